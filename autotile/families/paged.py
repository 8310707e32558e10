"""Paged decode attention: one (or a few speculative) query tokens per sequence over a block-table KV cache.

Decode is memory-bound: every step reads each sequence's whole K and V once and
does ~1 FLOP per byte. The kernel therefore works on all G = Hq / Hkv query
heads of one KV head in one program (each K/V page is read once, GQA and MQA
alike), loads BLOCK_N tokens of K and V per step with num_stages steps in
flight, and, for few long sequences, splits the context into partitions that
separate programs walk before a reduce kernel combines them (VARIANT 'split').

>>> from autotile.device import interpret_device
>>> p = PagedProblem(batch=2, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16, max_context=40)
>>> inputs = FAMILY.make_inputs(p, interpret_device())
>>> out = FAMILY.allocate_outputs(p, inputs)
>>> FAMILY.launch(p, FAMILY.default_config(p, interpret_device()), inputs, out)
>>> FAMILY.check(p, inputs, out, FAMILY.reference(p, inputs)).ok
True
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from autotile.device import DeviceInfo
from autotile.dtypes import element_size, torch_dtype
from autotile.errors import BadInputError, ShapeMismatchError, UnsupportedDtypeError
from autotile.families.base import Baseline, Cost, Family, ProblemOption, Tensors, Tolerance, next_pow2
from autotile.launch import launch as launch_kernel
from autotile.render import interpreter_mode, load_kernel_module
from autotile.space import Axis, AxisKind, Config, Constraint, Space

QUERY_DTYPES = ("fp16", "bf16")
CACHE_DTYPES = ("fp16", "bf16", "fp8")
VARIANTS = ("whole", "split")
BLOCK_N_CHOICES = (16, 32, 64, 128, 256)
PARTITION_CHOICES = (256, 512, 1024, 2048, 4096)
# tl.dot needs every dimension >= 16; the query rows of a KV group are padded up to it.
MIN_ROWS = 16
# Unit roundoff (half an ulp at 1.0) of the dtype the attention weights and the output are rounded to.
_UNIT_ROUNDOFF = {"fp16": 2.0**-11, "bf16": 2.0**-8}
# e4m3's largest finite value: per-head scales map each head's amax onto it.
FP8_MAX = 448.0
# Split-context workspace limit (fp32 elements): 2**28 is 1 GiB.
_WORKSPACE_LIMIT = 2**28
# Registers a thread may spend on one step's K and V tiles (16-bit halves packed two a register)
# before Triton spills; Hopper gives a thread at most 255.
_TILE_REGISTER_BUDGET = 128


@dataclass(frozen=True)
class PagedProblem:
    """One decode step's shape. Context lengths enter as their max and mean (runtime calls bucket them)."""

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

    def __post_init__(self):
        if self.mean_context == 0:
            object.__setattr__(self, "mean_context", self.max_context)
        if min(self.batch, self.num_q_heads, self.num_kv_heads, self.page_size, self.num_queries) < 1:
            raise ShapeMismatchError(f"paged attention sizes must be >= 1: {self}")
        if self.num_q_heads % self.num_kv_heads:
            raise ShapeMismatchError(
                f"{self.num_q_heads} query heads cannot share {self.num_kv_heads} KV heads evenly; "
                "Hq must be a multiple of Hkv")
        if self.head_dim not in (16, 32, 64, 128, 256):
            raise ShapeMismatchError(f"head_dim must be a power of two from 16 to 256, got {self.head_dim}")
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
        if self.kv_dtype != "fp8" and self.kv_dtype != self.dtype:
            raise UnsupportedDtypeError(
                f"a {self.kv_dtype} cache needs {self.kv_dtype} queries (got {self.dtype}); only fp8 caches mix dtypes")

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def rows(self) -> int:
        """Query rows one program holds: the G heads of a KV group times the query tokens, padded."""
        return max(MIN_ROWS, next_pow2(self.group * self.num_queries))


def context_bucket(tokens: int) -> int:
    """Context lengths a runtime call is filed under: the next power of two (at least 16)."""
    return next_pow2(max(16, int(tokens)))


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


_SEED_CONFIGS = (
    dict(VARIANT="whole", BLOCK_N=64, PARTITION_SIZE=256, num_warps=4, num_stages=3),
    dict(VARIANT="whole", BLOCK_N=128, PARTITION_SIZE=256, num_warps=8, num_stages=3),
    dict(VARIANT="whole", BLOCK_N=32, PARTITION_SIZE=256, num_warps=4, num_stages=4),
    dict(VARIANT="split", BLOCK_N=64, PARTITION_SIZE=1024, num_warps=4, num_stages=3),
    dict(VARIANT="split", BLOCK_N=128, PARTITION_SIZE=2048, num_warps=8, num_stages=3),
    dict(VARIANT="split", BLOCK_N=64, PARTITION_SIZE=512, num_warps=4, num_stages=4),
)


class PagedFamily(Family):
    name = "paged"
    template = "paged_attention.py.j2"
    problem_type = PagedProblem
    shape_fields = ("batch", "max_context", "mean_context")

    cli_options = (
        ProblemOption("batch", int, "sequences per step", multiple=True),
        ProblemOption("context", int, "tokens of context per sequence (the max when --mean-context is given)", multiple=True),
        ProblemOption("mean_context", int, "mean context length of a ragged batch (default: all equal)"),
        ProblemOption("q_heads", int, "query heads", default=32),
        ProblemOption("kv_heads", int, "KV heads (GQA/MQA when fewer than query heads)", default=8),
        ProblemOption("head_dim", int, "head dimension", default=128),
        ProblemOption("page_size", int, "tokens per cache page", default=16),
        ProblemOption("num_queries", int, "query tokens per sequence (speculative decoding when > 1)", default=1),
        ProblemOption("dtype", str, "query dtype", default="bf16", choices=QUERY_DTYPES),
        ProblemOption("kv_dtype", str, "cache dtype (default: the query dtype)", choices=CACHE_DTYPES),
    )

    # --- problems -----------------------------------------------------------------
    def default_suite(self) -> list[PagedProblem]:
        """The decode rows of shared/anchors: bf16, D=128, pages of 16."""
        return [PagedProblem(b, hq, 8, 128, 16, ctx) for b, hq, ctx in
                ((64, 32, 4096), (16, 32, 16384), (256, 32, 1024), (8, 64, 32768))]

    def problems_from_cli(self, *, batch=(), context=(), mean_context=None, q_heads=32, kv_heads=8, head_dim=128,
                          page_size=16, num_queries=1, dtype="bf16", kv_dtype=None, **_unused) -> list[PagedProblem]:
        batches = [batch] if isinstance(batch, int) else list(batch or ())
        contexts = [context] if isinstance(context, int) else list(context or ())
        if not batches and not contexts:
            return self.default_suite()
        if not batches or not contexts:
            raise BadInputError("give both --batch and --context (or neither, for the default suite)")
        return [PagedProblem(b, q_heads, kv_heads, head_dim, page_size, ctx, min(mean_context or ctx, ctx),
                             num_queries, dtype, kv_dtype or dtype) for b in batches for ctx in contexts]

    # --- the search -----------------------------------------------------------------
    def space(self, problem: PagedProblem, device: DeviceInfo) -> Space:
        p = problem
        tile_size = max(element_size(p.kv_dtype), element_size(p.dtype))  # fp8 tiles are widened before the dots
        partitions = lambda c: cdiv(p.max_context, c["PARTITION_SIZE"])  # noqa: E731

        def smem_bytes(c) -> int:
            # num_stages K and V tiles in flight, plus the weights tile handed to the second dot.
            return 2 * c["BLOCK_N"] * p.head_dim * tile_size * c["num_stages"] + p.rows * c["BLOCK_N"] * 2

        def workspace(c) -> int:
            return p.batch * p.num_kv_heads * partitions(c) * p.rows * (p.head_dim + 2)

        axes = [
            Axis("VARIANT", VARIANTS, AxisKind.RENDER),
            Axis("BLOCK_N", BLOCK_N_CHOICES),
            Axis("PARTITION_SIZE", PARTITION_CHOICES),
            Axis("num_warps", (2, 4, 8)),
            Axis("num_stages", (1, 2, 3, 4)),
        ]
        constraints = [
            Constraint("shared_memory", lambda c: smem_bytes(c) <= device.smem_per_block,
                       lambda c: f"needs {smem_bytes(c)} B of shared memory, the device allows {device.smem_per_block} B"),
            Constraint("tile_registers",
                       lambda c: c["BLOCK_N"] * p.head_dim <= _TILE_REGISTER_BUDGET * 32 * c["num_warps"],
                       f"the K and V tiles would need more than {_TILE_REGISTER_BUDGET} registers a thread"),
            Constraint("work_per_warp", lambda c: c["BLOCK_N"] * p.head_dim >= 8 * 32 * c["num_warps"],
                       "a tile must give every thread at least one 16-byte vector of K"),
            Constraint("tile_within_context", lambda c: c["BLOCK_N"] <= max(16, next_pow2(p.max_context)),
                       "a token tile longer than the next power of two of the context only loads padding"),
            Constraint("partition_split_only",
                       lambda c: c["VARIANT"] == "split" or c["PARTITION_SIZE"] == PARTITION_CHOICES[0],
                       "PARTITION_SIZE only shapes the split variant; the whole variant keeps the first choice"),
            Constraint("partition_holds_tiles", lambda c: c["VARIANT"] == "whole" or c["PARTITION_SIZE"] >= c["BLOCK_N"],
                       "a partition must hold whole token tiles"),
            Constraint("split_has_partitions", lambda c: c["VARIANT"] == "whole" or partitions(c) >= 2,
                       "splitting needs at least two partitions of the longest context"),
            Constraint("split_workspace", lambda c: c["VARIANT"] == "whole" or workspace(c) <= _WORKSPACE_LIMIT,
                       "the split workspace would exceed 1 GiB"),
        ]
        return Space(axes, constraints)

    def seed_configs(self, problem: PagedProblem, device: DeviceInfo) -> list[Config]:
        """Shapes fast decode kernels use on Hopper, tried right after the default: wide token tiles,
        a few stages in flight, and split contexts for few long sequences."""
        space = self.space(problem, device)
        return [Config(w) for w in _SEED_CONFIGS if space.is_feasible(w)]

    def default_config(self, problem: PagedProblem, device: DeviceInfo) -> Config:
        p = problem
        programs = p.batch * p.num_kv_heads
        preferred = dict(VARIANT="whole", BLOCK_N=64 if p.head_dim <= 128 else 32, PARTITION_SIZE=PARTITION_CHOICES[0],
                         num_warps=4, num_stages=3)
        if programs < 2 * device.sm_count and p.max_context >= 2 * PARTITION_CHOICES[0]:
            # Too few (sequence, KV head) pairs to fill the device: split so there are ~4 programs a core.
            wanted = 4 * device.sm_count
            size = PARTITION_CHOICES[-1]
            while size > PARTITION_CHOICES[0] and programs * cdiv(p.max_context, size) < wanted:
                size //= 2
            preferred.update(VARIANT="split", PARTITION_SIZE=size)
        return self.first_feasible(problem, device, preferred)

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
        tokens = p.batch * p.mean_context
        kv_bytes = 2 * tokens * p.num_kv_heads * p.head_dim * element_size(p.kv_dtype)
        q_bytes = 2 * p.batch * p.num_queries * p.num_q_heads * p.head_dim * element_size(p.dtype)  # q in, out
        table_bytes = 4 * (p.batch * cdiv(p.mean_context, p.page_size) + p.batch)
        return Cost(flops=4.0 * tokens * p.num_q_heads * p.num_queries * p.head_dim,
                    bytes=float(kv_bytes + q_bytes + table_bytes))

    def baseline(self, problem: PagedProblem, inputs: Tensors) -> Baseline | None:
        return Baseline("gather + SDPA", gather_sdpa(problem, inputs))

    # --- running --------------------------------------------------------------------
    def render_switches(self, problem: PagedProblem, config: Config) -> dict:
        return dict(VARIANT=config["VARIANT"], FP8_SCALES=problem.kv_dtype == "fp8", UPCAST_DOTS=False)

    def launch(self, problem: PagedProblem, config: Config, inputs: Tensors, outputs: Tensors) -> None:
        p = problem
        q, k_cache, v_cache, out = inputs["q"], inputs["k_cache"], inputs["v_cache"], outputs["out"]
        interpret = q.device.type == "cpu"
        switches = self.render_switches(p, config)
        # NOTE: Triton 3.6's interpreter computes bf16 tl.dot wrongly; CPU runs upcast the dot operands.
        switches["UPCAST_DOTS"] = interpret and "bf16" in (p.dtype, p.kv_dtype)
        module = _kernel_module(self.template, interpret, tuple(sorted(switches.items())))
        split = config["VARIANT"] == "split"
        partitions = cdiv(p.max_context, config["PARTITION_SIZE"]) if split else 1
        rows = p.rows
        if split:
            ws = torch.empty(p.batch * p.num_kv_heads * partitions * rows * (p.head_dim + 2),
                             dtype=torch.float32, device=q.device)
            cut = p.batch * p.num_kv_heads * partitions * rows
            ws_max, ws_sum, ws_acc = ws[:cut], ws[cut:2 * cut], ws[2 * cut:]
        else:
            ws_max = ws_sum = ws_acc = out  # unused pointers still need a tensor
        k_scale = inputs.get("k_scale", out)
        v_scale = inputs.get("v_scale", out)
        block_table, context_lens = inputs["block_table"], inputs["context_lens"]
        scale = float(inputs["scale"])
        shape = dict(PAGE_SIZE=p.page_size, HEAD_DIM=p.head_dim, GROUP=p.group, NUM_QUERIES=p.num_queries, ROWS=rows)
        with interpreter_mode(interpret):
            launch_kernel(
                module.paged_attention_kernel, (p.num_kv_heads, p.batch, partitions),
                q, k_cache, v_cache, out, block_table, context_lens, k_scale, v_scale,
                ws_acc, ws_max, ws_sum,
                scale, partitions,
                q.stride(0), q.stride(1), q.stride(2),
                out.stride(0), out.stride(1), out.stride(2),
                k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
                block_table.stride(0),
                **shape, BLOCK_N=config["BLOCK_N"], PARTITION_SIZE=config["PARTITION_SIZE"],
                num_warps=config["num_warps"], num_stages=config["num_stages"],
            )
            if split:
                launch_kernel(
                    module.paged_attention_reduce, (p.num_kv_heads, p.batch),
                    out, context_lens, ws_acc, ws_max, ws_sum, partitions,
                    out.stride(0), out.stride(1), out.stride(2),
                    HEAD_DIM=p.head_dim, GROUP=p.group, NUM_QUERIES=p.num_queries, ROWS=rows,
                    PARTITION_SIZE=config["PARTITION_SIZE"], num_warps=4,
                )


@functools.lru_cache(maxsize=None)
def _kernel_module(template: str, interpret: bool, switches: tuple):
    """Rendered and imported once per structure: decode steps are short, re-rendering is not free."""
    return load_kernel_module(template, interpret=interpret, **dict(switches))


def dense_kv(problem: PagedProblem, inputs: Tensors, seq: int, name: str) -> torch.Tensor:
    """De-page one sequence's K or V into a contiguous float32 (context, Hkv, D) tensor, dequantised."""
    length = int(inputs["context_lens"][seq])
    pages = inputs["block_table"][seq, :cdiv(length, problem.page_size)].long()
    dense = inputs[f"{name}_cache"][pages].float().flatten(0, 1)[:length]  # (context, Hkv, D)
    if f"{name}_scale" in inputs:
        dense = dense * inputs[f"{name}_scale"].float()[None, :, None]
    return dense


def dense_reference(problem: PagedProblem, inputs: Tensors) -> torch.Tensor:
    """Plain float32 attention, one sequence at a time, over de-paged contiguous K and V.

    Query j of Q sits at position context - Q + j and sees positions 0..itself.
    """
    p = problem
    scale = float(inputs["scale"])
    q = inputs["q"].float()  # (B, Q, Hq, D)
    out = torch.empty_like(q)
    for b in range(p.batch):
        k = dense_kv(p, inputs, b, "k")  # (context, Hkv, D)
        v = dense_kv(p, inputs, b, "v")
        grouped = q[b].view(p.num_queries, p.num_kv_heads, p.group, p.head_dim)  # (Q, Hkv, G, D)
        logits = torch.einsum("qhgd,khd->hgqk", grouped, k) * scale  # (Hkv, G, Q, context)
        positions = torch.arange(k.shape[0], device=q.device)
        last = k.shape[0] - p.num_queries + torch.arange(p.num_queries, device=q.device)  # (Q,)
        logits = logits.masked_fill(positions[None, :] > last[:, None], float("-inf"))
        attended = torch.einsum("hgqk,khd->qhgd", torch.softmax(logits, dim=-1), v)  # (Q, Hkv, G, D)
        out[b] = attended.reshape(p.num_queries, p.num_q_heads, p.head_dim)
    return out


def gather_sdpa(problem: PagedProblem, inputs: Tensors):
    """What a user writes without a paged kernel: gather the pages into contiguous K/V, then SDPA."""
    p = problem
    q, table, lengths = inputs["q"], inputs["block_table"], inputs["context_lens"]
    span = table.shape[1] * p.page_size
    positions = torch.arange(span, device=q.device)
    last = lengths[:, None] - p.num_queries + torch.arange(p.num_queries, device=q.device)[None, :]  # (B, Q)
    mask = positions[None, None, None, :] <= last[:, None, :, None]  # (B, 1, Q, span)
    if p.num_queries == 1 and bool((lengths == span).all()):
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
