"""Several searches of one tune_problem call, one process each, so their Python runs in parallel.

As threads of one process the searches took turns under the GIL: each trial
costs its search 0.2-0.3 s of Python (Optuna's ask and tell, the claims),
about as long as a short GEMM trial, and two H200s tuned only 1.09x as fast
as one (benchmarks/RESULTS.md). The first search runs in the tuner's own
process; each other one in a search process that rebuilds its plan from
plain data (database URLs, a family reference, the problem as a dict), runs
one `_Search` on the shared study, and sends its progress and result to the
tuner on a queue. The tuner draws the progress, sums the results, and on
Ctrl-C tells every search to stop after its current trial.

Search processes ignore SIGINT (the terminal sends it to the whole process
group; the parent decides) and stop by themselves when the parent is gone,
so a killed tuner leaves no search running: a rerun resumes as after any kill.
"""
from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import pickle
import logging
import queue
import signal
import threading
import time
import traceback
from collections.abc import Sequence

from autotile.device import DeviceInfo
from autotile.space import Config
from autotile.tune.search import Progress, TuneError, _Search, _SearchPlan, _SharedState, best_recorded
from autotile.tune.workers import born_ignoring_ctrl_c, family_ref, ignore_ctrl_c, resolve_family

log = logging.getLogger("autotile.tune")

# Seconds between a search process's looks at whether its parent is still there.
_PARENT_CHECK_S = 1.0
# Seconds the parent waits for a report before it looks at the processes again.
_POLL_S = 0.5
# After a search process exited, its last reports may still be in flight this long.
_DRAIN_AFTER_EXIT_S = 5.0


@dataclasses.dataclass(frozen=True)
class _SearchSpec:
    """What a search process needs to rebuild its part of the plan: plain, picklable data."""

    family: str  # a family_ref
    problem: dict
    db_url: str
    storage_url: str
    plan: dict  # the _SearchPlan fields that are plain values
    seconds_left: float | None  # the run's --timeout, as time left when the process was started
    slot: int
    gpu: int | None
    device: DeviceInfo
    parent_pid: int


_PLAIN_FIELDS = ("name", "ids", "trials", "timeout", "seed", "isolate", "trial_timeout", "compile_ahead",
                 "lookahead", "distributed", "rows_complete")


class CtrlC:
    """Within this block the first Ctrl-C asks the searches to stop after their current trial; a second one
    raises KeyboardInterrupt at once.

    NOTE: a KeyboardInterrupt raised wherever the tuner happens to be can cut a database transaction short
    and leave its connection holding SQLite's write lock; storing the best so far afterwards then waited 30 s
    and failed ("database is locked"). A stop request ends the search between trials, where nothing is open.
    Only the main thread can take signals: elsewhere the block does nothing.

    >>> import threading
    >>> stop = threading.Event()
    >>> with CtrlC() as ctrl_c:
    ...     ctrl_c.stops(stop)  # the search loop checks `stop` between trials
    >>> ctrl_c.pressed, stop.is_set()
    (False, False)
    """

    def __init__(self):
        self.pressed = False
        self._events: list = []
        self._previous = None

    def stops(self, event) -> None:
        """Set `event` (a threading or multiprocessing Event) on the first Ctrl-C."""
        self._events.append(event)
        if self.pressed:
            event.set()

    def _handler(self, signum, frame) -> None:
        if self.pressed:
            raise KeyboardInterrupt
        self.pressed = True
        log.warning("autotile: Ctrl-C: stopping after the current trial, then storing the best so far "
                    "(Ctrl-C again stops at once)")
        for event in self._events:
            event.set()

    def __enter__(self) -> CtrlC:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None


def run_search_processes(plan: _SearchPlan, targets: Sequence[tuple[int | None, DeviceInfo]], db_url: str,
                         storage_url: str, ctrl_c: CtrlC | None = None, session=None) -> _SharedState:
    """Run one search per (gpu, device) target on `plan`'s study; returns their combined state.

    `ctrl_c` (the caller's CtrlC block) stops every search after its current trial; a KeyboardInterrupt
    (a second Ctrl-C) stops them too and comes back in `.error`.

    The first target's search runs in this process (a thread beside the one relaying reports, which
    mostly waits), so it starts at once, with the worker and pool of `session` (a TuneSession) when given;
    every other target gets a search process, which starts its own.
    """
    context = multiprocessing.get_context("spawn")
    reports = context.Queue()
    stop = context.Event()
    if ctrl_c is not None:
        ctrl_c.stops(stop)
    seconds_left = None if plan.deadline is None else max(0.0, plan.deadline - time.monotonic())
    plain = {name: getattr(plan, name) for name in _PLAIN_FIELDS}
    processes = {}
    for slot, (gpu, device) in enumerate(targets[1:], start=1):
        spec = _SearchSpec(family_ref(plan.family), dataclasses.asdict(plan.problem), db_url, storage_url, plain,
                           seconds_left, slot, gpu, device, os.getpid())
        # Not daemonic: a search process starts trial workers and compile processes of its own.
        process = context.Process(target=_search_process_main, args=(spec, reports, stop),
                                  name=f"autotile-search-{gpu if gpu is not None else slot}")
        with born_ignoring_ctrl_c():
            process.start()
        processes[slot] = process
    shared = _SharedState(stop=stop, best=best_recorded(plan))
    local = threading.Thread(target=_Search(plan, 0, *targets[0], shared, session=session).run,
                             name="autotile-search-0")
    local.start()
    try:
        _collect(processes, reports, shared, plan)
        local.join()
    except KeyboardInterrupt:
        # Every search stops after its current trial; every finished trial is stored by then.
        stop.set()
        _collect(processes, reports, shared, plan)
        local.join()
        with shared.lock:
            shared.error = shared.error or KeyboardInterrupt()
    finally:
        for process in processes.values():
            process.join(_DRAIN_AFTER_EXIT_S)
            if process.is_alive():
                process.kill()
                process.join()
    return shared


def _collect(processes: dict, reports, shared: _SharedState, plan: _SearchPlan) -> None:
    """Forward progress and gather results until every search process has reported or died."""
    done: set[int] = set()
    exited_at: dict[int, float] = {}
    lost: list[str] = []
    while len(done) < len(processes):
        try:
            slot, kind, data = reports.get(timeout=_POLL_S)
        except queue.Empty:
            now = time.monotonic()
            for slot, process in processes.items():
                if slot in done or process.is_alive():
                    continue
                exited_at.setdefault(slot, now)
                if now - exited_at[slot] > _DRAIN_AFTER_EXIT_S:  # died without reporting
                    done.add(slot)
                    lost.append(f"search process {process.name} exited with code {process.exitcode} before it "
                                "reported")
            continue
        if kind == "progress":
            if plan.progress:
                plan.progress(_progress_from(data))
        elif kind == "done":
            done.add(slot)
            _merge(shared, data)
    for line in lost:
        # This process's own search goes on to the target (its census fails the lost search's claimed trial as
        # stale): a lost search costs its trial in flight, not the run.
        log.warning("autotile: %s; the other searches go on to the target", line)


def _merge(shared: _SharedState, result: dict) -> None:
    with shared.lock:
        shared.this_run += result["this_run"]
        if result["best"] is not None and (shared.best is None or result["best"] < shared.best):
            shared.best = result["best"]
        shared.stopped = shared.stopped or result["stopped"]
        shared.context_lost = shared.context_lost or result["context_lost"]
        if result["error"] is not None and shared.error is None:
            shared.error = _error_from(result["error"])


# --- the search process ----------------------------------------------------------------------------
def _search_process_main(spec: _SearchSpec, reports, stop) -> None:
    ignore_ctrl_c()  # the parent handles Ctrl-C and sets `stop`
    threading.Thread(target=_stop_when_orphaned, args=(spec.parent_pid, stop), daemon=True).start()
    shared = _SharedState(stop=stop)
    try:
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        plan = _rebuild_plan(spec, lambda progress: reports.put((spec.slot, "progress", _progress_to(progress))))
        shared.best = best_recorded(plan)
        _Search(plan, spec.slot, spec.gpu, spec.device, shared).run()
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        shared.error = shared.error or exc
    reports.put((spec.slot, "done", {
        "this_run": shared.this_run, "best": shared.best, "stopped": shared.stopped,
        "context_lost": shared.context_lost, "error": None if shared.error is None else _error_to(shared.error),
    }))
    reports.close()
    reports.join_thread()  # the reports reach the pipe before the process exits


def _rebuild_plan(spec: _SearchSpec, progress) -> _SearchPlan:
    from autotile.store.db import open_engine
    from autotile.store.repo import Store
    from autotile.tune.storage import optuna_storage

    family = resolve_family(spec.family)
    problem = family.problem_from_dict(spec.problem)
    engine = open_engine(spec.db_url, create=False)
    deadline = None if spec.seconds_left is None else time.monotonic() + spec.seconds_left
    return _SearchPlan(family=family, problem=problem, space=family.space(problem, spec.device), engine=engine,
                       store=Store(engine), storage=optuna_storage(spec.storage_url), deadline=deadline,
                       progress=progress, **spec.plan)


def _stop_when_orphaned(parent_pid: int, stop) -> None:
    while not stop.is_set():
        if os.getppid() != parent_pid:  # the tuner was killed: finish the current trial and exit
            stop.set()
            return
        time.sleep(_PARENT_CHECK_S)


# --- what travels on the queue ------------------------------------------------------------------------
def _progress_to(progress: Progress) -> dict:
    config = progress.last_config
    return {"evaluated": progress.evaluated, "target": progress.target, "best_ms": progress.best_ms,
            "last_status": progress.last_status, "last_config": None if config is None else config.to_json()}


def _progress_from(data: dict) -> Progress:
    config = None if data["last_config"] is None else Config(json.loads(data["last_config"]))
    return Progress(**{**data, "last_config": config})


def _error_to(exc: BaseException) -> tuple[bytes | None, str]:
    text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    try:
        return pickle.dumps(exc), text
    except Exception:  # noqa: BLE001 - an exception that does not pickle travels as its text
        return None, text


def _error_from(error: tuple[bytes | None, str]) -> BaseException:
    blob, text = error
    if blob is not None:
        try:
            return pickle.loads(blob)
        except Exception:  # noqa: BLE001
            pass
    return TuneError(f"a search process failed: {text}")
