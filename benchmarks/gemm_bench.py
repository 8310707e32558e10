"""GEMM on the GPU: correctness sweep, tuning of the benchmark shapes, then autotile vs cuBLAS side by side.

Run from the repository root on a CUDA machine:
    python benchmarks/gemm_bench.py --budget-s 420 --out results/
It writes gemm.sqlite (every trial and the winners), gemm_bench.md and gemm_bench.json
into --out and prints the table last. Every timing in the table comes from one
interleaved re-timing (winner and baseline in turns), medians of do_bench medians.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import sys
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import autotile  # noqa: E402
from autotile.bench import Status, retime_interleaved, run_checked  # noqa: E402
from autotile.device import resolve_gpu  # noqa: E402
from autotile.families.gemm import FAMILY, contiguous_problem  # noqa: E402
from autotile.runtime.dispatch import clear_cache  # noqa: E402
from autotile.tune.driver import tune_problem  # noqa: E402

BF16_SHAPES = [(2048, 2048, 2048), (4096, 4096, 4096), (8192, 8192, 8192), (4096, 14336, 4096),
               (128, 28672, 8192), (16, 8192, 8192), (1000, 3000, 777)]
FP8_SHAPES = [(8192, 8192, 8192), (4096, 4096, 4096)]


def correctness_sweep(device, configs_per_problem: int = 6) -> list[str]:
    """Awkward shapes in every dtype, several configs each (default, seeds, random feasible)."""
    cases = [
        contiguous_problem(1, 1, 1, "bf16", "bf16"),
        contiguous_problem(67, 45, 129, "bf16", "bf16", bias=True, activation="gelu"),
        contiguous_problem(67, 45, 129, "fp16", "fp32", layout_a="col", layout_b="strided"),
        contiguous_problem(300, 200, 512, "bf16", "bf16", layout_b="col", activation="silu"),
        contiguous_problem(257, 384, 1024, "fp32", "fp32", tf32=True),
        contiguous_problem(257, 384, 1024, "fp32", "fp32"),
        contiguous_problem(128, 256, 512, "fp8", "bf16", layout_b="col", bias=True, activation="relu"),
        contiguous_problem(200, 136, 320, "fp8", "fp16", layout_b="col"),
        contiguous_problem(16, 4096, 4096, "bf16", "bf16", activation="relu"),
        contiguous_problem(1, 4096, 4104, "bf16", "bf16", layout_b="col", residual=True),
        contiguous_problem(300, 1040, 1184, "fp8", "bf16", layout_b="col", scale_mode="block"),
        contiguous_problem(5, 1040, 1184, "fp8", "bf16", layout_b="col", scale_mode="row", fp8_fast_accum=True),
    ]
    failures = []
    rng = random.Random(0)
    for problem in cases:
        space = FAMILY.space(problem, device)
        feasible = list(space.feasible())
        configs = [FAMILY.default_config(problem, device), *FAMILY.seed_configs(problem, device)]
        configs += rng.sample(feasible, min(configs_per_problem, len(feasible)))
        for config in configs:
            outcome, _ = run_checked(FAMILY, problem, config, device, seed=1)
            if outcome.status is Status.WRONG_RESULT or outcome.status is Status.CRASH:
                failures.append(f"{outcome.status.value}: {FAMILY.problem_key(problem)} {config.to_json()}: {outcome.error[:300]}")
            print(f"  check {outcome.status.value:16s} {problem.m}x{problem.n}x{problem.k} {problem.dtype} "
                  f"{config['VARIANT']} {config['BLOCK_M']}x{config['BLOCK_N']}x{config['BLOCK_K']} "
                  f"{config['SCHEDULE']} sk{config['SPLIT_K']} swap{int(config['SWAP_AB'])} p{int(config['PERSISTENT'])} "
                  f"ws{int(config['WARP_SPECIALIZE'])}", flush=True)
    return failures


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--budget-s", type=float, default=420.0, help="tuning time for all shapes together")
    parser.add_argument("--trials", type=int, default=40, help="trials per shape (the budget may stop earlier)")
    parser.add_argument("--out", type=Path, default=Path("gemm-results"))
    parser.add_argument("--skip-check", action="store_true")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    device = resolve_gpu("auto")
    if device.interpret:
        print("no CUDA GPU: this benchmark runs on a GPU only")
        return 2
    db_url = f"sqlite:///{args.out.resolve() / 'gemm.sqlite'}"

    if not args.skip_check:
        print("correctness sweep on", device.name, flush=True)
        failures = correctness_sweep(device)
        if failures:
            print("CORRECTNESS FAILURES:\n" + "\n".join(failures))
            (args.out / "gemm_failures.txt").write_text("\n".join(failures))

    problems = [contiguous_problem(m, n, k, "bf16", "bf16") for m, n, k in BF16_SHAPES]
    problems += [contiguous_problem(m, n, k, "fp8", "bf16", layout_b="col") for m, n, k in FP8_SHAPES]
    per_problem = args.budget_s / len(problems)
    rows = []
    for problem in problems:
        started = time.monotonic()
        try:
            result = tune_problem(FAMILY, problem, device, trials=args.trials, timeout=per_problem, db_url=db_url,
                                  retime_rounds=3)
        except Exception as exc:  # noqa: BLE001 - one shape must not stop the others
            print(f"tuning {problem} failed: {exc}", flush=True)
            continue
        tune_s = time.monotonic() - started
        print(f"tuned {problem.m}x{problem.n}x{problem.k} {problem.dtype}: {result.winner_ms} ms, "
              f"{result.statuses}, {tune_s:.0f} s; {result.winner.to_json() if result.winner else None}", flush=True)
        rows.append((problem, result, tune_s))

    # Final side-by-side: the winner (through the family's launch and through the public op, which serves the
    # winner from this run's database) and the anchor, interleaved, on one set of inputs.
    os.environ["AUTOTILE_DB"] = db_url
    clear_cache()
    table = []
    for problem, result, tune_s in rows:
        if result.winner is None:
            continue
        inputs = FAMILY.make_inputs(problem, device, seed=7)
        outputs = FAMILY.allocate_outputs(problem, inputs)
        baseline = FAMILY.baseline(problem, inputs)
        fns = {"autotile": lambda: FAMILY.launch(problem, result.winner, inputs, outputs),
               "op": lambda: autotile.matmul(inputs["a"], inputs["b"], scale_a=inputs.get("scale_a"),
                                             scale_b=inputs.get("scale_b"))}
        if baseline is not None:
            fns["anchor"] = baseline.run
        timings = retime_interleaved(fns, device, rounds=7)
        flops = FAMILY.cost(problem).flops
        ours = timings["autotile"]
        anchor = timings.get("anchor")
        table.append({
            "shape": f"{problem.m}x{problem.n}x{problem.k}", "dtype": problem.dtype,
            "autotile_ms": ours.median_ms, "autotile_tflops": flops / ours.median_ms / 1e9, "spread": ours.spread,
            "anchor": baseline.name if baseline else "", "anchor_ms": anchor.median_ms if anchor else None,
            "anchor_tflops": flops / anchor.median_ms / 1e9 if anchor else None,
            "ratio": anchor.median_ms / ours.median_ms if anchor else None,
            "op_tflops": flops / timings["op"].median_ms / 1e9,
            "op_ratio": anchor.median_ms / timings["op"].median_ms if anchor else None,
            "tuning_s": tune_s, "trials": sum(result.statuses.values()), "statuses": result.statuses,
            "config": json.loads(result.winner.to_json()),
        })

    bf16 = [r["ratio"] for r in table if r["dtype"] == "bf16" and r["ratio"]]
    geomean = float(torch.tensor(bf16).log().mean().exp()) if bf16 else float("nan")
    bf16_op = [r["op_ratio"] for r in table if r["dtype"] == "bf16" and r["op_ratio"]]
    geomean_op = float(torch.tensor(bf16_op).log().mean().exp()) if bf16_op else float("nan")
    header = (f"GEMM, autotile vs anchor, {device.name}, {datetime.date.today().isoformat()}, "
              f"torch {torch.__version__}, triton {triton.__version__}, CUDA {torch.version.cuda}\n\n"
              "| shape | dtype | autotile TFLOP/s | anchor | anchor TFLOP/s | ratio | autotile.matmul TFLOP/s | its ratio | spread | "
              "tuning s | trials | winner |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    lines = []
    for r in table:
        c = r["config"]
        winner = (f"{c['VARIANT']}{'+persistent' if c['PERSISTENT'] else ''}{'+ws' if c['WARP_SPECIALIZE'] else ''}"
                  f"{'+swap' if c.get('SWAP_AB') else ''} {c.get('SCHEDULE', 'data_parallel')} "
                  f"{c['BLOCK_M']}x{c['BLOCK_N']}x{c['BLOCK_K']} g{c['GROUP_M']} sk{c['SPLIT_K']} w{c['num_warps']} s{c['num_stages']}")
        lines.append(f"| {r['shape']} | {r['dtype']} | {r['autotile_tflops']:.0f} | {r['anchor']} | "
                     f"{(r['anchor_tflops'] or 0):.0f} | {(r['ratio'] or 0):.2f}x | {r['op_tflops']:.0f} | {(r['op_ratio'] or 0):.2f}x | {r['spread']:.1%} | {r['tuning_s']:.0f} | "
                     f"{r['trials']} | {winner} |")
    text = header + "\n".join(lines) + f"\n\nbf16 geometric mean of ratios: {geomean:.3f}x (family launch), {geomean_op:.3f}x (autotile.matmul)\n"
    (args.out / "gemm_bench.md").write_text(text)
    (args.out / "gemm_bench.json").write_text(json.dumps(table, indent=2))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
