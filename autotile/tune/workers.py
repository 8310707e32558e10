"""Where a trial runs: in this process, or in a worker process that a crash or a hang costs one trial.

An illegal memory access poisons a CUDA context for good and a launch that
never returns blocks its process, so on a GPU each trial runs in a long-lived
worker process (one per GPU, started with multiprocessing's "spawn"). The
parent waits at most the per-trial time limit; when the worker dies or runs
past it, the parent files the trial as `crash` or `timeout` with the exit
code or signal, the last lines the worker printed and a command that renders
the candidate, then starts a new worker. Workers keep their input sets and
references across trials, and their process (imports, CUDA context, Triton's
loaded kernels) across problems: a message retargets a worker to the next
problem, of any family (autotile.tune.session keeps one per device for a run).

The worker receives only plain data: a family reference (a registered name,
or `module:Class` for families outside the registry), the problem as a dict,
the device, a seed and config JSON; it answers with the TrialOutcome as a dict.
"""
from __future__ import annotations

import dataclasses
import importlib
import json
import multiprocessing
import os
import shlex
import shutil
import signal
import tempfile
import threading
import time
import traceback
from pathlib import Path

from autotile.bench import Status, Timing, TrialOutcome
from autotile.device import DeviceInfo
from autotile.families.base import Family
from autotile.space import Config
from autotile.tune.early_worker import born_ignoring_ctrl_c, take_early_worker  # noqa: F401 - re-exported

# Input sets (with their references) the trials rotate through.
INPUT_SETS = 2
# A trial may take this long on a GPU before the worker is killed and the trial filed as 'timeout'.
DEFAULT_TRIAL_TIMEOUT_GPU_S = 120.0
# Under the interpreter a trial is a CPU emulation and may take minutes.
DEFAULT_TRIAL_TIMEOUT_INTERPRET_S = 600.0
# A new worker has this long to import torch/triton and report ready.
_WORKER_START_LIMIT_S = 300.0
# Lines of the worker's output kept in the error text of a crash or timeout.
_STDERR_TAIL_LINES = 20
# Serialises the environment swap around starting a worker (threads of --gpus start workers at once).
_SPAWN_LOCK = threading.Lock()


def ignore_ctrl_c() -> None:
    """In a worker, compile or search process: ignore SIGINT (dropping one that came while it started)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


class WorkerSetupError(RuntimeError):
    """The worker could not load the family or build inputs and references: no trial can run."""


def default_trial_timeout(device: DeviceInfo) -> float:
    return DEFAULT_TRIAL_TIMEOUT_INTERPRET_S if device.interpret else DEFAULT_TRIAL_TIMEOUT_GPU_S


def family_ref(family: Family) -> str:
    """How a worker process finds `family`: its registered name, else `module:Class` (built with no arguments)."""
    from autotile.families import FAMILY_MODULES, get_family

    if family.name in FAMILY_MODULES and get_family(family.name) is family:
        return family.name
    cls = type(family)
    return f"{cls.__module__}:{cls.__qualname__}"


def resolve_family(ref: str) -> Family:
    """The family a `family_ref` names."""
    from autotile.families import get_family

    if ":" not in ref:
        return get_family(ref)
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)()


def reproduce_command(family: Family, problem, config: Config, device: DeviceInfo) -> str:
    """`autotile render FAMILY <shape options> --config '<json>'`: the candidate's source, from the shell."""
    fields = dataclasses.asdict(problem)
    parts = ["autotile", "render", family.name]
    for option in family.cli_options:
        if option.name not in fields or fields[option.name] is None:
            continue
        value = fields[option.name]
        flag = "--" + option.name.replace("_", "-")
        if option.type is bool:
            parts.append(flag if value else "--no-" + option.name.replace("_", "-"))
        elif option.multiple and isinstance(value, (list, tuple)):
            parts += [flag, ",".join(str(v) for v in value)]
        else:
            parts += [flag, str(value)]
    if not device.interpret:
        parts += ["--gpu", device.profile]
    parts += ["--config", config.to_json()]
    return " ".join(shlex.quote(p) for p in parts)


def outcome_to_dict(outcome: TrialOutcome) -> dict:
    return {"status": outcome.status.value, "error": outcome.error, "max_abs_error": outcome.max_abs_error,
            "timing": dataclasses.asdict(outcome.timing) if outcome.timing else None}


def outcome_from_dict(data: dict) -> TrialOutcome:
    timing = Timing(**data["timing"]) if data["timing"] else None
    return TrialOutcome(Status(data["status"]), timing, data["error"], data["max_abs_error"])


class _InputSets:
    """Input sets and their references, built once each and reused by every trial."""

    def __init__(self, family: Family, problem, device: DeviceInfo, seed: int):
        self.family, self.problem, self.device, self.seed = family, problem, device, seed
        self._sets: dict[int, tuple] = {}

    def for_trial(self, number: int) -> tuple:
        from autotile.bench import prepare

        slot = number % INPUT_SETS
        if slot not in self._sets:
            try:
                self._sets[slot] = prepare(self.family, self.problem, self.device, self.seed + slot)
            except Exception as exc:  # noqa: BLE001 - inputs or reference do not fit: nothing can be checked
                raise WorkerSetupError(
                    f"{self.family.name}: cannot build inputs and reference for {self.problem}: {exc}") from exc
        return self._sets[slot]


class InProcessEvaluator:
    """Runs trials in this process: fast to start; a CUDA crash here ends the study (the driver stops)."""

    isolated = False

    def __init__(self, family: Family, problem, device: DeviceInfo, seed: int):
        self.family, self.problem, self.device, self.seed = family, problem, device, seed
        self._inputs = _InputSets(family, problem, device, seed)

    def prestart(self) -> None:
        pass

    def evaluate(self, number: int, config: Config) -> TrialOutcome:
        from autotile.bench import evaluate

        prepared = self._inputs.for_trial(number)
        return evaluate(self.family, self.problem, config, self.device, seed=self.seed + number, prepared=prepared)

    def close(self) -> None:
        pass


def free_device_memory() -> None:
    """Give the memory of dropped input sets back (on a GPU, to the driver: the tuner re-times in its own process)."""
    import gc

    gc.collect()
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _worker_main(conn, device: DeviceInfo, log_path: str) -> None:
    """The worker process: import torch and triton once, then serve problems and trials until told to stop.

    Messages from the parent: ("target", id, family ref, problem dict, seed, device) sets the problem the next
    trials run, and the device they run on (`device` is None for a worker started before the tuner knew it,
    `spawn_early_worker`) (answered ("targeted", id), or ("setup_error", id, text) when the family or problem
    does not load);
    ("trial", id, number, config JSON) runs one trial of target `id` (answered ("outcome", id, dict));
    ("release",) drops the current problem's inputs; ("stop",) ends the process.
    """
    # Ctrl-C reaches the whole process group: the tuner decides (it stops the search and closes this worker),
    # so a trial is never cut short and filed as a crash.
    ignore_ctrl_c()
    log_fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    try:
        from autotile.bench import evaluate
    except Exception:  # noqa: BLE001 - reported to the parent, which stops the study
        conn.send(("setup_error", None, traceback.format_exc(limit=8)))
        return
    conn.send(("ready", os.getpid()))
    target_id, family, problem, seed, inputs = None, None, None, 0, None
    while True:
        try:
            message = conn.recv()
        except EOFError:  # the parent is gone
            return
        kind = message[0]
        if kind == "stop":
            return
        if kind in ("target", "release"):
            target_id, family, problem, inputs = None, None, None, None
            free_device_memory()
        if kind == "target":
            _, wanted, ref, problem_data, seed, device = message
            try:
                family = resolve_family(ref)
                problem = family.problem_from_dict(problem_data)
            except Exception:  # noqa: BLE001 - reported to the parent, which stops the study
                family = problem = None
                conn.send(("setup_error", wanted, traceback.format_exc(limit=8)))
                continue
            target_id, inputs = wanted, _InputSets(family, problem, device, seed)
            conn.send(("targeted", wanted))
            try:
                # The first trial's inputs and reference now, while the tuner sets up its study: not after its
                # first trial arrives. A failure is reported by that trial (the set is built again then).
                inputs.for_trial(0)
            except WorkerSetupError:
                pass
        elif kind == "trial":
            _, wanted, number, config_json = message
            if wanted != target_id:  # the parent never sends a trial before its target is acknowledged
                conn.send(("setup_error", wanted, f"trial {number} came for problem {wanted}, not {target_id}"))
                continue
            try:
                prepared = inputs.for_trial(number)
            except WorkerSetupError as exc:
                conn.send(("setup_error", wanted, str(exc)))
                return
            outcome = evaluate(family, problem, Config(json.loads(config_json)), device, seed=seed + number,
                               prepared=prepared)
            conn.send(("outcome", wanted, outcome_to_dict(outcome)))


def _tail(path: Path, offset: int) -> str:
    try:
        with open(path, "rb") as handle:
            handle.seek(offset)
            text = handle.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.strip().splitlines()[-_STDERR_TAIL_LINES:])


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "the worker did not exit"
    if code < 0:
        try:
            return f"the worker was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"the worker was killed by signal {-code}"
    return f"the worker exited with code {code}"


class IsolatedEvaluator:
    """Runs trials in a worker process per device, replaced whenever a trial kills it or runs past the limit.

    `gpu` is the CUDA index the worker sees as its only device (CUDA_VISIBLE_DEVICES); None under the interpreter.
    The worker outlives its problem: `retarget` points it at another problem (of any family) by a message, so
    a run over many problems (autotile.tune.session) pays its start-up (spawn, imports, CUDA context) once.
    """

    isolated = True

    def __init__(self, family: Family, problem, device: DeviceInfo, seed: int, trial_timeout: float,
                 gpu: int | None = None):
        self.device = device
        self.trial_timeout = trial_timeout
        self.gpu = gpu
        self._worker_device = device if device.interpret else dataclasses.replace(device, index=0)
        self._log_dir = Path(tempfile.mkdtemp(prefix="autotile-worker-"))
        self._adopted_log_dirs: list[Path] = []  # of early workers taken over (spawn_early_worker)
        self._process = None
        self._conn = None
        self._ready = False  # the running worker has reported ready
        self._sent_target: int | None = None  # the target the running worker was last sent
        self._acknowledged = False  # ... and has answered for
        self._busy = False  # a trial was sent and its answer not read: the worker's state is unknown
        self._log_path: Path | None = None
        self._target_id = 0
        self.workers_started = 0
        self.worker_pids: list[int] = []  # every worker this evaluator started, in order
        self.start_seconds: list[float] = []  # spawn to ready, per worker
        self.last_exit_code: int | None = None
        self.retarget(family, problem, seed)

    def retarget(self, family: Family, problem, seed: int) -> None:
        """Run the next trials on `problem` of `family` in the same worker (`prestart` or the first trial starts
        one when there is none).

        The message is sent now and answered while the caller prepares its search; the answer is awaited
        before the first trial.
        """
        if (self._process is not None and not self._busy and self._sent_target == self._target_id
                and (family_ref(family), dataclasses.asdict(problem), seed) == (self._ref, self._problem_data,
                                                                                self.seed)):
            return  # already pointed at this problem (started early by TuneSession.prestart): keep its inputs
        if self._busy:
            self._stop_worker()
        self.family, self.problem, self.seed = family, problem, seed
        self._ref = family_ref(family)
        self._problem_data = dataclasses.asdict(problem)
        self._target_id += 1
        if self._process is not None:
            self._send_target()

    # --- the worker's life ----------------------------------------------------------------
    def prestart(self) -> None:
        """Start the worker now, without waiting for it: it imports torch and builds its inputs while the
        search asks for configs and the compile-ahead pool starts, instead of after them."""
        if self._process is None:
            self._launch()
        elif self._sent_target != self._target_id:
            self._send_target()

    def _start(self) -> None:
        if self._process is None:
            self._launch()
        self._await_ready()
        if self._sent_target != self._target_id:
            self._send_target()
        self._await_target()

    def _launch(self) -> None:
        early = take_early_worker() if self.gpu is None else None  # see autotile.tune.early_worker
        if early is not None:  # started by the CLI before torch was imported here: it is importing torch already
            process, parent_conn, self._log_path, launched_at = early
            self._adopted_log_dirs.append(self._log_path.parent)
            self.workers_started += 1
            self._process, self._conn, self._ready, self._busy = process, parent_conn, False, False
            self._launched_at = launched_at
            self.worker_pids.append(process.pid)
            self._send_target()
            return
        context = multiprocessing.get_context("spawn")
        parent_conn, child_conn = context.Pipe()
        self.workers_started += 1
        self._log_path = self._log_dir / f"worker-{self.workers_started}.log"
        args = (child_conn, self._worker_device, str(self._log_path))
        process = context.Process(target=_worker_main, args=args, daemon=True,
                                  name=f"autotile-worker-{self.gpu if self.gpu is not None else 'cpu'}")
        with _SPAWN_LOCK:
            # NOTE: spawn copies os.environ when the child starts; setting CUDA_VISIBLE_DEVICES around start()
            # gives the worker its one GPU before it imports anything that could touch CUDA.
            before = os.environ.get("CUDA_VISIBLE_DEVICES")
            if self.gpu is not None:
                os.environ["CUDA_VISIBLE_DEVICES"] = str(self.gpu)
            try:
                with born_ignoring_ctrl_c():
                    process.start()
            finally:
                if self.gpu is not None:
                    if before is None:
                        os.environ.pop("CUDA_VISIBLE_DEVICES", None)
                    else:
                        os.environ["CUDA_VISIBLE_DEVICES"] = before
        child_conn.close()
        self._process, self._conn, self._ready, self._busy = process, parent_conn, False, False
        self._launched_at = time.monotonic()
        self.worker_pids.append(process.pid)
        self._send_target()  # waits in the pipe while the worker imports torch

    def _send_target(self) -> None:
        self._sent_target, self._acknowledged = self._target_id, False
        try:
            self._conn.send(("target", self._target_id, self._ref, self._problem_data, self.seed, self._worker_device))
        except (BrokenPipeError, OSError):
            pass  # the worker is gone: the wait for its answer says so

    def _await_ready(self) -> None:
        if self._ready:
            return
        reply = self._receive(_WORKER_START_LIMIT_S)
        if reply[0] != "ready":
            self._did_not_start(reply)
        self._ready = True
        self.start_seconds.append(time.monotonic() - self._launched_at)

    def _await_target(self) -> None:
        """Wait for the worker's answer to the current target (answers to earlier targets are passed over)."""
        while not self._acknowledged:
            reply = self._receive(_WORKER_START_LIMIT_S)
            if reply[0] in ("targeted", "setup_error") and reply[1] != self._target_id:
                continue
            if reply[0] != "targeted":
                self._did_not_start(reply)
            self._acknowledged = True

    def _did_not_start(self, reply) -> None:
        self._stop_worker()
        text = reply[2] if reply[0] == "setup_error" else (
            f"{_describe_exit(self.last_exit_code)}\n{_tail(self._log_path, 0)}")
        raise WorkerSetupError(f"the trial worker for {self.family.name} did not start:\n{text}")

    def _receive(self, limit: float):
        """The worker's next message; ("_died",) when it is gone, ("_timed_out",) when `limit` seconds passed."""
        deadline = time.monotonic() + limit
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return ("_timed_out",)
            try:
                if self._conn.poll(min(remaining, 0.5)):
                    return self._conn.recv()
            except (EOFError, OSError):  # the worker's end of the pipe closed: it exited
                return ("_died",)
            if not self._process.is_alive() and not self._conn.poll(0):
                return ("_died",)

    def _stop_worker(self) -> None:
        if self._process is None:
            return
        if self._process.is_alive():
            self._process.kill()
        self._process.join(10)
        self.last_exit_code = self._process.exitcode
        self._conn.close()
        self._process, self._conn, self._sent_target, self._busy = None, None, None, False

    def worker_pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    # --- trials -------------------------------------------------------------------------------
    def evaluate(self, number: int, config: Config) -> TrialOutcome:
        self._start()
        offset = self._log_path.stat().st_size if self._log_path.exists() else 0
        try:
            self._conn.send(("trial", self._target_id, number, config.to_json()))
        except (BrokenPipeError, OSError):
            reply = ("_died",)
        else:
            self._busy = True  # until its answer is read: a Ctrl-C in between leaves the worker mid-trial
            reply = self._receive(self.trial_timeout)
            self._busy = False
        if reply[0] == "outcome":
            outcome = outcome_from_dict(reply[2])
            if outcome.status is Status.CRASH and not self.device.interpret:
                self._stop_worker()  # the exception may have poisoned the worker's CUDA context
            if outcome.status in (Status.CRASH, Status.TIMEOUT):
                outcome = dataclasses.replace(outcome, error=self._with_repro(outcome.error, config))
            return outcome
        if reply[0] == "setup_error":
            self._stop_worker()
            raise WorkerSetupError(reply[2])
        self._stop_worker()
        tail = _tail(self._log_path, offset)
        if reply[0] == "_timed_out":
            status, what = Status.TIMEOUT, f"no result within {self.trial_timeout:g} s; the worker was killed"
        else:
            status, what = Status.CRASH, _describe_exit(self.last_exit_code)
        error = what + (f"\nlast output of the worker:\n{tail}" if tail else "")
        return TrialOutcome(status, error=self._with_repro(error, config))

    def _with_repro(self, error: str, config: Config) -> str:
        return f"{error}\nreproduce: {reproduce_command(self.family, self.problem, config, self.device)}"

    def release(self) -> None:
        """The problem's search is over: the worker drops its inputs and waits for the next `retarget`.

        A worker left mid-trial (the search was cut short while it ran one) is stopped instead: what it would
        answer belongs to no one, and its state is unknown.
        """
        if self._process is None:
            return
        if self._busy:
            self._stop_worker()
            return
        try:
            self._conn.send(("release",))
        except (BrokenPipeError, OSError):
            self._stop_worker()
            return
        self._sent_target = None  # the next problem sends its target afresh

    def close(self) -> None:
        if self._process is not None and self._process.is_alive() and not self._busy:
            try:
                self._conn.send(("stop",))
                self._process.join(5)
            except (BrokenPipeError, OSError):
                pass
        self._stop_worker()
        for folder in [self._log_dir] + self._adopted_log_dirs:
            shutil.rmtree(folder, ignore_errors=True)
