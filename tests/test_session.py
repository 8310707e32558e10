"""One trial worker and one compile-ahead pool for the problems of a run (autotile.tune.session).

Two problems of one session run in one worker process and one pool; a crash in one problem's trials costs
that trial only and the session keeps the replacement worker; Ctrl-C during a later problem stores the
earlier winners and that problem's best so far; nothing the session started outlives it.
"""
from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from autotile.bench import Status
from autotile.device import interpret_device
from autotile.families.base import problem_to_dict
from autotile.families.elementwise import FAMILY as ELEMENTWISE
from autotile.families.gemm import FAMILY as GEMM
from autotile.families.gemm import contiguous_problem
from autotile.store.db import open_engine
from autotile.store.repo import Store
from autotile.tune import compile_ahead, search
from autotile.tune.compile_ahead import CompileAhead
from autotile.tune.driver import tune_problem
from autotile.tune.plan import PlannedProblem, tune_planned
from autotile.tune.session import TuneSession, current_session
from autotile.tune.workers import IsolatedEvaluator, WorkerSetupError

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
from crashing_family import CrashingGemm  # noqa: E402
from recording_compile import record_compile  # noqa: E402

CPU = interpret_device()


def _elementwise(expr: str, numel: int = 1000):
    return ELEMENTWISE.problems_from_cli(expr=expr, numel=(numel,), dtype=("fp32",))[0]


FIRST, SECOND, THIRD = _elementwise("x * 2 + 1"), _elementwise("x * 3 - 1"), _elementwise("x + 5", 1500)
GEMM_PROBLEM = contiguous_problem(24, 32, 64, "fp16", "fp16")


@pytest.fixture
def nothing_left_running():
    """Fails the test if a thread or child process started during it is still alive at its end."""
    before = set(threading.enumerate())
    yield
    deadline = time.monotonic() + 10  # a closed pool's management thread takes a moment to go
    while time.monotonic() < deadline:
        left = [t.name for t in threading.enumerate() if t not in before and t.is_alive()]
        children = multiprocessing.active_children()
        if not left and not children:
            return
        time.sleep(0.1)
    raise AssertionError(f"left running: threads {left}, processes {children}")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture
def recording_pool(tmp_path, monkeypatch):
    """Searches get a real compile-ahead pool under the interpreter, whose jobs record their pid and config."""
    log = tmp_path / "compiles"
    log.mkdir()
    monkeypatch.setenv("AUTOTILE_TEST_COMPILE_LOG", str(log))

    def start(family, problem, device, seed, enabled):
        return CompileAhead(family, problem, device, seed, processes=1, compile_fn=record_compile)

    monkeypatch.setattr(search, "start_compile_ahead", start)
    return log


def test_two_problems_of_one_session_share_one_worker_and_one_pool(tmp_path, recording_pool, nothing_left_running):
    url = f"sqlite:///{tmp_path / 's.sqlite'}"
    with TuneSession() as session:
        assert current_session() is session
        first = tune_problem(ELEMENTWISE, FIRST, CPU, trials=2, db_url=url, isolate=True, retime_rounds=0,
                             lookahead=1)
        (pid,) = session.stats().worker_pids
        assert _alive(pid)  # kept, idle, between the problems
        second = tune_problem(GEMM, GEMM_PROBLEM, CPU, trials=2, db_url=url, isolate=True, retime_rounds=0,
                              lookahead=1)  # another family: the same worker, retargeted
        stats = session.stats()
    assert current_session() is None and not _alive(pid)
    for result in (first, second):
        assert result.winner is not None and result.statuses == {"ok": 2} and result.trials_this_run == 2
    assert stats.searches == 2 and stats.worker_starts == 1 and stats.worker_pids == (pid,)
    assert stats.pool_starts == 1
    compile_pids = {int(p.read_text().split(" ", 1)[0]) for p in recording_pool.iterdir()}
    assert len(compile_pids) == 1 and os.getpid() not in compile_pids and pid not in compile_pids


def test_without_a_session_each_problem_starts_and_stops_its_own_worker(tmp_path, nothing_left_running):
    url = f"sqlite:///{tmp_path / 's.sqlite'}"
    started = []
    original = IsolatedEvaluator._launch

    def launch(self):
        original(self)
        started.append(self.worker_pid())

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(IsolatedEvaluator, "_launch", launch)
        for problem in (FIRST, SECOND):
            tune_problem(ELEMENTWISE, problem, CPU, trials=1, db_url=url, isolate=True, retime_rounds=0)
            assert not _alive(started[-1])  # stopped when its search ended, as before sessions existed
    assert len(set(started)) == 2


def test_a_crash_in_the_first_problem_does_not_break_the_next(tmp_path, nothing_left_running):
    url = f"sqlite:///{tmp_path / 's.sqlite'}"
    crashing = CrashingGemm()
    with TuneSession() as session:
        # The default config (ok), then the seed config that makes its worker exit.
        first = tune_problem(crashing, GEMM_PROBLEM, CPU, trials=2, db_url=url, isolate=True, retime_rounds=0)
        second = tune_problem(ELEMENTWISE, FIRST, CPU, trials=2, db_url=url, isolate=True, retime_rounds=0)
        after_second = session.stats()
        third = tune_problem(ELEMENTWISE, SECOND, CPU, trials=2, db_url=url, isolate=True, retime_rounds=0)
        after_third = session.stats()
    assert first.statuses == {"ok": 1, "crash": 1}
    (crash,) = [t for t in Store(open_engine(url)).trials("gemm") if t["status"] == Status.CRASH.value]
    assert "exited with code 3" in crash["error"] and "reproduce: autotile render gemm" in crash["error"]
    assert second.statuses == {"ok": 2} and third.statuses == {"ok": 2}
    # The crashed worker's replacement started for the second problem, and the session kept it for the third.
    assert after_second.worker_starts == 2 and after_third.worker_starts == 2
    assert after_third.worker_pids == after_second.worker_pids


def test_ctrl_c_during_the_second_problem_stores_both(tmp_path, nothing_left_running):
    url = f"sqlite:///{tmp_path / 's.sqlite'}"
    trials_seen = []

    def ctrl_c_in_the_second_problem(progress):
        trials_seen.append(progress.evaluated)
        if len(trials_seen) == 3 + 2:  # the first problem's 3 trials, then 2 of the second's
            os.kill(os.getpid(), signal.SIGINT)  # as a terminal's Ctrl-C

    planned = [PlannedProblem(ELEMENTWISE, p, calls) for p, calls in ((FIRST, 9), (SECOND, 5), (THIRD, 1))]
    # What SIGINT did before (Python's handler; ignored where the tests were started in the background).
    before = signal.getsignal(signal.SIGINT)
    outcome = tune_planned(planned, CPU, budget_s=None, db_url=url, trials=3, isolate=True, retime_rounds=1,
                           progress=ctrl_c_in_the_second_problem)
    assert outcome.interrupted and [p.problem for p in outcome.skipped] == [THIRD]
    first, second = outcome.tuned
    assert not first.interrupted and first.winner is not None and sum(first.statuses.values()) == 3
    assert second.interrupted and second.winner is not None and sum(second.statuses.values()) == 2
    winners = {w.problem_key: w.config for w in Store(open_engine(url, create=False)).winners("elementwise")}
    assert winners == {first.problem_key: first.winner.to_json(), second.problem_key: second.winner.to_json()}
    assert signal.getsignal(signal.SIGINT) is before
    assert current_session() is None


def test_cli_run_of_a_trace_exits_130_on_ctrl_c_with_the_winners_stored(tmp_path, monkeypatch):
    from autotile.runtime.trace import TraceEntry, write_trace
    from autotile.tune import driver
    from cli.main import cli

    trace = tmp_path / "trace.jsonl"
    write_trace(trace, [TraceEntry("elementwise", "interpret", problem_to_dict(p), calls)
                        for p, calls in ((FIRST, 9), (SECOND, 5))])
    tune = driver.tune_problem
    seen = []

    def tune_and_press_ctrl_c(family, problem, device, **kwargs):
        def progress(p):
            seen.append(p.evaluated)
            if len(seen) == 2 + 1:  # the first problem's 2 trials, then 1 of the second's
                os.kill(os.getpid(), signal.SIGINT)

        return tune(family, problem, device, progress=progress, **kwargs)

    monkeypatch.setattr(driver, "tune_problem", tune_and_press_ctrl_c)
    db = tmp_path / "cli.sqlite"
    out = CliRunner().invoke(cli, ["tune", "--from-trace", str(trace), "--gpu", "interpret", "--trials", "2",
                                   "--db", str(db)])
    assert out.exit_code == 130, out.output
    assert "interrupted: the best so far is stored" in out.output
    assert len(Store(open_engine(f"sqlite:///{db}", create=False)).winners("elementwise")) == 2


def test_a_worker_retargeted_to_a_problem_it_cannot_load_is_replaced(nothing_left_running):
    class Unimportable(type(ELEMENTWISE)):  # a local class: the worker cannot import it by name
        pass

    evaluator = IsolatedEvaluator(ELEMENTWISE, FIRST, CPU, seed=0, trial_timeout=300.0)
    try:
        assert evaluator.evaluate(0, ELEMENTWISE.default_config(FIRST, CPU)).status is Status.OK
        evaluator.retarget(Unimportable(), SECOND, 0)
        with pytest.raises(WorkerSetupError, match="did not start"):
            evaluator.evaluate(0, ELEMENTWISE.default_config(SECOND, CPU))
        evaluator.retarget(GEMM, GEMM_PROBLEM, 1)
        assert evaluator.evaluate(0, GEMM.default_config(GEMM_PROBLEM, CPU)).status is Status.OK
        assert evaluator.workers_started == 2
    finally:
        evaluator.close()


def test_compile_pool_jobs_load_each_problem_once(monkeypatch):
    """A pool process serves jobs of several problems: a new problem replaces the last one's inputs."""
    state = {"device": CPU, "target": None, "family": None, "problem": None, "inputs": None}
    monkeypatch.setattr(compile_ahead, "_state", state)
    loaded = []

    def compile_fn(config_json):
        loaded.append(state["problem"])
        state["inputs"] = state["inputs"] or object()  # as compile_config builds them on first use
        return config_json, 0.0, ""

    first = ("elementwise", problem_to_dict(FIRST), 0, None)
    gemm = ("gemm", problem_to_dict(GEMM_PROBLEM), 0, None)
    compile_ahead._compile_job(first, compile_fn, "{}")
    inputs = state["inputs"]
    compile_ahead._compile_job(first, compile_fn, "{}")
    assert state["inputs"] is inputs  # same problem: kept
    compile_ahead._compile_job(gemm, compile_fn, "{}")
    assert loaded == [FIRST, FIRST, GEMM_PROBLEM] and state["inputs"] is not inputs
    _, _, error = compile_ahead._compile_job(("no-such-family", {}, 0, None), compile_fn, "{}")
    assert "no-such-family" in error


def test_a_compile_pool_whose_process_died_is_replaced(tmp_path, monkeypatch, nothing_left_running):
    monkeypatch.setenv("AUTOTILE_TEST_COMPILE_LOG", str(tmp_path))
    configs = list(ELEMENTWISE.space(FIRST, CPU).feasible())[:2]
    pool = CompileAhead(ELEMENTWISE, FIRST, CPU, 0, processes=1, compile_fn=record_compile)
    try:
        pool.submit(configs[:1])
        pool.wait_for(configs[0], limit_s=120)
        (log,) = tmp_path.iterdir()
        os.kill(int(log.read_text().split(" ", 1)[0]), signal.SIGKILL)
        deadline = time.monotonic() + 30
        while not pool._pool._broken and time.monotonic() < deadline:  # the executor notices the death
            time.sleep(0.05)
        pool.retarget(ELEMENTWISE, SECOND, 0)
        pool.submit(configs[1:])
        pool.wait_for(configs[1], limit_s=120)
    finally:
        pool.close()
    assert pool.pools_started == 2 and pool.compiled == 2 and len(list(tmp_path.iterdir())) == 2


@pytest.mark.gpu
def test_a_session_on_a_gpu_keeps_one_worker_and_one_compile_pool(tmp_path):
    """On a GPU (isolated workers and compile-ahead are the default there): two problems, one of each."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from autotile.device import resolve_gpu

    device = resolve_gpu("auto")
    url = f"sqlite:///{tmp_path / 'gpu.sqlite'}"
    problems = [contiguous_problem(m, 256, 512, "fp16", "fp16") for m in (16, 48)]
    with TuneSession() as session:
        results = [tune_problem(GEMM, p, device, trials=5, db_url=url, retime_rounds=1) for p in problems]
        stats = session.stats()
    for result in results:
        assert result.winner is not None and result.trials_this_run == 5
        assert "crash" not in result.statuses and "timeout" not in result.statuses, result.statuses
    assert stats.searches == 2 and stats.worker_starts == 1 and stats.pool_starts == 1
    deadline = time.monotonic() + 10
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not multiprocessing.active_children()


def test_the_pool_compiles_the_enqueued_configs_from_the_start(tmp_path, recording_pool, nothing_left_running,
                                                               monkeypatch):
    """The default, warm-start and seed configs a new study enqueues are known before its first trial: they go
    to the pool all at once, whatever the lookahead (0 here: the loop itself submits nothing). (What is submitted
    is checked: a search this short may end, and its pool be stopped, before the pool's process compiled any.)"""
    url = f"sqlite:///{tmp_path / 'e.sqlite'}"
    seeds = GEMM.seed_configs(GEMM_PROBLEM, CPU)
    assert len(seeds) >= 2  # the premise: this problem has seeds to compile ahead
    submitted = []
    submit = CompileAhead.submit

    def recording_submit(self, configs):
        configs = list(configs)
        submitted.extend(c.to_json() for c in configs)
        return submit(self, configs)

    monkeypatch.setattr(CompileAhead, "submit", recording_submit)
    tune_problem(GEMM, GEMM_PROBLEM, CPU, trials=1, db_url=url, isolate=False, retime_rounds=0, lookahead=0,
                 warm_start=False)
    default = GEMM.default_config(GEMM_PROBLEM, CPU)
    assert set(submitted) == {c.to_json() for c in [default, *seeds]}  # the default and every seed, at the start
