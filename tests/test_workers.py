"""Trials in worker processes: a crash, an outside kill and a hang each cost one trial; a killed tuner resumes."""
from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import optuna
import pytest
from click.testing import CliRunner

from autotile.device import interpret_device
from autotile.families.gemm import GemmFamily, contiguous_problem
from autotile.store.db import open_engine
from autotile.store.repo import Store
from autotile.tune.cluster import OWNER_ATTR, recorded_trials
from autotile.tune.driver import TuneError, study_name, tune_problem
from autotile.bench import Status
from autotile.tune.storage import journal_path, optuna_storage, study_journal
from autotile.tune.workers import InProcessEvaluator, IsolatedEvaluator, reproduce_command

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
from crashing_family import EXIT_CODE, CrashingGemm  # noqa: E402

CPU = interpret_device()
PROBLEM = contiguous_problem(24, 32, 64, "fp16", "fp16")


def _kill_when_pidfile_appears(pidfile: Path, killed: list, deadline_s: float = 120.0) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if pidfile.exists() and pidfile.read_text().strip():
            pid = int(pidfile.read_text())
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
            return
        time.sleep(0.1)


def test_crash_and_outside_kill_cost_one_trial_each(tmp_path, monkeypatch):
    pidfile = tmp_path / "worker.pid"
    monkeypatch.setenv("AUTOTILE_TEST_PIDFILE", str(pidfile))
    killed: list[int] = []
    killer = threading.Thread(target=_kill_when_pidfile_appears, args=(pidfile, killed), daemon=True)
    killer.start()
    family = CrashingGemm()
    url = f"sqlite:///{tmp_path / 'w.sqlite'}"
    # Trials: the default (ok), then the seed configs EXIT and KILLED (see crashing_family).
    result = tune_problem(family, PROBLEM, CPU, trials=3, db_url=url, isolate=True, trial_timeout=300.0,
                          retime_rounds=0)
    killer.join(1)
    assert killed, "the worker never reached the trial the test kills"
    assert result.statuses == {"ok": 1, "crash": 2} and result.trials_this_run == 3
    assert result.winner == family.default_config(PROBLEM, CPU)
    special = {name: c.to_json() for name, c in family.special_configs(PROBLEM, CPU).items()}
    by_config = {json.dumps(t["config"], sort_keys=True, separators=(",", ":")): t
                 for t in Store(open_engine(url)).trials("gemm")}
    exited, outside = by_config[special["exit"]], by_config[special["killed"]]
    assert f"exited with code {EXIT_CODE}" in exited["error"]
    assert "about to exit on purpose" in exited["error"]  # the worker's last output comes along
    assert "killed by signal SIGKILL" in outside["error"]
    for trial in (exited, outside):
        assert "reproduce: autotile render gemm --m 24 --n 32 --k 64" in trial["error"]


def test_hang_is_a_timeout_with_a_command_that_renders_it():
    family = CrashingGemm()
    hang = family.special_configs(PROBLEM, CPU)["hang"]
    # The limit counts from the trial's start, after the worker is up: 1 s of a config that sleeps 600 s.
    evaluator = IsolatedEvaluator(family, PROBLEM, CPU, seed=0, trial_timeout=1.0)
    try:
        outcome = evaluator.evaluate(0, hang)
        assert outcome.status is Status.TIMEOUT and "no result within 1 s; the worker was killed" in outcome.error
        assert evaluator.worker_pid() is None  # killed; the next trial starts a new worker
        evaluator.trial_timeout = 300.0  # a first trial on a busy machine may well take more than 1 s
        assert evaluator.evaluate(1, family.default_config(PROBLEM, CPU)).status is Status.OK
        assert evaluator.workers_started == 2
    finally:
        evaluator.close()
    repro = outcome.error.split("reproduce: ", 1)[1].strip()
    assert repro == reproduce_command(family, PROBLEM, hang, CPU)
    from cli.main import cli

    args = shlex.split(repro)
    assert args[:3] == ["autotile", "render", "gemm"]
    out = CliRunner().invoke(cli, args[1:])
    assert out.exit_code == 0, out.output
    assert f"# config:  {hang.to_json()}" in out.output and "@triton.jit" in out.output


def _kill_after(tuner: subprocess.Popen, engine, name: str, recorded: int) -> None:
    """SIGKILL the tuner once `recorded` trials of study `name` are stored: mid-run, wherever it is."""
    try:
        deadline = time.monotonic() + 120
        while len(recorded_trials(engine, name)) < recorded and time.monotonic() < deadline and tuner.poll() is None:
            time.sleep(0.05)
        assert tuner.poll() is None, "the tuner ended before it could be killed"
        tuner.send_signal(signal.SIGKILL)
    finally:
        tuner.wait(30)


def test_killed_tuner_resumes_to_the_exact_count(tmp_path):
    url = f"sqlite:///{tmp_path / 'k.sqlite'}"
    script = textwrap.dedent(f"""
        from autotile.device import interpret_device
        from autotile.families.gemm import FAMILY, contiguous_problem
        from autotile.tune.driver import tune_problem
        tune_problem(FAMILY, contiguous_problem(24, 32, 64, "fp16", "fp16"), interpret_device(), trials=40,
                     db_url={url!r}, retime_rounds=0)
    """)
    open_engine(url)  # created up front, so the poll below can read it
    name = study_name(GemmFamily(), PROBLEM, CPU)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    tuner = subprocess.Popen([sys.executable, "-c", script], env=env)
    engine = open_engine(url)
    _kill_after(tuner, engine, name, recorded=3)
    before = len(recorded_trials(engine, name))
    assert 3 <= before < 8
    result = tune_problem(GemmFamily(), PROBLEM, CPU, trials=8, db_url=url, retime_rounds=0)
    assert result.trials_this_run == 8 - before
    rows = recorded_trials(engine, name)
    assert len(rows) == 8 and len(set(rows.values())) == 8  # distinct numbers and configs
    study = optuna.load_study(study_name=name, storage=optuna_storage(study_journal(url, name)))
    # The killed run's claimed trial was failed; at most a trial it had only just asked (not yet named) waits
    # for OWNERLESS_STALE_AFTER_S: never claimed, never counted.
    left = study.get_trials(states=(optuna.trial.TrialState.RUNNING,))
    assert all(not t.user_attrs for t in left) and len(left) <= 1
    told = {t.number for t in study.trials if "status" in t.user_attrs}
    assert told <= set(rows)  # every trial Optuna counts has its row
    finished = {t.number for t in study.get_trials(states=(optuna.trial.TrialState.COMPLETE,
                                                           optuna.trial.TrialState.FAIL))}
    assert set(rows) <= finished
    assert sum(result.statuses.values()) == 8


@pytest.mark.parametrize("searches", [2])
def test_parallel_searches_share_one_study(tmp_path, searches, monkeypatch):
    from wait_for_peer import hold_local_search

    url = f"sqlite:///{tmp_path / 'g (1).sqlite'}"  # a path that URL rendering would escape
    monkeypatch.setattr(InProcessEvaluator, "evaluate", InProcessEvaluator.evaluate)  # undone after the test
    journal = study_journal(url, study_name(GemmFamily(), PROBLEM, CPU))  # the study's own journal file
    hold_local_search(journal)
    result = tune_problem(GemmFamily(), PROBLEM, CPU, trials=7, db_url=url, gpus=list(range(searches)),
                          retime_rounds=0, lookahead=1)
    rows = recorded_trials(open_engine(url), study_name(GemmFamily(), PROBLEM, CPU))
    assert len(rows) == 7 and len(set(rows.values())) == 7
    assert result.trials_this_run == 7 and sum(result.statuses.values()) == 7
    assert journal_path(journal).exists()
    pids = _owner_pids(journal, study_name(GemmFamily(), PROBLEM, CPU), rows)
    assert len(pids) == searches and os.getpid() in pids  # the first search here, each other in its own process


def _owner_pids(url: str, name: str, numbers) -> set[int]:
    """The pids of the searches that ran the given trials (owners are host:pid:token)."""
    trials = {t.number: t for t in optuna.load_study(study_name=name, storage=optuna_storage(url)).trials}
    return {int(trials[n].user_attrs[OWNER_ATTR].split(":")[1]) for n in numbers}


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except OSError:
        return False


def test_killed_multi_search_tuner_stops_its_searches_and_resumes(tmp_path):
    url = f"sqlite:///{tmp_path / 'm.sqlite'}"
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parent / "helpers")!r})
        from wait_for_peer import hold_local_search
        from autotile.device import interpret_device
        from autotile.families.gemm import FAMILY, contiguous_problem
        from autotile.tune.driver import tune_problem
        if __name__ == "__main__":
            hold_local_search({study_journal(url, study_name(GemmFamily(), PROBLEM, CPU))!r})
            tune_problem(FAMILY, contiguous_problem(24, 32, 64, "fp16", "fp16"), interpret_device(), trials=40,
                         db_url={url!r}, retime_rounds=0, gpus=[0, 1], lookahead=1)
    """)
    open_engine(url)
    name = study_name(GemmFamily(), PROBLEM, CPU)
    tuner = subprocess.Popen([sys.executable, "-c", script], env={**os.environ, "TRITON_INTERPRET": "1"})
    engine = open_engine(url)
    _kill_after(tuner, engine, name, recorded=4)
    searches = _owner_pids(study_journal(url, name), name, recorded_trials(engine, name))
    assert len(searches) == 2
    deadline = time.monotonic() + 120  # each finishes the trial it is in, then sees its tuner gone
    while any(_running(pid) for pid in searches) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_running(pid) for pid in searches), "a search process outlived its killed tuner"
    before = len(recorded_trials(engine, name))
    # Each search checks for its tuner once a second (_PARENT_CHECK_S): fast interpreter trials may add ~10 more
    # after the kill, never the 40 the killed run asked for.
    assert 4 <= before < 30
    target = max(12, before + 4)  # the resumed run has trials of its own to run
    result = tune_problem(GemmFamily(), PROBLEM, CPU, trials=target, db_url=url, retime_rounds=0, gpus=[0, 1],
                          lookahead=1)
    rows = recorded_trials(engine, name)
    assert result.trials_this_run == target - before and len(rows) == target and len(set(rows.values())) == target


def test_a_search_process_killed_mid_run_costs_its_trial_not_the_run(tmp_path):
    """kill -9 of one search of --gpus: the others finish the study and its winner is stored (the run failed, with
    no winner, though every trial was in)."""
    url = f"sqlite:///{tmp_path / 'd.sqlite'}"
    name = study_name(GemmFamily(), PROBLEM, CPU)
    journal = study_journal(url, name)
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parent / "helpers")!r})
        from wait_for_peer import hold_local_search
        from autotile.device import interpret_device
        from autotile.families.gemm import FAMILY, contiguous_problem
        from autotile.tune.driver import tune_problem
        if __name__ == "__main__":
            hold_local_search({journal!r})
            r = tune_problem(FAMILY, contiguous_problem(24, 32, 64, "fp16", "fp16"), interpret_device(), trials=14,
                             db_url={url!r}, retime_rounds=0, gpus=[0, 1], lookahead=1)
            print("winner", r.winner is not None)
    """)
    engine = open_engine(url)
    tuner = subprocess.Popen([sys.executable, "-c", script], env={**os.environ, "TRITON_INTERPRET": "1"},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline, peers = time.monotonic() + 120, set()
        while not peers and time.monotonic() < deadline and tuner.poll() is None:
            rows = recorded_trials(engine, name)
            peers = (_owner_pids(journal, name, rows) - {tuner.pid}) if len(rows) >= 3 else set()
            time.sleep(0.05)
        assert peers, "no search process ran a trial"
        os.kill(peers.pop(), signal.SIGKILL)
        out, err = tuner.communicate(timeout=240)
    finally:
        if tuner.poll() is None:
            tuner.kill()
    assert tuner.returncode == 0 and "winner True" in out, err[-2000:]
    assert len(recorded_trials(engine, name)) >= 14
    assert Store(engine).winners("gemm")


def test_tuning_refuses_an_in_memory_database():
    for gpus in (None, [0, 1]):
        with pytest.raises(TuneError, match="not an in-memory database"):
            tune_problem(GemmFamily(), PROBLEM, CPU, trials=2, db_url="sqlite:///:memory:", gpus=gpus)


def test_a_search_process_error_reaches_the_tuner():
    from autotile.tune.processes import _error_from, _error_to

    class Unpicklable(RuntimeError):
        def __reduce__(self):
            raise TypeError("no")

    assert isinstance(_error_from(_error_to(TuneError("bad shape"))), TuneError)
    assert str(_error_from(_error_to(TuneError("bad shape")))) == "bad shape"
    travelled = _error_from(_error_to(Unpicklable("lost the GPU")))
    assert isinstance(travelled, TuneError) and "lost the GPU" in str(travelled)


def test_cli_runs_two_searches_and_rejects_a_bad_gpu_list(tmp_path):
    from cli.main import cli

    db = tmp_path / "cli.sqlite"
    base = ["tune", "gemm", "--m", "24", "--n", "32", "--k", "64", "--dtype", "fp16", "--gpu", "interpret",
            "--db", str(db)]
    bad = CliRunner().invoke(cli, base + ["--gpus", "0,x"])
    assert bad.exit_code != 0 and "not a comma-separated list of GPU indices" in bad.output
    out = CliRunner().invoke(cli, base + ["--trials", "3", "--gpus", "0,1", "--trial-timeout", "60",
                                          "--no-compile-ahead"])
    assert out.exit_code == 0, out.output
    rows = recorded_trials(open_engine(f"sqlite:///{db}"), study_name(GemmFamily(), PROBLEM, CPU))
    assert len(rows) == 3 and len(set(rows.values())) == 3


def test_compile_ahead_pool_compiles_in_other_processes(tmp_path, monkeypatch):
    from recording_compile import record_compile

    from autotile.tune.compile_ahead import CompileAhead, NoCompileAhead, start_compile_ahead

    monkeypatch.setenv("AUTOTILE_TEST_COMPILE_LOG", str(tmp_path))
    family = GemmFamily()
    assert isinstance(start_compile_ahead(family, PROBLEM, CPU, 0, enabled=True), NoCompileAhead)  # interpreter
    configs = list(family.space(PROBLEM, CPU).feasible())[:3]
    pool = CompileAhead(family, PROBLEM, CPU, 0, processes=2, compile_fn=record_compile)
    try:
        pool.submit(configs)
        pool.submit(configs[:1])  # already submitted: not compiled twice
        for config in configs:
            pool.wait_for(config, limit_s=60)
    finally:
        pool.close()
    logs = [p.read_text().split(" ", 1) for p in tmp_path.iterdir()]
    assert sorted(text for _, text in logs) == sorted(c.to_json() for c in configs)
    assert all(int(pid) != os.getpid() for pid, _ in logs)
    assert pool.compiled + pool.dropped == 3 and pool.compiled >= 1


def test_closing_a_pool_stops_the_compiles_still_running():
    """A search's end does not wait for compiles nobody will use: close() terminates the processes in them."""
    from recording_compile import hang_compile

    from autotile.tune.compile_ahead import CompileAhead

    family = GemmFamily()
    configs = list(family.space(PROBLEM, CPU).feasible())[:3]
    pool = CompileAhead(family, PROBLEM, CPU, 0, processes=2, compile_fn=hang_compile)
    pool.submit(configs)
    running = [pool._futures[c.hash] for c in configs[:2]]
    deadline = time.monotonic() + 60
    while not all(f.running() for f in running) and time.monotonic() < deadline:
        time.sleep(0.01)
    processes = list(pool._pool._processes.values())
    started = time.monotonic()
    pool.close()
    assert time.monotonic() - started < 10
    # Each process has ended (its sentinel is ready; the executor's own thread may have reaped it first).
    from multiprocessing.connection import wait

    assert processes and len(wait([p.sentinel for p in processes], timeout=1)) == len(processes)


def test_compile_only_builds_each_kernels_launcher_but_launches_nothing(monkeypatch):
    """Within compile_only a Triton launch becomes a warm-up (compile, no run), and the compiled kernel's host
    launcher is built there too, not at the trial's first launch."""
    from triton.runtime.jit import JITFunction

    from autotile.tune.compile_ahead import compile_only

    class Compiled:
        handles = 0

        def _init_handles(self):
            Compiled.handles += 1

    calls = []

    def fake_run(self, *args, grid, warmup, **kwargs):
        calls.append(warmup)
        return Compiled()

    monkeypatch.setattr(JITFunction, "run", fake_run)
    with compile_only():
        kernel = JITFunction.run(None, 1, 2, grid=(1,), warmup=False, BLOCK=16)
    assert calls == [True] and Compiled.handles == 1 and isinstance(kernel, Compiled)
    assert JITFunction.run is fake_run  # restored


def test_compile_only_is_per_thread(monkeypatch):
    """A thread inside compile_only (a benchmark's compile thread) leaves other threads' launches alone, and the
    hook on JITFunction.run is gone once no thread is in such a block."""
    from triton.runtime.jit import JITFunction

    from autotile.tune.compile_ahead import compile_only

    calls = []

    def fake_run(self, *args, grid, warmup, **kwargs):
        calls.append((threading.current_thread().name, warmup))

    monkeypatch.setattr(JITFunction, "run", fake_run)
    with compile_only():
        JITFunction.run(None, grid=(1,), warmup=False)
        other = threading.Thread(target=lambda: JITFunction.run(None, grid=(1,), warmup=False), name="other")
        other.start()
        other.join()
    assert calls == [("MainThread", True), ("other", False)]
    assert JITFunction.run is fake_run
