"""`autotile.flash_attention`: the flash family as a differentiable torch.library custom op.

Two ops, `autotile::flash_attention_fwd` (q, k, v -> o, lse) and `autotile::flash_attention_bwd`
(do, q, k, v, o, lse -> dq, dk, dv), each with a fake implementation so torch.compile can trace
them, joined by `register_autograd`. Each looks up its own tuned config (forward and backward
are separate problems of the flash family). CPU tensors run the same kernels under Triton's
interpreter.
"""
from __future__ import annotations

import math

import torch

from autotile.device import DeviceInfo, current_device
from autotile.errors import BadInputError, ShapeMismatchError, UnsupportedDtypeError
from autotile.families.flash import FAMILY, FlashFamily, FlashProblem, default_scale
from autotile.runtime.dispatch import resolve
from autotile.runtime.eager import direct_call_ok
from autotile.space import Config


def _config_for(problem: FlashProblem, device: DeviceInfo) -> Config:
    return resolve(FAMILY, problem, device).config


def _unit_stride(t: torch.Tensor) -> torch.Tensor:
    # The kernels step along the head dim with stride 1; any other strides are taken as they are.
    return t if t.stride(-1) == 1 else t.contiguous()


def _check_args(q, k, v, scale) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise BadInputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ShapeMismatchError(
                f"{name} must be 4-D (batch, heads, seq, head_dim) as in SDPA, got shape {tuple(t.shape)}")
    if scale is not None and not math.isfinite(float(scale)):
        raise BadInputError(f"scale must be a finite number, got {scale!r}")


def _run(direction: str, tensors: dict, causal: bool, scale: float) -> dict:
    problem = FAMILY.problem_from_tensors(tensors["q"], tensors["k"], tensors["v"], causal=causal, direction=direction)
    device = current_device(tensors["q"].device)
    config = _config_for(problem, device)
    inputs = dict(tensors)
    if problem.dtype == "fp8":
        # fp8 tensors passed by users carry their values as they are: unit descales.
        inputs["descale"] = torch.ones(3, dtype=torch.float32, device=tensors["q"].device)
    outputs = FAMILY.allocate_outputs(problem, inputs)
    FAMILY.run(problem, config, inputs, outputs, scale=scale)
    return outputs


@torch.library.custom_op("autotile::flash_attention_fwd", mutates_args=())
def flash_attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                        scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """o (B, Hq, Sq, D) and lse (B, Hq, Sq) fp32, log2 domain (+inf for rows that see no key)."""
    out = _run("fwd", {"q": q, "k": k, "v": v}, causal, scale)
    return out["o"], out["lse"]


@flash_attention_fwd.register_fake
def _flash_attention_fwd_fake(q, k, v, causal, scale):
    out_dtype = torch.bfloat16 if q.dtype == torch.float8_e4m3fn else q.dtype
    return q.new_empty(q.shape, dtype=out_dtype), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("autotile::flash_attention_bwd", mutates_args=())
def flash_attention_bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                        lse: torch.Tensor, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of the forward above, recomputed from its o and lse."""
    out = _run("bwd", {"q": q, "k": k, "v": v, "o": o, "do": _unit_stride(do), "lse": lse.contiguous()}, causal, scale)
    return out["dq"], out["dk"], out["dv"]


@flash_attention_bwd.register_fake
def _flash_attention_bwd_fake(do, q, k, v, o, lse, causal, scale):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, causal, scale = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse)
    ctx.causal, ctx.scale = causal, scale
    ctx.mark_non_differentiable(lse)


def _backward(ctx, do, _dlse):
    q, k, v, o, lse = ctx.saved_tensors
    if do is None:
        do = torch.zeros_like(o)
    dq, dk, dv = flash_attention_bwd(do, q, k, v, o, lse, ctx.causal, ctx.scale)
    return dq, dk, dv, None, None


torch.library.register_autograd("autotile::flash_attention_fwd", _backward, setup_context=_setup_context)


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                    scale: float | None = None) -> torch.Tensor:
    """softmax(scale * q k^T) v with SDPA's layout, differentiable.

    q is (B, Hq, Sq, D) and k, v are (B, Hkv, Sk, D) with Hq a multiple of Hkv (MHA, GQA, MQA);
    fp16, bf16 and fp32 train, fp8 e4m3 runs forward only (output bf16). `causal` masks
    key j from query i unless j <= i + Sk - Sq (bottom-right aligned, as SDPA's
    causal_lower_right); rows that see no key return 0. `scale` defaults to 1/sqrt(D).

    >>> import torch, autotile
    >>> q, k, v = (torch.randn(1, 2, 5, 16, requires_grad=True) for _ in range(3))
    >>> out = autotile.flash_attention(q, k, v, causal=True)
    >>> ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    >>> bool((out - ref).abs().max() < 1e-5)
    True
    >>> out.sum().backward(); q.grad.shape
    torch.Size([1, 2, 5, 16])
    """
    _check_args(q, k, v, scale)
    scale = default_scale(q.shape[-1]) if scale is None else float(scale)
    q, k, v = _unit_stride(q), _unit_stride(k), _unit_stride(v)
    problem = FAMILY.check_tensors(q, k, v, causal=causal)
    if problem.dtype == "fp8" and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise UnsupportedDtypeError("the fp8 path is forward only: call it under torch.no_grad(), or train in bf16")
    if direct_call_ok(q, k, v):  # inference: no autograd graph to record, skip the dispatcher
        return _run("fwd", {"q": q, "k": k, "v": v}, bool(causal), scale)["o"]
    o, _ = torch.ops.autotile.flash_attention_fwd(q, k, v, bool(causal), scale)
    return o


def problem_for(q, k, v, *, causal: bool = False, scale: float | None = None) -> tuple[FlashFamily, FlashProblem, DeviceInfo]:
    """(family, forward problem, device) that `flash_attention(q, k, v, ...)` runs, for autotile.explain."""
    _check_args(q, k, v, scale)
    q, k, v = _unit_stride(q), _unit_stride(k), _unit_stride(v)
    return FAMILY, FAMILY.problem_from_tensors(q, k, v, causal=causal, direction="fwd"), current_device(q.device)
