"""Attention in plain torch: the flash family's references and FlashAttention's accuracy rule.

Nothing here touches Triton. `Scores` says what the logits go through besides the scale (the
causal mask, a sliding window, logit soft-capping, ALiBi), with FlashAttention's conventions:
- masks are aligned to the bottom-right: with diag = Sk - Sq, query i sees key j when
  i + diag - left <= j <= i + diag + right (causal: right = 0; -1: that side unbounded);
- soft-capping maps x = scale * q.k to softcap * tanh(x / softcap), before the ALiBi bias;
- ALiBi adds -slope[h] * |i + diag - j| to head h's logits;
- rows that see no key give 0 (and lse = +inf).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from autotile.families.base import CheckResult

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
# Score elements of one chunk in the plain-torch computations: 2**27 (1 GiB in float64, a few
# copies alive at once) keeps the references of the 16k-token anchor shapes inside GPU memory.
_CHUNK_SCORES = 2**27


@dataclass(frozen=True)
class Scores:
    """What the scaled logits go through: mask (causal, sliding window) and soft-capping. ALiBi slopes are data."""

    causal: bool = False
    window_left: int = -1  # keys more than this many positions before the diagonal are masked; -1: none
    window_right: int = -1  # keys more than this many positions after the diagonal are masked; -1: none
    softcap: float = 0.0  # > 0: x -> softcap * tanh(x / softcap)

    @property
    def right(self) -> int:
        """How far right of the diagonal a row sees; -1 when unbounded (causal overrides the window, as in FlashAttention)."""
        return 0 if self.causal else self.window_right

    @property
    def masked(self) -> bool:
        return self.right >= 0 or self.window_left >= 0


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


def seen_mask(seq_q: int, seq_k: int, device, scores: Scores) -> torch.Tensor | None:
    """(Sq, Sk) bool: query i sees key j; None when every query sees every key."""
    if not scores.masked:
        return None
    rows = torch.arange(seq_q, device=device)[:, None]
    cols = torch.arange(seq_k, device=device)[None, :]
    seen = torch.ones(seq_q, seq_k, dtype=torch.bool, device=device)
    if scores.right >= 0:
        seen &= cols <= rows + (seq_k - seq_q) + scores.right
    if scores.window_left >= 0:
        seen &= cols >= rows + (seq_k - seq_q) - scores.window_left
    return seen


def causal_seen(seq_q: int, seq_k: int, device) -> torch.Tensor:
    """(Sq, Sk) bool: query i sees key j <= i + Sk - Sq."""
    return seen_mask(seq_q, seq_k, device, Scores(causal=True))


def seen_pairs(seq_q: int, seq_k: int, causal: bool, window_left: int = -1, window_right: int = -1) -> int:
    """(query, key) pairs that take part, under the bottom-right causal mask and/or a sliding window."""
    scores = Scores(causal, window_left, window_right)
    if not scores.masked:
        return seq_q * seq_k
    diag = seq_k - seq_q
    rows = torch.arange(seq_q, dtype=torch.int64)
    # Row i sees keys [max(0, i + diag - left), min(Sk - 1, i + diag + right)], when that range is not empty.
    lo = (rows + diag - scores.window_left).clamp_min(0) if scores.window_left >= 0 else torch.zeros_like(rows)
    hi = (rows + diag + scores.right).clamp_max(seq_k - 1) if scores.right >= 0 else torch.full_like(rows, seq_k - 1)
    return int((hi - lo + 1).clamp_min(0).sum())


def alibi_bias(slopes: torch.Tensor, seq_q: int, seq_k: int, dtype: torch.dtype) -> torch.Tensor:
    """(B or 1, Hq, Sq, Sk): -slope * |i + Sk - Sq - j|, from slopes of shape (Hq,) or (B, Hq)."""
    rows = torch.arange(seq_q, device=slopes.device, dtype=dtype)[:, None]
    cols = torch.arange(seq_k, device=slopes.device, dtype=dtype)[None, :]
    distance = (rows + (seq_k - seq_q) - cols).abs()
    slopes = slopes.to(dtype)
    slopes = slopes[None] if slopes.dim() == 1 else slopes
    return -slopes[:, :, None, None] * distance


def _logits(q, k, *, scale: float, scores: Scores, alibi_slopes, dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scaled, soft-capped, biased logits (B, Hq, Sq, Sk) in float32 or wider, and the seen mask (None: all seen)."""
    group = q.shape[1] // k.shape[1]
    k = k.to(dtype).repeat_interleave(group, dim=1)
    soft_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    x = (torch.matmul(q.to(dtype), k.transpose(-1, -2)) * scale).to(soft_dtype)
    if scores.softcap > 0:
        x = scores.softcap * torch.tanh(x / scores.softcap)
    if alibi_slopes is not None:
        x = x + alibi_bias(alibi_slopes, q.shape[2], k.shape[2], soft_dtype)
    return x, seen_mask(q.shape[2], k.shape[2], q.device, scores)


def attention_math(q, k, v, *, causal: bool = False, scale: float, dtype: torch.dtype, scores: Scores | None = None,
                   alibi_slopes: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(scale * Q K^T) V in plain torch with matmuls in `dtype` and the softmax in float32 or wider.

    Differentiable; GQA by repeating K/V heads; rows that see no key give 0. `scores` (a Scores)
    replaces `causal` when given.
    """
    scores = scores or Scores(causal=causal)
    group = q.shape[1] // k.shape[1]
    x, seen = _logits(q, k, scale=scale, scores=scores, alibi_slopes=alibi_slopes, dtype=dtype)
    v = v.to(dtype).repeat_interleave(group, dim=1)
    if seen is not None:
        empty = ~seen.any(dim=1, keepdim=True)  # (Sq, 1)
        # Empty rows softmax over zeros instead of all -inf (no NaN in values or gradients), then are zeroed.
        x = x.masked_fill(~seen, float("-inf")).masked_fill(empty, 0.0)
        probs = torch.softmax(x, dim=-1).masked_fill(~seen, 0.0)
    else:
        probs = torch.softmax(x, dim=-1)
    return torch.matmul(probs.to(dtype), v)


def log2_sum_exp(q, k, *, causal: bool = False, scale: float, scores: Scores | None = None,
                 alibi_slopes: torch.Tensor | None = None) -> torch.Tensor:
    """(B, Hq, Sq) log2-domain log-sum-exp of the logits, float32 (float64 for float64 inputs); +inf for rows that see no key."""
    scores = scores or Scores(causal=causal)
    wide = torch.float64 if q.dtype == torch.float64 else torch.float32
    x, seen = _logits(q, k, scale=scale, scores=scores, alibi_slopes=alibi_slopes, dtype=wide)
    if seen is not None:
        x = x.masked_fill(~seen, float("-inf"))
    lse = torch.logsumexp(x, dim=-1) * LOG2E
    return torch.where(torch.isneginf(lse), torch.full_like(lse, float("inf")), lse)


def map_head_chunks(fn, q, k, v, *q_side):
    """`fn(q, k, v, *q_side)` over chunks of (one batch entry, a run of key/value heads with their query heads).

    `q_side` tensors have (batch, query heads) as their first two dims (dO, ALiBi slopes of shape (B, Hq)).
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


def per_batch_slopes(alibi_slopes: torch.Tensor | None, batch: int) -> torch.Tensor | None:
    """ALiBi slopes as (B, Hq), whatever of (Hq,) or (B, Hq) was given."""
    if alibi_slopes is None:
        return None
    return alibi_slopes.expand(batch, -1) if alibi_slopes.dim() == 1 else alibi_slopes


def attention_grads(q, k, v, do, *, causal: bool = False, scale: float, dtype: torch.dtype, scores: Scores | None = None,
                    alibi_slopes: torch.Tensor | None = None, dlse: torch.Tensor | None = None):
    """dq, dk, dv of attention_math at `dtype`, by autograd, chunk by chunk.

    `dlse` (B, Hq, Sq), natural-log units: the gradient of the log-sum-exp as well (return_lse=True).
    """
    scores = scores or Scores(causal=causal)
    side = [do]
    slopes = per_batch_slopes(alibi_slopes, q.shape[0])
    if slopes is not None:
        side.append(slopes)
    if dlse is not None:
        side.append(dlse)

    def one_chunk(q, k, v, do, *rest):
        rest = list(rest)
        chunk_slopes = rest.pop(0)[0] if slopes is not None else None
        chunk_dlse = rest.pop(0) if dlse is not None else None
        q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
        with torch.enable_grad():
            o = attention_math(q, k, v, scale=scale, dtype=dtype, scores=scores,
                               alibi_slopes=None if chunk_slopes is None else chunk_slopes[None])
            outputs, grads = [o], [do.to(o.dtype)]
            if chunk_dlse is not None:
                x, seen = _logits(q, k, scale=scale, scores=scores, dtype=dtype,
                                  alibi_slopes=None if chunk_slopes is None else chunk_slopes[None])
                if seen is not None:
                    x = x.masked_fill(~seen, float("-inf"))
                lse = torch.logsumexp(x, dim=-1)
                # Rows that see no key have lse = -inf here (+inf in the kernels) and no gradient.
                lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
                outputs.append(lse)
                grads.append(chunk_dlse.to(lse.dtype))
            return torch.autograd.grad(outputs, (q, k, v), grads)
    return map_head_chunks(one_chunk, q, k, v, *side)


def plain_fp8_forward(q8, k8, v8, descale: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    """What fp8 attention does in plain torch: dequantised Q/K/V, unnormalised P rounded to e4m3 for P V."""
    descale = descale.double()

    def one_chunk(q8, k8, v8):
        group = q8.shape[1] // k8.shape[1]
        q = q8.double() * descale[0]
        k = k8.double().repeat_interleave(group, dim=1) * descale[1]
        v = v8.double().repeat_interleave(group, dim=1)
        x = torch.matmul(q, k.transpose(-1, -2)) * scale
        if causal:
            x = x.masked_fill(~causal_seen(q.shape[2], k.shape[2], q.device), float("-inf"))
        row_max = x.amax(dim=-1, keepdim=True).nan_to_num(0.0, neginf=0.0)
        p = torch.exp(x - row_max)  # (B, Hq, Sq, Sk) in [0, 1]
        l = p.sum(dim=-1, keepdim=True)
        out = torch.matmul(p.to(torch.float8_e4m3fn).double(), v) * descale[2]
        return torch.where(l > 0, out / l.clamp_min(1e-300), torch.zeros_like(out))
    return map_head_chunks(one_chunk, q8, k8, v8)


# --- packed (varlen) sequences ------------------------------------------------------------------------
def split_packed(t: torch.Tensor, cu_seqlens: torch.Tensor) -> list[torch.Tensor]:
    """(total, H, D) packed rows -> one (1, H, len, D) tensor per sequence."""
    bounds = [int(x) for x in cu_seqlens.tolist()]
    return [t[a:b].transpose(0, 1)[None] for a, b in zip(bounds[:-1], bounds[1:])]


def join_packed(parts: list[torch.Tensor]) -> torch.Tensor:
    """Inverse of split_packed: (1, H, len, D) tensors -> (total, H, D)."""
    return torch.cat([p[0].transpose(0, 1) for p in parts], dim=0)


# --- the accuracy rule ---------------------------------------------------------------------------------
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
