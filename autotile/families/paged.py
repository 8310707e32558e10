"""Attention over a paged KV cache: decode (one or a few query tokens per sequence) and chunked prefill.

Decode is memory-bound: every step reads each sequence's whole K and V once and
does ~1 FLOP per byte. The kernels therefore work on all G = Hq / Hkv query
heads of one KV head in one program (each K/V page is read once, GQA and MQA
alike) and load BLOCK_N tokens of K and V per step with num_stages steps in
flight. Variants (templates/paged_attention.py.j2 describes them in full):

- 'whole': one program per (sequence, KV head);
- 'split': fixed partitions of PARTITION_SIZE tokens, a reduce kernel merges them;
- 'balanced': the kernel reads the lengths on the device and cuts contexts into
  chunks so that the launch fills the GPU for any mix of lengths (one 32k sequence
  or 256 short ones); a combine kernel merges the sequences it split. The grid
  depends on host integers only, so a CUDA graph captures it once per batch size;
- 'prefill': packed query blocks (cu_seqlens_q) on tensor cores, each token
  attending causally to its sequence's whole paged context.

`PagedLaunch` holds one problem's kernels and workspace; the runtime's plans
(autotile/runtime/paged_plan.py) keep one per decode step shape and only launch.

>>> from autotile.device import interpret_device
>>> p = PagedProblem(batch=2, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16, max_context=40)
>>> inputs = FAMILY.make_inputs(p, interpret_device())
>>> out = FAMILY.allocate_outputs(p, inputs)
>>> FAMILY.launch(p, FAMILY.default_config(p, interpret_device()), inputs, out)
>>> FAMILY.check(p, inputs, out, FAMILY.reference(p, inputs)).ok
True
"""
from __future__ import annotations

import collections
import functools
import math
import threading
from dataclasses import dataclass

import torch

from autotile.arch import device_default, device_seeds, require_dtypes
from autotile.device import DeviceInfo, current_device, interpret_device
from autotile.dtypes import element_size, torch_dtype
from autotile.errors import BadInputError, ShapeMismatchError, UnsupportedDtypeError
from autotile.families.base import Baseline, Cost, Family, ProblemOption, Tensors, Tolerance, is_vendor, next_pow2
from autotile.launch import launch as launch_kernel
from autotile.render import launching, load_kernel_module
from autotile.space import Axis, AxisKind, Config, Constraint, Space

QUERY_DTYPES = ("fp16", "bf16")
CACHE_DTYPES = ("fp16", "bf16", "fp8")
VARIANTS = ("whole", "split", "balanced", "prefill")
DECODE_VARIANTS = ("whole", "split", "balanced")
SPLITTING_VARIANTS = ("split", "balanced")
BLOCK_N_CHOICES = (16, 32, 64, 128, 256)
PARTITION_CHOICES = (256, 512, 1024, 2048, 4096)
WARP_CHOICES = (2, 4, 8)
# K elements a thread loads at least per step (one 16-byte vector of a 16-bit cache; the space's work_per_warp).
MIN_ELEMENTS_PER_THREAD = 8
# Query rows of a prefill program (tokens x the heads of a KV group); decode variants keep the first.
BLOCK_M_CHOICES = (16, 32, 64, 128)
# tl.dot needs every dimension >= 16; the query rows of a KV group are padded up to it.
MIN_ROWS = 16
# Decode programs hold G * Q query rows at once; more than this is a prefill-sized tile.
MAX_DECODE_ROWS = 64
# Query tokens per sequence from which the default is the prefill variant (tensor-core query blocks).
PREFILL_MIN_QUERIES = 16
# log2(e): the kernels keep logits in base 2 (templates/paged_attention.py.j2).
LOG2E = 1.4426950408889634
# Unit roundoff (half an ulp at 1.0) of the dtype the attention weights and the output are rounded to.
_UNIT_ROUNDOFF = {"fp16": 2.0**-11, "bf16": 2.0**-8}
# e4m3's largest finite value: per-head scales map each head's amax onto it.
FP8_MAX = 448.0
# Split-context workspace limit (fp32 elements): 2**28 is 1 GiB.
_WORKSPACE_LIMIT = 2**28
# Registers a thread may spend on one step's K and V tiles (16-bit halves packed two a register)
# before Triton spills; Hopper gives a thread at most 255.
_TILE_REGISTER_BUDGET = 128
# fp32 registers a thread may spend on the accumulator and the logits tile together (flash's
# widest default, BLOCK_M 64 x D 256 on 4 warps, takes 160).
_ACCUMULATOR_REGISTER_BUDGET = 160

# The balanced variant's scheduler (templates/paged_attention.py.j2, _chunk_schedule): a cost model in
# which an item (one chunk of one KV head) costs its tokens plus SPLIT_OVERHEAD_TOKENS (its query load,
# partial write and merge read, and a pipeline start); a split must beat no split by SPLIT_MARGIN_PCT -
# 100 percent (it costs a combine launch); chunk sizes are PARTITION_SIZE << 0..SPLIT_CANDIDATES - 2; the
# grid holds B + SPLIT_ITEMS_PER_SM * SMs / Hkv chunks. Two sweeps of 96 sets over six ragged mixes on the
# H200 (benchmarks/paged_sweep.py; results/paged_sweep_2026-12-01b_quick.md) put items 16, overhead 64 first
# (mean 81.6% of copy bandwidth at each mix's best tile at margin 100%, 81.1% at 110%, against 80.2% for the
# cost model's first guess, items 8, overhead 128); the 110% margin is kept, half a point (noise) below,
# because at 100% a batch of 64 sequences of 4k splits each into 4 where no split needs no combine pass.
SPLIT_CANDIDATES = 8
SPLIT_OVERHEAD_TOKENS = 64
SPLIT_MARGIN_PCT = 110
SPLIT_ITEMS_PER_SM = 16
# Pipeline depths the space offers. NOTE: from 3 stages on, the loops read each step's page ids one step
# ahead (PREFETCH_PAGES in templates/paged_attention.py.j2). When the K/V addresses come from a page-table
# load in the same step, Triton 3.6's pipeliner splits num_stages between the two loads: max(1,
# (num_stages - 1) // 2) K/V buffers (1 at 2-4 stages, 2 at 5-6), and a program waits on the page ids before
# each tile. With the ids carried from the step before, sm90 builds keep num_stages - 1 K/V tiles in flight.
# At 2 stages the in-step load measured faster (B=64 x 4k, whole variant: 0.26 ms against 0.34).
STAGE_CHOICES = (1, 2, 3, 4, 5)
PREFETCH_PAGES_FROM_STAGES = 3


def prefetches_pages(num_stages: int) -> bool:
    """Whether a config's loops read page ids a step ahead (the template's PREFETCH_PAGES)."""
    return num_stages >= PREFETCH_PAGES_FROM_STAGES


def decode_kv_buffers(num_stages: int) -> int:
    """K and V tiles a decode variant's loop keeps in flight at `num_stages` (Triton 3.6, see STAGE_CHOICES)."""
    return max(1, num_stages - 1)


# fp32 partial accumulators the combine kernel loads in one step for one query row (chunks x D_PAD): their
# loads are in flight together, 64 registers a thread at 4 warps. One 32k sequence is cut into 64 chunks:
# at D 128 they merge in one dependent step (at 32 chunks a step the combine took 5.1 us, 12% of the run).
COMBINE_STEP_ELEMENTS = 8192


def combine_parts_block(head_dim: int) -> int:
    """Chunks the combine kernel merges a step (a power of two) for a head dim."""
    return max(1, COMBINE_STEP_ELEMENTS // next_pow2(head_dim))


@dataclass(frozen=True)
class PagedProblem:
    """One step's shape. Context lengths enter as their max and mean (runtime calls bucket them).

    `num_queries` query tokens per sequence are the last positions of its context: 1 for decode,
    a few for speculative decoding, many for a chunk of prefill.
    """

    batch: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    max_context: int
    mean_context: int = 0  # 0: every sequence has max_context tokens
    num_queries: int = 1  # query tokens per sequence: 1 for decode, a few for speculative decoding
    dtype: str = "bf16"  # queries and output
    kv_dtype: str = "bf16"  # caches: the query dtype, or fp8 (e4m3 with per-KV-head scales)
    softcap: float = 0.0  # > 0: logits x -> softcap * tanh(x / softcap) (Gemma-2)
    window: int = -1  # >= 0: sliding window, a query at position p sees keys p - window .. p (Mistral, Gemma-2)

    def __post_init__(self):
        if self.mean_context == 0:
            object.__setattr__(self, "mean_context", self.max_context)
        if min(self.batch, self.num_q_heads, self.num_kv_heads, self.page_size, self.num_queries) < 1:
            raise ShapeMismatchError(f"paged attention sizes must be >= 1: {self}")
        if self.num_q_heads % self.num_kv_heads:
            raise ShapeMismatchError(
                f"{self.num_q_heads} query heads cannot share {self.num_kv_heads} KV heads evenly; "
                "Hq must be a multiple of Hkv")
        check_head_dim(self.head_dim)
        if self.page_size & (self.page_size - 1) or not 1 <= self.page_size <= 256:
            raise ShapeMismatchError(f"page_size must be a power of two up to 256, got {self.page_size}")
        if not self.num_queries <= self.mean_context <= self.max_context:
            raise ShapeMismatchError(
                f"need num_queries <= mean_context <= max_context, got {self.num_queries}, "
                f"{self.mean_context}, {self.max_context}: every query token is a position of its context")
        if self.dtype not in QUERY_DTYPES:
            raise UnsupportedDtypeError(f"queries must be one of {QUERY_DTYPES}, got {self.dtype}")
        if self.kv_dtype not in CACHE_DTYPES:
            raise UnsupportedDtypeError(f"caches must be one of {CACHE_DTYPES}, got {self.kv_dtype}")
        if isinstance(self.softcap, bool) or not isinstance(self.softcap, (int, float)) or not (
                math.isfinite(self.softcap) and self.softcap >= 0):
            raise BadInputError(f"softcap must be a finite number >= 0 (0: none), got {self.softcap!r}")
        object.__setattr__(self, "softcap", float(self.softcap))
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < -1:
            raise BadInputError(f"window must be an int >= 0 (keys a query sees left of itself) or -1 (none), "
                                f"got {self.window!r}")
        if self.kv_dtype != "fp8" and self.kv_dtype != self.dtype:
            raise UnsupportedDtypeError(
                f"a {self.kv_dtype} cache needs {self.kv_dtype} queries (got {self.dtype}); only fp8 caches mix dtypes")

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    def span(self, context: int) -> int:
        """Keys the queries of a sequence of `context` tokens see (window_span)."""
        return window_span(context, self.num_queries, self.window)

    @property
    def rows(self) -> int:
        """Query rows one decode program holds: the G heads of a KV group times the query tokens, padded."""
        return max(MIN_ROWS, next_pow2(self.group * self.num_queries))

    @property
    def head_dim_pad(self) -> int:
        """The tile width along D: the next power of two (80, 96, 112 -> 128); loads and stores are masked."""
        return next_pow2(self.head_dim)


# Fields added after databases were shipped, off (the family's later_fields): plain problems keep their keys.
FEATURE_DEFAULTS = {"softcap": 0.0, "window": -1}


def feature_args(problem: PagedProblem) -> tuple:
    """The kernels' runtime feature arguments, in their order (templates/paged_attention.py.j2, feature_params):
    soft-capping in base 2, then the window; none for a plain problem, whose kernels take none."""
    return (((problem.softcap * LOG2E,) if problem.softcap > 0 else ())
            + ((problem.window,) if problem.window >= 0 else ()))


def window_span(context: int, num_queries: int, window: int) -> int:
    """Keys the num_queries last positions of a context see: all of it, or (window >= 0) its last
    num_queries + window (the span the kernels walk and the balanced scheduler cuts)."""
    return context if window < 0 else min(context, num_queries + window)


def check_head_dim(head_dim: int) -> None:
    """Head dims the kernels take: multiples of 8 (16-byte rows) from 16 to 256."""
    if head_dim % 8 or not 16 <= head_dim <= 256:
        raise ShapeMismatchError(
            f"head_dim must be a multiple of 8 from 16 to 256 (64, 80, 96, 112, 128, 256, ...), got {head_dim}")


def min_block_n(head_dim_pad: int) -> int:
    """The smallest token tile that gives every thread of the fewest warps its vector of K (work_per_warp): 16
    tokens from D 32 on, 32 at D 16. Short contexts take it too, so that some config is always feasible.

    >>> min_block_n(16), min_block_n(32), min_block_n(256)
    (32, 16, 16)
    """
    least = MIN_ELEMENTS_PER_THREAD * 32 * WARP_CHOICES[0]
    return next(n for n in BLOCK_N_CHOICES if n * head_dim_pad >= least)


def context_bucket(tokens: int) -> int:
    """Context lengths a runtime call is filed under: the next power of two (at least 16)."""
    return next_pow2(max(16, int(tokens)))


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class SplitConstants:
    """The balanced scheduler's constants for one launch; the defaults are the module's SPLIT_* values.

    items_per_sm sizes the grid (SPLIT_ITEMS_PER_SM), overhead_tokens and margin_pct are the cost
    model's (SPLIT_OVERHEAD_TOKENS, SPLIT_MARGIN_PCT), candidates the chunk sizes it weighs
    (SPLIT_CANDIDATES, a power of two: the kernel holds them in one tl.arange). Overrides exist to
    measure other values (benchmarks/paged_sweep.py); a launch compiles once per distinct set.

    >>> SplitConstants() == SplitConstants.of(None) == SplitConstants.of({})
    True
    >>> SplitConstants.of({"items_per_sm": 16}).kernel_constants()["SPLIT_OVERHEAD"] == SPLIT_OVERHEAD_TOKENS
    True
    """

    items_per_sm: int = SPLIT_ITEMS_PER_SM
    overhead_tokens: int = SPLIT_OVERHEAD_TOKENS
    margin_pct: int = SPLIT_MARGIN_PCT
    candidates: int = SPLIT_CANDIDATES

    def __post_init__(self):
        # (lowest, highest, why): the kernel's integer arithmetic stays within int32 shifts and int64 costs.
        limits = {"items_per_sm": (1, 1024, "programs per SM the grid may hold"),
                  "overhead_tokens": (0, 1 << 20, "tokens' worth of cost an item adds"),
                  "margin_pct": (100, 1000, "percent a split must beat no split by (100: any gain)"),
                  "candidates": (2, 16, "chunk sizes weighed, a power of two")}
        for name, (low, high, meaning) in limits.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise BadInputError(f"split constant {name} ({meaning}) must be an integer from {low} to {high}, "
                                    f"got {value!r}")
        if self.candidates & (self.candidates - 1):
            raise BadInputError(f"split constant candidates must be a power of two (2, 4, 8, 16), got {self.candidates}")

    @classmethod
    def of(cls, value) -> "SplitConstants":
        """None (the module's constants), a SplitConstants, or a dict of some of its fields."""
        if value is None:
            return _DEFAULT_SPLIT  # built once: paged_launch asks on every launch of the tuner's timing loop
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = sorted(set(value) - set(cls.__dataclass_fields__))
            if unknown:
                raise BadInputError(f"unknown split constants {unknown}; the fields are "
                                    f"{sorted(cls.__dataclass_fields__)}")
            return cls(**value)
        raise BadInputError(f"split_constants must be None, a SplitConstants or a dict, got {type(value).__name__}")

    def kernel_constants(self) -> dict:
        """The balanced kernel's tl.constexpr arguments."""
        return dict(SPLIT_CANDIDATES=self.candidates, SPLIT_OVERHEAD=self.overhead_tokens,
                    SPLIT_MARGIN_PCT=self.margin_pct)


_DEFAULT_SPLIT = SplitConstants()


def shared_memory_bytes(problem: "PagedProblem", config) -> int:
    """Shared memory one program of `config` needs (what the space's shared_memory constraint checks)."""
    p, c = problem, config
    dim = p.head_dim_pad
    tile_size = max(element_size(p.kv_dtype), element_size(p.dtype))  # fp8 tiles are widened before the dots
    if c["VARIANT"] == "prefill":
        # num_stages K and V tiles (an upper bound: Triton keeps fewer), the weights tile handed to the
        # second dot and the query block.
        kv = 2 * c["BLOCK_N"] * dim * tile_size * c["num_stages"]
        return kv + c["BLOCK_M"] * c["BLOCK_N"] * 2 + c["BLOCK_M"] * dim * 2
    # What Triton allocates for a decode loop: its K and V buffers (decode_kv_buffers), the weights tile
    # and the query tile (the page ids stay in registers); equal to sm90 builds (tests/test_paged_compile.py).
    buffers = decode_kv_buffers(c["num_stages"])
    return buffers * 2 * c["BLOCK_N"] * dim * tile_size + p.rows * c["BLOCK_N"] * 2 + p.rows * dim * 2


def balanced_max_chunks(batch: int, num_kv_heads: int, num_sms: int, split_constants=None) -> int:
    """The balanced variant's grid: the most chunks its scheduler may cut a batch into."""
    return batch + cdiv(SplitConstants.of(split_constants).items_per_sm * num_sms, num_kv_heads)


def balanced_schedule(context_lens: list[int], num_kv_heads: int, num_sms: int, partition_size: int,
                      split_constants=None, *, window: int = -1, num_queries: int = 1) -> list[int]:
    """The chunk count of each sequence that the balanced kernels choose for these lengths.

    The same integer arithmetic as `_chunk_schedule` in the template, for tests and benchmark
    reports (the kernels compute it on the device; nothing calls this on the hot path).
    `split_constants` as for PagedLaunch (None: the module's constants). With a `window`, the kernels weigh and cut
    only the keys it leaves: the last num_queries + window of each context.
    >>> balanced_schedule([32768], num_kv_heads=8, num_sms=132, partition_size=256)
    [64]
    >>> balanced_schedule([4096] * 64, num_kv_heads=8, num_sms=132, partition_size=256) == [1] * 64
    True
    """
    split = SplitConstants.of(split_constants)
    context_lens = [window_span(n, num_queries, window) for n in context_lens]
    max_chunks = balanced_max_chunks(len(context_lens), num_kv_heads, num_sms, split)
    total, longest = sum(context_lens), max(max(context_lens, default=0), 1)
    best_cost, best_size = None, longest
    for index in range(split.candidates):
        size = longest if index == 0 else partition_size << (split.candidates - 1 - index)
        chunks = sum(max(cdiv(n, size), 1) for n in context_lens)
        work = 2 * num_kv_heads * (total + split.overhead_tokens * chunks) + num_sms * (
            min(size, longest) + split.overhead_tokens)
        cost = work * (100 if index == 0 else split.margin_pct)
        if chunks <= max_chunks and (best_cost is None or cost < best_cost):
            best_cost, best_size = cost, size
    return [max(cdiv(n, best_size), 1) for n in context_lens]


def balanced_tile(problem: "PagedProblem", sm_count: int) -> dict:
    """The balanced variant's tile where nothing was tuned for the call: BLOCK_N, warps and stages.

    Measured on the H200 over six ragged decode mixes (benchmarks/paged_sweep.py; results/
    paged_sweep_2026-12-01b_quick.md, paged_sweep_2026-12-01e_quick.md): 4 warps led on every mix (2 warps
    reached 45-76% of copy bandwidth where 4 reached 59-93%). With the page ids read a step ahead (3 stages
    and more), 3 stages (two K/V tiles in flight) led: 64-token tiles where (sequence, KV head) items
    outnumber the SMs and D <= 128 (82-92%); 32-token tiles for few items (one 32k sequence: 60%, against 58%
    at 2 stages) and at D = 256 (16 sequences of 1k-32k at Gemma-2 heads: 97%, against 96% for 64-token
    tiles at 2 stages).
    """
    many = problem.batch * problem.num_kv_heads >= sm_count
    if many and problem.head_dim_pad <= 128:
        return dict(BLOCK_N=64, num_warps=4, num_stages=3)
    return dict(BLOCK_N=32, num_warps=4, num_stages=3)


def _with_block_m(config):
    """NOTE: configs written before BLOCK_M was an axis (shipped and user winners, exported kernels, scripts) lack
    it; all of them are decode variants, whose BLOCK_M is fixed at the first choice, so it is filled in (the space's
    upgrade) rather than the config refused."""
    if "BLOCK_M" in config or is_vendor(config):
        return config
    return {**dict(config), "BLOCK_M": BLOCK_M_CHOICES[0]}


_SEED_CONFIGS = (
    dict(VARIANT="whole", BLOCK_N=64, PARTITION_SIZE=256, BLOCK_M=16, num_warps=4, num_stages=3),
    dict(VARIANT="whole", BLOCK_N=128, PARTITION_SIZE=256, BLOCK_M=16, num_warps=8, num_stages=3),
    dict(VARIANT="whole", BLOCK_N=32, PARTITION_SIZE=256, BLOCK_M=16, num_warps=4, num_stages=4),
    dict(VARIANT="balanced", BLOCK_N=64, PARTITION_SIZE=256, BLOCK_M=16, num_warps=4, num_stages=3),
    dict(VARIANT="balanced", BLOCK_N=64, PARTITION_SIZE=512, BLOCK_M=16, num_warps=4, num_stages=2),
    dict(VARIANT="split", BLOCK_N=64, PARTITION_SIZE=1024, BLOCK_M=16, num_warps=4, num_stages=3),
    dict(VARIANT="split", BLOCK_N=128, PARTITION_SIZE=2048, BLOCK_M=16, num_warps=8, num_stages=3),
    dict(VARIANT="prefill", BLOCK_N=64, PARTITION_SIZE=256, BLOCK_M=128, num_warps=8, num_stages=3),
    dict(VARIANT="prefill", BLOCK_N=64, PARTITION_SIZE=256, BLOCK_M=64, num_warps=4, num_stages=3),
    dict(VARIANT="prefill", BLOCK_N=32, PARTITION_SIZE=256, BLOCK_M=64, num_warps=4, num_stages=2),
)


class PagedFamily(Family):
    name = "paged"
    template = "paged_attention.py.j2"
    problem_type = PagedProblem
    shape_fields = ("batch", "max_context", "mean_context")
    later_fields = FEATURE_DEFAULTS

    cli_options = (
        ProblemOption("batch", int, "sequences per step", multiple=True),
        ProblemOption("context", int, "tokens of context per sequence (the max when --mean-context is given)", multiple=True),
        ProblemOption("mean_context", int, "mean context length of a ragged batch (default: all equal)"),
        ProblemOption("q_heads", int, "query heads", default=32),
        ProblemOption("kv_heads", int, "KV heads (GQA/MQA when fewer than query heads)", default=8),
        ProblemOption("head_dim", int, "head dimension (a multiple of 8 up to 256)", default=128),
        ProblemOption("page_size", int, "tokens per cache page", default=16),
        ProblemOption("num_queries", int, "query tokens per sequence (speculative decoding when a few, "
                      "chunked prefill when many)", default=1),
        ProblemOption("dtype", str, "query dtype", default="bf16", choices=QUERY_DTYPES),
        ProblemOption("kv_dtype", str, "cache dtype (default: the query dtype)", choices=CACHE_DTYPES),
        ProblemOption("softcap", float, "logit soft-capping, softcap * tanh(x / softcap) (Gemma-2: 50; 0: none)",
                      default=0.0),
        ProblemOption("window", int, "sliding window: keys a query sees left of itself (-1: none)", default=-1),
    )

    # --- problems -----------------------------------------------------------------
    def default_suite(self) -> list[PagedProblem]:
        """The decode rows of shared/anchors: bf16, D=128, pages of 16."""
        return [PagedProblem(b, hq, 8, 128, 16, ctx) for b, hq, ctx in
                ((64, 32, 4096), (16, 32, 16384), (256, 32, 1024), (8, 64, 32768))]

    def problems_from_cli(self, *, batch=(), context=(), mean_context=None, q_heads=32, kv_heads=8, head_dim=128,
                          page_size=16, num_queries=1, dtype="bf16", kv_dtype=None, softcap=0.0, window=-1,
                          **_unused) -> list[PagedProblem]:
        batches = [batch] if isinstance(batch, int) else list(batch or ())
        contexts = [context] if isinstance(context, int) else list(context or ())
        if not batches and not contexts:
            return self.default_suite()
        if not batches or not contexts:
            raise BadInputError("give both --batch and --context (or neither, for the default suite)")
        # A --mean-context above a --context is refused by the problem (it was clamped: another problem, silently).
        return [PagedProblem(b, q_heads, kv_heads, head_dim, page_size, ctx, mean_context or ctx,
                             num_queries, dtype, kv_dtype or dtype, softcap or 0.0, -1 if window is None else window)
                for b in batches for ctx in contexts]

    # --- the search -----------------------------------------------------------------
    def space(self, problem: PagedProblem, device: DeviceInfo) -> Space:
        p = problem
        require_dtypes(device, [p.dtype, p.kv_dtype], f"paged attention over a {p.kv_dtype} cache")
        dim = p.head_dim_pad
        partitions = lambda c: cdiv(p.max_context, c["PARTITION_SIZE"])  # noqa: E731
        prefill = lambda c: c["VARIANT"] == "prefill"  # noqa: E731
        query_rows = lambda c: c["BLOCK_M"] if prefill(c) else p.rows  # noqa: E731

        smem_bytes = lambda c: shared_memory_bytes(p, c)  # noqa: E731

        def accumulator_registers(c) -> float:
            return query_rows(c) * (dim + c["BLOCK_N"]) / (32 * c["num_warps"])

        def workspace(c) -> int:
            return p.batch * p.num_kv_heads * partitions(c) * p.rows * (p.head_dim + 2)

        axes = [
            Axis("VARIANT", VARIANTS, AxisKind.RENDER),
            Axis("BLOCK_N", BLOCK_N_CHOICES),
            Axis("PARTITION_SIZE", PARTITION_CHOICES),
            Axis("BLOCK_M", BLOCK_M_CHOICES),
            Axis("num_warps", WARP_CHOICES),
            Axis("num_stages", STAGE_CHOICES),
        ]
        splitting = lambda c: c["VARIANT"] in SPLITTING_VARIANTS  # noqa: E731
        constraints = [
            Constraint("shared_memory", lambda c: smem_bytes(c) <= device.smem_per_block,
                       lambda c: f"needs {smem_bytes(c)} B of shared memory, the device allows {device.smem_per_block} B"),
            Constraint("tile_registers",
                       lambda c: c["BLOCK_N"] * dim <= _TILE_REGISTER_BUDGET * 32 * c["num_warps"],
                       f"the K and V tiles would need more than {_TILE_REGISTER_BUDGET} registers a thread"),
            Constraint("accumulator_registers",
                       lambda c: accumulator_registers(c) <= _ACCUMULATOR_REGISTER_BUDGET,
                       f"the accumulator and logits would need more than {_ACCUMULATOR_REGISTER_BUDGET} "
                       "fp32 registers a thread"),
            Constraint("work_per_warp",
                       lambda c: c["BLOCK_N"] * dim >= MIN_ELEMENTS_PER_THREAD * 32 * c["num_warps"],
                       "a tile must give every thread at least one 16-byte vector of K"),
            # Loads past the context are masked: a short context at D 16 takes the 32-token tile work_per_warp needs.
            Constraint("tile_within_context",
                       lambda c: c["BLOCK_N"] <= max(min_block_n(dim), next_pow2(p.max_context)),
                       "a token tile longer than the next power of two of the context (or than the smallest tile "
                       "that gives every thread work) only loads padding"),
            Constraint("partition_split_only",
                       lambda c: splitting(c) or c["PARTITION_SIZE"] == PARTITION_CHOICES[0],
                       "PARTITION_SIZE only shapes the split and balanced variants; the others keep the first choice"),
            Constraint("partition_holds_tiles", lambda c: not splitting(c) or c["PARTITION_SIZE"] >= c["BLOCK_N"],
                       "a partition must hold whole token tiles"),
            Constraint("split_has_partitions", lambda c: not splitting(c) or partitions(c) >= 2,
                       "splitting needs at least two partitions of the longest context"),
            Constraint("split_workspace", lambda c: c["VARIANT"] != "split" or workspace(c) <= _WORKSPACE_LIMIT,
                       "the split workspace would exceed 1 GiB"),
            Constraint("block_m_prefill_only", lambda c: prefill(c) or c["BLOCK_M"] == BLOCK_M_CHOICES[0],
                       "BLOCK_M only shapes the prefill variant; decode variants keep the first choice"),
            Constraint("decode_rows", lambda c: prefill(c) or p.rows <= MAX_DECODE_ROWS,
                       f"decode programs hold G x Q = {p.group * p.num_queries} query rows, more than "
                       f"{MAX_DECODE_ROWS}: use the prefill variant"),
            Constraint("prefill_has_queries", lambda c: not prefill(c) or p.num_queries >= 2 or p.rows > MAX_DECODE_ROWS,
                       "the prefill variant is for several query tokens per sequence (or a KV group of more query "
                       f"heads than a decode program holds, {MAX_DECODE_ROWS})"),
            Constraint("block_holds_group", lambda c: not prefill(c) or c["BLOCK_M"] >= p.group,
                       "a prefill block must hold at least one token's group of query heads"),
            Constraint("block_within_queries",
                       lambda c: not prefill(c) or c["BLOCK_M"] // p.group <= max(MIN_ROWS // p.group,
                                                                                   next_pow2(p.num_queries)),
                       "a prefill block longer than the query tokens (beyond the smallest tile) only computes padding"),
        ]
        return Space(axes, constraints, upgrade=_with_block_m)

    def seed_configs(self, problem: PagedProblem, device: DeviceInfo) -> list[Config]:
        """Shapes fast decode kernels use on Hopper, tried right after the default: wide token tiles,
        a few stages in flight, split contexts for few long sequences, and flash-like prefill blocks."""
        return device_seeds(self, problem, device, _SEED_CONFIGS)

    def default_config(self, problem: PagedProblem, device: DeviceInfo) -> Config:
        p = problem
        if p.num_queries >= PREFILL_MIN_QUERIES or p.rows > MAX_DECODE_ROWS:
            return self.prefill_config(problem, device)
        preferred = dict(VARIANT="whole", BLOCK_N=64 if p.head_dim_pad <= 128 else 32,
                         PARTITION_SIZE=PARTITION_CHOICES[0], BLOCK_M=BLOCK_M_CHOICES[0], num_warps=4, num_stages=3)
        if p.batch * p.num_kv_heads < 4 * device.sm_count and p.max_context >= 2 * PARTITION_CHOICES[0]:
            # Too few (sequence, KV head) pairs to be sure of filling the device whatever the lengths:
            # the balanced kernel splits long contexts when (and only when) its cost model says so.
            preferred.update(VARIANT="balanced", **balanced_tile(p, device.sm_count))
        return device_default(self, problem, device, preferred)

    def prefill_config(self, problem: PagedProblem, device: DeviceInfo) -> Config:
        """The default prefill-variant config: flash's forward defaults (BLOCK_M 128 x BLOCK_N 64, 8 warps,
        3 stages at D <= 128; 64 x 64, 4 warps, 2 stages at D 256), adapted by first_feasible."""
        dim = problem.head_dim_pad
        preferred = dict(VARIANT="prefill", BLOCK_N=64, PARTITION_SIZE=PARTITION_CHOICES[0],
                         BLOCK_M=64 if dim >= 256 else 128, num_warps=4 if dim >= 256 or dim <= 64 else 8,
                         num_stages=2 if dim >= 256 else 3)
        return device_default(self, problem, device, preferred)

    # --- data -----------------------------------------------------------------------
    def context_lengths(self, problem: PagedProblem, gen: torch.Generator) -> list[int]:
        """Ragged lengths with the problem's max and (about) its mean; the first sequence is the longest."""
        p = problem
        if p.mean_context == p.max_context:
            return [p.max_context] * p.batch
        low = 2 * p.mean_context - p.max_context
        high = p.max_context
        if low < p.num_queries:  # a mean far below the max: spread the others around it
            low, high = p.num_queries, 2 * p.mean_context - p.num_queries
        others = torch.randint(low, high + 1, (p.batch - 1,), generator=gen).tolist()
        return [p.max_context] + others

    def make_inputs(self, problem: PagedProblem, device: DeviceInfo, seed: int = 0) -> Tensors:
        """Shuffled pages: each sequence's pages are scattered through a pool that also holds pages no
        sequence of this batch owns, and block-table entries past a sequence's end point at such pages."""
        p = problem
        gen = torch.Generator(device="cpu").manual_seed(seed)
        dev = device.torch_device
        # Values are drawn where they live: a long-context pool holds hundreds of millions of them.
        values_gen = torch.Generator(device=dev).manual_seed(seed)
        lengths = self.context_lengths(p, gen)
        owned = [cdiv(n, p.page_size) for n in lengths]
        table_width = cdiv(p.max_context, p.page_size)
        num_pages = sum(owned) + max(p.batch, sum(owned) // 4)
        order = torch.randperm(num_pages, generator=gen)
        block_table = torch.randint(0, num_pages, (p.batch, table_width), generator=gen, dtype=torch.int32)
        taken = 0
        for b, n in enumerate(owned):
            block_table[b, :n] = order[taken:taken + n].to(torch.int32)
            taken += n
        inputs: Tensors = {
            "q": torch.randn(p.batch, p.num_queries, p.num_q_heads, p.head_dim, generator=values_gen,
                             device=dev).to(torch_dtype(p.dtype)),
            "block_table": block_table.to(dev),
            "context_lens": torch.tensor(lengths, dtype=torch.int32).to(dev),
            "scale": torch.tensor(1.0 / math.sqrt(p.head_dim), dtype=torch.float64),
        }
        for name in ("k", "v"):
            values = torch.randn(num_pages, p.page_size, p.num_kv_heads, p.head_dim, generator=values_gen, device=dev)
            if p.kv_dtype == "fp8":
                # Per-KV-head scales as fp8 serving stacks calibrate them: each head's amax maps to e4m3's max.
                scale = values.abs().amax(dim=(0, 1, 3)) / FP8_MAX  # (Hkv,)
                values = values / scale[None, None, :, None]
                inputs[f"{name}_scale"] = scale.float()
            inputs[f"{name}_cache"] = values.to(torch_dtype(p.kv_dtype))
            del values
        return inputs

    def allocate_outputs(self, problem: PagedProblem, inputs: Tensors) -> Tensors:
        return {"out": torch.empty_like(inputs["q"])}

    def reference(self, problem: PagedProblem, inputs: Tensors) -> Tensors:
        return {"out": dense_reference(problem, inputs)}

    def tolerance(self, problem: PagedProblem) -> Tolerance:
        # The reference uses the same (already rounded) q, K and V in float32, so what is left is
        # (1) the attention weights rounded to the query dtype before the P @ V dot: relative error
        #     <= u on each weight (the largest, exactly 1, rounds exactly), so the output moves by at
        #     most u times the weighted mean of |v| over the context. make_inputs draws V (dequantised,
        #     for fp8) from N(0, 1), whose mean |v| is 0.8 and a weighted mean of which stays below 2
        #     even over a handful of tokens -- atol = 2u;
        # (2) the output rounded to its dtype: u relative, plus the fp32 softmax (~1e-6) -- rtol 2u.
        # Logits are fp32 dots of exact products; fp8 dequantisation (e4m3 -> 16-bit) is exact.
        u = _UNIT_ROUNDOFF[problem.dtype]
        return Tolerance(atol=2.0 * u, rtol=2.0 * u)

    def cost(self, problem: PagedProblem) -> Cost:
        p = problem
        span = p.span(p.mean_context)
        tokens = p.batch * span
        kv_bytes = 2 * tokens * p.num_kv_heads * p.head_dim * element_size(p.kv_dtype)
        q_bytes = 2 * p.batch * p.num_queries * p.num_q_heads * p.head_dim * element_size(p.dtype)  # q in, out
        table_bytes = 4 * (p.batch * cdiv(span, p.page_size) + p.batch)
        return Cost(flops=4.0 * tokens * p.num_q_heads * p.num_queries * p.head_dim,
                    bytes=float(kv_bytes + q_bytes + table_bytes))


    def baseline(self, problem: PagedProblem, inputs: Tensors) -> Baseline | None:
        if problem.softcap > 0:
            return None  # SDPA has no soft-capping
        return Baseline("gather + SDPA", gather_sdpa(problem, inputs))

    # --- running --------------------------------------------------------------------
    def render_switches(self, problem: PagedProblem, config: Config) -> dict:
        return dict(VARIANT=config["VARIANT"], FP8_SCALES=problem.kv_dtype == "fp8", UPCAST_DOTS=False, WRITE_LSE=False,
                    PREFETCH_PAGES=prefetches_pages(config["num_stages"]), SOFTCAP=problem.softcap > 0,
                    WINDOW=problem.window >= 0)

    def launch(self, problem: PagedProblem, config: Config, inputs: Tensors, outputs: Tensors) -> None:
        q, out = inputs["q"], outputs["out"]
        paged_launch(problem, config, q.device).decode_or_prefill(
            q, inputs["k_cache"], inputs["v_cache"], inputs["block_table"], inputs["context_lens"], out,
            scale=float(inputs["scale"]), k_scale=inputs.get("k_scale"), v_scale=inputs.get("v_scale"))


@functools.lru_cache(maxsize=None)
def _kernel_module(template: str, interpret: bool, switches: tuple):
    """Rendered and imported once per structure: decode steps are short, re-rendering is not free."""
    return load_kernel_module(template, interpret=interpret, **dict(switches))


@functools.lru_cache(maxsize=None)
def device_sm_count(device: torch.device) -> int:
    """Streaming multiprocessors the balanced scheduler fills (the interpreter: the CPU count)."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.get_device_properties(index).multi_processor_count
    return interpret_device().sm_count


class PagedLaunch:
    """One problem's kernels, launch constants and workspace, ready to launch.

    Built on the host from the problem, the config and the device alone (no tensor value is read);
    calling it launches kernels and nothing else: no allocation, no copy, no synchronisation, so a
    CUDA graph can capture it. Its workspace serves one launch at a time (one stream).
    `num_sms` is what the balanced variant fills (the device's SM count by default), `split_constants`
    its scheduler's constants (a SplitConstants or a dict of its fields; None: the module's).
    """

    def __init__(self, problem: PagedProblem, config: Config, device: torch.device, *,
                 return_lse: bool = False, num_sms: int | None = None, split_constants=None):
        p = problem
        self.problem, self.config, self.return_lse = p, config, return_lse
        self.variant = config["VARIANT"]
        self.device = torch.device(device)
        self.interpret = self.device.type == "cpu"
        # Meta tensors (autotile.xcompile, compile-ahead) stand for a GPU: its SMs and architecture decide the launch
        # constants, so the kernels compiled for them are the ones that GPU's launch asks for.
        stand_in = current_device(self.device) if self.device.type == "meta" else None
        if num_sms is None:
            num_sms = stand_in.sm_count if stand_in is not None else device_sm_count(self.device)
        self.num_sms = int(num_sms)
        switches = dict(FAMILY.render_switches(p, config), WRITE_LSE=return_lse,
                        # NOTE: Triton 3.6's interpreter computes bf16 tl.dot wrongly; CPU runs upcast the dot operands.
                        UPCAST_DOTS=self.interpret and "bf16" in (p.dtype, p.kv_dtype))
        self.module = _kernel_module(FAMILY.template, self.interpret, tuple(sorted(switches.items())))
        self.options = dict(BLOCK_N=config["BLOCK_N"], num_warps=config["num_warps"], num_stages=config["num_stages"])
        self.batch_pad = next_pow2(p.batch)
        self.partitions = cdiv(p.max_context, config["PARTITION_SIZE"]) if self.variant == "split" else 1
        self.split_constants = SplitConstants.of(split_constants)
        self.max_chunks = balanced_max_chunks(p.batch, p.num_kv_heads, self.num_sms, self.split_constants)
        slots = {"split": p.batch * p.num_kv_heads * self.partitions,
                 "balanced": self.max_chunks * p.num_kv_heads}.get(self.variant, 0)
        self.workspace = None
        if slots:
            # (slots, ROWS[, HEAD_DIM]) fp32 maxima, sums and accumulators of partial results.
            cut = slots * p.rows
            self.workspace = torch.empty(cut * (p.head_dim + 2), dtype=torch.float32, device=self.device)
            self._ws = (self.workspace[2 * cut:], self.workspace[:cut], self.workspace[cut:2 * cut])
        # The balanced kernel's choice for the combine kernel (log2 of the chunk size, -1: nothing split).
        self.schedule = torch.zeros(1, dtype=torch.int32, device=self.device) if self.variant == "balanced" else None
        # Programmatic dependent launch of the combine kernel (sm90+; griddepcontrol): its launch and prologue
        # overlap the balanced kernel's last programs instead of following them.
        capability = (stand_in.compute_capability if stand_in is not None
                      else torch.cuda.get_device_capability(self.device) if self.device.type == "cuda" else (0, 0))
        self.pdl = not self.interpret and capability >= (9, 0)
        self._combine_options = dict(PARTS_BLOCK=combine_parts_block(p.head_dim), PDL=self.pdl, num_warps=4,
                                     **({"launch_pdl": True} if self.pdl else {}))
        # Decode-shaped calls of the prefill variant (Q tokens a sequence) pack their queries by these offsets.
        self._uniform_cu_seqlens = None
        if self.variant == "prefill":
            self._uniform_cu_seqlens = torch.arange(0, (p.batch + 1) * p.num_queries, p.num_queries,
                                                    dtype=torch.int32, device=self.device)
        self._schedule_constants = self.split_constants.kernel_constants()
        self._window = (p.window,) if p.window >= 0 else ()  # the combine kernel's one feature argument
        self._features = feature_args(p)
        if p.window >= 0:
            self._combine_options["NUM_QUERIES"] = p.num_queries

    @property
    def workspace_bytes(self) -> int:
        return 0 if self.workspace is None else self.workspace.numel() * 4

    def decode_or_prefill(self, q4, k_cache, v_cache, block_table, context_lens, out4, *, scale: float,
                          k_scale=None, v_scale=None, lse=None) -> None:
        """The family's uniform form: q4/out4 (B, Q, Hq, D), lse (B, Q, Hq); prefill sees them packed."""
        if self.variant != "prefill":
            self.decode(q4, k_cache, v_cache, block_table, context_lens, out4, scale=scale, k_scale=k_scale,
                        v_scale=v_scale, lse=lse)
            return
        rows = self.problem.batch * self.problem.num_queries
        out_rows = _packed_rows(out4, rows)
        lse_rows = None if lse is None else _packed_rows(lse, rows)
        # An output whose (B, Q) axes do not merge into one strided axis (a transposed buffer) is written
        # packed first and copied in after: the kernel would otherwise write into a copy nobody reads.
        out_packed = out4.new_empty((rows, *out4.shape[2:])) if out_rows is None else out_rows
        lse_packed = lse.new_empty((rows, *lse.shape[2:])) if lse is not None and lse_rows is None else lse_rows
        self.prefill(q4.reshape(rows, *q4.shape[2:]), k_cache, v_cache, block_table, self._uniform_cu_seqlens,
                     context_lens, out_packed, scale=scale, k_scale=k_scale, v_scale=v_scale, lse=lse_packed)
        if out_rows is None:
            out4.copy_(out_packed.view(out4.shape))
        if lse is not None and lse_rows is None:
            lse.copy_(lse_packed.view(lse.shape))

    def _common(self, q, out, k_cache, v_cache, k_scale, v_scale, lse) -> tuple:
        k_scale = out if k_scale is None else k_scale  # unused pointers still need a tensor
        v_scale = out if v_scale is None else v_scale
        lse_args = ()
        if self.return_lse:
            strides = lse.stride()
            lse_args = (lse, strides[0], strides[1], strides[2] if lse.dim() > 2 else 1)
        caches = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                  v_cache.stride(0), v_cache.stride(1), v_cache.stride(2))
        return k_scale, v_scale, lse_args, caches

    def decode(self, q, k_cache, v_cache, block_table, context_lens, out, *, scale: float,
               k_scale=None, v_scale=None, lse=None) -> None:
        """q, out (B, Q, Hq, D); lse (B, Q, Hq) fp32 when built with return_lse."""
        p, variant, module = self.problem, self.variant, self.module
        k_scale, v_scale, lse_args, caches = self._common(q, out, k_cache, v_cache, k_scale, v_scale, lse)
        ws_acc, ws_max, ws_sum = self._ws if self.workspace is not None else (out, out, out)
        shape = dict(PAGE_SIZE=p.page_size, HEAD_DIM=p.head_dim, GROUP=p.group, NUM_QUERIES=p.num_queries, ROWS=p.rows)
        q_strides = (q.stride(0), q.stride(1), q.stride(2))
        o_strides = (out.stride(0), out.stride(1), out.stride(2))
        size = self.config["PARTITION_SIZE"]
        with launching(self.interpret):
            if variant in ("whole", "split"):
                launch_kernel(
                    module.paged_attention_kernel, (p.num_kv_heads, p.batch, self.partitions),
                    q, k_cache, v_cache, out, block_table, context_lens, k_scale, v_scale, ws_acc, ws_max, ws_sum,
                    *lse_args, scale, *self._features, self.partitions, *q_strides, *o_strides, *caches,
                    block_table.stride(0),
                    **shape, PARTITION_SIZE=size, **self.options)
                if variant == "split":
                    launch_kernel(
                        module.paged_attention_reduce, (p.num_kv_heads, p.batch),
                        out, context_lens, ws_acc, ws_max, ws_sum, *lse_args, self.partitions, *o_strides,
                        HEAD_DIM=p.head_dim, GROUP=p.group, NUM_QUERIES=p.num_queries, ROWS=p.rows,
                        PARTITION_SIZE=size, num_warps=4)
                return
            launch_kernel(
                module.paged_attention_balanced, (self.max_chunks, p.num_kv_heads),
                q, k_cache, v_cache, out, block_table, context_lens, k_scale, v_scale, ws_acc, ws_max, ws_sum,
                self.schedule, *lse_args, scale, *self._features, p.batch, self.num_sms, self.max_chunks,
                *q_strides, *o_strides, *caches, block_table.stride(0), **shape, PARTITION_SIZE=size,
                BATCH_PAD=self.batch_pad, PDL=self.pdl, **self._schedule_constants, **self.options)
            launch_kernel(
                module.paged_attention_combine, (p.batch, p.num_kv_heads, p.group * p.num_queries),
                out, context_lens, ws_acc, ws_max, ws_sum, self.schedule, *lse_args, *self._window, p.batch, *o_strides,
                HEAD_DIM=p.head_dim, GROUP=p.group, ROWS=p.rows, BATCH_PAD=self.batch_pad,
                **self._combine_options)

    def prefill(self, q, k_cache, v_cache, block_table, cu_seqlens_q, context_lens, out, *, scale: float,
                k_scale=None, v_scale=None, lse=None) -> None:
        """q, out (T, Hq, D) packed by cu_seqlens_q (B + 1,) int32; lse (T, Hq) fp32 when built with return_lse."""
        p = self.problem
        k_scale, v_scale, lse_args, caches = self._common(q, out, k_cache, v_cache, k_scale, v_scale, lse)
        block_m = self.config["BLOCK_M"]
        tokens_per_block = block_m // p.group
        # Sequences of q_len tokens take cdiv(q_len, tokens_per_block) blocks: at most this many in all.
        num_blocks = cdiv(q.shape[0], tokens_per_block) + p.batch
        with launching(self.interpret):
            launch_kernel(
                self.module.paged_prefill_kernel, (num_blocks, p.num_kv_heads),
                q, k_cache, v_cache, out, block_table, context_lens, cu_seqlens_q, k_scale, v_scale, *lse_args,
                scale, *self._features, p.batch, num_blocks, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
                *caches,
                block_table.stride(0), PAGE_SIZE=p.page_size, HEAD_DIM=p.head_dim, GROUP=p.group,
                BLOCK_M=block_m, BATCH_PAD=self.batch_pad, **self.options)


def _packed_rows(t: torch.Tensor, rows: int) -> torch.Tensor | None:
    """t (B, Q, ...) as a (B * Q, ...) view, or None where its strides allow no such view."""
    try:
        return t.view(rows, *t.shape[2:])
    except RuntimeError:
        return None


_LAUNCH_CACHE_SIZE = 16
_launches: collections.OrderedDict = collections.OrderedDict()
_launches_lock = threading.Lock()


def paged_launch(problem: PagedProblem, config: Config, device: torch.device, *, return_lse: bool = False,
                 num_sms: int | None = None, split_constants=None) -> PagedLaunch:
    """A PagedLaunch kept for reuse (the most recent few), so repeated launches of one problem (the tuner's
    timing loop) allocate nothing."""
    split_constants = SplitConstants.of(split_constants)
    if torch.device(device).type == "meta":  # one 'meta' device stands for many GPUs: nothing kept
        return PagedLaunch(problem, config, torch.device(device), return_lse=return_lse, num_sms=num_sms,
                           split_constants=split_constants)
    key = (problem, config, str(device), return_lse, num_sms, split_constants)
    with _launches_lock:
        found = _launches.get(key)
        if found is not None:
            _launches.move_to_end(key)
            return found
    made = PagedLaunch(problem, config, torch.device(device), return_lse=return_lse, num_sms=num_sms,
                       split_constants=split_constants)
    with _launches_lock:
        _launches[key] = made
        while len(_launches) > _LAUNCH_CACHE_SIZE:
            _launches.popitem(last=False)
    return made


def dense_kv(problem: PagedProblem, inputs: Tensors, seq: int, name: str) -> torch.Tensor:
    """De-page one sequence's K or V into a contiguous float32 (context, Hkv, D) tensor, dequantised."""
    length = int(inputs["context_lens"][seq])
    pages = inputs["block_table"][seq, :cdiv(length, problem.page_size)].long()
    dense = inputs[f"{name}_cache"][pages].float().flatten(0, 1)[:length]  # (context, Hkv, D)
    if f"{name}_scale" in inputs:
        dense = dense * inputs[f"{name}_scale"].float()[None, :, None]
    return dense


def dense_attention(problem: PagedProblem, inputs: Tensors) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain float32 attention, one sequence at a time, over de-paged contiguous K and V: (out, lse).

    Query j of Q sits at position context - Q + j and sees positions 0..itself (the window's last ones only, where
    the problem has one; logits soft-capped where it says so). out is (B, Q, Hq, D),
    lse (B, Q, Hq) the natural-log log-sum-exp of each query row's scaled logits.
    """
    p = problem
    scale = float(inputs["scale"])
    q = inputs["q"].float()  # (B, Q, Hq, D)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    for b in range(p.batch):
        k = dense_kv(p, inputs, b, "k")  # (context, Hkv, D)
        v = dense_kv(p, inputs, b, "v")
        grouped = q[b].view(p.num_queries, p.num_kv_heads, p.group, p.head_dim)  # (Q, Hkv, G, D)
        logits = torch.einsum("qhgd,khd->hgqk", grouped, k) * scale  # (Hkv, G, Q, context)
        if p.softcap > 0:
            logits = p.softcap * torch.tanh(logits / p.softcap)
        positions = torch.arange(k.shape[0], device=q.device)
        last = k.shape[0] - p.num_queries + torch.arange(p.num_queries, device=q.device)  # (Q,)
        hidden = positions[None, :] > last[:, None]  # (Q, context)
        if p.window >= 0:
            hidden |= positions[None, :] < last[:, None] - p.window
        logits = logits.masked_fill(hidden, float("-inf"))
        attended = torch.einsum("hgqk,khd->qhgd", torch.softmax(logits, dim=-1), v)  # (Q, Hkv, G, D)
        out[b] = attended.reshape(p.num_queries, p.num_q_heads, p.head_dim)
        lse[b] = torch.logsumexp(logits, dim=-1).permute(2, 0, 1).reshape(p.num_queries, p.num_q_heads)
    return out, lse


def dense_reference(problem: PagedProblem, inputs: Tensors) -> torch.Tensor:
    """The output of dense_attention: (B, Q, Hq, D) float32."""
    return dense_attention(problem, inputs)[0]


def gather_sdpa(problem: PagedProblem, inputs: Tensors):
    """What a user writes without a paged kernel: gather the pages into contiguous K/V, then SDPA."""
    p = problem
    q, table, lengths = inputs["q"], inputs["block_table"], inputs["context_lens"]
    span = table.shape[1] * p.page_size
    positions = torch.arange(span, device=q.device)
    last = lengths[:, None] - p.num_queries + torch.arange(p.num_queries, device=q.device)[None, :]  # (B, Q)
    mask = positions[None, None, None, :] <= last[:, None, :, None]  # (B, 1, Q, span)
    if p.window >= 0:
        mask &= positions[None, None, None, :] >= last[:, None, :, None] - p.window
    elif p.num_queries == 1 and bool((lengths == span).all()):
        mask = None  # every sequence fills its table: no mask, so SDPA may take its fastest backend
    qt = q.transpose(1, 2)  # (B, Hq, Q, D)
    tables = table.long()

    def gathered(name: str) -> torch.Tensor:
        dense = inputs[f"{name}_cache"][tables].flatten(1, 2)  # (B, span, Hkv, D)
        if f"{name}_scale" in inputs:
            dense = (dense.to(q.dtype) * inputs[f"{name}_scale"].to(q.dtype)[None, None, :, None])
        return dense.transpose(1, 2)  # (B, Hkv, span, D)

    def run():
        return torch.nn.functional.scaled_dot_product_attention(
            qt, gathered("k"), gathered("v"), attn_mask=mask, scale=float(inputs["scale"]), enable_gqa=True)
    return run


FAMILY = PagedFamily()
