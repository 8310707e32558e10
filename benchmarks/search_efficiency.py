"""Search efficiency: how many evaluations random search, TPE and TPE with a warm start need to find the best.

The methodology of "Tuning the Tuner" (Kernel Tuner): time a (sampled) space once, keep the table, then
replay search strategies on it many times offline.

(a) On the GPU, `--measure` times configs of 3 GEMM shapes and 1 flash shape and appends them to
    JSON-lines tables under --tables (default benchmarks/results/search_space_h200/), one per problem:

        PYTHONPATH=. python benchmarks/search_efficiency.py --measure --quick --out benchmarks/results/search_measure.md

    Each shape's feasible space (21,776 configs for a large bf16 GEMM on the H200) is far too big to time whole
    in minutes, so it is SAMPLED: the configs whose hashes sort first (a fixed, uniform sample that a longer run
    extends), plus the family's default and seed configs, plus the vendor op. The sample is not pruned by the
    roofline model, so the simulation can count the winners the model would have dropped. Configs compile in
    a pool of CPU processes (Triton's disk cache hands them to the timing process) while the GPU checks each
    against the float64/float32 reference and times it (short do_bench: 5 ms warm-up, 20 ms of runs with
    --quick). A run stops at --budget-s and is resumable: run it again to measure more of the sample; a
    config the process died on is filed as `crash`. --quick (300 GEMM configs a shape, the whole flash space)
    fits in about 4 minutes on an H200; without it, 1500 a shape over several runs.

(b) On the CPU, `--simulate` replays strategies on the tables: random search, TPE (the tuner's sampler and
    rules: default and seed configs first), TPE with a warm start from the OTHER shapes' tables (as a new problem
    gets it from the user's database; with --shipped-warm also from the shipped tuning_db/ winners of other
    problems; the table's own problem never seeds its own search), and the same with the roofline pruning. 20 seeds each; best-so-far
    against evaluations (median and spread) and evaluations to reach 95%, 98% and 99% of the table's best;
    how often the pruning model ruled out the table's best config. Writes markdown to --out:

        python benchmarks/search_efficiency.py --simulate --out benchmarks/results/search_efficiency.md

    Until GPU tables exist, `--synthetic` replays tables SYNTHESISED from the roofline model (labelled so
    everywhere): it checks the method, not the tuner.

Target (issue 15): TPE with a warm start reaches 98% of the best in at most 10% of the table's evaluations
(median over seeds).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from autotile.bench import Status, Timing, TrialOutcome, classify_exception, prepare, run_checked  # noqa: E402
from autotile.device import DeviceInfo  # noqa: E402
from autotile.families.base import Family  # noqa: E402
from autotile.space import Config  # noqa: E402
from autotile.tune.simulate import (  # noqa: E402
    RUNNING, Replay, Strategy, TimingTable, read_tables, replay, row_record, simulated_space, summarise,
    synthetic_device, synthetic_table, table_configs_best_first, table_header, write_rows,
)

DEFAULT_TABLES = Path(__file__).resolve().parent / "results" / "search_space_h200"
# Sampled GEMM configs a shape: --quick, and a full run (measured over several resumable runs).
QUICK_SAMPLE = 300
FULL_SAMPLE = 1500
# do_bench budget a config (ms of warm-up, ms of timed runs): short, as Inductor's max-autotune times its choices.
QUICK_BENCH = (5, 20)
FULL_BENCH = (10, 50)
# Seconds of measuring one --measure run may spend (start-up excluded): --quick, and a full run.
QUICK_BUDGET_S = 200.0
FULL_BUDGET_S = 540.0
# Seeds of each strategy in the simulation.
SEEDS = 20
# Levels of the table's best reported: a strategy reaches level L once its best time <= best / L.
LEVELS = (0.95, 0.98, 0.99)
TARGET_LEVEL, TARGET_SHARE = 0.98, 0.10
# Evaluations at which best-so-far is shown.
CHECKPOINTS = (5, 10, 20, 40, 80, 160)
# Share of a table a TPE replay may evaluate (random search may evaluate the whole table: it is cheap).
TPE_BUDGET_SHARE = 0.3
# A space of at most this many feasible configs is measured whole (the flash shape's 492), not sampled: a sample
# leaves holes next to the best configs that a search cannot step through.
WHOLE_SPACE_UP_TO = 600


def problems() -> list[tuple[str, Family, object]]:
    """(label, family, problem): the 3 GEMM shapes and the flash shape of the benchmark."""
    from autotile.families.flash import FAMILY as FLASH
    from autotile.families.flash import FlashProblem
    from autotile.families.gemm import FAMILY as GEMM
    from autotile.families.gemm import contiguous_problem

    return [
        ("gemm 4096x4096x4096 bf16", GEMM, contiguous_problem(4096, 4096, 4096, "bf16", "bf16")),
        ("gemm 16x14336x4096 bf16 nn.Linear (B = W.T)", GEMM,
         contiguous_problem(16, 14336, 4096, "bf16", "bf16", layout_b="col")),
        ("gemm 3000x5000x1536 bf16", GEMM, contiguous_problem(3000, 5000, 1536, "bf16", "bf16")),
        ("flash fwd B2 H32/8 S4096 D128 causal bf16 (Llama-3-8B prefill)", FLASH,
         FlashProblem("fwd", batch=2, heads_q=32, heads_kv=8, seq_q=4096, seq_k=4096, head_dim=128, causal=True,
                      dtype="bf16")),
    ]


def interpret_problems() -> list[tuple[str, Family, object]]:
    """Tiny problems for checking --measure itself on the CPU interpreter."""
    from autotile.families.gemm import FAMILY as GEMM
    from autotile.families.gemm import contiguous_problem

    return [("gemm 24x32x64 fp32 (interpreter)", GEMM, contiguous_problem(24, 32, 64, "fp32", "fp32")),
            ("gemm 40x32x64 fp32 (interpreter)", GEMM, contiguous_problem(40, 32, 64, "fp32", "fp32"))]


def slug(label: str) -> str:
    return "".join(ch if ch.isalnum() else "_" for ch in label.split(" (")[0]).strip("_").lower()


def sample_configs(family: Family, problem, device: DeviceInfo, size: int, whole: bool = True
                   ) -> tuple[list[Config], int]:
    """(the sample, the size of the feasible space): default and seed configs, then the `size` configs whose
    hashes sort first (uniform, fixed; a larger size extends a smaller one); with `whole` (no --sample given),
    a space of at most WHOLE_SPACE_UP_TO configs whole."""
    feasible = list(family.space(problem, device).feasible())
    size = max(size, len(feasible)) if whole and len(feasible) <= WHOLE_SPACE_UP_TO else size
    ordered = sorted(feasible, key=lambda c: c.hash)[:size]
    first = [family.default_config(problem, device), *family.seed_configs(problem, device)]
    return list(dict.fromkeys([*first, *ordered])), len(feasible)


# --- (a) measuring ----------------------------------------------------------------------------------
def measure_one(family: Family, problem, config: Config, device: DeviceInfo, prepared, bench: tuple[int, int]
                ) -> TrialOutcome:
    """Correctness gate against the reference, then a short do_bench (wall clock under the interpreter)."""
    from autotile.bench import time_fn

    outcome, inputs = run_checked(family, problem, config, device, 0, prepared)
    if outcome.status is not Status.OK:
        return outcome
    try:
        outputs = family.allocate_outputs(problem, inputs)
        fn = family.timed_call(problem, config, inputs, outputs)
        if device.interpret:
            timing = time_fn(fn, device)
        else:
            import triton.testing

            q20, median, q80 = triton.testing.do_bench(fn, warmup=bench[0], rep=bench[1], quantiles=[0.2, 0.5, 0.8])
            timing = Timing(float(median), float(q20), float(q80))
    except Exception as exc:  # noqa: BLE001 - a failure is a status, as in any trial
        return TrialOutcome(classify_exception(exc), error=f"{type(exc).__name__}: {exc}"[:300])
    return TrialOutcome(Status.OK, timing, max_abs_error=outcome.max_abs_error)


def _done(path: Path) -> dict[str, str]:
    """config hash -> last status recorded in a table file (RUNNING: the process died on it)."""
    import json

    done = {}
    if not path.exists():
        return done
    for number, line in enumerate(path.read_text().splitlines()):
        if number == 0 or not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a kill
        done[Config(record["config"]).hash] = record["status"]
    return done


def measure_problem(label: str, family: Family, problem, device: DeviceInfo, tables: Path, size: tuple[int, bool],
                    bench: tuple[int, int], deadline: float, processes: int) -> dict:
    """Measure what is left of one problem's sample before `deadline`; returns what was done."""
    from autotile.tune.compile_ahead import start_compile_ahead

    started = time.monotonic()
    path = tables / f"{slug(label)}.jsonl"
    # size: (configs, whether a small space is measured whole: not when --sample asked for an exact sample)
    sample, space_size = sample_configs(family, problem, device, size[0], whole=size[1])
    note = (f"sampled: {len(sample)} of {space_size} feasible configs (default, seeds, then by config hash); "
            f"do_bench warm-up {bench[0]} ms, {bench[1]} ms of runs; measured {datetime.date.today()}"
            + ("; TRITON INTERPRETER timings (CPU)" if device.interpret else ""))
    header = table_header(family, problem, device, space_size, note)
    done = _done(path)
    crashed = [h for h, status in done.items() if status == RUNNING]
    for config in sample:  # the process died on these last time: filed as crashes, not run again
        if config.hash in crashed:
            write_rows(path, header, [row_record(config, Status.CRASH.value, error="the measuring process died on it")])
    pending = [c for c in sample if c.hash not in done]
    prepared = prepare(family, problem, device, seed=0)
    vendor = [c for c in family.vendor_configs(problem, device) if c.hash not in done]
    for config in vendor:
        outcome = measure_one(family, problem, config, device, prepared, bench)
        write_rows(path, header, [row_record(config, outcome.status.value, outcome.timing, outcome.error)])
    if not device.interpret and pending:
        compiler = start_compile_ahead(family, problem, device, seed=0, enabled=True, processes=processes)
    else:
        compiler = start_compile_ahead(family, problem, device, seed=0, enabled=False)
    measured = 0
    try:
        compiler.submit(pending)
        for config in pending:
            if time.monotonic() > deadline:
                break
            compiler.wait_for(config, 120.0)
            write_rows(path, header, [row_record(config, RUNNING)])  # a crash that kills us leaves this behind
            outcome = measure_one(family, problem, config, device, prepared, bench)
            write_rows(path, header, [row_record(config, outcome.status.value, outcome.timing, outcome.error)])
            measured += 1
    finally:
        compiler.close()
    left = len(pending) - measured
    return {"label": label, "path": str(path), "space": space_size, "sample": len(sample),
            "measured_now": measured, "left": left, "seconds": time.monotonic() - started}


def run_measure(args) -> str:
    from autotile.device import interpret_device, resolve_gpu

    device = interpret_device() if args.interpret else resolve_gpu("auto")
    if device.interpret and not args.interpret:
        raise SystemExit("--measure needs a GPU (or --interpret to check the script on the CPU interpreter)")
    chosen = interpret_problems() if args.interpret else problems()
    size = (args.sample or (QUICK_SAMPLE if args.quick else FULL_SAMPLE), args.sample is None)
    bench = QUICK_BENCH if args.quick else FULL_BENCH
    budget = args.budget_s or (QUICK_BUDGET_S if args.quick else FULL_BUDGET_S)
    processes = max(1, min(15, (os.cpu_count() or 2) - 1))
    args.tables.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    rows = []
    for number, (label, family, problem) in enumerate(chosen):
        # An equal share of what is left, so a slow shape cannot starve the next ones.
        share = (budget - (time.monotonic() - started)) / (len(chosen) - number)
        rows.append(measure_problem(label, family, problem, device, args.tables, size, bench,
                                    time.monotonic() + max(share, 1.0), processes))
        print(f"{label}: {rows[-1]['measured_now']} measured, {rows[-1]['left']} of the sample left", flush=True)
    lines = [f"# Search-space tables, {device.name}, {datetime.date.today()}", "",
             f"Sample of {size} configs a shape (plus default and seeds); do_bench {bench[0]}/{bench[1]} ms; "
             f"{processes} compile processes; budget {budget:.0f} s. Tables: `{args.tables}`.", "",
             "| problem | feasible configs | sample | measured this run | left | seconds |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['label']} | {r['space']} | {r['sample']} | {r['measured_now']} | {r['left']} | "
                     f"{r['seconds']:.0f} |")
    if any(r["left"] for r in rows):
        lines += ["", "Samples not finished: run the same command again to measure the rest."]
    return "\n".join(lines) + "\n"


# --- (b) simulation ---------------------------------------------------------------------------------
@dataclasses.dataclass
class Outcome:
    label: str
    table: TimingTable
    replays: dict[str, list[Replay]]
    warm_from: str
    loo_dropped: bool | None  # the model, calibrated on every other config, rules out the best
    near_best_dropped: int  # configs within 2% of the best that the fully calibrated model rules out


def load_or_synthesise(args) -> tuple[list[tuple[str, Family, object, TimingTable]], str]:
    chosen = interpret_problems() if args.interpret else problems()
    if args.synthetic:
        device = synthetic_device()
        out = []
        for label, family, problem in chosen:
            # As with --measure: an explicit --sample is the exact sample, even of a space small enough to take whole.
            sample, space = sample_configs(family, problem, device, args.sample or QUICK_SAMPLE,
                                           whole=args.sample is None)
            table = synthetic_table(family, problem, device, sample)
            table.space_size = space
            out.append((label, family, problem, table))
        return out, "SYNTHESISED tables (roofline model x per-axis factors x noise): a check of the method only"
    tables = read_tables(args.tables)
    out = []
    for label, family, problem in chosen:
        key = family.problem_key(problem)
        match = [t for t in tables if t.family == family.name and _key_of(family, t) == key]
        if match:
            out.append((label, family, problem, match[0]))
    if not out:
        raise SystemExit(f"no tables of the benchmark's problems in {args.tables}: run --measure on a GPU first, "
                         "or pass --synthetic")
    interpreted = any(t.device.interpret for *_, t in out)
    source = f"tables in `{args.tables}` measured on {out[0][3].device.name}"
    return out, source + (" (TRITON INTERPRETER timings)" if interpreted else "")


def _key_of(family: Family, table: TimingTable) -> str | None:
    try:
        return family.problem_key(family.problem_from_dict(table.problem))
    except Exception:  # noqa: BLE001
        return None


def shipped_neighbours(family: Family, device_key: str) -> list[tuple[object, list[Config]]]:
    """The shipped tuning_db/ winners of `family` on `device_key`, as (problem, [its winner]) pairs: what a user's
    first study warm-starts from besides its own database (autotile.tune.warmstart.warm_start)."""
    from autotile.tune.warmstart import best_configs, shipped_engine, tuned_problems

    engine = shipped_engine()
    if engine is None:
        return []
    return [(other, best_configs(engine, row_id, device_key)) for other, row_id in
            tuned_problems(engine, family, device_key)]


def warm_for(family: Family, problem, table: TimingTable, others: list[TimingTable], shipped: bool = False):
    """The warm start a new study of `problem` would get (autotile.tune.warmstart): from the other problems' tables
    (a user's database) and, with `shipped`, the shipped tuning_db/ winners of other problems. Neither ever holds
    the table's own problem (rank_neighbours leaves a problem's own key out): no leakage from the table."""
    from autotile.tune.warmstart import rank_neighbours, warm_configs

    tuned = [(family.problem_from_dict(t.problem), table_configs_best_first(t)) for t in others
             if t.family == family.name and t.device.key == table.device.key]
    if shipped:
        keys = {family.problem_key(p) for p, _ in tuned}
        tuned += [(p, c) for p, c in shipped_neighbours(family, table.device.key) if family.problem_key(p) not in keys]
    space = simulated_space(family.space(problem, table.device), table)
    return warm_configs(space, rank_neighbours(family, problem, tuned))


def model_checks(family: Family, problem, table: TimingTable) -> tuple[bool | None, int]:
    """(whether the model calibrated on every config but the best rules the best out, how many configs within 2%
    of the best the model calibrated on all of them rules out)."""
    from autotile.tune.prune import Pruner

    ok = table.ok_rows()
    configs = [r.config for r in ok]
    pruner = Pruner.for_problem(family, problem, table.device, configs, min_observed=1)
    if pruner is None or len(ok) < 2:
        return None, 0
    best = min(ok, key=lambda r: r.median_ms)
    for row in ok:
        if row is not best:
            pruner.observe(row.config, row.median_ms)
    loo = pruner.would_drop(best.config, best.median_ms)
    pruner.observe(best.config, best.median_ms)
    near = sum(1 for r in ok if r.median_ms <= best.median_ms * 1.02 and pruner.drops(r.config))
    return loo, near


def run_simulation(args) -> tuple[str, list[Outcome], str]:
    loaded, source = load_or_synthesise(args)
    outcomes = []
    for label, family, problem, table in loaded:
        others = [t for other_label, _, _, t in loaded if other_label != label]
        warm = warm_for(family, problem, table, others, shipped=args.shipped_warm)
        size = len(table)
        tpe_budget = max(20, math.ceil(TPE_BUDGET_SHARE * size))
        strategies = {
            "random": {"strategy": Strategy.RANDOM, "budget": size},
            "tpe": {"strategy": Strategy.TPE, "budget": tpe_budget},
            "tpe+warm": {"strategy": Strategy.TPE_WARM, "budget": tpe_budget, "warm": warm.configs},
            "tpe+warm+prune": {"strategy": Strategy.TPE_WARM, "budget": tpe_budget, "warm": warm.configs,
                               "prune": True},
        }
        replays = {}
        for name, kwargs in strategies.items():
            started = time.monotonic()
            replays[name] = [replay(family, problem, table, seed=seed, **kwargs) for seed in range(args.seeds)]
            print(f"{label}: {name} x {args.seeds} seeds in {time.monotonic() - started:.1f} s", flush=True)
        loo, near = model_checks(family, problem, table)
        outcomes.append(Outcome(label, table, replays, warm.describe(family), loo, near))
    return source, outcomes, markdown(source, outcomes, args.seeds, args.shipped_warm)


def _fmt(value: float, size: int) -> str:
    return "not reached" if not math.isfinite(value) else f"{value:.0f} ({value / size:.1%})"


def curve(replays: list[Replay], best: float, at: int) -> str:
    """Median (min-max) of best / best-so-far after `at` evaluations."""
    values = []
    for r in replays:
        so_far = r.best_so_far()
        if not so_far:
            continue
        current = so_far[min(at, len(so_far)) - 1]
        values.append(best / current if math.isfinite(current) else 0.0)
    if not values:
        return "-"
    return f"{np.median(values):.1%} ({min(values):.0%}-{max(values):.0%})"


def markdown(source: str, outcomes: list[Outcome], seeds: int, shipped: bool = False) -> str:
    lines = [f"# Search efficiency ({datetime.date.today()})", "", f"Data: {source}.", "",
             f"{seeds} seeds a strategy. `tpe` is the tuner's search (default and seed configs first, then TPE); "
             "`tpe+warm` adds the warm start a new problem gets from its neighbours (here: the OTHER shapes' tables"
             + (" and the shipped tuning_db/ winners of other problems" if shipped else "")
             + "; never the table's own problem); "
             "`+prune` drops configs the roofline model rules out. Evaluations to reach a level: median over seeds "
             "(share of the table), and the quartiles.", ""]
    verdicts = []
    for o in outcomes:
        t = o.table
        best = t.best_ms
        vendor = f"; vendor op {t.best_vendor_ms:.4g} ms" if t.best_vendor_ms else ""
        lines += [f"## {o.label}", "",
                  f"{len(t)} configs in the table ({t.space_size or '?'} feasible in the space; {t.note}); "
                  f"best {best:.4g} ms{vendor}. Warm start: {o.warm_from}.", "",
                  "| strategy | " + " | ".join(f"evals to {level:.0%}" for level in LEVELS)
                  + " | quartiles at 98% | missed at 98% |",
                  "|---|" + "---|" * (len(LEVELS) + 2)]
        for name, replays in o.replays.items():
            summary = summarise(replays, best, LEVELS)
            cells = [_fmt(summary[level]["median"], len(t)) for level in LEVELS]
            s98 = summary[0.98]
            lines.append(f"| {name} | " + " | ".join(cells)
                         + f" | {s98['q25']:.0f}-{s98['q75']:.0f} | {s98['missed']}/{len(replays)} |")
        lines += ["", "Best-so-far as a share of the table's best, median (min-max) over seeds:", "",
                  "| strategy | " + " | ".join(f"{n} evals" for n in CHECKPOINTS) + " |",
                  "|---|" + "---|" * len(CHECKPOINTS)]
        for name, replays in o.replays.items():
            lines.append(f"| {name} | " + " | ".join(curve(replays, best, n) for n in CHECKPOINTS) + " |")
        pruned = o.replays["tpe+warm+prune"]
        best_hash = min(t.ok_rows(), key=lambda r: r.median_ms).config.hash
        dropped_best = sum(1 for r in pruned if best_hash in r.model_dropped and best_hash not in r.evaluated)
        share = np.median([len(r.model_dropped) / len(t) for r in pruned])
        lines += ["", f"Pruning: the model ruled out a median {share:.0%} of the table during a search; it ruled out "
                  f"the table's best config before it was evaluated in {dropped_best} of {len(pruned)} searches. "
                  + ("Calibrated on every other config, it would rule the best out: "
                     f"{'YES' if o.loo_dropped else 'no'}; configs within 2% of the best it rules out once "
                     f"calibrated on all: {o.near_best_dropped}." if o.loo_dropped is not None
                     else "No model for this problem."), ""]
        warm98 = summarise(o.replays["tpe+warm"], best, (TARGET_LEVEL,))[TARGET_LEVEL]["median"]
        tuner98 = summarise(o.replays["tpe+warm+prune"], best, (TARGET_LEVEL,))[TARGET_LEVEL]["median"]
        met = math.isfinite(warm98) and warm98 <= TARGET_SHARE * len(t)
        verdicts.append((o.label, warm98, tuner98, len(t), met))
    lines += ["## Target", "",
              f"TPE with a warm start reaches {TARGET_LEVEL:.0%} of the best in at most {TARGET_SHARE:.0%} of the "
              "table's evaluations (median over seeds):", "",
              "| problem | evals to 98% (tpe+warm) | table | met | the tuner's default (tpe+warm+prune) |",
              "|---|---|---|---|---|"]
    for label, evals, tuner, size, met in verdicts:
        lines.append(f"| {label} | {_fmt(evals, size)} | {size} | {'yes' if met else 'NO'} | {_fmt(tuner, size)} |")
    lines += ["", "Tables are samples of the feasible spaces (see each note): the best is the best of the sample, and "
              "the share is of the sample's evaluations."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--measure", action="store_true", help="time the sampled spaces on the GPU into --tables")
    mode.add_argument("--simulate", action="store_true", help="replay search strategies on the tables (CPU)")
    parser.add_argument("--quick", action="store_true", help=f"measure {QUICK_SAMPLE} GEMM configs a shape, about 4 min")
    parser.add_argument("--tables", type=Path, default=DEFAULT_TABLES, help="folder of the timing tables")
    parser.add_argument("--out", type=Path, default=None, help="markdown file to write")
    parser.add_argument("--budget-s", type=float, default=None, help="seconds of measuring this run")
    parser.add_argument("--sample", type=int, default=None, help="configs a shape (overrides --quick)")
    parser.add_argument("--seeds", type=int, default=SEEDS)
    parser.add_argument("--shipped-warm", action="store_true",
                        help="warm-start from the shipped tuning_db/ winners of other problems too (the tuner's "
                             "warm_start(shipped=True))")
    parser.add_argument("--synthetic", action="store_true", help="simulate on tables synthesised from the model")
    parser.add_argument("--interpret", action="store_true",
                        help="tiny problems on the CPU interpreter (to check the script itself)")
    args = parser.parse_args(argv)
    if args.measure:
        text = run_measure(args)
    else:
        _, outcomes, text = run_simulation(args)
        print()
        print("| problem | table | random 98% | tpe 98% | tpe+warm 98% | tpe+warm+prune 98% |")
        print("|---|---|---|---|---|---|")
        for o in outcomes:
            cells = [_fmt(summarise(o.replays[n], o.table.best_ms, (0.98,))[0.98]["median"], len(o.table))
                     for n in ("random", "tpe", "tpe+warm", "tpe+warm+prune")]
            print(f"| {o.label} | {len(o.table)} | " + " | ".join(cells) + " |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    print(text if args.measure else f"\nwritten to {args.out}" if args.out else "")
    return 0


if __name__ == "__main__":
    sys.exit(main())
