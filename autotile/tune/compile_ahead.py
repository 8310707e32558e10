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
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
import multiprocessing
import os
import time
from collections.abc import Callable, Iterable

from autotile.device import DeviceInfo
from autotile.families.base import Family
from autotile.space import Config
from autotile.tune.workers import born_ignoring_ctrl_c, family_ref, ignore_ctrl_c, resolve_family

# Pool processes compiling ahead (each holds a CUDA context and one set of inputs).
DEFAULT_COMPILE_PROCESSES = max(1, min(4, (os.cpu_count() or 2) // 2))

# Per pool process: the family, problem, device and inputs, built once by the initializer.
_state: dict = {}


@contextlib.contextmanager
def compile_only():
    """Within this block a Triton launch (`kernel[grid](...)`) compiles the kernel and returns without running it.

    NOTE: Triton's `JITFunction.run(..., warmup=True)` compiles (or loads from its cache) and returns before
    the launch; forcing it for every launch lets a family's own `launch` compile all its kernels with the
    exact arguments of a trial, with no family-specific code here.
    """
    from triton.runtime.jit import JITFunction

    from autotile.launch import slow_path

    original = JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        return original(self, *args, grid=grid, warmup=True, **kwargs)

    JITFunction.run = run
    try:
        with slow_path():  # kernels autotile.launch keeps would launch for real
            yield
    finally:
        JITFunction.run = original


def _init_pool_process(ref: str, problem_data: dict, device: DeviceInfo, seed: int, gpu: int | None) -> None:
    # Ctrl-C is the tuner's to handle (it shuts this pool down); here it would only break the pool mid-compile.
    ignore_ctrl_c()
    if gpu is not None:
        # Before the first CUDA call of this process: the pool compiles for (and allocates on) that GPU only.
        os.environ["CUDA_VISIBLE_DEVICES"] = str(gpu)
    family = resolve_family(ref)
    problem = family.problem_from_dict(problem_data)
    _state.update(family=family, problem=problem, device=device, seed=seed, inputs=None)


def compile_config(config_json: str) -> tuple[str, float, str]:
    """In a pool process: compile every kernel of one config. Returns (config JSON, seconds, error text or '')."""
    started = time.monotonic()
    family, problem, device = _state["family"], _state["problem"], _state["device"]
    try:
        if _state["inputs"] is None:
            _state["inputs"] = family.make_inputs(problem, device, seed=_state["seed"])
        inputs = _state["inputs"]
        outputs = family.allocate_outputs(problem, inputs)
        with compile_only():
            family.launch(problem, Config(json.loads(config_json)), inputs, outputs)
    except Exception as exc:  # noqa: BLE001 - the trial itself will report the failure as its status
        return config_json, time.monotonic() - started, f"{type(exc).__name__}: {exc}"[:500]
    return config_json, time.monotonic() - started, ""


class CompileAhead:
    """A pool of CPU processes compiling configs ahead of their trials.

    `submit` queues configs; `wait_for` is called right before a config's trial: a compile already
    running is awaited (it finishes sooner than a fresh compile), one still queued is dropped.
    """

    def __init__(self, family: Family, problem, device: DeviceInfo, seed: int,
                 processes: int = DEFAULT_COMPILE_PROCESSES, gpu: int | None = None,
                 compile_fn: Callable[[str], tuple[str, float, str]] = compile_config):
        context = multiprocessing.get_context("spawn")
        worker_device = dataclasses.replace(device, index=0) if gpu is not None else device
        args = (family_ref(family), dataclasses.asdict(problem), worker_device, seed, gpu)
        self._pool = concurrent.futures.ProcessPoolExecutor(processes, mp_context=context,
                                                            initializer=_init_pool_process, initargs=args)
        self._compile_fn = compile_fn
        self._futures: dict[str, concurrent.futures.Future] = {}
        self.compiled = 0
        self.dropped = 0

    def submit(self, configs: Iterable[Config]) -> None:
        for config in configs:
            if config.hash not in self._futures:
                with born_ignoring_ctrl_c():  # the pool starts its processes on a submit
                    self._futures[config.hash] = self._pool.submit(self._compile_fn, config.to_json())

    def wait_for(self, config: Config, limit_s: float) -> None:
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
        # NOTE: ProcessPoolExecutor.shutdown(cancel_futures=True) still waits for compiles already running.
        self._pool.shutdown(wait=True, cancel_futures=True)


class NoCompileAhead:
    """Compile-ahead turned off, or the interpreter (nothing to compile): every call does nothing."""

    compiled = 0
    dropped = 0

    def submit(self, configs: Iterable[Config]) -> None:
        pass

    def wait_for(self, config: Config, limit_s: float) -> None:
        pass

    def close(self) -> None:
        pass


def start_compile_ahead(family: Family, problem, device: DeviceInfo, seed: int, enabled: bool,
                        gpu: int | None = None, processes: int = DEFAULT_COMPILE_PROCESSES):
    """A compile-ahead pool on a GPU when `enabled`; a no-op under the interpreter or when disabled."""
    if not enabled or device.interpret:
        return NoCompileAhead()
    return CompileAhead(family, problem, device, seed, processes=processes, gpu=gpu)
