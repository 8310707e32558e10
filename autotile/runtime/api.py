"""The public ops. Each family's op module is imported on first use."""
from __future__ import annotations

import dataclasses
import importlib
import inspect

from autotile.errors import BadInputError
from autotile.families.base import vendor_label
from autotile.runtime import fallback

OP_MODULES = {
    "matmul": "autotile.runtime.ops_gemm",
    "linear": "autotile.runtime.ops_gemm",
    "flash_attention": "autotile.runtime.ops_flash",
    "flash_attention_varlen": "autotile.runtime.ops_flash_varlen",
    "paged_attention": "autotile.runtime.ops_paged",
    "paged_prefill": "autotile.runtime.ops_paged",
    "fuse": "autotile.runtime.ops_elementwise",
}


def _op_module(name: str):
    if name not in OP_MODULES:
        raise BadInputError(f"unknown op {name!r}; autotile's ops are {', '.join(OP_MODULES)}")
    return importlib.import_module(OP_MODULES[name])


def matmul(a, b, *, bias=None, activation=None, out_dtype=None, scale_a=None, scale_b=None, residual=None,
           fp8_fast_accum=False):
    """See autotile.runtime.ops_gemm.matmul."""
    return _op_module("matmul").matmul(a, b, bias=bias, activation=activation, out_dtype=out_dtype,
                                       scale_a=scale_a, scale_b=scale_b, residual=residual,
                                       fp8_fast_accum=fp8_fast_accum)


def linear(x, weight, bias=None, activation=None, residual=None):
    """activation(x @ weight.T + bias) + residual, as torch.nn.functional.linear. See autotile.runtime.ops_gemm.linear."""
    return _op_module("linear").linear(x, weight, bias, activation, residual)


def flash_attention(q, k, v, *, causal=False, scale=None, **features):
    """FlashAttention over (B, H, S, D) tensors; differentiable. See autotile.runtime.ops_flash."""
    return _op_module("flash_attention").flash_attention(q, k, v, causal=causal, scale=scale, **features)


def flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False,
                           scale=None, **features):
    """FlashAttention over packed variable-length sequences; differentiable. See autotile.runtime.ops_flash_varlen."""
    return _op_module("flash_attention_varlen").flash_attention_varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal, scale=scale, **features)


def paged_attention(q, k_cache, v_cache, block_table, context_lens, *, scale=None, **kwargs):
    """Decode attention over a paged KV cache. See autotile.runtime.ops_paged."""
    return _op_module("paged_attention").paged_attention(q, k_cache, v_cache, block_table, context_lens,
                                                         scale=scale, **kwargs)


def paged_prefill(q, k_cache, v_cache, block_table, cu_seqlens_q, context_lens, **kwargs):
    """Chunked prefill over a paged KV cache (packed queries). See autotile.runtime.ops_paged.paged_prefill."""
    return _op_module("paged_attention").paged_prefill(q, k_cache, v_cache, block_table, cu_seqlens_q, context_lens,
                                                       **kwargs)


def fuse(expr: str):
    """One kernel for an elementwise expression: autotile.fuse("sin(x)**2 + cos(x)**2")(x=t)."""
    return _op_module("fuse").fuse(expr)


def explain(op_name: str, *args, **kwargs) -> dict:
    """What a call would run, without running it: family, problem key, config, its source, device.

    `source` is 'user-db' or 'shipped-db' (a stored winner: `match` says 'exact' or 'range'), 'vendor' (a shape
    nobody tuned, served by the vendor library), 'default', or 'empty' (a call with an empty dimension: torch's
    result, no kernel; problem and config are None); `vendor` names the library call when one runs
    (a stored winner may be the vendor op too). `unusable` lists the configs of this problem that failed to
    build or launch in this process (config, source, error): `match` is then 'fallback', and `config` what
    serves the call instead (autotile.runtime.fallback).

    >>> import torch, autotile
    >>> info = autotile.explain("matmul", torch.randn(8, 4), torch.randn(4, 8))
    >>> info["family"], info["source"] in ("user-db", "shipped-db", "default")
    ('gemm', True)
    """
    module = _op_module(op_name)
    problem_for = getattr(module, f"{op_name}_problem_for", None) or module.problem_for
    try:
        inspect.signature(problem_for).bind(*args, **kwargs)
    except TypeError as exc:
        takes = inspect.signature(getattr(importlib.import_module("autotile"), op_name))
        raise BadInputError(f"explain({op_name!r}, ...) takes the arguments autotile.{op_name} takes "
                            f"{takes.replace(return_annotation=inspect.Signature.empty)}: {exc}") from None
    empty_call = getattr(module, f"{op_name}_empty_call", None) or getattr(module, "empty_call", None)
    if empty_call is not None and (empty := empty_call(*args, **kwargs)) is not None:
        family, device = empty
        return {"op": op_name, "family": family.name, "problem": None, "problem_key": None, "config": None,
                "source": "empty", "vendor": None, "match": None, "tuned_for": None, "device": device.key,
                "interpreted": device.interpret, "unusable": [],
                "note": "an empty dimension: torch's result, checked as every call is; no kernel runs"}
    family, problem, device = problem_for(*args, **kwargs)
    resolution = fallback.usable(family, problem, device)
    # Ops whose plans adapt the resolved config (paged decode and prefill).
    served = getattr(module, f"{op_name}_served_config", None) or getattr(module, "served_config", None)
    config = served(problem, device, resolution) if served else resolution.config
    return {
        "op": op_name,
        "family": family.name,
        "problem": dataclasses.asdict(problem),
        "problem_key": resolution.problem_key,
        "config": dict(config),
        "source": resolution.source,
        "vendor": vendor_label(resolution.config) if resolution.vendor else None,
        "match": resolution.match,
        "tuned_for": resolution.tuned_for,
        "device": device.key,
        "interpreted": device.interpret,
        "unusable": [mark.as_dict() for mark in fallback.marks_for(family, problem)],
    }
