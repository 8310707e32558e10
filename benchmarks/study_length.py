"""Study length: the whole-model tables' short studies against studies five times as long, on 5 sampled problems.

Target (issue 15): `autotile tune gemm --model llama3-8b` over the 14 M buckets finishes in at most 10 minutes,
and its winners are within 2% of a 5x longer study on 5 sampled problems. The tables shipped in tuning_db/ came
from `autotile tune gemm --model llama3-8b --trials 10 --patience 4` on an H200 (84 problems in 487 s:
benchmarks/results/tune_llama3-8b_all_buckets_2026-12-01.txt); this script checks the second half.

Run from the repository root on a CUDA machine:

    PYTHONPATH=. python benchmarks/study_length.py --out OUT/study_length.md                # ~3 min on an H200
    PYTHONPATH=. python benchmarks/study_length.py --rerun-short --out OUT/study_length.md  # ~3.5 min
    PYTHONPATH=. python benchmarks/study_length.py --smoke --out /tmp/study_length.md       # CPU interpreter, ~10 s

The times are estimates from the trial rate of the 84-problem run; the tuning budgets (--long-budget-s 270,
--short-budget-s 60) bound a run at about 5.5 minutes with start-up.

The 5 problems are Llama-3-8B projections in nn.Linear layout (bf16, B column-major), built as `--model` builds
them (autotile.tune.plan.model_problems), so their keys are the shipped ones: q_proj at M=1, k/v_proj at M=4,
gate_up at M=16, o_proj at M=64, down_proj at M=256.

1. SHORT: each problem's winner in the shipped tuning_db/ for this GPU (an exact match of the problem key); with
   --rerun-short, instead a fresh study of 10 trials, patience 4, into a temporary database.
2. LONG: a fresh study of 50 trials, patience 20 (5x both), into another temporary database. Both runs go
   through autotile.tune.plan.tune_planned, as `tune gemm --model` does, in one TuneSession (one trial worker
   and compile pool for every problem), in the order the CLI tunes them (fewest FLOPs first). Each new study
   warm-starts from the sampled problems tuned before it in its own database; the shipped run's studies had
   every smaller problem of the 84 to start from. A study that runs past its share of the budget is cut
   there, and the report says so.
3. Per problem, both winners (a generated kernel, or the vendor op) are checked against the float64 reference
   and timed beside F.linear and torch.matmul (cuBLAS) in one process on the same inputs: medians of
   triton.testing.do_bench medians over interleaved rounds (autotile.bench.retime_interleaved, L2 flushed).
4. short/long = the two winners' times; "within 2%" when short/long <= 1.02, or when both studies chose the same
   config ("same config": one winner, timed twice, the ratio is the timing noise).

Markdown to --out (a .md file, or a folder that gets study_length.md), the raw numbers as JSON beside it; the
table is printed last. --smoke runs a made-up model's one tiny problem on Triton's CPU interpreter with 2- and
4-trial studies (the short one always re-run: the shipped tables hold no interpreter winners): a check of the
script end to end, not a measurement.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path

if "--smoke" in sys.argv:
    # NOTE: Triton decides at import whether its helpers run interpreted: set before anything imports it.
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

MODEL = "llama3-8b"
# (label, M, name in autotile.models.projections). Llama-3-8B's o_proj (hidden x heads * head_dim) is 4096 x 4096,
# the GEMM of q_proj: projections() lists that GEMM once, as q, and so does the whole-model run.
SAMPLES = (("q_proj", 1, "q"), ("k/v_proj", 4, "kv"), ("gate_up", 16, "gate_up"), ("o_proj", 64, "q"),
           ("down_proj", 256, "down"))
# The smoke run: a made-up model small enough for the interpreter, no dimension a multiple of a block.
SMOKE_DIMS = "hidden=40,intermediate=24,heads=2,kv_heads=1"
SMOKE_SAMPLES = (("down_proj", 20, "down"),)
# (trials, patience): the shipped tables' command (benchmarks/RESULTS.md, "Whole-model tables"), and 5x both.
SETTINGS = {"short": (10, 4), "long": (50, 20)}
SMOKE_SETTINGS = {"short": (2, 2), "long": (4, 4)}
# Seconds the tuning runs may take (tune_planned's budget: each problem gets an equal share of what is left and
# is cut there). The device machine stops a command at 600 s; the whole run is meant to fit in 6 minutes. A
# 10-trial study of these shapes took ~6 s on the H200 (84 in 475 s), a 50-trial one should take ~25 s.
LONG_BUDGET_S = 270.0
SHORT_BUDGET_S = 60.0
# Interleaved timing rounds of the winners beside F.linear and torch.matmul.
TIMING_ROUNDS = 5
# issue 15: the short study's winner within 2% of the long one's.
WITHIN = 0.02


# --- the problems ------------------------------------------------------------------------------------

def sample_problems(model, samples, dtype: str) -> list[tuple[str, object]]:
    """(label, PlannedProblem) of each sample, in the order `tune gemm --model` tunes them.

    The problems are the model's planned problems (autotile.tune.plan.model_problems over the samples' token
    counts), picked by M and the named projection's (N, K, bias): the same objects the CLI path tunes.
    """
    from autotile.models import projections
    from autotile.tune.plan import model_problems

    planned = model_problems("gemm", [model], tuple(sorted({m for _, m, _ in samples})), dtype)
    by_name = {p.name: p for p in projections(model)}
    labels: dict[int, str] = {}
    for label, m, name in samples:
        if name not in by_name:
            raise ValueError(f"{model.name} has no projection {name!r}; it has {', '.join(by_name)}")
        proj = by_name[name]
        found = [i for i, item in enumerate(planned) if (item.problem.m, item.problem.n, item.problem.k,
                                                         item.problem.bias) == (m, proj.n, proj.k, proj.bias)]
        if len(found) != 1:
            raise ValueError(f"{label}: {len(found)} planned problems at M={m} with {name}'s shape {proj.n}x{proj.k}")
        labels[found[0]] = label
    return [(labels[i], planned[i]) for i in sorted(labels)]


def shipped_winner(db_url: str, family, problem, device_key: str) -> dict | None:
    """The winner stored for exactly `problem` on `device_key` in a database (the shipped tuning_db/), else None."""
    from autotile.store.db import open_engine
    from autotile.store.repo import Store

    engine = open_engine(db_url, create=False, read_only=True)
    try:
        winners = Store(engine).winners(family.name, device_key)
    finally:
        engine.dispose()
    key = family.problem_key(problem)
    for w in winners:
        if w.problem_key == key:
            return {"config": json.loads(w.config), "winner_ms": w.median_ms, "baseline_name": w.baseline_name,
                    "baseline_ms": w.baseline_ms, "trials": w.trials_run, "verified_range": w.verified_range,
                    "toolchain": w.toolchain, "created_at": w.created_at}
    return None


# --- tuning ------------------------------------------------------------------------------------------

def tune_studies(planned: list, device, trials: int, patience: int, db_url: str, budget_s: float | None,
                 label: str) -> dict:
    """Fresh studies of the planned problems through tune_planned (the `tune gemm --model` path) into `db_url`.

    Returns the run's wall time and, per problem key, its winner and how its study went.
    """
    from autotile.tune.plan import tune_planned

    def report(line: str) -> None:
        print(f"{label}: {line}", file=sys.stderr, flush=True)

    outcome = tune_planned(planned, device, budget_s=budget_s, db_url=db_url, trials=trials, seed=0, report=report,
                           patience=patience)
    results = {}
    for r in outcome.tuned:
        evaluated = sum(r.statuses.values())
        results[r.problem_key] = {
            "config": dict(r.winner) if r.winner is not None else None, "winner_ms": r.winner_ms,
            "baseline_name": r.baseline_name, "baseline_ms": r.baseline_ms, "trials": evaluated,
            "statuses": dict(r.statuses), "seconds": r.seconds, "stopped_early": r.stopped_early,
            "verified_range": r.verified_range, "warm_start": r.warm_start,
            # Neither the trial count nor patience ended it: the budget share did (or the space ran out).
            "cut": evaluated < trials and not r.stopped_early,
        }
    return {"seconds": outcome.seconds, "trials": trials, "patience": patience, "budget_s": budget_s,
            "results": results,
            "failed": {item.family.problem_key(item.problem): reason for item, reason in outcome.failed},
            "skipped": [item.family.problem_key(item.problem) for item in outcome.skipped]}


# --- timing ------------------------------------------------------------------------------------------

def time_side_by_side(family, problem, device, configs: dict, rounds: int) -> dict:
    """Check each config (a name -> config dict) on one set of inputs, then time those that pass beside F.linear
    and torch.matmul, in interleaved rounds. Returns per name its check and its median ms."""
    import torch.nn.functional as F

    from autotile.bench import Status, retime_interleaved, run_checked

    inputs = family.make_inputs(problem, device, seed=0)
    expected = family.reference(problem, inputs)
    checks, fns = {}, {}
    for name, config in configs.items():
        if config is None:
            continue
        try:
            config = family.validate_config(problem, device, config)
        except Exception as exc:  # noqa: BLE001 - a config this space no longer holds is reported, not timed
            checks[name] = {"ok": False, "status": "invalid", "message": f"{type(exc).__name__}: {exc}"[:300]}
            continue
        outcome, _ = run_checked(family, problem, config, device, 0, prepared=(inputs, expected))
        checks[name] = {"ok": outcome.status is Status.OK, "status": outcome.status.value,
                        "message": outcome.error[:300], "max_abs_error": outcome.max_abs_error}
        if outcome.status is Status.OK:
            fns[name] = family.timed_call(problem, config, inputs, family.allocate_outputs(problem, inputs))
    a, b = inputs["a"], inputs["b"]
    weight = b.t()  # B is column-major: its transpose is the (N, K) nn.Linear weight, contiguous

    def linear():
        return F.linear(a, weight, inputs.get("bias"))

    check = family.check(problem, inputs, {"c": linear()}, expected)
    checks["F.linear"] = {"ok": check.ok, "status": "ok" if check.ok else "wrong_result", "message": check.message,
                          "max_abs_error": check.max_abs_error}
    if check.ok:
        fns["F.linear"] = linear
    baseline = family.baseline(problem, inputs)
    if baseline is not None:
        fns["torch.matmul"] = baseline.run
    timings = retime_interleaved(fns, device, rounds=rounds)
    return {"checks": checks, "ms": {name: t.median_ms for name, t in timings.items()},
            "baseline_name": baseline.name if baseline is not None else None}


# --- judging and the report --------------------------------------------------------------------------

def judge(short_ms: float | None, long_ms: float | None, same_config: bool = False) -> tuple[float | None, str]:
    """(short / long, 'yes' | 'same config' | 'no' | 'n/a'): the short study's winner within WITHIN of the long one's.

    Two studies that chose the same config have the same winner: their two timings of it differ by this machine's
    noise only (3.2-3.5% on 16-18 us calls, H200), and that is no difference between the studies.

    >>> judge(1.01, 1.0), judge(1.03, 1.0)[1], judge(1.03, 1.0, same_config=True)[1], judge(None, 1.0)
    ((1.01, 'yes'), 'no', 'same config', (None, 'n/a'))
    """
    if not short_ms or not long_ms:
        return None, "n/a"
    ratio = short_ms / long_ms
    if same_config:
        return ratio, "same config"
    return ratio, "yes" if ratio <= 1.0 + WITHIN + 1e-12 else "no"


def config_summary(config: dict | None) -> str:
    """A GEMM config in a few words: tile, schedule, switches, warps and stages; or the vendor op.

    >>> config_summary({"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "SCHEDULE": "split_k", "SPLIT_K": 4,
    ...                 "SWAP_AB": True, "VARIANT": "blocked", "num_warps": 4, "num_stages": 5})
    '16x64x128 split-K 4, swap AB, w4 s5'
    >>> config_summary({"VENDOR": "cublas"}), config_summary(None)
    ('vendor (cublas)', '-')
    """
    if not config:
        return "-"
    if "VENDOR" in config:
        return f"vendor ({config['VENDOR']})"
    parts = [f"{config.get('BLOCK_M')}x{config.get('BLOCK_N')}x{config.get('BLOCK_K')}"]
    schedule = config.get("SCHEDULE")
    if schedule == "split_k":
        parts[0] += f" split-K {config.get('SPLIT_K')}"
    elif schedule and schedule != "data_parallel":
        parts[0] += f" {schedule}"
    for key, word in (("VARIANT", "tma"), ("SWAP_AB", "swap AB"), ("PERSISTENT", "persistent"),
                      ("WARP_SPECIALIZE", "warp-specialized"), ("FLATTEN", "flattened")):
        if config.get(key) is True or (key == "VARIANT" and config.get(key) == "tma"):
            parts.append(word)
    if config.get("GROUP_M", 1) != 1:
        parts.append(f"group {config['GROUP_M']}")
    parts.append(f"w{config.get('num_warps')} s{config.get('num_stages')}")
    return ", ".join(parts)


def _us(ms: float | None) -> str:
    return "-" if ms is None else f"{ms * 1e3:.2f}"


def _timed(row: dict, name: str) -> str:
    check = (row.get("timing") or {}).get("checks", {}).get(name)
    if check is not None and not check["ok"]:
        return "WRONG" if check["status"] == "wrong_result" else check["status"]
    return _us((row.get("timing") or {}).get("ms", {}).get(name))


def markdown(rows: list[dict], meta: dict) -> str:
    """The table (one row per problem), the verdict, the studies' wall times, and notes on each problem."""
    short_from = (f"a fresh study, `--trials {meta['short_trials']} --patience {meta['short_patience']}`"
                  if meta["rerun_short"] else f"the shipped tuning_db/ winner ({meta['shipped_toolchain']})")
    lines = [
        f"# Study length: short studies against 5x longer ones ({meta['date']}, {meta['device']})", "",
        (f"{meta['model']} projections, {meta['dtype']}, nn.Linear layout (B column-major), as `autotile tune gemm "
         f"--model {meta['model']}` builds them. Short: {short_from}. Long: a fresh study, `--trials "
         f"{meta['long_trials']} --patience {meta['long_patience']}`, in a temporary database. Times in "
         f"microseconds: medians of do_bench medians over {meta['rounds']} interleaved rounds, both winners beside "
         "F.linear and torch.matmul on the same inputs in one process; every output checked against float64 "
         "first."), "",
        ("| problem | M x N x K | short winner | long winner | short us | long us | F.linear us | torch.matmul us | "
         "short / long | within 2% |"),
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    judged = within = 0
    for row in rows:
        short, long_ = row.get("short") or {}, row.get("long") or {}
        judged += row["within"] != "n/a"
        within += row["within"] in ("yes", "same config")
        ratio = "-" if row["ratio"] is None else f"{row['ratio']:.3f}"
        lines.append(f"| {row['label']} | {row['shape']} | {config_summary(short.get('config'))} | "
                     f"{config_summary(long_.get('config'))} | {_timed(row, 'short')} | {_timed(row, 'long')} | "
                     f"{_timed(row, 'F.linear')} | {_timed(row, 'torch.matmul')} | {ratio} | {row['within']} |")
    lines += ["", (f"**Within 2% on {within} of {judged} problems**" if judged else "**No problem could be judged**")
              + f" ({len(rows)} sampled; short / long <= {1 + WITHIN:.2f}).", ""]
    long_run = meta["long_run"]
    lines.append(f"- Long studies: {long_run['seconds']:.1f} s for {len(rows)} problem(s) (tune_planned's wall "
                 f"time, trial worker start-up included; budget {long_run['budget_s']:.0f} s).")
    if meta.get("short_run"):
        lines.append(f"- Short studies re-run: {meta['short_run']['seconds']:.1f} s (after the long ones, in the "
                     "same session: the trial worker already up, Triton's cache warm).")
    for problem_key, reason in {**long_run["failed"], **(meta.get("short_run") or {}).get("failed", {})}.items():
        lines.append(f"- failed: {problem_key}: {reason}")
    lines += ["", "## Per problem", ""]
    for row in rows:
        lines.append(_notes(row))
    return "\n".join(lines) + "\n"


def _study_note(name: str, part: dict) -> str:
    if not part:
        return f"  - {name}: none"
    if "missing" in part:
        return f"  - {name}: {part['missing']}"
    text = (f"  - {name}: {config_summary(part.get('config'))}, stored at {_us(part.get('winner_ms'))} us "
            f"({part.get('baseline_name') or 'baseline'} {_us(part.get('baseline_ms'))} us), "
            f"{part.get('trials')} trials")
    if "seconds" in part:
        text += f" in {part['seconds']:.1f} s"
        if part.get("stopped_early"):
            text += f"; stopped early: {part['stopped_early']}"
        if part.get("cut"):
            text += "; CUT by its share of the budget before its trial count"
    if part.get("verified_range"):
        text += f"; verified over {part['verified_range']}"
    return text + f"\n    `{json.dumps(part.get('config'), sort_keys=True)}`"


def _notes(row: dict) -> str:
    parts = [f"- **{row['label']}** ({row['shape']}): `{row['problem_key']}`",
             _study_note("short", row.get("short")), _study_note("long", row.get("long"))]
    checks = (row.get("timing") or {}).get("checks", {})
    bad = [f"{name}: {c['status']} {c['message']}" for name, c in checks.items() if not c["ok"]]
    if bad:
        parts.append("  - not timed: " + "; ".join(bad))
    if row.get("timing_error"):
        parts.append(f"  - timing failed: {row['timing_error']}")
    if row.get("same_config"):
        parts.append("  - both studies chose the same config: short / long shows the timing noise")
    return "\n".join(parts)


def write_report(out: Path, text: str, rows: list[dict], meta: dict) -> tuple[Path, Path]:
    """markdown to `out` (a .md file, or a folder that gets study_length.md), JSON beside it."""
    md = out / "study_length.md" if out.is_dir() or not out.suffix else out
    md.parent.mkdir(parents=True, exist_ok=True)
    md.write_text(text)
    raw = md.with_suffix(".json")
    raw.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2, default=str) + "\n")
    return md, raw


# --- the run -----------------------------------------------------------------------------------------

def measure(args, scratch: Path) -> tuple[list[dict], dict]:
    """Tune (long, then short when re-run), then time each problem's two winners side by side."""
    from autotile.device import interpret_device, resolve_gpu
    from autotile.families.gemm import FAMILY
    from autotile.models import model_dims
    from autotile.store.db import read_only_url
    from autotile.tune.session import TuneSession

    device = interpret_device() if args.smoke else resolve_gpu("auto")
    model = model_dims("smoke", SMOKE_DIMS) if args.smoke else model_dims(MODEL)
    samples = sample_problems(model, SMOKE_SAMPLES if args.smoke else SAMPLES, args.dtype)
    planned = [item for _, item in samples]
    settings = SMOKE_SETTINGS if args.smoke else SETTINGS
    meta = {"model": model.name, "device_key": device.key, "short_trials": settings["short"][0],
            "short_patience": settings["short"][1], "long_trials": settings["long"][0],
            "long_patience": settings["long"][1], "rerun_short": args.rerun_short}
    with TuneSession() as session:  # one trial worker and compile pool for every study of the run
        meta["long_run"] = tune_studies(planned, device, *settings["long"], f"sqlite:///{scratch / 'long.sqlite'}",
                                        args.long_budget_s, "long")
        if args.rerun_short:
            meta["short_run"] = tune_studies(planned, device, *settings["short"],
                                             f"sqlite:///{scratch / 'short.sqlite'}", args.short_budget_s, "short")
        stats = session.stats()
    meta["session"] = {"searches": stats.searches, "worker_starts": stats.worker_starts,
                       "worker_start_s": list(stats.worker_start_s)}
    shipped_url = read_only_url(args.shipped_db)
    toolchains = set()
    rows = []
    for label, item in samples:
        problem = item.problem
        key = FAMILY.problem_key(problem)
        row = {"label": label, "shape": f"{problem.m}x{problem.n}x{problem.k}", "problem_key": key}
        rows.append(row)
        if args.rerun_short:
            row["short"] = meta["short_run"]["results"].get(key) or {"missing": "the short study stored no winner"}
        else:
            found = shipped_winner(shipped_url, FAMILY, problem, device.key)
            row["short"] = found or {"missing": f"no winner for this problem on {device.key} in {args.shipped_db} "
                                                "(run with --rerun-short)"}
            if found:
                toolchains.add(", ".join(f"{k} {found['toolchain'][k]}" for k in ("torch", "triton", "cuda")))
        row["long"] = meta["long_run"]["results"].get(key) or {"missing": "the long study stored no winner"}
        configs = {"short": row["short"].get("config"), "long": row["long"].get("config")}
        row["same_config"] = bool(configs["short"]) and configs["short"] == configs["long"]
        print(f"{label} {row['shape']}: timing short {config_summary(configs['short'])} | long "
              f"{config_summary(configs['long'])} ...", file=sys.stderr, flush=True)
        try:
            row["timing"] = time_side_by_side(FAMILY, problem, device, configs, args.rounds)
        except Exception as exc:  # noqa: BLE001 - one problem's failure is reported, the others go on
            row["timing_error"] = f"{type(exc).__name__}: {exc}"[:500]
        ms = (row.get("timing") or {}).get("ms", {})
        row["ratio"], row["within"] = judge(ms.get("short"), ms.get("long"), row["same_config"])
    meta["shipped_toolchain"] = "; ".join(sorted(toolchains)) or "-"
    return rows, meta


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="markdown file (or folder) to write; JSON beside it")
    parser.add_argument("--rerun-short", action="store_true",
                        help="re-run the short studies (10 trials, patience 4) instead of taking the shipped winners")
    parser.add_argument("--smoke", action="store_true",
                        help="CPU interpreter, one tiny problem, 2- and 4-trial studies")
    parser.add_argument("--rounds", type=int, default=None,
                        help=f"interleaved timing rounds (default {TIMING_ROUNDS})")
    parser.add_argument("--long-budget-s", type=float, default=LONG_BUDGET_S, help="seconds for all long studies")
    parser.add_argument("--short-budget-s", type=float, default=SHORT_BUDGET_S,
                        help="seconds for the re-run short studies")
    parser.add_argument("--shipped-db", type=Path, default=None, help="the shipped database (default: tuning_db/)")
    args = parser.parse_args(argv)
    args.rerun_short = args.rerun_short or args.smoke  # the shipped tables hold no interpreter winners
    args.rounds = args.rounds or (1 if args.smoke else TIMING_ROUNDS)
    args.dtype = "fp16" if args.smoke else "bf16"  # NOTE: the interpreter's bf16 dot is unreliable
    if args.shipped_db is None:
        from autotile.resources import shipped_db_path

        args.shipped_db = shipped_db_path()

    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="autotile-study-length-") as scratch:
        # Fresh kernel caches, so the studies' wall time includes their compiles, as a first run's does; the trial
        # worker and compile pool inherit them.
        os.environ["TRITON_CACHE_DIR"] = str(Path(scratch) / "triton")
        os.environ["AUTOTILE_CACHE_DIR"] = str(Path(scratch) / "kernels")
        import torch

        if not args.smoke and not torch.cuda.is_available():
            print("no CUDA GPU here: run on a GPU machine, or pass --smoke to check the script on the CPU interpreter",
                  file=sys.stderr)
            return 1
        rows, meta = measure(args, Path(scratch))
    import triton

    device = "Triton CPU interpreter (smoke: CPU timings)" if args.smoke else torch.cuda.get_device_name()
    meta.update(date=datetime.date.today().isoformat(), dtype=args.dtype, rounds=args.rounds, device=device,
                torch=torch.__version__, triton=triton.__version__, shipped_db=str(args.shipped_db),
                total_s=time.monotonic() - started)
    text = markdown(rows, meta)
    md, raw = write_report(args.out, text, rows, meta)
    print(text)
    print(f"wrote {md} and {raw} ({meta['total_s']:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
