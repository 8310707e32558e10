"""A/B of the Gluon backward's TMA descriptors: built in every program (the family's) against built once on the host
and passed as kernel parameters (this script's source patch of the rendered templates/flash_gluon_bwd.py.j2).

Why: with %globaltimer stamps (flash_bwd_tile_clock.py; results/flash_bwd_tile_clock_2026-12-04.txt) an SM spent
~7 us between one program's end and the next one's start (4 tiles a program at 2 x 32 x 4096), against ~2.3 us a
step. Each program builds seven descriptors (Q, dO, K, V, LSE, Delta, the fp32 dQ) into global scratch and fences
them before its first TMA. The forward's host-built descriptors gained 1-6% on short calls (RESULTS.md, twenty-fourth
run). Dense calls with one program a tile (SPLIT == 1) only; the preprocess and dQ's cast are the family's.
On a Hopper GPU (checks each variant's gradients against plain torch in fp32, then times both beside cuDNN):
    PYTHONPATH=. python benchmarks/prototypes/flash_bwd_host_desc.py [--shapes LABEL,...]
On a CPU, --compile-only checks that the patched kernel compiles for sm90 with no launch scratch (the family's build
takes 896 B a launch: seven 128-byte descriptors).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from autotile import render  # noqa: E402
from autotile.families.flash import FAMILY, GLUON_WS, FlashProblem  # noqa: E402
from autotile.families.flash_reference import default_scale  # noqa: E402

SHAPES = {
    "4x32x2048": FlashProblem("bwd", 4, 32, 32, 2048, 2048, 128),
    "2x32x4096 causal": FlashProblem("bwd", 2, 32, 32, 4096, 4096, 128, causal=True),
    "16x32x512 causal": FlashProblem("bwd", 16, 32, 32, 512, 512, 128, causal=True),
    "Llama-3-8B 16x512": FlashProblem("bwd", 16, 32, 8, 512, 512, 128, causal=True),
    "Llama-3-8B 1x4096": FlashProblem("bwd", 1, 32, 8, 4096, 4096, 128, causal=True),
    "D64 4x32x2048 causal": FlashProblem("bwd", 4, 32, 32, 2048, 2048, 64, causal=True),
}
CONFIG = dict(LOADS=GLUON_WS, BLOCK_M1=64, BLOCK_N1=128, BLOCK_M2=64, BLOCK_N2=128, num_warps=4, num_stages=2)
NAMES = ("q", "do", "k", "v", "lse", "delta", "dq")  # the kernel's descriptors, as it names them (NAME_desc)


def _statement_end(source: str, start: int) -> int:
    """The index past the statement that starts at `start` and ends where its parentheses close."""
    depth, at = 0, source.index("(", start)
    while True:
        depth += {"(": 1, ")": -1}.get(source[at], 0)
        at += 1
        if depth == 0:
            return source.index("\n", at) + 1


def patch(source: str) -> str:
    """The kernel takes its seven descriptors as leading parameters (host_NAME) instead of building them."""
    kernel = "def attn_bwd_gluon(q_ptr,"
    assert source.count(kernel) == 1
    source = source.replace(kernel, "def attn_bwd_gluon(" + ", ".join(f"host_{n}" for n in NAMES) + ", q_ptr,")
    for name in NAMES:
        start = source.index(f"    {name}_desc = tma.make_tensor_descriptor(")
        source = source[:start] + f"    {name}_desc = host_{name}\n" + source[_statement_end(source, start):]
    return source


def patched_module(problem):
    source = patch(render.render_source(FAMILY.template, **FAMILY.render_switches(problem, CONFIG)))
    path = render.write_to_cache(source)
    return render._import_path(str(path), render.source_sha(source), False)


def host_descriptors(problem, q, do, k, v, lse_pad, delta_pad, dq_acc) -> list:
    """The seven descriptors as the family's kernel builds them (dense: (B, H, S, D) views, boxes BLOCK_D wide)."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    bd, dtype = problem.block_d, gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16
    dq_cols = bd if bd <= 64 else bd // 2

    def rows(t, block_rows):
        block = [1, 1, block_rows, bd]
        return TensorDescriptor(t, list(t.shape), list(t.stride()), block,
                                gl.NVMMASharedLayout.get_default_for(block, dtype))
    stat_layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)
    stats = [TensorDescriptor(t, [t.numel()], [1], [64], stat_layout) for t in (lse_pad, delta_pad)]
    dq_block = [64, dq_cols]
    dq = TensorDescriptor(dq_acc, [dq_acc.numel() // bd, bd], [bd, 1], dq_block,
                          gl.NVMMASharedLayout.get_default_for(dq_block, gl.float32))
    return [rows(q, 64), rows(do, 64), rows(k, 128), rows(v, 128), *stats, dq]


def host_call(problem, inputs, outputs, module):
    """The family's plan (preprocess, dQ's cast, scalars, grid), its main kernel swapped for the patched one."""
    from autotile.launch import launch

    plan = FAMILY.plan(problem, CONFIG, inputs, outputs, scale=default_scale(problem.head_dim))
    assert plan.reduce is None, "one program a tile (SPLIT == 1) only"
    q, k, v, o, do, lse = (inputs[n] for n in ("q", "k", "v", "o", "do", "lse"))
    dq, dk, dv = (outputs[n] for n in ("dq", "dk", "dv"))
    scratch = torch.empty(plan.scratch_size, dtype=torch.float32, device=q.device).split(plan.scratch_parts)
    lse_pad, delta_pad, dq_acc = scratch[:3]
    descriptors = host_descriptors(problem, q, do, k, v, lse_pad, delta_pad, dq_acc)
    main = plan.main

    def call():
        plan.preprocess(o, do, lse, lse, lse, lse_pad, delta_pad, dq_acc)
        launch(module.attn_bwd_gluon, main.grid, *descriptors, q, k, v, do, lse_pad, delta_pad, dq_acc, dk, dv, lse,
               lse, *main.scalars, **main.options)
        plan.dq_cast(dq_acc, lse, dq)
    return call


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--compile-only", action="store_true")
    args = parser.parse_args()
    wanted = [w for w in args.shapes.split(",") if w]
    shapes = {k: p for k, p in SHAPES.items() if not wanted or any(w in k for w in wanted)}
    if args.compile_only:
        from autotile import xcompile
        from autotile.device import meta_stands_for, planned_device
        from autotile.launch import compile_instead

        h200 = planned_device("h200")
        for label, problem in shapes.items():
            inputs = xcompile.meta_inputs(FAMILY, problem)
            outputs = FAMILY.allocate_outputs(problem, inputs)
            collector = xcompile._Collector(h200)
            with meta_stands_for(h200), compile_instead(collector):
                host_call(problem, inputs, outputs, patched_module(problem))()
            build = next(k for k in collector.kernels if k.name == "attn_bwd_gluon")
            print(f"{label}: compiled for sm90, shared {build.shared}, launch scratch {build.global_scratch} B, "
                  f"key-loop spills {build.mma_loop_spills}")
        return 0
    import datetime

    import triton

    from autotile.device import cuda_device
    from flash_bench import kernel_call, sdpa_calls
    from flash_bwd_bench import gradient_error, timed_cells

    device = cuda_device()
    print(f"# descriptors built in each program (family) or on the host (patched), {datetime.date.today()}, "
          f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; TFLOP/s (x cuDNN)",
          flush=True)
    for label, problem in shapes.items():
        inputs = FAMILY.make_inputs(problem, device, seed=0)
        outputs = FAMILY.allocate_outputs(problem, inputs)
        host = host_call(problem, inputs, outputs, patched_module(problem))
        host()
        torch.cuda.synchronize()
        print(f"  {label} host descriptors: {gradient_error(problem, inputs, outputs)}", flush=True)
        fns = {"family": kernel_call(problem, CONFIG, inputs), "host descriptors": host}
        fns.update({name: f for name, f in sdpa_calls(problem, inputs).items() if "cuDNN" in name})
        print(f"{label}: {timed_cells(problem, fns, args.rounds, digits=3)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
