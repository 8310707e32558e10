"""The GEMM family's gluon_ws kernel with TMA descriptors built on the host, beside the family's own (built on the
device at every launch, into scratch from Triton's allocator), timed cold and warm beside cuBLAS.

Why: at mid-sized M the family's Gluon kernel times erratically cold (L2 flushed before each call: 29.8-56.3 us
across runs at 512 x 3584 x 3584, results/gemm_mid_probe_2026-12-04{b,c,d}.txt) and steadily warm; cuBLAS passes its
descriptors as kernel parameters, and Triton's own benchmarks found host-built descriptors 4-8% faster on persistent
GEMMs (triton-lang/triton PR 6463). The host variant is the rendered kernel with its three make_tensor_descriptor
calls replaced by parameters (a source patch, as prototypes/gluon_flash_variants.py does); whole power-of-two tiles,
16-bit operands, B as W (N, K). Each variant's output is checked against the family's own launch first.

    python benchmarks/prototypes/gluon_gemm_host_desc.py            # on a Hopper GPU, ~1 min
    env -u TRITON_INTERPRET python benchmarks/prototypes/gluon_gemm_host_desc.py --compile-only   # any machine: sm90
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ["AUTOTILE_VENDOR"] = "0"
sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parent)]

import torch  # noqa: E402

from autotile.families.gemm import FAMILY, contiguous_problem  # noqa: E402
from autotile.families.gemm_launch import launch_plan  # noqa: E402
from autotile.families.gemm_policy import gluon_config  # noqa: E402
from autotile.render import _import_path, render_source, source_sha, write_to_cache  # noqa: E402
from autotile.space import Config  # noqa: E402

SHAPES = ((512, 3584, 3584), (512, 4608, 3584), (1024, 4608, 3584), (2048, 4096, 4096))
TILES = {"128x128 s5": dict(BLOCK_N=128, BLOCK_K=64, num_stages=5),
         "128x256 s3": dict(BLOCK_N=256, BLOCK_K=64, num_stages=3)}
# The rendered kernel's signature line after its pointers, and its three device-built descriptors.
_SIGNATURE = "    M, N, K,\n"
_DEVICE_BUILT = {
    "a_desc": "    a_desc = tma.make_tensor_descriptor(a_ptr, [M, K], [stride_am, 1], [BLOCK_M, BLOCK_K], a_layout)\n",
    "b_desc": "    b_desc = tma.make_tensor_descriptor(b_ptr, [N, K], [stride_bn, 1], [B_COLS, BLOCK_K], b_layout)\n",
    "c_desc": "    c_desc = tma.make_tensor_descriptor(c_ptr, [M, N], [stride_cm, 1], [WG_ROWS, C_COLS], c_layout)\n",
}


def host_desc_module(problem, config: Config, interpret: bool = False):
    """The family's rendered gluon_ws module with a_desc, b_desc and c_desc taken as parameters."""
    switches = FAMILY.render_switches(problem, config)
    if switches["WIDE_N"] or switches["EPILOGUE_SUBTILE"] or not switches["B_COL"] or problem.dtype == "fp8":
        raise ValueError("the host-descriptor patch covers whole power-of-two tiles of 16-bit operands, B as W (N, K)")
    source = render_source(FAMILY.template, **switches)
    assert source.count(_SIGNATURE) == 1, "the kernel's signature moved: update _SIGNATURE"
    source = source.replace(_SIGNATURE, "    a_host, b_host, c_host,\n" + _SIGNATURE)
    for name, line in _DEVICE_BUILT.items():
        assert source.count(line) == 1, f"{name} is no longer built as this patch expects: update _DEVICE_BUILT"
        source = source.replace(line, f"    {name} = {name[0]}_host\n")
    return _import_path(str(write_to_cache(source)), source_sha(source), interpret)


def host_descriptors(config, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> list:
    """TensorDescriptors of a (M, K), W = b.t() (N, K) and c (M, N) with the kernel's block shapes and layouts."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    gl_dtype = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}
    w = b.t()

    def desc(t, block):
        layout = gl.NVMMASharedLayout.get_default_for(block, gl_dtype[t.dtype])
        return TensorDescriptor(t, list(t.shape), [t.stride(0), 1], block, layout)

    return [desc(a, [config["BLOCK_M"], config["BLOCK_K"]]), desc(w, [config["BLOCK_N"], config["BLOCK_K"]]),
            desc(c, [64, config["BLOCK_N"]])]


def host_args(module, config, a, b, c, bias, residual, ws, counters, stream_k) -> list:
    """The patched kernel's arguments: the family's kernel_args with the descriptors after the pointers."""
    args = module.kernel_args(a, b, c, bias, residual, None, None, ws, counters, stream_k)
    first_int = next(i for i, x in enumerate(args) if not isinstance(x, torch.Tensor))
    args[first_int:first_int] = host_descriptors(config, a, b, c)
    return args


def host_launch(problem, config, inputs, outputs, device: torch.device):
    """(kernel, grid, args, constexprs) of one host-descriptor launch."""
    plan = launch_plan(FAMILY, problem, config, device)
    module = host_desc_module(problem, config, interpret=False)
    a, b, c = inputs["a"], inputs["b"], outputs["c"]
    ws = torch.empty(max(1, plan.workspace), dtype=torch.float32, device=device)
    counters = torch.zeros(max(1, plan.counters), dtype=torch.int32, device=device)
    args = host_args(module, config, a, b, c, inputs.get("bias"), inputs.get("residual"), ws, counters, plan.stream_k)
    return module.gemm_kernel, plan.grid, args, plan.constexprs


def compile_variants(shapes=SHAPES, tiles=TILES) -> list[dict]:
    """Cross-compile the host-descriptor variants for sm90 on CPU tensors (no GPU): the patch applies and the kernel
    builds. One dict a variant: shape, tiles, shared bytes, global scratch bytes."""
    from triton.backends.compiler import GPUTarget

    from autotile.device import planned_device
    from autotile.families.gemm_launch import _CONSTEXPRS
    from autotile.xcompile import compile_kernel

    h200 = planned_device("h200")
    out = []
    for m, n, k in shapes:
        p = contiguous_problem(m, n, k, "bf16", "bf16", layout_b="col")
        space = FAMILY.space(p, h200)
        for name, t in tiles.items():
            config = Config(space.admit(gluon_config(p, **t)))
            module = host_desc_module(p, config)
            a, b, c = (torch.empty(m, k, dtype=torch.bfloat16), torch.empty(n, k, dtype=torch.bfloat16).t(),
                       torch.empty(m, n, dtype=torch.bfloat16))
            _, _, _, stream_k = module.launch_geometry(m, n, k, config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"],
                                                       config["SPLIT_K"], config["PERSISTENT"], h200.sm_count)
            args = host_args(module, config, a, b, c, None, None, torch.empty(1), torch.empty(1, dtype=torch.int32),
                             stream_k)
            constexprs = {key: config.get(key, 1) for key in _CONSTEXPRS}
            compiled, _ = compile_kernel(module.gemm_kernel, GPUTarget("cuda", 90, 32), tuple(args), constexprs)
            out.append({"shape": [m, n, k], "tiles": name, "shared": compiled.metadata.shared,
                        "scratch": compiled.metadata.global_scratch_size})
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compile-only", action="store_true")
    if parser.parse_args().compile_only:
        for built in compile_variants():
            print(f"{built['shape']} {built['tiles']}: compiled for sm90, {built['shared']} B shared, "
                  f"global scratch {built['scratch']} B", flush=True)
        return 0
    import triton

    from gemm_mid_probe import timed_beside_cublas

    from autotile.device import cuda_device

    device = cuda_device(0)
    dev = torch.device("cuda", 0)
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, triton {triton.__version__}; x cuBLAS, cold "
          "(L2 flushed) / warm (a CUDA graph of 50 calls), medians of 5 interleaved rounds", flush=True)
    failures = 0
    for m, n, k in SHAPES:
        p = contiguous_problem(m, n, k, "bf16", "bf16", layout_b="col")
        inputs, space = FAMILY.make_inputs(p, device, seed=3), FAMILY.space(p, device)
        outputs = FAMILY.allocate_outputs(p, inputs)
        fns = {}
        for name, tiles in TILES.items():
            config = Config(space.admit(gluon_config(p, **tiles)))
            FAMILY.launch(p, config, inputs, outputs)
            expected = outputs["c"].clone()
            kernel, grid, args, constexprs = host_launch(p, config, inputs, outputs, dev)
            outputs["c"].fill_(float("nan"))
            kernel[grid](*args, **constexprs)
            torch.cuda.synchronize()
            if not torch.equal(outputs["c"], expected):
                failures += 1
                print(f"FAILED {m}x{n}x{k} {name}: host descriptors differ from the family's launch", flush=True)
                continue
            fns[f"device {name}"] = (lambda c=config: FAMILY.launch(p, c, inputs, outputs))
            fns[f"host {name}"] = (lambda kn=kernel, g=grid, a=args, ce=constexprs: kn[g](*a, **ce))
        timed_beside_cublas(p, inputs, fns, 5)
    print(f"{failures} failed checks")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
