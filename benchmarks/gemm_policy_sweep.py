"""Which of the gemm family's untuned configs wins where: mid-M and prefill LLM projections, every candidate timed.

Run from the repository root on a CUDA machine:
    python benchmarks/gemm_policy_sweep.py --out OUT/gemm_policy_sweep.md     # ~3 min on an H200
    python benchmarks/gemm_policy_sweep.py --plan                              # list the work (no GPU)

gemm_kernels_bench.py reports the policy's default and the best of its first seeds; this script times every
candidate, so that the policy's rules (gemm_policy.py: the weight-streaming kernel up to STREAM_MAX_M tokens,
tile shapes and schedules above) can be set from measurements. Shapes: Llama-3-8B and Qwen2.5-7B projections
at M = 64, 256 and 2048 (--tokens), and 3000 x 5000 x 1536 (bf16, weights in nn.Linear layout). Candidates per
shape: the default, every seed, and variations of the weight-streaming kernel (M <= 64: stages, K tile, N tile,
warps) or of the prefill tiles (schedule, persistence, tile shape). Each candidate is checked against the
float64 reference, then all are timed interleaved with cuBLAS (torch.matmul(x, w.t())): one screening round,
then the best four, the default and cuBLAS over --rounds rounds; medians of do_bench medians. Kernels are
compiled first by a pool of CPU processes (gemm_kernels_bench.compile_ahead). Markdown to --out, JSON beside it.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]

import gemm_kernels_bench as gkb  # noqa: E402  (shapes, compile pool, checks, timing, vendor op, labels)

from autotile.device import resolve_gpu  # noqa: E402
from autotile.families.base import next_pow2  # noqa: E402
from autotile.families.gemm import FAMILY, contiguous_problem  # noqa: E402
from autotile.families.gemm_policy import (  # noqa: E402
    MID_MAX_M, ONE_WAVE_MID_TILES, STREAM_MAX_M, best_split, filling_split,
)
from autotile.families.gemm_space import SWAP_MAX_M  # noqa: E402
from autotile.space import Config  # noqa: E402

MODELS_SWEPT = ("llama3-8b", "qwen2.5-7b")
TOKENS = (64, 256, 2048)
FINALISTS = 4

# Variations of the policy's default, per regime (keys replaced; the split is re-chosen for streaming tiles).
STREAMING_VARIATIONS = (
    dict(num_stages=3), dict(num_stages=5), dict(BLOCK_K=64, num_stages=6), dict(BLOCK_N=128),
    dict(BLOCK_N=128, num_stages=3), dict(num_warps=8), dict(BLOCK_K=256, num_stages=3),
)
TILED_VARIATIONS = (
    dict(SCHEDULE="data_parallel", SPLIT_K=1),
    dict(VARIANT="tma", PERSISTENT=True, SCHEDULE="data_parallel", SPLIT_K=1, BLOCK_M=128, BLOCK_N=256, BLOCK_K=64,
         num_warps=8, num_stages=3, GROUP_M=8),
    dict(VARIANT="tma", PERSISTENT=True, SCHEDULE="data_parallel", SPLIT_K=1, BLOCK_M=128, BLOCK_N=128, BLOCK_K=64,
         num_warps=8, num_stages=4, GROUP_M=8),
    dict(VARIANT="tma", PERSISTENT=False, SCHEDULE="data_parallel", SPLIT_K=1, BLOCK_M=128, BLOCK_N=128, BLOCK_K=64,
         num_warps=4, num_stages=4, GROUP_M=8),
    dict(VARIANT="tma", PERSISTENT=True, SCHEDULE="data_parallel", SPLIT_K=1, BLOCK_M=128, BLOCK_N=256, BLOCK_K=64,
         num_warps=8, num_stages=3, GROUP_M=8, WARP_SPECIALIZE=True),
    dict(VARIANT="blocked", PERSISTENT=False, SCHEDULE="data_parallel", SPLIT_K=1, BLOCK_M=64, BLOCK_N=128, BLOCK_K=64,
         num_warps=4, num_stages=4, GROUP_M=8, SWAP_AB=False, FLATTEN=False, WARP_SPECIALIZE=False),
    # C stored in halves: the staging buffer's 32 KB freed for a fourth stage of 128 x 256 x 64 tiles.
    dict(VARIANT="tma", PERSISTENT=True, SCHEDULE="data_parallel", SPLIT_K=1, BLOCK_M=128, BLOCK_N=256, BLOCK_K=64,
         num_warps=8, num_stages=4, GROUP_M=8, EPILOGUE_SUBTILE=True),
    dict(VARIANT="tma", PERSISTENT=True, SCHEDULE="data_parallel", SPLIT_K=1, BLOCK_M=128, BLOCK_N=256, BLOCK_K=64,
         num_warps=8, num_stages=3, GROUP_M=8, EPILOGUE_SUBTILE=True),
    dict(VARIANT="tma", PERSISTENT=True, SCHEDULE="data_parallel", SPLIT_K=1, BLOCK_M=128, BLOCK_N=256, BLOCK_K=64,
         num_warps=8, num_stages=4, GROUP_M=8, EPILOGUE_SUBTILE=True, WARP_SPECIALIZE=True),
)
# Mid M (STREAM_MAX_M < M <= MID_MAX_M) also tries tiles that hold more of the tokens, split over K until the
# programs fill the SMs (SPLIT_K "fill": filling_split), so that the weight is read fewer times.
_SPLIT = dict(SCHEDULE="split_k", SPLIT_K="fill", PERSISTENT=False, SWAP_AB=False, FLATTEN=False, GROUP_M=8)
MID_VARIATIONS = (
    dict(_SPLIT, VARIANT="tma", BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=4),
    dict(_SPLIT, VARIANT="tma", BLOCK_M=256, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3),
    dict(_SPLIT, VARIANT="tma", BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=3),
    dict(_SPLIT, VARIANT="blocked", BLOCK_M=64, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=3),
    dict(_SPLIT, VARIANT="blocked", BLOCK_M=128, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=4),
    # The policy's one-wave TMA tiles (gemm_policy.ONE_WAVE_MID_TILES) everywhere, unsplit and as stream-K (whole
    # tiles for the full waves, the rest spread over the GPU: the untried remedy where they take 1-2 waves), and the
    # pointer-loaded tiles on 3 stages (3 programs an SM).
    *(dict(_SPLIT, SCHEDULE=schedule, SPLIT_K=1, VARIANT="tma", **tiles)
      for schedule in ("data_parallel", "stream_k") for tiles in ONE_WAVE_MID_TILES),
    dict(_SPLIT, SCHEDULE="data_parallel", SPLIT_K=1, VARIANT="blocked", BLOCK_M=64, BLOCK_N=128, BLOCK_K=64,
         num_warps=4, num_stages=3),
)
# Up to SWAP_MAX_M tokens, decode's weight-streaming kernel with every token in one swapped tile (BLOCK_M, the
# MMA's N side, set to the tokens' next power of two), split over K to fill the SMs.
_STREAM = dict(_SPLIT, VARIANT="blocked", SWAP_AB=True, GROUP_M=1)
WIDE_STREAMING_VARIATIONS = (
    dict(_STREAM, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4),
    dict(_STREAM, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3),
    dict(_STREAM, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=5),
    dict(_STREAM, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3),
    dict(_STREAM, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=4),
    dict(_STREAM, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=3),
    dict(_STREAM, BLOCK_N=64, BLOCK_K=64, num_warps=8, num_stages=4),
)


# fp8 with precise accumulation: the two-level accumulation drains the MMA pipeline at every promotion, so these
# try tiles small enough for 2-3 programs per SM (one program's drain overlaps another's MMAs) and longer K tiles.
_FP8 = dict(VARIANT="tma", SCHEDULE="data_parallel", SPLIT_K=1, SWAP_AB=False, FLATTEN=False, WARP_SPECIALIZE=False,
            GROUP_M=8)
FP8_VARIATIONS = (
    dict(_FP8, PERSISTENT=False, BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=4, PROMOTE_TILES=2),
    dict(_FP8, PERSISTENT=False, BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=3, PROMOTE_TILES=2),
    dict(_FP8, PERSISTENT=False, BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=5, PROMOTE_TILES=4),
    dict(_FP8, PERSISTENT=False, BLOCK_M=128, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4, PROMOTE_TILES=2),
    dict(_FP8, PERSISTENT=False, BLOCK_M=64, BLOCK_N=256, BLOCK_K=128, num_warps=8, num_stages=3, PROMOTE_TILES=2),
    dict(_FP8, PERSISTENT=True, BLOCK_M=128, BLOCK_N=128, BLOCK_K=256, num_warps=8, num_stages=3, PROMOTE_TILES=1),
    dict(_FP8, PERSISTENT=True, BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=3, PROMOTE_TILES=2,
         WARP_SPECIALIZE=True),
    dict(_FP8, PERSISTENT=True, BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=4, PROMOTE_TILES=2,
         GROUP_M=16),
)


# fp8 with fast accumulation (one accumulator, as bf16): Triton's persistent TMA tutorial's 128 x 256 x 128 tiles,
# with C stored in halves for a fourth stage, warp-specialised, and wider groups.
_FP8_FAST = dict(_FP8, PERSISTENT=True, BLOCK_M=128, BLOCK_N=256, BLOCK_K=128, num_warps=8)
FP8_FAST_VARIATIONS = (
    dict(_FP8_FAST, num_stages=3),
    dict(_FP8_FAST, num_stages=3, EPILOGUE_SUBTILE=True),
    dict(_FP8_FAST, num_stages=4, EPILOGUE_SUBTILE=True),
    dict(_FP8_FAST, num_stages=4, EPILOGUE_SUBTILE=True, GROUP_M=16),
    dict(_FP8_FAST, num_stages=3, WARP_SPECIALIZE=True),
    dict(_FP8_FAST, num_stages=4, EPILOGUE_SUBTILE=True, WARP_SPECIALIZE=True),
    dict(_FP8_FAST, num_stages=4, EPILOGUE_SUBTILE=True, PERSISTENT=False),
    dict(_FP8_FAST, BLOCK_N=128, num_stages=5, EPILOGUE_SUBTILE=True),
    dict(_FP8_FAST, BLOCK_M=256, BLOCK_N=128, num_stages=4, EPILOGUE_SUBTILE=True),
)


def fp8_shapes(sizes, fast: bool = False) -> list[gkb.Shape]:
    mode = "fp8 fast" if fast else "fp8 precise"
    return [gkb.Shape(mode, contiguous_problem(n, n, n, "fp8", "bf16", layout_b="col", fp8_fast_accum=fast))
            for n in sizes]


def shapes(tokens=TOKENS) -> list[gkb.Shape]:
    weights = gkb.projection_weights(MODELS_SWEPT)
    result = [gkb.Shape(" = ".join(labels), contiguous_problem(m, n, k, "bf16", "bf16", layout_b="col", bias=bias))
              for m in tokens for (n, k, bias), labels in weights.items()]
    m, n, k = gkb.IRREGULAR
    return result + [gkb.Shape("irregular", contiguous_problem(m, n, k, "bf16", "bf16", layout_b="col"))]


def candidates(problem, device) -> dict[str, Config]:
    """name -> config: the default first, then the seeds and the regime's variations the space holds."""
    space = FAMILY.space(problem, device)
    default = FAMILY.default_config(problem, device)
    found: dict[Config, str] = {default: "default"}
    for config in FAMILY.seed_configs(problem, device):
        found.setdefault(config, "seed")
    streaming = problem.m <= STREAM_MAX_M
    changes = STREAMING_VARIATIONS if streaming else TILED_VARIATIONS
    if problem.dtype == "fp8":
        changes = FP8_FAST_VARIATIONS if problem.fp8_fast_accum else FP8_VARIATIONS
    if STREAM_MAX_M < problem.m <= MID_MAX_M:
        changes += MID_VARIATIONS
    if STREAM_MAX_M < problem.m <= SWAP_MAX_M:
        changes += tuple(dict(change, BLOCK_M=next_pow2(problem.m)) for change in WIDE_STREAMING_VARIATIONS)
    for change in changes:
        wanted = dict(default, **change)
        if streaming and wanted["SCHEDULE"] == "split_k":
            wanted["SPLIT_K"] = max(2, best_split(problem, wanted, device))
        if wanted["SPLIT_K"] == "fill":
            wanted["SPLIT_K"] = filling_split(problem, wanted, device)
            wanted["SCHEDULE"] = "split_k" if wanted["SPLIT_K"] > 1 else "data_parallel"
        if space.is_feasible(wanted):
            found.setdefault(space.validate(wanted), "variation")
    named: dict[str, Config] = {}
    for config, kind in found.items():
        name = f"{kind} {gkb.short(config)}"
        named[name if name not in named else f"{name} g{config['GROUP_M']}"] = config  # short() omits GROUP_M
    return named


def sweep_shape(shape: gkb.Shape, configs: dict[str, Config], device, rounds: int, failures: list[str]) -> dict:
    problem = shape.problem
    inputs = FAMILY.make_inputs(problem, device, seed=7)
    reference = FAMILY.reference(problem, inputs)
    outputs = FAMILY.allocate_outputs(problem, inputs)
    fns = {}
    for name, config in configs.items():
        ok, _, message = gkb.check(problem, config, inputs, reference)
        if ok:
            fns[name] = (lambda c=config: FAMILY.launch(problem, c, inputs, outputs))
        else:
            failures.append(f"{gkb.describe(problem)} {config.to_json()}: {message}")
    vendor = gkb.vendor_fns(problem, inputs)
    screened = gkb.interleaved(dict(fns, **vendor), 1, 5, 20)
    ours = sorted((ms, name) for name, ms in screened.items() if name in fns)
    final = {name: fns[name] for _, name in ours[:FINALISTS]}
    default = next((name for name in fns if name.startswith("default")), None)
    if default:
        final[default] = fns[default]
    final.update(vendor)
    timed = gkb.interleaved(final, rounds, 10, 50)
    # The vendor op in the problem's own accumulation mode (fp8: _scaled_mm, precise unless fast accumulation).
    mode = "cuBLAS" if problem.dtype != "fp8" else "_scaled_mm fast" if problem.fp8_fast_accum else "_scaled_mm"
    vendor_ms = timed.pop(mode)
    return {"label": shape.label, "shape": gkb.describe(problem), "m": problem.m, "vendor_ms": vendor_ms,
            "screened": {name: ms for name, ms in screened.items()},
            "timed": {name: ms for name, ms in timed.items() if name not in vendor},
            "configs": {name: configs[name].to_json() for name in fns}}


def add_sweep_arguments(parser: argparse.ArgumentParser, out_name: str) -> None:
    """The options every policy sweep takes (this one and flash_policy_sweep.py)."""
    parser.add_argument("--out", type=Path, default=Path(out_name))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--budget-s", type=float, default=None,
                        help="no shape starts after this many seconds from the start (compiling every shape's "
                        "candidates ahead counts: narrow a short run with --only)")
    parser.add_argument("--plan", action="store_true", help="list shapes and candidates (H200 policy) and exit")
    parser.add_argument("--workers", type=int, default=max(1, min(14, (os.cpu_count() or 2) - 2)),
                        help="processes compiling kernels ahead")


def save(out: Path, rows: list[dict], failures: list[str], text: str | None = None) -> None:
    """The rows so far as JSON beside `out` (after every shape), and the markdown `text` at the end."""
    out.parent.mkdir(parents=True, exist_ok=True)
    if text is not None:
        out.write_text(text)
    out.with_suffix(".json").write_text(json.dumps({"rows": rows, "failures": failures}, indent=1))


def ranked(row: dict) -> tuple[float, tuple[float, str], str]:
    """(default / vendor, (best / vendor, its name), the runner-up as text) of one swept shape: ratios are the
    vendor's time over ours, from the row's final interleaved timings."""
    ratios = sorted(((row["vendor_ms"] / ms, name) for name, ms in row["timed"].items()), reverse=True)
    default = next((r for r, n in ratios if n.startswith("default")), float("nan"))
    best = ratios[0] if ratios else (float("nan"), "-")
    second = f"{ratios[1][1]} {ratios[1][0]:.2f}x" if len(ratios) > 1 else "-"
    return default, best, second


def render(rows: list[dict], device, seconds: float, failures: list[str]) -> str:
    lines = [f"# GEMM policy sweep: every untuned candidate beside the vendor op ({datetime.date.today().isoformat()}, "
             f"{device.name})", "",
             "nn.Linear layout. `timed`: medians of do_bench medians over interleaved rounds (the best "
             f"{FINALISTS} of a screening round, the default and the vendor op: cuBLAS, or `_scaled_mm` in the "
             "problem's accumulation mode for fp8); ratios are the vendor's time / ours. "
             f"{seconds:.0f} s in all.", "",
             "| shape | projection | vendor us | default / vendor | best | best / vendor | runner-up |",
             "|---|---|---|---|---|---|---|"]
    by_m: dict[int, list[tuple[float, float]]] = {}
    for row in rows:
        default, best, second = ranked(row)
        lines.append(f"| {row['shape']} | {row['label']} | {row['vendor_ms'] * 1e3:.1f} | {default:.2f}x | "
                     f"{best[1]} | {best[0]:.2f}x | {second} |")
        by_m.setdefault(row["m"], []).append((default, best[0]))
    lines += ["", "| M | shapes | geomean default / vendor | geomean best / vendor |", "|---|---|---|---|"]
    for m, pairs in sorted(by_m.items()):
        lines.append(f"| {m} | {len(pairs)} | {gkb.geomean([d for d, _ in pairs]):.3f}x | "
                     f"{gkb.geomean([b for _, b in pairs]):.3f}x |")
    lines += ["", "## Failed checks", ""] + ([f"- {f}" for f in failures] or ["none"])
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_sweep_arguments(parser, "gemm_policy_sweep.md")
    parser.add_argument("--tokens", type=lambda text: tuple(int(t) for t in text.split(",") if t), default=TOKENS,
                        help=f"comma-separated M values (default {','.join(map(str, TOKENS))})")
    parser.add_argument("--fp8", type=lambda text: tuple(int(t) for t in text.split(",")), default=(),
                        help="also sweep fp8 (precise accumulation) at these square sizes, against _scaled_mm")
    parser.add_argument("--fp8-fast", type=lambda text: tuple(int(t) for t in text.split(",")), default=(),
                        help="also sweep fp8 with fast accumulation at these square sizes, against "
                             "_scaled_mm(use_fast_accum=True)")
    args = parser.parse_args()
    work = ((shapes(args.tokens) if args.tokens else []) + fp8_shapes(args.fp8)
            + fp8_shapes(args.fp8_fast, fast=True))
    if args.plan:
        for shape in work:
            configs = candidates(shape.problem, gkb.H200_PLAN)
            print(f"{gkb.describe(shape.problem):22s} {shape.label:32s} {len(configs)} candidates")
            for name in configs:
                print(f"    {name}")
        return 0
    device = resolve_gpu("auto")
    if device.interpret:
        print("no CUDA GPU: this sweep runs on a GPU only (--plan lists its work without one)")
        return 2
    started = time.monotonic()
    plans = [(shape, candidates(shape.problem, device)) for shape in work]
    gkb.compile_ahead([(shape.problem, c) for shape, configs in plans for c in configs.values()], args.workers)
    print(f"compiled {sum(len(c) for _, c in plans)} configs ({time.monotonic() - started:.0f} s)", flush=True)
    rows, failures = [], []
    for shape, configs in plans:
        if args.budget_s and time.monotonic() - started > args.budget_s:
            failures.append(f"budget of {args.budget_s:.0f} s spent: {len(plans) - len(rows)} shapes not timed")
            break
        rows.append(sweep_shape(shape, configs, device, args.rounds, failures))
        save(args.out, rows, failures)
        best = max(rows[-1]["timed"].items(), key=lambda kv: -kv[1])
        print(f"  {gkb.describe(shape.problem):22s} vendor {rows[-1]['vendor_ms'] * 1e3:7.1f} us, best "
              f"{best[1] * 1e3:7.1f} us {best[0]} ({time.monotonic() - started:.0f} s)", flush=True)
    text = render(rows, device, time.monotonic() - started, failures)
    save(args.out, rows, failures, text)
    print(text)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
