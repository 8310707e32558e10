"""When an eager call may skip the torch.library dispatcher.

A custom op costs tens of microseconds of host time per call in the dispatcher
and its autograd wrapper (~40 µs measured for `autotile::matmul` on CPU), as
much as a short kernel runs. Eager calls of plain tensors that need no autograd
run the op's implementation directly; everything else (torch.compile tracing,
fake and meta tensors, tensor subclasses, active dispatch or function modes,
inputs that require grad) goes through the op, whose registrations handle it.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode


def direct_call_ok(*values) -> bool:
    """True when calling the op's implementation directly behaves exactly like calling the op."""
    if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:
        return False
    if torch._C._is_torch_function_mode_enabled():
        return False
    grad = torch.is_grad_enabled()
    for value in values:
        if value is None or not isinstance(value, torch.Tensor):
            continue
        if type(value) is not torch.Tensor or value.is_meta or (grad and value.requires_grad):
            return False
    return True
