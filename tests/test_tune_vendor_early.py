"""The tuner times the vendor op before its first search trial, stops early on that time, starts its worker
before it opens the study, and re-times its finalists as a race."""
from __future__ import annotations

import itertools
import time

import pytest

from autotile.bench import Timing
from autotile.device import interpret_device
from autotile.families.base import VENDOR_KEY
from autotile.families.gemm import GemmFamily, contiguous_problem
from autotile.space import Config
from autotile.store.db import open_engine
from autotile.store.repo import Store
from autotile.tune.driver import tune_problem, vendor_study
from autotile.tune.retime import race
from autotile.tune.session import TuneSession

CPU = interpret_device()
CUBLAS = Config({VENDOR_KEY: "cublas"})


class _SlowVendorGemm(GemmFamily):
    """The gemm family with torch.matmul on the CPU as its vendor op, slowed by `vendor_delay_s`."""

    def __init__(self, vendor_delay_s: float = 0.0):
        self.vendor_delay_s = vendor_delay_s

    def vendor_configs(self, problem, device):
        return [CUBLAS]

    def vendor_run(self, problem, config, inputs):
        time.sleep(self.vendor_delay_s)
        return super().vendor_run(problem, config, inputs)


@pytest.fixture
def url(tmp_path, monkeypatch):
    monkeypatch.setattr("autotile.resources.shipped_db_path", lambda: tmp_path / "none.sqlite")
    return f"sqlite:///{tmp_path / 'tune.sqlite'}"


def _rows(url: str, study: str) -> list[dict]:
    return [t for t in Store(open_engine(url, create=False)).trials() if t["study"] in (study, vendor_study(study))]


def test_the_vendor_op_is_timed_and_stored_before_the_first_search_trial(url):
    problem = contiguous_problem(12, 20, 24, "fp32", "fp32", layout_b="col")
    result = tune_problem(_SlowVendorGemm(), problem, CPU, trials=2, db_url=url, retime_rounds=0)
    rows = _rows(url, result.study)
    first = rows[0]  # trials() lists rows in the order they were recorded
    assert first["study"] == vendor_study(result.study) and first["config"] == {VENDOR_KEY: "cublas"}
    assert first["status"] == "ok" and first["median_ms"] > 0 and first["number"] == 0
    assert [r["study"] for r in rows[1:]] == [result.study] * 2  # the search's own trials follow
    assert result.trials_this_run == 2  # the vendor row is not a search trial


def test_a_rerun_keeps_the_earlier_vendor_rows_and_numbers_the_new_ones_after_them(url):
    problem = contiguous_problem(12, 20, 24, "fp32", "fp32", layout_b="col")
    first = tune_problem(_SlowVendorGemm(), problem, CPU, trials=1, db_url=url, retime_rounds=1)
    tune_problem(_SlowVendorGemm(), problem, CPU, trials=2, db_url=url, retime_rounds=1)
    vendor = [r for r in _rows(url, first.study) if r["study"] == vendor_study(first.study)]
    # Run 1: before its first trial, final re-timing; run 2: the same again.
    assert [r["number"] for r in vendor] == [0, 1, 2, 3] and {r["status"] for r in vendor} == {"ok"}


def test_the_early_stop_knows_the_vendor_time_from_the_first_trial(url, monkeypatch):
    # The vendor op sleeps 0.4 s a call: every interpreted kernel (tens of ms) beats it, so the search stops as
    # soon as the best has not improved for one trial, citing the vendor time it measured before trial 1. Only a
    # trial ten times as fast counts as an improvement here, so that CPU timing noise cannot keep the search going.
    from autotile.tune import search

    plain = search.stagnation
    monkeypatch.setattr(search, "stagnation", lambda times: plain(times, min_improvement=0.9))
    problem = contiguous_problem(12, 20, 24, "fp32", "fp32", layout_b="col")
    result = tune_problem(_SlowVendorGemm(vendor_delay_s=0.4), problem, CPU, trials=6, patience=1, db_url=url,
                          retime_rounds=0)
    assert "faster than the vendor op" in result.stopped_early, result.stopped_early
    cited = float(result.stopped_early.split("vendor op (")[1].split(" ms")[0])
    assert cited >= 400.0
    assert result.trials_this_run == 2



def test_a_vendor_op_timed_slow_once_is_timed_again_before_the_search_stops_on_it(url, monkeypatch):
    # The first vendor timing is disturbed (0.4 s a call, as beside a burst of compiles); by the time the search
    # would stop for having beaten it, the vendor op runs at its real speed (torch.matmul on the CPU: microseconds,
    # far ahead of any interpreted kernel). Timed again, it is ahead: the search goes on, and stops on that.
    from autotile.tune import search

    plain = search.stagnation
    monkeypatch.setattr(search, "stagnation", lambda times: plain(times, min_improvement=0.9))
    family = _SlowVendorGemm(vendor_delay_s=0.4)
    first_timing = search._Search._time_vendor

    def time_vendor(self, evaluator, when="before the first trial"):
        first_timing(self, evaluator, when)
        family.vendor_delay_s = 0.0

    monkeypatch.setattr(search._Search, "_time_vendor", time_vendor)
    problem = contiguous_problem(12, 20, 24, "fp32", "fp32", layout_b="col")
    result = tune_problem(family, problem, CPU, trials=8, patience=1, db_url=url, retime_rounds=0)
    assert "faster than the vendor op" not in result.stopped_early, result.stopped_early
    assert "the vendor op stays ahead" in result.stopped_early, result.stopped_early
    vendor_rows = [r for r in _rows(url, result.study) if r["study"] == vendor_study(result.study)]
    assert [r["status"] for r in vendor_rows][:2] == ["ok", "ok"]
    assert vendor_rows[0]["median_ms"] >= 400.0 > 10 * vendor_rows[1]["median_ms"]


def test_the_worker_started_before_the_study_is_the_one_the_search_uses(url):
    problem = contiguous_problem(12, 20, 24, "fp32", "fp32", layout_b="col")
    with TuneSession() as session:
        result = tune_problem(_SlowVendorGemm(), problem, CPU, trials=2, db_url=url, retime_rounds=0, isolate=True,
                              session=session)
        stats = session.stats()
    assert result.trials_this_run == 2 and result.winner is not None
    assert stats.worker_starts == 1, stats  # prestarted, then borrowed by the search: one process


def _clock(series: dict[str, list[float]]):
    """A fake `time_fn`: each callable returns its name; its times come from `series` in turn."""
    streams = {name: itertools.cycle(values) for name, values in series.items()}
    calls: dict[str, int] = {name: 0 for name in series}

    def time_one(fn, device) -> Timing:
        name = fn()
        calls[name] += 1
        return Timing(next(streams[name]), 0.0, 0.0)

    return time_one, calls


def test_the_race_drops_a_clear_loser_after_one_round_and_times_the_close_ones_every_round():
    time_one, calls = _clock({"vendor": [1.00, 1.02], "close": [1.05, 0.99], "slow": [1.30]})
    fns = {name: (lambda name=name: name) for name in ("vendor", "close", "slow")}
    timed = race(fns, CPU, rounds=5, time_one=time_one)
    assert calls == {"vendor": 5, "close": 5, "slow": 1}
    assert timed["slow"].median_ms == 1.30
    assert timed["vendor"].median_ms == 1.00 and timed["close"].median_ms == 1.05


def test_the_race_ends_when_one_candidate_is_left():
    time_one, calls = _clock({"vendor": [0.069], "kernel": [0.090], "other": [0.095]})
    fns = {name: (lambda name=name: name) for name in ("vendor", "kernel", "other")}
    timed = race(fns, CPU, rounds=5, time_one=time_one)
    assert calls == {"vendor": 1, "kernel": 1, "other": 1}
    assert min(timed, key=lambda n: timed[n].median_ms) == "vendor"


def test_a_candidate_that_falls_behind_later_leaves_then():
    time_one, calls = _clock({"a": [1.0, 1.0, 1.0], "b": [1.1, 1.6, 1.6]})
    fns = {name: (lambda name=name: name) for name in ("a", "b")}
    race(fns, CPU, rounds=5, time_one=time_one)
    assert calls == {"a": 2, "b": 2}  # b's median passes the margin in round 2 (1.35 > 1.18), ending the race


def test_a_worker_spawned_before_the_tuner_knew_its_problem_runs_the_trials(url):
    # The CLI starts one before it imports torch (autotile.cli.main.main); the first search takes it over.
    from autotile.tune import early_worker

    early_worker.spawn_early_worker()
    early_pid = early_worker._EARLY_WORKER[0].pid
    problem = contiguous_problem(12, 20, 24, "fp32", "fp32", layout_b="col")
    with TuneSession() as session:
        result = tune_problem(_SlowVendorGemm(), problem, CPU, trials=2, db_url=url, retime_rounds=0, isolate=True,
                              session=session)
        stats = session.stats()
    assert result.trials_this_run == 2 and result.statuses == {"ok": 2}  # the search's trials; the vendor row apart
    assert stats.worker_pids == (early_pid,) and early_worker.take_early_worker() is None


def test_the_cli_starts_the_early_worker_where_it_would_search_on_a_gpu(monkeypatch):
    # The branch runs only on a machine with an NVIDIA driver: here its import and call are checked with a stand-in.
    import sys

    from autotile.cli import main as cli_main

    started = []
    monkeypatch.setattr(cli_main, "starts_a_gpu_search", lambda args: True)
    monkeypatch.setattr("autotile.tune.early_worker.spawn_early_worker", lambda: started.append(True))
    monkeypatch.setattr(sys, "argv", ["autotile", "--version"])
    with pytest.raises(SystemExit):
        cli_main.main()
    assert started == [True]


def test_a_candidate_timed_in_one_round_keeps_its_timings_spread():
    # The race ended after round 1: the winner's spread was its one sample's (q20 = q80: 0.0%), read as perfect
    # stability though it was never measured over rounds.
    fns = {"vendor": lambda: "vendor", "kernel": lambda: "kernel"}
    timings = {"vendor": Timing(1.0, 0.9, 1.2), "kernel": Timing(2.0, 1.9, 2.1)}
    timed = race(fns, CPU, rounds=5, time_one=lambda fn, device: timings[fn()])
    assert (timed["vendor"].q20_ms, timed["vendor"].q80_ms) == (0.9, 1.2)
