"""One candidate: run on fresh random inputs, check against the reference, time.

Failures come back as a status, never as an exception: a candidate that does
not compile, runs out of shared memory or registers, computes the wrong thing
or crashes costs one trial.
"""
from __future__ import annotations

import enum
import statistics
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from autotile.device import DeviceInfo
from autotile.errors import KernelCacheError
from autotile.families.base import Family, Tensors
from autotile.render import TemplateRenderError
from autotile.space import Config

# do_bench budget per timing: ms of warm-up, then ms of repeated runs (each after an L2 flush); quantiles kept.
# NOTE: 10 / 40 rather than do_bench's own 25 / 100. Inductor's benchmarker caps a choice at 25 ms; 40 ms
# still gives ~40 runs of a 1 ms kernel and ~350 of a 50 us one (the flush takes ~70 us a run on the H200).
# A trial's timing only ranks it for the search, and the winner comes from the interleaved race of the
# finalists and the vendor op (autotile.tune.retime), so 125 ms a timing bought no better winners: on the
# H200 it was a third of a 12-trial study and most of its final re-timing.
_DO_BENCH_WARMUP_MS = 10
_DO_BENCH_REP_MS = 40
_QUANTILES = (0.2, 0.5, 0.8)
# The interpreter is a CPU emulation: a couple of runs give a number labelled 'interpret'.
_INTERPRET_RUNS = 2


def interleaved_samples(fns: Mapping[str, Callable[[], object]], rounds: int,
                        time_one: Callable[[Callable[[], object]], float]) -> dict[str, list[float]]:
    """Each callable's `time_one` over `rounds`, the callables taking turns within every round, so that drift
    on a shared GPU (clocks, neighbours: ~9% between repeats on the lent H200) hits each of them alike."""
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            samples[name].append(time_one(fn))
    return samples


def cuda_graph_of(fn: Callable[[], object], runs: int = 1) -> torch.cuda.CUDAGraph:
    """A CUDA graph of `runs` calls of fn, warmed up on a side stream first (benchmarks' GPU-only timings)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(runs):
            fn()
    return graph


def interleaved_medians(fns: Mapping[str, Callable[[], object]], rounds: int,
                        time_one: Callable[[Callable[[], object]], float]) -> dict[str, float]:
    """The median of `interleaved_samples` for each callable (benchmarks' side-by-side timings)."""
    return {name: statistics.median(values) for name, values in interleaved_samples(fns, rounds, time_one).items()}


class Status(str, enum.Enum):
    OK = "ok"
    COMPILE_ERROR = "compile_error"
    OUT_OF_RESOURCES = "out_of_resources"
    WRONG_RESULT = "wrong_result"
    TIMEOUT = "timeout"
    CRASH = "crash"


@dataclass(frozen=True)
class Timing:
    median_ms: float
    q20_ms: float
    q80_ms: float
    interpreted: bool = False

    @property
    def spread(self) -> float:
        """(q80 - q20) / median: how much repeated runs of this kernel differ."""
        return (self.q80_ms - self.q20_ms) / self.median_ms if self.median_ms else 0.0


@dataclass(frozen=True)
class TrialOutcome:
    status: Status
    timing: Timing | None = None
    error: str = ""
    max_abs_error: float | None = None


def classify_exception(exc: BaseException) -> Status:
    """Map what a candidate raised onto a trial status."""
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources

    if isinstance(exc, OutOfResources) or isinstance(exc, torch.OutOfMemoryError):
        return Status.OUT_OF_RESOURCES
    if isinstance(exc, (CompilationError, TemplateRenderError, SyntaxError)):
        return Status.COMPILE_ERROR
    text = f"{type(exc).__name__}: {exc}"
    if "out of resource" in text.lower() or "OutOfResources" in text:
        return Status.OUT_OF_RESOURCES
    if "InterpreterError" in text or "CompilationError" in text or "PassManager" in text:
        return Status.COMPILE_ERROR
    return Status.CRASH


def _error_text(exc: BaseException, limit: int = 4000) -> str:
    text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    return text[-limit:]


def poison(outputs: Tensors) -> None:
    """Fill float outputs with NaN, so an element the kernel never writes cannot pass the check."""
    for t in outputs.values():
        if t.is_floating_point():
            t.fill_(float("nan"))


def time_fn(fn: Callable[[], object], device: DeviceInfo) -> Timing:
    """Median and quantiles of fn's run time; CUDA events with L2 flushed on a GPU, wall clock under the interpreter."""
    if device.interpret:
        fn()
        samples = []
        for _ in range(_INTERPRET_RUNS):
            start = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - start) * 1e3)
        samples.sort()
        return Timing(statistics.median(samples), samples[0], samples[-1], interpreted=True)
    import triton.testing

    q20, median, q80 = triton.testing.do_bench(fn, warmup=_DO_BENCH_WARMUP_MS, rep=_DO_BENCH_REP_MS, quantiles=list(_QUANTILES))
    return Timing(float(median), float(q20), float(q80))


def prepare(family: Family, problem, device: DeviceInfo, seed: int) -> tuple[Tensors, Tensors]:
    """Random inputs and their reference outputs."""
    inputs = family.make_inputs(problem, device, seed=seed)
    return inputs, family.reference(problem, inputs)


def run_checked(family: Family, problem, config: Config, device: DeviceInfo, seed: int,
                prepared: tuple[Tensors, Tensors] | None = None) -> tuple[TrialOutcome, Tensors | None]:
    """Render, compile and run; compare with the reference. Returns the inputs for timing when ok.

    `prepared` (inputs, reference) skips drawing inputs and recomputing the reference.
    """
    try:
        inputs, expected = prepared if prepared is not None else prepare(family, problem, device, seed)
        outputs = family.allocate_outputs(problem, inputs)
        poison(outputs)
        family.run_config(problem, config, inputs, outputs)
        if not device.interpret:
            torch.cuda.synchronize()
        result = family.check(problem, inputs, outputs, expected)
    except KernelCacheError:
        raise  # the machine's setup, not this config's: the tune stops and says what to fix
    except Exception as exc:  # noqa: BLE001 - every failure is a trial status
        return TrialOutcome(classify_exception(exc), error=_error_text(exc)), None
    if not result.ok:
        return TrialOutcome(Status.WRONG_RESULT, error=result.message, max_abs_error=result.max_abs_error), None
    return TrialOutcome(Status.OK, max_abs_error=result.max_abs_error), inputs


def evaluate(family: Family, problem, config: Config, device: DeviceInfo, seed: int = 0,
             prepared: tuple[Tensors, Tensors] | None = None) -> TrialOutcome:
    """One trial: correctness gate, then timing."""
    outcome, inputs = run_checked(family, problem, config, device, seed, prepared)
    if outcome.status is not Status.OK:
        return outcome
    outputs = family.allocate_outputs(problem, inputs)
    try:
        timing = time_fn(family.timed_call(problem, config, inputs, outputs), device)
    except Exception as exc:  # noqa: BLE001
        return TrialOutcome(classify_exception(exc), error=_error_text(exc))
    return TrialOutcome(Status.OK, timing, max_abs_error=outcome.max_abs_error)


def retime_interleaved(fns: Mapping[str, Callable[[], object]], device: DeviceInfo, rounds: int = 5) -> dict[str, Timing]:
    """Time several callables in turns (round-robin), so drift of the GPU's clocks hits all of them alike.

    Each round times every callable once; the result per callable is the median
    of its round medians, with the spread of the rounds as quantiles.
    """
    per_round: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            per_round[name].append(time_fn(fn, device).median_ms)
    result = {}
    for name, samples in per_round.items():
        ordered = sorted(samples)
        lo = ordered[max(0, round(0.2 * (len(ordered) - 1)))]
        hi = ordered[min(len(ordered) - 1, round(0.8 * (len(ordered) - 1)))]
        result[name] = Timing(statistics.median(ordered), lo, hi, interpreted=device.interpret)
    return result


def cuda_context_alive() -> bool:
    """After a crash: whether the CUDA context still works (an illegal address poisons it for good)."""
    try:
        torch.cuda.synchronize()
        torch.ones(1, device="cuda").add_(1).item()
        return True
    except Exception:  # noqa: BLE001
        return False
