"""Fused elementwise kernels under Triton's interpreter, against torch in float64."""
import math
import warnings

import pytest
import torch
import torch.nn.functional as F

import autotile
from autotile.device import interpret_device
from autotile.errors import BadInputError, ShapeMismatchError, UnsupportedDtypeError
from autotile.expr import ExpressionError, parse
from autotile.families.checks import compare
from autotile.families.elementwise import FAMILY, ElementwiseProblem, geometry_of, triton_cdiv
from autotile.space import Config

DEVICE = interpret_device()

# Special values every op must propagate as torch does, plus ordinary ones.
SPECIALS = [math.nan, math.inf, -math.inf, 0.0, -0.0, 1.0, -1.0, 0.5, -0.5, 2.0, -3.0, 20.0, -20.0, 100.0, -100.0, 1e-30]

# op -> (expression, independent float64 torch reference)
UNARY = {
    "neg": ("-x", lambda x: -x),
    "abs": ("abs(x)", torch.abs),
    "exp": ("exp(x)", torch.exp),
    "log": ("log(x)", torch.log),
    "sqrt": ("sqrt(x)", torch.sqrt),
    "rsqrt": ("rsqrt(x)", torch.rsqrt),
    "sin": ("sin(x)", torch.sin),
    "cos": ("cos(x)", torch.cos),
    "tanh": ("tanh(x)", torch.tanh),
    "sigmoid": ("sigmoid(x)", torch.sigmoid),
    "relu": ("relu(x)", torch.relu),
    "gelu": ("gelu(x)", F.gelu),
    "gelu_tanh": ("gelu_tanh(x)", lambda x: F.gelu(x, approximate="tanh")),
    "silu": ("silu(x)", F.silu),
    "square": ("x ** 2", lambda x: x * x),
    "cube": ("x ** 3", lambda x: x * x * x),
    "reciprocal": ("x ** -1", lambda x: 1 / x),
    "pow_half": ("x ** 0.5", torch.sqrt),
    "pow_real": ("x ** 2.5", lambda x: torch.pow(x, 2.5)),
    "pow_int_big": ("x ** 7", lambda x: torch.pow(x, 7)),
}
BINARY = {
    "add": ("x + y", torch.add),
    "sub": ("x - y", torch.sub),
    "mul": ("x * y", torch.mul),
    "div": ("x / y", torch.div),
    "pow": ("x ** y", torch.pow),
    "maximum": ("maximum(x, y)", torch.maximum),
    "minimum": ("minimum(x, y)", torch.minimum),
    "lt": ("x < y", torch.lt),
    "le": ("x <= y", torch.le),
    "gt": ("x > y", torch.gt),
    "ge": ("x >= y", torch.ge),
    "eq": ("x == y", torch.eq),
    "ne": ("x != y", torch.ne),
    "where": ("where(x > y, x, y * 2)", lambda x, y: torch.where(x > y, x, y * 2)),
}


@pytest.fixture(autouse=True)
def _quiet_numpy():
    # The interpreter runs on numpy, which warns on overflow and invalid values that the tests mean to produce.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def _assert_matches(expr: str, got: torch.Tensor, want: torch.Tensor, values: dict):
    """Compare with the family's tolerance for this call's problem; the message names the worst element."""
    problem = FAMILY.problem_from_values(parse(expr), values)
    tol = FAMILY.tolerance(problem) if got.is_floating_point() else FAMILY._output_tolerance(FAMILY.plan(problem), got.dtype)
    result = compare(expr, got, want.to(got.dtype), tol)
    assert result.ok, result.message


def _grid(n: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Every pair of special values: x varies along the columns, y along the rows."""
    v = torch.tensor(SPECIALS, dtype=torch.float32)
    return v.repeat(len(SPECIALS) * n), v.repeat_interleave(len(SPECIALS)).repeat(n)


@pytest.mark.parametrize("op", sorted(UNARY))
def test_unary_ops_including_nan_and_inf(op):
    expr, ref = UNARY[op]
    x = torch.cat([torch.tensor(SPECIALS), torch.randn(17) * 3])
    got = autotile.fuse(expr)(x=x)
    assert got.dtype == torch.float32 and got.shape == x.shape
    _assert_matches(expr, got, ref(x.double()), {"x": x})


@pytest.mark.parametrize("op", sorted(BINARY))
def test_binary_ops_over_every_pair_of_special_values(op):
    expr, ref = BINARY[op]
    x, y = _grid()
    got = autotile.fuse(expr)(x=x, y=y)
    want = ref(x.double(), y.double())
    assert got.dtype == want.to(torch.float32 if want.is_floating_point() else want.dtype).dtype
    _assert_matches(expr, got, want, {"x": x, "y": y})


@pytest.mark.parametrize("numel", [1, 17, 2**16 + 3])  # one element, under a block, many blocks and a tail
def test_anchor_chain_at_awkward_sizes(numel):
    x = torch.randn(numel) * 4
    got = autotile.fuse("gelu_tanh(x*1.7+0.3) + sin(x)**2 + cos(x)**2")(x=x)
    xd = x.double()
    want = F.gelu(xd * 1.7 + 0.3, approximate="tanh") + torch.sin(xd) ** 2 + torch.cos(xd) ** 2
    _assert_matches("gelu_tanh(x*1.7+0.3) + sin(x)**2 + cos(x)**2", got, want, {"x": x})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_compute_in_fp32_and_round_once(dtype):
    x = (torch.randn(4099) * 2).to(dtype)
    expr = "silu(x) * x + exp(-x * x)"
    got = autotile.fuse(expr)(x=x)
    assert got.dtype == dtype
    xd = x.double()
    want = F.silu(xd) * xd + torch.exp(-xd * xd)
    _assert_matches(expr, got, want, {"x": x})
    # Rounding once beats eager torch, which rounds every intermediate to the half dtype (on average:
    # single elements may round either way).
    eager_err = ((F.silu(x) * x + torch.exp(-x * x)).double() - want).abs().mean()
    assert (got.double() - want).abs().mean() < eager_err


def test_broadcasting_row_column_and_zero_dim():
    x = torch.randn(33, 1)  # column
    y = torch.randn(1, 17)  # row
    s = torch.tensor(1.25, dtype=torch.float64)  # 0-d: promotes like a scalar
    expr = "x * y + s - where(x > y, x, y)"
    got = autotile.fuse(expr)(x=x, y=y, s=s)
    want = x.double() * y.double() + 1.25 - torch.where(x > y, x, y).double()
    assert got.shape == (33, 17) and got.dtype == torch.float32
    _assert_matches(expr, got, want, {"x": x, "y": y, "s": s})


def test_broadcast_over_leading_dims_and_one_element_tensors():
    x = torch.randn(3, 4, 5)
    b = torch.randn(5)
    one = torch.randn(1, 1, 1)
    expr = "relu(x + b) * one"
    got = autotile.fuse(expr)(x=x, b=b, one=one)
    _assert_matches(expr, got, torch.relu(x.double() + b.double()) * one.double(), {"x": x, "b": b, "one": one})
    problem = FAMILY.problem_from_values(parse(expr), {"x": x, "b": b, "one": one})
    assert problem.layout == "strided" and problem.one_element == "one"


@pytest.mark.parametrize("make", [
    lambda: torch.randn(40, 31).t(),  # transposed
    lambda: torch.randn(64, 50)[::3, 5:40],  # sliced rows and columns
    lambda: torch.randn(2, 9, 7).permute(2, 0, 1),  # permuted 3-D
    lambda: torch.randn(1000)[::7],  # strided 1-D
])
def test_non_contiguous_inputs(make):
    x = make()
    y = torch.randn(x.shape)
    expr = "x * sigmoid(y) + tanh(x)"
    got = autotile.fuse(expr)(x=x, y=y)
    assert got.is_contiguous() and got.shape == x.shape
    _assert_matches(expr, got, x.double() * torch.sigmoid(y.double()) + torch.tanh(x.double()), {"x": x, "y": y})


def test_mixed_dtypes_follow_torch_promotion():
    i = torch.randint(-9, 10, (257,), dtype=torch.int32)
    h = torch.randn(257).half()
    m = torch.rand(257) > 0.5
    expr = "where(m, i * h, i / 4) + i ** 2"
    got = autotile.fuse(expr)(i=i, h=h, m=m)
    eager = torch.where(m, i * h, i / 4) + i ** 2
    assert got.dtype == eager.dtype == torch.float32
    want = torch.where(m, i.double() * h.double(), i.double() / 4) + i.double() ** 2
    _assert_matches(expr, got, want, {"i": i, "h": h, "m": m})


def test_integer_and_bool_results_are_exact():
    x = torch.randint(-50, 50, (1000,), dtype=torch.int64)
    y = torch.randint(-50, 50, (1000,), dtype=torch.int64)
    a, b, c = autotile.fuse("a = x * y - abs(x) ** 3; b = maximum(x, y) >= 3; c = relu(x)")(x=x, y=y)
    assert a.dtype == torch.int64 and b.dtype == torch.bool and c.dtype == torch.int64
    assert torch.equal(a, x * y - x.abs() ** 3)
    assert torch.equal(b, torch.maximum(x, y) >= 3)
    assert torch.equal(c, torch.relu(x))


def test_scalars_of_every_kind():
    x = torch.randn(100, dtype=torch.float64)
    got = autotile.fuse("x * a + n - where(flag, x, 0.0) / 3")(x=x, a=0.1, n=7, flag=True)
    want = x * 0.1 + 7 - torch.where(torch.tensor(True), x, 0.0) / 3
    # fp64 math with the scalar passed bit-exactly: agrees with torch to a few ulps.
    torch.testing.assert_close(got, want, rtol=4 * 2.0**-53, atol=4 * 2.0**-53)
    assert autotile.fuse("x * a")(x=torch.ones(3, dtype=torch.bfloat16), a=3).dtype == torch.bfloat16


def test_several_outputs_share_intermediates():
    x, y, z = torch.randn(513), torch.randn(513), torch.randn(513)
    a, b = autotile.fuse("a = x * y; b = a + z")(x=x, y=y, z=z)
    torch.testing.assert_close(a, x * y, rtol=2**-23, atol=0)
    torch.testing.assert_close(b, (x.double() * y.double()).float().double().add(z.double()).float(), rtol=2**-23, atol=2**-23)


def test_every_config_kind_computes_the_same():
    x, y = torch.randn(5000), torch.randn(5000)
    problem = FAMILY.problem_from_values(parse("x * exp(-y * y)"), {"x": x, "y": y})
    space = FAMILY.space(problem, DEVICE)
    want = FAMILY.reference(problem, {"x": x, "y": y})
    picks = [dict(BLOCK_SIZE=512, num_warps=4, num_stages=1, PERSISTENT=False, PROGRAMS_PER_SM=1, STREAMING=False),
             dict(BLOCK_SIZE=1024, num_warps=8, num_stages=2, PERSISTENT=True, PROGRAMS_PER_SM=2, STREAMING=True),
             dict(BLOCK_SIZE=8192, num_warps=16, num_stages=3, PERSISTENT=True, PROGRAMS_PER_SM=1, STREAMING=False)]
    for pick in picks:
        config = space.validate(pick)
        outputs = FAMILY.allocate_outputs(problem, {"x": x, "y": y})
        outputs["out"].fill_(math.nan)
        FAMILY.launch(problem, config, {"x": x, "y": y}, outputs)
        result = FAMILY.check(problem, {"x": x, "y": y}, outputs, want)
        assert result.ok, (pick, result.message)


@pytest.mark.parametrize("expr, dtype, layout_numel", [
    ("sin(x)**2 + cos(x)**2", "bf16", 4096),
    ("x * sigmoid(y) + z", "fp16", 1000),
])
def test_tuning_pipeline_pieces_agree(expr, dtype, layout_numel):
    """make_inputs -> reference -> launch -> check, as one tuning trial runs them."""
    problem = FAMILY.problem_for_expression(expr, dtype, layout_numel)
    inputs = FAMILY.make_inputs(problem, DEVICE, seed=3)
    assert all(t.abs().sum() > 0 for t in inputs.values())
    outputs = FAMILY.allocate_outputs(problem, inputs)
    FAMILY.launch(problem, FAMILY.default_config(problem, DEVICE), inputs, outputs)
    assert FAMILY.check(problem, inputs, outputs, FAMILY.reference(problem, inputs)).ok


def test_strided_problem_round_trips_through_make_inputs():
    x, y = torch.randn(6, 1, 7), torch.randn(7, 5).t()
    problem = FAMILY.problem_from_values(parse("x + y"), {"x": x, "y": y})
    assert problem.layout == "strided"
    inputs = FAMILY.make_inputs(problem, DEVICE)
    assert geometry_of(inputs).strides == geometry_of({"x": x, "y": y}).strides
    outputs = FAMILY.allocate_outputs(problem, inputs)
    FAMILY.launch(problem, FAMILY.default_config(problem, DEVICE), inputs, outputs)
    assert FAMILY.check(problem, inputs, outputs, FAMILY.reference(problem, inputs)).ok


def test_check_fails_on_a_wrong_element_and_names_it():
    problem = FAMILY.problem_for_expression("x * 2", "fp32", 64)
    inputs = FAMILY.make_inputs(problem, DEVICE)
    expected = FAMILY.reference(problem, inputs)
    outputs = {"out": expected["out"].clone()}
    outputs["out"][37] *= 1 + 1e-5  # 80 ulps: far beyond one rounding
    result = FAMILY.check(problem, inputs, outputs, expected)
    assert not result.ok and "(37,)" in result.message


def test_near_ties_of_comparisons_accept_either_branch():
    # x * 3 == 0.3 exactly in float64 for x = 0.1 but not in fp32: the kernel may take either branch there.
    x = torch.tensor([0.1, 0.5, -1.0], dtype=torch.float32)
    problem = FAMILY.problem_from_values(parse("where(x * 3 > 0.3, 1.0, -1.0)"), {"x": x})
    expected = FAMILY.reference(problem, {"x": x})
    flipped = {"out": expected["out"].clone()}
    flipped["out"][0] = -expected["out"][0]
    assert FAMILY.check(problem, {"x": x}, flipped, expected).ok
    flipped["out"][1] = -expected["out"][1]  # not a near tie: must fail
    assert not FAMILY.check(problem, {"x": x}, flipped, expected).ok


def test_empty_tensors():
    out = autotile.fuse("x + 1")(x=torch.empty(0, 3))
    assert out.shape == (0, 3)


def test_torch_compile_traces_the_custom_op():
    f = autotile.fuse("a = x * y; b = relu(a) + s")
    compiled = torch.compile(lambda x, y: f(x=x, y=y, s=0.5), backend="aot_eager", fullgraph=True)
    x, y = torch.randn(9, 1), torch.randn(4)
    a, b = compiled(x, y)
    torch.testing.assert_close(a, x * y)
    torch.testing.assert_close(b, torch.relu(x * y) + 0.5)


def test_bad_input_says_what_to_do():
    t = torch.randn(8)
    with pytest.raises(BadInputError, match="missing input"):
        autotile.fuse("x + y")(x=t)
    with pytest.raises(BadInputError, match="unexpected input"):
        autotile.fuse("x")(x=t, y=t)
    with pytest.raises(BadInputError, match="by name"):
        autotile.fuse("x + 1")(t)
    with pytest.raises(ShapeMismatchError, match="do not broadcast"):
        autotile.fuse("x + y")(x=t, y=torch.randn(3))
    with pytest.raises(UnsupportedDtypeError, match="cast it first"):
        autotile.fuse("x + 1")(x=t.to(torch.complex64))
    with pytest.raises(BadInputError, match="at least one tensor"):
        autotile.fuse("x + 1")(x=2.0)
    with pytest.raises(ExpressionError, match="on bool values"):
        autotile.fuse("x * y")(x=t > 0, y=t > 1)
    with pytest.raises(BadInputError, match="no backward"):
        autotile.fuse("x * 2")(x=t.requires_grad_())
    with pytest.raises(ExpressionError, match="constant non-negative integer exponent"):
        autotile.fuse("x ** y")(x=torch.ones(2, dtype=torch.int32), y=torch.ones(2, dtype=torch.int32))


def test_explain_names_the_problem_and_its_source():
    info = autotile.explain("fuse", "sin(x) * y", x=torch.randn(4, 3), y=torch.randn(3))
    assert info["family"] == "elementwise"
    assert info["problem"]["layout"] == "strided" and info["problem"]["expr"] == "mul(sin(x),y)"
    assert info["source"] in ("user-db", "shipped-db", "default")


# --- the family's contract ---------------------------------------------------------------

def test_default_suite_and_cli_problems():
    suite = FAMILY.default_suite()
    assert {p.expr for p in suite} == {parse(e).canonical for e in
                                       ("sin(x)**2 + cos(x)**2", "gelu_tanh(x*1.7+0.3)", "silu(x)*x", "x * sigmoid(y) + z")}
    assert all(p.numel == 2**28 for p in suite)
    assert FAMILY.problems_from_cli() == suite
    problems = FAMILY.problems_from_cli(expr=["x*y"], numel=[1000, 2000], dtype=["bf16"])
    assert [(p.numel, p.inputs) for p in problems] == [(1000, "x:bf16:tensor,y:bf16:tensor"), (2000, "x:bf16:tensor,y:bf16:tensor")]
    assert {o.name for o in FAMILY.cli_options} >= {"expr", "numel", "dtype"}
    one = FAMILY.problems_from_cli(expr="maximum(x, y)", numel=64, dtype="fp32,bf16")
    assert [(p.expr, p.numel, p.inputs.split(":")[1]) for p in one] == [("maximum(x,y)", 64, "fp32"), ("maximum(x,y)", 64, "bf16")]


def test_problem_keys_round_trip_and_buckets():
    problem = FAMILY.problem_for_expression("silu(x)*x", "bf16", 3000)
    assert FAMILY.problem_from_dict(__import__("dataclasses").asdict(problem)) == problem
    near = FAMILY.problem_for_expression("silu(x)*x", "bf16", 4000)
    assert FAMILY.bucket(problem) == FAMILY.bucket(near)
    assert FAMILY.distance(problem, FAMILY.problem_for_expression("silu(x)*x", "fp32", 3000)) is None
    a = FAMILY.problem_from_values(parse("x + y"), {"x": torch.randn(8, 1), "y": torch.randn(5)})
    b = FAMILY.problem_from_values(parse("x + y"), {"x": torch.randn(16, 1), "y": torch.randn(7)})
    assert FAMILY.distance(a, b) is not None  # a strided winner serves other shapes of its class
    with pytest.raises(BadInputError, match="promotion gives"):
        FAMILY.plan(ElementwiseProblem(problem.expr, problem.inputs, "out:fp32", 3000))


def test_space_default_is_feasible_and_constraints_prune():
    for problem in FAMILY.default_suite() + [FAMILY.problem_for_expression("x > 0", "fp32", 1)]:
        space = FAMILY.space(problem, DEVICE)
        assert space.is_feasible(FAMILY.default_config(problem, DEVICE))
    space = FAMILY.space(FAMILY.default_suite()[1], DEVICE)
    assert not space.is_feasible(Config(BLOCK_SIZE=256, num_warps=8, num_stages=1, PERSISTENT=False,
                                        PROGRAMS_PER_SM=1, STREAMING=False))


def test_cost_counts_broadcast_inputs_once():
    a = FAMILY.problem_from_values(parse("x + y"), {"x": torch.randn(64, 1), "y": torch.randn(1, 32)})
    assert FAMILY.cost(a).bytes == (64 + 32 + 64 * 32) * 4
    b = FAMILY.problem_for_expression("sin(x)**2 + cos(x)**2", "bf16", 1000)
    assert FAMILY.cost(b).bytes == 1000 * 2 * 2


@pytest.mark.parametrize("numel", [4096, 4097, 1024 * 3])
@pytest.mark.parametrize("persistent", [False, True])
def test_whole_blocks_run_unmasked_and_ragged_ones_masked(numel, persistent):
    # numel a multiple of BLOCK_SIZE launches the EVEN (unpredicated) kernel; every element must still be written.
    x = torch.randn(numel)
    problem = FAMILY.problem_from_values(parse("x * 2 + 1"), {"x": x})
    config = FAMILY.space(problem, DEVICE).validate(dict(BLOCK_SIZE=1024, num_warps=4, num_stages=1,
                                                         PERSISTENT=persistent, PROGRAMS_PER_SM=1, STREAMING=False))
    outputs = FAMILY.allocate_outputs(problem, {"x": x})
    outputs["out"].fill_(math.nan)
    FAMILY.launch(problem, config, {"x": x}, outputs)
    assert FAMILY.launch_plan(problem, config, {"x": x}).meta["EVEN"] == (numel % 1024 == 0)
    torch.testing.assert_close(outputs["out"], x * 2 + 1, rtol=0, atol=0)


# --- sin and cos of one argument: one "sincos" step ----------------------------------------------

SINCOS_BOUND = 105615.0  # templates/elementwise.py.j2: a block holding a larger |x| takes tl.sin/tl.cos


def _ops(expr: str, dtype: str = "fp32") -> list[str]:
    return [s["op"] for s in FAMILY.plan(FAMILY.problem_for_expression(expr, dtype, 1000)).steps]


@pytest.mark.parametrize("expr, dtype", [
    ("sin(x)**2 + cos(x)**2", "fp32"),
    ("a = sin(x); b = cos(x)*y", "fp32"),  # several outputs
    ("sin(x)**2 + cos(x)**2", "bf16"),
    ("sin(x)**2 + cos(x)**2", "fp16"),
    ("sin(2*x) * cos(x*2)", "fp32"),  # one argument, spelled two ways
    ("sin(i) - cos(i)", "i32"),  # computed in fp32 from one cast
])
def test_sin_and_cos_of_one_argument_are_one_step(expr, dtype):
    ops = _ops(expr, dtype)
    assert ops.count("sincos") == 1 and "sin" not in ops and "cos" not in ops, ops


@pytest.mark.parametrize("expr, dtype", [
    ("sin(x) + cos(y)", "fp32"),  # different arguments
    ("sin(x) * cos(x + 1)", "fp32"),
    ("sin(x) * x", "fp32"),  # sin alone
    ("sin(x)**2 + cos(x)**2", "fp64"),  # fp64 keeps libdevice
])
def test_sin_and_cos_of_other_arguments_or_precisions_stay_separate(expr, dtype):
    ops = _ops(expr, dtype)
    assert "sincos" not in ops and "sin" in ops, ops


def test_sin_and_cos_of_a_value_uniform_over_the_block_stay_separate():
    # sin and cos of a scalar, a 0-d or a one-element tensor are 0-d values computed once per block: no sharing
    x = torch.randn(300)
    expr = "x * cos(s) - sin(s)"
    for s in (0.75, torch.tensor(0.75), torch.tensor([0.75])):
        problem = FAMILY.problem_from_values(parse(expr), {"x": x, "s": s})
        assert "sincos" not in [step["op"] for step in FAMILY.plan(problem).steps]
        got = autotile.fuse(expr)(x=x, s=s)
        _assert_matches(expr, got, x.double() * math.cos(0.75) - math.sin(0.75), {"x": x, "s": s})


def _launch(expr: str, values: dict, monkeypatch, block_size: int = 1024, num_warps: int = 4) -> tuple:
    """One launch with a fixed block size (the fast-path test is made per block): (problem, outputs, and the
    number of blocks that took the shared reduction, the template's _sincos_f32_reduced, not tl.sin/tl.cos)."""
    problem = FAMILY.problem_from_values(parse(expr), values)
    config = FAMILY.space(problem, DEVICE).validate(dict(BLOCK_SIZE=block_size, num_warps=num_warps, num_stages=1,
                                                         PERSISTENT=False, PROGRAMS_PER_SM=1, STREAMING=False))
    helpers = FAMILY.launch_plan(problem, config, values).kernel.fn.__globals__  # the module the interpreter runs
    reduced, fast_blocks = helpers["_sincos_f32_reduced"], []
    monkeypatch.setitem(helpers, "_sincos_f32_reduced", lambda x: fast_blocks.append(x) or reduced(x))
    outputs = FAMILY.allocate_outputs(problem, values)
    for out in outputs.values():
        out.fill_(math.nan)
    FAMILY.launch(problem, config, values, outputs)
    return problem, outputs, len(fast_blocks)


def _log_uniform(n: int, gen: torch.Generator, high: float = 1e5) -> torch.Tensor:
    """n float64 values of magnitude log-uniform in [1e-30, high], either sign."""
    magnitude = torch.exp(torch.empty(n, dtype=torch.float64).uniform_(math.log(1e-30), math.log(high), generator=gen))
    return torch.where(torch.rand(n, generator=gen) < 0.5, -magnitude, magnitude)


def _near_multiples_of_half_pi(ks: torch.Tensor, spread: int) -> torch.Tensor:
    """The fp32 values within `spread` ulps of k pi/2: where the reduction cancels most, r down to 2^-27.8."""
    nearest = (ks.double() * (math.pi / 2)).float()
    values, up, down = [nearest], nearest, nearest
    for _ in range(spread):
        up, down = torch.nextafter(up, torch.tensor(math.inf)), torch.nextafter(down, torch.tensor(0.0))
        values += [up, down]
    near = torch.cat(values)
    return torch.cat([near, -near])


SINCOS_SPECIALS = [0.0, -0.0, 1e-30, -1e-30, 1e-37, 1e-40, math.nan, 1e5, -1e5, SINCOS_BOUND, -SINCOS_BOUND] + [
    k * math.pi / 4 for k in range(-12, 13)]
JUST_BEYOND_BOUND = [105616.0, -105616.0, 2e5, 1e6]  # 2e5: bf16 rounds 105616 down into the bound
FAR_BEYOND_BOUND = [1e30, -1e30, 3e38, math.inf, -math.inf, math.nan]


def _fast_then_fallback_blocks(dtype: torch.dtype, block: int = 1024) -> torch.Tensor:
    """Block 0: specials, arguments near k pi/2 and log-uniform ones, all within the fast range of `dtype`;
    blocks 1 and 2 (one element short): log-uniform arguments and ones beyond SINCOS_BOUND, just and far,
    so that both take tl.sin/tl.cos."""
    gen = torch.Generator().manual_seed(5)
    top = min(1e5, torch.finfo(dtype).max)
    hard = _near_multiples_of_half_pi(torch.tensor([1, 3, 6, 161, 322, 644, 33433, 66866]), 1).double()
    first = torch.cat([torch.tensor(SINCOS_SPECIALS, dtype=torch.float64), hard])
    first = first[~(first.abs() > top)]  # keeps NaN
    blocks = [torch.cat([first, _log_uniform(block - first.numel(), gen, top)])]
    for beyond, size in ((JUST_BEYOND_BOUND, block), (FAR_BEYOND_BOUND, block - 1)):
        beyond = torch.tensor(beyond, dtype=torch.float64)
        blocks.append(torch.cat([beyond, _log_uniform(size - beyond.numel(), gen, top)]))
    return torch.cat(blocks).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("expr", ["a = sin(x); b = cos(x)", "sin(x)**2 + cos(x)**2"])
def test_sincos_matches_float64_in_and_beyond_the_fast_range(expr, dtype, monkeypatch):
    x = _fast_then_fallback_blocks(dtype)
    problem, outputs, fast_blocks = _launch(expr, {"x": x}, monkeypatch)
    assert fast_blocks == 1
    result = FAMILY.check(problem, {"x": x}, outputs, FAMILY.reference(problem, {"x": x}))
    assert result.ok, result.message


def _ulps(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """|got - want| in fp32 ulps at the float64 reference (2^-149 below the normal range); NaN for NaN is 0."""
    _, exponent = torch.frexp(want)
    ulp = torch.exp2((exponent - 24).clamp(min=-149).double())
    err = (got.double() - want).abs() / ulp
    return torch.where(torch.isnan(want) & torch.isnan(got), 0.0, err)


def _worst(name: str, x: torch.Tensor, got: torch.Tensor, want: torch.Tensor) -> tuple[float, str]:
    ulps = _ulps(got, want)
    i = int(torch.nan_to_num(ulps, nan=math.inf).argmax())
    return float(ulps[i]), f"{name}({x[i].item()!r}) = {got[i].item()!r}, float64 {want[i].item()!r}: {ulps[i]:.2f} ulp"


def test_sincos_fast_path_is_within_2_ulp(monkeypatch):
    # libdevice's sinf/cosf are documented at 2 ulp; the shared reduction must do as well over its range:
    # every fp32 near k pi/2 for all k below the bound, 2^18 log-uniform arguments and the specials.
    gen = torch.Generator().manual_seed(11)
    x = torch.cat([
        torch.tensor(SINCOS_SPECIALS, dtype=torch.float32),
        _near_multiples_of_half_pi(torch.arange(1, int(SINCOS_BOUND / (math.pi / 2)) + 1), 1),
        _log_uniform(2**18, gen).float(),
    ])
    x = x[~(x.abs() > SINCOS_BOUND)]
    _, outputs, fast_blocks = _launch("a = sin(x); b = cos(x)", {"x": x}, monkeypatch, block_size=16384, num_warps=16)
    assert fast_blocks == triton_cdiv(x.numel(), 16384)
    sin, cos = outputs["a"], outputs["b"]
    for name, got, want in (("sin", sin, torch.sin(x.double())), ("cos", cos, torch.cos(x.double()))):
        worst, where = _worst(name, x, got, want)
        assert worst <= 2.0, where
    assert torch.equal(torch.signbit(sin[:2]), torch.tensor([False, True]))  # sin(0) = 0, sin(-0) = -0
    assert sin[x.isnan()].isnan().all() and cos[x.isnan()].isnan().all()
