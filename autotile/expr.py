"""Elementwise expressions: parsed with `ast` into a whitelisted op tree, typed like eager torch.

Users write Python-like text; nothing of it is ever executed or pasted into a
kernel. `parse` accepts numbers, input names, + - * / **, unary minus, one
comparison at a time and calls of the functions in `FUNCTIONS`; anything else
(attribute access, other calls, subscripts, lambdas, imports...) is refused
with a message that lists what is allowed.

>>> e = parse("sin(x)**2 + cos(x)**2")
>>> e.canonical
'add(pow(cos(x),2),pow(sin(x),2))'
>>> e.inputs
('x',)

Several outputs are written as assignments; names that start with an
underscore are temporaries, every other assigned name is an output:

>>> parse("_t = x * y; a = _t + z; b = relu(_t)").output_names
('a', 'b')

Nodes are hash-consed (equal subtrees are one node), arguments of commutative
ops are sorted, and constant arithmetic is folded with Python's rules, so
equivalent spellings share one canonical string, the one problem keys use.

Typing (`infer_types`) runs the same op tree through eager torch on one-element
samples, so output dtypes, promotion of mixed dtypes and Python scalars, and
the errors for unsupported dtypes are exactly torch's.
"""
from __future__ import annotations

import ast
import contextlib
import functools
import math
import operator
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
import torch
import torch.nn.functional as F

from autotile.errors import BadInputError, UnsupportedDtypeError

# Longest expression text and largest op tree accepted: kernels with more steps
# than this stop being memory-bound long before, and the limit keeps the
# canonical string (which repeats shared subtrees) short.
MAX_TEXT_CHARS = 4000
MAX_NODES = 256
# Deepest nesting accepted (ops, unary signs, calls): a tree of MAX_NODES nodes is at most this deep, and
# the parser recurses once per level, well inside Python's recursion limit.
MAX_DEPTH = MAX_NODES
# Integer constants must fit the int64 scalars kernels take; a larger literal or folded result is refused
# (before it is computed: 9**9**9 would take Python hours).
INT_LIMIT = 2**63


class ExpressionError(BadInputError):
    """An expression outside the whitelisted grammar, or one that cannot be typed."""


@dataclass(frozen=True)
class OpSpec:
    name: str
    arity: int
    eager: Callable  # torch on tensors (Python scalars allowed where torch allows them)
    commutative: bool = False
    comparison: bool = False


def _gelu_tanh(x):
    return F.gelu(x, approximate="tanh")


OPS: dict[str, OpSpec] = {s.name: s for s in (
    OpSpec("add", 2, operator.add, commutative=True),
    OpSpec("sub", 2, operator.sub),
    OpSpec("mul", 2, operator.mul, commutative=True),
    OpSpec("div", 2, operator.truediv),
    OpSpec("pow", 2, operator.pow),
    OpSpec("neg", 1, operator.neg),
    OpSpec("abs", 1, torch.abs),
    OpSpec("exp", 1, torch.exp),
    OpSpec("log", 1, torch.log),
    OpSpec("sqrt", 1, torch.sqrt),
    OpSpec("rsqrt", 1, torch.rsqrt),
    OpSpec("sin", 1, torch.sin),
    OpSpec("cos", 1, torch.cos),
    OpSpec("tanh", 1, torch.tanh),
    OpSpec("sigmoid", 1, torch.sigmoid),
    OpSpec("relu", 1, torch.relu),
    OpSpec("gelu", 1, F.gelu),
    OpSpec("gelu_tanh", 1, _gelu_tanh),
    OpSpec("silu", 1, F.silu),
    OpSpec("where", 3, torch.where),
    OpSpec("maximum", 2, torch.maximum, commutative=True),
    OpSpec("minimum", 2, torch.minimum, commutative=True),
    OpSpec("lt", 2, operator.lt, comparison=True),
    OpSpec("le", 2, operator.le, comparison=True),
    OpSpec("gt", 2, operator.gt, comparison=True),
    OpSpec("ge", 2, operator.ge, comparison=True),
    OpSpec("eq", 2, operator.eq, commutative=True, comparison=True),
    OpSpec("ne", 2, operator.ne, commutative=True, comparison=True),
)}

# Function names users may call: every op by its own name, plus familiar aliases.
FUNCTIONS: dict[str, str] = {name: name for name in OPS} | {"max": "maximum", "min": "minimum"}

_BINOPS = {ast.Add: "add", ast.Sub: "sub", ast.Mult: "mul", ast.Div: "div", ast.Pow: "pow"}
_COMPARES = {ast.Lt: "lt", ast.LtE: "le", ast.Gt: "gt", ast.GtE: "ge", ast.Eq: "eq", ast.NotEq: "ne"}
_FOLDABLE = {"add": operator.add, "sub": operator.sub, "mul": operator.mul, "div": operator.truediv,
             "pow": operator.pow, "neg": operator.neg}

Number = int | float | bool


@dataclass(frozen=True)
class Node:
    """One node of the op tree: an input name, a constant, or an op over argument nodes."""

    kind: str  # 'input' | 'const' | 'op'
    name: str = ""  # input name, or op name
    value: Number = 0  # constants only
    args: tuple[Node, ...] = ()
    text: str = field(default="", compare=False)  # canonical text, computed once

    def __post_init__(self):
        object.__setattr__(self, "text", _node_text(self))

    def __hash__(self) -> int:
        return hash(self.text)

    def __eq__(self, other) -> bool:
        return isinstance(other, Node) and self.text == other.text


def _const_text(value: Number) -> str:
    return repr(value)  # repr keeps 2 vs 2.0 apart: they promote differently


def _node_text(node: Node) -> str:
    if node.kind == "input":
        return node.name
    if node.kind == "const":
        return _const_text(node.value)
    return f"{node.name}({','.join(a.text for a in node.args)})"


@dataclass(frozen=True)
class Expression:
    """A parsed expression: named outputs over input names, with a canonical text form."""

    outputs: tuple[tuple[str, Node], ...]
    inputs: tuple[str, ...]  # sorted
    bare: bool = True  # written as one expression (its output is named 'out'), not as assignments

    @property
    def output_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.outputs)

    @property
    def canonical(self) -> str:
        if self.bare:
            return self.outputs[0][1].text
        return ";".join(f"{name}={node.text}" for name, node in self.outputs)

    def output_inputs(self) -> tuple[tuple[str, ...], ...]:
        """The input names each output depends on (sorted), in output order.

        >>> parse("a = x * y; b = x + 1").output_inputs()
        (('x', 'y'), ('x',))
        """
        below: dict[str, frozenset[str]] = {}
        for node in self.nodes():  # arguments come before their users
            own = frozenset([node.name]) if node.kind == "input" else frozenset()
            below[node.text] = own.union(*(below[a.text] for a in node.args))
        return tuple(tuple(sorted(below[root.text])) for _, root in self.outputs)

    def nodes(self) -> list[Node]:
        """Every distinct node once, arguments before their users (a stable topological order)."""
        seen: dict[str, Node] = {}

        def visit(node: Node):
            if node.text in seen:
                return
            for arg in node.args:
                visit(arg)
            seen[node.text] = node

        for _, root in self.outputs:
            visit(root)
        return list(seen.values())


# --- parsing ---------------------------------------------------------------------

_ALLOWED_HELP = ("allowed: numbers, input names, + - * / **, unary -, one comparison (< <= > >= == !=) at a time, "
                 "and the functions " + ", ".join(sorted(FUNCTIONS)))


def _fail(node: ast.AST | None, message: str) -> ExpressionError:
    where = f" (column {node.col_offset + 1})" if node is not None and hasattr(node, "col_offset") else ""
    return ExpressionError(f"{message}{where}; {_ALLOWED_HELP}")


def _is_name(text: str) -> bool:
    return text.isascii() and text.isidentifier() and not text.startswith("__")


class _Builder:
    def __init__(self):
        self.count = 0
        self.bound: dict[str, Node] = {}  # names assigned earlier in the text
        self.free: set[str] = set()  # input names

    def make(self, node: Node) -> Node:
        self.count += 1
        if self.count > MAX_NODES:
            raise ExpressionError(f"expression has more than {MAX_NODES} nodes; split it into several fused calls")
        return node

    def op(self, name: str, args: list[Node], where: ast.AST) -> Node:
        spec = OPS[name]
        if len(args) != spec.arity:
            raise _fail(where, f"{name}() takes {spec.arity} argument(s), got {len(args)}")
        if all(a.kind == "const" for a in args) and name in _FOLDABLE:
            return self.make(Node("const", value=_fold(name, [a.value for a in args], where)))
        if spec.commutative:
            args = sorted(args, key=lambda a: a.text)
        return self.make(Node("op", name=name, args=tuple(args)))

    def expr(self, node: ast.AST) -> Node:
        if isinstance(node, ast.Constant):
            value = node.value
            if type(value) not in (int, float, bool):
                raise _fail(node, f"constant {value!r} is not a number")
            return self.const(value, node)
        if isinstance(node, ast.Name):
            if node.id in self.bound:
                return self.bound[node.id]
            if node.id in FUNCTIONS:
                raise _fail(node, f"{node.id!r} is a function; call it, e.g. {node.id}(x)")
            if not _is_name(node.id):
                raise _fail(node, f"input name {node.id!r} must be an ASCII identifier not starting with '__'")
            self.free.add(node.id)
            return self.make(Node("input", name=node.id))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            return self.op(_BINOPS[type(node.op)], [self.expr(node.left), self.expr(node.right)], node)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            inner = self.expr(node.operand)
            return inner if isinstance(node.op, ast.UAdd) else self.op("neg", [inner], node)
        if isinstance(node, ast.Compare):
            if len(node.ops) != 1 or type(node.ops[0]) not in _COMPARES:
                raise _fail(node, "chained comparisons (a < b < c) and 'in'/'is' are not allowed; compare two values at a time")
            return self.op(_COMPARES[type(node.ops[0])], [self.expr(node.left), self.expr(node.comparators[0])], node)
        if isinstance(node, ast.Call):
            if isinstance(node.func, ast.Attribute):
                raise _fail(node, f"attribute access ({ast.unparse(node.func)}) is not allowed; call the function by its bare name")
            if not isinstance(node.func, ast.Name) or node.func.id not in FUNCTIONS:
                name = node.func.id if isinstance(node.func, ast.Name) else ast.unparse(node.func)
                raise _fail(node, f"unknown function {name!r}")
            if node.keywords or any(isinstance(a, ast.Starred) for a in node.args):
                raise _fail(node, f"{node.func.id}() takes positional arguments only"
                            + ("; for the tanh approximation of gelu call gelu_tanh(x)" if node.func.id == "gelu" else ""))
            return self.op(FUNCTIONS[node.func.id], [self.expr(a) for a in node.args], node)
        if isinstance(node, ast.Attribute):
            raise _fail(node, f"attribute access ({ast.unparse(node)}) is not allowed")
        raise _fail(node, f"{type(node).__name__} ({ast.unparse(node)}) is not allowed in a fused expression")

    def const(self, value: Number, where: ast.AST) -> Node:
        if isinstance(value, float) and not math.isfinite(value):
            raise _fail(where, f"constant {value!r} is not finite; pass inf or nan as a scalar input instead")
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= INT_LIMIT:
            raise _fail(where, f"integer constant of {len(str(abs(value)))} digits does not fit 64 bits; "
                               "write it as a float (e.g. 1e30) or pass it as a scalar input")
        return self.make(Node("const", value=value))


def _fold(name: str, values: list[Number], where: ast.AST) -> Number:
    """Constant arithmetic with Python's rules, as Python evaluates it before torch sees a scalar."""
    if name == "pow" and _int_pow_too_large(*values):
        raise _fail(where, f"constant arithmetic {values[0]!r}**{values[1]!r} overflows 64-bit integers")
    try:
        result = _FOLDABLE[name](*values)
    except (ZeroDivisionError, OverflowError) as exc:
        raise _fail(where, f"constant arithmetic fails: {exc}") from None
    if type(result) not in (int, float, bool) or (isinstance(result, float) and not math.isfinite(result)):
        raise _fail(where, f"constant arithmetic gives {result!r}, which is not a finite real number")
    if isinstance(result, int) and not isinstance(result, bool) and abs(result) >= 2**63:
        raise _fail(where, "constant arithmetic overflows 64-bit integers")
    return result


def _int_pow_too_large(base: Number, exponent: Number) -> bool:
    """Whether integer `base ** exponent` has more than 64 bits, decided without computing it.

    >>> _int_pow_too_large(9, 387420489), _int_pow_too_large(2, 62), _int_pow_too_large(-1, 10**18)
    (True, False, False)
    """
    if not (isinstance(base, int) and isinstance(exponent, int)) or exponent < 0 or abs(base) < 2:
        return False  # floats overflow to an error at once; negative exponents give floats; 0, 1, -1 stay small
    return (abs(base).bit_length() - 1) * exponent >= 64


def _depth(tree: ast.AST, limit: int) -> int:
    """The nesting depth of a syntax tree, measured without recursion (counting stops past `limit`)."""
    deepest, stack = 0, [(tree, 1)]
    while stack:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        if depth > limit:
            break
        stack.extend((child, depth + 1) for child in ast.iter_child_nodes(node)
                     if not isinstance(child, (ast.expr_context, ast.operator, ast.unaryop, ast.cmpop)))
    return deepest


def parse(text: str) -> Expression:
    """Parse `text` into an `Expression`; raises ExpressionError naming what is not allowed.

    >>> parse("a = x*y; b = a + z").canonical
    'a=mul(x,y);b=add(mul(x,y),z)'
    """
    if not isinstance(text, str):
        raise ExpressionError(f"an expression is a string, got {type(text).__name__}")
    if len(text) > MAX_TEXT_CHARS:
        raise ExpressionError(f"expression is longer than {MAX_TEXT_CHARS} characters")
    try:
        module = ast.parse(text.strip(), mode="exec")
    except SyntaxError as exc:
        raise ExpressionError(f"expression is not valid Python syntax: {exc.msg} (column {exc.offset})") from None
    except (RecursionError, MemoryError):  # Python's own parser gives up on very deep nesting
        raise ExpressionError(f"expression is nested too deeply (more than {MAX_DEPTH} levels)") from None
    if _depth(module, MAX_DEPTH + 2) > MAX_DEPTH + 2:  # + the module and statement levels
        raise ExpressionError(f"expression is nested more than {MAX_DEPTH} levels deep (ops, signs and calls "
                              "inside one another); split it into temporaries, e.g. '_t = ...; out = f(_t)'")
    body = module.body
    if not body:
        raise ExpressionError("expression is empty")
    builder = _Builder()
    outputs: list[tuple[str, Node]] = []
    if len(body) == 1 and isinstance(body[0], ast.Expr):
        outputs.append(("out", builder.expr(body[0].value)))
    else:
        for statement in body:
            if not (isinstance(statement, ast.Assign) and len(statement.targets) == 1
                    and isinstance(statement.targets[0], ast.Name)):
                raise _fail(statement, "write either one expression or several 'name = expression' statements; "
                                       f"{ast.unparse(statement)!r} is neither")
            target = statement.targets[0].id
            if not _is_name(target) or target in FUNCTIONS:
                raise _fail(statement, f"{target!r} cannot be assigned: use an ASCII identifier that is not a function name")
            if target in builder.bound or target in builder.free:
                raise _fail(statement, f"{target!r} is already used; every name is assigned at most once, before its use")
            node = builder.expr(statement.value)
            if target in builder.free:
                raise _fail(statement, f"{target!r} is an input of this expression and cannot also be assigned")
            builder.bound[target] = node
            if not target.startswith("_"):
                outputs.append((target, node))
        if not outputs:
            raise ExpressionError("no outputs: names starting with '_' are temporaries; assign at least one other name")
    bare = len(body) == 1 and isinstance(body[0], ast.Expr)
    expression = Expression(tuple(outputs), tuple(sorted(builder.free)), bare)
    if not expression.inputs:
        raise ExpressionError("expression has no inputs; it needs at least one tensor input name")
    return expression


# --- values, types and eager evaluation -------------------------------------------

# Tensor dtypes fused kernels take, by the short names problem keys use.
DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64",
    torch.int8: "i8", torch.uint8: "u8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64",
    torch.bool: "bool",
}
DTYPES_BY_NAME: dict[str, torch.dtype] = {v: k for k, v in DTYPE_NAMES.items()}
# Python scalars: the dtype torch gives them when they meet only other scalars.
SCALAR_KINDS: dict[type, str] = {bool: "bool", int: "int", float: "float"}
_SCALAR_DTYPES = {"bool": torch.bool, "int": torch.int64, "float": torch.float64}

INPUT_KINDS = ("tensor", "zero_dim", "scalar")  # a dimensioned tensor, a 0-d tensor, a Python number
_SYMBOLIC_KINDS = {torch.SymBool: "bool", torch.SymInt: "int", torch.SymFloat: "float"}


@dataclass(frozen=True)
class InputSpec:
    """What typing needs to know of one input: its dtype and whether it is a 0-d tensor or a Python number."""

    name: str
    dtype: str  # a DTYPE_NAMES value; for Python scalars 'bool' | 'int' | 'float'
    kind: str = "tensor"

    def __post_init__(self):
        known = SCALAR_KINDS.values() if self.kind == "scalar" else DTYPE_NAMES.values()
        if self.kind not in INPUT_KINDS or self.dtype not in known:
            raise UnsupportedDtypeError(
                f"input {self.name!r}: {self.kind} of dtype {self.dtype!r} is not supported; "
                f"tensors may be {', '.join(DTYPE_NAMES.values())}; scalars bool, int or float")

    @property
    def text(self) -> str:
        return f"{self.name}:{self.dtype}:{self.kind}"

    @classmethod
    def from_text(cls, text: str) -> InputSpec:
        name, dtype, kind = text.split(":")
        return cls(name, dtype, kind)

    @classmethod
    def of(cls, name: str, value) -> InputSpec:
        if isinstance(value, torch.Tensor):
            if value.dtype not in DTYPE_NAMES:
                raise UnsupportedDtypeError(
                    f"input {name!r} is {value.dtype}; fused kernels take {', '.join(str(d) for d in DTYPE_NAMES)}: "
                    "cast it first")
            return cls(name, DTYPE_NAMES[value.dtype], "zero_dim" if value.dim() == 0 else "tensor")
        if type(value) in SCALAR_KINDS:
            return cls(name, SCALAR_KINDS[type(value)], "scalar")
        if type(value) in _SYMBOLIC_KINDS:  # a number torch.compile traces as a symbol: typed as the number
            return cls(name, _SYMBOLIC_KINDS[type(value)], "scalar")
        raise BadInputError(f"input {name!r} is a {type(value).__name__}; pass a torch.Tensor (torch.from_numpy for an "
                            f"array) or a Python int, float or bool")

    def sample(self) -> torch.Tensor | Number:
        """A one-element stand-in with the same promotion behaviour (value 1: valid for every op)."""
        if self.kind == "scalar":
            return {"bool": True, "int": 1, "float": 1.0}[self.dtype]
        return torch.ones((1,) if self.kind == "tensor" else (), dtype=DTYPES_BY_NAME[self.dtype])


@dataclass(frozen=True)
class ValueType:
    """The dtype of a node's value. Weak values are Python scalars (no tensor below them): they
    promote like scalars, and their dtype is the precision Python computes them in."""

    dtype: torch.dtype
    weak: bool = False

    @property
    def is_float(self) -> bool:
        return self.dtype.is_floating_point

    @property
    def is_bool(self) -> bool:
        return self.dtype == torch.bool


def value_type(value) -> ValueType:
    if isinstance(value, torch.Tensor):
        return ValueType(value.dtype)
    return ValueType(_SCALAR_DTYPES[SCALAR_KINDS[type(value)]], weak=True)


def _scalar_tensor(value: Number, like: torch.Tensor | None = None) -> torch.Tensor:
    # torch.tensor(python scalar) takes the default dtype for floats, int64 for ints: the dtypes
    # Python scalars promote as, so a wrapped scalar behaves as the scalar would.
    return torch.tensor(value, device=like.device if like is not None else None)


def apply_op(name: str, args: list) -> torch.Tensor | Number:
    """One op on tensors and Python scalars, as eager torch (and Python, for scalars alone) computes it."""
    spec = OPS[name]
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if not tensors:
        # Python computes scalar-only subexpressions itself, in double precision.
        if name == "div":
            args = [float(a) for a in args]
        wrapped = [torch.tensor(a, dtype=_SCALAR_DTYPES[SCALAR_KINDS[type(a)]]) for a in args]
        result = spec.eager(*wrapped)
        return result.item()
    if name in ("maximum", "minimum", "where"):
        args = [a if isinstance(a, torch.Tensor) else _scalar_tensor(a, tensors[0]) for a in args]
    return spec.eager(*args)


def operand_type(name: str, args: list) -> ValueType:
    """The dtype a comparison compares its two operands in (torch.result_type of them)."""
    if any(isinstance(a, torch.Tensor) for a in args):
        return ValueType(torch.result_type(*args))
    kinds = {SCALAR_KINDS[type(a)] for a in args}
    kind = "float" if "float" in kinds else "int" if "int" in kinds else "bool"
    return ValueType(_SCALAR_DTYPES[kind], weak=True)


def evaluate_nodes(expression: Expression, values: Mapping[str, object],
                   on_comparison: Callable[[Node, list], None] | None = None) -> dict[str, object]:
    """Every node's value (keyed by canonical text), computed with eager torch."""
    computed: dict[str, object] = {}
    for node in expression.nodes():
        if node.kind == "input":
            computed[node.text] = values[node.name]
        elif node.kind == "const":
            computed[node.text] = node.value
        else:
            args = [computed[a.text] for a in node.args]
            if on_comparison is not None and OPS[node.name].comparison:
                on_comparison(node, args)
            computed[node.text] = apply_op(node.name, args)
    return computed


def evaluate(expression: Expression, values: Mapping[str, object]) -> dict[str, object]:
    """The outputs of `expression` computed with eager torch, by output name.

    >>> evaluate(parse("x * 2 + 1"), {"x": torch.tensor([1.0, 2.0])})["out"]
    tensor([3., 5.])
    """
    computed = evaluate_nodes(expression, values)
    return {name: computed[node.text] for name, node in expression.outputs}


_DEFAULT_DTYPE_LOCK = threading.Lock()


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Temporarily change torch's default dtype (how Python floats and int/int promote).

    NOTE: torch's default dtype is process-global; references switch it to float64
    so that scalars and integer division are computed in float64 too.
    """
    with _DEFAULT_DTYPE_LOCK:
        before = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            yield
        finally:
            torch.set_default_dtype(before)


@dataclass(frozen=True)
class Typing:
    """Dtypes of every node (by canonical text), the comparison operand dtypes, and the outputs' dtypes."""

    types: Mapping[str, ValueType]
    operands: Mapping[str, ValueType]
    outputs: Mapping[str, torch.dtype]

    def of(self, node: Node) -> ValueType:
        return self.types[node.text]


def infer_types(expression: Expression, specs: Mapping[str, InputSpec],
                default: torch.dtype = torch.float32) -> Typing:
    """Type every node as eager torch would, by running the tree on one-element samples, under torch's default
    dtype `default` (how Python floats and integer division promote; problems are typed under float32).

    Raises UnsupportedDtypeError, quoting torch, where torch refuses an op for a dtype.

    >>> t = infer_types(parse("x * 1.7 > y"), {"x": InputSpec("x", "bf16"), "y": InputSpec("y", "i32")})
    >>> t.outputs["out"]
    torch.bool
    """
    return _infer_cached(expression, tuple(sorted((k, v) for k, v in specs.items())), default)


@functools.lru_cache(maxsize=256)
def _infer_cached(expression: Expression, specs: tuple[tuple[str, InputSpec], ...], default: torch.dtype) -> Typing:
    spec_of = dict(specs)
    missing = [n for n in expression.inputs if n not in spec_of]
    if missing:
        raise BadInputError(f"no value for input(s) {missing}")
    samples = {name: spec_of[name].sample() for name in expression.inputs}
    types: dict[str, ValueType] = {}
    operands: dict[str, ValueType] = {}

    def note_comparison(node: Node, args: list):
        operands[node.text] = operand_type(node.name, args)

    try:
        with default_dtype(default):
            computed = evaluate_nodes(expression, samples, note_comparison)
    except (RuntimeError, TypeError) as exc:
        dtypes = ", ".join(f"{s.name}: {s.dtype}" for _, s in specs)
        raise UnsupportedDtypeError(f"torch does not compute this expression for ({dtypes}): {exc}") from None
    for text, value in computed.items():
        types[text] = value_type(value)
    outputs = {name: types[node.text].dtype for name, node in expression.outputs}
    return Typing(types, operands, outputs)
