"""Several searches on one study: claims, heartbeats and stale trials, so no trial is lost or run twice.

Every search (a thread per GPU, or a process per host on a shared storage)
asks Optuna for trials and marks each with its owner
(`host:pid:token`). Before it runs a config it *claims* the trial (a user
attribute holding the config hash), then reads the other live claims: if
the evaluated trials plus the other claims already reach the target, or
another search claimed the same config, it withdraws (the trial is told
PRUNED) and looks again. Whichever of two racing searches reads second sees
the first's claim, so they never both run past the target or run one config
twice; when both see each other both withdraw and retry after a random pause.

The count of evaluated trials comes from autotile's own table (one row per
trial, written in one transaction), so a process killed between writing that
row and telling Optuna still counts exactly once; trials other hosts told
Optuna count too, for hosts that share only the Optuna storage.

A trial left RUNNING by a killed process is stale: on this host when its
owner's pid is gone, anywhere when its heartbeat (refreshed by a thread
while the trial is queued or running) is older than `stale_after_s`, and
`OWNERLESS_STALE_AFTER_S` after it was asked when the process died before
naming itself on it. Stale trials are told FAIL. None of this moves the
count, which comes from autotile's rows: a rerun of the same command
resumes to exactly `--trials`.
"""
from __future__ import annotations

import os
import socket
import threading
import time
import uuid

import optuna
from sqlalchemy import select
from sqlalchemy.orm import Session

from autotile.store.models import Trial as TrialRow

# Seconds between heartbeats of a search's queued and running trials.
HEARTBEAT_S = 20.0
# A RUNNING trial whose heartbeat is older than this is stale (its process is gone).
STALE_AFTER_S = 180.0
# A RUNNING trial with no owner and no heartbeat is stale this long after it was asked (a search names
# itself on a trial right after asking for it).
OWNERLESS_STALE_AFTER_S = 30.0
# Attribute names on Optuna trials.
OWNER_ATTR = "owner"
CLAIM_ATTR = "claimed_hash"
HEARTBEAT_ATTR = "heartbeat"
_HOST = socket.gethostname()


def new_owner() -> str:
    """A token naming one search: host, pid and a random part (several threads of one process differ)."""
    return f"{_HOST}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return not _is_zombie(pid)


def _is_zombie(pid: int) -> bool:
    """Whether `pid` has exited and waits to be reaped (in a container whose init reaps nobody, for good)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):  # no /proc (not Linux) or gone meanwhile
        return False


def owner_is_gone(owner: str) -> bool:
    """Whether the process that owns a trial has certainly exited (only known for owners on this host)."""
    host, _, rest = owner.partition(":")
    pid_text = rest.partition(":")[0]
    if host != _HOST or not pid_text.isdigit():
        return False
    pid = int(pid_text)
    return pid != os.getpid() and not _pid_alive(pid)


def recorded_trials(engine, study: str) -> dict[int, str]:
    """Trial number -> config hash of every trial autotile has a row for in `study`."""
    with Session(engine) as session:
        rows = session.execute(select(TrialRow.number, TrialRow.config_hash).where(TrialRow.study == study)).all()
    return {int(number): config_hash for number, config_hash in rows}


def evaluated_trials(engine, study: optuna.Study, name: str, rows_complete: bool = False) -> dict[int, str]:
    """Trial number -> config hash of every evaluated trial of the study.

    autotile's rows are the record (one transaction per trial); trials other hosts told Optuna are added,
    for hosts that share only the Optuna storage (`--storage`) and keep their rows in their own databases.
    `rows_complete` (the study lives in the database of the rows) skips that read: every search there
    writes its row before it tells Optuna.
    """
    evaluated = recorded_trials(engine, name)
    if rows_complete:
        return evaluated
    finished = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.FAIL)
    for trial in study.get_trials(deepcopy=False, states=finished):
        if "status" in trial.user_attrs and "config_hash" in trial.user_attrs:
            evaluated.setdefault(trial.number, trial.user_attrs["config_hash"])
    return evaluated


def _is_stale(trial: optuna.trial.FrozenTrial, now: float, stale_after_s: float) -> bool:
    owner = trial.user_attrs.get(OWNER_ATTR)
    if owner and owner_is_gone(owner):
        return True
    beat = trial.user_attrs.get(HEARTBEAT_ATTR)
    if beat is not None:
        return now - float(beat) > stale_after_s
    # No owner yet: its search was stopped between asking and naming itself (or is in that step right now).
    started = trial.datetime_start
    # Optuna stamps trials with naive local time, which .timestamp() reads as local time.
    return started is not None and now - started.timestamp() > OWNERLESS_STALE_AFTER_S


def fail_stale_trials(study: optuna.Study, stale_after_s: float = STALE_AFTER_S) -> list[int]:
    """Tell FAIL every RUNNING trial whose owner is gone or whose heartbeat stopped; returns their numbers."""
    now = time.time()
    failed = []
    for trial in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        if not _is_stale(trial, now, stale_after_s):
            continue
        try:
            study.tell(trial.number, state=optuna.trial.TrialState.FAIL, skip_if_finished=True)
            failed.append(trial.number)
        except (RuntimeError, ValueError):  # its owner finished it meanwhile
            continue
    return failed


def census(engine, study: optuna.Study, name: str, owner: str, rows_complete: bool = False
           ) -> tuple[dict[int, str], dict[int, str]]:
    """(evaluated, others' live claims): trial number -> config hash of each, as one consistent count.

    A trial moves claimed (RUNNING) -> row written -> told finished, so the claims are read first: a trial
    that finishes between the two reads then shows up in the second. Read the other way round, it would be
    in neither, and two searches could both run the last trial of the target.
    """
    running = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))
    evaluated = evaluated_trials(engine, study, name, rows_complete)
    claims = {}
    for trial in running:
        claimed = trial.user_attrs.get(CLAIM_ATTR)
        if claimed and trial.number not in evaluated and trial.user_attrs.get(OWNER_ATTR) != owner:
            claims[trial.number] = claimed
    return evaluated, claims


class Heartbeat:
    """A daemon thread that refreshes the heartbeat of the trials a search holds (queued or running)."""

    def __init__(self, study: optuna.Study, interval_s: float = HEARTBEAT_S):
        self.study = study
        self.interval_s = interval_s
        self._held: dict[int, optuna.trial.Trial] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="autotile-heartbeat", daemon=True)

    def hold(self, trial: optuna.trial.Trial) -> None:
        with self._lock:
            self._held[trial.number] = trial
        self._beat(trial)

    def release(self, trial: optuna.trial.Trial) -> None:
        with self._lock:
            self._held.pop(trial.number, None)

    def _beat(self, trial: optuna.trial.Trial) -> None:
        try:
            trial.set_user_attr(HEARTBEAT_ATTR, time.time())
        except (RuntimeError, ValueError):  # told meanwhile
            pass
        except Exception:  # noqa: BLE001 - a storage hiccup; the next beat tries again
            pass

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            with self._lock:
                held = list(self._held.values())
            for trial in held:
                self._beat(trial)

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(5)
