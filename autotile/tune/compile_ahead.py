"""Compile-ahead: CPU processes compile the configs Optuna asked for next while the GPU times the current one.

Each pool process renders a config and compiles every Triton kernel the
family's launch would run, without launching any (Triton's `warmup=True`
path), on real inputs of the problem so that the specialisation (pointer
alignment, integer divisibility) is exactly the one the trial will see. The
compiled kernels land in Triton's on-disk cache, which the trial worker then
reads instead of compiling.

Under the interpreter nothing is compiled (kernels run as Python), so
compile-ahead is a no-op there: `start_compile_ahead` returns a pool that
does nothing.

A pool outlives its problem: every job names its problem, and a pool process
that gets a job of another problem drops the last one's inputs and loads the
new one, so the processes of a run over many problems start once.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
import logging
import multiprocessing
import os
import threading
import time
from collections.abc import Callable, Iterable

from autotile.device import DeviceInfo
from autotile.families.base import Family
from autotile.space import Config
from autotile.tune.workers import born_ignoring_ctrl_c, family_ref, free_device_memory, ignore_ctrl_c, resolve_family

log = logging.getLogger("autotile.tune")

# Pool processes compiling ahead (each holds a CUDA context and one set of inputs): half the cores, at most 8.
# NOTE: 8, not 4, from the H200 machines' 16 cores: once a trial's own Python cost 0.1 s (its study in a journal
# file, autotile.tune.storage), 4 processes compiling ~1.5 s a config left the GPU waiting for kernels.
DEFAULT_COMPILE_PROCESSES = max(1, min(8, (os.cpu_count() or 2) // 2))

# Per pool process: the device (set by the initializer), and the family, problem, seed and inputs of the
# problem its last job was for.
_state: dict = {}


# compile_only's hook on JITFunction.run: installed while any thread is inside a compile_only block.
_only = threading.local()  # .active: this thread is inside a compile_only block
_hook_lock = threading.Lock()
_hook = {"users": 0, "original": None}


@contextlib.contextmanager
def compile_only():
    """Within this block, this thread's Triton launches (`kernel[grid](...)`) compile the kernel, and its launcher,
    and return without running it. Other threads launch as usual meanwhile.

    NOTE: Triton's `JITFunction.run(..., warmup=True)` compiles (or loads from its cache) and returns before
    the launch; forcing it for every launch lets a family's own `launch` compile all its kernels with the
    exact arguments of a trial, with no family-specific code here. Triton builds a kernel's host launcher (a C
    module, one per argument signature, cached on disk beside the kernels) only at its first launch: in the
    process that times the trial, a C compiler run of about a second for each new variant of a fresh cache.
    `CompiledKernel._init_handles()` (private; Triton 3.x) builds it here instead, and loads the kernel, which
    also reports a kernel that does not fit the device. The hook on JITFunction.run (a class attribute, seen by
    every thread) is installed while some thread is in such a block and tells threads apart.
    """
    from autotile.launch import slow_path

    _install_hook()
    before = getattr(_only, "active", False)
    _only.active = True
    try:
        with slow_path():  # kernels autotile.launch keeps would launch for real
            yield
    finally:
        _only.active = before
        _remove_hook()


def _install_hook() -> None:
    from triton.runtime.jit import JITFunction

    with _hook_lock:
        _hook["users"] += 1
        if _hook["users"] > 1:
            return
        original = _hook["original"] = JITFunction.run

        def run(self, *args, grid, warmup, **kwargs):
            if not getattr(_only, "active", False):
                return original(self, *args, grid=grid, warmup=warmup, **kwargs)
            kernel = original(self, *args, grid=grid, warmup=True, **kwargs)
            init_handles = getattr(kernel, "_init_handles", None)
            if init_handles is not None:
                init_handles()
            return kernel

        JITFunction.run = run


def _remove_hook() -> None:
    from triton.runtime.jit import JITFunction

    with _hook_lock:
        _hook["users"] -= 1
        if _hook["users"] == 0:
            JITFunction.run = _hook["original"]
            _hook["original"] = None


def _init_pool_process(device: DeviceInfo, gpu: int | None) -> None:
    # Ctrl-C is the tuner's to handle (it shuts this pool down); here it would only break the pool mid-compile.
    ignore_ctrl_c()
    if gpu is not None:
        # Before the first CUDA call of this process: the pool compiles for (and allocates on) that GPU only.
        os.environ["CUDA_VISIBLE_DEVICES"] = str(gpu)
    _state.update(device=device, target=None, family=None, problem=None, seed=0, inputs=None)


def _set_target(target: tuple[str, dict, int]) -> None:
    """In a pool process: compile for this (family ref, problem dict, seed) from now on."""
    if _state["target"] == target:
        return
    ref, problem_data, seed = target
    _state.update(target=None, family=None, problem=None, inputs=None)  # the last problem's inputs go first
    free_device_memory()
    family = resolve_family(ref)
    _state.update(target=target, family=family, problem=family.problem_from_dict(problem_data), seed=seed)


def _compile_job(target: tuple[str, dict, int], compile_fn: Callable[[str], tuple[str, float, str]],
                 config_json: str) -> tuple[str, float, str]:
    """One job of the pool: a config of `target`'s problem (the pool's processes serve every problem of a run)."""
    try:
        _set_target(target)
    except Exception as exc:  # noqa: BLE001 - the trial itself will report the failure as its status
        return config_json, 0.0, f"{type(exc).__name__}: {exc}"[:500]
    return compile_fn(config_json)


def compile_kernels(family: Family, problem, config: Config, inputs) -> None:
    """Compile every kernel `family.launch` runs for `config` on `inputs` (and their launchers), running none."""
    outputs = family.allocate_outputs(problem, inputs)
    with compile_only():
        family.launch(problem, config, inputs, outputs)


def compile_config(config_json: str) -> tuple[str, float, str]:
    """In a pool process: compile every kernel of one config. Returns (config JSON, seconds, error text or '')."""
    started = time.monotonic()
    family, problem, device = _state["family"], _state["problem"], _state["device"]
    try:
        if _state["inputs"] is None:
            _state["inputs"] = family.make_inputs(problem, device, seed=_state["seed"])
        compile_kernels(family, problem, Config(json.loads(config_json)), _state["inputs"])
    except Exception as exc:  # noqa: BLE001 - the trial itself will report the failure as its status
        return config_json, time.monotonic() - started, f"{type(exc).__name__}: {exc}"[:500]
    return config_json, time.monotonic() - started, ""


class CompileAhead:
    """A pool of CPU processes compiling configs ahead of their trials.

    `submit` queues configs; `wait_for` is called right before a config's trial: a compile already
    running is awaited (it finishes sooner than a fresh compile), one still queued is dropped.
    `retarget` moves the pool to another problem (of any family): its processes, with their imports and
    CUDA contexts, serve every problem of a run (autotile.tune.session). A pool whose process died is
    replaced on the next `submit`.
    """

    def __init__(self, family: Family, problem, device: DeviceInfo, seed: int,
                 processes: int = DEFAULT_COMPILE_PROCESSES, gpu: int | None = None,
                 compile_fn: Callable[[str], tuple[str, float, str]] = compile_config):
        self._worker_device = dataclasses.replace(device, index=0) if gpu is not None else device
        self.device, self.gpu, self.processes = device, gpu, processes
        self._compile_fn = compile_fn
        self._futures: dict[str, concurrent.futures.Future] = {}
        self.compiled = 0
        self.dropped = 0
        self.pools_started = 0
        self.warm = False  # a job of this pool has finished: its processes are up
        self._pool = self._new_pool()
        self.retarget(family, problem, seed)

    def _new_pool(self) -> concurrent.futures.ProcessPoolExecutor:
        self.pools_started += 1
        self.warm = False
        context = multiprocessing.get_context("spawn")
        return concurrent.futures.ProcessPoolExecutor(self.processes, mp_context=context,
                                                      initializer=_init_pool_process,
                                                      initargs=(self._worker_device, self.gpu))

    def retarget(self, family: Family, problem, seed: int) -> None:
        """Compile for `problem` of `family` from now on; the last problem's queued compiles are dropped."""
        target = (family_ref(family), dataclasses.asdict(problem), seed)
        if getattr(self, "_target", None) == target:
            return  # the same problem (started early by TuneSession.prestart): its queued compiles stay useful
        self.release()
        self._target = target

    def release(self) -> None:
        """Drop the compiles still queued (those running finish; nothing waits for them)."""
        for future in self._futures.values():
            future.cancel()
        self._futures.clear()

    def submit(self, configs: Iterable[Config]) -> None:
        for config in configs:
            if config.hash not in self._futures:
                future = self._submit(config.to_json())
                future.add_done_callback(self._note_warm)
                self._futures[config.hash] = future

    def _note_warm(self, future: concurrent.futures.Future) -> None:
        if not future.cancelled() and future.exception() is None:
            self.warm = True

    def _submit(self, config_json: str) -> concurrent.futures.Future:
        with born_ignoring_ctrl_c():  # the pool starts its processes on a submit
            try:
                return self._pool.submit(_compile_job, self._target, self._compile_fn, config_json)
            except concurrent.futures.process.BrokenProcessPool:
                # A pool process died (killed, out of memory): the pool is broken for good; a new one takes over.
                self._pool.shutdown(wait=False, cancel_futures=True)
                self._pool = self._new_pool()
                return self._pool.submit(_compile_job, self._target, self._compile_fn, config_json)

    def wait_for(self, config: Config, limit_s: float, wait_if_cold: bool = True) -> None:
        """Before `config`'s trial: wait (at most `limit_s`) for its compile when the pool has taken it up.

        `wait_if_cold` off: while no job has finished yet, do not wait at all. A new pool's processes take
        seconds to import torch and make a CUDA context, and the executor counts a job as running as soon as
        it is queued for them; a trial in the tuner's own process compiles sooner itself.
        """
        future = self._futures.pop(config.hash, None)
        if future is None:
            return
        if future.cancel() or not (wait_if_cold or self.warm or future.done()):
            self.dropped += 1
            return
        try:
            future.result(timeout=limit_s)
            self.compiled += 1
            self.warm = True  # (the done callback may not have run yet)
        except (concurrent.futures.TimeoutError, concurrent.futures.process.BrokenProcessPool):
            pass  # the trial compiles it itself

    def close(self) -> None:
        """Stop the pool now: queued compiles are dropped, and processes still compiling are terminated.

        NOTE: ProcessPoolExecutor.shutdown(cancel_futures=True) waits for the compiles already running (1-3 s on
        the H200, at the end of every search that owned its pool), and Python 3.12 has no way to stop its
        workers but its private `_processes`. A compile cut short leaves no half-written cache entry: Triton
        writes each file in a temporary folder and renames it into place (the folder may stay behind).
        """
        self._futures.clear()
        processes = list((getattr(self._pool, "_processes", None) or {}).values())
        self._pool.shutdown(wait=False, cancel_futures=True)
        for process in processes:
            if process.is_alive():
                process.terminate()
        for process in processes:
            process.join(timeout=10)


class CompileThread:
    """One thread of the tuner's own process compiling the first configs of an in-process search.

    A compile pool's processes take seconds to start (spawn, import torch and Triton, a CUDA context, the
    problem's inputs): on the H200 an in-process search compiled its first 4-5 configs itself, one at a time
    after the vendor op was timed, before the pool had finished a job. This thread starts with the call and
    compiles the configs it is given (the default first, then the warm-start and seed configs) while this
    process opens the database and the study; ptxas and the launcher's C compiler, a good part of a compile,
    are child processes. The kernels land in this process's Triton caches, where the trial finds them.
    `wait_for(config)` before a trial: a compile done or running is awaited, one still queued is withdrawn (the
    trial compiles it itself). `quiet()` around a timing: no compile runs meanwhile. NOTE: on the H200 the
    vendor op timed 0.147 ms beside the first compile and 0.069 ms alone; a compile holds the interpreter lock
    for long stretches (Triton's code generation), which likely held up the timed launches. `close()` waits for
    the compile running, so no compile outlives the search.
    """

    def __init__(self, family: Family, problem, device: DeviceInfo, seed: int):
        self.family, self.problem, self.device, self.seed = family, problem, device, seed
        self._queue: list[Config] = []
        self._seen: set[str] = set()
        self._running: str | None = None
        self._quiet = 0  # timings under way: no compile starts
        self._stopped = False
        self._changed = threading.Condition()
        self.compiled = 0
        self._thread = threading.Thread(target=self._work, name="autotile-compile", daemon=False)
        self._thread.start()

    def add(self, configs: Iterable[Config]) -> None:
        with self._changed:
            for config in configs:
                if config.hash not in self._seen:
                    self._seen.add(config.hash)
                    self._queue.append(config)
            self._changed.notify_all()

    def wait_for(self, config: Config, limit_s: float) -> None:
        deadline = time.monotonic() + limit_s
        with self._changed:
            if config in self._queue:
                self._queue.remove(config)
                return
            while self._running == config.hash and time.monotonic() < deadline:
                self._changed.wait(timeout=max(0.0, deadline - time.monotonic()))

    @contextlib.contextmanager
    def quiet(self):
        """Within this block no compile runs: one running is waited for, the next waits for the block's end."""
        with self._changed:
            self._quiet += 1
            while self._running is not None:
                self._changed.wait()
        try:
            yield
        finally:
            with self._changed:
                self._quiet -= 1
                self._changed.notify_all()

    def close(self) -> None:
        """Compile nothing more, and wait for the compile running (the finalists are timed next, quietly)."""
        with self._changed:
            self._stopped = True
            self._queue.clear()
            self._changed.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def _work(self) -> None:
        inputs = None
        while True:
            with self._changed:
                while (not self._queue or self._quiet) and not self._stopped:
                    self._changed.wait()
                if self._stopped:
                    return
                config = self._queue.pop(0)
                self._running = config.hash
            try:
                if inputs is None:
                    inputs = self.family.make_inputs(self.problem, self.device, seed=self.seed)
                compile_kernels(self.family, self.problem, config, inputs)
                self.compiled += 1
            except Exception as exc:  # noqa: BLE001 - the trial compiles it again and reports the failure
                log.debug("compiling %s ahead in this process failed: %s", dict(config), exc)
            finally:
                with self._changed:
                    self._running = None
                    self._changed.notify_all()


class NoCompileAhead:
    """Compile-ahead turned off, or the interpreter (nothing to compile): every call does nothing."""

    compiled = 0
    dropped = 0

    def submit(self, configs: Iterable[Config]) -> None:
        pass

    def wait_for(self, config: Config, limit_s: float, wait_if_cold: bool = True) -> None:
        pass

    def release(self) -> None:
        pass

    def close(self) -> None:
        pass


def start_compile_ahead(family: Family, problem, device: DeviceInfo, seed: int, enabled: bool,
                        gpu: int | None = None, processes: int = DEFAULT_COMPILE_PROCESSES):
    """A compile-ahead pool on a GPU when `enabled`; a no-op under the interpreter or when disabled."""
    if not enabled or device.interpret:
        return NoCompileAhead()
    return CompileAhead(family, problem, device, seed, processes=processes, gpu=gpu)
