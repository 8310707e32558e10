"""Compile-ahead: CPU processes compile the configs Optuna asked for next while the GPU times the current one.

Each pool process renders a config and compiles every Triton kernel the
family's launch would run for the tuned GPU's architecture, from meta tensors
(shapes, strides, dtypes and alignment, no data) that stand for the problem's
inputs (autotile.xcompile), and builds each kernel's host launcher. A pool
process never touches a GPU. The specialisation Triton binds (pointer
alignment, integer divisibility) is the one the trial's real launch binds, so
the compiled kernels land in Triton's on-disk cache under the keys the trial
looks up, and the trial loads them instead of compiling.

The processes are forked from the tuner's process, which has torch, Triton and
autotile imported already: a pool is ready at once, where spawned processes
took ~5-7 s on the H200 machines (imports, a CUDA context each). A forked
process must not use the CUDA context its parent may hold; compiling from meta
tensors uses none (PyTorch's DataLoader workers are forked after CUDA is
initialised on the same terms).

Under the interpreter nothing is compiled (kernels run as Python), so
compile-ahead is a no-op there: `start_compile_ahead` returns a pool that
does nothing.

A pool outlives its problem: every job names its problem, and a pool process
that gets a job of another problem drops the last one's inputs and makes the
new one's, so the processes of a run over many problems start once.
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
from autotile.tune.workers import born_ignoring_ctrl_c, family_ref, ignore_ctrl_c, resolve_family

log = logging.getLogger("autotile.tune")

# Pool processes compiling ahead (each holds one problem's meta inputs): half the cores, at most 8.
# NOTE: 8, not 4, from the H200 machines' 16 cores: once a trial's own Python cost 0.1 s (its study in a journal
# file, autotile.tune.storage), 4 processes compiling ~1.5 s a config left the GPU waiting for kernels.
DEFAULT_COMPILE_PROCESSES = max(1, min(8, (os.cpu_count() or 2) // 2))

# How much lower than the tuner's process a pool process is scheduled: with 8 of them compiling (and their ptxas
# runs) on 16 cores, the process timing the trials gets a CPU first.
POOL_NICENESS = 10

# Per pool process: the device compiled for (set by the initializer), and the family, problem, seed, input layout and
# meta inputs of the problem its last job was for.
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


def _init_pool_process(device: DeviceInfo) -> None:
    # Ctrl-C is the tuner's to handle (it shuts this pool down); here it would only break the pool mid-compile.
    ignore_ctrl_c()
    import torch

    # NOTE: as PyTorch's DataLoader does in its forked workers: torch's CPU thread pool does not survive a fork.
    torch.set_num_threads(1)
    # Below the tuner's own process (and its ptxas runs below it too): a timing must not wait for a CPU.
    os.nice(POOL_NICENESS)
    _state.update(device=device, target=None, family=None, problem=None, inputs=None)


def _set_target(target: tuple) -> None:
    """In a pool process: compile for this (family ref, problem dict, seed, input layout or None) from now on."""
    if _state["target"] == target:
        return
    ref, problem_data, _, _ = target
    _state.update(target=None, family=None, problem=None, inputs=None)  # the last problem's inputs go first
    family = resolve_family(ref)
    _state.update(target=target, family=family, problem=family.problem_from_dict(problem_data))


def _compile_job(target: tuple, compile_fn: Callable[[str], tuple[str, float, str]],
                 config_json: str) -> tuple[str, float, str]:
    """One job of the pool: a config of `target`'s problem (the pool's processes serve every problem of a run)."""
    try:
        _set_target(target)
    except Exception as exc:  # noqa: BLE001 - the trial itself will report the failure as its status
        return config_json, 0.0, f"{type(exc).__name__}: {exc}"[:500]
    return compile_fn(config_json)


def input_layout(inputs: dict) -> dict:
    """A problem's inputs without their data: each tensor as ('tensor', shape, strides, storage offset, dtype name),
    everything else (integers, None, 0-d tensors whose values the launch reads, moved to the CPU) as it is.

    >>> import torch
    >>> input_layout({"a": torch.zeros(4, 6)[:, 1:], "n": 3})
    {'a': ('tensor', (4, 5), (6, 1), 1, 'float32'), 'n': 3}
    """
    import torch

    layout = {}
    for name, value in inputs.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            layout[name] = ("tensor", tuple(value.shape), tuple(value.stride()), value.storage_offset(),
                            str(value.dtype).removeprefix("torch."))
        else:
            layout[name] = value.cpu() if isinstance(value, torch.Tensor) else value
    return layout


def meta_inputs_from(layout: dict) -> dict:
    """The meta tensors (and other values) an `input_layout` describes."""
    import torch

    from autotile.xcompile import meta_tensor

    inputs = {}
    for name, value in layout.items():
        if isinstance(value, tuple) and value and value[0] == "tensor":
            _, shape, strides, offset, dtype = value
            inputs[name] = meta_tensor(shape, strides, offset, getattr(torch, dtype))
        else:
            inputs[name] = value
    return inputs


def compile_config(config_json: str) -> tuple[str, float, str]:
    """In a pool process: compile every kernel of one config, and its launchers. Returns (config JSON, seconds,
    error text or '')."""
    from autotile import xcompile

    started = time.monotonic()
    family, problem, device = _state["family"], _state["problem"], _state["device"]
    try:
        if _state["inputs"] is None:
            _, _, seed, layout = _state["target"]
            # Without a layout from the tuner (its process has no inputs on the GPU), the inputs are made on the CPU.
            _state["inputs"] = (meta_inputs_from(layout) if layout is not None
                                else xcompile.meta_inputs(family, problem, seed))
        xcompile.compile_config(family, problem, Config(json.loads(config_json)), device, inputs=_state["inputs"],
                                read_resources=False, build_launchers=True)
    except Exception as exc:  # noqa: BLE001 - the trial itself will report the failure as its status
        return config_json, time.monotonic() - started, f"{type(exc).__name__}: {exc}"[:500]
    return config_json, time.monotonic() - started, ""


def _layout_of_inputs(family: Family, problem, device: DeviceInfo, seed: int) -> dict | None:
    """The layout of the problem's inputs, made on the device in this process (GEMM operands are drawn on the GPU
    in milliseconds; a pool process would draw them on the CPU, a second or more for a large GEMM). None where they
    cannot be made here: each pool process then makes them on the CPU."""
    try:
        return input_layout(family.make_layout_inputs(problem, device, seed=seed))
    except Exception as exc:  # noqa: BLE001 - the pool processes make them instead
        log.debug("the inputs' layout for compile-ahead was not made here: %s", exc)
        return None


@contextlib.contextmanager
def _forking_here():
    """NOTE: Python 3.12 warns at every fork of a process with threads (CUDA's own, the tuner's), since a lock another
    thread held at the fork stays held in the child. A pool process runs only its own code in its one thread, on
    meta tensors, and never touches the parent's CUDA context, as PyTorch's forked DataLoader workers do."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*use of fork\\(\\) may lead to deadlocks.*",
                                category=DeprecationWarning)
        yield


class CompileAhead:
    """A pool of CPU processes compiling configs ahead of their trials.

    `submit` queues configs; `wait_for` is called right before a config's trial: a compile already
    running is awaited (it finishes sooner than a fresh compile), one still queued is dropped.
    `retarget` moves the pool to another problem (of any family): its processes serve every problem of a
    run (autotile.tune.session). A pool whose process died is replaced on the next `submit`.
    """

    def __init__(self, family: Family, problem, device: DeviceInfo, seed: int,
                 processes: int = DEFAULT_COMPILE_PROCESSES,
                 compile_fn: Callable[[str], tuple[str, float, str]] = compile_config):
        self.device, self.processes = device, processes
        self._compile_fn = compile_fn
        self._futures: dict[str, concurrent.futures.Future] = {}
        self.compiled = 0
        self.dropped = 0
        self.pools_started = 0
        self._pool = self._new_pool()
        self.retarget(family, problem, seed)

    def _new_pool(self) -> concurrent.futures.ProcessPoolExecutor:
        self.pools_started += 1
        context = multiprocessing.get_context("fork")
        return concurrent.futures.ProcessPoolExecutor(self.processes, mp_context=context,
                                                      initializer=_init_pool_process, initargs=(self.device,))

    def retarget(self, family: Family, problem, seed: int) -> None:
        """Compile for `problem` of `family` from now on; the last problem's queued compiles are dropped."""
        problem_data = dataclasses.asdict(problem)
        current = getattr(self, "_target", None)
        if current is not None and current[:3] == (family_ref(family), problem_data, seed):
            return  # the same problem (started early by TuneSession.prestart): its queued compiles stay useful
        self.release()
        self._target = (family_ref(family), problem_data, seed, _layout_of_inputs(family, problem, self.device, seed))

    def release(self) -> None:
        """Drop the compiles still queued (those running finish; nothing waits for them)."""
        for future in self._futures.values():
            future.cancel()
        self._futures.clear()

    def submit(self, configs: Iterable[Config]) -> None:
        for config in configs:
            if config.hash not in self._futures:
                self._futures[config.hash] = self._submit(config.to_json())

    def _submit(self, config_json: str) -> concurrent.futures.Future:
        with born_ignoring_ctrl_c(), _forking_here():  # the pool forks its processes on its first submit
            try:
                return self._pool.submit(_compile_job, self._target, self._compile_fn, config_json)
            except concurrent.futures.process.BrokenProcessPool:
                # A pool process died (killed, out of memory): the pool is broken for good; a new one takes over.
                self._pool.shutdown(wait=False, cancel_futures=True)
                self._pool = self._new_pool()
                return self._pool.submit(_compile_job, self._target, self._compile_fn, config_json)

    def wait_for(self, config: Config, limit_s: float) -> None:
        """Before `config`'s trial: wait (at most `limit_s`) for its compile when the pool has taken it up."""
        future = self._futures.pop(config.hash, None)
        if future is None:
            return
        if future.cancel():
            self.dropped += 1
            return
        try:
            future.result(timeout=limit_s)
            self.compiled += 1
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


class NoCompileAhead:
    """Compile-ahead turned off, or the interpreter (nothing to compile): every call does nothing."""

    compiled = 0
    dropped = 0

    def submit(self, configs: Iterable[Config]) -> None:
        pass

    def wait_for(self, config: Config, limit_s: float) -> None:
        pass

    def release(self) -> None:
        pass

    def close(self) -> None:
        pass


def start_compile_ahead(family: Family, problem, device: DeviceInfo, seed: int, enabled: bool,
                        processes: int = DEFAULT_COMPILE_PROCESSES):
    """A compile-ahead pool on a GPU when `enabled`; a no-op under the interpreter or when disabled."""
    if not enabled or device.interpret:
        return NoCompileAhead()
    return CompileAhead(family, problem, device, seed, processes=processes)
