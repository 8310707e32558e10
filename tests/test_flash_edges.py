"""Flash attention as SDPA and FlashAttention users call it, against float64 torch under Triton's interpreter.

Layouts models produce (permuted from (B, S, H, D), a strided head dim, stride-0 heads for MQA) served one
after another from the call cache, autocast, rows of a packed batch that belong to no sequence, and the
errors for arguments the kernels cannot take.
"""
from __future__ import annotations

import math

import pytest
import torch

import autotile
from autotile.errors import BadInputError, ShapeMismatchError

F = torch.nn.functional


def attention64(q, k, v, *, causal=False, scale=None):
    """(o, lse) in float64: bottom-right causal mask, GQA by repeating k and v, rows with no key 0."""
    q, k, v = (t.double() for t in (q, k, v))
    group = q.shape[-3] // k.shape[-3]
    k, v = k.repeat_interleave(group, -3), v.repeat_interleave(group, -3)
    seq_q, seq_k = q.shape[-2], k.shape[-2]
    logits = q @ k.transpose(-1, -2) * (1 / math.sqrt(q.shape[-1]) if scale is None else scale)
    if causal:
        query = torch.arange(seq_q).view(-1, 1) + seq_k - seq_q
        logits = logits.masked_fill(torch.arange(seq_k).view(1, -1) > query, -math.inf)
    lse = torch.logsumexp(logits, -1)
    return torch.exp(logits - lse[..., None]).nan_to_num(0.0) @ v, lse


def assert_close(actual, expected, tol, what):
    error = (actual.double() - expected.double()).abs()
    worst = tuple(int(i) for i in torch.unravel_index(error.argmax(), error.shape))
    assert error.max() <= tol, (f"{what}: max error {error.max():.3g} at {worst}: {actual[worst].item():.6g} against "
                                f"{expected[worst].item():.6g} (tolerance {tol})")


LAYOUTS = {
    "bshd": lambda t: t.transpose(1, 2).contiguous().transpose(1, 2),  # (B, S, H, D) memory, as after a projection
    "sbhd": lambda t: t.permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3),
    "strided-head-dim": lambda t: t.transpose(-1, -2).contiguous().transpose(-1, -2),
    "contiguous": lambda t: t.contiguous(),
}


def test_one_shape_in_many_layouts_each_served_right():
    # Same shapes, other strides: each call signature must get its own plan, in any order.
    torch.manual_seed(0)
    for name in [*LAYOUTS, "bshd"]:
        q, k, v = (LAYOUTS[name](torch.randn(2, 2, 9, 16)).requires_grad_() for _ in range(3))
        out, lse = autotile.flash_attention(q, k, v, causal=True, return_lse=True)
        (out.sum() + lse.sum()).backward()
        leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
        ref, ref_lse = attention64(*leaves, causal=True)
        (ref.sum() + ref_lse.sum()).backward()
        assert_close(out, ref, 1e-5, f"{name} output")
        assert_close(lse, ref_lse, 1e-5, f"{name} lse")
        for label, t, r in zip("qkv", (q, k, v), leaves):
            assert_close(t.grad, r.grad, 1e-4, f"{name} d{label}")


def test_mqa_through_expanded_key_value_heads():
    torch.manual_seed(1)
    q = torch.randn(1, 4, 7, 16)
    k, v = (torch.randn(1, 1, 12, 16).expand(1, 4, 12, 16) for _ in range(2))  # stride 0 over heads
    assert_close(autotile.flash_attention(q, k, v, causal=True), attention64(q, k, v, causal=True)[0], 1e-5, "o")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_runs_attention_in_its_dtype_as_sdpa(dtype):
    torch.manual_seed(2)
    q, k, v = (torch.randn(1, 4, 9, 16, requires_grad=True) for _ in range(3))
    with torch.autocast("cpu", dtype=dtype):
        sdpa = F.scaled_dot_product_attention(q, k, v)
        out = autotile.flash_attention(q, k, v)
    assert out.dtype == sdpa.dtype == dtype
    # The float64 reference of the inputs as autocast rounds them; the tolerance is the output's rounding.
    expected = attention64(*(t.detach().to(dtype) for t in (q, k, v)))[0]
    assert_close(out, expected, 1e-2 if dtype == torch.bfloat16 else 2e-3, "o")
    out.float().sum().backward()
    assert q.grad.dtype == torch.float32 and torch.isfinite(q.grad).all()


def test_varlen_under_autocast_runs_in_its_dtype():
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    q, k, v = (torch.randn(9, 2, 16) for _ in range(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = autotile.flash_attention_varlen(q, k, v, cu, cu, 5, 5, causal=True)
    assert out.dtype == torch.bfloat16


@pytest.mark.parametrize("lead", [(), (2, 1, 2)], ids=["no-batch", "three-batch-dims"])
def test_sdpa_ranks_other_than_four_fold_their_leading_dims(lead):
    torch.manual_seed(0)
    q = torch.randn(*lead, 4, 7, 16, requires_grad=True)
    k, v = (torch.randn(*lead, 2, 9, 16, requires_grad=True) for _ in range(2))
    out, lse = autotile.flash_attention(q, k, v, causal=True, return_lse=True)
    (out.sum() + lse.sum()).backward()
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = attention64(*leaves, causal=True)
    (ref.sum() + ref_lse.sum()).backward()
    assert out.shape == q.shape and lse.shape == q.shape[:-1]
    assert_close(out, ref, 1e-5, "output")
    assert_close(lse, ref_lse, 1e-5, "lse")
    for name, leaf, ref_leaf in zip("qkv", (q, k, v), leaves):
        assert_close(leaf.grad, ref_leaf.grad, 1e-4, f"d{name}")
    assert autotile.explain("flash_attention", q, k, v, causal=True)["problem"]["batch"] == math.prod(lead)
    with pytest.raises(ShapeMismatchError, match="share the same other leading dims"):  # nor are SDPA's
        autotile.flash_attention(q, k[:1], v[:1]) if lead else autotile.flash_attention(q, k[None], v[None])


def test_numpy_integers_serve_as_python_ints_do():
    # Engines keep lengths and windows in NumPy arrays; an int from one is a length like any other.
    np = pytest.importorskip("numpy")
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 9, 16) for _ in range(3))
    windowed = autotile.flash_attention(q, k, v, window=(np.int64(3), np.int32(0)))
    assert torch.equal(windowed, autotile.flash_attention(q, k, v, window=(3, 0)))
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    packed = [t[0].transpose(0, 1).contiguous() for t in (q, k, v)]
    lengths = np.array([5, 5])
    out = autotile.flash_attention_varlen(*packed, cu, cu, lengths[0], lengths.max(), causal=True)
    assert torch.equal(out, autotile.flash_attention_varlen(*packed, cu, cu, 5, 5, causal=True))
    with pytest.raises(BadInputError, match="host int"):
        autotile.flash_attention_varlen(*packed, cu, cu, torch.tensor(5), 5)


def _dirty_heap(nbytes: int) -> None:
    # Freed NaN-filled memory of this size, which the next allocation of the same size is likely to reuse.
    torch.full((nbytes // 4,), math.nan).sum()


def test_varlen_rows_in_no_sequence_are_zero_with_zero_gradients():
    # A packed batch padded to a fixed size (as for CUDA graphs): rows 8.. of q and 10.. of k, v are in no sequence.
    torch.manual_seed(3)
    cu_q, cu_k = torch.tensor([0, 5, 8], dtype=torch.int32), torch.tensor([0, 4, 10], dtype=torch.int32)
    q = torch.randn(11, 2, 16, requires_grad=True)
    k, v = (torch.randn(13, 2, 16, requires_grad=True) for _ in range(2))
    _dirty_heap(q.numel() * 4)
    out, lse = autotile.flash_attention_varlen(q, k, v, cu_q, cu_k, 5, 6, causal=True, return_lse=True)
    assert torch.equal(out[8:], torch.zeros_like(out[8:])), "rows in no sequence must be 0, as rows with no key"
    assert torch.isinf(lse[:, 8:]).all() and (lse[:, 8:] > 0).all()
    # The next layer reads every row; a loss that ignores the padding must leave it without gradient.
    _dirty_heap(k.numel() * 4)
    (out[:8] * torch.randn(8, 2, 16)).sum().backward()
    for name, t, used in (("q", q, 8), ("k", k, 10), ("v", v, 10)):
        assert torch.equal(t.grad[used:], torch.zeros_like(t.grad[used:])), f"d{name} of rows in no sequence"
    for b in range(2):
        rows, keys = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        expected = attention64(*(t.detach()[s].transpose(0, 1) for t, s in ((q, rows), (k, keys), (v, keys))),
                               causal=True)[0].transpose(0, 1)
        assert_close(out[rows], expected, 1e-5, f"sequence {b}")


def test_varlen_reads_strided_cumulative_lengths_by_their_strides():
    """cu_seqlens given as a strided view (every other entry of a longer tensor) mean what they hold: the kernels
    read a contiguous copy, not the tensor's storage (which read [0, 1, 3] here, and past the rows with other
    values: a corrupted heap under the interpreter)."""
    torch.manual_seed(5)
    q, k, v = (torch.randn(8, 2, 16, requires_grad=True) for _ in range(3))
    strided = torch.tensor([0, 1, 3, 9, 8, 9], dtype=torch.int32)[::2]  # holds [0, 3, 8]
    out = autotile.flash_attention_varlen(q, k, v, strided, strided, 5, 5, causal=True)
    out.sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    dense = torch.tensor([0, 3, 8], dtype=torch.int32)
    want = autotile.flash_attention_varlen(q, k, v, dense, dense, 5, 5, causal=True)
    want.sum().backward()
    assert torch.equal(out, want)
    assert all(torch.equal(g, t.grad) for g, t in zip(grads, (q, k, v)))


def test_alibi_slopes_that_require_grad_are_refused_not_left_without_gradient():
    q, k, v = (torch.randn(1, 2, 5, 16, requires_grad=True) for _ in range(3))
    slopes = torch.rand(2, requires_grad=True)
    with pytest.raises(BadInputError, match="detach"):
        autotile.flash_attention(q, k, v, alibi_slopes=slopes)
    cu = torch.tensor([0, 5], dtype=torch.int32)
    with pytest.raises(BadInputError, match="detach"):
        autotile.flash_attention_varlen(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), cu, cu, 5,
                                        5, alibi_slopes=slopes)
    with torch.no_grad():  # inference: nothing to differentiate
        autotile.flash_attention(q, k, v, alibi_slopes=slopes)


def _dense(**kwargs):
    q = kwargs.pop("q", torch.randn(1, 2, 5, 16))
    return lambda: autotile.flash_attention(q, torch.randn(1, 2, 5, q.shape[-1] or 16),
                                            torch.randn(1, 2, 5, q.shape[-1] or 16), **kwargs)


@pytest.mark.parametrize("call, error, words", [
    pytest.param(_dense(q=torch.randn(1, 2, 5, 0)), ShapeMismatchError, "head dim of at least 1", id="head-dim-0"),
    pytest.param(lambda: autotile.flash_attention(torch.tensor(1.0), torch.randn(1, 2, 5, 16),
                                                  torch.randn(1, 2, 5, 16)), ShapeMismatchError, "head dim",
                 id="0-d-q"),
    pytest.param(_dense(scale="0.1"), BadInputError, "scale must be a finite number", id="scale-string"),
    pytest.param(_dense(causal="no"), BadInputError, "causal must be True or False", id="causal-string"),
    pytest.param(_dense(alibi_slopes=[0.5, 0.25]), BadInputError, "torch.tensor", id="slopes-list"),
    pytest.param(lambda: autotile.flash_attention_varlen(*(torch.randn(5, 2, 16) for _ in range(3)), [0, 5], [0, 5],
                                                         5, 5), BadInputError, "int32 tensor", id="varlen-lengths-list"),
    pytest.param(lambda: autotile.flash_attention_varlen(*(torch.randn(5, 2, 0) for _ in range(3)),
                                                         *(torch.tensor([0, 5], dtype=torch.int32),) * 2, 5, 5),
                 ShapeMismatchError, "head dim of at least 1", id="varlen-head-dim-0"),
])
def test_arguments_the_op_cannot_take_say_what_to_do(call, error, words):
    with pytest.raises(error, match=words):
        call()


def test_varlen_max_seqlen_is_bounded_by_the_packed_rows():
    """An engine's max model length as max_seqlen sized the grid by it: 7 packed rows with max_seqlen=10**6 ran
    ~16k idle query tiles (two minutes on the interpreter). No sequence outgrows the packed rows."""
    q = torch.randn(7, 2, 32, generator=torch.Generator().manual_seed(0))
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    loose = autotile.flash_attention_varlen(q, q, q, cu, cu, 10**6, 10**6, causal=True)
    assert torch.equal(loose, autotile.flash_attention_varlen(q, q, q, cu, cu, 4, 4, causal=True))


@pytest.mark.parametrize("dtype, magnitude", [(torch.float16, 2.0), (torch.float32, 5.0)])
@pytest.mark.parametrize("softcap", [None, 200.0], ids=["plain", "softcap"])
def test_dq_of_a_row_whose_logits_are_all_far_below_zero_is_finite(dtype, magnitude, softcap):
    """Keys past Sk in the last key block load K = 0, a logit of 0: against a row's LSE far below zero, P (or dS in
    16 bits) overflowed to inf, and inf times K's zero row made the row's dQ NaN (not causal, no window)."""
    gen = torch.Generator().manual_seed(0)
    q = (-magnitude * torch.ones(1, 1, 1, 16) + 0.1 * torch.randn(1, 1, 1, 16, generator=gen)).to(dtype)
    k = (magnitude * torch.ones(1, 1, 3, 16) + 0.1 * torch.randn(1, 1, 3, 16, generator=gen)).to(dtype)
    v = torch.randn(1, 1, 3, 16, generator=gen).to(dtype)
    do = torch.randn(1, 1, 1, 16, generator=gen).to(dtype)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    grads = torch.autograd.grad(autotile.flash_attention(q, k, v, softcap=softcap), (q, k, v), do)
    wide = [t.detach().double().requires_grad_() for t in (q, k, v)]
    logits = wide[0] @ wide[1].transpose(-1, -2) / 4.0
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    want = torch.autograd.grad(torch.softmax(logits, -1) @ wide[2], wide, do.double())
    for got, ref in zip(grads, want):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.double(), ref, atol=2e-3 if dtype == torch.float16 else 1e-5, rtol=1e-2)
