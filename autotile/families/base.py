"""The Family contract: everything the tuner, store, runtime and reports need to know about one kind of kernel.

A family is a class with no per-call state. The tuner, the store, the runtime
and the reports only ever call these methods, so they never special-case a
family. Problems are frozen dataclasses whose fields are plain ints, bools and
strings: their canonical JSON is the problem key.
"""
from __future__ import annotations

import abc
import dataclasses
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from autotile.device import DeviceInfo
from autotile.space import Config, Space

Tensors = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Tolerance:
    """|out - ref| <= atol + rtol * |ref|, element by element."""

    atol: float
    rtol: float


@dataclass(frozen=True)
class Cost:
    """Work of one call: FLOPs, and the fewest bytes it must move (each input read once, each output written once)."""

    flops: float
    bytes: float


@dataclass(frozen=True)
class CheckResult:
    ok: bool
    message: str
    max_abs_error: float = 0.0


@dataclass(frozen=True)
class Baseline:
    """What a user runs without autotile, timed beside the winner (cuBLAS, SDPA, torch.compile, ...)."""

    name: str
    run: Callable[[], Any]


@dataclass(frozen=True)
class ProblemOption:
    """One shape/variant option of `autotile tune FAMILY` (the CLI turns these into click options)."""

    name: str  # option name without dashes, e.g. "m" -> --m; also the keyword passed to problems_from_cli
    type: type  # int, str, bool or float
    help: str
    default: Any = None
    choices: tuple[str, ...] | None = None
    multiple: bool = False  # may be given several times / comma-separated


def problem_to_dict(problem) -> dict:
    return dataclasses.asdict(problem)


def canonical_json(data: Mapping) -> str:
    return json.dumps(dict(data), sort_keys=True, separators=(",", ":"))


def host_int(value) -> int | None:
    """`value` as an int when it is a host integer (Python's, NumPy's, anything with __index__), else None.
    Never a bool (True is no length) nor a tensor: reading a CUDA one back would wait for the queued work."""
    if type(value) is int:
        return value
    if isinstance(value, (bool, torch.Tensor)):
        return None
    index = getattr(type(value), "__index__", None)
    return None if index is None else index(value)


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


# A vendor config has this one key, naming the library call (e.g. {"VENDOR": "cublas"}). It is a
# config of the search like any other: checked, timed beside the generated kernels, stored as the
# winner when it is fastest, and served by calling the library.
VENDOR_KEY = "VENDOR"


# A policy config stands for the family's own choice for each shape: {"POLICY": "default"} is whatever
# `default_config(problem, device)` gives the call. Stored with a verified range over several shape
# fields, it says "across these shapes the family's default beats the vendor op" (a tuned policy).
POLICY_KEY = "POLICY"
POLICY_DEFAULT = "default"


def is_vendor(config: Mapping) -> bool:
    """True for a config that runs the vendor library (cuBLAS, SDPA) instead of a generated kernel."""
    return VENDOR_KEY in config


def vendor_label(config: Mapping) -> str:
    """A vendor config as people name it: 'cuBLAS (torch.matmul)', 'torch._scaled_mm', 'SDPA (cudnn)', ..."""
    kind = str(config.get(VENDOR_KEY, ""))
    names = {"cublas": "cuBLAS (torch.matmul)", "scaled_mm": "torch._scaled_mm"}
    return names.get(kind, f"SDPA ({kind.removeprefix('sdpa-')})" if kind.startswith("sdpa") else kind)


def vendor_enabled() -> bool:
    """`AUTOTILE_VENDOR=0` serves generated kernels only (to measure them on their own); default on. A value that
    is neither is taken as on, said once (autotile.switches)."""
    from autotile.switches import switch

    return switch("AUTOTILE_VENDOR", True, "keeps the vendor op a candidate; 0 serves generated kernels only")


def pow2_bucket(value: int) -> tuple[int, int]:
    """The power-of-two bucket (lo, hi] of a size as inclusive bounds: 1 -> (1, 1), 3 -> (3, 4), 100 -> (65, 128)."""
    hi = next_pow2(value)
    return (hi // 2 + 1 if hi > 1 else 1), hi


def log2_distance(a: int, b: int) -> float:
    return abs(math.log2(max(a, 1)) - math.log2(max(b, 1)))


class Family(abc.ABC):
    """One kind of kernel. Subclasses set the class attributes and implement the abstract methods."""

    name: ClassVar[str]
    template: ClassVar[str]
    problem_type: ClassVar[type]
    # Fields of the problem that are shapes: nearest-bucket lookup measures distance over these
    # and requires every other field to match.
    shape_fields: ClassVar[tuple[str, ...]] = ()
    # Fields that vary from call to call of one layer of a model (gemm: m, the tokens; flash: batch and
    # sequence lengths). A winner is verified across the bucket of these fields when it is stored, and
    # served for any call inside the range it was verified on. Families with a vendor op set them.
    serving_fields: ClassVar[tuple[str, ...]] = ()
    # Fields added after databases were shipped, with the value every problem had before: left out of keys and
    # buckets while they hold it, so that the stored keys of the problems that existed then still match.
    later_fields: ClassVar[Mapping[str, object]] = {}

    # --- problems -----------------------------------------------------------------
    def key_fields(self, problem) -> dict:
        """The problem's fields as its key and bucket name them: later_fields left out at their defaults."""
        data = problem_to_dict(problem)
        for name, default in self.later_fields.items():
            if data[name] == default:
                del data[name]
        return data

    def problem_key(self, problem) -> str:
        """Canonical, hashable description of a problem: shapes, dtypes, layout class, variant flags."""
        return canonical_json(self.key_fields(problem))

    def problem_from_dict(self, data: Mapping):
        fields = {f.name for f in dataclasses.fields(self.problem_type)}
        unknown = set(data) - fields
        if unknown:
            raise ValueError(f"{self.name}: unknown problem fields {sorted(unknown)}")
        return self.problem_type(**data)

    def bucket(self, problem) -> str:
        """Nearby shapes share a bucket: shape fields rounded up to powers of two, the rest exact."""
        data = self.key_fields(problem)
        for name in self.shape_fields:
            data[name] = next_pow2(data[name])
        return canonical_json(data)

    def distance(self, problem, other) -> float | None:
        """How far a tuned problem is from this one; None when its winner cannot serve this one at all."""
        a, b = problem_to_dict(problem), problem_to_dict(other)
        if any(a[k] != b[k] for k in a if k not in self.shape_fields):
            return None
        return sum(log2_distance(a[k], b[k]) for k in self.shape_fields)

    def default_suite(self) -> list:
        """Problems `autotile tune FAMILY` tunes when no shape is given."""
        return []

    # Options of `autotile tune FAMILY`; values arrive in problems_from_cli as keywords.
    cli_options: ClassVar[tuple[ProblemOption, ...]] = ()

    def presets(self) -> dict[str, list]:
        """Named problem lists for `autotile tune FAMILY --preset NAME`."""
        return {"default": self.default_suite()}

    def problems_from_cli(self, **options) -> list:
        """CLI option values -> problems to tune; the default suite when no shape is given."""
        raise NotImplementedError

    # --- the search -----------------------------------------------------------------
    def interpreter_refusal(self, problem) -> str | None:
        """Why Triton's CPU interpreter cannot run `problem` right (the tuner refuses it there, as the runtime
        does), or None. (The interpreter's space still stands for Hopper's limits: arch.device_default.)"""
        return None

    @abc.abstractmethod
    def space(self, problem, device: DeviceInfo) -> Space:
        ...

    @abc.abstractmethod
    def default_config(self, problem, device: DeviceInfo) -> Config:
        """Always a point of `space(problem, device)`."""

    def seed_configs(self, problem, device: DeviceInfo) -> list[Config]:
        """Known-good configs the search tries right after the default (each a point of the space)."""
        return []

    def first_feasible(self, problem, device: DeviceInfo, preferred: Mapping) -> Config:
        """`preferred` if it is in the space, else the feasible config that shares most values with it."""
        space = self.space(problem, device)
        admitted = space.admit(preferred)  # with any axes the space added since `preferred` was written
        if admitted is not None:
            return admitted
        best, best_score = None, -1
        for config in space.feasible():
            score = sum(config[k] == preferred.get(k) for k in config)
            if score > best_score:
                best, best_score = config, score
        if best is None:
            from autotile.errors import NoFeasibleConfigError

            raise NoFeasibleConfigError(f"{self.name}: the search space for {problem} has no feasible config")
        return best

    # --- the vendor op ------------------------------------------------------------------
    def vendor_configs(self, problem, device: DeviceInfo) -> list[Config]:
        """The vendor library's ways to compute `problem` (cuBLAS, SDPA's backends), each a config {VENDOR: name}.

        Empty when the family has no vendor op or the library cannot compute this problem.
        """
        return []

    def vendor_run(self, problem, config: Config, inputs: Tensors) -> Tensors:
        """Run a vendor config on `inputs`; returns the outputs as allocate_outputs names them (the library allocates)."""
        raise NotImplementedError(f"{self.name} has no vendor op")

    def validate_config(self, problem, device: DeviceInfo, config) -> Config:
        """`config` as a Config if `problem` can run it on `device` (a vendor config of the problem, or a point of
        the space); ConfigOutsideSpaceError otherwise. Every config read from a database passes through here."""
        from autotile.errors import ConfigOutsideSpaceError

        if is_vendor(config):
            if Config(config) in self.vendor_configs(problem, device):
                return Config(config)
            raise ConfigOutsideSpaceError(f"{dict(config)} is not a vendor op of this {self.name} problem")
        if POLICY_KEY in config:
            if dict(config) != {POLICY_KEY: POLICY_DEFAULT}:
                raise ConfigOutsideSpaceError(f"{dict(config)}: the only policy is {{{POLICY_KEY!r}: {POLICY_DEFAULT!r}}}")
            return self.default_config(problem, device)
        return self.space(problem, device).validate(config)

    def run_config(self, problem, config: Config, inputs: Tensors, outputs: Tensors) -> None:
        """Run any config of the problem into `outputs`: a vendor config or a generated kernel (`launch`)."""
        if is_vendor(config):
            for name, value in self.vendor_run(problem, config, inputs).items():
                outputs[name].copy_(value)
        else:
            self.launch(problem, config, inputs, outputs)

    def timed_call(self, problem, config: Config, inputs: Tensors, outputs: Tensors) -> Callable[[], Any]:
        """What timing a config runs: the vendor call as a user makes it (no copy), or the kernel launch."""
        if is_vendor(config):
            return lambda: self.vendor_run(problem, config, inputs)
        return lambda: self.launch(problem, config, inputs, outputs)

    # --- serving ranges -----------------------------------------------------------------
    def serving_bucket(self, field: str, value: int) -> tuple[int, int]:
        """Inclusive (lo, hi) of the bucket `value` of a serving field falls in: powers of two by default."""
        return pow2_bucket(value)

    def serving_range(self, problem) -> dict[str, tuple[int, int]]:
        """The bucket of each serving field of `problem`: what a winner of it is verified over."""
        data = problem_to_dict(problem)
        return {name: self.serving_bucket(name, data[name]) for name in self.serving_fields}

    def range_edges(self, problem) -> list:
        """The problems at the low and the high corner of `problem`'s serving range (those that differ from it)."""
        rng = self.serving_range(problem)
        if not rng:
            return []
        edges = []
        for corner in (0, 1):
            edge = dataclasses.replace(problem, **{name: bounds[corner] for name, bounds in rng.items()})
            if edge != problem and edge not in edges:
                edges.append(edge)
        return edges

    def in_range(self, problem, tuned, verified_range: Mapping[str, Any] | None) -> bool:
        """Whether a winner tuned for `tuned`, verified over `verified_range`, may serve `problem`.

        Every field that is not a serving field must match; each serving field must lie in its range.
        """
        if not verified_range or not self.serving_fields:
            return False
        # A range names every serving field, and may name other shape fields too (a tuned policy's range).
        ranged = set(verified_range)
        if not set(self.serving_fields) <= ranged or not ranged <= set(self.serving_fields) | set(self.shape_fields):
            return False
        a, b = problem_to_dict(problem), problem_to_dict(tuned)
        if any(a[k] != b[k] for k in a if k not in ranged and k not in self.range_free_fields):
            return False
        for name in ranged:
            bounds = verified_range.get(name)
            if not (isinstance(bounds, (list, tuple)) and len(bounds) == 2
                    and all(isinstance(x, int) and not isinstance(x, bool) for x in bounds)):
                return False
            if not bounds[0] <= a[name] <= bounds[1]:
                return False
        return True

    # Fields that may differ between a call and the winner serving it (the config is validated against the
    # call's own space anyway): gemm's TMA alignment.
    range_free_fields: ClassVar[tuple[str, ...]] = ()

    # --- data -----------------------------------------------------------------------
    @abc.abstractmethod
    def make_inputs(self, problem, device: DeviceInfo, seed: int = 0) -> Tensors:
        """Realistic random inputs on the device: never zeros."""

    def make_layout_inputs(self, problem, device: DeviceInfo, seed: int = 0) -> Tensors:
        """Inputs with make_inputs' shapes, strides, dtypes and alignment, whose values do not matter: what compiling
        a launch needs (autotile.xcompile.meta_inputs, the compile-ahead pool's layout). make_inputs unless a family's
        inputs cost more to compute."""
        return self.make_inputs(problem, device, seed=seed)

    @abc.abstractmethod
    def allocate_outputs(self, problem, inputs: Tensors) -> Tensors:
        ...

    @abc.abstractmethod
    def reference(self, problem, inputs: Tensors) -> Tensors:
        """Plain torch in float32/float64, independent of any Triton code."""

    @abc.abstractmethod
    def tolerance(self, problem) -> Tolerance:
        ...

    @abc.abstractmethod
    def cost(self, problem) -> Cost:
        ...

    def check(self, problem, inputs: Tensors, outputs: Tensors, expected: Tensors) -> CheckResult:
        from autotile.families.checks import compare

        tol = self.tolerance(problem)
        for name, want in expected.items():
            result = compare(name, outputs[name], want, tol)
            if not result.ok:
                return result
        return CheckResult(True, "ok")

    def baseline(self, problem, inputs: Tensors) -> Baseline | None:
        return None

    # --- running --------------------------------------------------------------------
    @abc.abstractmethod
    def launch(self, problem, config: Config, inputs: Tensors, outputs: Tensors) -> None:
        """render -> compile -> run, writing into `outputs`."""

    def render_switches(self, problem, config: Config) -> dict:
        """The Jinja switches of one config (for `autotile render`)."""
        raise NotImplementedError
