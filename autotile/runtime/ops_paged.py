"""`autotile.paged_attention`: decode attention through a block table, as the torch.library op autotile::paged_attention.

CUDA tensors run the tuned kernel (user database, shipped winners, or the
family's default config); CPU tensors run the same generated kernel under
Triton's interpreter.

>>> import torch, autotile
>>> from autotile.kvcache import PagedKVCache
>>> cache = PagedKVCache(num_layers=1, num_pages=8, page_size=16, num_kv_heads=1, head_dim=64)
>>> for seq, n in (("a", 20), ("b", 37)):
...     cache.allocate(seq)
...     _ = cache.append(seq, torch.randn(n, 1, 64), torch.randn(n, 1, 64))
>>> q = torch.randn(2, 4, 64, dtype=torch.float16)
>>> out = autotile.paged_attention(q, cache.k_pools[0], cache.v_pools[0],
...                                cache.block_table(["a", "b"]), cache.context_lens(["a", "b"]))
>>> out.shape
torch.Size([2, 4, 64])
"""
from __future__ import annotations

import math

import torch

from autotile.device import DeviceInfo, current_device
from autotile.dtypes import canonical_dtype_name
from autotile.errors import BadInputError, ShapeMismatchError, UnsupportedDtypeError
from autotile.families.paged import CACHE_DTYPES, FAMILY, QUERY_DTYPES, PagedFamily, PagedProblem, cdiv, context_bucket
from autotile.runtime.eager import direct_call_ok

__all__ = ["paged_attention", "problem_for"]


def _check_layout(q, k_cache, v_cache, block_table, context_lens) -> None:
    """Ranks, shapes, dtypes and devices: everything that can be checked without reading values."""
    if q.dim() not in (3, 4):
        raise ShapeMismatchError(
            f"q must be (B, Hq, D), or (B, Q, Hq, D) for Q speculative query tokens, got {tuple(q.shape)}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dim() != 4:
            raise ShapeMismatchError(f"{name} must be (num_pages, page_size, Hkv, D), got {tuple(t.shape)}")
    if k_cache.shape != v_cache.shape:
        raise ShapeMismatchError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must have one shape")
    batch, heads, dim = q.shape[0], q.shape[-2], q.shape[-1]
    if k_cache.shape[-1] != dim:
        raise ShapeMismatchError(f"q has head dim {dim} but the caches {k_cache.shape[-1]}")
    if heads % k_cache.shape[2]:
        raise ShapeMismatchError(
            f"q has {heads} heads and the caches {k_cache.shape[2]} KV heads: Hq must be a multiple of Hkv (GQA/MQA)")
    if block_table.dim() != 2 or block_table.shape[0] != batch:
        raise ShapeMismatchError(f"block_table must be (B={batch}, max_pages), got {tuple(block_table.shape)}")
    if block_table.shape[1] == 0:
        raise ShapeMismatchError("block_table has no columns: every sequence needs at least one page")
    if context_lens.dim() != 1 or context_lens.shape[0] != batch:
        raise ShapeMismatchError(f"context_lens must be (B={batch},), got {tuple(context_lens.shape)}")
    for name, t in (("block_table", block_table), ("context_lens", context_lens)):
        if t.dtype != torch.int32:
            raise UnsupportedDtypeError(f"{name} must be int32, got {t.dtype}; pass {name}.to(torch.int32)")
    devices = {t.device for t in (q, k_cache, v_cache, block_table, context_lens)}
    if len(devices) != 1:
        raise BadInputError(f"q, caches, block_table and context_lens are on {sorted(map(str, devices))}: move them to one device")
    if canonical_dtype_name(q.dtype) not in QUERY_DTYPES:
        raise UnsupportedDtypeError(f"q must be one of {QUERY_DTYPES}, got {q.dtype}")
    if k_cache.dtype != v_cache.dtype:
        raise UnsupportedDtypeError(f"k_cache is {k_cache.dtype} and v_cache {v_cache.dtype}: store both in one dtype")
    kv = canonical_dtype_name(k_cache.dtype) if k_cache.dtype in (torch.float16, torch.bfloat16, torch.float8_e4m3fn) else None
    if kv not in CACHE_DTYPES or (kv != "fp8" and k_cache.dtype != q.dtype):
        raise UnsupportedDtypeError(
            f"caches must be in q's dtype ({q.dtype}) or float8_e4m3fn with k_scale/v_scale, got {k_cache.dtype}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise BadInputError(f"{name} must have unit stride along the head dim (pages may be strided otherwise)")


def _scale_tensor(scale, name: str, heads: int, device: torch.device) -> torch.Tensor:
    """A per-tensor float, a 1-element tensor or a (Hkv,) tensor -> (Hkv,) float32 on the device."""
    t = torch.as_tensor(scale, dtype=torch.float32, device=device).reshape(-1)
    if t.numel() == 1:
        return t.expand(heads).contiguous()
    if t.numel() != heads:
        raise ShapeMismatchError(f"{name} must hold one value or one per KV head ({heads}), got {t.numel()}")
    return t.contiguous()


def _fp8_scales(k_cache, k_scale, v_scale) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    if fp8 and (k_scale is None or v_scale is None):
        raise BadInputError("an fp8 cache needs k_scale and v_scale (per tensor or per KV head): stored values times "
                            "the scale are the real K and V")
    if not fp8 and (k_scale is not None or v_scale is not None):
        raise BadInputError(f"k_scale/v_scale apply to fp8 caches only; these caches are {k_cache.dtype}")
    if not fp8:
        return None, None
    heads = k_cache.shape[2]
    return (_scale_tensor(k_scale, "k_scale", heads, k_cache.device),
            _scale_tensor(v_scale, "v_scale", heads, k_cache.device))


def _problem(q4, k_cache, block_table, context_lens) -> PagedProblem:
    """The problem of one call; reads the context lengths (one device sync) and checks them against the table."""
    num_queries = q4.shape[1]
    page_size = k_cache.shape[1]
    pages_in_use = (torch.arange(block_table.shape[1], device=block_table.device)[None, :]
                    < (context_lens[:, None] + page_size - 1) // page_size)
    used = torch.where(pages_in_use, block_table, 0)
    longest, shortest, total, top_page, bottom_page = torch.stack(
        [context_lens.max(), context_lens.min(), context_lens.sum(dtype=torch.int64), used.max(), used.min()]).tolist()
    if shortest < num_queries:
        raise ShapeMismatchError(
            f"every context must hold its {num_queries} query token(s) (the queries are its last positions); "
            f"the shortest context_lens entry is {shortest}")
    if longest > block_table.shape[1] * page_size:
        raise ShapeMismatchError(
            f"a context of {longest} tokens needs {cdiv(longest, page_size)} pages but block_table has "
            f"{block_table.shape[1]} columns of {page_size}-token pages; widen the table")
    if bottom_page < 0 or top_page >= k_cache.shape[0]:
        raise BadInputError(
            f"block_table points at page {top_page if top_page >= k_cache.shape[0] else bottom_page} within the "
            f"contexts, outside the cache's {k_cache.shape[0]} pages")
    batch = q4.shape[0]
    # Nearby serving shapes share a winner: context lengths are filed under the next power of two.
    longest_bucket = context_bucket(longest)
    mean_bucket = min(context_bucket(max(num_queries, round(total / batch))), longest_bucket)
    return PagedProblem(
        batch=batch, num_q_heads=q4.shape[2], num_kv_heads=k_cache.shape[2], head_dim=q4.shape[3],
        page_size=page_size, max_context=longest_bucket, mean_context=mean_bucket, num_queries=num_queries,
        dtype=canonical_dtype_name(q4.dtype), kv_dtype=canonical_dtype_name(k_cache.dtype))


def problem_for(q, k_cache, v_cache, block_table, context_lens, *, scale=None, k_scale=None, v_scale=None
                ) -> tuple[PagedFamily, PagedProblem, DeviceInfo]:
    """(family, problem, device) of a call, for autotile.explain("paged_attention", ...)."""
    _check_layout(q, k_cache, v_cache, block_table, context_lens)
    _fp8_scales(k_cache, k_scale, v_scale)
    q4 = q if q.dim() == 4 else q.unsqueeze(1)
    return FAMILY, _problem(q4, k_cache, block_table, context_lens), current_device(q.device)


def _resolve_config(problem: PagedProblem, device: DeviceInfo):
    from autotile.runtime.dispatch import resolve

    return resolve(FAMILY, problem, device).config


def _execute(q, k_cache, v_cache, block_table, context_lens, scale: float, k_scale, v_scale) -> torch.Tensor:
    # q: (B, Q, Hq, D) here; the public function adds and removes the Q axis of plain decode.
    q = q if q.stride(-1) == 1 else q.contiguous()
    block_table = block_table if block_table.stride(-1) == 1 else block_table.contiguous()
    context_lens = context_lens.contiguous()
    problem = _problem(q, k_cache, block_table, context_lens)
    device = current_device(q.device)
    inputs = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "block_table": block_table,
              "context_lens": context_lens, "scale": torch.tensor(scale, dtype=torch.float64)}
    if k_scale is not None:
        inputs["k_scale"], inputs["v_scale"] = k_scale, v_scale
    outputs = FAMILY.allocate_outputs(problem, inputs)
    FAMILY.launch(problem, _resolve_config(problem, device), inputs, outputs)
    return outputs["out"]


@torch.library.custom_op("autotile::paged_attention", mutates_args=())
def _paged_attention_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                        context_lens: torch.Tensor, scale: float, k_scale: torch.Tensor | None,
                        v_scale: torch.Tensor | None) -> torch.Tensor:
    return _execute(q, k_cache, v_cache, block_table, context_lens, scale, k_scale, v_scale)


@_paged_attention_op.register_fake
def _(q, k_cache, v_cache, block_table, context_lens, scale, k_scale, v_scale):
    return torch.empty_like(q)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                    context_lens: torch.Tensor, *, scale: float | None = None,
                    k_scale: float | torch.Tensor | None = None, v_scale: float | torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one (or Q speculative) query token(s) per sequence over a paged KV cache.

    q (B, Hq, D), or (B, Q, Hq, D) whose Q queries are the last Q positions of each context (causal
    among themselves); k_cache, v_cache (num_pages, page_size, Hkv, D) with Hq a multiple of Hkv;
    block_table (B, max_pages) int32, physical page of each sequence's logical page; context_lens
    (B,) int32, tokens of each sequence (its queries included). fp8 (e4m3) caches need k_scale and
    v_scale, one float or one per KV head, that multiply stored values back. `scale` defaults to
    1/sqrt(D). Returns a tensor shaped and typed like q. See the module docstring for an example.
    """
    _check_layout(q, k_cache, v_cache, block_table, context_lens)
    k_scale_t, v_scale_t = _fp8_scales(k_cache, k_scale, v_scale)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    q4 = q if q.dim() == 4 else q.unsqueeze(1)
    args = (q4, k_cache, v_cache, block_table, context_lens, scale, k_scale_t, v_scale_t)
    # Eager calls of plain tensors skip the dispatcher (decode steps are short kernels).
    out = _execute(*args) if direct_call_ok(*args) else _paged_attention_op(*args)
    return out if q.dim() == 4 else out.squeeze(1)
