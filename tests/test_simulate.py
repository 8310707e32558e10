"""Offline simulation: tables from files and databases, the tuner's loop on stored timings, replays, early stop."""
from __future__ import annotations

import functools
import json
import random
import sys

import pytest
from click.testing import CliRunner

from autotile.bench import Timing
from autotile.device import interpret_device
from autotile.families.gemm import GemmFamily, contiguous_problem
from autotile.space import Config
from autotile.store.db import open_engine
from autotile.store.repo import Store
from autotile.tune.driver import tune_problem
from autotile.tune.simulate import (
    SYNTHETIC_NOTE, SimulationError, Strategy, TimingTable, load_table, replay, row_record, summarise,
    synthetic_device, synthetic_table, table_header, write_rows,
)

CPU = interpret_device()
H200 = synthetic_device()
PROBLEM = contiguous_problem(1024, 1024, 1024, "bf16", "bf16")


class NeverRuns(GemmFamily):
    """A gemm family whose kernels must not run: a simulation answers every trial from its table."""

    def launch(self, problem, config, inputs, outputs):
        raise AssertionError("a simulated trial ran a kernel")

    def make_inputs(self, problem, device, seed=0):
        raise AssertionError("a simulated trial built inputs")


FAMILY = NeverRuns()


@functools.cache
def _feasible() -> tuple[Config, ...]:
    """PROBLEM's feasible H200 space, in the order the space yields it: enumerated once (~20k configs, seconds)."""
    return tuple(FAMILY.space(PROBLEM, H200).feasible())


@pytest.fixture(scope="module")
def table() -> TimingTable:
    """A sampled, synthesised H200 table of PROBLEM: 300 configs plus the default and the seed configs."""
    configs = random.Random(0).sample(list(_feasible()), 300)
    configs += [FAMILY.default_config(PROBLEM, H200), *FAMILY.seed_configs(PROBLEM, H200)]
    return synthetic_table(FAMILY, PROBLEM, H200, list(dict.fromkeys(configs)))


def _write(path, table: TimingTable, extra: list[dict] = ()) -> None:
    header = table_header(FAMILY, PROBLEM, table.device, table.space_size, table.note)
    records = [row_record(r.config, r.status, Timing(r.median_ms, r.q20_ms, r.q80_ms) if r.median_ms else None,
                          r.error) for r in table.rows.values()]
    write_rows(path, header, records + list(extra))


def test_jsonl_round_trip_running_rows_vendor_and_a_cut_last_line(tmp_path, table):
    path = tmp_path / "t.jsonl"
    died = next(iter(table.rows.values())).config
    _write(path, table, [{"config": dict(died), "status": "running"},
                         {"config": {"VENDOR": "cublas"}, "status": "ok", "median_ms": 0.05}])
    with path.open("a") as handle:
        handle.write('{"config": {"BLOCK_M": 1')  # a writer killed mid-line
    loaded = load_table(path, FAMILY, PROBLEM)
    assert len(loaded) == len(table) and loaded.device.key == "h200/sm90" and loaded.source == str(path)
    assert loaded.lookup(died).status == "crash"  # the measuring process died on it
    assert loaded.vendor_ms == {'{"VENDOR":"cublas"}': 0.05} and loaded.best_vendor_ms == 0.05
    other = next(h for h in table.rows if table.rows[h].config != died and table.rows[h].status == "ok")
    assert loaded.rows[other].median_ms == table.rows[other].median_ms
    assert SYNTHETIC_NOTE in loaded.note
    with pytest.raises(SimulationError, match="not gemm"):
        load_table(path, FAMILY, contiguous_problem(64, 64, 64, "bf16", "bf16"))
    with pytest.raises(SimulationError, match="measured on h200/sm90, not a100"):
        load_table(path, FAMILY, PROBLEM, "a100")
    assert load_table(tmp_path, FAMILY, PROBLEM).source == str(tmp_path)  # a folder: the matching table


def test_table_from_an_autotile_database(tmp_path):
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    store = Store(open_engine(url))
    problem_id, device_id, toolchain_id = (store.ensure_problem(FAMILY, PROBLEM), store.ensure_device(H200),
                                           store.ensure_toolchain())
    a, b = FAMILY.default_config(PROBLEM, H200), FAMILY.seed_configs(PROBLEM, H200)[0]
    rows = [("s", 0, a, "ok", 0.5), ("s", 1, b, "wrong_result", None), ("t", 0, a, "ok", 0.4),
            ("s:vendor", 0, Config(VENDOR="cublas"), "ok", 0.3)]
    for study, number, config, status, ms in rows:
        store.record_trial(problem_id=problem_id, device_id=device_id, toolchain_id=toolchain_id, study=study,
                           number=number, config=config.to_json(), config_hash=config.hash, status=status,
                           median_ms=ms, q20_ms=ms, q80_ms=ms, error="" if ms else "mismatch")
    loaded = load_table(tmp_path / "db.sqlite", FAMILY, PROBLEM)
    assert loaded.lookup(a).median_ms == 0.4  # the best of its trials
    assert loaded.lookup(b).status == "wrong_result" and len(loaded) == 2
    assert loaded.best_vendor_ms == 0.3 and loaded.device.key == "h200/sm90" and loaded.device.sm_count == 132
    with pytest.raises(SimulationError, match="no trials"):
        load_table(tmp_path / "db.sqlite", FAMILY, contiguous_problem(8, 8, 8, "bf16", "bf16"))


@pytest.fixture(scope="module")
def tuned(table):
    """(result, the configs evaluated in order, seed) of a 35-trial simulated study: a seed whose TPE proposals leave
    the table at least once (which seeds do depends on the space's axes), shared by the tests below. Seeds 1-35 did
    not when it was written; trying 36 first saves their ~35 s, and the others are still tried if the space changes."""
    for seed in (36, *range(1, 36), *range(37, 40)):
        evaluated = []
        # 35 trials: the first 19 are the default and the seeds, answered from the table before TPE proposes.
        result = tune_problem(FAMILY, PROBLEM, H200, trials=35, seed=seed, simulate=table, warm_start=False,
                              progress=lambda p: evaluated.append(p.last_config))
        if result.never_measured:
            return result, evaluated, seed
    pytest.fail("no seed of 1-39 proposed a config outside the table")


def test_the_tuner_runs_on_stored_timings_only(table, tuned):
    """Every trial is answered from the table (the family cannot run a kernel); the winner is the best evaluated."""
    result, evaluated, _ = tuned
    assert result.simulated and sum(result.statuses.values()) == 35 == len(evaluated)
    assert len({c.hash for c in evaluated}) == 35 and all(table.lookup(c) is not None for c in evaluated)
    ok = [table.lookup(c).median_ms for c in evaluated if table.lookup(c).status == "ok"]
    assert result.winner_ms == min(ok)
    assert evaluated[0] == FAMILY.default_config(PROBLEM, H200)  # the default config goes first, as in any study
    # The table holds 300 of the ~thousands of configs: TPE proposed others, which were replaced and counted.
    assert result.never_measured > 0 and result.winner_ms == table.lookup(result.winner).median_ms


def test_replay_runs_the_tuners_search(table, tuned):
    """The in-memory replay proposes exactly the configs the tuner's own loop evaluates, seed for seed."""
    _, configs, seed = tuned
    assert replay(FAMILY, PROBLEM, table, Strategy.TPE, seed, 35, prune=True).evaluated == [c.hash for c in configs]
    evaluated = []
    tune_problem(FAMILY, PROBLEM, H200, trials=20, seed=5, simulate=table, warm_start=False,
                 progress=lambda p: evaluated.append(p.last_config.hash))
    assert replay(FAMILY, PROBLEM, table, Strategy.TPE, 5, 20, prune=True).evaluated == evaluated


def test_replay_strategies_and_summary(table):
    best = table.best_ms
    randoms = [replay(FAMILY, PROBLEM, table, Strategy.RANDOM, seed, 40) for seed in range(3)]
    assert all(len(set(r.evaluated)) == 40 for r in randoms)  # without replacement
    assert randoms[0].evaluated != randoms[1].evaluated
    everything = replay(FAMILY, PROBLEM, table, Strategy.RANDOM, 0, 10_000)
    assert len(everything.evaluated) == len(table) and min(t for t in everything.times if t) == best
    assert everything.evaluations_to(best) == everything.times.index(best) + 1
    default = FAMILY.default_config(PROBLEM, H200)
    ranked = sorted(table.ok_rows(), key=lambda r: r.median_ms)
    # The best config but the default (the study runs the default first), as if a neighbour's winner were this one.
    warm = next(r.config for r in ranked if r.config != default)
    warmed = replay(FAMILY, PROBLEM, table, Strategy.TPE_WARM, 0, 5, warm=[warm])
    assert warmed.evaluated[:2] == [default.hash, warm.hash]
    reached = 1 if ranked[0].config == default else 2
    assert warmed.evaluations_to(best) == reached
    summary = summarise([warmed, everything], best)
    assert summary[0.99]["median"] == pytest.approx((warmed.evaluations_to(best / 0.99)
                                                     + everything.evaluations_to(best / 0.99)) / 2)
    assert summary[0.99]["missed"] == 0
    assert summarise([randoms[0]], best / 10)[0.95]["missed"] == 1  # an unreachable target is missed, not reached
    with pytest.raises(SimulationError, match="unknown strategy"):
        replay(FAMILY, PROBLEM, table, "grid", 0, 3)


def test_warm_start_in_a_simulation_comes_from_the_other_tables_of_the_folder(tmp_path, table):
    """A folder of tables is a database of problems: a simulated study warm-starts from its neighbours' bests."""
    neighbour = contiguous_problem(2048, 1024, 1024, "bf16", "bf16")
    theirs = synthetic_table(FAMILY, neighbour, H200, [r.config for r in table.rows.values()])
    write_rows(tmp_path / "neighbour.jsonl", table_header(FAMILY, neighbour, H200, None, theirs.note),
               [row_record(r.config, r.status, Timing(r.median_ms, r.q20_ms, r.q80_ms) if r.median_ms else None)
                for r in theirs.rows.values()])
    _write(tmp_path / "mine.jsonl", table)
    their_best = min(theirs.ok_rows(), key=lambda r: r.median_ms).config
    evaluated = []
    result = tune_problem(FAMILY, PROBLEM, H200, trials=3, simulate=load_table(tmp_path, FAMILY, PROBLEM),
                          progress=lambda p: evaluated.append(p.last_config))
    assert evaluated[1] == their_best and "2048x1024x1024" in result.warm_start


def _flat_table(ms_by_rank: list[float], vendor_ms: float | None) -> TimingTable:
    """A table where the i-th config of the space (in the order the search meets them) takes ms_by_rank[i]."""
    configs = [FAMILY.default_config(PROBLEM, H200), *_feasible()[:200]]
    configs = list(dict.fromkeys(configs))
    rows = {}
    from autotile.tune.simulate import TableRow

    for i, config in enumerate(configs):
        ms = ms_by_rank[i] if i < len(ms_by_rank) else ms_by_rank[-1] * (1.5 + 0.001 * i)
        rows[config.hash] = TableRow(config, "ok", ms, ms, ms)
    return TimingTable("gemm", {}, H200, rows, {'{"VENDOR":"cublas"}': vendor_ms} if vendor_ms else {})


@pytest.mark.parametrize("vendor, evaluations, why", [
    (None, 5, "no improvement in 4 trials"), (2.0, 5, "faster than the vendor op"),
    ("floor", 5, "no config can beat it"), (0.5, 9, "stays ahead")])
def test_early_stop_waits_for_the_vendor_op(vendor, evaluations, why):
    """Patience 4, and the default config (evaluated first) is the best of the table: the best stops improving at
    once. No vendor op, one slower than the best, or one at the roofline floor (nothing can beat it): stop after 4
    more trials. A vendor faster than anything yet but not at the floor: go on to twice the patience."""
    from autotile.tune.prune import Pruner

    if vendor == "floor":
        vendor = Pruner.for_problem(FAMILY, PROBLEM, H200, list(_feasible())).floor_ms()
    table = _flat_table([1.0], vendor)
    result = tune_problem(FAMILY, PROBLEM, H200, trials=60, simulate=table, patience=4, prune=False,
                          warm_start=False)
    assert sum(result.statuses.values()) == evaluations and why in result.stopped_early
    assert result.winner_ms == 1.0


def test_no_early_stop_without_patience():
    result = tune_problem(FAMILY, PROBLEM, H200, trials=12, simulate=_flat_table([1.0], None), prune=False,
                          warm_start=False)
    assert sum(result.statuses.values()) == 12 and result.stopped_early == ""


def test_simulate_command(tmp_path, table):
    from autotile.cli.main import cli

    path = tmp_path / "t.jsonl"
    _write(path, table)
    out = CliRunner().invoke(cli, ["tune", "gemm", "--m", "1024", "--n", "1024", "--k", "1024", "--dtype", "bf16",
                                   "--trials", "12", "--simulate", str(path), "--patience", "50"])
    assert out.exit_code == 0, out.output
    assert "12 evaluations reached" in out.output and "of the table's best" in out.output
    assert "SYNTHESISED" in out.output and "h200/sm90" in out.output
    missing = CliRunner().invoke(cli, ["tune", "gemm", "--m", "8", "--n", "8", "--k", "8", "--simulate", str(path)])
    assert missing.exit_code != 0 and "holds gemm" in missing.output


def test_search_efficiency_benchmark_measures_resumes_and_simulates(tmp_path, monkeypatch):
    """benchmarks/search_efficiency.py on the CPU: --measure on the interpreter's tiny problems (resumable; a
    config the process died on is filed as a crash), then --simulate on those tables and on synthesised ones."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "search_efficiency.py"
    spec = importlib.util.spec_from_file_location("search_efficiency", path)
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, bench)  # its dataclasses look their module up there
    spec.loader.exec_module(bench)
    tables = tmp_path / "tables"
    args = ["--measure", "--interpret", "--sample", "2", "--budget-s", "120", "--tables", str(tables)]
    assert bench.main(args + ["--out", str(tmp_path / "m.md")]) == 0
    first = sorted(tables.glob("*.jsonl"))
    assert len(first) == 2 and "| 0 |" in (tmp_path / "m.md").read_text()  # nothing left of either sample
    lines = first[0].read_text().splitlines()
    died = json.loads(lines[-1])["config"]
    first[0].write_text("\n".join(lines + [json.dumps({"config": died, "status": "running"})]) + "\n")
    assert bench.main(args + ["--out", str(tmp_path / "again.md")]) == 0
    assert "| 0 | 0 |" in (tmp_path / "again.md").read_text()  # resumed: nothing measured twice
    assert load_table(first[0], FAMILY, FAMILY.problem_from_dict(
        json.loads(lines[0])["problem"])).lookup(Config(died)).status == "crash"
    out = tmp_path / "sim.md"
    assert bench.main(["--simulate", "--interpret", "--seeds", "2", "--tables", str(tables), "--out", str(out)]) == 0
    text = out.read_text()
    assert "TRITON INTERPRETER" in text and "24x32x64" in text and "No model for this problem" in text
    assert "| tpe+warm |" in text and "## Target" in text
    synthetic = tmp_path / "synthetic.md"
    assert bench.main(["--simulate", "--synthetic", "--seeds", "2", "--sample", "30", "--out", str(synthetic)]) == 0
    text = synthetic.read_text()
    assert "SYNTHESISED" in text and text.count("## gemm") == 3 and "## flash" in text
    assert "ruled out the table's best config before it was evaluated in" in text
