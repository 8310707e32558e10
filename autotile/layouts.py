"""Outputs laid out like their inputs, as SDPA's attention backends lay them out.

A model's q is rarely (B, H, S, D)-contiguous: a projection viewed as (B, S, H, D) and transposed leaves it
(B, S, H, D) in memory. SDPA's cuDNN and FlashAttention backends then write O, dQ, dK and dV in that same dimension
order, so the model's `o.transpose(1, 2).reshape(B, S, H * D)` is a view, not a copy, and the gradients flow back
without one. Attention ops follow the same rule (matching_strides), whichever kernel serves, so that what their fake
implementations promise torch.compile holds for every backend.
"""
from __future__ import annotations

import math

import torch


def matching_strides(t: torch.Tensor) -> tuple[int, ...]:
    """Strides of a dense tensor of t's shape whose dimensions lie in memory in t's order, as torch's cuDNN attention
    allocates its outputs (aten/src/ATen/native/cudnn/MHA.cpp, alloc_with_matching_layout): innermost the one with
    the smallest stride, ties (size-1 dimensions) to the lower index. Two departures, for tensors torch's rule was
    not written for: the last dimension stays innermost (the kernels step along it with stride 1), and a broadcast
    dimension (stride 0, as k.expand(...) gives) goes outermost rather than innermost."""
    last = t.dim() - 1
    order = sorted(range(t.dim()), key=lambda d: (d != last, t.stride(d) if t.stride(d) or t.shape[d] <= 1
                                                  else math.inf))  # stable: ties keep index order
    strides = [0] * t.dim()
    step = 1
    for d in order:
        strides[d] = step
        step *= t.shape[d]
    return tuple(strides)


def same_layout(t: torch.Tensor, strides: tuple[int, ...]) -> bool:
    """Whether t addresses memory as `strides` do: equal but where a dimension has size 1."""
    return t.stride() == strides or all(a == b or n == 1 for a, b, n in zip(t.stride(), strides, t.shape))


def with_strides(t: torch.Tensor, strides: tuple[int, ...]) -> torch.Tensor:
    """t with exactly `strides`: itself, a view where only size-1 dimensions differ, or a copy."""
    if t.stride() == strides:
        return t
    if same_layout(t, strides):
        return t.as_strided(t.shape, strides)
    return torch.empty_strided(t.shape, strides, dtype=t.dtype, device=t.device).copy_(t)


_functorch_wrapped = torch._C._functorch.is_functorch_wrapped_tensor


def base_aligned(t: torch.Tensor, bytes_: int = 16) -> bool:
    """t's data pointer is a multiple of `bytes_`. Tensors with no data pointer to read count as aligned: fake
    tensors (reading theirs is deprecated, and warns) and the tensors torch.func transforms wrap (it raises). They
    only describe a call; a call with real tensors reads the real pointer."""
    if t.__class__ is not torch.Tensor and t.__class__ is not torch.nn.Parameter:
        from torch._subclasses.fake_tensor import is_fake

        if is_fake(t):
            return True
    if _functorch_wrapped(t):
        return True
    return t.data_ptr() % bytes_ == 0
