"""FlashAttention: softmax(scale * Q K^T) V without ever storing the Sq x Sk score matrix.

The forward streams K/V tiles past a resident Q tile, keeping a running row max and row sum
(online softmax), and saves each row's log-sum-exp. The backward recomputes the probability
tiles from that log-sum-exp: one kernel owns a key block and sums dK/dV over every query
head of its group, another owns a query block and sums dQ, so no atomics are needed.

Forward and backward are separate problems of one family (`direction`), tuned and looked up
separately. Causal masks are aligned to the bottom-right (query i sees key j <= i + Sk - Sq),
as SDPA's `causal_lower_right` and FlashAttention do; rows that see no key give O = 0.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import partial

import torch

from autotile.device import DeviceInfo
from autotile.dtypes import element_size, torch_dtype
from autotile.errors import BadInputError, ShapeMismatchError, UnsupportedDtypeError
from autotile.families.base import (Baseline, CheckResult, Cost, Family, ProblemOption, Tensors, Tolerance,
                                    next_pow2)
from autotile.families.checks import compare
from autotile.launch import launch as launch_kernel
from autotile.render import interpreter_mode, load_kernel_module
from autotile.space import Axis, AxisKind, Config, Constraint, Space

DIRECTIONS = ("fwd", "bwd")
DTYPES = ("fp32", "fp16", "bf16", "fp8")  # fp8 (e4m3 with per-tensor descales): forward only
MAX_HEAD_DIM = 256
LOG2E = 1.4426950408889634

# Unit roundoff (half an ulp at 1.0) of the dtype the results are stored in.
_UNIT_ROUNDOFF = {"fp32": 2.0**-24, "fp16": 2.0**-11, "bf16": 2.0**-8}
# FlashAttention's test rule (tests/test_flash_attn.py of Dao-AILab/flash-attention): our error against
# a float64 reference may be at most this multiple of the error plain torch makes at the same dtype ...
_PLAIN_TORCH_FACTOR = 2.0
# ... plus a floor of this many roundings of the output at its magnitude (+0.3, as FlashAttention's
# `out_ref + 0.3 - 0.3` floor), for outputs where torch happens to be almost exact. The rounding
# counts the fp32 accumulation too: two fp32 sums of n terms taken in different orders (tiles vs
# torch's blocked matmul) drift apart by ~sqrt(n) * 2^-24 of their size. That term is what is left
# for fp32 problems, and is negligible next to the storage rounding of fp16/bf16.
_FLOOR_ROUNDINGS = 2.0
_FP32_ROUNDOFF = 2.0**-24
# A thread holds at most this many fp32 accumulator values before Hopper kernels start to spill
# (255 registers a thread, minus addresses, masks and the softmax statistics).
_ACCUMULATOR_REGISTERS = 192
_BLOCKS = (16, 32, 64, 128)
# Score elements of one chunk in the plain-torch computations: 2**27 (1 GiB in float64, a few
# copies alive at once) keeps the references of the 16k-token anchor shapes inside GPU memory.
_CHUNK_SCORES = 2**27


def _rows_needed(num_warps: int) -> int:
    # An mma covers 16 rows a warp; a Hopper warpgroup (4 warps) covers 64, and more warpgroups
    # may split the other dimension of the tile instead.
    return 16 * min(num_warps, 4)


def _largest_block(seq: int) -> int:
    # Blocks past the next power of two of a sequence only compute padding; 64 rows (one warpgroup)
    # stay allowed so that wide heads (256) keep a config whose accumulators fit in registers.
    return max(64, next_pow2(seq))


@dataclass(frozen=True)
class FlashProblem:
    direction: str  # 'fwd' or 'bwd'
    batch: int
    heads_q: int
    heads_kv: int
    seq_q: int
    seq_k: int
    head_dim: int
    causal: bool = False
    dtype: str = "bf16"
    aligned: bool = True  # base pointers and row strides are multiples of 16 bytes (TMA-able)

    def __post_init__(self):
        if self.direction not in DIRECTIONS:
            raise BadInputError(f"direction must be one of {DIRECTIONS}, got {self.direction!r}")
        if min(self.batch, self.heads_q, self.heads_kv, self.seq_q, self.seq_k) < 1:
            raise ShapeMismatchError(f"attention sizes must be >= 1, got {self}")
        if self.heads_q % self.heads_kv:
            raise ShapeMismatchError(
                f"{self.heads_q} query heads cannot share {self.heads_kv} key/value heads: Hq must be a multiple of Hkv")
        if not 1 <= self.head_dim <= MAX_HEAD_DIM:
            raise ShapeMismatchError(f"head dim {self.head_dim} is not supported: use 1..{MAX_HEAD_DIM} (64, 96, 128, 256 are tuned)")
        if self.dtype not in DTYPES:
            raise UnsupportedDtypeError(f"flash attention supports {DTYPES}, got {self.dtype!r}")
        if self.dtype == "fp8" and self.direction == "bwd":
            raise UnsupportedDtypeError("the fp8 path is forward only; train in bf16 or fp16")

    @property
    def group(self) -> int:
        return self.heads_q // self.heads_kv

    @property
    def out_dtype(self) -> str:
        return "bf16" if self.dtype == "fp8" else self.dtype

    @property
    def block_d(self) -> int:
        # The head dim padded to a power of two (96 -> 128); tl.dot needs >= 16, fp8 dots >= 32 along K.
        return max(32 if self.dtype == "fp8" else 16, next_pow2(self.head_dim))


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


def seen_pairs(seq_q: int, seq_k: int, causal: bool) -> int:
    """(query, key) pairs that take part: all of them, or those under the bottom-right causal diagonal."""
    if not causal:
        return seq_q * seq_k
    diag = seq_k - seq_q
    # Row i sees min(Sk, max(0, i + diag + 1)) keys; rows [a, b) see i + diag + 1 of them.
    a = min(seq_q, max(0, -diag))  # first row that sees a key
    b = min(seq_q, max(a, seq_k - diag - 1))  # first row that sees every key
    partial = (b - a) * (a + b - 1) // 2 + (b - a) * (diag + 1)
    return partial + (seq_q - b) * seq_k


# --- plain torch attention (references and the same-dtype comparison) ------------------------------
def causal_seen(seq_q: int, seq_k: int, device) -> torch.Tensor:
    """(Sq, Sk) bool: query i sees key j <= i + Sk - Sq."""
    rows = torch.arange(seq_q, device=device)[:, None]
    cols = torch.arange(seq_k, device=device)[None, :]
    return cols <= rows + (seq_k - seq_q)


def attention_math(q, k, v, *, causal: bool, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """softmax(scale * Q K^T) V in plain torch with matmuls in `dtype` and the softmax in float32 or wider.

    Differentiable; GQA by repeating K/V heads; causal rows that see no key give 0.
    """
    group = q.shape[1] // k.shape[1]
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    soft_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    scores = (torch.matmul(q, k.transpose(-1, -2)) * scale).to(soft_dtype)  # (B, Hq, Sq, Sk)
    if causal:
        seen = causal_seen(q.shape[2], k.shape[2], q.device)
        empty = ~seen.any(dim=1, keepdim=True)  # (Sq, 1)
        # Empty rows softmax over zeros instead of all -inf (no NaN in values or gradients), then are zeroed.
        scores = scores.masked_fill(~seen, float("-inf")).masked_fill(empty, 0.0)
        probs = torch.softmax(scores, dim=-1).masked_fill(~seen, 0.0)
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs.to(dtype), v)


def log2_sum_exp(q, k, *, causal: bool, scale: float) -> torch.Tensor:
    """(B, Hq, Sq) float32 (float64 for float64 inputs) log2-domain log-sum-exp of the scaled scores; +inf for rows that see no key."""
    group = q.shape[1] // k.shape[1]
    wide = torch.float64 if q.dtype == torch.float64 else torch.float32
    k = k.to(wide).repeat_interleave(group, dim=1)
    scores = torch.matmul(q.to(wide), k.transpose(-1, -2)) * scale
    if causal:
        scores = scores.masked_fill(~causal_seen(q.shape[2], k.shape[2], q.device), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1) * LOG2E
    return torch.where(torch.isneginf(lse), torch.full_like(lse, float("inf")), lse)


def map_head_chunks(fn, q, k, v, *q_side):
    """`fn(q, k, v, *q_side)` over chunks of (one batch entry, a run of key/value heads with their query heads).

    Every result of `fn` (a tensor or a tuple of them, with heads along dim 1) is stitched back
    together, so plain-torch attention of the 16k-token anchor shapes fits in an H200's memory.
    """
    group = q.shape[1] // k.shape[1]
    per_chunk = max(1, _CHUNK_SCORES // (group * q.shape[2] * k.shape[2]))
    rows = []
    for b in range(q.shape[0]):
        parts = []
        for h0 in range(0, k.shape[1], per_chunk):
            kv = slice(h0, min(h0 + per_chunk, k.shape[1]))
            qh = slice(kv.start * group, kv.stop * group)
            result = fn(q[b:b + 1, qh], k[b:b + 1, kv], v[b:b + 1, kv], *(t[b:b + 1, qh] for t in q_side))
            parts.append(result if isinstance(result, tuple) else (result,))
        rows.append(tuple(torch.cat(column, dim=1) for column in zip(*parts)))
    stitched = tuple(torch.cat(column, dim=0) for column in zip(*rows))
    return stitched if len(stitched) > 1 else stitched[0]


def attention_grads(q, k, v, do, *, causal: bool, scale: float, dtype: torch.dtype):
    """dq, dk, dv of attention_math at `dtype`, by autograd, chunk by chunk."""
    def one_chunk(q, k, v, do):
        q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
        with torch.enable_grad():
            o = attention_math(q, k, v, causal=causal, scale=scale, dtype=dtype)
            return torch.autograd.grad(o, (q, k, v), do.to(o.dtype))
    return map_head_chunks(one_chunk, q, k, v, do)


def _plain_torch_fp8_forward(inputs: Tensors, causal: bool, scale: float) -> torch.Tensor:
    """What fp8 attention does in plain torch: dequantised Q/K/V, unnormalised P rounded to e4m3 for P V."""
    descale = inputs["descale"].double()

    def one_chunk(q8, k8, v8):
        group = q8.shape[1] // k8.shape[1]
        q = q8.double() * descale[0]
        k = k8.double().repeat_interleave(group, dim=1) * descale[1]
        v = v8.double().repeat_interleave(group, dim=1)
        scores = torch.matmul(q, k.transpose(-1, -2)) * scale
        if causal:
            scores = scores.masked_fill(~causal_seen(q.shape[2], k.shape[2], q.device), float("-inf"))
        row_max = scores.amax(dim=-1, keepdim=True).nan_to_num(0.0, neginf=0.0)
        p = torch.exp(scores - row_max)  # (B, Hq, Sq, Sk) in [0, 1]
        l = p.sum(dim=-1, keepdim=True)
        out = torch.matmul(p.to(torch.float8_e4m3fn).double(), v) * descale[2]
        return torch.where(l > 0, out / l.clamp_min(1e-300), torch.zeros_like(out))
    return map_head_chunks(one_chunk, inputs["q"], inputs["k"], inputs["v"])


def fa_rule_check(name: str, got: torch.Tensor, want: torch.Tensor, plain: torch.Tensor, out_dtype: str,
                  reduction: int) -> CheckResult:
    """FlashAttention's rule: max|got - want| <= 2 * max|plain - want| + 2 roundings at max|want| + 0.3.

    `reduction`: how many terms each output element sums (Sk for O and dQ, group * Sq for dK and dV).
    """
    g = got.detach().to(torch.float64)
    w = want.detach().to(device=g.device, dtype=torch.float64)
    pl = plain.detach().to(device=g.device, dtype=torch.float64)
    if g.shape != w.shape:
        return CheckResult(False, f"{name}: shape {tuple(g.shape)} != reference {tuple(w.shape)}")
    nan = torch.isnan(g)
    if nan.any():
        idx = tuple(int(i) for i in nan.nonzero()[0])
        return CheckResult(False, f"{name}: {int(nan.sum())} element(s) NaN or never written, first at {idx} "
                                  f"(reference {w[idx].item():.6g})", float("nan"))
    err = (g - w).abs()
    plain_err = float((pl - w).abs().max()) if w.numel() else 0.0
    rounding = _UNIT_ROUNDOFF[out_dtype] + math.sqrt(reduction) * _FP32_ROUNDOFF
    floor = _FLOOR_ROUNDINGS * rounding * (float(w.abs().max()) + 0.3) if w.numel() else 0.0
    allowed = _PLAIN_TORCH_FACTOR * plain_err + floor
    worst = float(err.max()) if err.numel() else 0.0
    if not worst <= allowed:
        idx = tuple(int(i) for i in torch.unravel_index(err.argmax(), err.shape))
        return CheckResult(
            False,
            f"{name}: max |err| {worst:.3g} > allowed {allowed:.3g} ({_PLAIN_TORCH_FACTOR:g} x plain torch "
            f"{out_dtype} error {plain_err:.3g} + floor {floor:.3g}); worst at {idx}: got {g[idx].item():.6g}, "
            f"expected {w[idx].item():.6g}, plain torch {pl[idx].item():.6g}", worst)
    return CheckResult(True, f"{name}: ok, max |err| {worst:.3g} (plain torch {plain_err:.3g})", worst)


def _cdiv(x: int, y: int) -> int:
    return (x + y - 1) // y


def _strides(t: torch.Tensor) -> tuple[int, int, int]:
    return t.stride(0), t.stride(1), t.stride(2)


# Known-good starting points (Triton's fused-attention tutorial on Hopper; the forward ones measured
# within a few percent of each other on the H200, 2026-11-29).
_SEED_FORWARD = (
    dict(LOADS="pointer", BLOCK_M=128, BLOCK_N=64, WARP_SPECIALIZE=False, num_warps=8, num_stages=3),
    dict(LOADS="pointer", BLOCK_M=128, BLOCK_N=128, WARP_SPECIALIZE=False, num_warps=8, num_stages=2),
    dict(LOADS="tma", BLOCK_M=128, BLOCK_N=64, WARP_SPECIALIZE=False, num_warps=8, num_stages=3),
    dict(LOADS="tma", BLOCK_M=128, BLOCK_N=128, WARP_SPECIALIZE=True, num_warps=8, num_stages=2),
    dict(LOADS="pointer", BLOCK_M=64, BLOCK_N=64, WARP_SPECIALIZE=False, num_warps=4, num_stages=3),
)
_SEED_BACKWARD = (
    dict(BLOCK_M1=32, BLOCK_N1=128, BLOCK_M2=128, BLOCK_N2=32, num_warps=8, num_stages=2),
    dict(BLOCK_M1=64, BLOCK_N1=128, BLOCK_M2=128, BLOCK_N2=64, num_warps=8, num_stages=2),
    dict(BLOCK_M1=32, BLOCK_N1=64, BLOCK_M2=64, BLOCK_N2=32, num_warps=4, num_stages=3),
)


class FlashFamily(Family):
    name = "flash"
    template = "flash_attention.py.j2"
    problem_type = FlashProblem
    shape_fields = ("batch", "heads_q", "heads_kv", "seq_q", "seq_k")

    cli_options = (
        ProblemOption("batch", int, "batch size (default: tokens per batch kept near 8k)"),
        ProblemOption("heads", int, "query heads (default 32)"),
        ProblemOption("heads_kv", int, "key/value heads (default: as many as query heads)"),
        ProblemOption("seq", int, "query sequence length(s)", multiple=True),
        ProblemOption("seq_k", int, "key/value sequence length (default: the query length)"),
        ProblemOption("head_dim", int, "head dim(s), e.g. 64,128", multiple=True),
        ProblemOption("causal", str, "causal mask, plain, or both", default="both", choices=("yes", "no", "both")),
        ProblemOption("dtype", str, "operand dtype", default="bf16", choices=DTYPES),
        ProblemOption("direction", str, "forward, backward, or both", default="both", choices=("fwd", "bwd", "both")),
    )

    # --- problems -----------------------------------------------------------------
    def check_tensors(self, q, k, v, *, causal: bool = False, direction: str = "fwd") -> FlashProblem:
        """Shapes, dtypes and devices of q, k, v, without reading their data (so fake tensors pass too).

        Returns the problem as if aligned; `problem_from_tensors` looks at the pointers.
        """
        from autotile.dtypes import canonical_dtype_name

        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.dim() != 4:
                raise ShapeMismatchError(
                    f"{name} must be 4-D (batch, heads, seq, head_dim) as in SDPA, got shape {tuple(t.shape)}")
        if k.shape != v.shape:
            raise ShapeMismatchError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
        if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
            raise ShapeMismatchError(
                f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree in batch (dim 0) and head dim (dim 3)")
        if not (q.device == k.device == v.device):
            raise BadInputError(f"q, k, v are on {q.device}, {k.device}, {v.device}: move them to one device")
        if not (q.dtype == k.dtype == v.dtype):
            raise UnsupportedDtypeError(f"q, k, v are {q.dtype}, {k.dtype}, {v.dtype}: cast them to one dtype")
        try:
            dtype = canonical_dtype_name(q.dtype)
        except UnsupportedDtypeError:
            dtype = str(q.dtype)
        if dtype not in DTYPES:
            raise UnsupportedDtypeError(
                f"flash attention takes fp16, bf16 or fp32 tensors (fp8 e4m3 forward only), got {q.dtype}; cast with .to(torch.bfloat16)")
        return FlashProblem(direction, q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3],
                            bool(causal), dtype, True)

    def problem_from_tensors(self, q, k, v, *, causal: bool = False, direction: str = "fwd") -> FlashProblem:
        problem = self.check_tensors(q, k, v, causal=causal, direction=direction)
        aligned = all(t.data_ptr() % 16 == 0 and all((s * t.element_size()) % 16 == 0 for s in t.stride()[:3])
                      for t in (q, k, v))
        return dataclasses.replace(problem, aligned=aligned)

    def default_suite(self) -> list[FlashProblem]:
        problems = []
        for direction in DIRECTIONS:
            for head_dim in (64, 128):
                for seq in (1024, 2048, 4096, 8192, 16384):
                    for causal in (False, True):
                        problems.append(FlashProblem(direction, max(1, 8192 // seq), 32, 32, seq, seq, head_dim, causal))
        return problems

    def problems_from_cli(self, **options) -> list[FlashProblem]:
        def values(name) -> list[int]:
            # A multiple option arrives as a tuple of ints or of comma-separated strings.
            raw = options.get(name)
            if raw in (None, (), []):
                return []
            out = []
            for item in raw if isinstance(raw, (list, tuple)) else [raw]:
                out.extend([item] if isinstance(item, int) else [int(x) for x in str(item).split(",") if x.strip()])
            return out

        seqs, head_dims = values("seq"), values("head_dim")
        shape_given = seqs or head_dims or any(options.get(n) for n in ("batch", "heads", "heads_kv", "seq_k"))
        directions = DIRECTIONS if options.get("direction", "both") == "both" else (options["direction"],)
        causals = {"yes": (True,), "no": (False,), "both": (False, True)}[options.get("causal") or "both"]
        dtype = options.get("dtype") or "bf16"
        if not shape_given:
            return [FlashProblem(p.direction, p.batch, p.heads_q, p.heads_kv, p.seq_q, p.seq_k, p.head_dim, p.causal, dtype)
                    for p in self.default_suite() if p.direction in directions and p.causal in causals
                    and not (dtype == "fp8" and p.direction == "bwd")]
        heads = options.get("heads") or 32
        heads_kv = options.get("heads_kv") or heads
        problems = []
        for direction in directions:
            if dtype == "fp8" and direction == "bwd":
                continue
            for seq in seqs or [4096]:
                batch = options.get("batch") or max(1, 8192 // seq)
                for head_dim in head_dims or [128]:
                    for causal in causals:
                        problems.append(FlashProblem(direction, batch, heads, heads_kv, seq,
                                                     options.get("seq_k") or seq, head_dim, causal, dtype))
        return problems

    # --- the search -----------------------------------------------------------------
    def space(self, problem: FlashProblem, device: DeviceInfo) -> Space:
        return self._forward_space(problem, device) if problem.direction == "fwd" else self._backward_space(problem, device)

    def _forward_space(self, p: FlashProblem, device: DeviceInfo) -> Space:
        size, bd = element_size(p.dtype), p.block_d

        def smem_bytes(c) -> int:
            # The resident Q tile, plus K and V tiles for every pipeline stage.
            return (c["BLOCK_M"] * bd + 2 * c["BLOCK_N"] * bd * c["num_stages"]) * size

        def accumulators(c) -> float:
            # O accumulator (BLOCK_M, BLOCK_D) and the score tile (BLOCK_M, BLOCK_N), fp32, per thread.
            return (c["BLOCK_M"] * bd + c["BLOCK_M"] * c["BLOCK_N"]) / (32 * c["num_warps"])

        axes = [
            Axis("LOADS", ("pointer", "tma"), AxisKind.RENDER),
            Axis("BLOCK_M", _BLOCKS),
            Axis("BLOCK_N", _BLOCKS),
            Axis("WARP_SPECIALIZE", (False, True)),
            Axis("num_warps", (1, 2, 4, 8)),
            Axis("num_stages", (2, 3, 4)),
        ]
        constraints = [
            Constraint("shared_memory", lambda c: smem_bytes(c) <= device.smem_per_block,
                       lambda c: f"needs {smem_bytes(c)} B of shared memory, the device allows {device.smem_per_block} B"),
            Constraint("accumulator_registers", lambda c: accumulators(c) <= _ACCUMULATOR_REGISTERS,
                       lambda c: f"{accumulators(c):.0f} fp32 accumulator values a thread would spill"),
            Constraint("rows_per_warp", lambda c: c["BLOCK_M"] >= _rows_needed(c["num_warps"]),
                       lambda c: f"{c['num_warps']} warps need at least {_rows_needed(c['num_warps'])} query rows"),
            Constraint("tile_within_problem",
                       lambda c: c["BLOCK_M"] <= _largest_block(p.seq_q) and c["BLOCK_N"] <= _largest_block(p.seq_k),
                       "a block larger than the next power of two of its sequence only computes padding"),
            Constraint("fp8_block_n", lambda c: p.dtype != "fp8" or c["BLOCK_N"] >= 32,
                       "fp8 P V dots need at least 32 keys along K"),
            Constraint("tma_alignment", lambda c: c["LOADS"] != "tma" or (p.aligned and (p.head_dim * size) % 16 == 0),
                       "TMA needs 16-byte aligned base pointers and strides, and a head dim of a multiple of 16 bytes"),
            Constraint("warp_specialize_tma_only", lambda c: c["LOADS"] == "tma" or not c["WARP_SPECIALIZE"],
                       "warp specialisation splits TMA producers from mma consumers; pointer loads have no producer"),
        ]
        return Space(axes, constraints)

    def _backward_space(self, p: FlashProblem, device: DeviceInfo) -> Space:
        size, bd = element_size(p.dtype), p.block_d

        def smem_dkdv(c) -> int:
            # Resident K and V tiles, plus Q and dO tiles for every pipeline stage.
            return (2 * c["BLOCK_N1"] * bd + 2 * c["BLOCK_M1"] * bd * c["num_stages"]) * size

        def smem_dq(c) -> int:
            # Resident Q and dO tiles, plus K and V tiles for every pipeline stage.
            return (2 * c["BLOCK_M2"] * bd + 2 * c["BLOCK_N2"] * bd * c["num_stages"]) * size

        def acc_dkdv(c) -> float:
            # dK and dV accumulators (BLOCK_N1, BLOCK_D) and the P^T, dP^T tiles (BLOCK_N1, BLOCK_M1), fp32.
            return (2 * c["BLOCK_N1"] * bd + 2 * c["BLOCK_N1"] * c["BLOCK_M1"]) / (32 * c["num_warps"])

        def acc_dq(c) -> float:
            # dQ accumulator (BLOCK_M2, BLOCK_D) and the P, dP tiles (BLOCK_M2, BLOCK_N2), fp32.
            return (c["BLOCK_M2"] * bd + 2 * c["BLOCK_M2"] * c["BLOCK_N2"]) / (32 * c["num_warps"])

        axes = [
            Axis("BLOCK_M1", _BLOCKS),
            Axis("BLOCK_N1", _BLOCKS),
            Axis("BLOCK_M2", _BLOCKS),
            Axis("BLOCK_N2", _BLOCKS),
            Axis("num_warps", (1, 2, 4, 8)),
            Axis("num_stages", (2, 3, 4)),
        ]
        limit = device.smem_per_block
        constraints = [
            Constraint("shared_memory_dkdv", lambda c: smem_dkdv(c) <= limit,
                       lambda c: f"the dK/dV kernel needs {smem_dkdv(c)} B of shared memory, the device allows {limit} B"),
            Constraint("shared_memory_dq", lambda c: smem_dq(c) <= limit,
                       lambda c: f"the dQ kernel needs {smem_dq(c)} B of shared memory, the device allows {limit} B"),
            Constraint("accumulator_registers", lambda c: max(acc_dkdv(c), acc_dq(c)) <= _ACCUMULATOR_REGISTERS,
                       lambda c: f"{max(acc_dkdv(c), acc_dq(c)):.0f} fp32 accumulator values a thread would spill"),
            Constraint("rows_per_warp", lambda c: min(c["BLOCK_N1"], c["BLOCK_M2"]) >= _rows_needed(c["num_warps"]),
                       lambda c: f"{c['num_warps']} warps need at least {_rows_needed(c['num_warps'])} rows in the tile a program owns"),
            Constraint("tile_within_problem",
                       lambda c: max(c["BLOCK_M1"], c["BLOCK_M2"]) <= _largest_block(p.seq_q)
                       and max(c["BLOCK_N1"], c["BLOCK_N2"]) <= _largest_block(p.seq_k),
                       "a block larger than the next power of two of its sequence only computes padding"),
        ]
        return Space(axes, constraints)

    def seed_configs(self, problem: FlashProblem, device: DeviceInfo) -> list[Config]:
        """Hopper configs of Triton's fused-attention tutorial, tried right after the default."""
        wanted = _SEED_FORWARD if problem.direction == "fwd" else _SEED_BACKWARD
        space = self.space(problem, device)
        return [Config(w) for w in wanted if space.is_feasible(w)]

    def default_config(self, problem: FlashProblem, device: DeviceInfo) -> Config:
        # Starting points of Triton's fused-attention tutorial on H100, narrowed by head dim so the
        # accumulators fit in registers; first_feasible adapts them to short sequences.
        if problem.direction == "fwd":
            wide = problem.block_d >= 256
            preferred = dict(LOADS="pointer", BLOCK_M=64 if wide else 128, BLOCK_N=64, WARP_SPECIALIZE=False,
                             num_warps=4 if wide or problem.block_d <= 64 else 8, num_stages=2 if wide else 3)
        else:
            wide = problem.block_d >= 256
            preferred = dict(BLOCK_M1=32, BLOCK_N1=64 if wide else 128, BLOCK_M2=64 if wide else 128, BLOCK_N2=32,
                             num_warps=8 if problem.block_d >= 128 else 4, num_stages=2)
        return self.first_feasible(problem, device, preferred)

    # --- data -----------------------------------------------------------------------
    def make_inputs(self, problem: FlashProblem, device: DeviceInfo, seed: int = 0) -> Tensors:
        p = problem
        gen = torch.Generator(device="cpu").manual_seed(seed)
        dev = device.torch_device
        pad = 0 if p.aligned else 1  # unaligned problems start one element into their storage

        def tensor(heads: int, seq: int, values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
            numel = p.batch * heads * seq * p.head_dim
            t = torch.empty(numel + pad, dtype=dtype, device=dev)[pad:].view(p.batch, heads, seq, p.head_dim)
            t.copy_(values.to(dtype).to(dev))
            return t

        shapes = {"q": (p.heads_q, p.seq_q), "k": (p.heads_kv, p.seq_k), "v": (p.heads_kv, p.seq_k)}
        raw = {n: torch.randn(p.batch, h, s, p.head_dim, generator=gen) for n, (h, s) in shapes.items()}
        if p.dtype == "fp8":
            # Per-tensor scaling as fp8 recipes do: amax maps to e4m3's largest value, 448.
            scales = torch.stack([raw[n].abs().max() / 448.0 for n in "qkv"]).float()
            inputs = {n: tensor(*shapes[n], raw[n] / scales[i], torch.float8_e4m3fn) for i, n in enumerate("qkv")}
            inputs["descale"] = scales.to(dev)
            return inputs
        dtype = torch_dtype(p.dtype)
        inputs = {n: tensor(*shapes[n], raw[n], dtype) for n in "qkv"}
        if p.direction == "bwd":
            # O and LSE come from plain torch, so timing and checking the backward needs no forward kernel.
            scale = default_scale(p.head_dim)
            with torch.no_grad():
                o = map_head_chunks(partial(attention_math, causal=p.causal, scale=scale, dtype=torch.float32),
                                    inputs["q"], inputs["k"], inputs["v"])
                inputs["o"] = tensor(p.heads_q, p.seq_q, o, dtype)
                inputs["lse"] = map_head_chunks(lambda q, k, v: log2_sum_exp(q, k, causal=p.causal, scale=scale),
                                                inputs["q"], inputs["k"], inputs["v"]).contiguous()
            inputs["do"] = tensor(p.heads_q, p.seq_q, torch.randn(p.batch, p.heads_q, p.seq_q, p.head_dim, generator=gen), dtype)
        return inputs

    def allocate_outputs(self, problem: FlashProblem, inputs: Tensors) -> Tensors:
        q = inputs["q"]
        if problem.direction == "fwd":
            return {"o": torch.empty(q.shape, dtype=torch_dtype(problem.out_dtype), device=q.device),
                    "lse": torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)}
        # Contiguous whatever the inputs' strides, as the op's fake implementation promises torch.compile.
        return {name: torch.empty(inputs[src].shape, dtype=inputs[src].dtype, device=q.device)
                for name, src in (("dq", "q"), ("dk", "k"), ("dv", "v"))}

    def _dequantised(self, problem: FlashProblem, inputs: Tensors) -> tuple[torch.Tensor, ...]:
        if problem.dtype != "fp8":
            return inputs["q"], inputs["k"], inputs["v"]
        descale = inputs["descale"].double()
        return tuple(inputs[n].double() * descale[i] for i, n in enumerate("qkv"))

    def reference(self, problem: FlashProblem, inputs: Tensors) -> Tensors:
        p, scale = problem, default_scale(problem.head_dim)
        q, k, v = (t.detach().double() for t in self._dequantised(p, inputs))
        if p.direction == "fwd":
            o, lse = map_head_chunks(lambda q, k, v: (attention_math(q, k, v, causal=p.causal, scale=scale, dtype=torch.float64),
                                                      log2_sum_exp(q, k, causal=p.causal, scale=scale).double()), q, k, v)
            return {"o": o, "lse": lse}
        dq, dk, dv = attention_grads(q, k, v, inputs["do"].double(), causal=p.causal, scale=scale, dtype=torch.float64)
        return {"dq": dq, "dk": dk, "dv": dv}

    def plain_torch(self, problem: FlashProblem, inputs: Tensors) -> Tensors:
        """The same computation in plain torch at the problem's dtype: the yardstick of the FA rule."""
        p, scale = problem, default_scale(problem.head_dim)
        if p.dtype == "fp8":
            return {"o": _plain_torch_fp8_forward(inputs, p.causal, scale)}
        dtype = torch_dtype(p.dtype)
        if p.direction == "fwd":
            with torch.no_grad():
                return {"o": map_head_chunks(partial(attention_math, causal=p.causal, scale=scale, dtype=dtype),
                                             inputs["q"], inputs["k"], inputs["v"])}
        dq, dk, dv = attention_grads(inputs["q"], inputs["k"], inputs["v"], inputs["do"], causal=p.causal, scale=scale, dtype=dtype)
        return {"dq": dq, "dk": dk, "dv": dv}

    def tolerance(self, problem: FlashProblem) -> Tolerance:
        # Only the log-sum-exp is compared element-wise (the outputs and gradients follow the FA rule in
        # check()). It is fp32 from the same rounded inputs as the reference: the row sum of up to Sk
        # terms rounds by at most Sk * 2^-24 relative, exp2 on the GPU is ex2.approx (2^-22 relative),
        # and fp32 dots of D products add D * 2^-24 of |s| ~ 1; in log2 units, times 4 for headroom.
        # fp8 scores come from Hopper's fp8 tensor cores, which accumulate in ~14 bits (DeepSeek-V3
        # report, sec. 3.3.2): D unit-size terms whose partial sums grow like sqrt(D) make an error of
        # ~ D * 2^-14 before the 1/sqrt(D) scale, ~ sqrt(D) * 2^-14 in the scores; the log-sum-exp
        # moves by at most the largest score error.
        p = problem
        fp8_scores = math.sqrt(p.head_dim) * 2.0**-14 if p.dtype == "fp8" else 0.0
        return Tolerance(atol=4.0 * (p.seq_k * 2.0**-24 + 2.0**-22 + p.head_dim * 2.0**-24 + fp8_scores) / math.log(2.0)
                         + 1e-6, rtol=2.0**-20)

    def check(self, problem: FlashProblem, inputs: Tensors, outputs: Tensors, expected: Tensors) -> CheckResult:
        plain = self.plain_torch(problem, inputs)
        results = []
        for name, want in expected.items():
            if name == "lse":
                result = compare(name, outputs[name], want, self.tolerance(problem))
            else:
                reduction = problem.seq_k if name in ("o", "dq") else problem.group * problem.seq_q
                result = fa_rule_check(name, outputs[name], want, plain[name], problem.out_dtype, reduction)
            if not result.ok:
                return result
            results.append(result)
        return CheckResult(True, "; ".join(r.message for r in results), max(r.max_abs_error for r in results))

    def cost(self, problem: FlashProblem) -> Cost:
        p = problem
        pairs = seen_pairs(p.seq_q, p.seq_k, p.causal)
        forward = 4.0 * p.batch * p.heads_q * pairs * p.head_dim  # Q K^T and P V
        size, out_size = element_size(p.dtype), element_size(p.out_dtype)
        q_elems = p.batch * p.heads_q * p.seq_q * p.head_dim
        kv_elems = p.batch * p.heads_kv * p.seq_k * p.head_dim
        rows = p.batch * p.heads_q * p.seq_q
        if p.direction == "fwd":
            return Cost(forward, float(q_elems * size + 2 * kv_elems * size + q_elems * out_size + 4 * rows))
        # Backward: Q K^T recomputed, dV, dP, dQ, dK: 5 matmuls against the forward's 2, as SDPA counts.
        moved = 3 * q_elems * size + 2 * kv_elems * size + q_elems * size + 2 * kv_elems * size + 4 * rows
        return Cost(2.5 * forward, float(moved))

    def baseline(self, problem: FlashProblem, inputs: Tensors) -> Baseline | None:
        if problem.dtype == "fp8":
            return None  # SDPA has no fp8 path
        p = problem
        f = torch.nn.functional
        kwargs = dict(scale=default_scale(p.head_dim), enable_gqa=p.heads_q != p.heads_kv)
        if p.causal and p.seq_q == p.seq_k:
            kwargs["is_causal"] = True
        elif p.causal:
            from torch.nn.attention.bias import causal_lower_right

            kwargs["attn_mask"] = causal_lower_right(p.seq_q, p.seq_k)
        if p.direction == "fwd":
            q, k, v = inputs["q"], inputs["k"], inputs["v"]
            return Baseline("SDPA", lambda: f.scaled_dot_product_attention(q, k, v, **kwargs))
        q, k, v = (inputs[n].detach().clone().requires_grad_(True) for n in "qkv")
        o = f.scaled_dot_product_attention(q, k, v, **kwargs)
        do = inputs["do"]
        return Baseline("SDPA backward", lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True))

    # --- running --------------------------------------------------------------------
    def render_switches(self, problem: FlashProblem, config: Config) -> dict:
        return dict(
            CAUSAL=problem.causal, HEAD_PADDED=problem.block_d != problem.head_dim, FP8=problem.dtype == "fp8",
            LOADS=config["LOADS"] if problem.direction == "fwd" else "pointer",
            INPUT_PRECISION="ieee" if problem.dtype == "fp32" else "",
        )

    def launch(self, problem: FlashProblem, config: Config, inputs: Tensors, outputs: Tensors) -> None:
        self.run(problem, config, inputs, outputs, scale=default_scale(problem.head_dim))

    def run(self, problem: FlashProblem, config: Config, inputs: Tensors, outputs: Tensors, *, scale: float) -> None:
        """`launch` with the softmax scale given (the runtime op passes the user's)."""
        interpret = inputs["q"].device.type == "cpu"
        module = load_kernel_module(self.template, interpret=interpret, **self.render_switches(problem, config))
        meta = {"num_warps": config["num_warps"], "num_stages": config["num_stages"]}
        dims = {"HEAD_DIM": problem.head_dim, "BLOCK_D": problem.block_d}
        with interpreter_mode(interpret):
            if problem.direction == "fwd":
                self._forward(module, problem, config, inputs, outputs, scale, interpret, dims, meta)
            else:
                self._backward(module, problem, config, inputs, outputs, scale, dims, meta)

    @staticmethod
    def _forward(module, p: FlashProblem, config: Config, inputs: Tensors, outputs: Tensors, scale: float,
                 interpret: bool, dims: dict, meta: dict) -> None:
        q, k, v, o, lse = inputs["q"], inputs["k"], inputs["v"], outputs["o"], outputs["lse"]
        if config["LOADS"] == "tma" and not interpret:
            from autotile.device import ensure_triton_allocator

            ensure_triton_allocator()
        grid = (_cdiv(p.seq_q, config["BLOCK_M"]), p.batch * p.heads_q)
        launch_kernel(
            module.attn_fwd, grid, q, k, v, o, lse, inputs.get("descale", lse),
            *_strides(q), *_strides(k), *_strides(v), *_strides(o),
            p.batch, p.heads_q, p.heads_kv, p.seq_q, p.seq_k, scale,
            BLOCK_M=config["BLOCK_M"], BLOCK_N=config["BLOCK_N"], WARP_SPECIALIZE=config["WARP_SPECIALIZE"],
            **dims, **meta,
        )

    @staticmethod
    def _backward(module, p: FlashProblem, config: Config, inputs: Tensors, outputs: Tensors, scale: float,
                  dims: dict, meta: dict) -> None:
        q, k, v, o, do, lse = (inputs[n] for n in ("q", "k", "v", "o", "do", "lse"))
        dq, dk, dv = outputs["dq"], outputs["dk"], outputs["dv"]
        delta = torch.empty_like(lse)  # (B, Hq, Sq) fp32: rowsum(dO * O)
        rows_grid = (_cdiv(p.seq_q, config["BLOCK_M2"]), p.batch * p.heads_q)
        launch_kernel(module.attn_bwd_preprocess, rows_grid, o, do, delta, *_strides(o), *_strides(do),
                      p.heads_q, p.seq_q, BLOCK_M=config["BLOCK_M2"], **dims, **meta)
        launch_kernel(
            module.attn_bwd_dkdv, (_cdiv(p.seq_k, config["BLOCK_N1"]), p.batch * p.heads_kv),
            q, k, v, do, dk, dv, lse, delta,
            *_strides(q), *_strides(k), *_strides(v), *_strides(do), *_strides(dk), *_strides(dv),
            p.heads_q, p.heads_kv, p.seq_q, p.seq_k, scale,
            BLOCK_M1=config["BLOCK_M1"], BLOCK_N1=config["BLOCK_N1"], **dims, **meta,
        )
        launch_kernel(
            module.attn_bwd_dq, rows_grid, q, k, v, do, dq, lse, delta,
            *_strides(q), *_strides(k), *_strides(v), *_strides(do), *_strides(dq),
            p.heads_q, p.heads_kv, p.seq_q, p.seq_k, scale,
            BLOCK_M2=config["BLOCK_M2"], BLOCK_N2=config["BLOCK_N2"], **dims, **meta,
        )


FAMILY = FlashFamily()
