"""The GEMM family's Gluon variant (gluon_ws) beside the tma variant and the vendor op, on the H200.

For each shape: the vendor op (cuBLAS through torch.matmul, or torch._scaled_mm), the family's tma default (the
policy's Triton config), and gluon_ws configs of several tile shapes, each checked against float64 first, then
timed interleaved (medians of do_bench medians over rounds). The family's kernels alone (AUTOTILE_VENDOR=0).

    python benchmarks/gemm_gluon_bench.py --out results/gluon_gemm.md      # ~2 min on an H200
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

os.environ["AUTOTILE_VENDOR"] = "0"

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gemm_kernels_bench import check, interleaved, vendor_fns  # noqa: E402

from autotile.device import cuda_device  # noqa: E402
from autotile.families.gemm import FAMILY, contiguous_problem  # noqa: E402
from autotile.families.gemm_policy import gluon_config, prefill_config  # noqa: E402
from autotile.space import Config  # noqa: E402

# (label, problem, gluon_ws tiles to time)
FP8_TILES = [dict(num_stages=4), dict(num_stages=5)]
FAST_TILES = [dict(BLOCK_N=256, num_stages=3), dict(num_stages=5)]
BF16_TILES = [dict(BLOCK_M=64, BLOCK_K=64, num_stages=6), dict(BLOCK_K=64, num_stages=5),
              dict(BLOCK_N=256, BLOCK_K=64, num_stages=3)]


def shapes() -> list[tuple[str, object, list[dict]]]:
    out = []
    for size in (4096, 8192):
        for scale in ("tensor", "row"):
            out.append((f"fp8 precise {scale}", contiguous_problem(size, size, size, "fp8", "bf16", layout_b="col",
                                                                   scale_mode=scale), FP8_TILES))
        out.append(("fp8 fast", contiguous_problem(size, size, size, "fp8", "bf16", layout_b="col",
                                                   fp8_fast_accum=True), FAST_TILES))
    for m, n, k, label in [(128, 6144, 4096, "Llama-3-8B qkv"), (512, 4096, 14336, "Llama-3-8B down"),
                           (512, 28672, 4096, "Llama-3-8B gate_up"), (2048, 6144, 4096, "Llama-3-8B qkv"),
                           (3000, 5000, 1536, "irregular"), (4096, 4096, 4096, "square")]:
        out.append((f"bf16 {label}", contiguous_problem(m, n, k, "bf16", "bf16", layout_b="col"), BF16_TILES))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("gluon_gemm.md"))
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    device = cuda_device(0)
    import datetime

    import triton

    lines = [f"# gluon_ws beside the tma variant and the vendor op ({torch.cuda.get_device_name(0)})", "",
             f"{datetime.date.today().isoformat()}, torch {torch.__version__}, triton {triton.__version__}, "
             f"CUDA {torch.version.cuda}. Medians of do_bench medians over {args.rounds} interleaved rounds; the family's kernels alone "
             "(AUTOTILE_VENDOR=0); ratios are vendor time over ours.", "",
             "| shape | problem | vendor us | tma (prefill policy) | best gluon_ws | its tiles | all gluon_ws |",
             "|---|---|---|---|---|---|---|"]
    failures = 0
    for label, problem, tiles in shapes():
        inputs = FAMILY.make_inputs(problem, device, seed=11)
        reference = FAMILY.reference(problem, inputs)
        outputs = FAMILY.allocate_outputs(problem, inputs)
        space = FAMILY.space(problem, device)
        configs = {"tma default": space.admit(prefill_config(problem, device, gluon=False))}
        for t in tiles:
            config = space.admit(gluon_config(problem, **t))
            if config is not None:
                configs[f"gluon {config['BLOCK_M']}x{config['BLOCK_N']}x{config['BLOCK_K']} s{config['num_stages']}"] = config
        fns = {}
        for name, config in configs.items():
            if config is None:
                continue
            ok, _, message = check(problem, Config(config), inputs, reference)
            if not ok:
                failures += 1
                print(f"FAILED {label} {name}: {message}", flush=True)
                continue
            fns[name] = (lambda c=config: FAMILY.launch(problem, c, inputs, outputs))
        vendor = vendor_fns(problem, inputs)
        vendor_name = next(iter(vendor)) if problem.dtype != "fp8" else (
            "_scaled_mm fast" if problem.fp8_fast_accum else "_scaled_mm")
        fns[vendor_name] = vendor[vendor_name]
        ms = interleaved(fns, args.rounds, 10, 50)
        v = ms[vendor_name]
        gluon = {k: x for k, x in ms.items() if k.startswith("gluon")}
        best = min(gluon, key=gluon.get) if gluon else None
        tma = f"{v / ms['tma default']:.3f}x" if "tma default" in ms else "failed its check"
        row = (f"| {label} | {problem.m}x{problem.n}x{problem.k} | {v * 1e3:.1f} | {tma} | " + (f"{v / gluon[best]:.3f}x | {best[6:]} | " if best else "- | - | ")
               + ", ".join(f"{k[6:]} {v / x:.3f}x" for k, x in gluon.items()) + " |")
        print(row, flush=True)
        lines.append(row)
    lines += ["", f"{failures} failed checks"]
    args.out.write_text("\n".join(lines) + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
