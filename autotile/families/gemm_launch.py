"""Launching the GEMM family's kernels: a plan per (problem, config, device), the fp32 workspace of split
tiles and the tile counters with which the last contributor of a tile finishes it.

The tile counters are zero between launches: the program that completes a tile resets its counter, so
one buffer serves every launch on a stream without a memset. Buffers are kept per CUDA stream (launches
on one stream never overlap). A launch captured in a CUDA graph gets counters of its own (a graph may be
replayed on any stream, beside eager launches): a slice of the device's graph counters, zeroed once and
never handed out again, which the graph's kernels leave zero after every replay (CUDA runs the launches
of one graph one after another). Where that arena is spent, or not made yet, the graph zeroes counters
of its own on every replay: one small memset node per split launch. A launch that raises drops its
stream's buffer, whose counters it may have left half counted.
"""
from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Callable

import torch

from autotile.device import current_device
from autotile.families.gemm_space import programs_per_sm, upgrade_config
from autotile.launch import KeptEncodings, bind, bind_descriptors
from autotile.launch import launch as launch_kernel
from autotile.render import launching, load_kernel_module
from autotile.space import Config

# Programs the interpreter pretends run at once (it runs them one after another): an odd number, so
# that stream-K's shares of K iterations begin and end inside tiles, and persistent loops take turns.
INTERPRETER_PROGRAMS = 3
# Operand dtypes whose tl.dot Triton 3.6's interpreter computes wrongly (bf16) or that it may not take:
# their dot operands are upcast to fp32 on the CPU, which is exact for all three.
_UPCAST_ON_CPU = ("bf16", "fp16", "fp8")
_MIN_COUNTERS = 4096
_CONSTEXPRS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "SPLIT_K", "PROMOTE_TILES", "WARP_SPECIALIZE", "FLATTEN",
               "num_warps", "num_stages")


@dataclasses.dataclass(frozen=True)
class LaunchPlan:
    """Everything about one (problem, config) launch that does not depend on the tensors' addresses."""

    kernel: object
    kernel_args: Callable  # the rendered module's kernel_args: gemm_kernel's arguments in order
    grid: tuple
    constexprs: dict
    workspace: int  # fp32 elements of split tiles' partial sums (0: none)
    counters: int  # tile counters the launch needs (0: none)
    stream_k: tuple  # (dp_tiles, sk_programs, sk_iters) for the stream_k schedule
    interpret: bool
    tiles: tuple  # (BLOCK_M, BLOCK_N, BLOCK_K): kernel_args' last argument
    # The operands ('a', 'b', 'c') whose host-built TMA descriptors lead the kernel's arguments, in order; empty
    # where the kernel takes pointers only.
    descriptor_sources: tuple = ()
    # FAMILY.launch's bound launches of a descriptor kernel, per call signature (_run_bound_descriptors).
    bound: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)


@functools.lru_cache(maxsize=4096)
def launch_plan(family, problem, config: Config, dev: torch.device) -> LaunchPlan:
    """Worked out once per (problem, config, device): a launch then costs an allocation and Triton's launch."""
    interpret = dev.type == "cpu"
    config = Config(upgrade_config(problem, config))
    switches = family.render_switches(problem, config)
    switches["UPCAST_DOTS"] = interpret and problem.dtype in _UPCAST_ON_CPU
    module = load_kernel_module(family.template, interpret=interpret, **switches)
    if interpret:
        programs = INTERPRETER_PROGRAMS
    else:
        device = current_device(dev)
        programs = device.sm_count * programs_per_sm(problem, config, device)
    grid, workspace, counters, stream_k = module.launch_geometry(
        problem.m, problem.n, problem.k, config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"], config["SPLIT_K"],
        config["PERSISTENT"], programs)
    constexprs = {name: config.get(name, 1) for name in _CONSTEXPRS}  # PROMOTE_TILES is 1 where it is no axis
    tiles = (config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"])
    return LaunchPlan(module.gemm_kernel, module.kernel_args, grid, constexprs, workspace, counters, stream_k,
                      interpret, tiles, getattr(module, "DESCRIPTOR_SOURCES", ()))


def run_plan(plan: LaunchPlan, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, inputs: dict) -> None:
    """Launch `plan` on operands a (M, K), b (K, N) into c (M, N); bias, residual and scales come from `inputs`."""
    if plan.descriptor_sources and _run_bound_descriptors(plan, a, b, c, inputs):
        return
    ws = workspace(a.device, plan.workspace) if plan.workspace else None
    counters = tile_counters(a.device, plan.counters) if plan.counters else None
    args = plan.kernel_args(a, b, c, inputs.get("bias"), inputs.get("residual"), inputs.get("scale_a"),
                            inputs.get("scale_b"), ws, counters, plan.stream_k, plan.tiles)
    try:
        with launching(plan.interpret):
            launch_kernel(plan.kernel, plan.grid, *args, **plan.constexprs)
    except BaseException:
        if counters is not None:
            forget_counters(a.device)
        raise


def _pointer_meta(t) -> tuple | None:
    return None if t is None else (t.stride(), not t.data_ptr() & 15, t.dtype)


def _run_bound_descriptors(plan: LaunchPlan, a, b, c, inputs: dict) -> bool:
    """Launch a plan whose kernel takes host-built TMA descriptors through a BoundDescriptorGemm it keeps per call
    signature; False where that does not apply (fp8, the interpreter), and the caller launches.

    NOTE: built per call (kernel_args, then Triton's own encoding at launch), the descriptors cost ~20 us of host
    time, and FAMILY.launch outlasted the L2 flush and kernel of a mid-sized GEMM: do_bench timed the host
    (512 x 3584 x 3584 at 88 us, beside 21 us replayed in a CUDA graph: results/gemm_mid_probe_2026-12-04e.txt).
    Tuning and the benchmarks time through FAMILY.launch, so it takes the bound launch that serving takes.
    """
    if plan.interpret or a.dtype not in (torch.bfloat16, torch.float16):
        return False
    bias, residual = inputs.get("bias"), inputs.get("residual")
    key = (a.stride(), b.stride(), c.stride(), a.device, _pointer_meta(bias), _pointer_meta(residual))
    bound = plan.bound.get(key)
    if bound:
        bound(a, b, c, bias, residual)
        return True
    if bound is False:
        return False  # launched through Triton's own path, which the caller takes
    bound = bind_plan(plan, a, b, c, bias, residual)
    if bound is None:
        return False  # not launched
    plan.bound[key] = bound
    return True  # launched, bound or through Triton's own path


# NOTE: a buffer replaced or dropped here may still be in use by launches queued on its stream; the caching
# allocator hands its memory out again only to work queued after them on that same stream.
_counters: dict[tuple, torch.Tensor] = {}


# NOTE: the private raw-stream getter (what Triton's own launcher calls) costs ~0.2 us; the public
# current_stream() builds a Stream object (~2 us) on every call of a decode GEMM.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
# NOTE: the C check itself; torch.cuda.is_current_stream_capturing() wraps it in a Python call.
_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None) or torch.cuda.is_current_stream_capturing


def _cuda_index(dev: torch.device) -> int:
    return dev.index if dev.index is not None else torch.cuda.current_device()


def _stream_key(dev: torch.device) -> tuple:
    if dev.type != "cuda":
        return (dev.type, 0)
    index = _cuda_index(dev)
    stream = _raw_stream(index) if _raw_stream is not None else torch.cuda.current_stream(index).cuda_stream
    return ("cuda", index, stream)


def tile_counters(dev: torch.device, count: int) -> torch.Tensor:
    """At least `count` int32 tile counters, all zero, for a launch on the current stream of `dev`."""
    if dev.type == "cuda" and torch.cuda.is_current_stream_capturing():
        taken = _graph_counters(dev, count)
        return taken if taken is not None else torch.zeros(count, dtype=torch.int32, device=dev)
    key = _stream_key(dev)
    buffer = _counters.get(key)
    if buffer is not None and buffer.numel() >= count:
        return buffer
    if dev.type == "cuda":
        _make_graph_counters(dev)
    buffer = torch.zeros(max(count, _MIN_COUNTERS, 2 * (buffer.numel() if buffer is not None else 0)),
                         dtype=torch.int32, device=dev)
    _counters[key] = buffer
    return buffer


# Tile counters of launches captured in CUDA graphs, per device: zeroed once, each slice handed to one captured
# launch for good (1 MiB a device; a graph's launch takes one counter a tile, so 256K covers some thousands of
# captured split launches, vLLM's graphs per batch size times a model's layers; past that, memset nodes).
GRAPH_COUNTERS = 1 << 18
_graph_arenas: dict[int, list] = {}  # device index -> [counters, first free]


def _make_graph_counters(dev: torch.device) -> None:
    """The device's graph counters, made by its first eager split launch (outside any capture, so zeroed once).

    NOTE: the zeros are written on the current stream, not awaited: a graph taking from them is captured
    later, and torch.cuda.graph synchronises the device before it captures (as vLLM's and torch.compile's
    captures do). A raw CUDAGraph.capture_begin with no synchronisation since the first eager split launch,
    replayed at once on another stream, is the one order that could find them unwritten.
    """
    index = _cuda_index(dev)
    if index not in _graph_arenas:
        _graph_arenas[index] = [torch.zeros(GRAPH_COUNTERS, dtype=torch.int32, device=dev), 0]


def _graph_counters(dev: torch.device, count: int) -> torch.Tensor | None:
    """`count` zero counters of the device's graph arena, for one captured launch; None where it has too few."""
    entry = _graph_arenas.get(_cuda_index(dev))
    if entry is None or entry[1] + count > entry[0].numel():
        return None
    start = entry[1]
    entry[1] = start + count
    return entry[0][start:start + count]


_workspaces: dict[tuple, torch.Tensor] = {}


def workspace(dev: torch.device, numel: int) -> torch.Tensor:
    """At least `numel` fp32 elements for split tiles' partial sums, kept per stream like the counters.

    Launches on one stream run one after another, so the next launch may reuse what the last one wrote; a
    launch captured in a CUDA graph gets a buffer of its own (the graph's pool), as for the counters.
    """
    if dev.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.empty(numel, dtype=torch.float32, device=dev)
    key = _stream_key(dev)
    buffer = _workspaces.get(key)
    if buffer is None or buffer.numel() < numel:
        buffer = _workspaces[key] = torch.empty(max(numel, 2 * (buffer.numel() if buffer is not None else 0)),
                                                dtype=torch.float32, device=dev)
    return buffer


def split_buffers(dev: torch.device, numel: int, count: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(workspace(dev, numel), tile_counters(dev, count)), None where 0 is asked for, with one capture check and
    one stream lookup where both are kept already.

    NOTE: apart, the two cost ~5.2 us of host time on the H200 machine (2.65 + 2.55), a third of a split-K decode
    GEMM's whole host time (results/host_pieces_2026-12-02.txt); together ~2 us.
    """
    if dev.type == "cuda" and not _capturing():
        key = _stream_key(dev)
        ws, counters = _workspaces.get(key), _counters.get(key)
        if (not numel or (ws is not None and ws.numel() >= numel)) and \
                (not count or (counters is not None and counters.numel() >= count)):
            return (ws if numel else None), (counters if count else None)
    return (workspace(dev, numel) if numel else None), (tile_counters(dev, count) if count else None)


def forget_counters(dev: torch.device) -> None:
    """Drop the current stream's counters (after a failed launch): the next launch starts from zeros."""
    _counters.pop(_stream_key(dev), None)




class BoundGemm:
    """One call signature's kernel bound to its compiled launcher: a call passes new tensors and nothing else.

    Shapes and strides are fixed by the signature, so the integer arguments of the first call's
    kernel_args are kept and only the tensors (a, b, c, bias, ...) are put in their places. The workspace
    and tile counters come from the per-stream buffers of autotile.families.gemm_launch.
    NOTE: measured on the H200 machine, FAMILY.launch cost 27-42 us of host time per decode GEMM (the
    plan lookup, the argument signature, the launch context), more than cuBLAS's whole call (~20 us), so
    host-bound decode steps lost to cuBLAS although the kernel itself was faster.
    """

    __slots__ = ("launcher", "plan", "pick", "tail", "device_index", "buffers")

    # The order of the values a call hands over; the kernel's tensor arguments are picked from them.
    _VALUES = ("a", "b", "c", "bias", "residual", "ws", "counters")

    def __init__(self, launcher, plan, args: list, named: dict, device_index: int, first: int = 0):
        """`args`: the first call's kernel arguments, whose tensors from `first` on are `named`'s values."""
        self.launcher, self.plan, self.device_index = launcher, plan, device_index
        lead = first
        slots = []
        ids = {id(value): name for name, value in named.items() if value is not None}
        while lead < len(args) and isinstance(args[lead], torch.Tensor):
            slots.append(self._VALUES.index(ids[id(args[lead])]))
            lead += 1
        self.tail = tuple(args[lead:])
        # NOTE: an itemgetter picks the tensors in one C call (a dict and a comprehension per call showed in
        # the host time of decode GEMMs, which is their whole time in eager serving). A descriptor kernel may take
        # no pointer at all (the tma variant unsplit, with no epilogue tensor).
        if len(slots) > 1:
            self.pick = operator.itemgetter(*slots)
        elif slots:
            self.pick = lambda values, i=slots[0]: (values[i],)
        else:
            self.pick = lambda values: ()
        self.buffers = bool(plan.workspace or plan.counters)

    def __call__(self, a, b, c, bias, residual) -> None:
        """Launch on a, b, c, bias, residual: only their data pointers are read (b may be any tensor whose data
        pointer is the bound B operand's, e.g. an nn.Linear weight for its transpose)."""
        if self.buffers:
            values = (a, b, c, bias, residual, *split_buffers(a.device, self.plan.workspace, self.plan.counters))
        else:
            values = (a, b, c, bias, residual)
        self.launcher(*self.pick(values), *self.tail)


class BoundDescriptorGemm(BoundGemm):
    """BoundGemm for a kernel that takes host-built TMA descriptors of a, b and c (the gluon_ws and tma variants)
    before its pointers: a call encodes a descriptor only for a base address it has not seen, and otherwise passes
    the kept encoding (autotile.launch.KeptEncodings).
    """

    __slots__ = ("descriptors",)

    def __init__(self, launcher, encoders, plan, args: list, named: dict, device_index: int):
        super().__init__(launcher, plan, args, named, device_index, first=len(encoders))
        # (index of the descriptor's operand among a call's values, its kept encodings)
        self.descriptors = tuple((self._VALUES.index(source), KeptEncodings(encode))
                                 for source, encode in zip(plan.descriptor_sources, encoders))

    def __call__(self, a, b, c, bias, residual) -> None:
        if self.buffers:
            values = (a, b, c, bias, residual, *split_buffers(a.device, self.plan.workspace, self.plan.counters))
        else:
            values = (a, b, c, bias, residual)
        expanded = []
        for source, encoded in self.descriptors:
            expanded += encoded(values[source])
        self.launcher(*expanded, *self.pick(values), *self.tail)


def bind_gemm(family, problem, config, a, b, c, bias, residual):
    """Launch once and return a BoundGemm for later calls; None: not launched (the plan serves this call and
    every later one); False: launched through Triton's own path (the plan serves later calls)."""
    if problem.dtype == "fp8":
        return None
    return bind_plan(launch_plan(family, problem, config, a.device), a, b, c, bias, residual)


def bind_plan(plan: LaunchPlan, a, b, c, bias, residual):
    """bind_gemm of a plan of 16-bit (or fp32) operands."""
    present = [id(t) for t in (a, b, c, bias, residual) if t is not None]
    if plan.interpret or len(set(present)) < len(present):
        return None  # (one tensor in two places could not be told apart in later calls)
    named = {"a": a, "b": b, "c": c, "bias": bias, "residual": residual, "scale_a": None, "scale_b": None,
             "ws": workspace(a.device, plan.workspace) if plan.workspace else None,
             "counters": tile_counters(a.device, plan.counters) if plan.counters else None}
    args = plan.kernel_args(a, b, c, bias, residual, None, None, named["ws"], named["counters"], plan.stream_k,
                            plan.tiles)
    sources = plan.descriptor_sources
    try:
        if sources:
            bound = bind_descriptors(plan.kernel, plan.grid, *args, **plan.constexprs)
        else:
            bound = bind(plan.kernel, plan.grid, *args, **plan.constexprs)
    except BaseException:
        if plan.counters:
            forget_counters(a.device)  # a failed launch may have left them half counted
        raise
    if bound is None:
        return False  # launched already, through Triton's own path: keep using the plan
    if sources:
        launcher, encoders = bound
        return BoundDescriptorGemm(launcher, encoders, plan, args, named, a.device.index)
    return BoundGemm(bound, plan, args, named, a.device.index)
