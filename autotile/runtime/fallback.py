"""A served generated kernel that cannot build or launch here: mark it, warn once, serve the call another way.

A stored winner was compiled and timed where it was tuned; the machine that serves it may differ (GPU,
driver, Triton, ptxas). There its config may not compile, may ask for more shared memory than the GPU
has, or may be a Gluon kernel for an architecture the GPU lacks. That should cost a model one warning,
not its run. The first build or launch failure of a served (family, problem, config) marks it unusable
for the rest of the process, logs one warning, and the same call runs the next choice: the vendor op
where the family has one for the problem, else the family's default config. When the default itself
fails the call raises KernelUnusableError, chained to the original exception.

Everything else passes through unchanged: bad input (AutotileError), CUDA errors (an illegal access or
a device-side assert poisons the context, so a retry would only fail again), and any failure while a
CUDA graph is being captured (a fallback there would record the vendor op's work and allocations in
the graph).

Marks are forgotten by `dispatch.clear_cache()`, with the winners it forgets: it is what a user calls
after re-tuning, and a re-tuned winner was compiled and checked on this machine.

Only a served object's first call pays for this. `guard` wraps it and, once the call returns, puts the
plain runner back, so later calls run exactly what they ran before; ops with no runner to swap (fused
expressions, paged plans) call `fail_over` and `warn` from their own first launch.
"""
from __future__ import annotations

import dataclasses
import logging
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from autotile.device import DeviceInfo
from autotile.errors import AutotileError, KernelCacheError, KernelUnusableError
from autotile.families.base import Family, is_vendor, vendor_enabled, vendor_label
from autotile.runtime.dispatch import Resolution, on_clear, resolve
from autotile.space import Config

log = logging.getLogger("autotile.runtime")

# Lower-case fragments of the messages of CUDA errors that leave the context unusable: never retried.
_POISONED = ("illegal memory access", "illegal address", "illegal instruction", "device-side assert",
             "misaligned address", "unspecified launch failure", "launch timed out", "uncorrectable ecc",
             "cuda error", "cudaerror")
# Lower-case fragments of the messages of build and launch failures that Triton raises as plain exceptions:
# an MLIR pass that fails, the driver refusing a launch or a module ("Triton Error [CUDA]: too many resources
# requested for launch", "... no kernel image is available", "... unsupported PTX version"), ptxas.
_BUILD = ("passmanager::run failed", "out of resource", "triton error [cuda]", "ptxas", "no kernel image",
          "unsupported ptx")


@dataclass(frozen=True)
class Choice:
    """A generated kernel an op serves: `config` for `problem`, from `source` (a Resolution's)."""

    family: Family
    problem: object
    device: DeviceInfo
    config: Config
    source: str


@dataclass(frozen=True)
class Mark:
    """A served config that failed to build or launch in this process, and why."""

    family: str
    problem_key: str
    config: Config
    source: str
    error: str  # the exception's type and first line

    def as_dict(self) -> dict:
        return {"config": dict(self.config), "source": self.source, "error": self.error}


_marks: dict[tuple, Mark] = {}  # (family name, problem, config) -> Mark
_warned: set[tuple] = set()
_lock = threading.Lock()


def _forget() -> None:
    with _lock:
        _marks.clear()
        _warned.clear()


on_clear(_forget)


def is_build_failure(exc: BaseException) -> bool:
    """Whether `exc` says a generated kernel could not be compiled or launched here (and nothing ran wrongly)."""
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources, PTXASError

    accelerator_error = getattr(torch, "AcceleratorError", None)  # torch's CUDA errors since 2.8
    if isinstance(exc, KernelCacheError):
        return True  # no generated kernel can be written here: the vendor op still computes the call
    if (isinstance(exc, (AutotileError, torch.OutOfMemoryError))
            or (accelerator_error is not None and isinstance(exc, accelerator_error))):
        return False
    text = str(exc).lower()
    if any(fragment in text for fragment in _POISONED):
        return False
    if isinstance(exc, (CompilationError, OutOfResources, PTXASError)):
        return True
    if isinstance(exc, subprocess.CalledProcessError):  # a compiler tool (ptxas) that exited with an error
        return True
    return isinstance(exc, RuntimeError) and any(fragment in text for fragment in _BUILD)


def _capturing() -> bool:
    try:
        return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    except Exception:  # noqa: BLE001 - a torch without CUDA: nothing is being captured
        return False


def recoverable(exc: BaseException) -> bool:
    """Whether a served kernel's failure may be replaced by the next choice: a build/launch failure, not mid-capture."""
    return is_build_failure(exc) and not _capturing()


def marked(family: Family, problem, config: Config) -> Mark | None:
    return _marks.get((family.name, problem, config)) if _marks else None


def marks_for(family: Family, problem) -> list[Mark]:
    """The configs of `problem` marked unusable in this process (autotile.explain reports them)."""
    return [m for (name, p, _), m in list(_marks.items()) if name == family.name and p == problem]


def _mark(choice: Choice, exc: BaseException) -> Mark:
    lines = str(exc).strip().splitlines()
    error = f"{type(exc).__name__}: {lines[0][:300] if lines else ''}".rstrip(": ")
    key = (choice.family.name, choice.problem, choice.config)
    with _lock:
        return _marks.setdefault(key, Mark(choice.family.name, choice.family.problem_key(choice.problem),
                                           choice.config, choice.source, error))


def check_default(family: Family, problem, default: Config) -> None:
    """Raise KernelUnusableError when the family's default config is marked unusable for `problem`: nothing is left
    to serve it (for ops that fall back to the default on their own, too)."""
    mark = marked(family, problem, default)
    if mark is not None:
        raise KernelUnusableError(
            f"autotile: no kernel can serve {mark.family} problem {mark.problem_key} on this machine: the family's "
            f"default config {default.to_json()} failed to build or launch here ({mark.error}), and no vendor op "
            "computes this problem. Please report it, with the output of `autotile env`.")


def usable(family: Family, problem, device: DeviceInfo) -> Resolution:
    """dispatch.resolve's answer, or the next choice past configs marked unusable: the vendor op where the family
    has one for `problem`, else the default config. KernelUnusableError when the default is marked too."""
    resolution = resolve(family, problem, device)
    if not _marks:
        return resolution
    if marked(family, problem, resolution.config) is None:
        return resolution
    vendor = family.vendor_configs(problem, device) if vendor_enabled() else []
    if vendor:
        return dataclasses.replace(resolution, config=vendor[0], source="vendor", tuned_for=None, match="fallback")
    default = family.default_config(problem, device)
    check_default(family, problem, default)
    return dataclasses.replace(resolution, config=default, source="default", tuned_for=None, match="fallback")


def fail_over(choice: Choice, exc: BaseException) -> Resolution:
    """After `choice` raised `exc`, a recoverable failure: mark it and return what serves its problem now.

    Call it inside the `except` block; KernelUnusableError (nothing left) is chained to `exc`.
    """
    _mark(choice, exc)
    try:
        return usable(choice.family, choice.problem, choice.device)
    except KernelUnusableError as err:
        raise err from exc


def warn(choice: Choice, instead: Config) -> None:
    """One warning per marked config: what failed, what serves it now (`instead`), and what to do."""
    mark = marked(choice.family, choice.problem, choice.config)
    key = (choice.family.name, choice.problem, choice.config)
    with _lock:
        if mark is None or key in _warned:
            return
        _warned.add(key)
    now = vendor_label(instead) if is_vendor(instead) else f"the default config {instead.to_json()}"
    source = {"user-db": "your tuning database", "shipped-db": "autotile's shipped database",
              "default": "the family's defaults"}.get(mark.source, mark.source)
    log.warning(
        "autotile: the %s kernel for %s with config %s (from %s) failed to build or launch on this machine (%s); "
        "it is not used again in this process, and its calls run %s instead. Fix: re-tune on this machine "
        "(`autotile tune %s ...` with this shape, or record a run with AUTOTILE_RECORD=trace.jsonl and "
        "`autotile tune --from-trace trace.jsonl`); if it came from autotile's shipped database, please report it "
        "with the output of `autotile env`.",
        mark.family, mark.problem_key, mark.config.to_json(), source, mark.error, now, mark.family)


def refusal(err: KernelUnusableError) -> Callable:
    """A runner that raises `err`'s message: what serves a problem that no kernel can serve here."""
    message = str(err)

    def refuse(*args, **kwargs):
        raise KernelUnusableError(message)
    return refuse


def guard(choice: Choice, run: Callable, rebuild: Callable, install: Callable, *,
          proven: Callable | None = None, redo: Callable | None = None) -> Callable:
    """`run`, which launches `choice`'s kernel, wrapped for its first call.

    That call returning, `proven(run)` (by default `install(run)`) puts the plain `run` where later calls find
    it. A recoverable failure instead marks the choice and serves the call with `rebuild(resolution, *args)` ->
    (config, runner) for the next choice (guarded in turn by the op when generated), which `install(runner)`
    keeps for later calls. `redo(runner, *args)` computes the call with it where `run` is one launch of a runner
    rather than the runner itself (default: runner(*args)).
    """
    def first(*args):
        try:
            out = run(*args)
        except Exception as exc:
            if not recoverable(exc):
                raise
            try:
                config, runner = rebuild(fail_over(choice, exc), *args)
            except KernelUnusableError as err:
                install(refusal(err))  # later calls say so at once, rather than compile the failing kernel again
                raise err from exc
            install(runner)
            warn(choice, config)
            return runner(*args) if redo is None else redo(runner, *args)
        (install if proven is None else proven)(run)
        return out
    return first


__all__ = ["Choice", "Mark", "is_build_failure", "recoverable", "usable", "fail_over", "warn", "guard", "refusal",
           "check_default", "marked", "marks_for"]
