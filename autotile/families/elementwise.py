"""Fused elementwise chains: every output of an expression in one pass, intermediates kept in registers.

An expression (autotile/expr.py) is lowered here into a list of steps whose op
names come from the whitelist; templates/elementwise.py.j2 maps each op name to
Triton code. Inputs are addressed one of two ways, chosen by the problem's
layout class (never searched):
  contiguous: every tensor input has the output's shape and is contiguous (or is a
    single element, loaded once): flat offsets, the path that must reach copy bandwidth;
  strided: anything else (broadcasting, transposes, slices): the flat output index is
    decomposed over the broadcast shape, after merging dimensions that are contiguous
    in every input, and each input has its own strides (0 on broadcast dimensions).
Outputs are always allocated contiguous, with torch's broadcast shape and result dtype.
sin and cos of one fp32 value are lowered to one "sincos" step, which shares the range reduction.
"""
from __future__ import annotations

import functools
import itertools
import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from autotile.arch import require_dtypes
from autotile.device import DeviceInfo, current_device
from autotile.errors import BadInputError, ShapeMismatchError
from autotile.expr import (DTYPE_NAMES, DTYPES_BY_NAME, Expression, ExpressionError, InputSpec, Node, Typing, ValueType,
                           default_dtype, evaluate, evaluate_nodes, infer_types, parse)
from autotile.families.base import Baseline, CheckResult, Cost, Family, ProblemOption, Tensors, Tolerance, next_pow2
from autotile.launch import launch as launch_kernel
from autotile.render import launching, load_kernel_module
from autotile.space import Axis, AxisKind, Config, Constraint, Space

LAYOUTS = ("contiguous", "strided")
TUNE_DTYPES = ("fp32", "bf16", "fp16", "fp64")

# The chains of shared/anchors/README.md (2^28 elements, fp32 and bf16), plus a three-input chain.
ANCHOR_CHAINS = ("sin(x)**2 + cos(x)**2", "gelu_tanh(x*1.7+0.3)", "silu(x)*x")
THREE_INPUT_CHAIN = "x * sigmoid(y) + z"
ANCHOR_NUMEL = 2**28

# Offsets stay 32-bit while every reachable offset, plus the slack of one grid-stride step past the end
# (at most 8 programs per SM x 132 SMs x 16384 elements < 2^25), is below 2^31.
_INT32_SLACK = 2**25
_INTERPRET_SMS = 4  # the interpreter runs programs one after another; a few exercise the persistent loop

# Unit roundoff of each floating dtype (half an ulp at 1.0).
_UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, torch.float64: 2.0**-53}
# Error of one computed step, in units of the compute dtype's roundoff: Triton's transcendental functions on
# NVIDIA GPUs use the hardware approximations (ex2/lg2.approx: 2 ulp; sin/cos.approx: 2^-20.9 absolute on
# [-pi, pi], i.e. 8 ulp at 1.0), and pow goes through exp2(b * log2|a|). 16 ulp covers the worst of these.
_ULPS_PER_STEP = 16
# pow(a, b) = exp2(t), t = b * log2|a|: rounding t (and the approximate log2) costs about 2 |t| ln2 ulps of the
# result, and a finite fp32 result needs |t| < 149, so one pow step is budgeted 2 * 149 * ln2 + 16 < 256 ulps.
_ULPS_PER_POW = 256
_ARITH_OPS = frozenset({"add", "sub", "mul", "div", "pow", "neg", "abs", "maximum", "minimum"})
_VALUE_STEPS = frozenset({"load", "scalar", "const", "cast", "round"})
# 16-bit float dtypes a "round" step rounds a value to (and back to its compute type).
_ROUNDED = {torch.float16: "fp16", torch.bfloat16: "bf16"}


@dataclass(frozen=True)
class ElementwiseProblem:
    expr: str  # canonical expression (autotile.expr.parse(...).canonical)
    inputs: str  # 'name:dtype:kind' of every input, sorted by name, comma-separated (kinds: tensor, zero_dim, scalar)
    outputs: str  # 'name:dtype' of every output, in the expression's order
    numel: int  # elements of each output
    layout: str = "contiguous"
    rank: int = 1  # collapsed dimensions of the strided layout
    one_element: str = ""  # dimensioned tensor inputs holding a single element (loaded once), comma-separated
    shape: str = ""  # strided: the collapsed output shape, 'd0xd1x...'
    strides: str = ""  # strided: collapsed strides of each addressed tensor input, 's0,s1;s0,s1'

    def __post_init__(self):
        if self.numel < 0:
            raise ShapeMismatchError(f"numel must be >= 0, got {self.numel}")
        if self.layout not in LAYOUTS:
            raise BadInputError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.rank < 1:
            raise BadInputError(f"rank must be >= 1, got {self.rank}")


@dataclass(frozen=True)
class Geometry:
    """How one call's tensors are addressed: the layout class and, when strided, the collapsed sizes and strides."""

    shape: tuple[int, ...]  # broadcast output shape (uncollapsed)
    numel: int
    layout: str
    one_element: frozenset[str]
    sizes: tuple[int, ...] = ()  # collapsed (strided only)
    strides: tuple[tuple[int, ...], ...] = ()  # collapsed, per addressed tensor input (strided only)
    max_offset: int = 0


def _collapse(shape: Sequence[int], strides: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
    """Drop size-1 dims and merge neighbours that are contiguous in every tensor: (sizes, strides per tensor)."""
    dims = [d for d in range(len(shape)) if shape[d] != 1]
    sizes: list[int] = []
    merged: list[list[int]] = [[] for _ in strides]
    for d in dims:
        if sizes and all(st[-1] == s[d] * shape[d] for st, s in zip(merged, strides)):
            sizes[-1] *= shape[d]
            for st, s in zip(merged, strides):
                st[-1] = s[d]
        else:
            sizes.append(shape[d])
            for st, s in zip(merged, strides):
                st.append(s[d])
    if not sizes:
        return (1,), tuple((0,) for _ in strides)
    return tuple(sizes), tuple(tuple(st) for st in merged)


def geometry_of(tensors: Mapping[str, torch.Tensor], one_element: frozenset[str] | None = None) -> Geometry:
    """The broadcast shape of `tensors` and how each is addressed over it.

    `one_element` names the tensors loaded once (by default: those holding a single element).
    """
    try:
        shape = tuple(torch.broadcast_shapes(*(t.shape for t in tensors.values())))
    except RuntimeError:
        shapes = ", ".join(f"{n}{tuple(t.shape)}" for n, t in tensors.items())
        raise ShapeMismatchError(f"input shapes do not broadcast together: {shapes}; "
                                 "dimensions must match or be 1, aligned from the right as in torch") from None
    numel = math.prod(shape)
    one = frozenset(n for n, t in tensors.items() if t.numel() == 1) if one_element is None else one_element
    if any(tensors[n].numel() != 1 for n in one):
        raise ShapeMismatchError(f"inputs {sorted(one)} must hold a single element for this kernel")
    addressed = [n for n in tensors if n not in one]
    strides = [tensors[n].expand(shape).stride() if tensors[n].shape != shape else tensors[n].stride() for n in addressed]
    sizes, collapsed = _collapse(shape, strides)
    max_offset = max([numel] + [sum((s - 1) * st for s, st in zip(sizes, c)) for c in collapsed])
    if len(sizes) == 1 and all(c == (1,) for c in collapsed):
        return Geometry(shape, numel, "contiguous", one, max_offset=max_offset)
    return Geometry(shape, numel, "strided", one, sizes, collapsed, max_offset)


# --- lowering: op tree -> kernel steps ----------------------------------------------------

def compute_type(vt: ValueType, weak_float: str) -> str:
    """The kernel dtype a value is held in: fp32 for half/bfloat16/fp32, fp64, the integer dtype, i1 for bool."""
    if vt.dtype.is_floating_point:
        if vt.weak:
            return weak_float
        return "fp64" if vt.dtype == torch.float64 else "fp32"
    if vt.dtype == torch.bool:
        return "i1"
    return "i64" if vt.weak else DTYPE_NAMES[vt.dtype]


def _sincos_arguments(expression: Expression, typing: Typing, weak_float: str, uniform_inputs: frozenset[str]
                      ) -> frozenset[str]:
    """Argument nodes (by canonical text) of which the tree takes both sin and cos, in fp32 and per element.

    Those become one "sincos" step (one range reduction for both). A value uniform over the block
    (constants, scalars, one-element inputs and ops of those alone) is a 0-d value computed once per
    block: it keeps tl.sin/tl.cos (nothing to share per element, and the template's block-wide range
    test needs a block), and so does fp64.
    """
    uniform: set[str] = set()
    taken: dict[str, set[str]] = {}
    for node in expression.nodes():
        if (node.kind == "const" or (node.kind == "input" and node.name in uniform_inputs)
                or (node.kind == "op" and all(a.text in uniform for a in node.args))):
            uniform.add(node.text)
        elif node.kind == "op" and node.name in ("sin", "cos") and compute_type(typing.of(node), weak_float) == "fp32":
            taken.setdefault(node.args[0].text, set()).add(node.name)
    return frozenset(arg for arg, names in taken.items() if len(names) == 2)


class _Lowering:
    """Emits the steps of one op tree: each {"dst", "op", "args", "type"} plus "value"/"index"/"bits", and
    "cos" on "sincos" steps (which define two values: sin in "dst", cos in "cos")."""

    def __init__(self, typing: Typing, weak_float: str, sincos_arguments: frozenset[str]):
        self.typing = typing
        self.weak_float = weak_float
        self.sincos_arguments = sincos_arguments  # node texts: see _sincos_arguments
        self.steps: list[dict] = []
        self.dst: dict[str, str] = {}  # node text -> value name
        self.type_of: dict[str, str] = {}  # value name -> compute type
        self.const_of: dict[str, object] = {}  # value name -> constant value, for constants
        self.casts: dict[tuple[str, str], str] = {}
        self.sincos: dict[str, tuple[str, str]] = {}  # argument value name -> (sin, cos) value names

    def emit(self, op: str, type_: str, args: Sequence[str] = (), **extra) -> str:
        dst = f"t{len(self.steps)}"
        self.steps.append({"dst": dst, "op": op, "args": list(args), "type": type_, **extra})
        self.type_of[dst] = type_
        return dst

    def const(self, value, type_: str) -> str:
        value = int(value) if isinstance(value, bool) else value
        if type_ in ("fp32", "fp64"):
            value = float(value)
        elif type_ != "i1":
            value = _wrap_integer(int(value), type_)
        dst = self.emit("const", type_, value=value)
        self.const_of[dst] = value
        return dst

    def as_type(self, name: str, type_: str) -> str:
        if self.type_of[name] == type_:
            return name
        if name in self.const_of:  # a constant is re-emitted in the consumer's dtype, not converted at run time
            return self.const(self.const_of[name], type_)
        key = (name, type_)
        if key not in self.casts:
            self.casts[key] = self.emit("cast", type_, [name])
        return self.casts[key]

    def compared_const(self, name: str, dtype: torch.dtype, type_: str) -> str:
        """A constant a comparison compares in a 16-bit float dtype, rounded to it first as torch rounds it
        (x == 0.1 with x fp16 compares against fp16's 0.1), then emitted in the compute type."""
        value = self.const_of[name]
        if dtype in _ROUNDED and isinstance(value, (int, float)) and not isinstance(value, bool):
            # An int too (x == 2049 compares against fp16's 2048); one past float's range is an infinity there.
            wide = float(value) if abs(value) < 2**1023 else math.copysign(math.inf, value)
            value = torch.tensor(wide, dtype=dtype).item()
        return self.const(value, type_)

    def compared(self, name: str, text: str, dtype: torch.dtype, type_: str) -> str:
        """A value a comparison compares in a 16-bit float dtype it is not of (a scalar input, a 0-d tensor, an
        integer tensor), rounded to that dtype first, as torch casts every operand to the comparison's dtype
        (x == s with x fp16 and s = 0.1 compares against fp16's 0.1), then held in the compute type."""
        value = self.as_type(name, type_)
        if dtype in _ROUNDED and self.typing.types[text].dtype != dtype:
            value = self.emit("round", type_, [value], dtype=_ROUNDED[dtype])
        return value

    def compute(self, node: Node) -> str:
        return compute_type(self.typing.of(node), self.weak_float)

    def op(self, node: Node) -> str:
        out_t = self.compute(node)
        name = node.name
        args = [self.dst[a.text] for a in node.args]
        if out_t == "i1" and name in _ARITH_OPS | {"relu", "silu", "gelu", "gelu_tanh"}:
            raise ExpressionError(f"{name}() on bool values is not supported; turn masks into numbers with where(m, 1, 0)")
        if name in ("lt", "le", "gt", "ge", "eq", "ne"):
            operand = self.typing.operands[node.text]
            arg_t = compute_type(operand, self.weak_float)
            return self.emit(name, out_t, [self.compared_const(a, operand.dtype, arg_t) if a in self.const_of
                                           else self.compared(a, arg.text, operand.dtype, arg_t)
                                           for a, arg in zip(args, node.args)])
        if name == "where":
            cond = self.as_type(args[0], "i1")
            return self.emit("where", out_t, [cond] + [self.as_type(a, out_t) for a in args[1:]])
        if name == "pow":
            return self.pow(node, [self.as_type(a, out_t) for a in args], out_t)
        if name in ("sin", "cos") and node.args[0].text in self.sincos_arguments:
            return self.sin_cos(name, self.as_type(args[0], out_t))
        return self.emit(name, out_t, [self.as_type(a, out_t) for a in args])

    def sin_cos(self, name: str, arg: str) -> str:
        """sin or cos of an fp32 value the tree takes both of: the first of them emits the sincos step."""
        if arg not in self.sincos:
            sin = self.emit("sincos", "fp32", [arg])
            cos = self.steps[-1]["cos"] = f"{sin}_cos"
            self.type_of[cos] = "fp32"
            self.sincos[arg] = (sin, cos)
        return self.sincos[arg][name == "cos"]

    def pow(self, node: Node, args: list[str], out_t: str) -> str:
        base, exponent_node = args[0], node.args[1]
        n = exponent_node.value if exponent_node.kind == "const" else None
        integral = n is not None and not isinstance(n, bool) and float(n).is_integer()
        if out_t in ("fp32", "fp64"):
            # The exponents torch special-cases are computed as torch does (x**2 is x*x, x**-1 is 1/x,
            # x**0.5 is sqrt(x), so (-inf)**0.5 is NaN there, not IEEE pow's inf).
            if integral and abs(int(n)) <= 4:
                return self.power_by_products(base, int(n), out_t)
            if n in (0.5, -0.5):
                return self.emit("sqrt" if n > 0 else "rsqrt", out_t, [base])
            return self.emit("pow", out_t, args)
        if not integral or int(n) < 0:
            raise ExpressionError("integer ** needs a constant non-negative integer exponent, e.g. x**3; "
                                  "for other exponents make the base floating point, e.g. x * 1.0")
        return self.power_by_products(base, int(n), out_t)

    def power_by_products(self, base: str, n: int, type_: str) -> str:
        if n == 0:
            return self.const(1, type_)  # x**0 is 1 for every x, NaN included
        result, square, k = None, base, abs(n)
        while k:
            if k & 1:
                result = square if result is None else self.emit("mul", type_, [result, square])
            k >>= 1
            if k:
                square = self.emit("mul", type_, [square, square])
        if n < 0:
            result = self.emit("div", type_, [self.const(1, type_), result])
        return result


_INTEGER_BITS = {"i8": (8, True), "u8": (8, False), "i16": (16, True), "i32": (32, True), "i64": (64, True)}


def _wrap_integer(value: int, type_: str) -> int:
    """`value` converted to integer dtype `type_` with two's-complement wraparound, as torch converts a Python int
    that meets a narrower integer tensor (int8 x + 300 adds 44); Triton refuses a constant out of its dtype's range.

    >>> _wrap_integer(300, "i8"), _wrap_integer(-1, "u8"), _wrap_integer(5, "i32")
    (44, 255, 5)
    """
    bits, signed = _INTEGER_BITS[type_]
    value &= (1 << bits) - 1
    return value - (1 << bits) if signed and value >= 1 << (bits - 1) else value


@dataclass(frozen=True)
class Plan:
    """Everything a problem implies: the parsed expression, its typing, kernel inputs in order, and the steps."""

    expression: Expression
    specs: Mapping[str, InputSpec]
    typing: Typing
    tensor_names: tuple[str, ...]  # kernel pointer arguments in0, in1, ... (dimensioned and 0-d tensors)
    scalar_names: tuple[str, ...]  # kernel scalar arguments s0, s1, ...
    one_element: frozenset[str]
    steps: tuple[dict, ...]
    output_values: tuple[str, ...]  # the step value each output stores
    output_dtypes: tuple[torch.dtype, ...]
    weak_float: str
    compute_float: str  # fp32 or fp64: precision of the float steps (the lesser, when both occur)

    @property
    def float_comparisons(self) -> list[Node]:
        return [n for n in self.expression.nodes() if n.kind == "op" and n.text in self.typing.operands
                and self.typing.operands[n.text].is_float]

    @property
    def arithmetic_steps(self) -> int:
        """Values computed by ops (a sincos step computes two)."""
        return sum(_values_of(s) for s in self.steps if s["op"] not in _VALUE_STEPS)

    def type_of_output(self, index: int) -> str:
        """The compute dtype of the value output `index` stores."""
        value = self.output_values[index]
        return next(s["type"] for s in self.steps if value in (s["dst"], s.get("cos")))

    @property
    def error_ulps(self) -> int:
        """Rounding error the steps may accumulate, in units of the compute dtype's roundoff (see _ULPS_PER_STEP)."""
        ulps = sum(_ULPS_PER_POW if s["op"] == "pow" else _ULPS_PER_STEP * _values_of(s)
                   for s in self.steps if s["op"] not in _VALUE_STEPS)
        return max(ulps, _ULPS_PER_STEP)


def _values_of(step: dict) -> int:
    return 2 if step["op"] == "sincos" else 1


def build_plan(expression: Expression, specs: Mapping[str, InputSpec], one_element: frozenset[str]) -> Plan:
    typing = infer_types(expression, specs)
    for name, node in expression.outputs:
        if typing.of(node).weak:
            raise ExpressionError(f"output {name!r} depends on no tensor input; every output needs at least one tensor")
    # Python numbers, and ops of them alone, are held in double as Python computes them ('x + (a - b)' with
    # a = 100000001.0 and b = 100000000.0 adds 1, as torch given a - b does); they are uniform over a block, so
    # this costs a few scalar ops a block. A value meeting a tensor takes the tensor's compute type.
    weak_float = "fp64"
    tensor_names = tuple(n for n in expression.inputs if specs[n].kind != "scalar")
    scalar_names = tuple(n for n in expression.inputs if specs[n].kind == "scalar")
    uniform = one_element | frozenset(scalar_names) | frozenset(n for n in tensor_names if specs[n].kind == "zero_dim")
    lowering = _Lowering(typing, weak_float, _sincos_arguments(expression, typing, weak_float, uniform))
    for node in expression.nodes():
        vt = typing.of(node)
        if node.kind == "input" and specs[node.name].kind == "scalar":
            t = compute_type(vt, weak_float)
            value = lowering.emit("scalar", t, index=scalar_names.index(node.name), bits=t == "fp64")
        elif node.kind == "input":
            value = lowering.emit("load", compute_type(vt, weak_float), index=tensor_names.index(node.name))
        elif node.kind == "const":
            value = lowering.const(node.value, compute_type(vt, weak_float))
        else:
            value = lowering.op(node)
        lowering.dst[node.text] = value
    float_types = {s["type"] for s in lowering.steps if s["type"] in ("fp32", "fp64")}
    return Plan(
        expression=expression, specs=dict(specs), typing=typing, tensor_names=tensor_names, scalar_names=scalar_names,
        one_element=one_element,
        steps=tuple(lowering.steps), output_values=tuple(lowering.dst[node.text] for _, node in expression.outputs),
        output_dtypes=tuple(typing.outputs[name] for name in expression.output_names), weak_float=weak_float,
        compute_float="fp32" if "fp32" in float_types or not float_types else "fp64",
    )


def _scalar_value(value):
    """Scalars arrive as Python numbers (the op) or as 0-d CPU tensors (make_inputs)."""
    return value.item() if isinstance(value, torch.Tensor) else value


def check_scalar_fits(name: str, value) -> None:
    """Kernels take integer scalars as int64 (as torch does, which refuses a wider one too)."""
    if type(value) is not int or -2**63 <= value < 2**63:
        return
    raise BadInputError(f"scalar input {name!r} ({len(str(abs(value)))} digits) does not fit 64 bits; "
                        f"pass it as a float, {name}=float(...), or as a tensor")


def _fp64_bits(value: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(value)))[0]


@dataclass(frozen=True)
class LaunchPlan:
    """One kernel launch minus the tensors: reusable for every call with the same shapes and strides."""

    kernel: object
    grid: tuple[int]
    geometry_args: tuple[int, ...]
    meta: Mapping[str, int]
    scalar_bits: tuple[bool, ...]
    interpret: bool


# Elements per thread (BLOCK_SIZE / (32 * num_warps)) is the axis that matters most: 8 suits both memory-bound
# chains and chains heavy in libdevice math (sin/cos: 16-32 per thread ran 1.5x slower on the H200, 2026-11-29,
# benchmarks/results/elementwise_*.md), wide blocks with streaming loads suit the purely memory-bound ones.
_SEED_CONFIGS = (
    dict(BLOCK_SIZE=2048, num_warps=8, num_stages=1, PERSISTENT=False, PROGRAMS_PER_SM=1, STREAMING=False),
    dict(BLOCK_SIZE=512, num_warps=2, num_stages=1, PERSISTENT=False, PROGRAMS_PER_SM=1, STREAMING=False),
    dict(BLOCK_SIZE=1024, num_warps=8, num_stages=1, PERSISTENT=False, PROGRAMS_PER_SM=1, STREAMING=False),
    dict(BLOCK_SIZE=4096, num_warps=8, num_stages=1, PERSISTENT=False, PROGRAMS_PER_SM=1, STREAMING=False),
    dict(BLOCK_SIZE=8192, num_warps=16, num_stages=1, PERSISTENT=False, PROGRAMS_PER_SM=1, STREAMING=True),
    dict(BLOCK_SIZE=4096, num_warps=8, num_stages=3, PERSISTENT=True, PROGRAMS_PER_SM=4, STREAMING=True),
)


class ElementwiseFamily(Family):
    name = "elementwise"
    template = "elementwise.py.j2"
    problem_type = ElementwiseProblem
    shape_fields = ("numel",)
    _STRIDE_FIELDS = ("shape", "strides")  # describe one strided problem; winners serve every shape of its class

    cli_options = (
        ProblemOption("expr", str, "expression over input names, e.g. 'sin(x)**2 + cos(x)**2' (quote it)", multiple=True),
        ProblemOption("numel", int, "elements of each (contiguous) input and output; default 2^28", multiple=True),
        ProblemOption("dtype", str, "dtype of every input", default="fp32", choices=TUNE_DTYPES, multiple=True),
    )

    # --- problems -----------------------------------------------------------------
    def problem_from_values(self, expression: Expression, values: Mapping[str, object]) -> ElementwiseProblem:
        """The problem of one call: `values` maps every input name to a tensor or a Python number."""
        specs = {name: InputSpec.of(name, values[name]) for name in expression.inputs}
        tensors = {n: values[n] for n in expression.inputs if isinstance(values[n], torch.Tensor)}
        if not tensors:
            raise BadInputError("fuse needs at least one tensor input; every input here is a Python number")
        geometry = geometry_of(tensors)
        plan = build_plan(expression, specs, geometry.one_element - {n for n, s in specs.items() if s.kind == "zero_dim"})
        return self._problem(plan, geometry)

    def _problem(self, plan: Plan, geometry: Geometry) -> ElementwiseProblem:
        inputs = ",".join(plan.specs[n].text for n in plan.expression.inputs)
        outputs = ",".join(f"{n}:{DTYPE_NAMES[d]}" for n, d in zip(plan.expression.output_names, plan.output_dtypes))
        # Only inputs the kernel reads: one used by an unused temporary alone is not in the canonical expression.
        read = frozenset().union(*plan.expression.output_inputs())
        one = ",".join(sorted(n for n in geometry.one_element if n in read and plan.specs[n].kind == "tensor"))
        if geometry.layout == "contiguous":
            return ElementwiseProblem(plan.expression.canonical, inputs, outputs, geometry.numel, "contiguous", 1, one)
        return ElementwiseProblem(
            plan.expression.canonical, inputs, outputs, geometry.numel, "strided", len(geometry.sizes), one,
            "x".join(str(s) for s in geometry.sizes), ";".join(",".join(str(v) for v in st) for st in geometry.strides))

    def problem_for_expression(self, expr: str, dtypes: Mapping[str, str] | str = "fp32", numel: int = ANCHOR_NUMEL
                               ) -> ElementwiseProblem:
        """A contiguous problem over 1-D tensors: every input of `expr` a tensor of `dtypes` (one name or per input)."""
        if numel < 1:
            # Calls on empty tensors build problems of numel 0 from their tensors, not here; a problem to tune
            # needs elements to time, and `autotile db import` refuses a winner of none.
            raise ShapeMismatchError(f"numel must be >= 1 to tune or benchmark {expr!r}, got {numel}")
        expression = parse(expr)
        specs = {n: InputSpec(n, dtypes if isinstance(dtypes, str) else dtypes[n]) for n in expression.inputs}
        plan = build_plan(expression, specs, frozenset())
        return self._problem(plan, Geometry((numel,), numel, "contiguous", frozenset(), max_offset=numel))

    @functools.lru_cache(maxsize=512)  # noqa: B019 - the family is a stateless singleton
    def plan(self, problem: ElementwiseProblem) -> Plan:
        expression = parse(problem.expr)
        specs = {s.name: s for s in (InputSpec.from_text(t) for t in problem.inputs.split(","))}
        one = frozenset(n for n in problem.one_element.split(",") if n)
        plan = build_plan(expression, specs, one)
        declared = ",".join(f"{n}:{DTYPE_NAMES[d]}" for n, d in zip(expression.output_names, plan.output_dtypes))
        if declared != problem.outputs:
            raise BadInputError(f"problem declares outputs {problem.outputs!r}, but torch's promotion gives {declared!r}")
        return plan

    def bucket(self, problem: ElementwiseProblem) -> str:
        from autotile.families.base import canonical_json, problem_to_dict

        data = problem_to_dict(problem)
        data["numel"] = next_pow2(problem.numel)
        for name in self._STRIDE_FIELDS:
            data[name] = ""
        return canonical_json(data)

    def distance(self, problem: ElementwiseProblem, other: ElementwiseProblem) -> float | None:
        from autotile.families.base import log2_distance, problem_to_dict

        a, b = problem_to_dict(problem), problem_to_dict(other)
        if any(a[k] != b[k] for k in a if k not in self.shape_fields + self._STRIDE_FIELDS):
            return None
        return log2_distance(problem.numel, other.numel)

    def default_suite(self) -> list[ElementwiseProblem]:
        return [self.problem_for_expression(expr, dtype) for expr in ANCHOR_CHAINS + (THREE_INPUT_CHAIN,)
                for dtype in ("fp32", "bf16")]

    def problems_from_cli(self, expr=None, numel=None, dtype=None, **_unused) -> list[ElementwiseProblem]:
        # Each option may arrive as one value or several; --expr is never split on commas (maximum(x, y)).
        exprs = [expr] if isinstance(expr, str) else list(expr or ())
        if not exprs:
            return self.default_suite()
        numels = [int(n) for n in _values(numel)] or [ANCHOR_NUMEL]
        if min(numels) < 1:
            # Calls on empty tensors still run (a problem of numel 0), but a search on none times nothing, and
            # `autotile db import` refuses such a winner.
            raise ShapeMismatchError(f"--numel must be >= 1, got {min(numels)}: a search needs elements to time")
        dtypes = _values(dtype) or ["fp32"]
        return [self.problem_for_expression(e, d, n) for e in exprs for d in dtypes for n in numels]

    # --- the search -----------------------------------------------------------------
    def space(self, problem: ElementwiseProblem, device: DeviceInfo) -> Space:
        plan = self.plan(problem)
        dtypes = [plan.specs[n].dtype for n in plan.tensor_names] + [DTYPE_NAMES[d] for d in plan.output_dtypes]
        require_dtypes(device, dtypes, f"the fused expression {problem.expr!r}")
        addressed = [plan.specs[n].dtype for n in plan.tensor_names if n not in plan.one_element]
        sizes = [DTYPES_BY_NAME[d].itemsize for d in addressed] + [d.itemsize for d in plan.output_dtypes]
        narrowest = min(sizes)
        per_thread = lambda c: c["BLOCK_SIZE"] // (32 * c["num_warps"])  # noqa: E731
        largest_block = max(1024, next_pow2(problem.numel))
        axes = [
            Axis("BLOCK_SIZE", (256, 512, 1024, 2048, 4096, 8192, 16384)),
            Axis("num_warps", (1, 2, 4, 8, 16), AxisKind.META),
            Axis("num_stages", (1, 2, 3, 4), AxisKind.META),
            Axis("PERSISTENT", (False, True), AxisKind.RENDER),
            Axis("PROGRAMS_PER_SM", (1, 2, 4, 8)),
            Axis("STREAMING", (False, True), AxisKind.RENDER),
        ]
        constraints = [
            # 16 bytes is the widest load one thread issues (ld.global.v4.b32).
            Constraint("full_vectors", lambda c: per_thread(c) * narrowest >= 16,
                       lambda c: f"{per_thread(c)} element(s) of {narrowest} B a thread is less than one 16-byte access"),
            Constraint("registers", lambda c: per_thread(c) <= 64,
                       "more than 64 elements a thread per live value spills registers"),
            Constraint("block_within_problem", lambda c: c["BLOCK_SIZE"] <= largest_block,
                       f"a block beyond {largest_block} elements only computes padding"),
            Constraint("grid_only_when_persistent", lambda c: c["PERSISTENT"] or c["PROGRAMS_PER_SM"] == 1,
                       "PROGRAMS_PER_SM sizes the persistent grid only"),
            Constraint("stages_only_when_persistent", lambda c: c["PERSISTENT"] or c["num_stages"] == 1,
                       "without the persistent loop there is no loop to pipeline"),
        ]
        return Space(axes, constraints)

    def seed_configs(self, problem: ElementwiseProblem, device: DeviceInfo) -> list[Config]:
        """Shapes that reach HBM bandwidth on Hopper, tried right after the default (wide blocks, 8-16 warps,
        optionally a persistent grid-stride loop with streaming loads)."""
        space = self.space(problem, device)
        return [Config(w) for w in _SEED_CONFIGS if space.is_feasible(w)]

    def default_config(self, problem: ElementwiseProblem, device: DeviceInfo) -> Config:
        # 8 elements per thread, as Inductor's pointwise default: 0.99x torch.compile on the sin/cos chain where
        # 4096 x 8 warps (16 per thread) ran 0.67x (H200, 2026-11-29).
        preferred = dict(BLOCK_SIZE=1024, num_warps=4, num_stages=1, PERSISTENT=False, PROGRAMS_PER_SM=1,
                         STREAMING=False)
        return self.first_feasible(problem, device, preferred)

    # --- data -----------------------------------------------------------------------
    def make_inputs(self, problem: ElementwiseProblem, device: DeviceInfo, seed: int = 0) -> Tensors:
        plan = self.plan(problem)
        dev = torch.device(device.torch_device)
        gen = torch.Generator(device=dev).manual_seed(seed)
        if problem.layout == "strided":
            sizes = tuple(int(s) for s in problem.shape.split("x"))
            strides = iter(tuple(int(v) for v in st.split(",")) for st in problem.strides.split(";"))
        else:
            sizes = (problem.numel,)
            strides = itertools.repeat((1,))
        inputs: Tensors = {}
        for name in plan.expression.inputs:
            spec = plan.specs[name]
            if spec.kind == "scalar":
                # Scalars travel as 0-d CPU tensors here; the op passes Python numbers.
                value = {"float": 0.75, "int": 3, "bool": True}[spec.dtype]
                inputs[name] = torch.tensor(value)
                continue
            dtype = DTYPES_BY_NAME[spec.dtype]
            if spec.kind == "zero_dim" or name in plan.one_element:
                shape, stride = ((),) * 2 if spec.kind == "zero_dim" else ((1,) * len(sizes),) * 2
            else:
                shape, stride = sizes, next(strides)
            storage = 1 + sum((s - 1) * st for s, st in zip(shape, stride))
            flat = _random(storage, dtype, dev, gen)
            inputs[name] = flat.as_strided(shape, stride)
        return inputs

    def allocate_outputs(self, problem: ElementwiseProblem, inputs: Tensors) -> Tensors:
        plan = self.plan(problem)
        tensors = [inputs[n] for n in plan.tensor_names]
        shape = torch.broadcast_shapes(*(t.shape for t in tensors))
        return {name: torch.empty(shape, dtype=dtype, device=tensors[0].device)
                for name, dtype in zip(plan.expression.output_names, plan.output_dtypes)}

    def reference(self, problem: ElementwiseProblem, inputs: Tensors) -> Tensors:
        """Eager torch on the same expression in float64 (floating inputs upcast), rounded to the output dtypes."""
        plan = self.plan(problem)
        values = self._float64_values(plan, inputs)
        with default_dtype(torch.float64):
            results = evaluate(plan.expression, values)
        shape = torch.broadcast_shapes(*(inputs[n].shape for n in plan.tensor_names))
        return {name: results[name].expand(shape).to(dtype).contiguous()
                for name, dtype in zip(plan.expression.output_names, plan.output_dtypes)}

    @staticmethod
    def _float64_values(plan: Plan, inputs: Tensors) -> dict:
        values = {}
        for name in plan.expression.inputs:
            v = inputs[name]
            if plan.specs[name].kind == "scalar":
                values[name] = _scalar_value(v)
            else:
                values[name] = v.to(torch.float64) if v.is_floating_point() else v
        return values

    def tolerance(self, problem: ElementwiseProblem) -> Tolerance:
        """The loosest tolerance of the problem's outputs (check() applies each output's own)."""
        plan = self.plan(problem)
        return max((self._output_tolerance(plan, d) for d in plan.output_dtypes), key=lambda t: t.rtol)

    @staticmethod
    def _output_tolerance(plan: Plan, dtype: torch.dtype) -> Tolerance:
        if not dtype.is_floating_point:
            return Tolerance(0.0, 0.0)  # integers and comparisons are exact (see check() for near-ties)
        # Kernel: each arithmetic step rounds in the compute dtype, by up to _ULPS_PER_STEP units for the
        # approximate functions; the errors add along the chain (inputs are O(1), so the ops are well conditioned
        # and an absolute error of the same size covers results near zero). Then the kernel rounds to the output
        # dtype (half an ulp) and so does the reference (half an ulp): 2 units of roundoff.
        compute = torch.float64 if plan.compute_float == "fp64" else torch.float32
        chain = plan.error_ulps * _UNIT_ROUNDOFF[compute]
        rounding = 2.0 * _UNIT_ROUNDOFF[dtype]
        return Tolerance(atol=rounding + chain, rtol=rounding + chain)

    def check(self, problem: ElementwiseProblem, inputs: Tensors, outputs: Tensors, expected: Tensors) -> CheckResult:
        from autotile.families.checks import compare

        plan = self.plan(problem)
        ambiguous = self._near_ties(plan, inputs)
        worst = 0.0
        for name, dtype in zip(plan.expression.output_names, plan.output_dtypes):
            want = expected[name]
            if ambiguous is not None:
                want = torch.where(ambiguous.to(want.device), outputs[name].to(want.dtype), want)
            result = compare(name, outputs[name], want, self._output_tolerance(plan, dtype))
            if not result.ok:
                return result
            worst = max(worst, result.max_abs_error)
        return CheckResult(True, "ok", worst)

    def _near_ties(self, plan: Plan, inputs: Tensors) -> torch.Tensor | None:
        """Elements where a floating comparison's operands lie within the kernel's rounding of each other.

        There the kernel (in fp32) and the float64 reference may legitimately decide differently, and
        everything downstream differs; those elements take the kernel's values in every output.
        """
        comparisons = {n.text for n in plan.float_comparisons}
        if not comparisons:
            return None
        compute = torch.float64 if plan.compute_float == "fp64" else torch.float32
        chain = plan.error_ulps * _UNIT_ROUNDOFF[compute]
        shape = torch.broadcast_shapes(*(inputs[n].shape for n in plan.tensor_names))
        device = inputs[plan.tensor_names[0]].device
        ties = torch.zeros(shape, dtype=torch.bool, device=device)

        def note(node: Node, args: list):
            nonlocal ties
            if node.text not in comparisons:
                return
            a, b = (torch.as_tensor(x, dtype=torch.float64, device=device) for x in args)
            close = (a - b).abs() <= chain * (1.0 + torch.maximum(a.abs(), b.abs()))
            ties = ties | close.expand(shape)

        with default_dtype(torch.float64):
            evaluate_nodes(plan.expression, self._float64_values(plan, inputs), note)
        return ties

    def cost(self, problem: ElementwiseProblem) -> Cost:
        plan = self.plan(problem)
        read = 0
        strides = iter(problem.strides.split(";")) if problem.layout == "strided" else None
        sizes = [int(s) for s in problem.shape.split("x")] if strides else None
        for name in plan.tensor_names:
            itemsize = DTYPES_BY_NAME[plan.specs[name].dtype].itemsize
            if name in plan.one_element:
                read += itemsize
            elif strides is None:
                read += problem.numel * itemsize
            else:  # a broadcast input is read once: only its non-broadcast dims count
                st = [int(v) for v in next(strides).split(",")]
                read += math.prod(s for s, t in zip(sizes, st) if t != 0) * itemsize
        written = sum(problem.numel * d.itemsize for d in plan.output_dtypes)
        return Cost(flops=float(problem.numel * plan.arithmetic_steps), bytes=float(read + written))

    def baseline(self, problem: ElementwiseProblem, inputs: Tensors) -> Baseline | None:
        """torch.compile of the same expression (eager torch under the interpreter, or where compiling fails)."""
        plan = self.plan(problem)
        values = {n: _scalar_value(inputs[n]) if plan.specs[n].kind == "scalar" else inputs[n]
                  for n in plan.expression.inputs}
        expression = plan.expression

        def eager():
            return evaluate(expression, values)

        if inputs[plan.tensor_names[0]].device.type == "cpu":
            return Baseline("eager torch", eager)
        compiled_fn = torch.compile(lambda **kw: evaluate(expression, kw), dynamic=False)

        def compiled():
            return compiled_fn(**values)

        try:
            compiled()
        except Exception:  # noqa: BLE001 - inductor cannot take every expression; eager torch still can
            return Baseline("eager torch", eager)
        return Baseline("torch.compile", compiled)

    # --- running --------------------------------------------------------------------
    def render_switches(self, problem: ElementwiseProblem, config: Config) -> dict:
        plan = self.plan(problem)
        index_64 = problem.numel + _INT32_SLACK >= 2**31
        if problem.layout == "strided":
            sizes = [int(s) for s in problem.shape.split("x")]
            for st in problem.strides.split(";"):
                index_64 |= sum((s - 1) * int(v) for s, v in zip(sizes, st.split(","))) + _INT32_SLACK >= 2**31
        return self._switches(plan, problem.layout == "strided", problem.rank, index_64, config, interpreted=False)

    @staticmethod
    def _switches(plan: Plan, strided: bool, rank: int, index_64: bool, config: Mapping, interpreted: bool) -> dict:
        return dict(
            INTERPRETED=interpreted,
            OUTPUT_BF16=[d == torch.bfloat16 and plan.type_of_output(i) == "fp32" for i, d in enumerate(plan.output_dtypes)],
            N_TENSORS=len(plan.tensor_names), N_SCALARS=len(plan.scalar_names),
            TENSOR_ONE=[n in plan.one_element for n in plan.tensor_names],
            STEPS=[dict(s) for s in plan.steps], OUTPUTS=list(plan.output_values),
            STRIDED=strided, RANK=rank if strided else 1, INDEX_64=index_64,
            PERSISTENT=config["PERSISTENT"], STREAMING=config["STREAMING"],
        )

    def launch_plan(self, problem: ElementwiseProblem, config: Config, inputs: Mapping[str, object]) -> LaunchPlan:
        """Compile (or fetch) the kernel and lay out its geometry arguments for these inputs' shapes and strides."""
        plan = self.plan(problem)
        tensors = {n: inputs[n] for n in plan.tensor_names}
        device = next(iter(tensors.values())).device
        geometry = geometry_of(tensors, plan.one_element)
        strided = geometry.layout == "strided"
        index_64 = geometry.max_offset + _INT32_SLACK >= 2**31
        interpret = device.type == "cpu"
        switches = self._switches(plan, strided, len(geometry.sizes), index_64, config, interpreted=interpret)
        module = load_kernel_module(self.template, interpret=interpret, **switches)
        blocks = triton_cdiv(geometry.numel, config["BLOCK_SIZE"])
        if config["PERSISTENT"]:
            sms = _INTERPRET_SMS if interpret else current_device(device).sm_count
            blocks = min(blocks, sms * config["PROGRAMS_PER_SM"])
        geometry_args: tuple[int, ...] = (geometry.numel,)
        if strided:
            geometry_args += geometry.sizes + tuple(v for st in geometry.strides for v in st)
        return LaunchPlan(module.elementwise_kernel, (max(blocks, 1),), geometry_args,
                          {"BLOCK_SIZE": config["BLOCK_SIZE"], "EVEN": geometry.numel % config["BLOCK_SIZE"] == 0,
                           "num_warps": config["num_warps"], "num_stages": config["num_stages"]},
                          tuple(s["bits"] for s in plan.steps if s["op"] == "scalar"), interpret)

    def run(self, plan: Plan, launch: LaunchPlan, inputs: Mapping[str, object], outputs: Sequence[torch.Tensor]) -> None:
        """Launch with `inputs` (tensors, and Python numbers or 0-d CPU tensors for scalars) into contiguous `outputs`."""
        if launch.geometry_args[0] == 0:
            return
        args = [inputs[n] for n in plan.tensor_names]
        if plan.scalar_names:
            bits_of = dict(zip((s["index"] for s in plan.steps if s["op"] == "scalar"), launch.scalar_bits))
            for i, name in enumerate(plan.scalar_names):
                value = _scalar_value(inputs[name])
                check_scalar_fits(name, value)
                # NOTE: Triton's interpreter cannot take a bool argument as int1; bools go as 0/1 (the kernel compares != 0).
                args.append(_fp64_bits(value) if bits_of.get(i) else int(value) if isinstance(value, bool) else value)
        args += outputs
        args += launch.geometry_args
        if launch.interpret:
            import numpy

            # NOTE: the interpreter computes with numpy, which warns where a lane divides by zero or overflows: lanes
            # past the end (masked, loaded as 0) and values whose inf or NaN is the right answer. torch warns on
            # neither.
            with launching(True), numpy.errstate(all="ignore"):
                launch_kernel(launch.kernel, launch.grid, *args, **launch.meta)
        else:  # a compiled kernel: no context, no environment writes, no lock (this is every call of a fused op)
            launch_kernel(launch.kernel, launch.grid, *args, **launch.meta)

    def launch(self, problem: ElementwiseProblem, config: Config, inputs: Tensors, outputs: Tensors) -> None:
        plan = self.plan(problem)
        launch = self.launch_plan(problem, config, inputs)
        self.run(plan, launch, inputs, [outputs[n] for n in plan.expression.output_names])


def _values(option) -> list:
    """A CLI option's values: one value, several, or comma-separated text."""
    if option is None:
        return []
    items = [option] if isinstance(option, (str, int)) else list(option)
    return [part.strip() if isinstance(part, str) else part
            for item in items for part in (item.split(",") if isinstance(item, str) else [item]) if part != ""]


def _random(numel: int, dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> torch.Tensor:
    """Random values of `dtype`: N(0, 1) floats, small signed integers, fair bools; never all zeros."""
    if dtype.is_floating_point:
        return torch.randn(numel, generator=gen, device=device, dtype=torch.float32).to(dtype)
    if dtype == torch.bool:
        return torch.rand(numel, generator=gen, device=device) < 0.5
    low = 0 if dtype == torch.uint8 else -20
    return torch.randint(low, 21, (numel,), generator=gen, device=device, dtype=dtype)


def triton_cdiv(x: int, y: int) -> int:
    return (x + y - 1) // y


FAMILY = ElementwiseFamily()
