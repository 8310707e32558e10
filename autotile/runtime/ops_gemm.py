"""`autotile.matmul` and `autotile.linear`: the tuned GEMM as torch.library custom ops.

What a call runs is decided once per call signature (shapes, strides, dtypes, device, 16-byte alignment,
epilogue) and kept: the stored winner, the vendor op (cuBLAS through torch.matmul / F.linear, or
torch._scaled_mm for fp8) for shapes nobody tuned, or a generated kernel. Later calls with the same
signature pay a dict lookup, one counter increment (AUTOTILE_RECORD) and the launch itself: no
host sync, no allocation a CUDA graph cannot capture.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Optional

import torch

from autotile.device import current_device
from autotile.dtypes import canonical_dtype_name, torch_dtype
from autotile.errors import BadInputError, ShapeMismatchError
from autotile.families.base import VENDOR_KEY
from autotile.families.gemm import FAMILY, GemmProblem, vendor_matmul
from autotile.runtime import trace
from autotile.runtime.dispatch import on_clear, resolve
from autotile.runtime.eager import direct_call_ok

_ACTIVATIONS = {"none": None, "relu": torch.relu, "silu": torch.nn.functional.silu, "gelu": torch.nn.functional.gelu}


def _inputs(a, b, bias, scale_a, scale_b) -> dict:
    inputs = {"a": a, "b": b}
    if bias is not None:
        inputs["bias"] = bias
    if a.dtype == torch.float8_e4m3fn:
        one = torch.ones(1, dtype=torch.float32, device=a.device)
        inputs["scale_a"] = (scale_a if scale_a is not None else one).reshape(1).float()
        inputs["scale_b"] = (scale_b if scale_b is not None else one).reshape(1).float()
    return inputs


def _check_scales(a: torch.Tensor, scale_a, scale_b) -> None:
    if a.dtype != torch.float8_e4m3fn and (scale_a is not None or scale_b is not None):
        raise BadInputError(f"scale_a/scale_b apply to float8_e4m3fn operands only; these are {a.dtype}: "
                            "scale the result instead (or the operands before the call)")


def problem_for(a, b, *, bias=None, activation=None, out_dtype=None, scale_a=None, scale_b=None):
    """(family, problem, device) of a matmul call, for `autotile.explain`."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        raise BadInputError("matmul takes two tensors a (M, K) and b (K, N)")
    _check_scales(a, scale_a, scale_b)
    problem = FAMILY.problem_from_tensors(a, b, bias, activation, out_dtype)
    return FAMILY, problem, current_device(a.device)


class _Served:
    """What calls of one signature run, worked out once; `calls` counts them for AUTOTILE_RECORD."""

    __slots__ = ("run", "calls")

    def __init__(self, run: Callable, counter: list):
        self.run = run
        self.calls = counter  # a one-element list shared with autotile.runtime.trace


_served: dict[tuple, _Served] = {}
_served_lock = threading.Lock()


def _forget_served() -> None:
    with _served_lock:
        _served.clear()


on_clear(_forget_served)


def _vendor_runner(problem: GemmProblem, kind: str) -> Callable:
    activation, out_dtype = problem.activation, torch_dtype(problem.out_dtype)
    if kind == "cublas" and activation == "none":
        return lambda a, b, bias, scale_a, scale_b: torch.matmul(a, b) if bias is None else torch.addmm(bias, a, b)
    return lambda a, b, bias, scale_a, scale_b: vendor_matmul(kind, a, b, bias, activation, out_dtype,
                                                               scale_a, scale_b)


def _kernel_runner(problem: GemmProblem, config) -> Callable:
    out_dtype = torch_dtype(problem.out_dtype)

    def run(a, b, bias, scale_a, scale_b):
        inputs = _inputs(a, b, bias, scale_a, scale_b)
        outputs = {"c": torch.empty(problem.m, problem.n, dtype=out_dtype, device=a.device)}
        if a.is_cuda and a.device.index != torch.cuda.current_device():
            with torch.cuda.device(a.device):
                FAMILY.launch(problem, config, inputs, outputs)
        else:
            FAMILY.launch(problem, config, inputs, outputs)
        return outputs["c"]
    return run


def _serve(problem: GemmProblem, device) -> _Served:
    resolution = resolve(FAMILY, problem, device)
    if resolution.vendor:
        run = _vendor_runner(problem, resolution.config[VENDOR_KEY])
    else:
        run = _kernel_runner(problem, resolution.config)
    return _Served(run, trace.counter(FAMILY, problem, device))


def _signature(a, b, bias, activation, out_dtype, scale_a, scale_b) -> tuple:
    # Everything the problem (and so the served config) depends on; cheap to build (~1 us).
    tf32 = a.dtype is torch.float32 and torch.backends.cuda.matmul.allow_tf32
    return (a.shape, a.stride(), b.shape, b.stride(), a.dtype, b.dtype, a.device, b.device,
            not (a.data_ptr() | b.data_ptr()) & 15, None if bias is None else (bias.shape, bias.dtype, bias.device),
            activation, out_dtype, scale_a is None, scale_b is None, tf32)


def _served_for(a, b, bias, activation, out_dtype, scale_a, scale_b) -> _Served:
    key = _signature(a, b, bias, activation, out_dtype, scale_a, scale_b)
    served = _served.get(key)
    if served is None:
        if a.dim() == 2 and b.dim() == 2 and a.shape[1] == b.shape[0] and 0 in (a.shape[0], b.shape[1]):
            # No rows or no columns: an empty result, as torch.matmul gives (nothing to tune or launch).
            dtype = out_dtype or (torch.bfloat16 if a.dtype == torch.float8_e4m3fn else a.dtype)
            return _Served(lambda a, b, *rest: a.new_empty((a.shape[0], b.shape[1]), dtype=dtype), [0])
        _, problem, device = problem_for(a, b, bias=bias, activation=activation, out_dtype=out_dtype,
                                         scale_a=scale_a, scale_b=scale_b)
        served = _serve(problem, device)
        with _served_lock:
            _served[key] = served
    return served


def _run(a, b, bias, activation, out_dtype, scale_a, scale_b) -> torch.Tensor:
    served = _served_for(a, b, bias, activation, out_dtype, scale_a, scale_b)
    served.calls[0] += 1
    return served.run(a, b, bias, scale_a, scale_b)


@torch.library.custom_op("autotile::matmul", mutates_args=())
def _matmul_op(a: torch.Tensor, b: torch.Tensor, bias: Optional[torch.Tensor], scale_a: Optional[torch.Tensor],
               scale_b: Optional[torch.Tensor], activation: str, out_dtype: str) -> torch.Tensor:
    out = torch_dtype(out_dtype) if out_dtype else None
    return _run(a, b, bias, activation if activation != "none" else None, out, scale_a, scale_b)


@_matmul_op.register_fake
def _matmul_fake(a, b, bias, scale_a, scale_b, activation, out_dtype):
    dtype = torch_dtype(out_dtype) if out_dtype else (torch.bfloat16 if a.dtype == torch.float8_e4m3fn else a.dtype)
    return a.new_empty((a.shape[0], b.shape[1]), dtype=dtype)


def _as_dtype(out_dtype) -> torch.dtype | None:
    if out_dtype is None or isinstance(out_dtype, torch.dtype):
        return out_dtype
    return torch_dtype(canonical_dtype_name(out_dtype))


def matmul(a: torch.Tensor, b: torch.Tensor, *, bias: torch.Tensor | None = None, activation: str | None = None,
           out_dtype: torch.dtype | str | None = None, scale_a: torch.Tensor | None = None,
           scale_b: torch.Tensor | None = None) -> torch.Tensor:
    """C = activation(a @ b (* scale_a * scale_b for fp8) + bias) with the tuned kernel for this shape.

    a (M, K) and b (K, N) of one dtype (fp32, fp16, bf16 or float8_e4m3fn), any strides;
    activation is None, 'relu', 'gelu' or 'silu'; out_dtype defaults to the operands'
    dtype (bf16 for fp8). On a GPU a shape nobody tuned runs the vendor op (cuBLAS /
    torch._scaled_mm); CPU tensors run the generated kernel under Triton's interpreter.

    >>> import torch, autotile
    >>> a, b = torch.randn(5, 7), torch.randn(7, 3)
    >>> torch.allclose(autotile.matmul(a, b, activation="relu"), torch.relu(a @ b), atol=1e-5)
    True
    """
    if direct_call_ok(a, b, bias, scale_a, scale_b):
        # Eager calls of plain tensors skip the dispatcher (decode GEMMs are short kernels).
        return _run(a, b, bias, activation, _as_dtype(out_dtype), scale_a, scale_b)
    if not torch.compiler.is_compiling():
        # Bad input is reported here, before the op; traced calls meet the same checks when the op runs.
        problem_for(a, b, bias=bias, activation=activation, out_dtype=out_dtype, scale_a=scale_a, scale_b=scale_b)
    out = canonical_dtype_name(out_dtype) if out_dtype is not None else ""
    return _matmul_op(a, b, bias, scale_a, scale_b, activation or "none", out)


def _check_linear(x, weight, bias) -> None:
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
        raise BadInputError("linear takes tensors x (..., K) and weight (N, K), as torch.nn.functional.linear")
    if weight.dim() != 2:
        raise ShapeMismatchError(f"weight must be (out_features, in_features), got {tuple(weight.shape)}")
    if x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ShapeMismatchError(f"x is {tuple(x.shape)} and weight {tuple(weight.shape)}: x's last dim must equal "
                                 "weight.shape[1] (in_features)")
    if bias is not None and (not isinstance(bias, torch.Tensor) or bias.shape != (weight.shape[0],)):
        raise ShapeMismatchError(f"bias must have shape ({weight.shape[0]},), got "
                                 f"{tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__}")


def linear_problem_for(x, weight, bias=None, activation=None):
    """(family, problem, device) of a linear call, for `autotile.explain("linear", x, weight)`."""
    _check_linear(x, weight, bias)
    return problem_for(x.reshape(-1, x.shape[-1]), weight.t(), bias=bias, activation=activation)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           activation: str | None = None) -> torch.Tensor:
    """activation(x @ weight.T + bias), as torch.nn.functional.linear (plus a fused activation).

    x (..., K) with any leading dims; weight (N, K) as nn.Linear stores it; the GEMM's B operand is
    weight.T, column-major, a first-class layout of the gemm family. Tokens (M = x.numel() / K) vary
    per call; winners are served across the M bucket they were verified on. Where the vendor op serves,
    the call is F.linear itself.

    >>> import torch, autotile
    >>> x, w = torch.randn(2, 3, 8), torch.randn(5, 8)
    >>> torch.allclose(autotile.linear(x, w, activation="silu"), torch.nn.functional.silu(x @ w.T), atol=1e-5)
    True
    """
    if direct_call_ok(x, weight, bias):
        served = _linear_served.get(_linear_signature(x, weight, bias, activation))
        if served is None:
            served = _serve_linear(x, weight, bias, activation)
        served.calls[0] += 1
        return served.run(x, weight, bias)
    _check_linear(x, weight, bias)
    lead = x.shape[:-1]
    out = matmul(x.reshape(-1, x.shape[-1]), weight.t(), bias=bias, activation=activation)
    return out.reshape(*lead, weight.shape[0])


_linear_served: dict[tuple, _Served] = {}


def _forget_linear() -> None:
    with _served_lock:
        _linear_served.clear()


on_clear(_forget_linear)


def _linear_signature(x, weight, bias, activation) -> tuple:
    tf32 = x.dtype is torch.float32 and torch.backends.cuda.matmul.allow_tf32
    return (x.shape, x.stride(), weight.shape, weight.stride(), x.dtype, weight.dtype, x.device, weight.device,
            not (x.data_ptr() | weight.data_ptr()) & 15,
            None if bias is None else (bias.shape, bias.dtype, bias.device), activation, tf32)


def _serve_linear(x, weight, bias, activation) -> _Served:
    """What linear calls of this signature run: F.linear itself where the vendor op serves, else the kernel."""
    _check_linear(x, weight, bias)
    key = _linear_signature(x, weight, bias, activation)
    a = x.reshape(-1, x.shape[-1])
    act = _ACTIVATIONS[activation or "none"]
    if a.shape[0] == 0:  # no tokens: nothing to tune or launch
        served = _Served(lambda x, w, b: torch.nn.functional.linear(x, w, b), [0])
    else:
        _, problem, device = problem_for(a, weight.t(), bias=bias, activation=activation)
        resolution = resolve(FAMILY, problem, device)
        if resolution.vendor and resolution.config[VENDOR_KEY] == "cublas":
            def run(x, w, b):
                return torch.nn.functional.linear(x, w, b) if act is None else act(torch.nn.functional.linear(x, w, b))
        else:
            inner = (_vendor_runner(problem, resolution.config[VENDOR_KEY]) if resolution.vendor
                     else _kernel_runner(problem, resolution.config))

            def run(x, w, b):
                return inner(x.reshape(-1, x.shape[-1]), w.t(), b, None, None).view(*x.shape[:-1], w.shape[0])
        served = _Served(run, trace.counter(FAMILY, problem, device))
    with _served_lock:
        _linear_served[key] = served
    return served


__all__ = ["matmul", "linear", "problem_for", "linear_problem_for"]
