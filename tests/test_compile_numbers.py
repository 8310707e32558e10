"""The ops under torch.compile where a call's numbers change between calls (dynamo traces them as symbols, or
passes floats as tensors) and where a call is empty: the compiled call gives the eager result, and a bad number
is still refused with the eager error, by the op's body."""
from __future__ import annotations

import pytest
import torch

import autotile
from autotile.errors import BadInputError


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _compiled(fn, **kwargs):
    # The defects lived in dynamo's tracing and fake-tensor pass, which every backend runs: eager keeps it short.
    return torch.compile(fn, backend="eager", **kwargs)


def test_fuse_takes_a_python_number_that_changes_between_compiled_calls():
    fused = autotile.fuse("x * z + 1")
    x = torch.randn(4, 3)
    f = _compiled(lambda x, z: fused(x=x, z=z))
    for z in (0.1, 0.2, 0.3, 2, 3):
        assert torch.equal(f(x, z), fused(x=x, z=z)), z


def test_fuse_takes_a_number_from_a_dynamic_size():
    fused = autotile.fuse("x * n")
    f = _compiled(lambda x: fused(x=x, n=x.shape[0]), dynamic=True)
    for rows in (4, 5, 6):
        x = torch.randn(rows, 3)
        assert torch.equal(f(x), fused(x=x, n=rows))


def test_fuse_on_a_tensor_that_requires_grad_is_refused_as_in_eager():
    x = torch.randn(3, requires_grad=True)
    fused = autotile.fuse("x * 2")
    with pytest.raises(BadInputError, match="fuse has no backward"):
        _compiled(lambda x: fused(x=x))(x)
    with torch.no_grad():
        assert torch.equal(_compiled(lambda x: fused(x=x))(x), x.detach() * 2)


def test_flash_scale_and_softcap_may_change_between_compiled_calls():
    q, k, v = (torch.randn(1, 2, 5, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
    f = _compiled(lambda s, c: autotile.flash_attention(q, k, v, scale=s, softcap=c), fullgraph=True)
    for scale, cap in ((0.1, None), (0.2, None), (0.2, 5.0), (0.3, 6.0)):
        torch.testing.assert_close(f(scale, cap), autotile.flash_attention(q, k, v, scale=scale, softcap=cap))
    with pytest.raises(BadInputError, match="scale must be a finite number"):
        f(float("nan"), None)
    with pytest.raises(BadInputError, match="softcap must be a finite number >= 0"):
        f(0.2, -1.0)


def test_varlen_scale_may_change_between_compiled_calls():
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    q = torch.randn(5, 2, 16)
    f = _compiled(lambda s: autotile.flash_attention_varlen(q, q, q, cu, cu, 3, 3, causal=True, scale=s),
                  fullgraph=True)
    for scale in (0.1, 0.2, 0.3):
        want = autotile.flash_attention_varlen(q, q, q, cu, cu, 3, 3, causal=True, scale=scale)
        torch.testing.assert_close(f(scale), want)


def test_paged_scale_and_softcap_may_change_between_compiled_calls():
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = (torch.randn(8, 16, 2, 64, generator=gen).half() for _ in range(2))
    block_table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    context_lens = torch.tensor([20, 9], dtype=torch.int32)
    q = torch.randn(2, 4, 64, generator=gen).half()

    def step(scale, cap):
        return autotile.paged_attention(q, k_cache, v_cache, block_table, context_lens, scale=scale, softcap=cap,
                                        max_context=32)

    f = _compiled(step, fullgraph=True)
    for scale, cap in ((0.1, None), (0.2, None), (0.2, 5.0), (0.3, 6.0)):
        assert torch.equal(f(scale, cap), step(scale, cap))
    with pytest.raises(BadInputError, match="scale must be a finite number"):
        f(float("nan"), None)


@pytest.mark.parametrize("q_shape, k_shape", [((1, 2, 5, 16), (1, 2, 0, 16)), ((0, 2, 5, 16), (0, 2, 5, 16)),
                                              ((1, 2, 0, 16), (1, 2, 5, 16))], ids=["no keys", "no batch", "no queries"])
def test_empty_flash_calls_compile_to_the_eager_result(q_shape, k_shape):
    q, k = torch.randn(*q_shape), torch.randn(*k_shape)
    f = _compiled(lambda q, k: autotile.flash_attention(q, k, k, causal=True, return_lse=True), fullgraph=True)
    for got, want in zip(f(q, k), autotile.flash_attention(q, k, k, causal=True, return_lse=True)):
        assert torch.equal(got, want)
