"""A ping-pong Gluon GEMM (each consumer warpgroup its own tiles) beside the family's default and cuBLAS, in one run.

Why: at 256-1024 tokens the family's gluon_ws kernel runs 0.87-0.92x of cuBLAS (benchmarks/RESULTS.md, twenty-third
and twenty-fourth runs). Its two consumer warpgroups share every tile (64 rows each), so both run their epilogue at
once and the tensor cores idle meanwhile; the producer can only prefetch. CUTLASS's Hopper "ping-pong" kernel gives
each warpgroup whole tiles of its own, in turn: one warpgroup's epilogue runs during the other's MMAs. Here the
producer loads a program's tiles in order into one ring of slots; warpgroup w takes the program's tiles w, w + 2,
...; a warpgroup starts on its tile once the other has seen every slot of the tile before (a turn barrier each, as
CUTLASS's ordered math barrier), so the two mainloops follow each other and each epilogue overlaps the other's MMAs.

The kernel: persistent (a program per SM), one producer warp (TMA loads of A (M, K) and W (N, K), nn.Linear's
weight), two consumer warpgroups each computing BLOCK_M x BLOCK_N tiles (64 or 128 rows: one or two wgmmas a K step),
C leaving in two halves through a TMA store. Data-parallel whole tiles, no epilogue; bf16.

    python benchmarks/prototypes/gluon_gemm_pingpong.py                  # on a Hopper GPU, ~1-2 min
    env -u TRITON_INTERPRET python benchmarks/prototypes/gluon_gemm_pingpong.py --compile-only   # any machine: sm90
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[1])]

# Registers a thread of the producer warp keeps (setmaxnreg); the consumers get the rest (as the family's kernel).
PRODUCER_REGS = gl.constexpr(24)
CONSUMER_REGS = gl.constexpr(232)
# (label, BLOCK_M, BLOCK_N, BLOCK_K, stages): a consumer's tile (its accumulator: 128 fp32 values a thread) and
# the ring, within the H200's 227 KB with both warpgroups' half-width C buffers.
TILES = (("pp 128x128 s5", 128, 128, 64, 5), ("pp 128x128 s6", 128, 128, 64, 6), ("pp 64x256 s4", 64, 256, 64, 4),
         ("pp 64x128 s8", 64, 128, 64, 8))
# Llama-3-8B and Qwen2.5-7B projections (N, K) at the token counts where the family trails cuBLAS most.
PROJECTIONS = (("llama qkv", 6144, 4096), ("llama o", 4096, 4096), ("llama down", 4096, 14336),
               ("qwen qkv", 4608, 3584), ("qwen o", 3584, 3584), ("qwen gate_up", 37888, 3584))
TOKENS = (256, 512, 1024)


@gluon.jit
def _tile_coords(tile, num_pid_m):
    # Row blocks fastest: the programs of a wave that share a weight tile read it from L2 together.
    return tile % num_pid_m, tile // num_pid_m


@gluon.jit
def _producer(a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              BLOCK_K: gl.constexpr, STAGES: gl.constexpr):
    num_pid_m = gl.cdiv(M, BLOCK_M)
    tiles = num_pid_m * gl.cdiv(N, BLOCK_N)
    k_tiles = gl.cdiv(K, BLOCK_K)
    i = 0
    for tile in range(gl.program_id(0), tiles, gl.num_programs(0)):
        pid_m, pid_n = _tile_coords(tile, num_pid_m)
        for kt in range(k_tiles):
            s = i % STAGES
            mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)  # a slot's first use passes at once
            mbarrier.expect(ready.index(s), a_desc.block_type.nbytes + b_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(a_desc, [pid_m * BLOCK_M, kt * BLOCK_K], ready.index(s), a_bufs.index(s))
            tma.async_copy_global_to_shared(b_desc, [pid_n * BLOCK_N, kt * BLOCK_K], ready.index(s), b_bufs.index(s))
            i += 1


@gluon.jit
def _consumer(WG: gl.constexpr, a_bufs, b_bufs, ready, empty, turn, c_desc, M, N, K, BLOCK_M: gl.constexpr,
              BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr):
    # The two warpgroups take the program's tiles in turn: a warpgroup starts waiting on its tile's slots once the
    # other has seen every slot of the tile before (turn). NOTE: the turns are what keeps the slots' barriers
    # right, not only an order: a warpgroup that waited on a slot a whole ring ahead of the producer would take the
    # completed phase of the ring before as its own (the parities repeat every other use of a slot).
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                     instr_shape=[16, BLOCK_N, 16])
    c_smem = gl.allocate_shared_memory(c_desc.dtype, c_desc.block_type.shape, c_desc.layout)
    num_pid_m = gl.cdiv(M, BLOCK_M)
    tiles = num_pid_m * gl.cdiv(N, BLOCK_N)
    k_tiles = gl.cdiv(K, BLOCK_K)
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    j = 0  # this warpgroup's tiles so far
    for tile in range(pid + WG * programs, tiles, 2 * programs):
        pid_m, pid_n = _tile_coords(tile, num_pid_m)
        i = (tile - pid) // programs * k_tiles  # this tile's first slot in the producer's sequence
        # The other warpgroup's previous tile has seen all its slots (the program's first tile waits for none).
        mbarrier.wait(turn.index(WG), (j + WG + 1) & 1, pred=(WG == 1) | (j > 0))
        acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout)
        for kt in range(k_tiles):
            s = i % STAGES
            mbarrier.wait(ready.index(s), (i // STAGES) & 1)
            acc = warpgroup_mma(a_bufs.index(s), b_bufs.index(s).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(1, deps=(acc, ))  # the previous K tile's MMAs are done: release its slot
            mbarrier.arrive(empty.index((i + STAGES - 1) % STAGES), count=1, pred=kt > 0)
            i += 1
        mbarrier.arrive(turn.index(1 - WG), count=1)  # every slot of this tile seen: the other's turn
        j += 1
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        mbarrier.arrive(empty.index((i + STAGES - 1) % STAGES), count=1)
        # C in two halves through one half-width buffer (the other warpgroup's MMAs run meanwhile).
        left, right = gl.split(gl.permute(gl.reshape(acc, [BLOCK_M, 2, BLOCK_N // 2]), (0, 2, 1)))
        tma.store_wait(0)  # this warpgroup's previous store has left c_smem
        c_smem.store(left.to(c_desc.dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(c_desc, [pid_m * BLOCK_M, pid_n * BLOCK_N], c_smem)
        tma.store_wait(0)
        c_smem.store(right.to(c_desc.dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(c_desc, [pid_m * BLOCK_M, pid_n * BLOCK_N + BLOCK_N // 2], c_smem)
    tma.store_wait(0)


@gluon.jit
def pingpong_kernel(a_desc, b_desc, c_desc, M, N, K, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                    BLOCK_K: gl.constexpr, num_warps: gl.constexpr, num_stages: gl.constexpr):
    gl.static_assert(num_warps == 4, "each partition is one warpgroup")
    gl.static_assert(a_desc.block_type.shape == [BLOCK_M, BLOCK_K], "a_desc's block is BLOCK_M x BLOCK_K")
    gl.static_assert(b_desc.block_type.shape == [BLOCK_N, BLOCK_K], "b_desc's block is BLOCK_N x BLOCK_K of W")
    gl.static_assert(c_desc.block_type.shape == [BLOCK_M, BLOCK_N // 2], "c_desc's block is half a tile")
    dtype: gl.constexpr = a_desc.dtype
    a_bufs = gl.allocate_shared_memory(dtype, [num_stages, BLOCK_M, BLOCK_K], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(dtype, [num_stages, BLOCK_N, BLOCK_K], b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [num_stages, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [num_stages, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(num_stages):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)  # one warpgroup reads each slot
    for w in gl.static_range(2):
        mbarrier.init(turn.index(w), count=1)  # warpgroup w's turn, given by the other
    gl.warp_specialize([
        (_consumer, (0, a_bufs, b_bufs, ready, empty, turn, c_desc, M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, num_stages)),
        (_consumer, (1, a_bufs, b_bufs, ready, empty, turn, c_desc, M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, num_stages)),
        (_producer, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, num_stages)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# --- host side ---------------------------------------------------------------------------------------------------
def descriptors(a, w, c, block_m: int, block_n: int, block_k: int) -> list:
    """Host-built TMA descriptors of a (M, K), w (N, K) and c (M, N) with the kernel's blocks."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    gl_dtype = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[a.dtype]
    out = []
    for t, block in ((a, [block_m, block_k]), (w, [block_n, block_k]), (c, [block_m, block_n // 2])):
        layout = gl.NVMMASharedLayout.get_default_for(block, gl_dtype)
        out.append(TensorDescriptor(t, list(t.shape), [t.stride(0), 1], block, layout))
    return out


def launch_args(a, w, c, block_m, block_n, block_k, stages, sm_count: int) -> tuple:
    """(grid, args, options) of one launch: a program per SM at most."""
    m, k = a.shape
    n = w.shape[0]
    tiles = -(-m // block_m) * -(-n // block_n)
    options = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, num_stages=stages)
    return (min(tiles, sm_count),), (*descriptors(a, w, c, block_m, block_n, block_k), m, n, k), options


def compile_all() -> list[dict]:
    """Cross-compile every tile for sm90 on CPU tensors: shared memory, spills (ptxas), global scratch."""
    from triton.backends.compiler import GPUTarget

    from autotile.xcompile import compile_kernel

    out = []
    for label, bm, bn, bk, stages in TILES:
        a, w = torch.empty(512, 4096, dtype=torch.bfloat16), torch.empty(4096, 4096, dtype=torch.bfloat16)
        c = torch.empty(512, 4096, dtype=torch.bfloat16)
        grid, args, options = launch_args(a, w, c, bm, bn, bk, stages, 132)
        compiled, _ = compile_kernel(pingpong_kernel, GPUTarget("cuda", 90, 32), args, options)
        out.append({"label": label, "shared": compiled.metadata.shared,
                    "scratch": compiled.metadata.global_scratch_size, "spills": _spills(compiled)})
    return out


def _spills(compiled) -> str:
    """What ptxas -v says of spills and serialised wgmmas (C7515-C7517), for sm90a."""
    import re
    import subprocess
    import tempfile

    import triton

    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as ptx:
        ptx.write(compiled.asm["ptx"])
        ptx.flush()
        report = subprocess.run([triton.knobs.nvidia.ptxas.path, "-arch=sm_90a", "-v", ptx.name, "-o", "/dev/null"],
                                capture_output=True, text=True, timeout=300).stderr
    spills = re.findall(r"(\d+) bytes spill stores", report)
    warnings = sorted(set(re.findall(r"C75\d\d", report)))
    return f"spill stores {spills}, wgmma warnings {warnings or 'none'}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compile-only", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    args = parser.parse_args()
    if args.compile_only:
        for built in compile_all():
            print(built, flush=True)
        return 0
    os.environ["AUTOTILE_VENDOR"] = "0"
    import triton
    from gemm_kernels_bench import interleaved

    from autotile.device import cuda_device
    from autotile.families.gemm import FAMILY, contiguous_problem
    from autotile.launch import bind_descriptors

    dev = cuda_device()
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, triton {triton.__version__}; x cuBLAS "
          f"(F.linear), L2 flushed, medians of {args.rounds} interleaved rounds; the family's kernels alone", flush=True)
    failures, ratios = 0, {}
    for tokens in (int(t) for t in args.tokens.split(",")):
        for label, n, k in PROJECTIONS:
            p = contiguous_problem(tokens, n, k, "bf16", "bf16", layout_b="col")
            inputs = FAMILY.make_inputs(p, dev, seed=1)
            outputs = FAMILY.allocate_outputs(p, inputs)
            a, w = inputs["a"], inputs["b"].t()  # w: the (N, K) weight
            want = torch.nn.functional.linear(a.float(), w.float())
            fns = {"cuBLAS": lambda a=a, w=w: torch.nn.functional.linear(a, w)}
            default = FAMILY.default_config(p, dev)
            fns["default"] = FAMILY.timed_call(p, default, inputs, outputs)
            for name, bm, bn, bk, stages in TILES:
                c = torch.empty(tokens, n, device="cuda", dtype=torch.bfloat16)
                grid, launch, options = launch_args(a, w, c, bm, bn, bk, stages, dev.sm_count)
                bound = bind_descriptors(pingpong_kernel, grid, *launch, **options)
                if bound is None:
                    print(f"  {name}: no bound launcher, skipped", flush=True)
                    continue
                launcher, encoders = bound
                encoded = [x for encode, t in zip(encoders, (a, w, c)) for x in encode(t)]
                rest = launch[len(encoders):]
                torch.cuda.synchronize()
                err = (c.float() - want).abs().max().item() / max(want.abs().max().item(), 1.0)
                if not err < 2e-2:
                    failures += 1
                    print(f"FAILED {tokens}x{n}x{k} {name}: relative error {err:.3g}", flush=True)
                    continue
                fns[name] = lambda launcher=launcher, encoded=encoded, rest=rest: launcher(*encoded, *rest)
            ms = interleaved(fns, args.rounds, 10, 60)
            row = {name: ms["cuBLAS"] / t for name, t in ms.items() if name != "cuBLAS"}
            for name, r in row.items():
                ratios.setdefault((tokens, name), []).append(r)
            print(f"{tokens}x{n}x{k} {label} (default {default['VARIANT']} {default['BLOCK_M']}x{default['BLOCK_N']}"
                  f" s{default['num_stages']}): " + ", ".join(f"{name} {r:.3f}x" for name, r in row.items()),
                  flush=True)
    for (tokens, name), values in sorted(ratios.items()):
        geo = float(torch.tensor(values).log().mean().exp())
        print(f"geomean {tokens} tokens {name}: {geo:.3f}x over {len(values)}, lowest {min(values):.3f}x", flush=True)
    print(f"{failures} failed checks")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
