"""A tuning session: the trial worker and the compile-ahead pool of a run over many problems, started once.

Starting a trial worker (spawn, import torch and triton, create a CUDA context) took ~11 s on the H200
machines (benchmarks/RESULTS.md, "Tuning throughput"); a model's 56-84 GEMM problems paid that before every
problem's first trial (the compile-ahead pool is forked and ready at once; keeping it saves its forks). A
`TuneSession` keeps one worker and one pool per device for as long as it is open and points them at each
problem in turn (a message, not a new process): `tune_problem(..., session=...)` uses it, and so does every
`tune_problem` call made inside `with TuneSession():` in the same thread (the CLI's multi-problem runs,
`tune_planned`).

What stays as it was for one problem: a trial that crashes or hangs its worker is filed as `crash` or
`timeout` and the next trial gets a new worker, which the session then keeps; a worker cut short in the
middle of a trial (a second Ctrl-C) is stopped, not reused. Closing the session (its `with` block ends,
normally, by an error or by Ctrl-C) stops every process it started. Without a session, `tune_problem`
opens a private one and closes it when its search ends.

>>> from autotile.device import interpret_device
>>> from autotile.families.gemm import FAMILY, contiguous_problem
>>> from autotile.tune.driver import tune_problem
>>> with TuneSession() as session:  # doctest: +SKIP
...     for m in (16, 32):
...         tune_problem(FAMILY, contiguous_problem(m, 64, 64, "fp16", "fp16"), interpret_device(), trials=3,
...                      isolate=True, db_url="sqlite:////tmp/tuning.sqlite")
...     session.stats().worker_starts
1
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from autotile.device import DeviceInfo
from autotile.families.base import Family
from autotile.tune.compile_ahead import CompileAhead, start_compile_ahead
from autotile.tune.workers import IsolatedEvaluator

# The session `with TuneSession():` opened in this context (thread), used by tune_problem when given none.
_CURRENT: contextvars.ContextVar[TuneSession | None] = contextvars.ContextVar("autotile_tune_session", default=None)


@dataclass(frozen=True)
class SessionStats:
    """What a session started and ran, for reports and benchmarks."""

    searches: int  # searches run in the session
    worker_starts: int  # trial worker processes started (a crashed or hung worker's replacement counts)
    worker_pids: tuple[int, ...]  # their pids, in order
    worker_start_s: tuple[float, ...]  # spawn to ready, per worker that reported ready
    pool_starts: int  # compile-ahead pools started (each starts its processes on first use)


class TuneSession:
    """Keeps one trial worker and one compile-ahead pool per device across the problems tuned in it.

    A search borrows them with `trial_evaluator` / `compile_pool` and hands them back with `give_back`
    (which closes what the session does not keep). A worker or pool already lent out (two searches of one
    device at once) is not shared: the second search gets its own, closed when it is given back.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._evaluators: dict[tuple, IsolatedEvaluator] = {}
        self._pools: dict[tuple, CompileAhead] = {}
        self._lent: set[int] = set()  # id() of kept objects now lent to a search
        self._retired: list = []  # what `close` stopped: its counts still count in `stats`
        self._searches = 0
        self._closed = False
        self._token = None

    # --- lending ----------------------------------------------------------------------------------
    def trial_evaluator(self, family: Family, problem, device: DeviceInfo, seed: int, trial_timeout: float,
                        gpu: int | None = None) -> IsolatedEvaluator:
        """The device's worker, pointed at `problem` (started now if the session has none yet)."""
        key = (gpu, device)
        with self._lock:
            self._check_open()
            kept = self._evaluators.get(key)
            if kept is not None and id(kept) not in self._lent:
                kept.trial_timeout = trial_timeout
                kept.retarget(family, problem, seed)
                self._lent.add(id(kept))
                return kept
        evaluator = IsolatedEvaluator(family, problem, device, seed, trial_timeout, gpu=gpu)
        with self._lock:
            if key not in self._evaluators:
                self._evaluators[key] = evaluator
                self._lent.add(id(evaluator))
        return evaluator

    def compile_pool(self, family: Family, problem, device: DeviceInfo, seed: int, enabled: bool,
                     gpu: int | None = None, start: Callable = start_compile_ahead):
        """The device's compile-ahead pool, pointed at `problem`; a no-op pool when disabled or interpreted.

        `start(family, problem, device, seed, enabled)` makes a new pool when the session has none.
        """
        key = (gpu, device)
        with self._lock:
            self._check_open()
            self._searches += 1  # every search asks for its pool once (a no-op pool when it compiles nothing)
            kept = self._pools.get(key)
            if enabled and kept is not None and id(kept) not in self._lent:
                kept.retarget(family, problem, seed)
                self._lent.add(id(kept))
                return kept
        pool = start(family, problem, device, seed, enabled)
        if isinstance(pool, CompileAhead):
            with self._lock:
                if key not in self._pools:
                    self._pools[key] = pool
                    self._lent.add(id(pool))
        return pool

    def prestart(self, family: Family, problem, device: DeviceInfo, seed: int, trial_timeout: float,
                 compile_ahead: bool, first_configs=(), gpu: int | None = None, isolate: bool = True) -> None:
        """Start the device's trial worker (`isolate`) and compile-ahead pool for `problem` now, without lending them.

        The worker imports torch, creates its CUDA context and builds its inputs, and the pool compiles
        `first_configs` (the configs the study will ask first), while the tuner opens its database and study;
        the search then borrows them (`trial_evaluator`, `compile_pool`) pointed at the same problem.
        """
        key = (gpu, device)
        with self._lock:
            self._check_open()
            evaluator = self._evaluators.get(key)
            pool = self._pools.get(key)
            if (evaluator is not None and id(evaluator) in self._lent) or (pool is not None and id(pool) in self._lent):
                return  # a search of this device is running: it started its own
        if isolate and evaluator is None:
            evaluator = IsolatedEvaluator(family, problem, device, seed, trial_timeout, gpu=gpu)
            with self._lock:
                self._evaluators.setdefault(key, evaluator)
        elif isolate:
            evaluator.trial_timeout = trial_timeout
            evaluator.retarget(family, problem, seed)
        if isolate:
            evaluator.prestart()
        if not compile_ahead or device.interpret:
            return
        if pool is None:
            pool = start_compile_ahead(family, problem, device, seed, True)
            with self._lock:
                self._pools.setdefault(key, pool)
        else:
            pool.retarget(family, problem, seed)
        pool.submit(first_configs)

    def give_back(self, thing) -> None:
        """A search is done with `thing` (an evaluator or a pool): kept ones wait for the next problem, others close."""
        with self._lock:
            kept = id(thing) in self._lent and not self._closed
            self._lent.discard(id(thing))
        if kept:
            thing.release()
        else:
            thing.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this TuneSession is closed: open a new one")

    # --- life ----------------------------------------------------------------------------------------
    def stats(self) -> SessionStats:
        with self._lock:
            kept = self._retired + list(self._evaluators.values()) + list(self._pools.values())
            evaluators = [e for e in kept if isinstance(e, IsolatedEvaluator)]
            pools = [p for p in kept if isinstance(p, CompileAhead)]
        return SessionStats(searches=self._searches,
                            worker_starts=sum(e.workers_started for e in evaluators),
                            worker_pids=tuple(pid for e in evaluators for pid in e.worker_pids),
                            worker_start_s=tuple(s for e in evaluators for s in e.start_seconds),
                            pool_starts=sum(p.pools_started for p in pools))

    def close(self) -> None:
        """Stop every worker and pool process the session started. Safe to call twice."""
        with self._lock:
            self._closed = True
            kept = list(self._evaluators.values()) + list(self._pools.values())
            self._retired.extend(kept)
            self._evaluators.clear()
            self._pools.clear()
            self._lent.clear()
        errors = []
        for thing in kept:
            try:
                thing.close()
            except BaseException as exc:  # noqa: BLE001 - close the rest, then raise the first
                errors.append(exc)
        if errors:
            raise errors[0]

    def __enter__(self) -> TuneSession:
        self._token = _CURRENT.set(self)
        return self

    def __exit__(self, *exc) -> None:
        if self._token is not None:
            _CURRENT.reset(self._token)
            self._token = None
        self.close()


def current_session() -> TuneSession | None:
    """The session of the innermost open `with TuneSession():` block in this thread, if any."""
    session = _CURRENT.get()
    return None if session is None or session._closed else session


def prestart_search(family: Family, problem, device: DeviceInfo, *, seed: int = 0, trial_timeout: float | None = None,
                    compile_ahead: bool = True, gpus=None, isolate: bool | None = None, **_ignored) -> bool:
    """Start the trial worker and compile pool that `tune_problem(family, problem, device, ...)` with these
    arguments will use, in the session open in this thread, before the tuner is even imported (Optuna,
    Alembic); False when there is no session or the search would not use them (several GPUs, in-process
    trials). The other tune_problem arguments are accepted and ignored.
    """
    from autotile.tune.workers import default_trial_timeout

    session = current_session()
    isolate = (not device.interpret) if isolate is None else isolate
    if session is None or gpus or not isolate:
        return False
    session.prestart(family, problem, device, seed, trial_timeout or default_trial_timeout(device), compile_ahead,
                     first_configs=[family.default_config(problem, device)])
    return True


@contextlib.contextmanager
def session_scope() -> Iterator[TuneSession]:
    """The session open in this context, or a new one for the length of the block."""
    session = current_session()
    if session is not None:
        yield session
        return
    with TuneSession() as session:
        yield session


def in_session(fn: Callable) -> Callable:
    """Run `fn` inside `session_scope()`: every problem it tunes shares one worker and pool per device."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with session_scope():
            return fn(*args, **kwargs)

    return wrapper
