"""`autotile.paged_attention` and `autotile.paged_prefill`: the one-call forms of the paged plans.

Each call finds (or makes, once per step shape) a plan of autotile/runtime/paged_plan.py and
runs it. CUDA tensors run the tuned kernel (user database, shipped winners, or the family's
default config); CPU tensors run the same generated kernel under Triton's interpreter. The ops
are the torch.library custom ops autotile::paged_attention and autotile::paged_prefill.

What a call costs on the host: with `max_context=` (a host int bounding this step's context
lengths) nothing reads the device, so the call can run under a CUDA graph (warm it up once
first: the first call of a step shape compiles and allocates the plan's workspace). Without it,
the call reads the lengths and the block table's extent back (a few small reductions and one
device-to-host copy, which waits for the queued work) and checks them, as AUTOTILE_CHECKS=1 does.

>>> import torch, autotile
>>> from autotile.kvcache import PagedKVCache
>>> cache = PagedKVCache(num_layers=1, num_pages=8, page_size=16, num_kv_heads=1, head_dim=64)
>>> for seq, n in (("a", 20), ("b", 37)):
...     cache.allocate(seq)
...     _ = cache.append(seq, torch.randn(n, 1, 64), torch.randn(n, 1, 64))
>>> q = torch.randn(2, 4, 64, dtype=torch.float16)
>>> out = autotile.paged_attention(q, cache.k_pools[0], cache.v_pools[0],
...                                cache.block_table(["a", "b"]), cache.context_lens(["a", "b"]), max_context=64)
>>> out.shape
torch.Size([2, 4, 64])
"""
from __future__ import annotations

import collections
import threading

import torch

from autotile.device import DeviceInfo
from autotile.dtypes import canonical_dtype_name
from autotile.errors import BadInputError, ShapeMismatchError, UnsupportedDtypeError
from autotile.families.base import host_int
from autotile.families.paged import CACHE_DTYPES, FAMILY, QUERY_DTYPES, PagedFamily, PagedProblem, context_bucket
from autotile.runtime import paged_plan
from autotile.runtime.eager import direct_call_ok, under_transform
from autotile.runtime.paged_fresh import fresh_prefill, is_fresh_uniform

__all__ = ["paged_attention", "paged_prefill", "problem_for", "paged_prefill_problem_for", "served_config",
           "paged_prefill_served_config"]

# What a decode or prefill plan runs for a resolved config (autotile.explain reports it).
served_config = paged_plan.served_config
paged_prefill_served_config = paged_plan.served_prefill_config


def _check_layout(q, k_cache, v_cache, block_table, context_lens) -> None:
    """Ranks, shapes, dtypes and devices: everything that can be checked without reading values."""
    paged_plan.require_tensors(q=q, k_cache=k_cache, v_cache=v_cache, block_table=block_table,
                               context_lens=context_lens)
    if q.dim() not in (3, 4):
        raise ShapeMismatchError(
            f"q must be (B, Hq, D), or (B, Q, Hq, D) for Q speculative query tokens, got {tuple(q.shape)}")
    _check_caches(q, k_cache, v_cache)
    batch = q.shape[0]
    if block_table.dim() != 2 or block_table.shape[0] != batch:
        raise ShapeMismatchError(f"block_table must be (B={batch}, max_pages), got {tuple(block_table.shape)}")
    if block_table.shape[1] == 0:
        raise ShapeMismatchError("block_table has no columns: every sequence needs at least one page")
    if context_lens.dim() != 1 or context_lens.shape[0] != batch:
        raise ShapeMismatchError(f"context_lens must be (B={batch},), got {tuple(context_lens.shape)}")
    _check_index_tensors(q, k_cache, block_table=block_table, context_lens=context_lens)


def _check_caches(q, k_cache, v_cache) -> None:
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dim() != 4:
            raise ShapeMismatchError(f"{name} must be (num_pages, page_size, Hkv, D), got {tuple(t.shape)}")
    if k_cache.shape != v_cache.shape:
        raise ShapeMismatchError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must have one shape")
    heads, dim = q.shape[-2], q.shape[-1]
    if k_cache.shape[-1] != dim:
        raise ShapeMismatchError(f"q has head dim {dim} but the caches {k_cache.shape[-1]}")
    if heads % k_cache.shape[2]:
        raise ShapeMismatchError(
            f"q has {heads} heads and the caches {k_cache.shape[2]} KV heads: Hq must be a multiple of Hkv (GQA/MQA); "
            f"caches are (num_pages, page_size, Hkv, D), vLLM's layout (FlashInfer's NHD): pass an HND cache as "
            f"cache.transpose(1, 2)")
    if canonical_dtype_name(q.dtype) not in QUERY_DTYPES:
        raise UnsupportedDtypeError(f"q must be one of {QUERY_DTYPES}, got {q.dtype}: cast q (and 16-bit caches) to "
                                    f"one, e.g. q.to(torch.bfloat16)")
    if k_cache.dtype != v_cache.dtype:
        raise UnsupportedDtypeError(f"k_cache is {k_cache.dtype} and v_cache {v_cache.dtype}: store both in one dtype")
    kv = canonical_dtype_name(k_cache.dtype) if k_cache.dtype in (torch.float16, torch.bfloat16, torch.float8_e4m3fn) else None
    if kv not in CACHE_DTYPES or (kv != "fp8" and k_cache.dtype != q.dtype):
        raise UnsupportedDtypeError(
            f"caches must be in q's dtype ({q.dtype}) or float8_e4m3fn with k_scale/v_scale, got {k_cache.dtype}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise BadInputError(f"{name} must have unit stride along the head dim (pages may be strided otherwise)")


def _check_index_tensors(q, k_cache, **tensors) -> None:
    for name, t in tensors.items():
        if t.dtype != torch.int32:
            raise UnsupportedDtypeError(f"{name} must be int32, got {t.dtype}; pass {name}.to(torch.int32)")
    devices = {t.device for t in (q, k_cache, *tensors.values())}
    if len(devices) != 1:
        raise BadInputError(f"q, the caches and {', '.join(tensors)} are on {sorted(map(str, devices))}: "
                            "move them to one device")


def _scale_tensor(scale, name: str, heads: int, device: torch.device) -> torch.Tensor:
    """A per-tensor float, a 1-element tensor or a (Hkv,) tensor -> (Hkv,) float32 on the device.

    A Python float costs a host-to-device copy: sync-free callers pass (Hkv,) float32 device tensors.
    """
    if not isinstance(scale, torch.Tensor):
        # A host number costs nothing to check. Writes divide by the scale, reads multiply by it: a zero,
        # negative or non-finite one stores NaN or clamped garbage and every read comes back wrong.
        _check_positive(torch.as_tensor(scale, dtype=torch.float64).reshape(-1), name)
    elif paged_plan.checks_on(scale.device):
        _check_positive(scale.detach().reshape(-1), name)
    if (isinstance(scale, torch.Tensor) and scale.shape == (heads,) and scale.dtype == torch.float32
            and scale.device == device and scale.stride(0) == 1):
        return scale
    t = torch.as_tensor(scale, dtype=torch.float32, device=device).reshape(-1)
    if t.numel() == 1:
        return t.expand(heads).contiguous()
    if t.numel() != heads:
        raise ShapeMismatchError(f"{name} must hold one value or one per KV head ({heads}), got {t.numel()}")
    return t.contiguous()


def _check_positive(values: torch.Tensor, name: str) -> None:
    """Refuses a scale that is zero, negative or not finite (reads a device tensor: checked runs only)."""
    if not bool(torch.isfinite(values).all() and (values > 0).all()):
        raise BadInputError(f"{name} must be finite and > 0 (a head's amax / 448 is the usual choice), "
                            f"got {values.tolist()}")


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


def _max_context(max_context) -> int | None:
    if max_context is None:
        return None
    # Any host integer (a NumPy one from an engine's metadata too), never a tensor: reading one back would sync.
    value = host_int(max_context)
    if value is None or value < 1:
        raise BadInputError(f"max_context must be a host int >= 1 (an upper bound on this step's context lengths), "
                            f"got {max_context!r}")
    return value


# --- plans kept for the one-call forms ------------------------------------------------------------

_PLAN_CACHE_SIZE = 64
_plans: collections.OrderedDict = collections.OrderedDict()
_plans_lock = threading.Lock()


def _cached_plan(key: tuple, make):
    with _plans_lock:
        plan = _plans.get(key)
        if plan is not None:
            _plans.move_to_end(key)
            return plan
    plan = make()
    with _plans_lock:
        _plans[key] = plan
        while len(_plans) > _PLAN_CACHE_SIZE:
            _plans.popitem(last=False)
    return plan


def clear_plans() -> None:
    """Forget the kept plans (and their workspaces); dispatch.clear_cache calls it, so new winners take effect."""
    with _plans_lock:
        _plans.clear()


def _register_clear_hook() -> None:
    from autotile.runtime.dispatch import on_clear

    on_clear(clear_plans)


_register_clear_hook()


def _decode_plan(q4, k_cache, bound: int, mean: int | None, return_lse: bool, softcap: float = 0.0,
                 window: int = -1) -> paged_plan.PagedAttentionPlan:
    batch, queries, heads, dim = q4.shape
    key = ("decode", q4.device, batch, queries, heads, k_cache.shape[2], dim, k_cache.shape[1], bound, mean,
           q4.dtype, k_cache.dtype, return_lse, softcap, window)
    return _cached_plan(key, lambda: paged_plan.PagedAttentionPlan(
        batch=batch, num_q_heads=heads, num_kv_heads=k_cache.shape[2], head_dim=dim, page_size=k_cache.shape[1],
        max_context=bound, mean_context=mean, dtype=q4.dtype, kv_dtype=k_cache.dtype, num_queries=queries,
        device=q4.device, return_lse=return_lse, checks=False, softcap=softcap, window=window))


def _decode_bounds(q4, k_cache, block_table, context_lens, max_context) -> tuple[int, int | None]:
    """(context bound, mean) of a call: from max_context alone, or read back and checked (one sync)."""
    checks = paged_plan.checks_on(q4.device)
    facts = None
    if max_context is None or checks:
        facts = paged_plan.check_decode_values(block_table, context_lens, k_cache.shape[0], k_cache.shape[1],
                                               max_context, q4.shape[1])
    if max_context is not None:
        return context_bucket(max(max_context, q4.shape[1])), None
    longest, total = facts[0], facts[3]
    bound = context_bucket(max(longest, q4.shape[1]))
    # Nearby serving shapes share a winner: lengths are filed under powers of two.
    return bound, context_bucket(max(q4.shape[1], round(total / q4.shape[0])))


def _execute(q, k_cache, v_cache, block_table, context_lens, scale: float, k_scale, v_scale,
             max_context: int | None, return_lse: bool, softcap: float = 0.0,
             window: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    # q: (B, Q, Hq, D) here; the public function adds and removes the Q axis of plain decode.
    q = q if q.stride(-1) == 1 else q.contiguous()
    block_table = block_table if block_table.stride(-1) == 1 else block_table.contiguous()
    context_lens = context_lens.contiguous()
    bound, mean = _decode_bounds(q, k_cache, block_table, context_lens, max_context)
    plan = _decode_plan(q, k_cache, bound, mean, return_lse, softcap, window)
    result = plan.run(q, k_cache, v_cache, block_table, context_lens, scale=scale, k_scale=k_scale, v_scale=v_scale)
    if return_lse:
        return result
    return result, q.new_empty((0,), dtype=torch.float32)


@torch.library.custom_op("autotile::paged_attention", mutates_args=())
def _paged_attention_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                        context_lens: torch.Tensor, scale: float, k_scale: torch.Tensor | None,
                        v_scale: torch.Tensor | None, max_context: int | None,
                        return_lse: bool, softcap: float = 0.0,
                        window: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    _check_traced_numbers(q, scale, softcap, window)
    return _execute(q, k_cache, v_cache, block_table, context_lens, scale, k_scale, v_scale, max_context, return_lse,
                    softcap, window)


@_paged_attention_op.register_fake
def _(q, k_cache, v_cache, block_table, context_lens, scale, k_scale, v_scale, max_context, return_lse, softcap=0.0,
      window=-1):
    lse_shape = q.shape[:3] if return_lse else (0,)
    return torch.empty_like(q), q.new_empty(lse_shape, dtype=torch.float32)


def _check_traced_numbers(q, scale, softcap, window) -> None:
    """The op's numbers, which torch.compile may have traced as symbols past the call's own checks."""
    paged_plan.finite_scale(scale, q.shape[-1])
    paged_plan.model_features(softcap, window)


def _refuse_autograd(op: str, **tensors) -> None:
    """The paged ops serve inference: a call that would need their gradient is refused up front (it would fail
    at backward time with torch's own message, or inside a torch.func transform)."""
    if not torch.compiler.is_compiling() and under_transform():
        raise BadInputError(f"{op} has no backward and does not run inside torch.func transforms; train with "
                            "autotile.flash_attention(_varlen)")
    if torch.is_grad_enabled():
        wanting = [name for name, t in tensors.items() if isinstance(t, torch.Tensor) and t.requires_grad]
        if wanting:
            raise BadInputError(f"{op} has no backward, but {', '.join(wanting)} requires grad: call it under "
                                "torch.inference_mode() or torch.no_grad(), or detach the inputs; train with "
                                "autotile.flash_attention(_varlen)")


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                    context_lens: torch.Tensor, *, scale: float | None = None,
                    k_scale: float | torch.Tensor | None = None, v_scale: float | torch.Tensor | None = None,
                    max_context: int | None = None, return_lse: bool = False, softcap: float | None = None,
                    window=None):
    """Attention of one (or Q speculative) query token(s) per sequence over a paged KV cache.

    q (B, Hq, D), or (B, Q, Hq, D) whose Q queries are the last Q positions of each context (causal
    among themselves); k_cache, v_cache (num_pages, page_size, Hkv, D) with Hq a multiple of Hkv and
    D a multiple of 8 up to 256; block_table (B, max_pages) int32, physical page of each sequence's
    logical page; context_lens (B,) int32, tokens of each sequence (its queries included; 0 marks a
    padding row, whose output is 0). fp8 (e4m3) caches need k_scale and v_scale, one float or one
    per KV head, that multiply stored values back. `scale` defaults to 1/sqrt(D).

    `max_context` (a host int >= every context length) makes the call sync-free and CUDA-graph
    capturable; without it the call reads the lengths back once (see the module docstring).
    Returns a tensor shaped and typed like q, or (out, lse) with `return_lse=True`: lse (B, Hq) or
    (B, Q, Hq) float32, the natural-log log-sum-exp of each row's scaled logits (see
    autotile.runtime.paged_plan.merge_attention_states). A batch of 0 sequences gives empty outputs.
    `softcap` soft-caps the logits, softcap * tanh(x / softcap) (Gemma-2: 50.0); `window` keeps the keys at most
    `window` positions left of each query (a model's sliding window of W tokens is window=W - 1; (left, 0) is taken
    too). A call without them runs kernels that have neither.
    For many steps of one shape, `autotile.plan_paged_attention` keeps the host work out of the loop.
    """
    _check_layout(q, k_cache, v_cache, block_table, context_lens)
    _refuse_autograd("paged_attention", q=q)
    k_scale_t, v_scale_t = _fp8_scales(k_cache, k_scale, v_scale)
    scale = paged_plan.finite_scale(scale, q.shape[-1])
    max_context = _max_context(max_context)
    softcap, window = paged_plan.model_features(softcap, window)
    if q.shape[0] == 0:
        out = torch.empty_like(q)
        return (out, torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)) if return_lse else out
    q4 = q if q.dim() == 4 else q.unsqueeze(1)
    args = (q4, k_cache, v_cache, block_table, context_lens, scale, k_scale_t, v_scale_t, max_context, bool(return_lse),
            softcap, window)
    # Eager calls of plain tensors skip the dispatcher (decode steps are short kernels).
    out, lse = _execute(*args) if direct_call_ok(*args) else _paged_attention_op(*args)
    if q.dim() == 3:
        out = out.squeeze(1)
        lse = lse.squeeze(1) if return_lse else lse
    return (out, lse) if return_lse else out


# --- chunked prefill ----------------------------------------------------------------------------

def _prefill_plan(q, k_cache, batch: int, bound: int, return_lse: bool, softcap: float = 0.0,
                  window: int = -1) -> paged_plan.PagedPrefillPlan:
    tokens, heads, dim = q.shape
    # Plans are kept per power-of-two bucket of the step's tokens (their config's key).
    bucket = context_bucket(tokens)
    key = ("prefill", q.device, batch, bucket, heads, k_cache.shape[2], dim, k_cache.shape[1], bound, q.dtype,
           k_cache.dtype, return_lse, softcap, window)
    return _cached_plan(key, lambda: paged_plan.PagedPrefillPlan(
        batch=batch, num_tokens=tokens, num_q_heads=heads, num_kv_heads=k_cache.shape[2], head_dim=dim,
        page_size=k_cache.shape[1], max_context=bound, dtype=q.dtype, kv_dtype=k_cache.dtype, device=q.device,
        return_lse=return_lse, checks=False, softcap=softcap, window=window))


def _execute_prefill(q, k_cache, v_cache, block_table, cu_seqlens_q, context_lens, k_new, v_new, slot_mapping,
                     scale: float, k_scale, v_scale, max_context: int | None,
                     return_lse: bool, softcap: float = 0.0, window: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    q = q if q.stride(-1) == 1 else q.contiguous()
    block_table = block_table if block_table.stride(-1) == 1 else block_table.contiguous()
    context_lens, cu_seqlens_q = context_lens.contiguous(), cu_seqlens_q.contiguous()
    batch = context_lens.shape[0]
    if max_context is None or paged_plan.checks_on(q.device):
        facts = paged_plan.check_prefill_values(block_table, cu_seqlens_q, context_lens, k_cache.shape[0],
                                                k_cache.shape[1], max_context, q.shape[0], slot_mapping)
        max_context = max_context or max(facts[0], 1)
    if is_fresh_uniform(q, k_new, v_new, k_cache, batch, max_context):
        paged_plan.write_kv(k_cache, v_cache, slot_mapping, k_new, v_new, k_scale, v_scale)
        result = fresh_prefill(q, k_new, v_new, batch, scale, return_lse, softcap=softcap, window=window)
        return result if return_lse else (result, q.new_empty((0,), dtype=torch.float32))
    plan = _prefill_plan(q, k_cache, batch, context_bucket(max_context), return_lse, softcap, window)
    result = plan.run(q, k_cache, v_cache, block_table, cu_seqlens_q, context_lens, k_new=k_new, v_new=v_new,
                      slot_mapping=slot_mapping, scale=scale, k_scale=k_scale, v_scale=v_scale)
    if return_lse:
        return result
    return result, q.new_empty((0,), dtype=torch.float32)


@torch.library.custom_op("autotile::paged_prefill", mutates_args=("k_cache", "v_cache"))
def _paged_prefill_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                      cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, k_new: torch.Tensor | None,
                      v_new: torch.Tensor | None, slot_mapping: torch.Tensor | None, scale: float,
                      k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, max_context: int | None,
                      return_lse: bool, softcap: float = 0.0,
                      window: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    _check_traced_numbers(q, scale, softcap, window)
    return _execute_prefill(q, k_cache, v_cache, block_table, cu_seqlens_q, context_lens, k_new, v_new, slot_mapping,
                            scale, k_scale, v_scale, max_context, return_lse, softcap, window)


@_paged_prefill_op.register_fake
def _(q, k_cache, v_cache, block_table, cu_seqlens_q, context_lens, k_new, v_new, slot_mapping, scale, k_scale,
      v_scale, max_context, return_lse, softcap=0.0, window=-1):
    lse_shape = q.shape[:2] if return_lse else (0,)
    return torch.empty_like(q), q.new_empty(lse_shape, dtype=torch.float32)


def _check_prefill_layout(q, k_cache, v_cache, block_table, cu_seqlens_q, context_lens) -> int:
    """Ranks, shapes, dtypes and devices of a prefill call (nothing read back); its batch."""
    paged_plan.require_tensors(q=q, k_cache=k_cache, v_cache=v_cache, block_table=block_table,
                               cu_seqlens_q=cu_seqlens_q, context_lens=context_lens)
    if q.dim() != 3:
        raise ShapeMismatchError(f"q must be (T, Hq, D), the new tokens of all sequences packed, got {tuple(q.shape)}")
    _check_caches(q, k_cache, v_cache)
    batch = context_lens.shape[0] if context_lens.dim() == 1 else -1
    if batch < 0 or tuple(cu_seqlens_q.shape) != (batch + 1,):
        raise ShapeMismatchError(f"context_lens must be (B,) and cu_seqlens_q (B + 1,), got "
                                 f"{tuple(context_lens.shape)} and {tuple(cu_seqlens_q.shape)}")
    if block_table.dim() != 2 or block_table.shape[0] != batch or block_table.shape[1] == 0:
        raise ShapeMismatchError(f"block_table must be (B={batch}, max_pages >= 1), got {tuple(block_table.shape)}")
    _check_index_tensors(q, k_cache, block_table=block_table, context_lens=context_lens, cu_seqlens_q=cu_seqlens_q)
    return batch


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                  cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, *, k_new: torch.Tensor | None = None,
                  v_new: torch.Tensor | None = None, slot_mapping: torch.Tensor | None = None,
                  scale: float | None = None, k_scale: float | torch.Tensor | None = None,
                  v_scale: float | torch.Tensor | None = None, max_context: int | None = None,
                  return_lse: bool = False, softcap: float | None = None, window=None):
    """Chunked prefill over a paged KV cache: each new token attends causally to its sequence's whole context.

    q (T, Hq, D) packs the new tokens of B sequences: sequence b's are rows cu_seqlens_q[b] to
    cu_seqlens_q[b+1] - 1 ((B + 1,) int32) and are the last positions of its context of
    context_lens[b] tokens ((B,) int32, the cached prefix plus the new tokens). k_new, v_new
    (T, Hkv, D) and slot_mapping (T,) int64 (from PagedKVCache.reserve) write the new tokens' K and
    V into their pages first; leave them out when the pages already hold them. Caches, block_table,
    scales, `max_context`, `softcap` and `window` as for autotile.paged_attention (without max_context the call
    reads the lengths back once and checks them). Returns out like q, or (out, lse (T, Hq) float32).

    >>> import torch, autotile
    >>> from autotile.kvcache import PagedKVCache
    >>> cache = PagedKVCache(num_layers=1, num_pages=8, page_size=16, num_kv_heads=2, head_dim=64,
    ...                      dtype=torch.float16)
    >>> cache.allocate("a")
    >>> slots = cache.reserve("a", 24)  # a prompt of 24 tokens, nothing cached yet
    >>> k, v = torch.randn(24, 2, 64).half(), torch.randn(24, 2, 64).half()
    >>> out = autotile.paged_prefill(torch.randn(24, 8, 64).half(), cache.k_pools[0], cache.v_pools[0],
    ...                              cache.block_table(["a"]), torch.tensor([0, 24], dtype=torch.int32),
    ...                              cache.context_lens(["a"]), k_new=k, v_new=v, slot_mapping=slots, max_context=64)
    >>> out.shape
    torch.Size([24, 8, 64])
    """
    batch = _check_prefill_layout(q, k_cache, v_cache, block_table, cu_seqlens_q, context_lens)
    _refuse_autograd("paged_prefill", q=q, k_new=k_new, v_new=v_new)
    k_scale_t, v_scale_t = _fp8_scales(k_cache, k_scale, v_scale)
    scale = paged_plan.finite_scale(scale, q.shape[-1])
    max_context = _max_context(max_context)
    softcap, window = paged_plan.model_features(softcap, window)
    if batch == 0 or q.shape[0] == 0:
        out = torch.empty_like(q)
        return (out, torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)) if return_lse else out
    paged_plan.check_new_tokens(k_new, v_new, slot_mapping, q.shape[0])
    if slot_mapping is not None and slot_mapping.dtype == torch.int32:
        slot_mapping = slot_mapping.long()
    args = (q, k_cache, v_cache, block_table, cu_seqlens_q, context_lens, k_new, v_new, slot_mapping, scale,
            k_scale_t, v_scale_t, max_context, bool(return_lse), softcap, window)
    out, lse = _execute_prefill(*args) if direct_call_ok(*args) else _paged_prefill_op(*args)
    return (out, lse) if return_lse else out


# --- explain ------------------------------------------------------------------------------------

def paged_prefill_problem_for(q, k_cache, v_cache, block_table, cu_seqlens_q, context_lens, *, k_new=None,
                              v_new=None, slot_mapping=None, scale=None, k_scale=None, v_scale=None,
                              max_context=None, return_lse=False, softcap=None,
                              window=None) -> tuple[PagedFamily, PagedProblem, DeviceInfo]:
    """(family, problem, device) of an autotile.paged_prefill call's plan, for autotile.explain. A step of fresh
    prompts of one length runs as dense causal attention instead (explain("flash_attention", ...) names that)."""
    batch = _check_prefill_layout(q, k_cache, v_cache, block_table, cu_seqlens_q, context_lens)
    if batch == 0:
        raise ShapeMismatchError("a prefill step of no sequences runs nothing: there is no problem to explain")
    _fp8_scales(k_cache, k_scale, v_scale)
    max_context = _max_context(max_context)
    if max_context is None:
        facts = paged_plan.check_prefill_values(block_table, cu_seqlens_q, context_lens, k_cache.shape[0],
                                                k_cache.shape[1], None, q.shape[0], slot_mapping)
        max_context = max(facts[0], 1)
    bound = context_bucket(max_context)
    softcap, window = paged_plan.model_features(softcap, window)
    problem = paged_plan.prefill_problem(batch, q.shape[0], q.shape[1], k_cache.shape[2], q.shape[2],
                                         k_cache.shape[1], bound, canonical_dtype_name(q.dtype),
                                         canonical_dtype_name(k_cache.dtype), softcap,
                                         paged_plan.effective_paged_window(window, bound))  # as the plan drops it
    return FAMILY, problem, paged_plan._device_info(q.device)


def problem_for(q, k_cache, v_cache, block_table, context_lens, *, scale=None, k_scale=None, v_scale=None,
                max_context=None, return_lse=False, softcap=None,
                window=None) -> tuple[PagedFamily, PagedProblem, DeviceInfo]:
    """(family, problem, device) of an autotile.paged_attention call, for autotile.explain."""
    _check_layout(q, k_cache, v_cache, block_table, context_lens)
    _fp8_scales(k_cache, k_scale, v_scale)
    q4 = q if q.dim() == 4 else q.unsqueeze(1)
    bound, mean = _decode_bounds(q4, k_cache, block_table, context_lens, _max_context(max_context))
    plan_device = paged_plan._device_info(q.device)
    softcap, window = paged_plan.model_features(softcap, window)
    problem = PagedProblem(q4.shape[0], q4.shape[2], k_cache.shape[2], q4.shape[3], k_cache.shape[1], bound,
                           bound if mean is None else min(mean, bound), q4.shape[1],
                           canonical_dtype_name(q4.dtype), canonical_dtype_name(k_cache.dtype), softcap,
                           paged_plan.effective_paged_window(window, bound))  # as the plan drops it
    return FAMILY, problem, plan_device
