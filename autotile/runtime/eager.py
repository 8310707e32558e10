"""When an eager call may skip the torch.library dispatcher.

A custom op costs tens of microseconds of host time per call in the dispatcher
and its autograd wrapper (~40 µs measured for `autotile::matmul` on CPU), as
much as a short kernel runs. Eager calls of plain tensors that need no autograd
run the op's implementation directly; everything else (torch.compile tracing,
fake and meta tensors, tensor subclasses, active dispatch or function modes,
inputs that require grad) goes through the op, whose registrations handle it.
Inside torch.func transforms (vmap, grad, jacrev, ...) the ops compute in plain
torch instead (`under_transform`).
Eager calls of plain tensors that do need autograd may record a torch.autograd.Function whose
forward and backward call the implementations directly (`autograd_call_ok`): the custom op's
autograd wrapper and dispatch cost more than its kernels on short training calls.
"""
from __future__ import annotations

import numbers

import torch


_dispatch_stack_depth = torch._C._len_torch_dispatch_stack
_function_mode_on = torch._C._is_torch_function_mode_enabled
_grad_enabled = torch.is_grad_enabled
_is_compiling = torch.compiler.is_compiling
_Parameter = torch.nn.Parameter
_functorch_level = torch._C._functorch.peek_interpreter_stack


_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)


def checked_by_op(value) -> bool:
    """Whether a number's value is checked by the op's body rather than the call: while torch.compile traces the
    call, a number may be a symbol (automatic dynamic, dynamic=True, a size) or a float dynamo passes as a tensor,
    whose value is known only when the compiled graph runs (math.isfinite on it does not trace). Anything but a
    number (a bool, a string) is the call's to refuse."""
    return isinstance(value, _SYMBOLIC) or (_is_compiling() and isinstance(value, numbers.Real)
                                           and not isinstance(value, bool))


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

    Plain tensors and nn.Parameters (a model's weights) qualify outside torch.func transforms (their wrapped tensors
    have no data pointer); tensor subclasses, meta tensors and, while grad mode is on, tensors that require grad do
    not. This runs on every eager call: ~1 us.
    """
    # NOTE: the C checks directly rather than torch.utils._python_dispatch._get_current_dispatch_mode (a Python
    # wrapper around the same): this runs on every call of a served op.
    # is_compiling first: under torch.compile it is a constant and the C calls after it are never traced.
    if _is_compiling() or _dispatch_stack_depth() or _function_mode_on() or _functorch_level() is not None:
        return False
    return _plain(values, _grad_enabled())


def autograd_call_ok(*values) -> bool:
    """True when an eager call that needs autograd may record a torch.autograd.Function rather than the op: plain
    tensors and nn.Parameters (not meta), no torch.compile tracing, no dispatch or function modes, no torch.func
    transform (the ops compute in plain torch there: under_transform). Its Function's forward and backward then run the op's
    implementations directly (~1 us)."""
    if _is_compiling() or _dispatch_stack_depth() or _function_mode_on() or _functorch_level() is not None:
        return False
    return _plain(values, False)


def under_transform() -> bool:
    """Inside a torch.func transform (vmap, grad, jacrev, jvp, ...). The custom ops' registered autograd is one
    torch.func cannot differentiate ("it must override the setup_context staticmethod"), and the tensors it wraps
    have no data pointer for a kernel: the ops compute in plain torch there, which every transform knows."""
    return _functorch_level() is not None


any_autocast = torch._C._is_any_autocast_enabled
_AUTOCAST_FROM = (torch.float32, torch.float16, torch.bfloat16)  # what autocast casts; fp8 runs as it is


def autocast_operands(*tensors) -> tuple | None:
    """`tensors` cast as torch.autocast casts the operands of an op it runs in its lower precision (matmul, linear,
    SDPA), or None where autocast leaves them as they are: off for their device, or of its dtype already. None
    entries and fp8 tensors stay as given; values that are not tensors leave all as given (the op's checks name
    them)."""
    if not all(t is None or isinstance(t, torch.Tensor) for t in tensors):
        return None
    device = next((t.device.type for t in tensors if t is not None), None)
    if device is None or device == "meta" or not torch.is_autocast_enabled(device):  # torch has no meta autocast
        return None
    dtype = torch.get_autocast_dtype(device)
    if all(t is None or t.dtype == dtype or t.dtype not in _AUTOCAST_FROM for t in tensors):
        return None
    return tuple(t.to(dtype) if t is not None and t.dtype in _AUTOCAST_FROM else t for t in tensors)
