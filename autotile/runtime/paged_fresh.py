"""Chunked prefill of fresh prompts: when no sequence has a cached prefix, attend over the new tokens directly.

A prefill step whose sequences all start from an empty cache attends, for each sequence, over exactly
the new tokens the call is given (`k_new`, `v_new`), causally. That is dense causal self-attention, so
the step runs as `autotile.flash_attention` on the packed tokens viewed as (B, H, S, D), which serves
the fastest of the tuned kernels and SDPA's backends for the shape, while the new K/V are still written
into their pages for the decode steps that follow. FlashInfer makes the same split (its ragged-KV
prefill for new tokens beside the paged one for cached prefixes).

Host integers decide it, so a run stays free of device reads: under the run contract (q_len_b <=
context_lens[b] <= max_context), T = B * max_context new tokens can only mean that every sequence has
exactly max_context new tokens and nothing cached. Batches of unequal fresh prompts, and any step with a
cached prefix, go to the paged prefill kernel. An fp8 cache never takes this path: attention must see
the quantised values the pages hold, not the new tokens as given.
"""
from __future__ import annotations

import torch


def is_fresh_uniform(q: torch.Tensor, k_new, v_new, k_cache: torch.Tensor, batch: int, max_context: int | None) -> bool:
    """Whether every one of the `batch` sequences has exactly `max_context` new tokens and no cached prefix, and
    the new K/V are at hand in the cache's own dtype (so attending over them equals attending over the pages)."""
    return (k_new is not None and v_new is not None and max_context is not None and batch > 0
            and q.shape[0] == batch * max_context
            and q.dtype == k_cache.dtype == k_new.dtype == v_new.dtype
            and k_new.dim() == 3 and k_new.shape[0] == q.shape[0] and v_new.shape == k_new.shape)


def fresh_prefill(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, batch: int, scale: float,
                  return_lse: bool, out: torch.Tensor | None = None, lse: torch.Tensor | None = None, *,
                  softcap: float = 0.0, window: int = -1):
    """Causal attention of each sequence's new tokens over themselves: q (T, Hq, D), k_new/v_new (T, Hkv, D)
    packed by sequence, T = batch * S, soft-capped and windowed as the paged kernels are. Returns out (T, Hq, D),
    or (out, lse (T, Hq) float32, natural log)."""
    from autotile.runtime.ops_flash import flash_attention  # (the flash runtime imports this package)

    tokens, heads, dim = q.shape
    seq = tokens // batch

    def dense(t):  # (T, H, D) -> (B, H, S, D), a view
        return t.view(batch, seq, t.shape[1], dim).transpose(1, 2)

    result = flash_attention(dense(q), dense(k_new), dense(v_new), causal=True, scale=scale, return_lse=return_lse,
                             window=(window, 0) if window >= 0 else None, softcap=softcap)
    o, row_lse = result if return_lse else (result, None)
    packed = o.transpose(1, 2).reshape(tokens, heads, dim)  # a view when the backend wrote (B, S, H, D)
    if out is not None:
        out.copy_(packed)
        packed = out
    if not return_lse:
        return packed
    packed_lse = row_lse.transpose(1, 2).reshape(tokens, heads)
    if lse is not None:
        lse.copy_(packed_lse)
        packed_lse = lse
    return packed, packed_lse
