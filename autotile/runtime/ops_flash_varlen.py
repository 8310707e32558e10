"""`autotile.flash_attention_varlen`: attention over packed variable-length sequences, differentiable.

The layout of FlashAttention's varlen API: q (total_q, Hq, D) and k, v (total_k, Hkv, D) hold the
sequences one after another; cu_seqlens_q / cu_seqlens_k (B + 1,) int32 are their cumulative
lengths, and max_seqlen_q / max_seqlen_k (Python ints) the longest of each, which size the grid, so
nothing is read back from the GPU. A batch of prompts of different lengths runs with no padding.
Custom ops `autotile::flash_attention_varlen_fwd` / `_bwd` joined by register_autograd, served as
`autotile.flash_attention` is (ops_flash): a prepared generated kernel per call signature. SDPA has
no packed layout, so no vendor config takes these problems.
"""
from __future__ import annotations

from typing import Optional

import torch

from autotile.device import DeviceInfo, current_device
from autotile.errors import BadInputError, ShapeMismatchError
from autotile.families.flash import FAMILY, FlashFamily, FlashProblem, effective_window, max_seqlen
from autotile.runtime.eager import autograd_call_ok, direct_call_ok, under_transform
from autotile.runtime.ops_flash import (LN2, _keep, _layout, _normalise, _unit_stride, attention_in_torch,
                                        autocast_inputs, check_flags, check_fp8_grad, check_numbers, check_slopes_grad,
                                        eager_or_op, foreign_arguments, no_double_backward, number_arguments,
                                        serve_backward, serve_forward)
from autotile.runtime.paged_plan import checks_on


def _key(direction, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window, softcap, alibi) -> tuple:
    return (direction, "varlen", _layout(q), _layout(k), _layout(v), _layout(cu_q), _layout(cu_k), max_q, max_k,
            causal, scale, window, softcap, _layout(alibi))


def _problem(q, k, v, cu_q, cu_k, max_q, max_k, causal, window, softcap, alibi, direction="fwd") -> FlashProblem:
    return FAMILY.check_packed(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, direction=direction, window=window,
                               softcap=softcap, alibi_slopes=alibi)


def _served_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window, softcap, alibi):
    def build():
        problem = _problem(q, k, v, cu_q, cu_k, max_q, max_k, causal, window, softcap, alibi)
        sample = {"q": q, "k": k, "v": v, "alibi": alibi, "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k}
        return serve_forward(problem, current_device(q.device), scale, sample)
    return _keep(_key("fwd", q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window, softcap, alibi), build)


@torch.library.custom_op("autotile::flash_attention_varlen_fwd", mutates_args=())
def flash_attention_varlen_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                               cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, causal: bool,
                               scale: float, window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
                               alibi_slopes: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """o (total_q, Hq, D) and lse (Hq, total_q) fp32, log2 domain (+inf for rows that see no key)."""
    check_numbers(scale, softcap)  # traced as symbols, they were not checked before
    if checks_on(q.device):
        # The call's own check is skipped where torch.compile traces it (a traced max_seqlen may be symbolic), and
        # the lengths are only real here: a max_seqlen short of a sequence would leave its last rows unwritten.
        check_lengths(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    served = _served_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale,
                             (window_left, window_right), softcap, alibi_slopes)
    served.calls[0] += 1
    return served.run(q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k, True)


@flash_attention_varlen_fwd.register_fake
def _varlen_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, window_left=-1,
                     window_right=-1, softcap=0.0, alibi_slopes=None):
    return q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


def _flash_attention_varlen_bwd(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                scale, window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None, dlse=None):
    """The body of autotile::flash_attention_varlen_bwd, which eager backward calls without the dispatcher
    (ops_flash.eager_or_op)."""
    do, lse = _unit_stride(do), lse.contiguous()
    window = (window_left, window_right)
    cu_q, cu_k = cu_seqlens_q, cu_seqlens_k

    def build():
        problem = _problem(q, k, v, cu_q, cu_k, max_seqlen_q, max_seqlen_k, causal, window, softcap, alibi_slopes, "bwd")
        sample = {"q": q, "k": k, "v": v, "o": o, "do": do, "lse": lse, "alibi": alibi_slopes,
                  "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k}
        return serve_backward(problem, current_device(q.device), scale, sample, dlse is not None)
    key = _key("bwd", q, k, v, cu_q, cu_k, max_seqlen_q, max_seqlen_k, causal, scale, window, softcap, alibi_slopes) + (
        _layout(o), _layout(do), _layout(lse), dlse is not None, torch.are_deterministic_algorithms_enabled())
    served = _keep(key, build)
    served.calls[0] += 1
    return served.run(q, k, v, o, do, lse, alibi_slopes, cu_q, cu_k, dlse)


@torch.library.custom_op("autotile::flash_attention_varlen_bwd", mutates_args=())
def flash_attention_varlen_bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                               lse: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                               max_seqlen_q: int, max_seqlen_k: int, causal: bool, scale: float, window_left: int = -1,
                               window_right: int = -1, softcap: float = 0.0,
                               alibi_slopes: Optional[torch.Tensor] = None,
                               dlse: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of the varlen forward, recomputed from its o and lse."""
    return _flash_attention_varlen_bwd(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                       causal, scale, window_left, window_right, softcap, alibi_slopes, dlse)


@flash_attention_varlen_bwd.register_fake
def _varlen_bwd_fake(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale,
                     window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None, dlse=None):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    (q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window_left, window_right, softcap, alibi_slopes) = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, cu_q, cu_k, alibi_slopes)
    ctx.args = (max_q, max_k, causal, scale, window_left, window_right, softcap)


def _backward(ctx, do, dlse):
    q, k, v, o, lse, cu_q, cu_k, alibi_slopes = ctx.saved_tensors
    if do is None:
        do = torch.zeros_like(o)
    bwd = eager_or_op(flash_attention_varlen_bwd, _flash_attention_varlen_bwd, do, q, k, v, o, lse, cu_q, cu_k,
                      alibi_slopes, dlse)
    dq, dk, dv = bwd(do, q, k, v, o, lse, cu_q, cu_k, *ctx.args, alibi_slopes, dlse)
    return no_double_backward((dq, dk, dv), q, k, v, do, dlse) + (None,) * 10


torch.library.register_autograd("autotile::flash_attention_varlen_fwd", _backward, setup_context=_setup_context)


class _EagerVarlen(torch.autograd.Function):
    """The op and its registered autograd for eager calls of plain tensors that need gradients, without the custom
    op's wrapper and dispatch (ops_flash._EagerFlash says why)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, alibi_slopes, served, args):
        ctx.set_materialize_grads(False)
        o, lse = served.run(q, k, v, alibi_slopes, cu_q, cu_k, True)
        ctx.save_for_backward(q, k, v, o, lse, cu_q, cu_k, alibi_slopes)
        ctx.args = args
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, o, lse, cu_q, cu_k, alibi_slopes = ctx.saved_tensors
        dq, dk, dv = _flash_attention_varlen_bwd(do if do is not None else torch.zeros_like(o), q, k, v, o, lse, cu_q,
                                                 cu_k, *ctx.args, alibi_slopes, dlse)
        return no_double_backward((dq, dk, dv), q, k, v, do, dlse) + (None,) * 5


def check_lengths(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int) -> None:
    """The cumulative lengths' values: from 0, never decreasing, within the packed rows, no sequence longer than its
    max_seqlen (the grid's size). Reading them back is free for CPU tensors; on a GPU it waits for the queued work,
    so it runs there only under AUTOTILE_CHECKS=1 (paged_plan.checks_on), as FlashAttention trusts them too.
    NOTE: under Triton's interpreter, rows past the packed tensor are read and written on the host's heap: a bad
    end took the process down (free(): invalid next size)."""
    for name, cu, rows, longest_name, longest in (
            ("cu_seqlens_q", cu_seqlens_q, q.shape[0], "max_seqlen_q", max_seqlen_q),
            ("cu_seqlens_k", cu_seqlens_k, k.shape[0], "max_seqlen_k", max_seqlen_k)):
        values = cu.tolist()
        shown = values if len(values) <= 8 else values[:8] + ["..."]
        if values[0] != 0 or any(b < a for a, b in zip(values, values[1:])):
            raise BadInputError(f"{name} must start at 0 and never decrease (cumulative lengths), got {shown}")
        if values[-1] > rows:
            raise ShapeMismatchError(f"{name} ends at {values[-1]}, past the {rows} packed rows of "
                                     f"{'q' if name == 'cu_seqlens_q' else 'k and v'}")
        length = max(b - a for a, b in zip(values, values[1:]))
        if length > longest:
            raise BadInputError(f"{name} holds a sequence of {length} rows, longer than {longest_name}={longest}: "
                                f"pass the longest length")


def flash_attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                           cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, *, causal: bool = False,
                           scale: float | None = None, window: tuple[int, int] | None = None,
                           softcap: float | None = None, alibi_slopes: torch.Tensor | None = None,
                           return_lse: bool = False, **flash_attn_arguments):
    """Attention of each packed sequence with itself, as FlashAttention's flash_attn_varlen_func; differentiable.

    q (total_q, Hq, D), k and v (total_k, Hkv, D), Hq a multiple of Hkv; sequence b is rows
    cu_seqlens_q[b]:cu_seqlens_q[b+1] of q and cu_seqlens_k[b]:cu_seqlens_k[b+1] of k and v
    (int32, B + 1 entries from 0). Masks, `scale`, `window`, `softcap` and `alibi_slopes` ((Hq,) or
    (B, Hq)) act per sequence as in autotile.flash_attention. With `return_lse` the result is
    (o, lse), lse (Hq, total_q) fp32 natural-log log-sum-exp. Packed rows past the last sequence
    (padding to a fixed size) come back as rows that see no key: o 0, lse +inf, no gradient.
    Under torch.autocast, q, k, v are cast as for autotile.flash_attention.

    >>> import torch, autotile
    >>> cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    >>> q, k, v = (torch.randn(8, 2, 16) for _ in range(3))
    >>> out = autotile.flash_attention_varlen(q, k, v, cu, cu, 5, 5, causal=True)
    >>> first = torch.nn.functional.scaled_dot_product_attention(
    ...     *(t[:3].transpose(0, 1) for t in (q, k, v)), is_causal=True).transpose(0, 1)
    >>> bool((out[:3] - first).abs().max() < 1e-5)
    True
    """
    if flash_attn_arguments:
        foreign_arguments("flash_attention_varlen", flash_attn_arguments)
    if isinstance(scale, torch.Tensor) or isinstance(softcap, torch.Tensor):
        scale, softcap = number_arguments(scale, softcap)
    check_flags(causal, alibi_slopes)
    q, k, v, scale, window, softcap = _normalise(q, k, v, scale, window, softcap)
    if (cast := autocast_inputs(q, k, v)) is not None:
        q, k, v = cast
    causal = bool(causal)
    if not torch.compiler.is_compiling():  # NOTE: a traced max_seqlen may be symbolic: the op's own check reads it
        max_seqlen_q, max_seqlen_k = max_seqlen(max_seqlen_q, "max_seqlen_q"), max_seqlen(max_seqlen_k, "max_seqlen_k")
        # No sequence is longer than all the packed rows: a looser bound (an engine's max model length) would only
        # size a grid of idle programs.
        max_seqlen_q, max_seqlen_k = min(max_seqlen_q, max(1, q.shape[0])), min(max_seqlen_k, max(1, k.shape[0]))
        window = effective_window(window, max_seqlen_q, max_seqlen_k, causal)
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor):  # the call's key reads its layout
            raise BadInputError(f"{name} must be a 1-D int32 tensor of B + 1 cumulative lengths (starting at 0), got "
                                f"{type(cu).__name__}: pass torch.tensor(lengths, dtype=torch.int32, device=q.device)")
    # The kernels read the cumulative lengths as a contiguous array: a strided view (cu[::2]) would be read wrongly.
    cu_seqlens_q, cu_seqlens_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()
    args = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if not torch.compiler.is_compiling() and under_transform():
        return _varlen_in_torch(q, k, v, *args, causal, scale, window, softcap, alibi_slopes, return_lse)
    if not torch.compiler.is_compiling():
        check_fp8_grad(q, k, v)
        served = _served_forward(q, k, v, *args, causal, scale, window, softcap, alibi_slopes)
        if checks_on(q.device):
            check_lengths(q, k, *args)
        if direct_call_ok(q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k):
            served.calls[0] += 1
            o, lse = served.run(q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k, return_lse)
            return (o, lse * LN2) if return_lse else o
        if autograd_call_ok(q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k):
            check_slopes_grad(alibi_slopes)
            served.calls[0] += 1
            o, lse = _EagerVarlen.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, served,
                                        (max_seqlen_q, max_seqlen_k, causal, scale, window[0], window[1], softcap))
            return (o, lse * LN2) if return_lse else o
    check_slopes_grad(alibi_slopes)
    o, lse = torch.ops.autotile.flash_attention_varlen_fwd(q, k, v, *args, causal, scale, window[0], window[1],
                                                           softcap, alibi_slopes)
    return (o, lse * LN2) if return_lse else o


def _varlen_in_torch(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window, softcap, alibi, return_lse):
    """A call inside a torch.func transform (eager.under_transform): each sequence through
    ops_flash.attention_in_torch, in plain torch, after the checks every call gets. Rows past the last sequence, and
    rows of a sequence with no keys, see no key: o 0, lse +inf."""
    _problem(q, k, v, cu_q, cu_k, max_q, max_k, causal, window, softcap, alibi)
    check_lengths(q, k, cu_q, cu_k, max_q, max_k)
    o = q.new_zeros(q.shape)
    lse = torch.full((q.shape[1], q.shape[0]), torch.inf, dtype=torch.float32, device=q.device)
    starts_q, starts_k = cu_q.tolist(), cu_k.tolist()
    for b, (q0, q1, k0, k1) in enumerate(zip(starts_q, starts_q[1:], starts_k, starts_k[1:])):
        if q1 == q0 or k1 == k0:
            continue
        one = [t[r0:r1].transpose(0, 1)[None] for t, r0, r1 in ((q, q0, q1), (k, k0, k1), (v, k0, k1))]
        slopes = None if alibi is None else alibi if alibi.dim() == 1 else alibi[b]
        o_b, lse_b = attention_in_torch(*one, causal, scale, window, softcap, slopes, True)
        o = o.index_copy(0, torch.arange(q0, q1, device=q.device), o_b[0].transpose(0, 1))
        lse = lse.index_copy(1, torch.arange(q0, q1, device=q.device), lse_b[0].float())
    return (o, lse) if return_lse else o


def problem_for(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal: bool = False,
                scale=None, window=None, softcap=None, alibi_slopes=None,
                return_lse: bool = False) -> tuple[FlashFamily, FlashProblem, DeviceInfo]:
    """(family, forward problem, device) that `flash_attention_varlen(...)` runs, for autotile.explain."""
    q, k, v, scale, window, softcap = _normalise(q, k, v, scale, window, softcap)
    window = effective_window(window, max_seqlen(max_seqlen_q, "max_seqlen_q"), max_seqlen(max_seqlen_k, "max_seqlen_k"),
                              bool(causal))
    problem = _problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window, softcap,
                       alibi_slopes)
    if checks_on(q.device):  # as the call checks them: explain never approves a call the op refuses
        check_lengths(q, k, cu_seqlens_q, cu_seqlens_k, problem.seq_q, problem.seq_k)
    return FAMILY, problem, current_device(q.device)
