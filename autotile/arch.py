"""What a GPU architecture lets a kernel use, and the named constraints every family's space adds from it.

A family's `space(problem, device)` asks `arch_of(device)` what the device's compute capability
supports and adds `feature_constraint(...)` for each axis value that needs a feature (the TMA
variants, warp specialisation, the asynchronous-MMA lookahead); `require_dtypes` refuses a problem
the device cannot run at all (fp8 on sm80) before any config is tried. Shared memory per block comes
from the device itself (what CUDA reports, or the profile of a GPU that is planned for but not
present); the register file and threads per SM from the architecture.

Triton's interpreter stands in for the H200 in tests: its device (compute capability (0, 0)) gets
Hopper's architecture. An interpreter DeviceInfo given another compute capability gets that one's.

>>> from autotile.device import planned_device
>>> a100 = arch_of(planned_device("a100"))
>>> a100.name, a100.supports(Feature.TMA), a100.supports(Feature.BF16), a100.smem_per_block
('sm80', False, True, 166912)
>>> arch_of(planned_device("l40s")).supports(Feature.FP8)
True
"""
from __future__ import annotations

import enum
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from autotile.device import PROFILES, DeviceInfo
from autotile.errors import UnsupportedDtypeError
from autotile.space import Constraint


class Feature(enum.Enum):
    """Hardware a kernel variant or a dtype needs, with the oldest compute capability that has it."""

    BF16 = "bf16"  # bf16 tensor cores and conversions (Ampere)
    TF32 = "tf32"  # tf32 tensor cores (Ampere)
    FP8 = "fp8"  # e4m3 tensor cores (Ada; Triton's fp8e4nv needs sm89)
    TMA = "tma"  # the tensor memory accelerator: TMA descriptors (Hopper)
    WARP_SPECIALIZE = "warp_specialize"  # producer and consumer warps with register reallocation (Hopper)
    ASYNC_MMA = "async_mma"  # MMAs that run while the issuing warps go on (wgmma; Blackwell's tcgen05)

    @property
    def description(self) -> str:
        return _DESCRIPTIONS[self]


_DESCRIPTIONS = {
    Feature.BF16: "bf16 tensor cores (sm80 and newer)",
    Feature.TF32: "tf32 tensor cores (sm80 and newer)",
    Feature.FP8: "fp8 e4m3 tensor cores (sm89 and newer)",
    Feature.TMA: "TMA tensor descriptors (sm90 and newer)",
    Feature.WARP_SPECIALIZE: "warp specialisation (sm90)",
    Feature.ASYNC_MMA: "asynchronous MMAs, wgmma or tcgen05 (sm90 and sm100)",
}

# Which compute capabilities have each feature, as Triton 3.6 compiles the templates (python -m autotile.xcompile):
# - below sm90 it rewrites TMA descriptors into plain pointer loads (make_ttir:
#   add_rewrite_tensor_descriptor_to_pointer) and ignores warp specialisation, so those variants compile
#   there but only repeat their pointer twins: trials spent on nothing;
# - fp8e4nv does not compile below sm89 ("type fp8e4nv not supported in this architecture");
# - its automatic warp specialisation fails ("PassManager::run failed") on the gemm and flash kernels for
#   sm100 and on the gemm kernel for sm120: Hopper only;
# - the asynchronous MMAs are wgmma (Hopper) and tcgen05 (data-centre Blackwell); consumer Blackwell (12.x)
#   issues mma.sync.
_HAS: dict[Feature, Callable[[tuple[int, int]], bool]] = {
    Feature.BF16: lambda cc: cc >= (8, 0),
    Feature.TF32: lambda cc: cc >= (8, 0),
    Feature.FP8: lambda cc: cc >= (8, 9),
    Feature.TMA: lambda cc: cc >= (9, 0),
    Feature.WARP_SPECIALIZE: lambda cc: cc[0] == 9,
    Feature.ASYNC_MMA: lambda cc: cc[0] in (9, 10),
}

# Per compute capability: (shared memory per block with opt-in, bytes; resident threads per SM). From the
# CUDA C++ Programming Guide, "Technical Specifications per Compute Capability" (CUDA 12.8): 64, 163, 99,
# 163, 99, 227, 227, 99 KiB per block; 1024, 2048, 1536, 2048, 1536, 2048, 2048, 1536 threads per SM.
_PER_CC: dict[tuple[int, int], tuple[int, int]] = {
    (7, 5): (65536, 1024),
    (8, 0): (166912, 2048),
    (8, 6): (101376, 1536),
    (8, 7): (166912, 2048),
    (8, 9): (101376, 1536),
    (9, 0): (232448, 2048),
    (10, 0): (232448, 2048),
    (12, 0): (101376, 1536),
}
# 64 Ki 32-bit registers per SM on every architecture since Maxwell (same table), at most 255 a thread.
REGISTERS_PER_SM = 65536
MAX_REGISTERS_PER_THREAD = 255
# Triton 3.6 compiles for Turing (sm75) and newer.
OLDEST = (7, 5)
# The architecture of the GPUs this project is tuned on: the interpreter's stand-in.
HOPPER = (9, 0)


class UnsupportedOnDevice(UnsupportedDtypeError):
    """A problem the device's architecture cannot run at all (fp8 operands on sm80, bf16 on sm75)."""


@dataclass(frozen=True)
class Arch:
    """The architecture of one device and the limits its kernels live within."""

    compute_capability: tuple[int, int]
    features: frozenset[Feature]
    smem_per_block: int  # bytes a program may use, as the device reports it (or its profile says)
    max_threads_per_sm: int
    registers_per_sm: int = REGISTERS_PER_SM
    device_label: str = ""

    @property
    def name(self) -> str:
        major, minor = self.compute_capability
        return f"sm{major}{minor}"

    def supports(self, feature: Feature) -> bool:
        return feature in self.features

    def describe(self) -> str:
        """'sm80: bf16, tf32' -- what this architecture offers kernels."""
        names = [f.value for f in Feature if f in self.features]
        return f"{self.name}: {', '.join(names) or 'fp16/fp32 tensor cores only'}"


def _nearest_known(cc: tuple[int, int]) -> tuple[int, int]:
    """The newest tabulated compute capability not newer than `cc` (a 12.1 part is treated as 12.0)."""
    known = [k for k in _PER_CC if k <= cc]
    return max(known) if known else min(_PER_CC)


def arch_of(device: DeviceInfo) -> Arch:
    """The architecture of `device`: the interpreter is Hopper unless its DeviceInfo names another one."""
    cc = tuple(device.compute_capability)
    if device.interpret and cc == (0, 0):
        cc = HOPPER
    if cc < OLDEST:
        raise UnsupportedOnDevice(f"{device.name} is sm{cc[0]}{cc[1]}; Triton 3.6 compiles for sm75 (Turing) "
                                  "and newer GPUs")
    smem_default, threads = _PER_CC[_nearest_known(cc)]
    features = frozenset(f for f, has in _HAS.items() if has(cc))
    profile = PROFILES.get(device.profile)
    registers = profile.registers_per_sm if profile is not None and not device.interpret else REGISTERS_PER_SM
    return Arch(cc, features, device.smem_per_block or smem_default, threads, registers, device.name)


def default_smem_per_block(compute_capability: tuple[int, int]) -> int:
    """Shared memory per block (opt-in) of an architecture, when the device does not say."""
    return _PER_CC[_nearest_known(tuple(compute_capability))][0]


# The dtypes that need a feature of their own; fp16 and fp32 run everywhere Triton does.
_DTYPE_FEATURES = {"bf16": Feature.BF16, "fp8": Feature.FP8, "tf32": Feature.TF32}


def require_dtypes(device: DeviceInfo, dtypes: Iterable[str], what: str) -> None:
    """Raise UnsupportedOnDevice, before any config is tried, when `device` lacks a feature a dtype needs.

    >>> from autotile.device import planned_device
    >>> require_dtypes(planned_device("a100"), ["fp8", "bf16"], "this gemm")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    autotile.arch.UnsupportedOnDevice: this gemm needs fp8 e4m3 tensor cores (sm89 and newer); ... is sm80. ...
    """
    arch = arch_of(device)
    for dtype in dict.fromkeys(dtypes):
        feature = _DTYPE_FEATURES.get(dtype)
        if feature is not None and not arch.supports(feature):
            advice = {Feature.FP8: "Use bf16 or fp16 on this GPU, or run fp8 on an L40S, H100 or H200",
                      Feature.BF16: "Use fp16 on this GPU", Feature.TF32: "Use fp32 without tf32 on this GPU"}[feature]
            raise UnsupportedOnDevice(f"{what} needs {feature.description}; {device.name} is {arch.name}. {advice}")


def feature_constraint(device: DeviceInfo, feature: Feature, uses: Callable[[Mapping], bool], what: str
                       ) -> Constraint:
    """The named constraint `needs_<feature>`: configs for which `uses(config)` holds need `feature`.

    On a device that has the feature it holds for every config (and prunes nothing).
    """
    arch = arch_of(device)
    if arch.supports(feature):
        return Constraint(f"needs_{feature.value}", lambda c: True, "")
    return Constraint(f"needs_{feature.value}", lambda c: not uses(c),
                      f"{what} needs {feature.description}; this device is {arch.name}")


def architecture_constraints(device: DeviceInfo, uses: Mapping[Feature, tuple[Callable[[Mapping], bool], str]]
                             ) -> list[Constraint]:
    """One `feature_constraint` per entry of {feature: (uses, what)}."""
    return [feature_constraint(device, feature, used, what) for feature, (used, what) in uses.items()]


def device_seeds(family, problem, device: DeviceInfo, wanted: Iterable[Mapping]) -> list:
    """A family's seed configs (written for Hopper) as `device` can run them, without repeats.

    A seed in the device's space is kept. One that only Hopper's space holds (TMA loads, more shared memory
    than an A100's or an L40S's) is replaced by itself with fewer pipeline stages where that fits, else by the
    feasible config sharing most of its values (the nearest sizes among those), so that a smaller GPU still
    starts near each seed's tile shape; seeds outside Hopper's space too are dropped.
    On Hopper (and the interpreter) this keeps exactly the seeds in the space.
    """

    space = family.space(problem, device)
    seeds: list = []
    for config in wanted:
        seed = space.admit(config)
        if seed is None:
            seed = _fitted(family, problem, device, space, config)
        if seed is not None and seed not in seeds:
            seeds.append(seed)
    return seeds


def device_default(family, problem, device: DeviceInfo, preferred: Mapping):
    """`family.first_feasible(problem, device, preferred)`, except that a preferred config (written for Hopper)
    that a smaller GPU cannot hold becomes itself with fewer stages, or the nearest tile shape that fits, as
    `device_seeds` does. On Hopper (and the interpreter) this is exactly first_feasible."""
    space = family.space(problem, device)
    if not space.is_feasible(preferred):
        fitted = _fitted(family, problem, device, space, preferred)
        if fitted is not None:
            return fitted
    return family.first_feasible(problem, device, preferred)


def _fitted(family, problem, device: DeviceInfo, space, config: Mapping):
    """A config of Hopper's space that `space` (a smaller GPU's) lacks, with fewer stages or the nearest tile
    shape; None on Hopper itself, or when Hopper's space lacks the config too."""
    from autotile.device import interpret_device

    if arch_of(device).compute_capability == HOPPER and device.smem_per_block >= interpret_device().smem_per_block:
        return None
    if not family.space(problem, interpret_device()).is_feasible(config):
        return None
    return _fewer_stages(space, config) or _nearest(space, config)


# Fewest pipeline stages a fitted config keeps: with one, Triton does not pipeline the loads at all.
MIN_FITTED_STAGES = 2


def _fewer_stages(space, config: Mapping):
    """`config` with the most pipeline stages below its own (at least MIN_FITTED_STAGES) that `space` holds."""
    if "num_stages" not in config:
        return None
    fewer = (s for s in space.axis("num_stages").choices if MIN_FITTED_STAGES <= s < config["num_stages"])
    for stages in sorted(fewer, reverse=True):
        candidate = space.admit(dict(config, num_stages=stages))
        if candidate is not None:
            return candidate
    return None


def _nearest(space, config: Mapping):
    """The feasible config of `space` sharing most values with `config`; ties go to the nearest sizes (log2)."""
    def distance(candidate) -> tuple:
        differing = [k for k in candidate if candidate[k] != config.get(k)]
        sizes = sum(abs(math.log2(candidate[k]) - math.log2(config[k])) for k in differing
                    if type(candidate[k]) is int and type(config.get(k)) is int and candidate[k] > 0 and config[k] > 0)
        return len(differing), sizes
    return min(space.feasible(), key=distance, default=None)
