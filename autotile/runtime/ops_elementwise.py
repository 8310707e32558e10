"""`autotile.fuse`: one generated kernel for a whole elementwise expression, as a torch.library custom op.

>>> import torch, autotile
>>> t = torch.randn(1000)
>>> torch.allclose(autotile.fuse("sin(x)**2 + cos(x)**2")(x=t), torch.ones(1000), atol=1e-5)
True

Inputs are passed by name: tensors (broadcast together as torch does) and Python
numbers. Each result has torch's broadcast shape (of the inputs it uses) and result dtype,
contiguous; half and bfloat16 inputs are computed in fp32 and rounded once at the end.
Expressions written as assignments return a tuple of their outputs, in order.
There is no backward: call it on tensors that do not require grad.
"""
from __future__ import annotations

import functools
import threading
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from autotile.device import current_device
from autotile.errors import BadInputError, ShapeMismatchError
from autotile.expr import Expression, InputSpec, evaluate, infer_types, parse
from autotile.families.elementwise import FAMILY, LaunchPlan, Plan, check_scalar_fits
from autotile.launch import bind
from autotile.runtime import fallback, trace
from autotile.runtime.dispatch import on_clear
from autotile.runtime.eager import direct_call_ok, under_transform


_default_dtype = torch.get_default_dtype


@functools.lru_cache(maxsize=1024)
def _parsed(text: str) -> Expression:
    return parse(text)


def _check_names(expression: Expression, values: dict) -> None:
    missing = [n for n in expression.inputs if n not in values]
    extra = sorted(set(values) - set(expression.inputs))
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing input(s) {missing}")
        if extra:
            parts.append(f"unexpected input(s) {extra}")
        raise BadInputError(f"{'; '.join(parts)}: the expression uses exactly {list(expression.inputs)}, passed by name")


def _refuse_devices(tensors: dict) -> None:
    listed = ", ".join(f"{n} on {t.device}" for n, t in tensors.items())
    raise BadInputError(f"inputs are on different devices ({listed}); move them to one device")


def _on_one_device(values: dict) -> tuple[dict, torch.device]:
    """The device of the dimensioned tensors; 0-d CPU tensors join it (as torch allows for CPU scalars)."""
    tensors = {n: v for n, v in values.items() if isinstance(v, torch.Tensor)}
    if not tensors:
        for name, value in values.items():
            InputSpec.of(name, value)  # names the input that is neither a tensor nor a number (a list, an array...)
        raise BadInputError("fuse needs at least one tensor input; every input here is a Python number")
    devices = {t.device for t in tensors.values() if t.dim() > 0} or {t.device for t in tensors.values()}
    if len(devices) > 1:
        _refuse_devices({n: t for n, t in tensors.items() if t.dim() > 0})
    device = devices.pop()
    if device.type not in ("cpu", "cuda"):
        raise BadInputError(f"fuse runs on CUDA tensors and (interpreted) on CPU tensors, not on {device.type}")
    moved = {n: v.to(device) if isinstance(v, torch.Tensor) and v.device != device else v for n, v in values.items()}
    return moved, device


@dataclass(frozen=True)
class _Prepared:
    """What a call with one signature (dtypes, shapes, strides, device) needs: memoised per signature.

    `calls` counts the calls of the signature (AUTOTILE_RECORD, autotile.runtime.trace).
    """

    plan: Plan
    launch: LaunchPlan
    shape: tuple[int, ...]
    device: torch.device
    calls: list
    same_device: bool  # a CUDA device that is the current one (or the CPU): no device switch around the launch
    # Per output, the index that cuts the kernel's output (over every input's broadcast shape) down to the output's
    # own broadcast shape, or None where they agree; None for the whole tuple when every output has the full shape.
    narrow: tuple | None
    # [launcher]: the compiled kernel bound at the first CUDA call of a signature without scalar inputs (None:
    # not yet; False: not bindable, the plan launches every call).
    bound: list


_prepared: dict[tuple, _Prepared] = {}
_prepared_lock = threading.Lock()


def _signature(canonical: str, values: dict) -> tuple:
    parts = [canonical]
    for name in sorted(values):
        v = values[name]
        if isinstance(v, torch.Tensor):
            # 16-byte alignment too: a kept launcher is specialised on it, as Triton specialises pointers.
            parts.append((name, v.dtype, tuple(v.shape), v.stride(), v.device, not v.data_ptr() & 15))
        else:
            parts.append((name, type(v)))
    return tuple(parts)


def problem_from(expression: Expression, values: dict):
    """(problem, device info) of one call; raises autotile errors for bad input."""
    _check_names(expression, values)
    values, device = _on_one_device(values)
    return FAMILY.problem_from_values(expression, values), current_device(device), values


def _forget_prepared() -> None:
    with _prepared_lock:
        _prepared.clear()


on_clear(_forget_prepared)


def output_shapes(expression: Expression, values: dict) -> list[tuple[int, ...]]:
    """Each output's shape: the broadcast shape of the tensor inputs it depends on, as eager torch gives it
    ('a = x + 1; b = a * y' gives a the shape of x, not of x and y)."""
    return [tuple(torch.broadcast_shapes(*(values[n].shape for n in names if isinstance(values[n], torch.Tensor))))
            for names in expression.output_inputs()]


def _narrowing(shape: tuple[int, ...], own: tuple[int, ...]) -> tuple | None:
    """The index of a tensor of (broadcast) `shape` that leaves an output of shape `own`: the kernel's values are
    the same along the dimensions the output is broadcast over, so any one slice of them will do."""
    if own == shape:
        return None
    lead = len(shape) - len(own)
    return (0,) * lead + tuple(slice(None) if o == s else slice(0, 1) for o, s in zip(own, shape[lead:]))


def _prepare(problem, device_info, values: dict, config) -> _Prepared:
    plan = FAMILY.plan(problem)
    tensors = [values[n] for n in plan.tensor_names]
    device = tensors[0].device
    shape = tuple(torch.broadcast_shapes(*(t.shape for t in tensors)))
    narrow = tuple(_narrowing(shape, own) for own in output_shapes(plan.expression, values))
    return _Prepared(plan, FAMILY.launch_plan(problem, config, values), shape, device,
                     trace.counter(FAMILY, problem, device_info),
                     device.type == "cpu" or device.index == torch.cuda.current_device(),
                     narrow if any(i is not None for i in narrow) else None, [None])


def _execute(expression: Expression, values: dict) -> list[torch.Tensor]:
    _check_names(expression, values)
    values, _ = _on_one_device(values)
    prepared = _prepared.get(_signature(expression.canonical, values))
    if prepared is None:
        return _first_launch(expression, values)
    return _launch(prepared, values)


def _evaluated(expression: Expression, values: dict) -> list[torch.Tensor]:
    """The outputs computed by eager torch (expr.evaluate), each of its own broadcast shape (output_shapes)."""
    device = next(v for v in values.values() if isinstance(v, torch.Tensor)).device
    return [torch.as_tensor(r, device=device).expand(shape)
            for r, shape in zip(evaluate(expression, values).values(), output_shapes(expression, values))]


def _empty_kernel(expression: Expression, values: dict) -> bool:
    """Whether the kernel's shape (the broadcast shape of all the tensor inputs) is empty while an output's own
    shape is not ('a = x * 2; b = y + 1' with x (3, 0) and y (3, 1)): the kernel would compute nothing of it."""
    try:
        full = torch.broadcast_shapes(*(v.shape for v in values.values() if isinstance(v, torch.Tensor)))
    except RuntimeError:
        return False  # the problem's own check says so
    return 0 in full and any(0 not in shape for shape in output_shapes(expression, values))


def _first_launch(expression: Expression, values: dict) -> list[torch.Tensor]:
    """A new signature: prepare it, launch it, and keep it once it ran. A config that cannot build or launch here
    hands the call (and the signature) to the default config (autotile.runtime.fallback)."""
    if _empty_kernel(expression, values):  # nothing to launch: torch computes the outputs that are not empty
        return [t.clone(memory_format=torch.contiguous_format) for t in _evaluated(expression, values)]
    key = _signature(expression.canonical, values)
    problem, device_info, values = problem_from(expression, values)
    resolution = fallback.usable(FAMILY, problem, device_info)
    while True:
        prepared = _prepare(problem, device_info, values, resolution.config)
        try:
            outputs = _launch(prepared, values)
        except Exception as exc:
            if not fallback.recoverable(exc):
                raise
            choice = fallback.Choice(FAMILY, problem, device_info, resolution.config, resolution.source)
            resolution = fallback.fail_over(choice, exc)
            fallback.warn(choice, resolution.config)
            continue
        with _prepared_lock:
            _prepared[key] = prepared
        return outputs


def _launch(prepared: _Prepared, values: dict) -> list[torch.Tensor]:
    outputs = _launch_full(prepared, values)
    if prepared.narrow is None:
        return outputs
    return [o if index is None else o[index].contiguous() for o, index in zip(outputs, prepared.narrow)]


def _launch_full(prepared: _Prepared, values: dict) -> list[torch.Tensor]:
    """Run the kernel: every output over the broadcast shape of all the inputs."""
    prepared.calls[0] += 1
    # NOTE: new_empty where the output has the first input's dtype: 2.7 us of host time on the H200 machine against
    # torch.empty's 4.3 (results/host_pieces_2026-12-02.txt), on a call whose whole budget is ~10 us over the vendor's.
    like = values[prepared.plan.tensor_names[0]]
    outputs = [like.new_empty(prepared.shape) if d is like.dtype
               else torch.empty(prepared.shape, dtype=d, device=prepared.device) for d in prepared.plan.output_dtypes]
    bound = prepared.bound[0]
    if bound:
        # NOTE: the compiled kernel's own launcher, bound at the signature's first call: the argument signature
        # and the plan are not worked out again (they cost more host time than the fused op saves on small tensors).
        bound(*[values[n] for n in prepared.plan.tensor_names], *outputs, *prepared.launch.geometry_args)
    elif prepared.same_device:
        if bound is None and prepared.device.type == "cuda" and not prepared.plan.scalar_names:
            args = [values[n] for n in prepared.plan.tensor_names] + outputs + list(prepared.launch.geometry_args)
            if prepared.launch.geometry_args[0]:
                prepared.bound[0] = bind(prepared.launch.kernel, prepared.launch.grid, *args,
                                         **prepared.launch.meta) or False
            return outputs
        FAMILY.run(prepared.plan, prepared.launch, values, outputs)
    else:
        with torch.cuda.device(prepared.device):
            FAMILY.run(prepared.plan, prepared.launch, values, outputs)
    return outputs


def _split(values: dict) -> tuple[str, list[torch.Tensor], str, list]:
    tensor_names = [n for n in sorted(values) if isinstance(values[n], torch.Tensor)]
    scalar_names = [n for n in sorted(values) if not isinstance(values[n], torch.Tensor)]
    return ",".join(tensor_names), [values[n] for n in tensor_names], ",".join(scalar_names), [values[n] for n in scalar_names]


def _join(tensor_names: str, tensors, scalar_names: str, scalars) -> dict:
    values = dict(zip([n for n in tensor_names.split(",") if n], tensors))
    values.update(zip([n for n in scalar_names.split(",") if n], scalars))
    return values


@torch.library.custom_op("autotile::fuse", mutates_args=())
def _fuse_op(expr: str, tensor_names: str, tensors: list[torch.Tensor], scalar_names: str,
             scalars: Sequence[int | float | bool]) -> list[torch.Tensor]:
    return _execute(_parsed(expr), _join(tensor_names, tensors, scalar_names, scalars))


@_fuse_op.register_fake
def _fuse_fake(expr, tensor_names, tensors, scalar_names, scalars):
    expression = _parsed(expr)
    values = _join(tensor_names, tensors, scalar_names, scalars)
    specs = {n: InputSpec.of(n, v) for n, v in values.items()}
    typing = infer_types(expression, specs)
    try:
        torch.broadcast_shapes(*(t.shape for t in tensors))  # one kernel runs over all of them
        shapes = output_shapes(expression, values)
    except RuntimeError:
        raise ShapeMismatchError("input shapes do not broadcast together") from None
    like = next((t for t in tensors if t.dim() > 0), tensors[0])
    return [like.new_empty(shape, dtype=typing.outputs[name]) for shape, name in zip(shapes, expression.output_names)]


class FusedExpression:
    """A parsed expression, callable with its inputs by name. Build one with `autotile.fuse(expr)`."""

    def __init__(self, expr: str):
        self.expression = parse(expr)
        self.canonical = self.expression.canonical
        self._names = tuple(sorted(self.expression.inputs))

    def __repr__(self) -> str:
        return f"autotile.fuse({self.canonical!r})"

    def _fast(self, values: dict) -> _Prepared | None:
        """The prepared launch of a call whose signature was seen before, or None (then the full path runs).

        Only plain tensors of one device that need no autograd take this path; a signature is only ever
        prepared by the full path, which checked it.
        """
        if len(values) != len(self._names) or _default_dtype() is not torch.float32:
            return None
        parts = [self.canonical]
        for name in self._names:
            v = values.get(name)
            if type(v) is torch.Tensor:
                if v.requires_grad and torch.is_grad_enabled():
                    return None
                parts.append((name, v.dtype, tuple(v.shape), v.stride(), v.device, not v.data_ptr() & 15))
            else:
                parts.append((name, type(v)))
        return _prepared.get(tuple(parts))

    def __call__(self, *args, **values):
        if not args and direct_call_ok():
            prepared = self._fast(values)
            if prepared is not None:
                results = _launch(prepared, values)
                return results[0] if self.expression.bare else tuple(results)
        if args:
            raise BadInputError(f"pass inputs by name, e.g. fuse(...)({', '.join(f'{n}=...' for n in self.expression.inputs)})")
        _check_names(self.expression, values)
        values = {name: _host_scalar(value) for name, value in values.items()}
        if not torch.compiler.is_compiling() and under_transform():
            return self._in_torch(values)
        if (_default_dtype() is not torch.float32 and not torch.compiler.is_compiling()
                and self._typed_by_default(values)):
            return self._in_torch(values, copies=True)
        # Traced too: the op has no autograd formula, and torch.compile would fail on it with torch's own words.
        if torch.is_grad_enabled() and any(isinstance(v, torch.Tensor) and v.requires_grad for v in values.values()):
            raise BadInputError("fuse has no backward; detach the inputs or call it under torch.no_grad()")
        if direct_call_ok(*values.values()):
            results = _execute(self.expression, values)
        else:  # traced, fake or subclass tensors: the op's registrations handle them
            if not torch.compiler.is_compiling():
                _no_meta_mix(values)
                _check_scalars(values)
            results = _fuse_op(self.canonical, *_split(values))
        if self.expression.bare:
            return results[0]
        return tuple(results)


    def _in_torch(self, values: dict, copies: bool = False):
        """The expression in eager torch, after the checks every call gets; each output of the broadcast shape of
        the inputs it uses. Inside a torch.func transform (eager.under_transform), which every transform knows
        (grad included); or as new tensors (`copies`), where the kernel would type the call otherwise."""
        _check_scalars(values)
        results = _evaluated(self.expression, values)
        if copies:
            results = [t.clone(memory_format=torch.contiguous_format) for t in results]
        return results[0] if self.expression.bare else tuple(results)

    def _typed_by_default(self, values: dict) -> bool:
        """Whether torch's default dtype, set to other than float32, types this call otherwise than the kernel's
        problem, which is typed under float32 (an integer input through a float op, a Python float into an
        integer tensor): then torch computes it, said once."""
        specs = {name: InputSpec.of(name, value) for name, value in values.items()}
        if infer_types(self.expression, specs).types == infer_types(self.expression, specs, _default_dtype()).types:
            return False
        warnings.warn(f"autotile.fuse: torch's default dtype is {_default_dtype()}, which types "
                      f"{self.canonical!r} unlike the float32 its kernels are built for: eager torch computes it "
                      "(set torch.set_default_dtype(torch.float32) around the call for the kernel)", stacklevel=3)
        return True


def _host_scalar(value):
    """A NumPy scalar (or 0-d array) as the Python number torch would take it as; anything else as it is."""
    if type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0:
        return value.item()
    return value


def _check_scalars(values: dict) -> None:
    """What the op's schema would refuse with a cast error (a list, None, a string, an int wider than 64 bits),
    refused first with the input's name: calls under a torch function mode (torch.set_default_device among them)
    take the op."""
    for name, value in values.items():
        if not isinstance(value, torch.Tensor):
            InputSpec.of(name, value)
            check_scalar_fits(name, value)


def _no_meta_mix(values: dict) -> None:
    """Meta tensors beside real ones are refused (all meta: the op's fake gives shapes and dtypes only). NOTE: the
    dispatcher sends a call with any meta input to the op's fake, which would hand back uninitialised memory on the
    real tensors' device."""
    tensors = {n: v for n, v in values.items() if isinstance(v, torch.Tensor)}
    if any(t.is_meta for t in tensors.values()) and any(not t.is_meta and t.dim() > 0 for t in tensors.values()):
        _refuse_devices(tensors)


def fuse(expr: str) -> FusedExpression:
    """One kernel for the elementwise expression `expr`; call the result with the inputs by name.

    >>> import torch, autotile
    >>> a, b = autotile.fuse("a = x * y; b = relu(a) + z")(x=torch.ones(3), y=torch.full((3,), -2.0), z=1.5)
    >>> a.tolist(), b.tolist()
    ([-2.0, -2.0, -2.0], [1.5, 1.5, 1.5])
    """
    return FusedExpression(expr)


def problem_for(expr: str, *args, **values):
    """(family, problem, device) of `fuse(expr)(**values)`, for `autotile.explain("fuse", expr, **values)`."""
    if args:
        raise BadInputError("pass the inputs of an explained fuse call by name")
    problem, device, _ = problem_from(_parsed(expr) if isinstance(expr, str) else parse(expr), values)
    return FAMILY, problem, device


__all__ = ["fuse", "problem_for", "FusedExpression"]
