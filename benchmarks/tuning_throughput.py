"""Tuning throughput: trials per minute of a GEMM study, with compile-ahead off and on, on one GPU and on two.

Run from the repository root on a CUDA machine (two GPUs for the last row):
    python benchmarks/tuning_throughput.py --trials 40 --out benchmarks/results/
It tunes one GEMM problem several times, each time from nothing: a new
database, a new Triton cache and a new kernel cache, so no run profits from
another's compiles. Every run uses isolated trial workers (the GPU default)
and the same seed; the interleaved re-timing of the winner is skipped
(`retime_rounds=0`): the table measures the search alone. It prints a
markdown table and writes it, with the raw numbers as JSON, into --out.

Targets (issue 7): compile-ahead >= 1.5x the trials per minute without it;
two GPUs >= 1.8x one GPU (both with compile-ahead).

Two rates are reported: over the whole run (including the start of the
trial worker and of the compile processes, seconds that a long study pays
once), and in steady state, from the trial recorded WARMUP_TRIALS-th to the
last (what each further trial of a long study costs). Both ratios are shown.

`--interpret` runs the same pipeline on Triton's CPU interpreter with a tiny
problem, to check the script itself: there is nothing to compile there, so
its numbers say nothing about compile-ahead.

`--runs model` (what `--quick` runs) measures a run over many problems: the
first few decode GEMMs of a model (llama3-8b by default, smallest first, as
`autotile tune gemm --model` orders them), tuned once with one trial worker and
compile pool for all of them (a TuneSession, as `--model`, `--from-trace` and
suites run) and once with a new worker and pool per problem (as before
sessions). Each mode starts from cold caches; the session runs first, which
if anything favours the other. It reports seconds per problem, seconds to each
problem's first trial, and the worker and pool start-ups. Target (issues 11
and 15): the session pays the start-up once, so the per-problem time drops by
about the worker's start-up (~11 s on the H200s).

    python benchmarks/tuning_throughput.py --quick --out benchmarks/results/
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from autotile.device import interpret_device, resolve_gpu  # noqa: E402
from autotile.families.gemm import FAMILY, contiguous_problem  # noqa: E402
from autotile.tune.driver import tune_problem  # noqa: E402
from autotile.tune.session import TuneSession  # noqa: E402

TARGET_COMPILE_AHEAD = 1.5
TARGET_TWO_GPUS = 1.8
# Trials recorded before the steady-state clock starts (worker and compile-pool start-up fall in these).
WARMUP_TRIALS = 5


def steady_rate(db_path: Path) -> float | None:
    """Trials per minute from the WARMUP_TRIALS-th recorded trial to the last."""
    import sqlite3

    with sqlite3.connect(db_path) as db:
        stamps = [row[0] for row in db.execute("SELECT created_at FROM autotile_trials ORDER BY created_at")]
    times = [datetime.datetime.fromisoformat(str(s)) for s in stamps]
    if len(times) <= WARMUP_TRIALS + 1:
        return None
    span = (times[-1] - times[WARMUP_TRIALS]).total_seconds()
    return 60.0 * (len(times) - 1 - WARMUP_TRIALS) / span if span > 0 else None


def run_once(label: str, problem, device, *, trials: int, gpus: list[int] | None, compile_ahead: bool,
             seed: int, scratch: Path) -> dict:
    """One study from nothing; returns its trials, seconds and statuses."""
    root = scratch / label.replace(" ", "_").replace(",", "")
    root.mkdir(parents=True)
    # Workers and compile processes are spawned and inherit these: every run starts with cold caches.
    os.environ["TRITON_CACHE_DIR"] = str(root / "triton")
    os.environ["AUTOTILE_CACHE_DIR"] = str(root / "autotile")
    started = time.monotonic()
    result = tune_problem(FAMILY, problem, device, trials=trials, db_url=f"sqlite:///{root / 'tune.sqlite'}",
                          seed=seed, gpus=gpus, compile_ahead=compile_ahead, retime_rounds=0)
    seconds = time.monotonic() - started
    evaluated = result.trials_this_run
    steady = steady_rate(root / "tune.sqlite")
    return {"label": label, "gpus": gpus or [device.index], "compile_ahead": compile_ahead, "trials": evaluated,
            "seconds": seconds, "trials_per_min": 60.0 * evaluated / seconds if seconds else 0.0,
            "steady_trials_per_min": steady, "statuses": result.statuses, "stopped_early": result.stopped_early}


def table(rows: list[dict], device_name: str, problem_key: str) -> str:
    by_label = {r["label"]: r for r in rows}
    one_off, one_on = by_label.get("1 GPU, compile-ahead off"), by_label.get("1 GPU, compile-ahead on")
    lines = [f"Tuning throughput on {device_name}, GEMM {problem_key} "
             f"({datetime.date.today().isoformat()})", "",
             f"| run | trials | seconds | trials/min, whole run | trials/min, steady (after {WARMUP_TRIALS}) | "
             "ratio whole / steady | target |", "|---|---|---|---|---|---|---|"]

    def ratios(r, reference, target_value, versus):
        whole = r["trials_per_min"] / reference["trials_per_min"]
        steady = (r["steady_trials_per_min"] / reference["steady_trials_per_min"]
                  if r["steady_trials_per_min"] and reference["steady_trials_per_min"] else None)
        text = f"{whole:.2f}x / {f'{steady:.2f}x' if steady else '-'} vs {versus}"
        verdict = lambda v: "met" if v is not None and v >= target_value else "NOT met"  # noqa: E731
        return text, f">= {target_value}x: whole run {verdict(whole)}, steady {verdict(steady)}"

    for r in rows:
        ratio, target = "", ""
        if r is one_on and one_off:
            ratio, target = ratios(r, one_off, TARGET_COMPILE_AHEAD, "compile-ahead off")
        elif r["label"].startswith("2 GPUs") and one_on:
            ratio, target = ratios(r, one_on, TARGET_TWO_GPUS, "1 GPU")
        steady = f"{r['steady_trials_per_min']:.1f}" if r["steady_trials_per_min"] else "-"
        lines.append(f"| {r['label']} | {r['trials']} | {r['seconds']:.1f} | {r['trials_per_min']:.1f} | {steady} | "
                     f"{ratio} | {target} |")
    return "\n".join(lines)


def model_problems_for(model_name: str, count: int, interpret: bool) -> list:
    """The model's `count` smallest GEMM problems at 1 and 16 tokens (bf16, nn.Linear layout).

    Under the interpreter: as many tiny GEMMs, to check the script (a model's shapes take minutes per trial).
    """
    if interpret:
        return [contiguous_problem(8 + 8 * i, 32, 64, "fp16", "fp16") for i in range(count)]
    from autotile.models import model_dims
    from autotile.tune.plan import model_problems

    planned = model_problems("gemm", [model_dims(model_name)], (1, 16), "bf16")
    if len(planned) < count:
        raise SystemExit(f"{model_name} has {len(planned)} GEMM problems at 1 and 16 tokens, fewer than {count}")
    return [p.problem for p in planned[:count]]


def run_problems(label: str, problems: list, device, *, shared: bool, trials: int, seed: int, scratch: Path) -> dict:
    """Tune every problem from cold caches, in one session (`shared`) or a new one per problem."""
    root = scratch / label.replace(" ", "_").replace(",", "")
    root.mkdir(parents=True)
    os.environ["TRITON_CACHE_DIR"] = str(root / "triton")
    os.environ["AUTOTILE_CACHE_DIR"] = str(root / "autotile")
    url = f"sqlite:///{root / 'tune.sqlite'}"
    per_problem, first_trial, statuses, stats = [], [], {}, []
    session = TuneSession() if shared else None
    started = time.monotonic()
    try:
        for problem in problems:
            begun, first = time.monotonic(), []

            def progress(p, first=first, begun=begun):
                if not first:
                    first.append(time.monotonic() - begun)

            own = session or TuneSession()  # without sharing: what tune_problem starts for itself, counted
            try:
                result = tune_problem(FAMILY, problem, device, trials=trials, db_url=url, seed=seed, isolate=True,
                                      retime_rounds=0, warm_start=False, progress=progress, session=own)
            finally:
                if own is not session:
                    own.close()
                    stats.append(own.stats())
            per_problem.append(time.monotonic() - begun)
            first_trial.append(first[0] if first else None)
            for status, n in result.statuses.items():
                statuses[status] = statuses.get(status, 0) + n
            print(f"  {problem.m}x{problem.n}x{problem.k}: {per_problem[-1]:.1f} s, first trial done after "
                  f"{first_trial[-1] or 0:.1f} s", file=sys.stderr, flush=True)
    finally:
        if session is not None:
            session.close()
            stats.append(session.stats())
    seconds = time.monotonic() - started
    return {"label": label, "problems": len(problems), "shapes": [f"{p.m}x{p.n}x{p.k}" for p in problems],
            "trials_per_problem": trials, "seconds": seconds,
            "per_problem_s": per_problem, "first_trial_s": first_trial, "statuses": statuses,
            "worker_starts": sum(s.worker_starts for s in stats), "pool_starts": sum(s.pool_starts for s in stats),
            "worker_start_s": [t for s in stats for t in s.worker_start_s]}


def problems_table(rows: list[dict], device_name: str, model_name: str) -> str:
    lines = [f"Tuning many problems on {device_name}: {rows[0]['problems']} GEMM problems of {model_name}, "
             f"{rows[0]['trials_per_problem']} trials each, cold caches ({datetime.date.today().isoformat()})", "",
             "M x N x K: " + ", ".join(rows[0]["shapes"]), "",
             "| run | seconds | s / problem (mean, median) | s until the first trial is done (median; first problem) | "
             "worker starts (mean s each) | pool starts | statuses |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        per = r["per_problem_s"]
        firsts = [f for f in r["first_trial_s"] if f is not None]
        starts = r["worker_start_s"]
        lines.append(
            f"| {r['label']} | {r['seconds']:.1f} | {statistics.mean(per):.1f}, {statistics.median(per):.1f} | "
            f"{statistics.median(firsts) if firsts else float('nan'):.1f}; "
            f"{r['first_trial_s'][0] or float('nan'):.1f} | "
            f"{r['worker_starts']} ({statistics.mean(starts) if starts else float('nan'):.1f}) | "
            f"{r['pool_starts']} | {r['statuses']} |")
    by_label = {r["label"]: r for r in rows}
    shared, alone = by_label.get("one session"), by_label.get("a worker per problem")
    if shared and alone:
        saved = (alone["seconds"] - shared["seconds"]) / shared["problems"]
        lines += ["", f"One session: {alone['seconds'] / shared['seconds']:.2f}x as fast over the run, "
                      f"{saved:.1f} s saved per problem; {shared['worker_starts']} worker start(s) against "
                      f"{alone['worker_starts']}."]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=40, help="trials per run")
    parser.add_argument("--size", type=int, default=4096, help="M = N = K of the bf16 GEMM")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="folder for tuning_throughput.md and .json")
    parser.add_argument("--interpret", action="store_true", help="check the script on the CPU interpreter")
    parser.add_argument("--runs", default="off,on,2gpu",
                        help="which runs, comma-separated: off (1 GPU, compile-ahead off), on (1 GPU, compile-ahead "
                             "on), 2gpu (GPUs 0 and 1, compile-ahead on; skipped with fewer than two GPUs), model "
                             "(many problems of one model, with and without one session)")
    parser.add_argument("--model", default="llama3-8b", help="the model whose GEMMs `--runs model` tunes")
    parser.add_argument("--problems", type=int, default=8, help="problems of `--runs model`")
    parser.add_argument("--model-trials", type=int, default=6, help="trials per problem of `--runs model`")
    parser.add_argument("--quick", action="store_true",
                        help="only `--runs model`, 6 problems of 3 trials: about 2 minutes on an H200")
    args = parser.parse_args()
    if args.quick:
        args.runs, args.problems, args.model_trials = "model", 6, 3

    import torch

    if args.interpret:
        device, problem = interpret_device(), contiguous_problem(24, 32, 64, "fp16", "fp16")
        gpu_counts = [1, 2]
    else:
        if not torch.cuda.is_available():
            print("no CUDA GPU here: run on a GPU machine, or pass --interpret to check the script", file=sys.stderr)
            return 1
        device, problem = resolve_gpu("auto"), contiguous_problem(args.size, args.size, args.size, "bf16", "bf16")
        gpu_counts = [1, 2] if torch.cuda.device_count() >= 2 else [1]
    wanted = set(args.runs.split(","))
    plans = [(label, gpus, ahead) for key, label, gpus, ahead in (
        ("off", "1 GPU, compile-ahead off", [0], False), ("on", "1 GPU, compile-ahead on", [0], True),
        ("2gpu", "2 GPUs (0,1), compile-ahead on", [0, 1], True)) if key in wanted and len(gpus) in gpu_counts]
    rows, model_rows = [], []
    with tempfile.TemporaryDirectory(prefix="autotile-throughput-") as scratch:
        for label, gpus, ahead in plans:
            print(f"running: {label} ...", file=sys.stderr, flush=True)
            rows.append(run_once(label, problem, device, trials=args.trials, gpus=gpus, compile_ahead=ahead,
                                 seed=args.seed, scratch=Path(scratch)))
            print(f"  {rows[-1]['trials']} trials in {rows[-1]['seconds']:.1f} s; {rows[-1]['statuses']}",
                  file=sys.stderr, flush=True)
        if "model" in wanted:
            problems = model_problems_for(args.model, args.problems, device.interpret)
            for label, shared in (("one session", True), ("a worker per problem", False)):
                print(f"running: {len(problems)} problems, {label} ...", file=sys.stderr, flush=True)
                model_rows.append(run_problems(label, problems, device, shared=shared, trials=args.model_trials,
                                               seed=args.seed, scratch=Path(scratch)))
    device_name = device.name + (" (interpreter: compile-ahead is a no-op)" if device.interpret else "")
    parts = [table(rows, device_name, FAMILY.problem_key(problem))] if rows else []
    if model_rows:
        parts.append(problems_table(model_rows, device_name, "tiny GEMMs" if device.interpret else args.model))
    text = "\n\n".join(parts)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "tuning_throughput.md").write_text(text + "\n")
        (args.out / "tuning_throughput.json").write_text(json.dumps(rows + model_rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
