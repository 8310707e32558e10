"""`autotile tune` on a GPU, on every exit path: kill -9 and resume, a rerun of the finished study, Ctrl-C.

On a GPU each trial runs in a worker process and a pool of processes compiles ahead (the CPU tests cover
neither). Each run must exit with the status it promises and leave no process of its own running.

    python -m pytest -q -p no:cacheprovider -m gpu tests/test_robustness_gpu.py    # about 2-4 minutes on an H200
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SHAPE = ["--m", "256", "--n", "256", "--k", "512", "--dtype", "fp16"]


def _cli(db: str, trials: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "autotile.cli.main", "tune", "gemm", *SHAPE, "--gpu", "auto", "--trials",
            str(trials), "--db", db, *extra]


def _rows(db: str) -> int:
    from autotile.store.db import open_engine
    from autotile.store.repo import Store

    try:
        return len(Store(open_engine(db, create=False, read_only=True)).trials("gemm"))
    except Exception:  # noqa: BLE001 - not created yet
        return 0


def _session_left(session: int) -> list[str]:
    """Processes still alive in the session the tuner led (its workers, compile pools, search processes)."""
    left = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        fields = text.rsplit(")", 1)[1].split()
        if int(fields[3]) == session and fields[0] != "Z":  # field 6 of stat: the session id
            left.append(text.split(")", 1)[0] + ")")
    return left


def _start(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _finish(tuner: subprocess.Popen, limit_s: float = 600) -> tuple[int, str, str]:
    out, err = tuner.communicate(timeout=limit_s)
    deadline = time.monotonic() + 30
    while _session_left(tuner.pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _session_left(tuner.pid), f"left running after the tuner exited: {_session_left(tuner.pid)}"
    return tuner.returncode, out, err


def _wait_for_rows(db: str, tuner: subprocess.Popen, count: int, limit_s: float = 600) -> None:
    deadline = time.monotonic() + limit_s
    while _rows(db) < count:
        assert tuner.poll() is None and time.monotonic() < deadline, "the tuner ended before it stored the trials"
        time.sleep(0.2)


def test_kill_resume_and_rerun_on_a_gpu(tmp_path):
    db = str(tmp_path / "gpu.sqlite")
    tuner = _start(_cli(db, 8))
    _wait_for_rows(db, tuner, 2)
    os.killpg(tuner.pid, signal.SIGKILL)  # the tuner and everything it started, as an OOM killer might
    tuner.wait(60)
    resumed = _start(_cli(db, 8))
    code, out, err = _finish(resumed)
    assert code == 0 and any(line.startswith("winner") for line in out.splitlines()), err[-3000:]
    again = _start(_cli(db, 8))
    code, out, err = _finish(again)
    assert code == 0 and "study already complete" in out, err[-3000:]  # was: abort at exit, status 134


def test_ctrl_c_on_a_gpu_stores_the_best_so_far(tmp_path):
    db = str(tmp_path / "gpu-int.sqlite")
    tuner = _start(_cli(db, 200))
    _wait_for_rows(db, tuner, 3)
    os.killpg(tuner.pid, signal.SIGINT)  # a terminal's Ctrl-C reaches the workers and compile pools too
    code, out, err = _finish(tuner)
    assert code == 130 and "interrupted: the best so far is stored" in err, err[-3000:]
    assert "Traceback" not in err and "stopped early: interrupted (Ctrl-C)" in out
    from autotile.store.db import open_engine
    from autotile.store.repo import Store

    (winner,) = Store(open_engine(db, create=False, read_only=True)).winners("gemm")
    statuses = {t["status"] for t in Store(open_engine(db, create=False, read_only=True)).trials("gemm")}
    assert winner.trials_run >= 3 and "crash" not in statuses  # no trial was cut short and filed as a crash


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_ctrl_c_stops_every_search_process(tmp_path):
    db = str(tmp_path / "gpus.sqlite")
    tuner = _start(_cli(db, 400, "--gpus", "0,1"))
    _wait_for_rows(db, tuner, 4)
    os.killpg(tuner.pid, signal.SIGINT)
    code, out, err = _finish(tuner)
    assert code == 130 and "interrupted: the best so far is stored" in err, err[-3000:]
