"""gluon_ws GEMM configs re-timed in a fresh process beside the vendor op (5 interleaved rounds, medians of do_bench
medians; the family's kernels alone). Wrote results/gluon_gemm_2026-12-04_retime.txt (bf16, whole tiles) and
_retime_fp8.txt (fp8, whole tiles against stream-K). On a Hopper GPU:
    python benchmarks/prototypes/gluon_gemm_retime.py bf16
    python benchmarks/prototypes/gluon_gemm_retime.py fp8
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ["AUTOTILE_VENDOR"] = "0"
sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[1])]

import torch  # noqa: E402

from gemm_kernels_bench import interleaved  # noqa: E402

from autotile.device import cuda_device  # noqa: E402
from autotile.families.gemm import FAMILY, contiguous_problem  # noqa: E402
from autotile.families.gemm_policy import gluon_config  # noqa: E402

BF16_TILES = {"dp128": dict(BLOCK_N=128, BLOCK_K=64, num_stages=5), "dp256": dict(BLOCK_N=256, BLOCK_K=64, num_stages=3),
              "dp256 sub s4": dict(BLOCK_N=256, BLOCK_K=64, num_stages=4, EPILOGUE_SUBTILE=True)}


def timed(problem, fns: dict, inputs: dict, vendor) -> str:
    fns["vendor"] = vendor
    ms = interleaved(fns, 5, 10, 60)
    return ", ".join(f"{name} {ms['vendor'] / t:.3f}x" for name, t in ms.items() if name != "vendor")


def bf16(dev) -> None:
    for m, n, k in ((256, 6144, 4096), (512, 3584, 3584), (2048, 4096, 4096)):
        p = contiguous_problem(m, n, k, "bf16", "bf16", layout_b="col")
        inputs, space = FAMILY.make_inputs(p, dev, seed=1), FAMILY.space(p, dev)
        outputs = FAMILY.allocate_outputs(p, inputs)
        configs = {name: space.admit(gluon_config(p, **tiles)) for name, tiles in BF16_TILES.items()}
        configs["default"] = FAMILY.default_config(p, dev)
        fns = {name: (lambda c=c: FAMILY.launch(p, c, inputs, outputs)) for name, c in configs.items()}
        a, w = inputs["a"], inputs["b"].t()
        print(f"{m}x{n}x{k}: " + timed(p, fns, inputs, lambda: torch.matmul(a, w.t())), flush=True)


def fp8(dev) -> None:
    for size in (4096, 8192):
        for fast in (False, True):
            p = contiguous_problem(size, size, size, "fp8", "bf16", layout_b="col", fp8_fast_accum=fast)
            inputs, space = FAMILY.make_inputs(p, dev, seed=1), FAMILY.space(p, dev)
            outputs = FAMILY.allocate_outputs(p, inputs)
            tiles = dict(BLOCK_N=256, num_stages=3) if fast else dict(num_stages=4)
            configs = {s: space.admit(gluon_config(p, SCHEDULE=s, **tiles)) for s in ("data_parallel", "stream_k")}
            fns = {name: (lambda c=c: FAMILY.launch(p, c, inputs, outputs)) for name, c in configs.items()}
            a, b, sa, sb = inputs["a"], inputs["b"], inputs["scale_a"], inputs["scale_b"]
            vendor = lambda: torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16, use_fast_accum=fast)  # noqa: E731
            print(f"{size}^3 {'fast' if fast else 'precise'}: " + timed(p, fns, inputs, vendor), flush=True)


if __name__ == "__main__":
    {"bf16": bf16, "fp8": fp8}[sys.argv[1]](cuda_device())
