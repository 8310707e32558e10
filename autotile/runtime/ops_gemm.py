"""`autotile.matmul`: the tuned GEMM as a torch.library custom op."""
from __future__ import annotations

from typing import Optional

import torch

from autotile.device import current_device
from autotile.dtypes import canonical_dtype_name
from autotile.errors import BadInputError
from autotile.families.gemm import FAMILY
from autotile.runtime.dispatch import resolve
from autotile.runtime.eager import direct_call_ok


def _inputs(a, b, bias, scale_a, scale_b) -> dict:
    inputs = {"a": a, "b": b}
    if bias is not None:
        inputs["bias"] = bias
    if a.dtype == torch.float8_e4m3fn:
        one = torch.ones(1, dtype=torch.float32, device=a.device)
        inputs["scale_a"] = (scale_a if scale_a is not None else one).reshape(1).float()
        inputs["scale_b"] = (scale_b if scale_b is not None else one).reshape(1).float()
    return inputs


def problem_for(a, b, *, bias=None, activation=None, out_dtype=None, scale_a=None, scale_b=None):
    """(family, problem, device) of a matmul call, for `autotile.explain`."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        raise BadInputError("matmul takes two tensors a (M, K) and b (K, N)")
    problem = FAMILY.problem_from_tensors(a, b, bias, activation, out_dtype)
    return FAMILY, problem, current_device(a.device)


def _run(problem, device, a, b, bias, scale_a, scale_b) -> torch.Tensor:
    config = resolve(FAMILY, problem, device).config
    inputs = _inputs(a, b, bias, scale_a, scale_b)
    outputs = FAMILY.allocate_outputs(problem, inputs)
    if a.is_cuda and a.device.index != torch.cuda.current_device():
        with torch.cuda.device(a.device):
            FAMILY.launch(problem, config, inputs, outputs)
    else:
        FAMILY.launch(problem, config, inputs, outputs)
    return outputs["c"]


@torch.library.custom_op("autotile::matmul", mutates_args=())
def _matmul_op(a: torch.Tensor, b: torch.Tensor, bias: Optional[torch.Tensor], scale_a: Optional[torch.Tensor],
               scale_b: Optional[torch.Tensor], activation: str, out_dtype: str) -> torch.Tensor:
    _, problem, device = problem_for(a, b, bias=bias, activation=activation, out_dtype=out_dtype or None)
    return _run(problem, device, a, b, bias, scale_a, scale_b)


@_matmul_op.register_fake
def _matmul_fake(a, b, bias, scale_a, scale_b, activation, out_dtype):
    from autotile.dtypes import torch_dtype

    dtype = torch_dtype(out_dtype) if out_dtype else (torch.bfloat16 if a.dtype == torch.float8_e4m3fn else a.dtype)
    return a.new_empty((a.shape[0], b.shape[1]), dtype=dtype)


def matmul(a: torch.Tensor, b: torch.Tensor, *, bias: torch.Tensor | None = None, activation: str | None = None,
           out_dtype: torch.dtype | str | None = None, scale_a: torch.Tensor | None = None,
           scale_b: torch.Tensor | None = None) -> torch.Tensor:
    """C = activation(a @ b (* scale_a * scale_b for fp8) + bias) with the tuned kernel for this shape.

    a (M, K) and b (K, N) of one dtype (fp32, fp16, bf16 or float8_e4m3fn), any strides;
    activation is None, 'relu', 'gelu' or 'silu'; out_dtype defaults to the operands'
    dtype (bf16 for fp8). CUDA tensors run the tuned kernel; CPU tensors run the same
    kernel under Triton's interpreter.

    >>> import torch, autotile
    >>> a, b = torch.randn(5, 7), torch.randn(7, 3)
    >>> torch.allclose(autotile.matmul(a, b, activation="relu"), torch.relu(a @ b), atol=1e-5)
    True
    """
    if not torch.compiler.is_compiling():
        # Eager calls get bad input reported here, before the op; traced calls meet the same checks
        # when the op runs (the fake implementation only gives shapes).
        _, problem, device = problem_for(a, b, bias=bias, activation=activation, out_dtype=out_dtype,
                                         scale_a=scale_a, scale_b=scale_b)
        if direct_call_ok(a, b, bias, scale_a, scale_b):
            return _run(problem, device, a, b, bias, scale_a, scale_b)
    out = canonical_dtype_name(out_dtype) if out_dtype is not None else ""
    return _matmul_op(a, b, bias, scale_a, scale_b, activation or "none", out)
