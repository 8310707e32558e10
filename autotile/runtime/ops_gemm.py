"""`autotile.matmul` and `autotile.linear`: the tuned GEMM as torch.library custom ops.

What a call runs is decided once per call signature (shapes, strides, dtypes, device, 16-byte alignment,
epilogue) and kept: the stored winner, the vendor op (cuBLAS through torch.matmul / F.linear, or
torch._scaled_mm for fp8) for shapes nobody tuned, or a generated kernel. Later calls with the same
signature pay a dict lookup, one counter increment (AUTOTILE_RECORD) and the launch itself: no
host sync, no allocation a CUDA graph cannot capture.
"""
from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Optional

import torch

from autotile.device import current_device
from autotile.dtypes import canonical_dtype_name, torch_dtype
from autotile.errors import BadInputError, ShapeMismatchError
from autotile.families.base import VENDOR_KEY
from autotile.families.gemm import FAMILY, GemmProblem, check_activation, vendor_matmul
from autotile.families.gemm_launch import bind_gemm
from autotile.runtime import fallback, trace
from autotile.runtime.dispatch import on_clear
from autotile.runtime.eager import any_autocast, autocast_operands, direct_call_ok, under_transform

_ACTIVATIONS = {"none": None, "relu": torch.relu, "silu": torch.nn.functional.silu, "gelu": torch.nn.functional.gelu}


def _activation_fn(activation) -> Callable | None:
    """The torch function of `activation` (None for none), refusing a name the family does not take, as its
    problems do (calls that never build a problem: empty ones, and the vendor op's own epilogue)."""
    name = activation or "none"
    check_activation(name)
    return _ACTIVATIONS[name]


def _inputs(a, b, bias, scale_a, scale_b, residual=None) -> dict:
    inputs = {"a": a, "b": b}
    if bias is not None:
        inputs["bias"] = bias
    if residual is not None:
        inputs["residual"] = residual
    if a.dtype == torch.float8_e4m3fn:
        one = torch.ones(1, dtype=torch.float32, device=a.device)
        scales = [one if scale is None else scale.float() for scale in (scale_a, scale_b)]
        # One value each: per-tensor scales, as 1-element tensors; row and block scales go as they are (a block
        # scale may hold one value: B's (1, 1) of a matmul with K and N up to one 128-block, gemm.scale_mode_of).
        per_tensor = all(scale.numel() == 1 for scale in scales)
        for name, scale in zip(("scale_a", "scale_b"), scales):
            inputs[name] = scale.reshape(1) if per_tensor else scale
    return inputs


def problem_for(a, b, *, bias=None, activation=None, out_dtype=None, scale_a=None, scale_b=None, residual=None,
                fp8_fast_accum=False):
    """(family, problem, device) of a matmul call, for `autotile.explain`: a residual the call adds after the kernel
    (residual_apart) is not the kernel's."""
    _check_tensor_types(a, b, bias, residual, scale_a, scale_b)
    if residual is not None and residual_apart(a, residual, out_dtype):
        residual = None
    problem = FAMILY.problem_from_tensors(a, b, bias, activation, out_dtype, residual=residual, scale_a=scale_a,
                                          scale_b=scale_b, fp8_fast_accum=fp8_fast_accum)
    return FAMILY, problem, current_device(a.device)


def _check_tensor_types(a, b, bias, residual, scale_a, scale_b) -> None:
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        raise BadInputError("matmul takes two tensors a (M, K) and b (K, N)")
    for name, value in (("bias", bias), ("residual", residual), ("scale_a", scale_a), ("scale_b", scale_b)):
        if value is not None and not isinstance(value, torch.Tensor):
            raise BadInputError(f"{name} must be a torch.Tensor or None, got {type(value).__name__}")


def _is_empty(a, b) -> bool:
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dim() == 2 and b.dim() == 2 and (
        0 in (*a.shape, *b.shape))


def _empty_served(a, b, bias, activation, out_dtype, scale_a, scale_b, residual, fp8_fast_accum=False) -> "_Served":
    """A call with no rows, columns or inner dimension: torch.matmul's result (empty, or with K = 0 the epilogue of
    zeros: the bias through the activation, plus the residual), after the checks every call gets. Nothing to tune
    or launch."""
    _check_tensor_types(a, b, bias, residual, scale_a, scale_b)
    _, out, _ = FAMILY.check_operands(a, b, bias, out_dtype, residual=residual, scale_a=scale_a, scale_b=scale_b,
                                      fp8_fast_accum=fp8_fast_accum)
    dtype, act = torch_dtype(out), _activation_fn(activation)

    def run(a, b, bias, scale_a, scale_b, residual):
        c = a.new_zeros((a.shape[0], b.shape[1]), dtype=torch.float32)
        if bias is not None:
            c = c + bias.float()
        if act is not None:
            c = act(c)
        return (c if residual is None else c + residual.float()).to(dtype)

    return _Served(run, [0])


class _Served:
    """What calls of one signature run, worked out once; `calls` counts them for AUTOTILE_RECORD; `plain_vendor`:
    the call is torch.matmul(a, b) or torch.addmm(bias, a, b) itself (cuBLAS serves a 16-bit problem with no
    activation, residual or other output dtype)."""

    __slots__ = ("run", "calls", "plain_vendor", "bound_linear", "short_key_tried")

    def __init__(self, run: Callable, counter: list, plain_vendor: bool = False):
        self.run = run
        self.calls = counter  # a one-element list shared with autotile.runtime.trace
        self.plain_vendor = plain_vendor
        # linear signatures a generated kernel serves: the runner's bound_launch (see _FastLinear)
        self.bound_linear: Callable | None = None
        self.short_key_tried = False  # matmul: whether _keep_fast_matmul has seen a call of this signature


_served: dict[tuple, _Served] = {}
_served_lock = threading.Lock()


def _forget_served() -> None:
    with _served_lock:
        _served.clear()
        _matmul_fast.clear()


on_clear(_forget_served)


def _vendor_runner(problem: GemmProblem, kind: str) -> Callable:
    activation, out_dtype, fast = problem.activation, torch_dtype(problem.out_dtype), problem.fp8_fast_accum
    if kind == "cublas" and activation == "none" and not problem.residual:
        return lambda a, b, bias, scale_a, scale_b, residual: (torch.matmul(a, b) if bias is None
                                                               else torch.addmm(bias, a, b))
    one = None

    def run(a, b, bias, scale_a, scale_b, residual):
        nonlocal one
        if kind == "scaled_mm" and (scale_a is None or scale_b is None):
            one = torch.ones(1, dtype=torch.float32, device=a.device) if one is None else one
            scale_a, scale_b = (one if scale_a is None else scale_a), (one if scale_b is None else scale_b)
        return vendor_matmul(kind, a, b, bias, activation, out_dtype, scale_a, scale_b, residual, fast)
    return run


def _kernel_runner(problem: GemmProblem, config) -> Callable:
    out_dtype = torch_dtype(problem.out_dtype)
    shape = (problem.m, problem.n)
    bound = None  # this signature's BoundGemm once bound; False: the plan serves every call
    current = torch.cuda.current_device
    # NOTE: a.new_empty(shape) cost 2.7 us of host time on the H200 machine against torch.empty's 4.3
    # (results/host_pieces_2026-12-02.txt): the output allocation of a served call, where C has A's dtype.
    if torch_dtype(problem.dtype) == out_dtype:
        def new_c(a):
            return a.new_empty(shape)
    else:
        def new_c(a):
            return torch.empty(shape, dtype=out_dtype, device=a.device)

    def run(a, b, bias, scale_a, scale_b, residual):
        nonlocal bound
        if bound and a.device.index == current():
            c = new_c(a)
            bound(a, b, c, bias, residual)
            return c
        if bound is None and a.is_cuda and a.device.index == current():
            c = torch.empty(shape, dtype=out_dtype, device=a.device)
            bound = bind_gemm(FAMILY, problem, config, a, b, c, bias, residual)
            if bound is not None:
                return c  # launched (bound, or through Triton's own path)
            bound = False
        inputs = _inputs(a, b, bias, scale_a, scale_b, residual)
        outputs = {"c": torch.empty(problem.m, problem.n, dtype=out_dtype, device=a.device)}
        if a.is_cuda and a.device.index != torch.cuda.current_device():
            with torch.cuda.device(a.device):
                FAMILY.launch(problem, config, inputs, outputs)
        else:
            FAMILY.launch(problem, config, inputs, outputs)
        return outputs["c"]

    def launch_bound(a, b, bias):
        # The bound launch of a call with no residual. A linear call passes its weight as b, as it is (its data
        # pointer is its transpose's), saving the transpose's cost on every call.
        c = new_c(a)
        bound(a, b, c, bias, None)
        return c

    def run_linear(x, weight, bias):
        """run(x, weight.t(), bias, ...) for a 2-D x and an (N, K) weight."""
        if bound and x.device.index == current():
            return launch_bound(x, weight, bias)
        return run(x, weight.t(), bias, None, None, None)

    def bound_launch() -> tuple[Callable, int] | None:
        """(launch_bound, its device index) once the signature is bound: a launch with no checks (the caller's
        guards hold them: _FastLinear, _FastMatmul); None before the first launch, and where it launches through
        Triton's own path."""
        return (launch_bound, bound.device_index) if bound else None

    run.linear = run_linear
    run.bound_launch = bound_launch
    return run


def _serve(problem: GemmProblem, device) -> _Served:
    resolution = fallback.usable(FAMILY, problem, device)
    plain_vendor = (resolution.vendor and resolution.config[VENDOR_KEY] == "cublas"
                    and problem.dtype in ("bf16", "fp16") and problem.out_dtype == problem.dtype
                    and problem.activation == "none" and not problem.residual)
    served = _Served(None, trace.counter(FAMILY, problem, device), plain_vendor)

    def install(run) -> None:
        served.run = run

    def build(resolution, *call) -> tuple:
        # A generated kernel's first call may fail over to the next choice (autotile.runtime.fallback).
        if resolution.vendor:
            return resolution.config, _vendor_runner(problem, resolution.config[VENDOR_KEY])
        choice = fallback.Choice(FAMILY, problem, device, resolution.config, resolution.source)
        return resolution.config, fallback.guard(choice, _kernel_runner(problem, resolution.config), build, install)

    served.run = build(resolution)[1]
    return served


def _shape_key(a, b, bias) -> tuple:
    # The shapes and dtypes of a signature: the key of the vendor fast path, and the first half of the full one.
    # The bias's too: addmm would broadcast a bias of another shape that the checks refuse. (matmul builds it
    # inline: keep the two alike.)
    return (a.shape, b.shape, a.dtype, b.dtype) if bias is None else (a.shape, b.shape, a.dtype, b.dtype,
                                                                        bias.shape, bias.dtype)


def _layout_key(a, b, bias, activation, out_dtype, scale_a, scale_b, residual, fast_accum) -> tuple:
    # The rest of what the problem (and so the served config) depends on: with _shape_key, ~1.5 us to build.
    tf32 = a.dtype is torch.float32 and torch.backends.cuda.matmul.allow_tf32
    return (a.stride(), b.stride(), a.device, b.device, not (a.data_ptr() | b.data_ptr()) & 15, _extra(bias),
            activation, out_dtype, _extra(scale_a), _extra(scale_b), tf32, _extra(residual), fast_accum)


def _extra(t) -> tuple | None:
    # Shape, strides, dtype, device and 16-byte alignment of a bias or residual: a kept launcher is
    # specialised on the alignment of every pointer, as Triton is.
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device, not t.data_ptr() & 15)


def _served_for(a, b, bias, activation, out_dtype, scale_a, scale_b, residual=None, fast_accum=False,
                shapes: tuple | None = None) -> _Served:
    """`shapes`: _shape_key(a, b, bias) where the caller has it already."""
    try:
        shapes = _shape_key(a, b, bias) if shapes is None else shapes
        key = (shapes, _layout_key(a, b, bias, activation, out_dtype, scale_a, scale_b, residual, fast_accum))
    except AttributeError:  # not tensors (a NumPy array, a list): the checks say what to pass
        problem_for(a, b, bias=bias, activation=activation, out_dtype=out_dtype, scale_a=scale_a, scale_b=scale_b,
                    residual=residual, fp8_fast_accum=fast_accum)
        raise
    served = _served.get(key)
    if served is None:
        if _is_empty(a, b):
            return _empty_served(a, b, bias, activation, out_dtype, scale_a, scale_b, residual, fast_accum)
        _, problem, device = problem_for(a, b, bias=bias, activation=activation, out_dtype=out_dtype,
                                         scale_a=scale_a, scale_b=scale_b, residual=residual,
                                         fp8_fast_accum=fast_accum)
        served = _serve(problem, device)
        with _served_lock:
            _served[key] = served
            if served.plain_vendor:
                _matmul_fast[shapes] = served.calls
    return served


def _run(a, b, bias, activation, out_dtype, scale_a, scale_b, residual=None, fast_accum=False,
         shapes: tuple | None = None) -> torch.Tensor:
    served = _served_for(a, b, bias, activation, out_dtype, scale_a, scale_b, residual, fast_accum, shapes)
    served.calls[0] += 1
    return served.run(a, b, bias, scale_a, scale_b, residual)


@torch.library.custom_op("autotile::matmul", mutates_args=())
def _matmul_op(a: torch.Tensor, b: torch.Tensor, bias: Optional[torch.Tensor], scale_a: Optional[torch.Tensor],
               scale_b: Optional[torch.Tensor], residual: Optional[torch.Tensor], activation: str, out_dtype: str,
               fp8_fast_accum: bool) -> torch.Tensor:
    out = torch_dtype(out_dtype) if out_dtype else None
    return _run(a, b, bias, activation if activation != "none" else None, out, scale_a, scale_b, residual,
                fp8_fast_accum)


@_matmul_op.register_fake
def _matmul_fake(a, b, bias, scale_a, scale_b, residual, activation, out_dtype, fp8_fast_accum):
    dtype = torch_dtype(out_dtype) if out_dtype else (torch.bfloat16 if a.dtype == torch.float8_e4m3fn else a.dtype)
    return a.new_empty((a.shape[0], b.shape[1]), dtype=dtype)


def _matmul_setup(ctx, inputs, output) -> None:
    a, b, bias, scale_a, scale_b, residual, activation, out_dtype, fp8_fast_accum = inputs
    ctx.fp8 = a.dtype == torch.float8_e4m3fn or scale_a is not None
    ctx.activation = activation
    ctx.fp8_fast_accum = fp8_fast_accum
    ctx.dtypes = (a.dtype, b.dtype, None if bias is None else bias.dtype, None if residual is None else residual.dtype)
    ctx.save_for_backward(a, b, bias, scale_a, scale_b)


def _matmul_backward(ctx, grad):
    """Gradients of C = act(a @ b + bias) + residual, in torch (as F.linear's backward: matmuls in the operands'
    dtype); an activation's derivative at a @ b + bias, recomputed in the operands' dtype (what autograd keeps of
    act(F.linear(...)) written in torch) and taken in fp32: nothing extra is kept from the forward."""
    a, b, bias, scale_a, scale_b = ctx.saved_tensors
    a_dtype, b_dtype, bias_dtype, residual_dtype = ctx.dtypes
    need = ctx.needs_input_grad
    g = grad
    if ctx.fp8:
        if any(need[i] for i in (0, 1, 3, 4)):
            raise BadInputError("autotile.matmul has no backward for fp8 operands or their scales: call it on tensors "
                                "that do not require grad, or under torch.no_grad()")
        # A bias or residual of an fp8 call trains (an adapter's): its gradient is grad through the activation,
        # at the pre-activation the op computes again without it (fp32 out).
        if bias is not None and need[2] and ctx.activation != "none":
            pre = _run(a, b, bias.float(), None, torch.float32, scale_a, scale_b, None, ctx.fp8_fast_accum)
            pre = pre.detach().requires_grad_(True)
            with torch.enable_grad():
                (g,) = torch.autograd.grad(_ACTIVATIONS[ctx.activation](pre), pre, grad.float())
        grad_bias = g.float().sum(0).to(bias_dtype) if bias is not None and need[2] else None
        grad_residual = grad.to(residual_dtype) if residual_dtype is not None and need[5] else None
        return None, None, grad_bias, None, None, grad_residual, None, None, None
    if ctx.activation != "none":
        # Under create_graph the derivative keeps its graph back to a, b and the bias, so a second backward (a
        # gradient penalty) differentiates through the activation too.
        second = torch.is_grad_enabled()
        with torch.enable_grad():
            pre = torch.matmul(a, b) if bias is None else torch.addmm(bias.to(a.dtype), a, b)
            pre = pre.float()
            if not (second and pre.requires_grad):
                pre = pre.detach().requires_grad_(True)
            (g,) = torch.autograd.grad(_ACTIVATIONS[ctx.activation](pre), pre, grad.float(), create_graph=second)
    grad_a = torch.matmul(g.to(b_dtype), b.t()).to(a_dtype) if need[0] else None
    grad_b = torch.matmul(a.t(), g.to(a_dtype)).to(b_dtype) if need[1] else None
    grad_bias = g.float().sum(0).to(bias_dtype) if bias is not None and need[2] else None
    grad_residual = grad.to(residual_dtype) if residual_dtype is not None and need[5] else None
    return grad_a, grad_b, grad_bias, None, None, grad_residual, None, None, None


torch.library.register_autograd("autotile::matmul", _matmul_backward, setup_context=_matmul_setup)


def _as_dtype(out_dtype) -> torch.dtype | None:
    if out_dtype is None or isinstance(out_dtype, torch.dtype):
        return out_dtype
    return torch_dtype(canonical_dtype_name(out_dtype))


def matmul(a: torch.Tensor, b: torch.Tensor, *, bias: torch.Tensor | None = None, activation: str | None = None,
           out_dtype: torch.dtype | str | None = None, scale_a: torch.Tensor | None = None,
           scale_b: torch.Tensor | None = None, residual: torch.Tensor | None = None,
           fp8_fast_accum: bool = False) -> torch.Tensor:
    """C = activation(a @ b (* fp8 scales) + bias) + residual with the tuned kernel for this shape.

    a (M, K) and b (K, N) of one dtype (fp32, fp16, bf16 or float8_e4m3fn), any strides;
    activation is None, 'relu', 'gelu' or 'silu'; residual an (M, N) tensor added last; out_dtype
    defaults to the operands' dtype (bf16 for fp8). fp8 scales (float32) are per tensor (one value
    each), per row of A and column of B ((M, 1) and (1, N)), or per 1 x 128 group of A and 128 x 128
    block of B ((M, ceil(K/128)) and (ceil(K/128), ceil(N/128))); `fp8_fast_accum` (fp8 only) never promotes the
    tensor cores' partial sums (as torch._scaled_mm's use_fast_accum). On a GPU a shape nobody tuned
    runs the vendor op (cuBLAS / torch._scaled_mm) where there is one; CPU tensors run the generated
    kernel under Triton's interpreter.

    >>> import torch, autotile
    >>> a, b = torch.randn(5, 7), torch.randn(7, 3)
    >>> torch.allclose(autotile.matmul(a, b, activation="relu"), torch.relu(a @ b), atol=1e-5)
    True
    """
    shapes = None
    if not _is_compiling():
        try:
            # _shape_key(a, b, bias), inlined (keep the two alike): a call this short is bound by host time, and a
            # Python frame shows in it.
            shapes = ((a.shape, b.shape, a.dtype, b.dtype) if bias is None
                      else (a.shape, b.shape, a.dtype, b.dtype, bias.shape, bias.dtype))
        except AttributeError:  # not tensors: the checks below say what to pass
            pass
        plain = (shapes is not None and activation is None and out_dtype is None and scale_a is None
                 and scale_b is None and residual is None and not fp8_fast_accum)
        fast = _matmul_fast.get(shapes) if plain else None
        if fast.__class__ is list:
            # A signature cuBLAS serves as torch.matmul(a, b) (addmm with a bias): called with no checks first (a
            # short call is bound by host time, and torch is right for any strides, devices and autograd).
            fast[0] += 1
            return _torch_mm(a, b) if bias is None else _torch_addmm(bias, a, b)
        if fast is not None and not _any_autocast():
            out = fast(a, b, bias)
            if out is not None:
                return out
    # Under torch.autocast, 16- and 32-bit operands are cast as torch.matmul's are (fp8 calls run as given).
    if (scale_a is None and scale_b is None and (_any_autocast() or _is_compiling())
            and (cast := autocast_operands(a, b, bias)) is not None):
        return matmul(*cast[:2], bias=cast[2], activation=activation, out_dtype=out_dtype, residual=residual,
                      fp8_fast_accum=fp8_fast_accum)
    if residual is not None and residual_apart(a, residual, out_dtype):
        return _add_residual(matmul(a, b, bias=bias, activation=activation, out_dtype=out_dtype, scale_a=scale_a,
                                    scale_b=scale_b, fp8_fast_accum=fp8_fast_accum), residual)
    if direct_call_ok(a, b, bias, scale_a, scale_b, residual):
        # Eager calls of plain tensors skip the dispatcher (decode GEMMs are short kernels). The shapes' key is the
        # first half of the full signature's.
        served = _served_for(a, b, bias, activation, _as_dtype(out_dtype), scale_a, scale_b, residual, fp8_fast_accum,
                             shapes)
        served.calls[0] += 1
        out = served.run(a, b, bias, scale_a, scale_b, residual)
        if plain and not served.short_key_tried:  # once: whether the signature can take one is known by now
            served.short_key_tried = True
            _keep_fast_matmul(served, shapes, a, b, bias)
        return out
    if not torch.compiler.is_compiling() and under_transform():
        return _matmul_in_torch(a, b, bias, activation, out_dtype, scale_a, scale_b, residual, fp8_fast_accum)
    if not torch.compiler.is_compiling():
        # Bad input is reported here, before the op; traced calls meet the same checks when the op runs.
        if _is_empty(a, b):
            _empty_served(a, b, bias, activation, _as_dtype(out_dtype), scale_a, scale_b, residual, fp8_fast_accum)
        else:  # the problem alone: meta tensors have no device to run on, and the op's fake registration serves them
            _check_tensor_types(a, b, bias, residual, scale_a, scale_b)
            FAMILY.problem_from_tensors(a, b, bias, activation, out_dtype, residual=residual, scale_a=scale_a,
                                        scale_b=scale_b, fp8_fast_accum=fp8_fast_accum)
    out = canonical_dtype_name(out_dtype) if out_dtype is not None else ""
    return _matmul_op(a, b, bias, scale_a, scale_b, residual, activation or "none", out, bool(fp8_fast_accum))


def _matmul_in_torch(a, b, bias, activation, out_dtype, scale_a, scale_b, residual, fp8_fast_accum) -> torch.Tensor:
    """A matmul call inside a torch.func transform (eager.under_transform), after the checks every call gets: torch's
    ops, as the vendor config runs them; accumulated in fp32 where the output's dtype is not the operands'."""
    _check_tensor_types(a, b, bias, residual, scale_a, scale_b)
    if _is_empty(a, b):
        served = _empty_served(a, b, bias, activation, _as_dtype(out_dtype), scale_a, scale_b, residual,
                               fp8_fast_accum)
        return served.run(a, b, bias, scale_a, scale_b, residual)
    problem = FAMILY.problem_from_tensors(a, b, bias, activation, out_dtype, residual=residual, scale_a=scale_a,
                                          scale_b=scale_b, fp8_fast_accum=fp8_fast_accum)
    if problem.dtype == "fp8":
        raise BadInputError("autotile.matmul has no torch.func path for fp8 operands: call it outside vmap, grad and "
                            "the other torch.func transforms")
    out = torch_dtype(problem.out_dtype)
    if out != a.dtype:
        a, b, bias, residual = (None if t is None else t.float() for t in (a, b, bias, residual))
    return vendor_matmul("cublas", a, b, bias, problem.activation, out, residual=residual).to(out)


def residual_apart(a, residual, out_dtype) -> bool:
    """A residual whose dtype is not the output's: the call adds it after the kernel, as `F.linear(x, w) + residual`
    promotes (an fp32 residual stream beside bf16 layers under autocast); fused, it would be rounded into the
    output's dtype."""
    if not (isinstance(a, torch.Tensor) and isinstance(residual, torch.Tensor) and residual.is_floating_point()
            and residual.device == a.device):
        return False  # the checks name what to pass
    out = _as_dtype(out_dtype) or (torch.bfloat16 if a.dtype == torch.float8_e4m3fn else a.dtype)
    return residual.dtype != out


def _as_linear_bias(bias, weight):
    """`bias` as the (N,) bias linear's kernels take where F.linear broadcasts it over the features alone; else as
    given (the checks name a bias of any other shape)."""
    if (isinstance(bias, torch.Tensor) and isinstance(weight, torch.Tensor) and weight.dim() == 2
            and bias.shape != weight.shape[:1] and (flat := _feature_bias(bias, weight.shape[0])) is not None):
        return flat
    return bias


def _feature_bias(bias: torch.Tensor, n: int) -> torch.Tensor | None:
    """A bias F.linear broadcasts over the output features alone ((1, N), (1, 1), a single value) as the (N,) one
    the kernels take (differentiable); None for any other shape (the checks name it)."""
    if bias.dim() > 2 or any(size != 1 for size in bias.shape[:-1]) or (bias.dim() and bias.shape[-1] not in (1, n)):
        return None
    return bias.reshape(-1).expand(n).contiguous() if bias.numel() == 1 else bias.reshape(n)


def _add_residual(y: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    if tuple(residual.shape) != tuple(y.shape):  # `+` would broadcast it
        raise ShapeMismatchError(f"residual must have the output's shape {tuple(y.shape)}, got {tuple(residual.shape)}")
    return y + residual


def _check_linear(x, weight, bias, residual=None) -> None:
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
    out_shape = (*x.shape[:-1], weight.shape[0])
    if residual is not None and (not isinstance(residual, torch.Tensor) or tuple(residual.shape) != out_shape):
        raise ShapeMismatchError(f"residual must have the output's shape {out_shape}, got "
                                 f"{tuple(residual.shape) if isinstance(residual, torch.Tensor) else type(residual).__name__}")


def matmul_problem_for(a, b, *, bias=None, activation=None, out_dtype=None, scale_a=None, scale_b=None, residual=None,
                       fp8_fast_accum=False):
    """problem_for as the call sees it, for `autotile.explain("matmul", a, b)`: under torch.autocast, the operands
    cast as matmul casts them."""
    if scale_a is None and scale_b is None and (cast := autocast_operands(a, b, bias)) is not None:
        a, b, bias = cast
    return problem_for(a, b, bias=bias, activation=activation, out_dtype=out_dtype, scale_a=scale_a, scale_b=scale_b,
                       residual=residual, fp8_fast_accum=fp8_fast_accum)


def matmul_empty_call(a, b, *, bias=None, activation=None, out_dtype=None, scale_a=None, scale_b=None, residual=None,
                      fp8_fast_accum=False) -> tuple | None:
    """For autotile.explain: (family, device) of a call with an empty dimension, after the checks every call gets (it
    launches nothing: _empty_served), else None."""
    if not _is_empty(a, b):
        return None
    _empty_served(a, b, bias, activation, _as_dtype(out_dtype), scale_a, scale_b, residual, fp8_fast_accum)
    return FAMILY, current_device(a.device)


def linear_empty_call(x, weight, bias=None, activation=None, residual=None) -> tuple | None:
    """matmul_empty_call of a linear call: no tokens, or a weight with no rows or columns."""
    if not (isinstance(x, torch.Tensor) and isinstance(weight, torch.Tensor)):
        return None
    bias = _as_linear_bias(bias, weight)
    _check_linear(x, weight, bias, residual)
    return matmul_empty_call(x.reshape(-1, x.shape[-1]), weight.t(), bias=bias, activation=activation,
                             residual=None if residual is None else residual.reshape(-1, weight.shape[0]))


def linear_problem_for(x, weight, bias=None, activation=None, residual=None):
    """(family, problem, device) of a linear call, for `autotile.explain("linear", x, weight)`: under torch.autocast,
    x, weight and bias cast as linear casts them."""
    if (cast := autocast_operands(x, weight, bias)) is not None:
        x, weight, bias = cast
    bias = _as_linear_bias(bias, weight)
    _check_linear(x, weight, bias, residual)
    return problem_for(x.reshape(-1, x.shape[-1]), weight.t(), bias=bias, activation=activation,
                       residual=None if residual is None else residual.reshape(-1, weight.shape[0]))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           activation: str | None = None, residual: torch.Tensor | None = None) -> torch.Tensor:
    """activation(x @ weight.T + bias) + residual, as torch.nn.functional.linear (plus a fused epilogue).

    x (..., K) with any leading dims; weight (N, K) as nn.Linear stores it; residual, if given, has the
    output's shape (..., N) (a decoder layer's skip connection). The GEMM's B operand is weight.T,
    column-major, a first-class layout of the gemm family. Tokens (M = x.numel() / K) vary per call;
    winners are served across the M bucket they were verified on. Where the vendor op serves, the call
    is F.linear itself.

    >>> import torch, autotile
    >>> x, w = torch.randn(2, 3, 8), torch.randn(5, 8)
    >>> torch.allclose(autotile.linear(x, w, activation="silu"), torch.nn.functional.silu(x @ w.T), atol=1e-5)
    True
    """
    if not _is_compiling():
        # Signatures seen before are found by a short key (the weight object, the tokens' shape) first.
        fast = _linear_fast.get((x.shape, x.dtype, id(weight), bias is None, residual is None, activation))
        if fast.__class__ is _VendorLinear:
            # The vendor serves it. NOTE: inlined rather than through a runner: a call this short is bound by host
            # time, and each Python frame shows in it (the plain case; activation and residual take the runner).
            fast.calls[0] += 1
            if activation is None and residual is None:
                weight_t = fast.weight_t
                if (weight_t is not None and (bias is None or fast.two_d) and x.__class__ is _Tensor
                        and weight.is_set_to(fast.weight_kept) and weight.dtype is fast.weight_dtype
                        and not _function_mode_on()
                        and not (_grad_enabled() and (weight.requires_grad
                                                      or (bias is not None and bias.requires_grad)))):
                    # F.linear's own call, without its per-call transpose of the weight.
                    return fast.matmul(x, weight_t) if bias is None else _torch_addmm(bias, x, weight_t)
                # F.linear itself: right for autograd, subclasses, modes and devices, as it always is.
                return _f_linear(x, weight, bias)
            return _vendor_epilogue(_f_linear(x, weight, bias), activation, residual)
        if fast is not None and not _any_autocast():
            out = fast(x, weight, bias)
            if out is not None:
                return out
    # Under torch.autocast, x, weight and bias are cast as F.linear's are (the vendor's calls above cast themselves).
    if (_any_autocast() or _is_compiling()) and (cast := autocast_operands(x, weight, bias)) is not None:
        return linear(*cast, activation=activation, residual=residual)
    if isinstance(x, _Tensor) and isinstance(weight, _Tensor) and weight.dim() == 2 and (
            0 in weight.shape or (x.dtype is _FP8 and x.numel() == 0)):
        # No output features or no input features (then every output is its bias), or no fp8 tokens: torch's
        # result, nothing to tune or launch (fp8 as matmul's empty calls: bf16 out, the epilogue in fp32).
        _check_linear(x, weight, bias, residual)
        if x.dtype is _FP8 or weight.dtype is _FP8:
            return _linear_as_matmul(x, weight, bias, activation, residual)
        return _vendor_epilogue(_f_linear(x, weight, bias), activation, residual)
    if (bias is not None and isinstance(bias, _Tensor) and isinstance(weight, _Tensor)
            and (flat := _as_linear_bias(bias, weight)) is not bias):
        return linear(x, weight, flat, activation, residual)
    if residual is not None and residual_apart(x, residual, None):
        return _add_residual(linear(x, weight, bias, activation), residual)
    if direct_call_ok(x, weight, bias, residual):
        try:
            signature = _linear_signature(x, weight, bias, activation, residual)
        except AttributeError:  # not tensors: the checks say what to pass
            _check_linear(x, weight, bias, residual)
            raise
        served = _linear_served.get(signature)
        if served is None:
            served = _serve_linear(x, weight, bias, activation, residual)
        served.calls[0] += 1
        out = served.run(x, weight, bias, residual)
        if served.bound_linear is not None:  # a kernel serves it: later calls may take the short key
            _keep_fast_linear(served, x, weight, bias, activation)
        return out
    _check_linear(x, weight, bias, residual)
    return _linear_as_matmul(x, weight, bias, activation, residual)


def _linear_as_matmul(x, weight, bias, activation, residual) -> torch.Tensor:
    lead, n = x.shape[:-1], weight.shape[0]
    out = matmul(x.reshape(lead.numel(), x.shape[-1]), weight.t(), bias=bias, activation=activation,
                 residual=None if residual is None else residual.reshape(-1, n))
    return out.reshape(*lead, n)


_linear_served: dict[tuple, _Served] = {}
# (x.shape, x.dtype, id(weight), no bias, no residual, activation) -> a _VendorLinear for signatures the vendor op
# serves, or a _FastLinear for those a bound kernel serves. NOTE: keyed by the weight object's id: a
# _VendorLinear leaves the table when its weight is freed (so an id reused later never finds it), and a
# _FastLinear checks that the weight is the object it was bound with before it launches.
_linear_fast: dict[tuple, _VendorLinear | _FastLinear] = {}
# _shape_key(a, b, bias) -> the call counter, for matmul signatures cuBLAS serves as torch.matmul / addmm (a
# 16-bit problem with no epilogue but a bias: _Served.plain_vendor), or a _FastMatmul for a 16-bit signature with
# no epilogue but a bias that a bound kernel serves. NOTE: keyed by shapes and dtypes alone: the same shapes with
# other strides run torch too, which is right for any tensors (at worst a layout a tuned kernel would have served
# runs cuBLAS); a _FastMatmul checks the layout it was bound for, and any other takes the full signature.
_matmul_fast: dict[tuple, list | _FastMatmul] = {}
_is_compiling = torch.compiler.is_compiling
_f_linear = torch.nn.functional.linear
# NOTE: the C getter itself: torch.cuda.current_device() wraps it in a Python call (~0.2 us a call).
_current_cuda_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device
_torch_mm = torch.mm
_torch_addmm = torch.addmm
_Tensor = torch.Tensor
_FP8 = torch.float8_e4m3fn
_grad_enabled = torch._C.is_grad_enabled
_function_mode_on = torch._C._is_torch_function_mode_enabled
_any_autocast = any_autocast


def _vendor_epilogue(y: torch.Tensor, activation, residual) -> torch.Tensor:
    act = _activation_fn(activation)
    y = y if act is None else act(y)
    return y if residual is None else y + residual


def _forget_linear() -> None:
    with _served_lock:
        _linear_served.clear()
        _linear_fast.clear()


on_clear(_forget_linear)


def _linear_signature(x, weight, bias, activation, residual) -> tuple:
    tf32 = x.dtype is torch.float32 and torch.backends.cuda.matmul.allow_tf32
    return (x.shape, x.stride(), weight.shape, weight.stride(), x.dtype, weight.dtype, x.device, weight.device,
            not (x.data_ptr() | weight.data_ptr()) & 15, _extra(bias), activation, tf32, _extra(residual))


def _serve_linear(x, weight, bias, activation, residual) -> _Served:
    """What linear calls of this signature run: F.linear itself where the vendor op serves, else the kernel."""
    _check_linear(x, weight, bias, residual)
    key = _linear_signature(x, weight, bias, activation, residual)
    a = x.reshape(-1, x.shape[-1])

    def vendor(x, w, b, r):
        return _vendor_epilogue(_f_linear(x, w, b), activation, r)

    if a.shape[0] == 0:  # no tokens: nothing to tune or launch
        served = _Served(vendor, [0])
    else:
        n = weight.shape[0]
        _, problem, device = problem_for(a, weight.t(), bias=bias, activation=activation,
                                         residual=None if residual is None else residual.reshape(-1, n))
        resolution = fallback.usable(FAMILY, problem, device)
        if resolution.vendor and resolution.config[VENDOR_KEY] == "cublas":
            served = _Served(vendor, trace.counter(FAMILY, problem, device))
            _keep_vendor_linear((x.shape, x.dtype, id(weight), bias is None, residual is None, activation),
                                trace.counter(FAMILY, problem, device), x, weight)
        else:
            served = _Served(None, trace.counter(FAMILY, problem, device))

            def install(run) -> None:
                served.run = run

            def build(resolution, *call) -> tuple:
                # A generated kernel's first call may fail over to the next choice (autotile.runtime.fallback).
                served.bound_linear = None
                if resolution.vendor and resolution.config[VENDOR_KEY] == "cublas":
                    return resolution.config, vendor
                inner = (_vendor_runner(problem, resolution.config[VENDOR_KEY]) if resolution.vendor
                         else _kernel_runner(problem, resolution.config))

                def general(x, w, b, r):
                    flat = None if r is None else r.reshape(-1, w.shape[0])
                    return inner(x.reshape(-1, x.shape[-1]), w.t(), b, None, None, flat).view(*x.shape[:-1],
                                                                                              w.shape[0])

                if resolution.vendor:
                    return resolution.config, general
                # The signature fixes x's rank: a 2-D x with no residual (a decode step's projection) takes the
                # kernel without the reshapes and the transpose, each a torch call of a few us of host time.
                run = general
                if two_d_plain:
                    run = lambda x, w, b, r, fast=inner.linear: fast(x, w, b)  # noqa: E731
                if residual is None:
                    served.bound_linear = inner.bound_launch
                choice = fallback.Choice(FAMILY, problem, device, resolution.config, resolution.source)
                return resolution.config, fallback.guard(choice, run, build, install)

            two_d_plain = x.dim() == 2 and residual is None
            served.run = build(resolution)[1]
    with _served_lock:
        _linear_served[key] = served
    return served


class _VendorLinear:
    """Later calls of a linear signature the vendor op serves, found by the short key (x's shape and dtype, the
    weight object, the epilogue): F.linear itself, with no checks first, or the call F.linear makes, on a
    transposed view of the weight kept here. at::linear calls torch.mm(x, w.t()) on a 2-D x (torch.addmm with a
    bias), and torch.matmul(x, w.t()) on any other x with no bias (a decode step's (batch, 1, hidden)).

    NOTE: the kept transpose saves the view F.linear builds on every call, and the layers around it: 0.2-1.0 us
    of host time on the development CPU before the guards, 0.7-1.0 us net on the H200 machine
    (results/host_pieces_2026-12-02e_shortkeys.txt), where a decode step's eager call is bound by host time. It is
    taken only while it computes exactly what F.linear would: x a plain tensor; the weight on the storage, offset,
    sizes, strides and dtype it was kept at (a `.data` assignment changes them); no torch function mode (one may
    handle F.linear itself); and no weight or bias the call would record a backward for (the views are
    detached, so that they hold the weight's storage but not the weight: a freed weight drops its entry).
    """

    __slots__ = ("calls", "weight_t", "weight_kept", "weight_dtype", "two_d", "matmul", "weight_ref", "__weakref__")

    def __init__(self, calls: list, x, weight):
        self.calls = calls
        plain = type(weight) in (torch.Tensor, torch.nn.Parameter) and weight.layout == torch.strided
        # The guard: weight.is_set_to(weight_kept) (the same storage, offset, sizes and strides: one C call, ~0.2 us
        # less than comparing the data pointer, shape and strides) and the same dtype.
        self.weight_kept = weight.detach() if plain else None
        self.weight_t = self.weight_kept.t() if plain else None
        self.weight_dtype = weight.dtype
        self.two_d = x.dim() == 2  # the key fixes x's rank
        self.matmul = torch.mm if self.two_d else torch.matmul
        self.weight_ref = None  # set by _keep_vendor_linear: its callback drops the entry


def _keep_vendor_linear(key: tuple, calls: list, x, weight) -> None:
    entry = _VendorLinear(calls, x, weight)
    entry_ref = weakref.ref(entry)

    def forget(_, key=key, table=_linear_fast):
        # The weight is freed: its entry goes, with the storage its view holds. NOTE: no lock here: a collection
        # can run this inside a section that holds _served_lock; dict operations are atomic on their own. The
        # table is bound here, so that a weight freed at interpreter exit still finds it.
        if table.get(key) is entry_ref():
            table.pop(key, None)
    entry.weight_ref = weakref.ref(weight, forget)
    with _served_lock:
        _linear_fast[key] = entry


class _FastLinear:
    """Later calls of a linear signature a bound generated kernel serves, found by the short key: a few guards
    stand for the full signature (~2 us of Python on the development CPU, more on the H200 machine, where a
    decode GEMM's eager call is bound by host time).

    The key fixes x's shape and dtype, the weight object and the epilogue. The guards: the weight (and bias) is
    the object bound, at the data pointer, shape, strides and dtype bound (a `.data` assignment changes them);
    x is contiguous (its strides are then fixed by its shape) and 16-byte aligned, on the bound device, which
    is the current one; and the call may skip the dispatcher (direct_call_ok). Any guard failing returns None:
    the call takes the full signature.
    """

    __slots__ = ("weight_ref", "weight_meta", "bias_ref", "bias_meta", "device_index", "launch", "out_shape",
                 "calls")

    def __init__(self, served: _Served, launch: Callable, device_index: int, x, weight, bias):
        self.weight_ref, self.weight_meta = weakref.ref(weight), _tensor_meta(weight)
        self.bias_ref = None if bias is None else weakref.ref(bias)
        self.bias_meta = None if bias is None else _tensor_meta(bias)
        self.device_index, self.launch, self.calls = device_index, launch, served.calls
        self.out_shape = None if x.dim() == 2 else (*x.shape[:-1], weight.shape[0])

    def __call__(self, x, weight, bias) -> torch.Tensor | None:
        # direct_call_ok first: under a torch.func transform x has no data pointer to read.
        if (direct_call_ok(x, weight, bias) and self.weight_ref() is weight
                and _tensor_meta(weight) == self.weight_meta
                and (bias is None if self.bias_ref is None
                     else self.bias_ref() is bias and _tensor_meta(bias) == self.bias_meta)
                and x.is_contiguous() and not x.data_ptr() & 15
                and x.get_device() == self.device_index == _current_cuda_device()):
            self.calls[0] += 1
            out = self.launch(x, weight, bias)
            return out if self.out_shape is None else out.view(self.out_shape)
        return None


class _FastMatmul:
    """Later calls of a matmul signature a bound generated kernel serves, found by the shapes' key: a few guards
    stand for the rest of the full signature (_layout_key and the walk to the runner: ~1 us of Python on the
    development CPU, 2.5-4 us on the H200 machine's, where a decode GEMM's eager call is bound by host time).

    The key fixes the shapes and dtypes of a, b and the bias, and the caller asks for no epilogue but the bias.
    The guards: a, b and the bias have the strides bound and are 16-byte aligned, on the bound device, which is
    the current one; and the call may skip the dispatcher (direct_call_ok). Any guard failing returns None: the
    call takes the full signature.
    """

    __slots__ = ("a_stride", "b_stride", "bias_stride", "device_index", "launch", "calls")

    def __init__(self, served: _Served, launch: Callable, device_index: int, a, b, bias):
        self.a_stride, self.b_stride = a.stride(), b.stride()
        self.bias_stride = None if bias is None else bias.stride()
        self.device_index, self.launch, self.calls = device_index, launch, served.calls

    def __call__(self, a, b, bias) -> torch.Tensor | None:
        index = self.device_index
        # direct_call_ok first: under a torch.func transform a and b have no data pointer to read.
        if (direct_call_ok(a, b, bias) and a.stride() == self.a_stride and b.stride() == self.b_stride
                and not (a.data_ptr() | b.data_ptr()) & 15
                and a.get_device() == index == _current_cuda_device() and b.get_device() == index
                and (bias is None or (bias.stride() == self.bias_stride and not bias.data_ptr() & 15
                                      and bias.get_device() == index))):
            self.calls[0] += 1
            return self.launch(a, b, bias)
        return None


def _keep_fast_matmul(served: _Served, shapes: tuple, a, b, bias) -> None:
    """After a kernel-served matmul call with no epilogue but a bias: later calls of its shapes may take a
    _FastMatmul where the guards can hold."""
    bound_launch = getattr(served.run, "bound_launch", None)
    # 16-bit operands only (an fp32 signature also depends on torch's TF32 switch, fp8 on its scales), aligned.
    if bound_launch is None or not (a.is_cuda and a.dtype in (torch.bfloat16, torch.float16)):
        return
    if (a.data_ptr() | b.data_ptr() | (0 if bias is None else bias.data_ptr())) & 15:
        return
    bound = bound_launch()
    if bound is not None:
        with _served_lock:
            _matmul_fast.setdefault(shapes, _FastMatmul(served, *bound, a, b, bias))


def _tensor_meta(t: torch.Tensor) -> tuple:
    return t.data_ptr(), t.shape, t.stride(), t.dtype


def _keep_fast_linear(served: _Served, x, weight, bias, activation) -> None:
    """After a kernel-served call: its signature's later calls take a _FastLinear where the guards can hold."""
    # 16-bit x only: an fp32 signature also depends on torch's TF32 switch, which the short key does not hold.
    if not (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and x.is_contiguous()
            and not x.data_ptr() & 15):
        return
    bound = served.bound_linear()
    if bound is None:
        served.bound_linear = None  # launched through Triton's own path: it never binds
        return
    with _served_lock:
        _linear_fast[(x.shape, x.dtype, id(weight), bias is None, True, activation)] = \
            _FastLinear(served, *bound, x, weight, bias)


__all__ = ["matmul", "linear", "problem_for", "linear_problem_for", "matmul_problem_for"]
