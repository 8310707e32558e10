"""The GPU at hand (or Triton's CPU interpreter) and the named GPU profiles results are filed under."""
from __future__ import annotations

import contextlib
import functools
import os
import subprocess
import threading
from dataclasses import dataclass, field

from autotile.errors import DeviceMismatchError


@dataclass(frozen=True)
class GpuProfile:
    """What a kind of GPU can do: the ceilings that reports place results against, and the limits its search
    spaces are planned with when it is not the GPU at hand (`planned_device`).

    `peak_tflops` are dense datasheet rates unless `measured` says otherwise;
    `copy_tbps` counts bytes read plus bytes written. `sources` says where the limits come from.
    """

    name: str
    match: tuple[str, ...]  # lower-case substrings of the CUDA device name
    compute_capability: tuple[int, int]
    peak_tflops: dict[str, float] = field(default_factory=dict)
    copy_tbps: float = 0.0
    note: str = ""
    full_name: str = ""
    sm_count: int = 0
    smem_per_block: int = 0  # bytes of shared memory one block may opt in to
    registers_per_sm: int = 65536  # 32-bit registers
    memory_bytes: int = 0
    sources: str = ""


# Shared memory per block and registers per SM: CUDA C++ Programming Guide (12.8), "Technical
# Specifications per Compute Capability": 163 KiB a block on 8.0, 99 KiB on 8.9, 227 KiB on 9.0;
# 64 Ki 32-bit registers per SM on all three.
_CUDA_GUIDE = "CUDA C++ Programming Guide, technical specifications per compute capability"

PROFILES: dict[str, GpuProfile] = {
    p.name: p
    for p in (
        GpuProfile(
            "h200", ("h200",), (9, 0),
            # bf16/fp16: best seen with cuBLAS on random data; fp8/tf32 datasheet dense.
            {"bf16": 717.0, "fp16": 717.0, "fp8": 1979.0, "fp32": 495.0},
            copy_tbps=4.30,
            note="measured on the lent H200, 2026-11-29 (shared/anchors): copy 4.30 TB/s, bf16 matmul 717 TFLOP/s",
            full_name="NVIDIA H200", sm_count=132, smem_per_block=232448, memory_bytes=141 * 10**9,
            sources=f"132 SMs and 232448 B a block as CUDA reports them on the lent H200; 141 GB: H200 datasheet; "
                    f"{_CUDA_GUIDE}"),
        GpuProfile("h100", ("h100",), (9, 0), {"bf16": 989.0, "fp16": 989.0, "fp8": 1979.0, "fp32": 495.0},
                   copy_tbps=3.35, note="H100 SXM datasheet, dense",
                   full_name="NVIDIA H100 80GB HBM3 (SXM5)", sm_count=132, smem_per_block=232448,
                   memory_bytes=80 * 10**9,
                   sources=f"132 SMs: NVIDIA H100 Tensor Core GPU architecture whitepaper (H100 SXM5); {_CUDA_GUIDE}"),
        GpuProfile("a100", ("a100",), (8, 0), {"bf16": 312.0, "fp16": 312.0, "fp32": 156.0},
                   copy_tbps=2.0, note="A100 80GB SXM datasheet, dense",
                   full_name="NVIDIA A100 80GB SXM", sm_count=108, smem_per_block=166912, memory_bytes=80 * 10**9,
                   sources=f"108 SMs: NVIDIA A100 Tensor Core GPU architecture whitepaper; 80 GB: A100 datasheet; "
                           f"{_CUDA_GUIDE}"),
        GpuProfile("l40s", ("l40s",), (8, 9), {"bf16": 362.0, "fp16": 362.0, "fp8": 733.0, "fp32": 183.0},
                   copy_tbps=0.864, note="L40S datasheet, dense",
                   full_name="NVIDIA L40S", sm_count=142, smem_per_block=101376, memory_bytes=48 * 10**9,
                   sources=f"142 SMs (568 tensor cores, 4 an SM) and 48 GB: L40S datasheet; {_CUDA_GUIDE}"),
        GpuProfile("interpret", (), (0, 0), {}, 0.0, note="Triton's CPU interpreter: timings are CPU timings"),
    )
}

# Per-block shared memory the interpreter pretends to have, so that the same
# constraints prune the same configs on CPU as on Hopper (227 KiB opt-in).
HOPPER_SMEM_PER_BLOCK = 232448


@dataclass(frozen=True)
class DeviceInfo:
    """One device as autotile files results under it."""

    profile: str  # a PROFILES key, or 'other:<name>' for GPUs without a profile
    name: str
    compute_capability: tuple[int, int]
    sm_count: int
    memory_bytes: int
    smem_per_block: int
    driver: str
    interpret: bool = False
    index: int = 0
    planned: bool = False  # a profile's limits for a GPU that is not here (planning only: nothing runs on it)

    @property
    def key(self) -> str:
        """What winners are keyed by: the profile and the architecture (driver changes mark staleness, not identity)."""
        if self.interpret:
            return "interpret"
        major, minor = self.compute_capability
        return f"{self.profile}/sm{major}{minor}"

    @property
    def torch_device(self) -> str:
        return "cpu" if self.interpret else f"cuda:{self.index}"

    def fingerprint(self) -> dict:
        return {
            "key": self.key, "profile": self.profile, "name": self.name,
            "compute_capability": f"{self.compute_capability[0]}.{self.compute_capability[1]}",
            "sm_count": self.sm_count, "memory_bytes": self.memory_bytes,
            "smem_per_block": self.smem_per_block, "driver": self.driver,
        }


@functools.lru_cache(maxsize=None)
def interpret_device() -> DeviceInfo:
    return DeviceInfo("interpret", "Triton CPU interpreter", (0, 0), os.cpu_count() or 1, 0,
                      HOPPER_SMEM_PER_BLOCK, "none", interpret=True)


def _driver_version() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def profile_for_name(device_name: str) -> str:
    lowered = device_name.lower()
    for profile in PROFILES.values():
        if any(m in lowered for m in profile.match):
            return profile.name
    return "other:" + "-".join(lowered.replace("nvidia", "").split())


@functools.lru_cache(maxsize=None)
def cuda_device(index: int = 0) -> DeviceInfo:
    import torch

    props = torch.cuda.get_device_properties(index)
    smem = getattr(props, "shared_memory_per_block_optin", 0)
    if not smem:
        import triton

        smem = triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"]
    return DeviceInfo(
        profile=profile_for_name(props.name), name=props.name,
        compute_capability=(props.major, props.minor), sm_count=props.multi_processor_count,
        memory_bytes=props.total_memory, smem_per_block=int(smem), driver=_driver_version(), index=index,
    )


_stand_in = threading.local()  # .device: what tensors on torch's meta device stand for (cross-compiling)


@contextlib.contextmanager
def meta_stands_for(device: DeviceInfo):
    """Within this block (this thread), tensors on torch's 'meta' device count as being on `device`.

    Meta tensors have shapes, strides, dtypes and (offset-only) addresses but no data: a family's own launch
    code runs on them as on the GPU's tensors, and autotile.xcompile compiles what it would launch.
    """
    before = getattr(_stand_in, "device", None)
    _stand_in.device = device
    try:
        yield device
    finally:
        _stand_in.device = before


def current_device(tensor_device=None) -> DeviceInfo:
    """The device a tensor lives on: a CUDA GPU, or the interpreter for CPU tensors."""
    import torch

    dev = torch.device(tensor_device) if tensor_device is not None else None
    if dev is not None and dev.type == "meta":
        stand_in = getattr(_stand_in, "device", None)
        if stand_in is None:
            raise DeviceMismatchError("tensors on torch's meta device have no data to run on: move them to a GPU "
                                      "(autotile.xcompile compiles for one with meta tensors)")
        return stand_in
    if dev is None or dev.type == "cpu":
        if dev is None and torch.cuda.is_available():
            return cuda_device(torch.cuda.current_device())
        return interpret_device()
    if dev.type != "cuda":
        raise DeviceMismatchError(f"autotile runs on CUDA GPUs and on the CPU interpreter, not on {dev.type!r} tensors")
    return cuda_device(dev.index if dev.index is not None else torch.cuda.current_device())


def planned_device(profile: str) -> DeviceInfo:
    """A GPU profile's device as the search spaces see it, whether or not that GPU is present: its compute
    capability, SM count, memory and shared memory per block come from the profile (`autotile tune --dry-run`,
    autotile.xcompile).

    >>> planned_device("a100").key, planned_device("a100").smem_per_block
    ('a100/sm80', 166912)
    """
    name = profile.strip().lower()
    known = PROFILES.get(name)
    if known is None or name == "interpret":
        raise DeviceMismatchError(f"unknown GPU profile {profile!r}; known: "
                                  f"{', '.join(sorted(n for n in PROFILES if n != 'interpret'))}")
    return DeviceInfo(profile=known.name, name=f"{known.full_name} (planned)",
                      compute_capability=known.compute_capability, sm_count=known.sm_count,
                      memory_bytes=known.memory_bytes, smem_per_block=known.smem_per_block, driver="none",
                      planned=True)


def profile_archs() -> dict[tuple[int, int], str]:
    """One profile per architecture the profiles name (the first listed): {(8, 0): 'a100', (8, 9): 'l40s', ...}."""
    archs: dict[tuple[int, int], str] = {}
    for profile in PROFILES.values():
        if profile.name != "interpret":
            archs.setdefault(profile.compute_capability, profile.name)
    return archs


def resolve_gpu(requested: str, index: int = 0, planned: bool = False) -> DeviceInfo:
    """`--gpu` value -> the device to tune on. Stops when the present GPU is not the one named.

    'auto' takes the present GPU (or the interpreter when there is none);
    'interpret' always runs on the CPU interpreter. `planned` (a dry run: nothing will run) takes a named
    profile's limits when that GPU is not present.
    """
    import torch

    requested = requested.strip().lower()
    if requested == "interpret":
        return interpret_device()
    if requested != "auto" and requested not in PROFILES and not requested.startswith("other:"):
        known = ", ".join(sorted(p for p in PROFILES if p != "interpret"))
        raise DeviceMismatchError(f"--gpu {requested}: unknown GPU profile; known: {known}, auto or interpret")
    if planned and requested != "auto" and not (torch.cuda.is_available() and cuda_device(index).profile == requested):
        return planned_device(requested)
    if not torch.cuda.is_available():
        if requested == "auto":
            return interpret_device()
        raise DeviceMismatchError(
            f"--gpu {requested}: no CUDA GPU is present here. Run on a machine with that GPU, "
            "or pass --gpu interpret to run the pipeline on Triton's CPU interpreter.")
    present = cuda_device(index)
    if requested in ("auto", present.profile):
        return present
    if requested not in PROFILES:
        raise DeviceMismatchError(
            f"--gpu {requested}: unknown GPU profile; known: {', '.join(sorted(PROFILES))}, or auto")
    raise DeviceMismatchError(
        f"--gpu {requested}: the GPU present is {present.name} (profile {present.profile}); results cannot be "
        f"tuned for {requested} here. Pass --gpu {present.profile} or --gpu auto.")


def _scratch(size: int, alignment: int, stream):
    import torch

    return torch.empty(size, device="cuda", dtype=torch.int8)


@functools.lru_cache(maxsize=1)
def _allocator_state() -> tuple:
    """(Triton's allocator ContextVar, its null allocator's type), or (None, None) where Triton hides them."""
    try:
        from triton.runtime._allocation import NullAllocator, _allocator
    except ImportError:
        return None, None
    return _allocator, NullAllocator


def ensure_triton_allocator() -> None:
    """Give Triton a scratch allocator where this thread's context has none (a user's own is kept): kernels that
    build TMA descriptors on the device need one at every launch.

    NOTE: Triton 3.6 keeps the allocator in a ContextVar, so one set in the thread that first launched is missing in
    another (autograd runs a backward in its own thread; a server launches from its workers). Launch paths of such
    kernels call this before each launch: one ContextVar read (private to Triton; where that moves, the allocator is
    set every time).
    """
    current, null = _allocator_state()
    if current is None or isinstance(current.get(), null):
        import triton

        triton.set_allocator(_scratch)
