"""The GEMM family's Gluon variant (gluon_ws) beside the tma variant and the vendor op, on the H200.

For each shape: the vendor op (cuBLAS through torch.matmul, or torch._scaled_mm), the family's tma default (the
policy's Triton config), and gluon_ws configs of several tile shapes, each checked against float64 first, then
timed interleaved (medians of do_bench medians over rounds). The family's kernels alone (AUTOTILE_VENDOR=0).

    python benchmarks/gemm_gluon_bench.py --out results/gluon_gemm.md      # ~2 min on an H200
    python benchmarks/gemm_gluon_bench.py --set bf16 --out results/gluon_gemm_bf16.md  # LLM projections, both schedules
    python benchmarks/gemm_gluon_bench.py --set parts --out results/gluon_gemm_parts.md  # two-part tile widths
    python benchmarks/gemm_gluon_bench.py --set pingpong --out results/gluon_gemm_pingpong.md  # ping-pong consumers
"""
from __future__ import annotations

import argparse
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
DP = dict(SCHEDULE="data_parallel")
# --set bf16: both schedules, and 128 x 256 tiles on four stages beside C staged in halves.
BF16_SCHEDULE_TILES = [dict(BLOCK_N=256, BLOCK_K=64, num_stages=3), dict(BLOCK_N=256, BLOCK_K=64, num_stages=3, **DP),
                       dict(BLOCK_N=256, BLOCK_K=64, num_stages=4, EPILOGUE_SUBTILE=True, **DP),
                       dict(BLOCK_K=64, num_stages=5), dict(BLOCK_K=64, num_stages=5, **DP),
                       dict(BLOCK_K=64, num_stages=6, EPILOGUE_SUBTILE=True, **DP),
                       dict(BLOCK_M=64, BLOCK_N=256, BLOCK_K=64, num_stages=4, **DP),
                       dict(BLOCK_M=64, BLOCK_K=64, num_stages=6, **DP)]
SPLIT = dict(SCHEDULE="split_k")
# --set tail: shapes whose whole tiles leave the last wave part-empty; whole tiles against the tail split over K.
TAIL_TILES = [dict(BLOCK_N=256, BLOCK_K=64, num_stages=3, **DP), dict(BLOCK_K=64, num_stages=5, **DP)] + [
    dict(BLOCK_N=256, BLOCK_K=64, num_stages=3, SPLIT_K=s, **SPLIT) for s in (2, 3, 4, 6, 8)] + [
    dict(BLOCK_K=64, num_stages=5, SPLIT_K=s, **SPLIT) for s in (2, 3, 4)]
TAIL_SHAPES = [(2048, 4608, 3584, "Qwen2.5-7B qkv"), (4096, 4608, 3584, "Qwen2.5-7B qkv"),
               (1024, 4608, 3584, "Qwen2.5-7B qkv"), (512, 4608, 3584, "Qwen2.5-7B qkv"),
               (2048, 3584, 3584, "Qwen2.5-7B o"), (1024, 3584, 3584, "Qwen2.5-7B o"), (512, 3584, 3584, "Qwen2.5-7B o"),
               (512, 6144, 4096, "Llama-3-8B qkv"), (256, 6144, 4096, "Llama-3-8B qkv"), (3000, 5000, 1536, "irregular")]
# --set wide: 192-column tiles (WIDE_N) beside 128 and 256, where 192 divides N or fills the waves better.
WIDE_TILES = [dict(BLOCK_N=256, BLOCK_K=64, num_stages=3, **DP), dict(BLOCK_K=64, num_stages=5, **DP),
              dict(BLOCK_N=192, BLOCK_K=64, num_stages=4, **DP), dict(BLOCK_N=192, BLOCK_K=64, num_stages=3, **DP)]
WIDE_SHAPES = [(512, 6144, 4096, "Llama-3-8B qkv"), (2048, 4608, 3584, "Qwen2.5-7B qkv"),
               (4096, 4608, 3584, "Qwen2.5-7B qkv"), (2048, 6144, 4096, "Llama-3-8B qkv"),
               (1024, 6144, 4096, "Llama-3-8B qkv"), (3000, 5000, 1536, "irregular")]
# --set parts: two-part widths (96 = 64 + 32, 144 = 128 + 16, 160 = 128 + 32, 192 = 128 + 64) on shapes whose N they
# divide into 32 tiles a row, beside the power-of-two tiles; (tokens, N, K, label, width).
PARTS_SHAPES = [(512, 4608, 3584, "Qwen2.5-7B qkv", 144), (1024, 4608, 3584, "Qwen2.5-7B qkv", 144),
                (2048, 4608, 3584, "Qwen2.5-7B qkv", 144), (4096, 4608, 3584, "Qwen2.5-7B qkv", 144),
                (1024, 5120, 5120, "Mistral-Nemo-12B o", 160), (2048, 5120, 5120, "Mistral-Nemo-12B o", 160),
                (1024, 3072, 3072, "Phi-3-mini o", 96), (2048, 3072, 3072, "Phi-3-mini o", 96),
                (256, 4608, 3584, "Qwen2.5-7B qkv", 144), (256, 6144, 4096, "Llama-3-8B qkv", 192)]


def parts_tiles(m: int, width: int) -> list[dict]:
    tiles = [dict(BLOCK_K=64, num_stages=5, **DP), dict(BLOCK_N=256, BLOCK_K=64, num_stages=3, **DP),
             dict(BLOCK_N=width, BLOCK_K=64, num_stages=4, **DP)]
    if width < 192:
        tiles.append(dict(BLOCK_N=width, BLOCK_K=64, num_stages=5, **DP))
    if m <= 512:  # 64-row tiles: one consumer warpgroup, twice the tiles
        tiles.append(dict(BLOCK_M=64, BLOCK_N=width, BLOCK_K=64, num_stages=6, **DP))
    return tiles


# --set pingpong: two consumer warpgroups with whole tiles of their own, taking the tensor cores in turn, beside the
# family's default (cooperative: both warpgroups on one tile). A warpgroup's tile holds at most 128 fp32 sums a thread.
PP = dict(SCHEDULE="pingpong")
PINGPONG_BF16_TILES = [dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_stages=5, **PP),
                       dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_stages=6, EPILOGUE_SUBTILE=True, **PP),
                       dict(BLOCK_M=64, BLOCK_N=256, BLOCK_K=64, num_stages=4, **PP),
                       dict(BLOCK_M=64, BLOCK_N=256, BLOCK_K=64, num_stages=4, EPILOGUE_SUBTILE=True, **PP)]
PINGPONG_PRECISE_TILES = [dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, num_stages=6, **PP)]
PINGPONG_FAST_TILES = [dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_stages=5, **PP),
                       dict(BLOCK_M=64, BLOCK_N=256, BLOCK_K=128, num_stages=4, **PP)]
PINGPONG_SHAPES = [(2048, 6144, 4096, "Llama-3-8B qkv"), (2048, 4096, 4096, "Llama-3-8B o"),
                   (2048, 28672, 4096, "Llama-3-8B gate_up"), (2048, 4096, 14336, "Llama-3-8B down"),
                   (2048, 4608, 3584, "Qwen2.5-7B qkv"), (4096, 4608, 3584, "Qwen2.5-7B qkv"),
                   (2048, 9216, 3072, "Phi-3-mini qkv"), (8192, 4096, 14336, "Mistral-7B down"),
                   (3000, 5000, 1536, "irregular"), (1024, 6144, 4096, "Llama-3-8B qkv"),
                   (512, 28672, 4096, "Llama-3-8B gate_up"), (512, 3584, 3584, "Qwen2.5-7B o")]
FP8_SCHEDULE_TILES = [dict(num_stages=4), dict(num_stages=4, **DP), dict(num_stages=5, EPILOGUE_SUBTILE=True, **DP)]
FAST_SCHEDULE_TILES = [dict(BLOCK_N=256, num_stages=3), dict(BLOCK_N=256, num_stages=3, **DP),
                       dict(BLOCK_N=256, num_stages=4, EPILOGUE_SUBTILE=True, **DP)]
# nn.Linear projections (tokens x out x in) of Llama-3-8B, Qwen2.5-7B and Mistral-7B, prefill and mid-sized.
BF16_PROJECTIONS = [
    (2048, 6144, 4096, "Llama-3-8B qkv"), (2048, 4096, 4096, "Llama-3-8B o"), (2048, 28672, 4096, "Llama-3-8B gate_up"),
    (2048, 4096, 14336, "Llama-3-8B down"), (2048, 4608, 3584, "Qwen2.5-7B qkv"), (2048, 3584, 18944, "Qwen2.5-7B down"),
    (4096, 6144, 4096, "Llama-3-8B qkv"), (8192, 4096, 14336, "Mistral-7B down"), (3000, 5000, 1536, "irregular"),
    (512, 6144, 4096, "Llama-3-8B qkv"), (512, 28672, 4096, "Llama-3-8B gate_up"), (512, 4096, 14336, "Llama-3-8B down"),
    (256, 6144, 4096, "Llama-3-8B qkv"), (256, 37888, 3584, "Qwen2.5-7B gate_up"), (128, 4608, 3584, "Qwen2.5-7B qkv"),
]


def _fp8_squares(precise_tiles: list[dict], fast_tiles: list[dict]) -> list[tuple[str, object, list[dict]]]:
    """fp8 at 4096^3 and 8192^3, precise (tensor scales) and fast, with the tiles to time for each."""
    out = []
    for size in (4096, 8192):
        out.append(("fp8 precise tensor", contiguous_problem(size, size, size, "fp8", "bf16", layout_b="col"),
                    precise_tiles))
        out.append(("fp8 fast", contiguous_problem(size, size, size, "fp8", "bf16", layout_b="col",
                                                   fp8_fast_accum=True), fast_tiles))
    return out


def shapes(which: str = "all") -> list[tuple[str, object, list[dict]]]:
    out = []
    if which == "bf16":
        for m, n, k, label in BF16_PROJECTIONS:
            out.append((f"bf16 {label}", contiguous_problem(m, n, k, "bf16", "bf16", layout_b="col"),
                        BF16_SCHEDULE_TILES))
        return out
    if which == "wide":
        return [(f"bf16 {label}", contiguous_problem(m, n, k, "bf16", "bf16", layout_b="col"), WIDE_TILES)
                for m, n, k, label in WIDE_SHAPES]
    if which == "parts":
        return [(f"bf16 {label}", contiguous_problem(m, n, k, "bf16", "bf16", layout_b="col"), parts_tiles(m, width))
                for m, n, k, label, width in PARTS_SHAPES]
    if which == "tail":
        return [(f"bf16 {label}", contiguous_problem(m, n, k, "bf16", "bf16", layout_b="col"), TAIL_TILES)
                for m, n, k, label in TAIL_SHAPES]
    if which == "pingpong":
        return [(f"bf16 {label}", contiguous_problem(m, n, k, "bf16", "bf16", layout_b="col"), PINGPONG_BF16_TILES)
                for m, n, k, label in PINGPONG_SHAPES] + _fp8_squares(PINGPONG_PRECISE_TILES, PINGPONG_FAST_TILES)
    if which == "fp8":
        return _fp8_squares(FP8_SCHEDULE_TILES, FAST_SCHEDULE_TILES)
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


def checked_launches(problem, configs: dict, inputs: dict, reference: dict, outputs: dict,
                     label: str) -> tuple[dict, int]:
    """({name: a launch of that config into `outputs`} for the configs that pass their check, failed checks)."""
    fns, failures = {}, 0
    for name, config in configs.items():
        ok, _, message = check(problem, Config(config), inputs, reference)
        if not ok:
            failures += 1
            print(f"FAILED {label} {name}: {message}", flush=True)
            continue
        fns[name] = (lambda c=config: FAMILY.launch(problem, c, inputs, outputs))
    return fns, failures


def config_name(config) -> str:
    schedule = {"data_parallel": "dp", "stream_k": "sk", "split_k": f"split{config['SPLIT_K']}",
                "pingpong": "pp"}[config["SCHEDULE"]]
    sub = " sub" if config.get("EPILOGUE_SUBTILE") else ""
    return (f"gluon {config['BLOCK_M']}x{config['BLOCK_N']}x{config['BLOCK_K']} s{config['num_stages']} "
            f"{schedule}{sub}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("gluon_gemm.md"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--set", choices=("all", "bf16", "fp8", "tail", "wide", "parts", "pingpong"), default="all",
                        help="bf16: LLM projections under both schedules; fp8: 4096^3 and 8192^3 under both; "
                        "tail: part-empty last waves, whole tiles against the tail split over K; "
                        "wide: 192-column tiles beside 128 and 256; parts: 96-, 144-, 160- and 192-column tiles where "
                        "they divide N; pingpong: two consumer warpgroups with tiles of their own, beside the default")
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
    for label, problem, tiles in shapes(args.set):
        inputs = FAMILY.make_inputs(problem, device, seed=11)
        reference = FAMILY.reference(problem, inputs)
        outputs = FAMILY.allocate_outputs(problem, inputs)
        space = FAMILY.space(problem, device)
        configs = {"tma default": space.admit(prefill_config(problem, device, gluon=False))}
        default = FAMILY.default_config(problem, device)
        if dict(default) != dict(configs["tma default"] or {}):
            configs["family default"] = default
        for t in tiles:
            # One row of tiles: the grouped order has nothing to group.
            config = space.admit(gluon_config(problem, **t)) or space.admit(gluon_config(problem, **t, GROUP_M=1))
            if config is not None:
                configs[config_name(config)] = config
            else:
                print(f"infeasible for {label}: {t}: {space.violations(gluon_config(problem, **t))}", flush=True)
        fns, failed = checked_launches(problem, {n: c for n, c in configs.items() if c is not None}, inputs,
                                       reference, outputs, label)
        failures += failed
        vendor = vendor_fns(problem, inputs)
        vendor_name = next(iter(vendor)) if problem.dtype != "fp8" else (
            "_scaled_mm fast" if problem.fp8_fast_accum else "_scaled_mm")
        fns[vendor_name] = vendor[vendor_name]
        ms = interleaved(fns, args.rounds, 10, 50)
        v = ms[vendor_name]
        gluon = {k: x for k, x in ms.items() if k.startswith("gluon")}
        best = min(gluon, key=gluon.get) if gluon else None
        tma = f"{v / ms['tma default']:.3f}x" if "tma default" in ms else "failed its check"
        if "family default" in ms:
            tma += f" (family default {v / ms['family default']:.3f}x)"
        row = (f"| {label} | {problem.m}x{problem.n}x{problem.k} | {v * 1e3:.1f} | {tma} | " + (f"{v / gluon[best]:.3f}x | {best[6:]} | " if best else "- | - | ")
               + ", ".join(f"{k[6:]} {v / x:.3f}x" for k, x in gluon.items()) + " |")
        print(row, flush=True)
        lines.append(row)
    lines += ["", f"{failures} failed checks"]
    args.out.write_text("\n".join(lines) + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
