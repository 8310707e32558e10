"""Compiling a family's kernels for a GPU architecture that is not present, with Triton's own ptxas.

Every family launches its kernels through `autotile.launch.launch(kernel, grid, *args, **kwargs)`.
Within `compile_instead(...)` those launches run nothing: this module binds the real arguments the
way Triton binds a launch (tensor dtypes and 16-byte alignment, integers that are 1 or multiples of
16, constexprs from the keywords) and compiles the kernel for an explicit `GPUTarget("cuda", cc, 32)`.
The tensors are torch 'meta' tensors (shapes, strides, dtypes and offsets without data) that
`autotile.device.meta_stands_for` makes the family's launch code treat as the target GPU's, so the
render switches are the GPU's (never the interpreter's upcast dots) and the kernel compiled is the
one that GPU would run. A kernel must also fit the target's shared memory per block.

`run_as(cc)` does the same on a GPU with real tensors and then runs the kernel: the PTX compiled for
sm`cc` is handed to the driver, which compiles it for the GPU at hand (an H200 runs the code an A100
would get: its mma.sync tiles and cp.async pipelines, no TMA). benchmarks/arch_check.py uses it.

Triton fixes at import whether its language helpers are compiled or interpreted: run this in a process
that imported Triton without TRITON_INTERPRET=1 (the tests run it in a child process).

    python -m autotile.xcompile --gpu a100 --family gemm --sample 8      # any machine, no GPU needed

Each kernel's registers and stack a thread are read back from its cubin (Triton's cuobjdump): a kernel at the
255-register ceiling with stack spills, which a config can be judged by before any GPU time is spent on it.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import logging
import multiprocessing
import os
import random
import re
import sys
import time
from collections.abc import Iterable, Sequence

import torch

from autotile.device import DeviceInfo, interpret_device, meta_stands_for, planned_device, profile_archs
from autotile.errors import AutotileError
from autotile.families.base import Family, is_vendor
from autotile.launch import compile_instead
from autotile.space import AxisKind, Config


class CrossCompileError(AutotileError):
    """A kernel did not compile for its target, or would not fit it."""


@dataclasses.dataclass(frozen=True)
class KernelBuild:
    """One kernel compiled for one target."""

    name: str
    shared: int  # bytes of shared memory a program needs
    num_warps: int
    seconds: float
    ptx_features: tuple[str, ...] = ()  # the notable instructions its PTX uses (wgmma, mma.sync, cp.async, TMA)
    registers: int | None = None  # registers a thread, as ptxas allotted them (None: not read)
    stack: int | None = None  # bytes of stack a thread: register spills, or local arrays (None: not read)
    # local loads and stores (spills) inside the innermost loops that issue wgmma (None: not read, or no such loop)
    mma_loop_spills: int | None = None
    # bytes of global scratch a program, which the launch allocates each time (TMA descriptors built on the device)
    global_scratch: int = 0


@dataclasses.dataclass(frozen=True)
class ConfigBuild:
    """What compiling one config of one problem for one device gave."""

    family: str
    problem_key: str
    device_key: str
    role: str  # 'default', 'seed' or 'sample'
    config: str  # canonical JSON
    kernels: tuple[KernelBuild, ...] = ()
    error: str = ""
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.error


# PTX instructions worth reporting (patterns searched for): they show which hardware path a kernel took.
_PTX_FEATURES = {"wgmma": r"wgmma\.mma_async", "mma.sync": r"mma\.sync", "cp.async": r"cp\.async",
                 "tma": r"cp\.async\.bulk\.tensor", "setmaxnreg": r"setmaxnreg",
                 # a TMA store, shared memory to global memory
                 "tma_store": r"cp\.async\.bulk\.tensor\.[1-5]d\.global\.shared",
                 # global reductions (no reply awaited) and atomics (which wait for L2's reply)
                 "red": r"red\.relaxed\.gpu\.global", "atom": r"atom\.global",
                 # a TMA reduction from shared memory into global memory
                 "tma_reduce": r"cp\.reduce\.async\.bulk\.tensor"}


def gpu_target(compute_capability: tuple[int, int]):
    from triton.backends.compiler import GPUTarget

    major, minor = compute_capability
    return GPUTarget("cuda", 10 * major + minor, 32)


def require_compiler_mode() -> None:
    """Refuse to cross-compile where Triton was imported for its interpreter (its helpers cannot compile)."""
    import triton.language.standard as standard
    from triton.runtime.jit import JITFunction

    if not isinstance(standard.cdiv, JITFunction):
        raise CrossCompileError(
            "Triton was imported with TRITON_INTERPRET=1 in this process, so its language helpers run only under "
            "the interpreter: cross-compile in a process started without it (python -m autotile.xcompile ...)")


_binders: dict = {}  # (kernel, cc) -> (backend, binder)


def bind_arguments(kernel, target, args: tuple, kwargs: dict):
    """(backend, options, signature, constexprs, attrs, bound arguments) of one launch, as Triton's own launch
    binds it for `target`.

    NOTE: the binder and _pack_args are what JITFunction.run calls to specialise a launch (Triton 3.6); called
    with meta or CPU tensors they give the signature a GPU launch would get, with no GPU.
    """
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    from triton import knobs

    # NOTE: JITFunction.run (Triton 3.6) adds these two options before it binds a launch; they are part of the
    # compiled kernel's cache key, which compile-ahead (autotile.tune.compile_ahead) must share with the trial.
    kwargs = {**kwargs, "debug": kwargs.get("debug", kernel.debug) or knobs.runtime.debug,
              "instrumentation_mode": knobs.compilation.instrumentation_mode}
    key = (kernel, target.arch)
    if key not in _binders:
        backend = make_backend(target)
        _binders[key] = (backend, create_function_from_signature(kernel.signature, kernel.params, backend))
    backend, binder = _binders[key]
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    return backend, options, signature, constexprs, attrs, bound


def compile_kernel(kernel, target, args: tuple, kwargs: dict):
    """(CompiledKernel, bound arguments) of `kernel[grid](*args, **kwargs)` for `target`, without launching."""
    import triton

    _, options, signature, constexprs, attrs, bound = bind_arguments(kernel, target, args, kwargs)
    if getattr(kernel, "is_gluon", lambda: False)():  # a Gluon kernel builds from its own IR
        from triton.experimental.gluon._runtime import GluonASTSource as ASTSource
    else:
        from triton.compiler import ASTSource
    source = ASTSource(kernel, signature, constexprs, attrs)
    return triton.compile(source, target=target, options=options.__dict__), bound


class _Collector:
    """The compile-instead hook: compiles each launch for `device`'s architecture and records it.

    `read_resources`: read each kernel's registers and stack back from its cubin (a cuobjdump run each).
    `build_launchers`: build each kernel's host launcher too (a C module Triton keeps on disk beside the kernels,
    built otherwise at the kernel's first launch); where that fails (no CUDA driver library to link) the launch
    builds it later.
    """

    def __init__(self, device: DeviceInfo, read_resources: bool = True, build_launchers: bool = False):
        self.device = device
        self.target = gpu_target(device.compute_capability)
        self.kernels: list[KernelBuild] = []
        self.read_resources, self.build_launchers = read_resources, build_launchers

    def __call__(self, kernel, grid, args, kwargs) -> None:
        started = time.monotonic()
        name = getattr(kernel, "__name__", str(kernel))
        try:
            compiled, _ = compile_kernel(kernel, self.target, args, kwargs)
        except Exception as exc:  # noqa: BLE001 - Triton raises many kinds; the message is what matters
            raise CrossCompileError(f"{name} does not compile for sm{self.target.arch}: "
                                    f"{type(exc).__name__}: {_tail(str(exc))}") from None
        shared = int(compiled.metadata.shared)
        if shared > self.device.smem_per_block:
            raise CrossCompileError(f"{name} needs {shared} B of shared memory a program; {self.device.name} "
                                    f"(sm{self.target.arch}) allows {self.device.smem_per_block} B")
        if self.build_launchers:
            build_launcher(compiled)
        ptx = compiled.asm.get("ptx", "")
        features = tuple(label for label, pattern in _PTX_FEATURES.items() if re.search(pattern, ptx))
        registers, stack = resource_usage(compiled.asm.get("cubin")) if self.read_resources else (None, None)
        loop_spills = mma_loop_spills(compiled.asm.get("cubin")) if self.read_resources and stack else None
        self.kernels.append(KernelBuild(name, shared, int(compiled.metadata.num_warps),
                                        time.monotonic() - started, features, registers, stack, loop_spills,
                                        int(getattr(compiled.metadata, "global_scratch_size", 0) or 0)))


def build_launcher(compiled) -> None:
    """Build (or find on disk) the host launcher of a compiled kernel without loading the kernel, so no GPU is
    touched; where it cannot be built here, the kernel's first launch builds it.

    NOTE: CompiledKernel._init_handles (Triton 3.6) builds it at the first launch, together with loading the
    kernel into the GPU's context; the launcher class alone only compiles a C module and imports it.
    """
    try:
        from triton.runtime.driver import driver

        driver.active.launcher_cls(compiled.src, compiled.metadata)
    except Exception as exc:  # noqa: BLE001 - the kernel's first launch builds it instead
        logging.getLogger("autotile.xcompile").debug("no launcher built ahead for %s: %s", compiled.name, exc)


def resource_usage(cubin: bytes | None) -> tuple[int | None, int | None]:
    """(registers a thread, bytes of stack a thread) of a compiled kernel, read with the cuobjdump Triton ships;
    (None, None) when there is no cubin or no cuobjdump. Stack holds spilled registers, or local arrays (libdevice's
    sin and cos keep one for large arguments): stack at the 255-register ceiling is spilling."""
    out = _cuobjdump(cubin, "-res-usage") if cubin else None
    if out is None:
        return None, None
    # e.g. "REG:254 STACK:0 SHARED:1024 LOCAL:0 CONSTANT[0]:712 ..."
    fields = dict(item.split(":", 1) for line in out.splitlines() if "REG:" in line for item in line.split()
                  if ":" in item)
    try:
        return int(fields["REG"]), int(fields["STACK"])
    except (KeyError, ValueError):
        return None, None


def _cuobjdump(cubin: bytes, *flags: str) -> str | None:
    """`cuobjdump FLAGS` on a cubin with the cuobjdump Triton ships; None where there is none or it fails."""
    import subprocess
    import tempfile

    try:
        from triton import knobs

        tool = knobs.nvidia.cuobjdump.path
    except Exception:  # noqa: BLE001 - another Triton: report nothing rather than fail the compile check
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as handle:
        handle.write(cubin)
        handle.flush()
        try:
            return subprocess.run([tool, *flags, handle.name], capture_output=True, text=True, timeout=60).stdout
        except (OSError, subprocess.SubprocessError):
            return None


_SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?);")


def mma_loop_spills(cubin: bytes | None) -> int | None:
    """Local loads and stores (LDL/STL: spilled registers) inside the innermost loops of a kernel's SASS that issue
    wgmma (HGMMA), or None (no cubin, no cuobjdump, no such loop). A spill there costs every iteration; one that
    ptxas places outside (a value kept across a persistent kernel's tiles) costs once a tile.
    Loops are read from backward branches: the addresses from a branch's target to the branch. NOTE: ptxas puts the
    retry paths of barrier waits after the kernel's last EXIT, branching back into it; those are not loops."""
    sass = _cuobjdump(cubin, "-sass") if cubin else None
    return sass_mma_loop_spills(sass) if sass else None


def sass_mma_loop_spills(sass: str) -> int | None:
    """mma_loop_spills on `cuobjdump -sass` text."""
    code = [(int(m.group(1), 16), m.group(2)) for m in _SASS_LINE.finditer(sass)]
    last_exit = max((a for a, t in code if re.search(r"\bEXIT\b", t)), default=None)
    mma = [a for a, t in code if "HGMMA" in t]
    loops = []
    for address, text in code:
        branch = re.search(r"\bBRA\s+(?:`\()?0x([0-9a-f]+)", text)
        target = int(branch.group(1), 16) if branch else address
        if target < address and (last_exit is None or address < last_exit) and any(target <= a <= address for a in mma):
            loops.append((target, address))
    innermost = [(lo, hi) for lo, hi in loops
                 if not any((lo, hi) != (l2, h2) and lo <= l2 and h2 <= hi for l2, h2 in loops)]
    if not innermost:
        return None
    return sum(1 for a, t in code for lo, hi in innermost if lo <= a <= hi and re.search(r"\b(LDL|STL)\b", t))


def _tail(text: str, limit: int = 1500) -> str:
    text = text.strip()
    return text if len(text) <= limit else "..." + text[-limit:]


def meta_tensor(shape, strides, offset: int, dtype: torch.dtype) -> torch.Tensor:
    """A meta tensor of this shape, strides, storage offset (so the same alignment) and dtype."""
    extent = 1 + sum((size - 1) * stride for size, stride in zip(shape, strides) if size > 0)
    storage = torch.empty(offset + max(extent, 1), dtype=dtype, device="meta")
    return storage.as_strided(shape, strides, offset)


def meta_like(value):
    """A tensor as a meta tensor of the same shape, strides, dtype and storage offset (so the same alignment);
    0-d tensors (scalars the launch code reads on the host) and anything else stay as they are."""
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return value
    return meta_tensor(value.shape, value.stride(), value.storage_offset(), value.dtype)


def meta_inputs(family: Family, problem, seed: int = 0) -> dict:
    """The problem's inputs (made on the CPU: real page tables, lengths, alignment) as meta tensors."""
    inputs = family.make_layout_inputs(problem, interpret_device(), seed=seed)
    return {name: meta_like(t) for name, t in inputs.items()}


def compile_config(family: Family, problem, config, device: DeviceInfo, inputs: dict | None = None,
                   read_resources: bool = True, build_launchers: bool = False) -> tuple[KernelBuild, ...]:
    """Compile every kernel `family.launch` would launch for (problem, config) on `device`, for its architecture.

    Raises CrossCompileError naming the kernel that does not compile or does not fit. The compiled kernels land
    in Triton's cache under the keys a launch on such a GPU looks up (autotile.tune.compile_ahead relies on it).
    `read_resources` and `build_launchers`: see _Collector.

    >>> from autotile.device import planned_device
    >>> from autotile.families.elementwise import FAMILY
    >>> p = FAMILY.problem_for_expression("silu(x) * x", "bf16", 4096)
    >>> a100 = planned_device("a100")
    >>> [k.name for k in compile_config(FAMILY, p, FAMILY.default_config(p, a100), a100)]  # doctest: +SKIP
    ['elementwise_kernel']
    """
    if device.interpret:
        raise CrossCompileError("the interpreter compiles nothing: name a GPU (a profile, or a DeviceInfo)")
    if is_vendor(config):
        raise CrossCompileError(f"{dict(config)} runs a vendor library: there is no kernel to compile")
    require_compiler_mode()
    inputs = meta_inputs(family, problem) if inputs is None else inputs
    outputs = family.allocate_outputs(problem, inputs)
    collector = _Collector(device, read_resources=read_resources, build_launchers=build_launchers)
    _forget_device_plans()
    with meta_stands_for(device), compile_instead(collector):
        family.launch(problem, Config(config), inputs, outputs)
    if not collector.kernels:
        raise CrossCompileError(f"{family.name}: the launch of {dict(config)} launched no kernel")
    return tuple(collector.kernels)


def _forget_device_plans() -> None:
    """NOTE: the GEMM family keeps launch plans per torch device, and every meta tensor is on the one 'meta'
    device whatever GPU it stands for: forget them, so that a plan (its grid and stream-K split, worked out
    from the SM count) is made for the GPU compiled for now."""
    from autotile.families import gemm_launch

    gemm_launch.launch_plan.cache_clear()


class run_as:
    """Within this block (this thread), launches on the GPU at hand run the code compiled for sm`cc`.

    Each launch is compiled for that architecture from its real arguments and its PTX handed to the driver,
    which compiles it for the present GPU (PTX of an older architecture runs on newer ones). Compiled kernels
    are kept per signature. For benchmarks/arch_check.py: an H200 runs what an A100 (sm80) or an L40S (sm89)
    would be given.
    """

    def __init__(self, compute_capability: tuple[int, int]):
        self.target = gpu_target(compute_capability)
        self._kept: dict = {}
        self._hook = compile_instead(self._launch)
        self.launched: list[str] = []

    def __enter__(self):
        require_compiler_mode()
        self._hook.__enter__()
        return self

    def __exit__(self, *exc):
        return self._hook.__exit__(*exc)

    def _launch(self, kernel, grid, args, kwargs) -> None:
        from autotile.launch import argument_signature

        try:
            key = (kernel, tuple(sorted(kwargs.items())), argument_signature(args))
        except TypeError:  # an argument the signature does not know, or an unhashable keyword: compile afresh
            key = None
        entry = self._kept.get(key) if key is not None else None
        if entry is None:
            compiled, bound = compile_kernel(kernel, self.target, args, kwargs)
            # NOTE: cuModuleLoadData takes PTX as well as cubin; the cubin of an older architecture would not
            # load on a newer GPU, its PTX is compiled for the GPU by the driver.
            compiled.kernel = compiled.asm["ptx"].encode() + b"\0"
            entry = compiled
            if key is not None:
                self._kept[key] = entry
        else:
            _, _, _, _, _, bound = bind_arguments(kernel, self.target, args, kwargs)
        grid = tuple(grid) + (1,) * (3 - len(grid))
        entry[grid](*bound.values())
        self.launched.append(getattr(kernel, "__name__", str(kernel)))


# --- what to compile -------------------------------------------------------------------------------

def covering_sample(space, count: int, seed: int = 0, exclude: Iterable[Config] = ()) -> list[Config]:
    """Up to `count` feasible configs of `space`: first ones that together take every value of every
    structural axis (render switches and bool/str axes) that some feasible config takes, then random ones."""
    feasible = [c for c in space.feasible() if c not in set(exclude)]
    rng = random.Random(seed)
    rng.shuffle(feasible)
    structural = [a.name for a in space.axes
                  if a.kind == AxisKind.RENDER or not isinstance(a.choices[0], int) or isinstance(a.choices[0], bool)]
    wanted = {(name, c[name]) for c in feasible for name in structural}
    chosen: list[Config] = []
    while wanted and len(chosen) < count:
        best = max(feasible, key=lambda c: sum((n, c[n]) in wanted for n in structural))
        gain = {(n, best[n]) for n in structural} & wanted
        if not gain:
            break
        chosen.append(best)
        feasible.remove(best)
        wanted -= gain
    chosen += feasible[:max(0, count - len(chosen))]
    return chosen


def configs_to_check(family: Family, problem, device: DeviceInfo, sample: int, seed: int = 0, seeds: bool = True
                     ) -> list[tuple[str, Config]]:
    """(role, config): the default, the seeds (unless `seeds` is False), and a covering sample of the rest of
    the space on `device`."""
    default = family.default_config(problem, device)
    seeds = [c for c in family.seed_configs(problem, device) if c != default] if seeds else []
    taken = [default, *seeds]
    sampled = covering_sample(family.space(problem, device), sample, seed, exclude=taken) if sample else []
    return [("default", default)] + [("seed", c) for c in seeds] + [("sample", c) for c in sampled]


def representative_problems() -> dict[str, list]:
    """A few problems per family that between them reach every kernel and render switch: small enough
    that their inputs are made in moments on the CPU, large enough that every block size is feasible."""
    from autotile.families.elementwise import FAMILY as ELEMENTWISE
    from autotile.families.flash import FlashProblem
    from autotile.families.gemm import contiguous_problem
    from autotile.families.paged import PagedProblem

    return {
        "gemm": [
            contiguous_problem(512, 1024, 512, "bf16", "bf16", layout_b="col"),  # prefill: TMA, persistent
            contiguous_problem(8, 1024, 2048, "fp16", "fp16", layout_b="col", bias=True, activation="silu"),  # decode
            contiguous_problem(300, 500, 200, "fp32", "fp32", tf32=True, residual=True),  # odd sizes, tf32
            contiguous_problem(512, 512, 512, "fp8", "bf16", layout_b="col", scale_mode="row"),
        ],
        "flash": [
            FlashProblem("fwd", 1, 4, 2, 512, 512, 128, causal=True),
            FlashProblem("fwd", 1, 2, 2, 300, 300, 64, dtype="fp16", softcap=30.0, window_left=64),
            FlashProblem("fwd", 1, 2, 2, 256, 256, 128, dtype="fp8"),
            FlashProblem("bwd", 1, 2, 1, 256, 256, 64, causal=True),
        ],
        "paged": [
            PagedProblem(4, 8, 2, 128, 16, 1000),  # decode: whole, split, balanced
            PagedProblem(2, 8, 2, 96, 16, 600, num_queries=32),  # chunked prefill, padded head dim
            PagedProblem(4, 8, 8, 64, 16, 1000, dtype="fp16", kv_dtype="fp8"),
        ],
        "elementwise": [
            ELEMENTWISE.problem_for_expression("sin(x)**2 + cos(x)**2", "fp32", 1 << 16),
            ELEMENTWISE.problem_for_expression("x * sigmoid(y) + z", "bf16", 100_003),
        ],
    }


# --- running many compiles ---------------------------------------------------------------------------

def _check_one(job: tuple) -> ConfigBuild:
    family_name, problem_data, device, role, config_json = job
    from autotile.families import get_family

    family = get_family(family_name)
    problem = family.problem_from_dict(problem_data)
    started = time.monotonic()
    common = dict(family=family_name, problem_key=family.problem_key(problem), device_key=device.key, role=role,
                  config=config_json)
    try:
        kernels = compile_config(family, problem, Config.from_json(config_json), device)
    except Exception as exc:  # noqa: BLE001 - reported per config
        text = str(exc) if isinstance(exc, CrossCompileError) else f"{type(exc).__name__}: {_tail(str(exc))}"
        return ConfigBuild(**common, error=text, seconds=time.monotonic() - started)
    return ConfigBuild(**common, kernels=kernels, seconds=time.monotonic() - started)


def plan_jobs(families: Sequence[str], devices: Sequence[DeviceInfo], sample: int, seed: int = 0,
              problems: dict[str, list] | None = None, seeds: bool = True) -> list[tuple]:
    """Every (family, problem, device, role, config) to compile; problems a device cannot run are skipped."""
    from autotile.arch import UnsupportedOnDevice
    from autotile.families import get_family

    problems = representative_problems() if problems is None else problems
    jobs = []
    for name in families:
        family = get_family(name)
        for problem in problems[name]:
            for device in devices:
                try:
                    configs = configs_to_check(family, problem, device, sample, seed, seeds)
                except UnsupportedOnDevice:
                    continue
                jobs += [(name, dataclasses.asdict(problem), device, role, c.to_json()) for role, c in configs]
    return jobs


def run_jobs(jobs: list[tuple], processes: int = 1) -> list[ConfigBuild]:
    """Compile every job, in `processes` processes (spawned without TRITON_INTERPRET)."""
    if processes <= 1:
        return [_check_one(job) for job in jobs]
    context = multiprocessing.get_context("spawn")
    # Longest first (flash backward, then flash), so that no process is left with a long compile at the end.
    order = sorted(range(len(jobs)), key=lambda i: (jobs[i][0] != "flash", jobs[i][1].get("direction") != "bwd"))
    interpret = os.environ.pop("TRITON_INTERPRET", None)  # the spawned processes inherit the environment
    try:
        with concurrent.futures.ProcessPoolExecutor(processes, mp_context=context) as pool:
            results = list(pool.map(_check_one, [jobs[i] for i in order]))
    finally:
        if interpret is not None:
            os.environ["TRITON_INTERPRET"] = interpret
    by_index = dict(zip(order, results))
    return [by_index[i] for i in range(len(jobs))]


def summary_table(results: Sequence[ConfigBuild]) -> str:
    """Markdown: per family and device, configs compiled, failures, and compile seconds."""
    rows: dict[tuple[str, str], list[ConfigBuild]] = {}
    for r in results:
        rows.setdefault((r.family, r.device_key), []).append(r)
    lines = ["| family | device | configs | failed | spilling | compile s (sum) | slowest s |",
             "|---|---|---|---|---|---|---|"]
    for (family, device), group in sorted(rows.items()):
        failed = sum(not r.ok for r in group)
        spilling = sum(any(_spills(k) for k in r.kernels) for r in group)
        lines.append(f"| {family} | {device} | {len(group)} | {failed} | {spilling} | "
                     f"{sum(r.seconds for r in group):.1f} | {max(r.seconds for r in group):.1f} |")
    return "\n".join(lines)


# ptxas' most registers a thread (sm70 on): a kernel there with stack has spilled.
_MAX_REGISTERS = 255


def _spills(kernel: KernelBuild) -> bool:
    return bool(kernel.stack) and kernel.registers is not None and kernel.registers >= _MAX_REGISTERS


def spill_lines(results: Sequence[ConfigBuild]) -> list[str]:
    """One line per kernel that spilled registers: what to look at before timing a config on the GPU."""
    return [f"SPILLS {r.family} {r.device_key} {r.role} {r.config} {k.name}: {k.registers} registers, "
            f"{k.stack} B of stack a thread" for r in results for k in r.kernels if _spills(k)]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m autotile.xcompile",
                                     description="Cross-compile families' defaults, seeds and a sample of their "
                                                 "spaces for GPU profiles (no GPU needed).")
    parser.add_argument("--gpu", action="append", default=None,
                        help="profile to compile for (repeatable; default: one profile per architecture)")
    parser.add_argument("--family", action="append", default=None, help="family (repeatable; default: all four)")
    parser.add_argument("--sample", type=int, default=4, help="configs sampled per problem beside default and seeds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--processes", type=int, default=max(1, min(4, os.cpu_count() or 1)))
    parser.add_argument("--json", action="store_true", help="print every result as one JSON line at the end")
    args = parser.parse_args(argv)
    devices = [planned_device(name) for name in (args.gpu or [profile_archs()[cc] for cc in sorted(profile_archs())])]
    families = args.family or ["gemm", "flash", "paged", "elementwise"]
    jobs = plan_jobs(families, devices, args.sample, args.seed)
    started = time.monotonic()
    results = run_jobs(jobs, args.processes)
    for r in results:
        if not r.ok:
            print(f"FAILED {r.family} {r.device_key} {r.role} {r.problem_key} {r.config}\n  {r.error}", file=sys.stderr)
    for line in spill_lines(results):
        print(line, file=sys.stderr)
    print(summary_table(results), file=sys.stderr)
    print(f"{len(results)} configs in {time.monotonic() - started:.1f} s on {args.processes} processes",
          file=sys.stderr)
    if args.json:
        print(json.dumps([dataclasses.asdict(r) for r in results]))
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
