"""Edge cases of autotile.fuse against eager torch and a float64 reference: signs of zero, tanh near zero,
integer constants outside an input's dtype, Python ints wider than 64 bits, inputs that are neither tensors
nor numbers, and the shapes of several outputs."""
from __future__ import annotations

import pytest
import torch

import autotile
from autotile import expr
from autotile.errors import BadInputError


def _same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal dtype, shape and values, the sign of zero included (1 / x tells -0 from +0)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.is_floating_point():
        numbers = ~want.isnan()  # the sign of a NaN means nothing
        assert torch.equal(torch.signbit(got[numbers]), torch.signbit(want[numbers])), (
            f"signs differ: {got.tolist()} vs {want.tolist()}")
    assert torch.equal(got.nan_to_num(), want.nan_to_num()), f"{got.tolist()} vs {want.tolist()}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_unary_minus_keeps_the_sign_of_zero(dtype):
    x = torch.tensor([0.0, -0.0, 1.5, float("inf"), float("nan")], dtype=dtype)
    _same_bits(autotile.fuse("-x")(x=x), -x)
    _same_bits(autotile.fuse("1 / (-x)")(x=x), 1 / (-x))


@pytest.mark.parametrize("dtype, ulp", [(torch.float32, 2.0**-24), (torch.float64, 2.0**-53)])
def test_tanh_is_accurate_near_zero(dtype, ulp):
    # 1 - exp(-2|x|) cancels for small |x|: that formula alone is 40% off at x = 1e-7 in fp32.
    magnitudes = torch.cat([torch.logspace(-30, 1.5, 401, dtype=torch.float64),
                            torch.linspace(0.1, 0.7, 61, dtype=torch.float64)])
    x = torch.cat([magnitudes, -magnitudes]).to(dtype)
    got = autotile.fuse("tanh(x)")(x=x).double()
    want = torch.tanh(x.double())
    relative = ((got - want) / want).abs() / ulp
    worst = int(relative.argmax())
    assert relative[worst] <= 8, f"tanh({x[worst].item()!r}) = {got[worst].item()!r}, float64 says {want[worst].item()!r}"
    _same_bits(autotile.fuse("tanh(x)")(x=torch.tensor([-0.0, 0.0], dtype=dtype)), torch.tensor([-0.0, 0.0], dtype=dtype))


# where/maximum take a Python number as torch takes a 0-d int64 tensor there (torch.where refuses a wide int).
@pytest.mark.parametrize("expr, dtype, eager", [
    ("x + 300", torch.int8, lambda x: x + 300),
    ("x * 200", torch.int8, lambda x: x * 200),
    ("x + (-300)", torch.uint8, lambda x: x + (-300)),
    ("x > -1", torch.uint8, lambda x: x > -1),
    ("x == 300", torch.int8, lambda x: x == 300),
    ("where(x > 0, x, 3000000000)", torch.int32, lambda x: torch.where(x > 0, x, torch.tensor(3000000000))),
    ("maximum(x, 3000000000)", torch.int32, lambda x: torch.maximum(x, torch.tensor(3000000000))),
])
def test_integer_constants_wrap_to_the_inputs_dtype_as_torch(expr, dtype, eager):
    x = torch.tensor([0, 1, 44, 100, 127], dtype=dtype)
    _same_bits(autotile.fuse(expr)(x=x), eager(x))


def test_python_int_wider_than_64_bits_is_refused_with_advice():
    fused = autotile.fuse("x + a")
    x = torch.ones(3)
    fused(x=x, a=2)  # the signature is prepared: the wide int must be caught on the cached path too
    with pytest.raises(BadInputError, match=r"'a'.*does not fit 64 bits; pass it as a float"):
        fused(x=x, a=2**70)
    assert torch.equal(fused(x=x, a=float(2**70)), x + float(2**70))


@pytest.mark.parametrize("value, kind", [([1.0, 2.0], "list"), (None, "NoneType"), ("3", "str")])
def test_an_input_that_is_not_a_tensor_or_number_is_named(value, kind):
    with pytest.raises(BadInputError, match=rf"input 'x' is a {kind}; pass a torch.Tensor"):
        autotile.fuse("x + 1")(x=value)
    with pytest.raises(BadInputError, match=rf"input 'y' is a {kind}; pass a torch.Tensor"):
        autotile.fuse("x + y")(x=torch.ones(3), y=value)


def test_inputs_are_checked_under_a_torch_function_mode_too():
    """torch.set_default_device (a function mode) sends calls through the op, whose schema refused a list or a wide
    int with a cast error that named no input."""
    fused = autotile.fuse("x + a")
    with torch.device("cpu"):
        with pytest.raises(BadInputError, match=r"input 'a' is a list"):
            fused(x=torch.ones(3), a=[1.0, 2.0])
        with pytest.raises(BadInputError, match=r"'a'.*does not fit 64 bits"):
            fused(x=torch.ones(3), a=2**70)
        assert torch.equal(fused(x=torch.ones(3), a=2), torch.full((3,), 3.0))


def test_numpy_scalars_are_taken_as_the_python_numbers_torch_takes_them_as():
    np = pytest.importorskip("numpy")
    x = torch.arange(-3, 3, dtype=torch.float16)
    for value in (np.float32(2.5), np.int64(3), np.bool_(True), np.array(1.25)):
        _same_bits(autotile.fuse("x * a + a")(x=x, a=value), x * value.item() + value.item())
    with pytest.raises(BadInputError, match="'a' is a ndarray"):  # an array is no scalar: it must be a tensor
        autotile.fuse("x * a")(x=x, a=np.ones(6))


def test_each_output_has_the_shape_of_the_inputs_it_uses():
    x, y, s = torch.randn(2, 1, 3), torch.randn(4, 1), torch.tensor(2.0)
    fused = autotile.fuse("a = x + s; b = a * y; c = s * 3; d = y - 1")
    for _ in range(2):  # the first call prepares the signature, the second takes the cached path
        a, b, c, d = fused(x=x, y=y, s=s)
        for got, want in ((a, x + s), (b, (x + s) * y), (c, s * 3), (d, y - 1)):
            assert got.shape == want.shape and got.is_contiguous()
            torch.testing.assert_close(got, want)
    assert d.sum().item() == pytest.approx((y - 1).sum().item())


def test_traced_outputs_have_the_same_shapes_as_eager_ones():
    x, y = torch.randn(3, 1), torch.randn(5)
    fused = autotile.fuse("a = x * 2; b = a + y")
    compiled = torch.compile(lambda x, y: fused(x=x, y=y), backend="aot_eager", fullgraph=True)
    assert [t.shape for t in compiled(x, y)] == [(3, 1), (3, 5)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("text", ["x == 0.1", "x != 0.1", "x > 0.2", "0.3 >= x", "where(x <= 0.3, x, 0.0)"])
def test_a_literal_compared_with_a_16_bit_tensor_is_rounded_to_its_dtype_as_torch_does(text, dtype):
    """x == 0.1 with x fp16 holding fp16's 0.1 is True in torch (the literal is rounded to fp16 first); computing
    the comparison in fp32 against fp32's 0.1 flipped it."""
    x = torch.tensor([0.1, 0.2, 0.3, -1.0], dtype=dtype)
    want = expr.evaluate(expr.parse(text), {"x": x})["out"]
    assert torch.equal(autotile.fuse(text)(x=x), want)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("text", ["x == 2049", "x != 257", "where(x >= 2049, 1.0, 0.0)", "x == 65520", "x < 1e5",
                                  "x > -1e39"])
def test_int_literals_and_literals_past_the_dtypes_range_compare_as_torch_does(text, dtype):
    """An int literal was compared unrounded (x == 2049 with fp16's 2048: False where torch says True), and a literal
    that rounds to an infinity was emitted as a bare name `inf` (a NameError in the kernel)."""
    x = torch.tensor([2048., 256., 65504., float("inf"), -float("inf"), 1.0], dtype=dtype)
    assert torch.equal(autotile.fuse(text)(x=x), expr.evaluate(expr.parse(text), {"x": x})["out"])


def test_an_input_only_an_unused_temporary_reads_may_hold_one_element():
    (out,) = autotile.fuse("_t = x * 2; out = y + 1")(x=torch.ones(1), y=torch.arange(4.0))
    assert torch.equal(out, torch.arange(4.0) + 1)


def test_a_negative_zero_base_keeps_its_sign_in_odd_powers():
    a = torch.tensor([-0.0, -0.0, -0.0, 0.0, -2.0, 3.0])
    b = torch.tensor([-1.0, 3.0, 0.5, -1.0, 3.0, 2.0])
    got, want = autotile.fuse("x ** y")(x=a, y=b), a ** b
    assert torch.equal(torch.signbit(got), torch.signbit(want)) and torch.allclose(got, want, rtol=1e-5)


def test_interpreted_fused_ops_warn_no_more_than_torch(recwarn):
    """numpy warned 'divide by zero' for the masked lanes past the end of rsqrt(x) and x**-2 under the interpreter."""
    x = torch.rand(100) + 0.1
    torch.testing.assert_close(autotile.fuse("rsqrt(x) + x**-2")(x=x), x.rsqrt() + x**-2)
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]


@pytest.mark.parametrize("x_shape, y_shape", [((3, 0), (3, 1)), ((0, 3), (3,)), ((0, 1), (1, 3))])
def test_an_output_of_nonempty_inputs_is_computed_when_another_input_is_empty(x_shape, y_shape):
    # The kernel runs over the broadcast shape of all the inputs, empty here; b uses y alone and is not empty.
    x, y = torch.randn(x_shape), torch.rand(y_shape)
    a, b = autotile.fuse("a = x * 2; b = y + 1")(x=x, y=y)
    _same_bits(a, x * 2)
    _same_bits(b, y + 1)


def test_each_output_keeps_its_own_shape_under_vmap():
    g = autotile.fuse("a = x + 1; b = a * y")
    y = torch.rand(1, 4)
    a, b = torch.func.vmap(lambda x: g(x=x, y=y))(torch.rand(2, 3, 1))
    assert a.shape == (2, 3, 1) and b.shape == (2, 3, 4)


@pytest.mark.parametrize("text, values", [
    ("x + (a - b)", dict(a=100000001.0, b=100000000.0)),
    ("x * (a / b)", dict(a=1e39, b=1e39)),
])
def test_python_number_inputs_combine_in_double_as_python_combines_them(text, values):
    # torch gets (a - b) and (a / b) from Python, in double precision: 1.0 both times.
    x = torch.ones(3)
    want = torch.full((3,), 2.0) if "+" in text else x
    _same_bits(autotile.fuse(text)(x=x, **values), want)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_other_operands_compared_with_a_16_bit_tensor_are_rounded_to_its_dtype_as_torch_does(dtype):
    # A Python number, a 0-d tensor and an integer tensor are cast to the comparison's 16-bit dtype first.
    x = torch.tensor([0.1, 0.3, 2048.0, 7.0], dtype=dtype)
    for op in ("==", ">=", "<", "!="):
        fused = autotile.fuse(f"x {op} s")
        for s in (0.1, torch.tensor(0.1), torch.tensor(0.1, dtype=torch.float64)):
            _same_bits(fused(x=x, s=s), eval(f"x {op} s"))
    n = torch.tensor([1, 1, 2049, 7], dtype=torch.int32)  # 2049 is 2048 in fp16 and bf16
    _same_bits(autotile.fuse("x == n")(x=x, n=n), x == n)
    _same_bits(autotile.fuse("where(x < s, x, 0)")(x=x, s=0.1), torch.where(x < 0.1, x, 0))


def test_another_default_dtype_types_calls_as_torch_does():
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        i = torch.tensor([16777217, 3])
        with pytest.warns(UserWarning, match="default dtype is torch.float64"):
            got = autotile.fuse("x * 1.0")(x=i)
        _same_bits(got, i * 1.0)  # float64, exact
        with pytest.warns(UserWarning, match="eager torch computes it"):
            _same_bits(autotile.fuse("x / 2")(x=i), i / 2)
        h = torch.tensor([1.5, -2.0], dtype=torch.float16)  # typed alike under either default: the kernel serves it
        _same_bits(autotile.fuse("x * 2.0")(x=h), h * 2.0)
    finally:
        torch.set_default_dtype(before)
    _same_bits(autotile.fuse("x * 1.0")(x=torch.tensor([3])), torch.tensor([3.0]))
