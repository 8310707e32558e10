"""The GPU at hand (or Triton's CPU interpreter) and the named GPU profiles results are filed under."""
from __future__ import annotations

import functools
import os
import subprocess
from dataclasses import dataclass, field

from autotile.errors import DeviceMismatchError


@dataclass(frozen=True)
class GpuProfile:
    """What a kind of GPU can do: the ceilings that reports place results against.

    `peak_tflops` are dense datasheet rates unless `measured` says otherwise;
    `copy_tbps` counts bytes read plus bytes written.
    """

    name: str
    match: tuple[str, ...]  # lower-case substrings of the CUDA device name
    compute_capability: tuple[int, int]
    peak_tflops: dict[str, float] = field(default_factory=dict)
    copy_tbps: float = 0.0
    note: str = ""


PROFILES: dict[str, GpuProfile] = {
    p.name: p
    for p in (
        GpuProfile(
            "h200", ("h200",), (9, 0),
            # bf16/fp16: best seen with cuBLAS on random data; fp8/tf32 datasheet dense.
            {"bf16": 717.0, "fp16": 717.0, "fp8": 1979.0, "fp32": 495.0},
            copy_tbps=4.30,
            note="measured on the lent H200, 2026-11-29 (shared/anchors): copy 4.30 TB/s, bf16 matmul 717 TFLOP/s",
        ),
        GpuProfile("h100", ("h100",), (9, 0), {"bf16": 989.0, "fp16": 989.0, "fp8": 1979.0, "fp32": 495.0},
                   copy_tbps=3.35, note="H100 SXM datasheet, dense"),
        GpuProfile("a100", ("a100",), (8, 0), {"bf16": 312.0, "fp16": 312.0, "fp32": 156.0},
                   copy_tbps=2.0, note="A100 80GB SXM datasheet, dense"),
        GpuProfile("l40s", ("l40s",), (8, 9), {"bf16": 362.0, "fp16": 362.0, "fp8": 733.0, "fp32": 183.0},
                   copy_tbps=0.864, note="L40S datasheet, dense"),
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


def current_device(tensor_device=None) -> DeviceInfo:
    """The device a tensor lives on: a CUDA GPU, or the interpreter for CPU tensors."""
    import torch

    dev = torch.device(tensor_device) if tensor_device is not None else None
    if dev is None or dev.type == "cpu":
        if dev is None and torch.cuda.is_available():
            return cuda_device(torch.cuda.current_device())
        return interpret_device()
    if dev.type != "cuda":
        raise DeviceMismatchError(f"autotile runs on CUDA GPUs and on the CPU interpreter, not on {dev.type!r} tensors")
    return cuda_device(dev.index if dev.index is not None else torch.cuda.current_device())


def resolve_gpu(requested: str, index: int = 0) -> DeviceInfo:
    """`--gpu` value -> the device to tune on. Stops when the present GPU is not the one named.

    'auto' takes the present GPU (or the interpreter when there is none);
    'interpret' always runs on the CPU interpreter.
    """
    import torch

    requested = requested.strip().lower()
    if requested == "interpret":
        return interpret_device()
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


@functools.lru_cache(maxsize=1)
def ensure_triton_allocator() -> None:
    """Give Triton a scratch allocator (once): kernels that build TMA descriptors on the device need one."""
    import torch
    import triton

    def alloc(size: int, alignment: int, stream):
        return torch.empty(size, device="cuda", dtype=torch.int8)

    triton.set_allocator(alloc)
