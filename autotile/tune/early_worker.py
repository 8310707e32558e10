"""A trial worker started before the tuner knows its problem or device, from a module that imports no torch.

`autotile tune` on a GPU spends seconds importing torch and resolving its device before it knows what to
tune, and the trial worker's own start-up (spawn, import torch and triton, CUDA context: ~11 s on the H200
machines) came only after that. `spawn_early_worker` starts the worker first thing, so both imports run at
once; the first `IsolatedEvaluator` of the default GPU takes it over (`take_early_worker`) and sends it its
device with its first problem. A worker nothing takes is a daemon: it stops when this process exits.
"""
from __future__ import annotations

import contextlib
import multiprocessing
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

# The worker spawn_early_worker started and no evaluator has taken yet: (process, connection, log path, launch time).
_EARLY_WORKER: tuple | None = None


@contextlib.contextmanager
def born_ignoring_ctrl_c() -> Iterator[None]:
    """Processes started within this block cannot be stopped by Ctrl-C while they start up.

    Ctrl-C reaches the whole process group; the tuner decides what stops (see `ignore_ctrl_c`). A child
    sets SIGINT to ignored first thing in its main function, but spawn imports torch before that, and a
    Ctrl-C then killed it ("exited with code -2 before it reported"). NOTE: the signal mask survives fork
    and exec, so SIGINT blocked here around the start stays blocked in the child until `ignore_ctrl_c`.
    """
    if not hasattr(signal, "pthread_sigmask"):  # not POSIX
        yield
        return
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def _early_worker_main(conn, log_path: str) -> None:
    from autotile.tune.workers import _worker_main

    _worker_main(conn, None, log_path)


def spawn_early_worker() -> None:
    """Start a trial worker for the default GPU now (once per process), without importing torch here."""
    global _EARLY_WORKER
    if _EARLY_WORKER is not None:
        return
    context = multiprocessing.get_context("spawn")
    parent_conn, child_conn = context.Pipe()
    log_path = Path(tempfile.mkdtemp(prefix="autotile-worker-")) / "worker-early.log"
    process = context.Process(target=_early_worker_main, args=(child_conn, str(log_path)), daemon=True,
                              name="autotile-worker-early")
    with born_ignoring_ctrl_c():
        process.start()
    child_conn.close()
    _EARLY_WORKER = (process, parent_conn, log_path, time.monotonic())


def take_early_worker() -> tuple | None:
    """(process, connection, log path, launch time) of the worker `spawn_early_worker` started, once; None when
    there is none or it has died."""
    global _EARLY_WORKER
    early, _EARLY_WORKER = _EARLY_WORKER, None
    if early is None or not early[0].is_alive():
        return None
    return early
