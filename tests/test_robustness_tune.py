"""`autotile tune` on every exit path: a rerun of a finished study, kill -9 and resume, Ctrl-C, an error.

Each leaves no thread or process of the tuner running, and the CLI's exit status says what happened
(issue 19: a rerun of a finished study aborted at interpreter exit, status 134, from a daemon thread
still enumerating the feasible configs).
"""
from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from autotile.device import interpret_device
from autotile.families.elementwise import FAMILY as ELEMENTWISE
from autotile.store.db import open_engine
from autotile.store.repo import Store
from autotile.tune import search
from autotile.tune.cluster import recorded_trials
from autotile.tune.driver import study_name, tune_problem
from autotile.tune.workers import InProcessEvaluator

CPU = interpret_device()
EXPR, NUMEL = "x * 2 + 1", 1000
PROBLEM = ELEMENTWISE.problems_from_cli(expr=EXPR, numel=(NUMEL,), dtype=("fp32",))[0]
ENV = {**os.environ, "TRITON_INTERPRET": "1"}


def _cli(db: str, trials: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "autotile.cli.main", "tune", "elementwise", "--expr", EXPR, "--numel", str(NUMEL),
            "--gpu", "interpret", "--trials", str(trials), "--db", db, *extra]


def _run(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(args, env=ENV, capture_output=True, text=True, timeout=timeout)


def _rows(db: str) -> dict[int, str]:
    return recorded_trials(open_engine(db, create=False), study_name(ELEMENTWISE, PROBLEM, CPU))


def _wait_for_rows(db: str, process: subprocess.Popen, count: int, limit_s: float = 240.0) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if len(_rows(db)) >= count:
                return
        except Exception:  # noqa: BLE001 - the tuner has not created the database yet
            pass
        time.sleep(0.05)
    raise AssertionError(f"the tuner stored fewer than {count} trials (exit status {process.poll()})")


def test_killed_tuner_resumes_and_a_rerun_of_the_finished_study_exits_0(tmp_path):
    """kill -9, resume, run again: the last run has nothing to do (it aborted at exit with status 134)."""
    db = str(tmp_path / "killed.sqlite")
    tuner = subprocess.Popen(_cli(db, 6), env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_for_rows(db, tuner, 2)
        tuner.send_signal(signal.SIGKILL)
    finally:
        tuner.wait(30)
    stored = len(_rows(db))
    assert tuner.returncode == -signal.SIGKILL and 2 <= stored < 6
    resumed = _run(_cli(db, 6))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    rows = _rows(db)
    assert len(rows) == 6 and len(set(rows.values())) == 6
    # Not a terminal: one line per trial on stderr, so a long run in a log shows it is alive.
    assert all(f"trial {n}/6:" in resumed.stderr for n in range(stored + 1, 7)), resumed.stderr
    again = _run(_cli(db, 6))
    assert again.returncode == 0, again.stderr[-2000:]
    assert sum("study already complete" in line for line in again.stdout.splitlines()) == 1, again.stdout
    assert "trial " not in again.stderr and len(_rows(db)) == 6


@pytest.mark.parametrize("searches", [(), ("--gpus", "0,1")], ids=["one search", "search processes"])
def test_ctrl_c_stores_the_best_so_far_and_exits_130(tmp_path, searches):
    db = str(tmp_path / "interrupted.sqlite")
    tuner = subprocess.Popen(_cli(db, 40, *searches), env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, start_new_session=True)
    try:
        _wait_for_rows(db, tuner, 2)
        os.killpg(tuner.pid, signal.SIGINT)  # as a terminal's Ctrl-C: to the tuner and every process it started
        out, err = tuner.communicate(timeout=240)
    finally:
        if tuner.poll() is None:
            tuner.kill()
    assert tuner.returncode == 130, err[-2000:]
    assert "Traceback" not in err and "Aborted!" not in err
    assert "interrupted: the best so far is stored; run the same command again to resume" in err
    assert "stopped early: interrupted (Ctrl-C)" in out
    (winner,) = Store(open_engine(db, create=False)).winners("elementwise")
    stored = len(_rows(db))
    assert 2 <= stored < 40 and winner.trials_run >= stored


@pytest.fixture
def no_new_threads():
    """Fails the test if a thread or child process started during it is still alive at its end."""
    before = set(threading.enumerate())
    yield
    left = [t.name for t in threading.enumerate() if t not in before and t.is_alive()]
    children = multiprocessing.active_children()
    assert not left and not children, f"left running: threads {left}, processes {children}"


@pytest.fixture
def slow_enumeration(monkeypatch):
    """The feasible-config table takes a while to build, as on a busy machine or a large space."""
    original = search._ConfigSource._codes_of

    def slow(self, configs):
        time.sleep(3.0)
        return original(self, configs)

    monkeypatch.setattr(search._ConfigSource, "_codes_of", slow)


def test_a_search_stopped_at_once_waits_for_its_enumeration_thread(tmp_path, slow_enumeration, no_new_threads):
    # timeout=0 stops the search before its first trial, while the background enumeration still runs.
    result = tune_problem(ELEMENTWISE, PROBLEM, CPU, trials=3, timeout=0, db_url=f"sqlite:///{tmp_path / 't.sqlite'}",
                          retime_rounds=0)
    assert result.stopped_early.startswith("timeout") and result.winner is None


def test_error_paths_leave_nothing_running(tmp_path, monkeypatch, slow_enumeration, no_new_threads):
    url = f"sqlite:///{tmp_path / 't.sqlite'}"

    def no_pool(*args, **kwargs):
        raise OSError("cannot start the compile pool")

    # Fails right after the trial worker (a process) and the enumeration (a thread) were started.
    start_compile_ahead = search.start_compile_ahead
    monkeypatch.setattr(search, "start_compile_ahead", no_pool)
    with pytest.raises(OSError, match="compile pool"):
        tune_problem(ELEMENTWISE, PROBLEM, CPU, trials=3, db_url=url, retime_rounds=0, isolate=True)
    monkeypatch.setattr(search, "start_compile_ahead", start_compile_ahead)

    def broken(self, number, config):
        raise RuntimeError("the storage went away")

    monkeypatch.setattr(InProcessEvaluator, "evaluate", broken)
    with pytest.raises(RuntimeError, match="storage went away"):
        tune_problem(ELEMENTWISE, PROBLEM, CPU, trials=3, db_url=url, retime_rounds=0)


def test_isolated_run_then_rerun_leave_nothing_running(tmp_path, no_new_threads):
    url = f"sqlite:///{tmp_path / 't.sqlite'}"
    first = tune_problem(ELEMENTWISE, PROBLEM, CPU, trials=2, db_url=url, retime_rounds=1, isolate=True)
    assert first.winner is not None and not first.already_complete and first.trials_this_run == 2
    again = tune_problem(ELEMENTWISE, PROBLEM, CPU, trials=2, db_url=url, retime_rounds=1, isolate=True)
    assert again.already_complete and again.trials_this_run == 0 and again.winner is not None


def test_ctrl_c_in_process_stops_between_trials_and_names_a_winner(tmp_path, no_new_threads):
    seen = []

    def ctrl_c_after_two(progress):
        seen.append(progress.evaluated)
        if len(seen) == 2:
            os.kill(os.getpid(), signal.SIGINT)  # as a terminal's Ctrl-C

    url = f"sqlite:///{tmp_path / 't.sqlite'}"
    # What SIGINT did before (Python's handler; ignored where the tests were started in the background).
    before = signal.getsignal(signal.SIGINT)
    result = tune_problem(ELEMENTWISE, PROBLEM, CPU, trials=10, db_url=url, retime_rounds=1,
                          progress=ctrl_c_after_two)
    assert result.interrupted and result.stopped_early == "interrupted (Ctrl-C)"
    assert result.winner is not None and sum(result.statuses.values()) == 2
    (winner,) = Store(open_engine(url, create=False)).winners("elementwise")
    assert winner.config == result.winner.to_json()
    assert signal.getsignal(signal.SIGINT) is before  # Ctrl-C does again what it did before


def test_second_ctrl_c_stops_at_once(tmp_path, no_new_threads):
    def ctrl_c_twice(progress):
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)

    url = f"sqlite:///{tmp_path / 't.sqlite'}"
    with pytest.raises(KeyboardInterrupt):
        tune_problem(ELEMENTWISE, PROBLEM, CPU, trials=10, db_url=url, retime_rounds=1, progress=ctrl_c_twice)
    assert Store(open_engine(url, create=False)).winners("elementwise") == []


# --- what a rerun and the runtime see after tuning -----------------------------------------------------

def _fake_retiming(monkeypatch, stored_hash: str, others_ms: float):
    """The interleaved re-timing gives the stored winner 1 ms and every other candidate `others_ms`."""
    from autotile.bench import Timing
    from autotile.tune import driver

    def retime(fns, device, rounds):
        return {key: Timing(1.0 if key == stored_hash else others_ms, 0.99, 1.01, True) for key in fns}

    monkeypatch.setattr(driver, "race", retime)


def test_a_rerun_keeps_the_stored_winner_unless_another_is_faster_beyond_the_noise(tmp_path, monkeypatch):
    url = f"sqlite:///{tmp_path / 't.sqlite'}"
    tune_problem(ELEMENTWISE, PROBLEM, CPU, trials=4, db_url=url, retime_rounds=1)
    (stored,) = Store(open_engine(url, create=False)).winners("elementwise")
    _fake_retiming(monkeypatch, stored.config_hash, 0.995)  # 0.5% faster: within the noise
    kept = tune_problem(ELEMENTWISE, PROBLEM, CPU, trials=4, db_url=url, retime_rounds=1)
    assert kept.already_complete and kept.winner.to_json() == stored.config
    _fake_retiming(monkeypatch, stored.config_hash, 0.9)  # 10% faster: a real improvement
    replaced = tune_problem(ELEMENTWISE, PROBLEM, CPU, trials=4, db_url=url, retime_rounds=1)
    assert replaced.winner.to_json() != stored.config
    (now,) = Store(open_engine(url, create=False)).winners("elementwise")
    assert now.config == replaced.winner.to_json() and now.median_ms == 0.9


def test_explain_sees_a_winner_tuned_in_the_same_process(tmp_path, monkeypatch):
    import autotile
    import torch

    url = f"sqlite:///{tmp_path / 't.sqlite'}"
    monkeypatch.setenv("AUTOTILE_DB", url)
    x = torch.randn(NUMEL)
    assert autotile.explain("fuse", EXPR, x=x)["source"] != "user-db"  # memoised before the tuning
    result = tune_problem(ELEMENTWISE, PROBLEM, CPU, trials=2, db_url=url, retime_rounds=1)
    info = autotile.explain("fuse", EXPR, x=x)
    assert info["source"] == "user-db" and info["config"] == dict(result.winner)


def test_autotile_log_prints_one_line_per_new_shape(monkeypatch, capfd):
    import autotile
    import torch

    from autotile.runtime import dispatch

    monkeypatch.setenv("AUTOTILE_LOG", "1")
    dispatch.clear_cache()
    for n in (NUMEL, NUMEL, NUMEL + 7, NUMEL):
        autotile.fuse(EXPR)(x=torch.randn(n))
    lines = [line for line in capfd.readouterr().err.splitlines() if line.startswith("autotile: elementwise")]
    assert len(lines) == 2 and '"numel":1000' in lines[0] and '"numel":1007' in lines[1]
    assert all("->" in line and "[" in line for line in lines)


def test_a_study_started_again_beside_its_recorded_trials_keeps_every_trial(tmp_path):
    """A database copied without its journals (or a damaged journal moved aside): the study starts again while its
    rows remain. Its new trials were numbered from 0 again, each colliding with a recorded row and dropped
    silently, and their configs ran again."""
    import shutil

    url = f"sqlite:///{tmp_path / 'a.sqlite'}"
    tune_problem(ELEMENTWISE, PROBLEM, CPU, trials=4, db_url=url, retime_rounds=0, warm_start=False)
    copied = tmp_path / "copy"
    copied.mkdir()
    for part in ("a.sqlite", "a.sqlite-wal", "a.sqlite-shm"):  # the database, without a.sqlite.studies/
        if (tmp_path / part).exists():
            shutil.copy(tmp_path / part, copied / part)
    copy_url = f"sqlite:///{copied / 'a.sqlite'}"
    result = tune_problem(ELEMENTWISE, PROBLEM, CPU, trials=7, db_url=copy_url, retime_rounds=0, warm_start=False)
    rows = _rows(copy_url)
    assert len(rows) == 7 and len(set(rows.values())) == 7, rows  # every trial kept, no config run twice
    assert result.trials_this_run == 3 and sum(result.statuses.values()) == 7


def test_a_driver_update_mid_study_keeps_the_studys_trials_for_the_winner(tmp_path):
    """A new device row of the same key (another driver): the study, named by the key, is the same one, and the
    winner is picked from all of its trials (it was 'every trial failed' for a complete study)."""
    import dataclasses

    url = f"sqlite:///{tmp_path / 't.sqlite'}"
    tune_problem(ELEMENTWISE, PROBLEM, CPU, trials=4, db_url=url, retime_rounds=0)
    updated = dataclasses.replace(CPU, driver=CPU.driver + " (updated)")
    again = tune_problem(ELEMENTWISE, PROBLEM, updated, trials=4, db_url=url, retime_rounds=0)
    assert again.already_complete and again.winner is not None and again.statuses == {"ok": 4}
    more = tune_problem(ELEMENTWISE, PROBLEM, updated, trials=6, db_url=url, retime_rounds=0)
    assert more.trials_this_run == 2 and sum(more.statuses.values()) == 6
    (winner,) = Store(open_engine(url, create=False)).winners("elementwise")
    assert "6 trials" in winner.provenance


def test_a_journal_whose_last_line_is_damaged_is_set_aside_and_the_run_keeps_every_trial(tmp_path, caplog):
    """Optuna replays a journal whose last line is cut short, then fails once create_study appends after it: the
    rerun raised JSONDecodeError as a traceback."""
    from autotile.tune.storage import journal_path, study_journal

    url = f"sqlite:///{tmp_path / 'j.sqlite'}"
    tune_problem(ELEMENTWISE, PROBLEM, CPU, trials=3, db_url=url, retime_rounds=0, warm_start=False)
    journal = journal_path(study_journal(url, study_name(ELEMENTWISE, PROBLEM, CPU)))
    with open(journal, "ab") as handle:
        handle.write(b"garbage{\n")
    with caplog.at_level("WARNING", logger="autotile.tune"):
        result = tune_problem(ELEMENTWISE, PROBLEM, CPU, trials=5, db_url=url, retime_rounds=0, warm_start=False)
    assert "could not be replayed" in caplog.text and result.winner is not None
    rows = _rows(url)
    assert len(rows) == 5 and len(set(rows.values())) == 5


def test_best_so_far_of_a_resumed_run_counts_the_recorded_trials(tmp_path):
    url = f"sqlite:///{tmp_path / 'b.sqlite'}"
    tune_problem(ELEMENTWISE, PROBLEM, CPU, trials=3, db_url=url, retime_rounds=0, warm_start=False)
    recorded_best = min(t["median_ms"] for t in Store(open_engine(url, create=False)).trials("elementwise")
                        if t["status"] == "ok" and not t["study"].endswith(":vendor"))
    seen = []
    tune_problem(ELEMENTWISE, PROBLEM, CPU, trials=5, db_url=url, retime_rounds=0, warm_start=False,
                 progress=lambda p: seen.append(p.best_ms))
    assert seen and all(best <= recorded_best for best in seen)
