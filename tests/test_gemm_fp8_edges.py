"""fp8 calls of matmul and linear at their edges: the vendor op's scale forms, empty calls, cached signatures with
other scales, the fast-accumulation switch and the gradients an fp8 call has (its bias and residual)."""
from __future__ import annotations

import pytest
import torch

import autotile
from autotile.errors import BadInputError
from autotile.families.gemm import vendor_matmul

E4 = torch.float8_e4m3fn


def _fp8(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(E4)


def _dequantised(a, b, scale_a, scale_b):
    return (a.double() * scale_a.double().reshape(-1, 1)) @ (b.double() * scale_b.double().reshape(1, -1))


def _scaled_mm_runs_here() -> bool:
    try:
        torch._scaled_mm(_fp8(16, 16), _fp8(16, 16).t(), torch.ones(()), torch.ones(()), out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError, AttributeError):
        return False
    return True


@pytest.mark.skipif(not _scaled_mm_runs_here(), reason="torch._scaled_mm does not run on this build's CPU")
@pytest.mark.parametrize("form", ["1-D row scales at M = 1", "strided (1, N)", "(1, 1, 1) per tensor"])
def test_the_vendor_op_takes_every_scale_form_the_kernels_take(form):
    # An untuned fp8 shape is served by torch._scaled_mm, which takes contiguous (M, 1) and (1, N) row scales only.
    m = 1 if form.startswith("1-D") else 4
    a, b = _fp8(m, 64), _fp8(32, 64, seed=1).t()
    if form.startswith("1-D"):
        scale_a, scale_b = torch.full((1,), 0.5), torch.linspace(0.5, 2, 32)
    elif form.startswith("strided"):
        scale_a, scale_b = torch.linspace(1, 2, m).reshape(m, 1), torch.linspace(0.5, 2, 64).reshape(32, 2)[:, :1].t()
        assert not scale_b.is_contiguous()
    else:
        scale_a, scale_b = torch.full((1, 1, 1), 0.5), torch.full((1, 1, 1), 2.0)
    got = vendor_matmul("scaled_mm", a, b, None, "none", torch.bfloat16, scale_a, scale_b)
    want = _dequantised(a, b, scale_a.reshape(-1), scale_b.reshape(-1))
    torch.testing.assert_close(got.double(), want, atol=0.05, rtol=2**-7)


@pytest.mark.parametrize("call", ["no tokens", "no tokens, gelu", "no tokens, residual", "no input features"])
def test_empty_fp8_linear_calls_give_bf16_as_every_fp8_call(call):
    weight = _fp8(32, 0 if call == "no input features" else 64)
    x = _fp8(3, 0) if call == "no input features" else _fp8(0, 64)
    kwargs = {"no tokens, gelu": dict(activation="gelu"),
              "no tokens, residual": dict(residual=torch.zeros(0, 32, dtype=torch.bfloat16)),
              "no input features": dict(bias=torch.linspace(-1, 1, 32).bfloat16(), activation="relu")}.get(call, {})
    out = autotile.linear(x, weight, **kwargs)
    assert out.dtype == torch.bfloat16 and out.shape == (x.shape[0], 32)
    if call == "no input features":  # every output is its bias through the activation
        assert torch.equal(out, torch.relu(kwargs["bias"]).expand(3, 32))


def test_scales_of_another_dtype_are_refused_after_a_good_call_of_the_same_shapes():
    a, b = _fp8(4, 64), _fp8(32, 64, seed=1).t()
    scale_a, scale_b = torch.ones(4, 1), torch.ones(1, 32)
    autotile.matmul(a, b, scale_a=scale_a, scale_b=scale_b)
    for bad in (scale_a.double(), scale_a.to(torch.int64), scale_a.bfloat16()):
        with pytest.raises(BadInputError, match="scale_a must be a float32 tensor"):
            autotile.matmul(a, b, scale_a=bad, scale_b=scale_b)


def test_empty_fp8_calls_check_their_scales():
    a, b = _fp8(0, 150), _fp8(150, 20)
    with pytest.raises(BadInputError, match="float32"):
        autotile.matmul(a, b, scale_a=torch.ones(7, 7, dtype=torch.float64), scale_b=torch.ones(5))
    with pytest.raises(BadInputError, match="fp8_fast_accum does not apply"):  # block scales
        autotile.matmul(a, b, scale_a=torch.ones(0, 2), scale_b=torch.ones(2, 1), fp8_fast_accum=True)


def test_fp8_fast_accum_is_a_bool_for_fp8_operands_only():
    with pytest.raises(BadInputError, match="float8_e4m3fn operands only"):
        autotile.matmul(torch.randn(2, 3), torch.randn(3, 4), fp8_fast_accum=True)
    with pytest.raises(BadInputError, match="True or False"):
        autotile.matmul(_fp8(4, 64), _fp8(32, 64).t(), fp8_fast_accum="no")
    autotile.matmul(torch.randn(2, 3), torch.randn(3, 4), fp8_fast_accum=False)


def test_an_fp8_calls_bias_and_residual_train_and_its_operands_do_not():
    a, b = _fp8(4, 64), _fp8(32, 64, seed=1).t()
    scale_a, scale_b = torch.linspace(0.5, 1, 4).reshape(4, 1), torch.linspace(0.5, 2, 32).reshape(1, 32)
    bias = torch.linspace(-1, 1, 32).bfloat16().requires_grad_(True)
    residual = torch.randn(4, 32).bfloat16().requires_grad_(True)
    upstream = torch.randn(4, 32, generator=torch.Generator().manual_seed(2))
    out = autotile.matmul(a, b, bias=bias, activation="gelu", residual=residual, scale_a=scale_a, scale_b=scale_b)
    (out.float() * upstream).sum().backward()
    bias64 = bias.detach().double().requires_grad_(True)
    pre = _dequantised(a, b, scale_a.reshape(-1), scale_b.reshape(-1)) + bias64
    (torch.nn.functional.gelu(pre) * upstream.double()).sum().backward()
    assert torch.allclose(bias.grad.double(), bias64.grad, atol=0.02, rtol=2**-7)  # one bf16 step of ~4
    assert torch.equal(residual.grad, upstream.bfloat16())
    scale = scale_a.clone().requires_grad_(True)
    with pytest.raises(BadInputError, match="no backward for fp8 operands or their scales"):
        autotile.matmul(a, b, scale_a=scale, scale_b=scale_b).float().sum().backward()
