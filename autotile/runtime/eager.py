"""When an eager call may skip the torch.library dispatcher.

A custom op costs tens of microseconds of host time per call in the dispatcher
and its autograd wrapper (~40 µs measured for `autotile::matmul` on CPU), as
much as a short kernel runs. Eager calls of plain tensors that need no autograd
run the op's implementation directly; everything else (torch.compile tracing,
fake and meta tensors, tensor subclasses, active dispatch or function modes,
inputs that require grad) goes through the op, whose registrations handle it.
Eager calls of plain tensors that do need autograd may record a torch.autograd.Function whose
forward and backward call the implementations directly (`autograd_call_ok`): the custom op's
autograd wrapper and dispatch cost more than its kernels on short training calls.
"""
from __future__ import annotations

import torch


_dispatch_stack_depth = torch._C._len_torch_dispatch_stack
_function_mode_on = torch._C._is_torch_function_mode_enabled
_grad_enabled = torch.is_grad_enabled
_is_compiling = torch.compiler.is_compiling
_Parameter = torch.nn.Parameter
_functorch_level = torch._C._functorch.peek_interpreter_stack


def _plain(values: tuple, refuse_grad: bool) -> bool:
    """Plain tensors and nn.Parameters (a model's weights), not meta, and (refuse_grad) none that requires grad;
    values that are not tensors pass. A tensor subclass does not: its own dispatch applies."""
    for value in values:
        if value is None:
            continue
        kind = type(value)
        if kind is not torch.Tensor and kind is not _Parameter:
            if isinstance(value, torch.Tensor):
                return False
            continue
        if value.is_meta or (refuse_grad and value.requires_grad):
            return False
    return True


def direct_call_ok(*values) -> bool:
    """True when calling the op's implementation directly behaves exactly like calling the op.

    Plain tensors and nn.Parameters (a model's weights) qualify; tensor subclasses, meta tensors and, while
    grad mode is on, tensors that require grad do not. This runs on every eager call: ~1 us.
    """
    # NOTE: the C checks directly rather than torch.utils._python_dispatch._get_current_dispatch_mode (a Python
    # wrapper around the same): this runs on every call of a served op.
    # is_compiling first: under torch.compile it is a constant and the C calls after it are never traced.
    if _is_compiling() or _dispatch_stack_depth() or _function_mode_on():
        return False
    return _plain(values, _grad_enabled())


def autograd_call_ok(*values) -> bool:
    """True when an eager call that needs autograd may record a torch.autograd.Function rather than the op: plain
    tensors and nn.Parameters (not meta), no torch.compile tracing, no dispatch or function modes, no torch.func
    transform (the op's registrations serve those). Its Function's forward and backward then run the op's
    implementations directly (~1 us)."""
    if _is_compiling() or _dispatch_stack_depth() or _function_mode_on() or _functorch_level() is not None:
        return False
    return _plain(values, False)
