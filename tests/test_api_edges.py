"""Edges of the public ops a demanding user meets, on the CPU (Triton's interpreter): a negative softmax scale in
bf16, LSEs of rows that see no key merged across ops, cumulative lengths that do not fit the packed tensors, meta
tensors beside real ones in fuse, gradients through matmul and linear when a generated kernel serves them, and
calls with an empty dimension (they give torch's result)."""
from __future__ import annotations

import math

import pytest
import torch

import autotile
from autotile.errors import BadInputError, ShapeMismatchError, UnsupportedDtypeError
from autotile.runtime.paged_plan import merge_attention_states


def _attention64(q, k, v, scale, softcap=0.0):
    s = (q.double() @ k.double().transpose(-1, -2)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    return torch.softmax(s, -1) @ v.double()


@pytest.mark.parametrize("scale, softcap", [(-0.5, 0.0), (-0.3, 20.0)], ids=["negative", "negative-softcap"])
def test_a_negative_scale_in_bf16_matches_float64(scale, softcap):
    """The kernels run on |scale| with Q negated; Triton's interpreter negates bf16 tensors wrongly, so Q goes
    through fp32 (max error 2.8-4.7 before)."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 13, 32, generator=gen).bfloat16().requires_grad_(True) for _ in range(3))
    o = autotile.flash_attention(q, k, v, scale=scale, softcap=softcap or None)
    leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    want = _attention64(*leaves, scale, softcap)
    assert (o.double() - want).abs().max().item() < 3e-2
    do = torch.randn(o.shape, generator=gen).bfloat16()
    got = torch.autograd.grad(o, (q, k, v), do)
    for g, w in zip(got, torch.autograd.grad(want, leaves, do.double())):
        assert ((g.double() - w).abs().max() / w.abs().max()).item() < 3e-2


def test_flash_lses_of_rows_with_no_key_merge_as_no_keys():
    """flash_attention gives +inf for a row that sees no key (FlashAttention's convention), the paged ops -inf:
    merge_attention_states takes both as a state with no keys."""
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 1, 4, 16, generator=gen) for _ in range(3))
    # Causal over keys 0-1 with 4 queries, bottom-right aligned: queries 0 and 1 see no key.
    out_a, lse_a = autotile.flash_attention(q, k[:, :, :2], v[:, :, :2], causal=True, return_lse=True)
    out_b, lse_b = autotile.flash_attention(q, k[:, :, 2:], v[:, :, 2:], return_lse=True)
    assert torch.isinf(lse_a[0, 0, :2]).all() and (lse_a[0, 0, :2] > 0).all()
    out, lse = merge_attention_states(out_a[0, 0], lse_a[0, 0], out_b[0, 0], lse_b[0, 0])
    assert torch.allclose(out[:2], out_b[0, 0, :2], atol=1e-6) and torch.allclose(lse[:2], lse_b[0, 0, :2])
    scores = (q[0, 0].double() @ k[0, 0].double().T) / math.sqrt(16)
    seen = torch.ones(4, 4, dtype=torch.bool)
    seen[:, :2] = torch.tril(torch.ones(4, 2, dtype=torch.bool), diagonal=-2)
    want = torch.softmax(scores.masked_fill(~seen, -math.inf), -1) @ v[0, 0].double()
    assert torch.allclose(out.double(), want, atol=1e-5)
    assert torch.allclose(lse.double(), torch.logsumexp(scores.masked_fill(~seen, -math.inf), -1), atol=1e-5)
    empty, no_key = merge_attention_states(out_a[0, 0], lse_a[0, 0], out_a[0, 0], lse_a[0, 0])
    assert not empty[:2].any() and (no_key[:2] == -math.inf).all()


@pytest.mark.parametrize("cu_q, max_q, error, text", [
    ([0, 3, 10], 7, ShapeMismatchError, "past the 8 packed rows"),
    ([1, 3, 8], 5, BadInputError, "start at 0"),
    ([0, 5, 3], 5, BadInputError, "never decrease"),
    ([0, 3, 8], 4, BadInputError, "longer than max_seqlen_q=4"),
], ids=["past-the-end", "not-from-zero", "decreasing", "longer-than-max"])
def test_cumulative_lengths_that_do_not_fit_are_refused(cu_q, max_q, error, text):
    """Checked where reading them back is free (CPU tensors): past the packed rows, the interpreter wrote outside
    its buffers and the process aborted."""
    q = k = v = torch.randn(8, 2, 16)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    with pytest.raises(error, match=text):
        autotile.flash_attention_varlen(q, k, v, torch.tensor(cu_q, dtype=torch.int32), cu, max_q, 5)
    assert autotile.flash_attention_varlen(q, k, v, cu, cu, 5, 5).shape == (8, 2, 16)


def test_fuse_refuses_meta_tensors_beside_real_ones():
    """The op's fake serves all-meta calls; a meta input beside a CPU one came back as uninitialised memory."""
    add = autotile.fuse("x + y")
    with pytest.raises(BadInputError, match="different devices"):
        add(x=torch.randn(3), y=torch.randn(3, device="meta"))
    assert add(x=torch.randn(3, device="meta"), y=torch.randn(3, device="meta")).is_meta


@pytest.mark.parametrize("dtype, activation, tol", [(torch.float32, None, 1e-5), (torch.float32, "gelu", 1e-5),
                                                    (torch.bfloat16, "silu", 2e-2)], ids=["fp32", "gelu", "bf16-silu"])
def test_linear_and_matmul_have_gradients(dtype, activation, tol):
    """A generated kernel serves these calls (CPU): their backward is torch's, through the op's registered
    autograd; before, backward raised 'no autograd formula was registered'."""
    gen = torch.Generator().manual_seed(5)
    x, w, bias, residual = (torch.randn(*shape, generator=gen).to(dtype).requires_grad_(True)
                            for shape in ((2, 3, 24), (10, 24), (10,), (2, 3, 10)))
    y = autotile.linear(x, w, bias, activation=activation, residual=residual)
    dy = torch.randn(y.shape, generator=gen).to(dtype)
    got = torch.autograd.grad(y, (x, w, bias, residual), dy)
    leaves = [t.detach().double().requires_grad_(True) for t in (x, w, bias, residual)]
    act = {None: lambda t: t, "gelu": torch.nn.functional.gelu, "silu": torch.nn.functional.silu}[activation]
    want = act(leaves[0] @ leaves[1].T + leaves[2]) + leaves[3]
    for g, w_ in zip(got, torch.autograd.grad(want, leaves, dy.double())):
        assert g.dtype == dtype and ((g.double() - w_).abs().max() / w_.abs().max()).item() < tol
    a, b = (torch.randn(*shape, generator=gen, requires_grad=True) for shape in ((5, 7), (7, 3)))
    autotile.matmul(a, b, activation="relu").sum().backward()
    assert torch.allclose(a.grad, (a @ b > 0).float() @ b.detach().T, atol=1e-5)


def test_matmul_and_linear_name_what_to_pass_for_non_tensors():
    """NumPy arrays and lists got a bare AttributeError from the signature key."""
    a, b = torch.randn(4, 8), torch.randn(8, 3)
    with pytest.raises(BadInputError, match="two tensors"):
        autotile.matmul(a.numpy(), b.numpy())
    with pytest.raises(BadInputError, match="bias must be a torch.Tensor"):
        autotile.matmul(a, b, bias=[1.0, 2.0, 3.0])
    with pytest.raises(BadInputError, match="takes tensors"):
        autotile.linear(a.numpy(), b.T)
    with pytest.raises(ShapeMismatchError, match="bias must have shape"):
        autotile.linear(a, b.T, bias=[1.0, 2.0, 3.0])
    with pytest.raises(UnsupportedDtypeError, match=r"gemm kernels take .* got torch.int64"):  # its own dtypes
        autotile.matmul(a.long(), b.long())


def test_explain_without_the_ops_arguments_names_them():
    """A bare TypeError from the op's internals before."""
    with pytest.raises(BadInputError, match=r"takes the arguments autotile.linear takes \(x: .*missing"):
        autotile.explain("linear")
    with pytest.raises(BadInputError, match="autotile.flash_attention takes"):
        autotile.explain("flash_attention", torch.randn(1, 2, 3, 16), causal=True)


def test_a_paged_plan_runs_where_there_is_a_device_to_run_it():
    """Without device=, a plan was made for CUDA even on a machine with none (torch's AssertionError)."""
    from autotile.runtime.paged_plan import plan_paged_attention

    plan = plan_paged_attention(batch=1, num_q_heads=2, num_kv_heads=2, head_dim=32, page_size=16, max_context=64,
                                dtype=torch.float16)
    assert plan.device.type == ("cuda" if torch.cuda.is_available() else "cpu")


def test_linear_with_no_features_is_torchs():
    """No input features (every output its bias) or no output features: F.linear's result; K = 0 raised a bare
    reshape error."""
    x, w, bias = torch.randn(3, 0), torch.randn(5, 0), torch.randn(5)
    assert torch.equal(autotile.linear(x, w, bias, activation="relu"), torch.relu(bias).expand(3, 5))
    assert autotile.linear(torch.randn(2, 3, 4), torch.randn(0, 4)).shape == (2, 3, 0)


def test_a_cache_with_a_page_size_the_ops_do_not_take_is_refused_when_made():
    from autotile.kvcache import PagedKVCache

    with pytest.raises(ShapeMismatchError, match="power of two"):
        PagedKVCache(num_layers=1, num_pages=4, page_size=5, num_kv_heads=2, head_dim=16)


@pytest.mark.parametrize("q_shape, kv_shape", [((0, 4, 6, 32), (0, 2, 9, 32)), ((2, 4, 0, 32), (2, 2, 9, 32)),
                                               ((2, 4, 6, 32), (2, 2, 0, 32))], ids=["batch-0", "no-queries", "no-keys"])
def test_attention_with_an_empty_dimension_is_sdpas(q_shape, kv_shape):
    """SDPA returns an empty tensor for no batch or no queries, and rows of zeros for no keys; the op refused all three.
    LSE is +inf where a row sees no key (the op's convention); gradients are zeros, as SDPA's."""
    q = torch.randn(q_shape, requires_grad=True)
    k, v = (torch.randn(kv_shape, requires_grad=True) for _ in range(2))
    o, lse = autotile.flash_attention(q, k, v, causal=True, return_lse=True)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    assert o.shape == want.shape and torch.equal(o, want)
    assert lse.shape == q_shape[:3] and bool(torch.isposinf(lse).all())
    o.sum().backward()
    assert q.grad.shape == q.shape and not q.grad.any()


def test_attention_with_an_empty_dimension_still_checks_its_tensors():
    k, v = torch.randn(2, 2, 9, 32), torch.randn(2, 2, 9, 16)
    with pytest.raises(ShapeMismatchError, match=r"k \(2, 2, 9, 32\) and v \(2, 2, 9, 16\) must have the same shape"):
        autotile.flash_attention(torch.randn(2, 4, 0, 32), k, v)
    with pytest.raises(ShapeMismatchError, match="Hq must be a multiple of Hkv"):
        autotile.flash_attention(torch.randn(2, 3, 0, 32), k, k)
    with pytest.raises(BadInputError, match="alibi_slopes"):
        autotile.flash_attention(torch.randn(2, 4, 0, 32), k, k, alibi_slopes=torch.ones(3))


def test_matmul_over_an_empty_inner_dimension_is_the_epilogue_of_zeros():
    """torch.matmul over K = 0 gives zeros; with a bias, activation and residual the op's result is act(bias) +
    residual. It raised "GEMM sizes must be >= 1"."""
    a, b = torch.randn(3, 0, requires_grad=True), torch.randn(0, 5)
    bias = (torch.arange(5.0) - 2).requires_grad_(True)
    residual = torch.randn(3, 5)
    assert torch.equal(autotile.matmul(a, b), torch.zeros(3, 5))
    out = autotile.matmul(a, b, bias=bias, activation="gelu", residual=residual)
    want = torch.nn.functional.gelu(bias.detach()).expand(3, 5) + residual
    assert torch.allclose(out, want)
    out.sum().backward()
    assert a.grad.shape == (3, 0)
    assert torch.allclose(bias.grad, 3 * torch.autograd.grad(torch.nn.functional.gelu(bias).sum(), bias)[0])
    assert autotile.matmul(torch.randn(2, 0), torch.randn(0, 3), out_dtype=torch.float16).dtype == torch.float16
    with pytest.raises(ShapeMismatchError, match=r"bias must have shape \(5,\)"):
        autotile.matmul(a, b, bias=torch.ones(4))
    with pytest.raises(ShapeMismatchError, match="residual"):
        autotile.matmul(torch.randn(0, 4), torch.randn(4, 5), residual=torch.ones(1, 5))


def _flash_call(q, k, v):
    return autotile.flash_attention(q, k, v, causal=True)


def _flash_op_call(q, k, v):
    # The registered op's autograd (what torch.compile records), not the eager Function.
    return torch.ops.autotile.flash_attention_fwd(q, k, v, True, 0.25)[0]


def _varlen_call(q, k, v):
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    flat = [t.transpose(1, 2).reshape(8, *t.shape[1:2], 16) for t in (q, k, v)]
    return autotile.flash_attention_varlen(*flat, cu, cu, 5, 5, causal=True)


@pytest.mark.parametrize("call", [_flash_call, _flash_op_call, _varlen_call], ids=["flash", "flash-op", "varlen"])
def test_a_loss_on_attention_gradients_is_refused_not_dropped(call):
    """With create_graph=True the backward's gradients came back as constants: a gradient penalty added to a loss
    trained without its own gradient, silently. The second backward now raises, as SDPA's fused backends do; the
    first, and create_graph without a second backward, work as before."""
    q, k, v = (torch.randn(1, 2, 8, 16, requires_grad=True) for _ in range(3))
    (dq,) = torch.autograd.grad(call(q, k, v).square().sum(), q, create_graph=True)
    assert dq.requires_grad
    penalty = dq.square().sum() + q.sum()
    with pytest.raises(RuntimeError, match="no derivative"):
        penalty.backward()
    (again,) = torch.autograd.grad(call(q, k, v).square().sum(), q)
    assert torch.equal(again, dq.detach())


@pytest.mark.parametrize("activation", ["silu", "gelu"])
def test_matmul_second_derivatives_go_through_the_activation(activation):
    """A gradient penalty on act(a @ b + bias): the backward's activation derivative was a constant, so the second
    derivative missed its part (a wrong gradient, silently)."""
    gen = torch.Generator().manual_seed(5)
    leaves = [torch.randn(shape, generator=gen, dtype=torch.float64) for shape in ((5, 7), (7, 3), (3,))]
    act = {"silu": torch.nn.functional.silu, "gelu": torch.nn.functional.gelu}[activation]

    def penalty_gradients(fn):
        a, b, bias = (t.float().requires_grad_(True) for t in leaves)
        (da,) = torch.autograd.grad(fn(a, b, bias).square().sum(), a, create_graph=True)
        return torch.autograd.grad(da.square().sum(), (a, b, bias))

    got = penalty_gradients(lambda a, b, bias: autotile.matmul(a, b, bias=bias, activation=activation))
    want = penalty_gradients(lambda a, b, bias: act(a @ b + bias))
    for g, w in zip(got, want):
        assert torch.allclose(g, w, rtol=1e-3, atol=1e-4)


def test_linear_and_matmul_under_autocast_run_in_its_dtype_as_torch():
    """An attention block under autocast: the projections come out in autocast's dtype as F.linear's do, so the
    attention's output feeds the next projection (which raised on mixed dtypes before)."""
    torch.manual_seed(0)
    h, w, b = torch.randn(2, 16, 32), torch.randn(48, 32), torch.randn(48)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, want = autotile.linear(h, w, b), torch.nn.functional.linear(h, w, b)
        m, want_m = autotile.matmul(h[0], w.t(), bias=b), torch.addmm(b, h[0], w.t())
        q = y[..., :32].reshape(2, 16, 2, 16).transpose(1, 2)
        o = autotile.flash_attention(q, q, q, causal=True)
        out = autotile.linear(o.transpose(1, 2).reshape(2, 16, 32), w, b)
    assert y.dtype == want.dtype == m.dtype == want_m.dtype == out.dtype == torch.bfloat16
    # The same bf16 operands in both: within two bf16 units of the largest output.
    torch.testing.assert_close(y.float(), want.float(), atol=2 * 2**-8 * want.abs().max().item(), rtol=0)
    torch.testing.assert_close(m.float(), want_m.float(), atol=2 * 2**-8 * want_m.abs().max().item(), rtol=0)
    assert autotile.linear(h, w, b).dtype == torch.float32  # outside autocast, as given


@pytest.mark.parametrize("op", ["decode", "prefill", "explain"])
def test_paged_ops_name_an_argument_that_is_not_a_tensor(op):
    q, cache = torch.randn(2, 4, 64), torch.randn(4, 16, 2, 64)
    table, lengths = torch.zeros(2, 2, dtype=torch.int32), torch.tensor([3, 5], dtype=torch.int32)
    with pytest.raises(BadInputError, match=r"must be a tensor of int32 .* got list"):
        if op == "decode":
            autotile.paged_attention(q, cache, cache, table, [3, 5])
        elif op == "prefill":
            autotile.paged_prefill(q, cache, cache, table, [0, 6, 11], lengths)
        else:
            autotile.explain("paged_attention", q, cache, cache, table, [3, 5])
    with pytest.raises(BadInputError, match="q must be a tensor of the queries"):
        autotile.paged_attention([1.0], cache, cache, table, lengths)


def test_a_prefill_plan_of_negative_tokens_is_refused():
    with pytest.raises(BadInputError, match="num_tokens .* must be >= 0, got -3"):
        autotile.plan_paged_prefill(batch=1, num_tokens=-3, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16,
                                    max_context=64, device="cpu")


def test_messages_name_the_argument_and_what_to_do():
    x, w = torch.randn(4, 8), torch.randn(6, 8)
    with pytest.raises(UnsupportedDtypeError, match="gemm kernels take .* got torch.float64: cast them"):
        autotile.linear(x.double(), w.double())
    with pytest.raises(UnsupportedDtypeError, match="bias is torch.int64 but the output is fp32"):
        autotile.linear(x, w, torch.ones(6, dtype=torch.int64))
    with pytest.raises(ShapeMismatchError, match=r"q must be \(batch, heads, seq, head_dim\) as in SDPA, got shape \(8, 16\)"):
        autotile.flash_attention(torch.randn(8, 16), torch.randn(8, 16), torch.randn(8, 16))


def test_an_unknown_vendor_switch_is_said_once_and_taken_as_on(monkeypatch, caplog):
    from autotile import switches
    from autotile.families import base

    monkeypatch.setattr(switches, "_warned", set())
    monkeypatch.setenv("AUTOTILE_VENDOR", "maybe")
    with caplog.at_level("WARNING", logger="autotile.runtime"):
        assert base.vendor_enabled() and base.vendor_enabled()
    assert caplog.text.count("AUTOTILE_VENDOR='maybe' is neither") == 1
    monkeypatch.setenv("AUTOTILE_VENDOR", "off")
    assert not base.vendor_enabled()


@pytest.mark.parametrize("value, on", [("false", False), ("no", False), ("OFF", False), ("1", True), ("yes", True),
                                       ("none", False), ("2", False), ("", False)])
def test_log_and_checks_switches_read_on_and_off_as_the_vendor_switch_does(value, on, monkeypatch, caplog):
    """AUTOTILE_LOG=false, no or off turned logging on, and a mistyped AUTOTILE_CHECKS (none, 2) turned the GPU's
    debug checks on silently. Both now take one spelling rule; other values stay off and are said once."""
    from autotile import switches
    from autotile.runtime.paged_plan import checks_on

    monkeypatch.setattr(switches, "_warned", set())
    monkeypatch.setenv("AUTOTILE_LOG", value)
    monkeypatch.setenv("AUTOTILE_CHECKS", value)
    with caplog.at_level("WARNING", logger="autotile.runtime"):
        assert switches.switch("AUTOTILE_LOG", False, "") is on
        assert checks_on(torch.device("cuda")) is on
    assert ("is neither on" in caplog.text) == (value in ("none", "2"))


def test_explain_refuses_a_varlen_call_the_op_refuses():
    cu = torch.tensor([0, 16], dtype=torch.int32)
    q = torch.randn(16, 2, 16)
    with pytest.raises(BadInputError, match="longer than max_seqlen_q=4"):
        autotile.explain("flash_attention_varlen", q, q, q, cu, cu, 4, 4)


@pytest.mark.parametrize("call", [_flash_call, _flash_op_call, _varlen_call], ids=["flash", "flash-op", "varlen"])
def test_activation_checkpointing_recomputes_attention_and_gives_its_gradients(call):
    """Non-reentrant checkpointing (torch's recommended kind) recomputes saved tensors on their first read and
    refuses a second: the eager Function read them twice and its backward raised CheckpointError."""
    import torch.utils.checkpoint

    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 2, 8, 16, generator=gen, requires_grad=True) for _ in range(3))
    plain = call(q, k, v)
    do = torch.randn(plain.shape, generator=gen)
    want = torch.autograd.grad(plain, (q, k, v), do)
    out = torch.utils.checkpoint.checkpoint(call, q, k, v, use_reentrant=False)
    for got, expected in zip(torch.autograd.grad(out, (q, k, v), do), want):
        assert torch.allclose(got, expected, atol=1e-6)


def test_torch_func_transforms_differentiate_and_batch_the_ops():
    """vmap and grad of linear and matmul raised 'Cannot access data pointer' (the wrapped tensors have none), and
    grad of flash_attention raised torch's 'must override the setup_context staticmethod' (the custom op's registered
    autograd). Inside a transform the ops now compute in plain torch, every feature included."""
    gen = torch.Generator().manual_seed(11)
    x, w, b = torch.randn(4, 5, 32, generator=gen), torch.randn(24, 32, generator=gen), torch.randn(24, generator=gen)
    f = torch.nn.functional
    got = torch.func.vmap(lambda xx: autotile.linear(xx, w, b, activation="silu"))(x)
    assert torch.allclose(got, f.silu(f.linear(x, w, b)), atol=1e-5)
    got = torch.func.grad(lambda ww: autotile.linear(x, ww, b).square().sum())(w)
    assert torch.allclose(got, torch.func.grad(lambda ww: f.linear(x, ww, b).square().sum())(w), atol=1e-4)
    got = torch.func.vmap(lambda xx: autotile.matmul(xx, w.t(), out_dtype=torch.float16))(x)
    assert got.dtype == torch.float16 and torch.allclose(got.float(), f.linear(x, w), atol=2e-2)
    q, k, v = (torch.randn(1, 2, 9, 16, generator=gen) for _ in range(3))
    slopes = torch.rand(2, generator=gen)

    def attention(qq):
        o, lse = autotile.flash_attention(qq, k, v, causal=True, window=(4, 0), softcap=5.0, alibi_slopes=slopes,
                                          return_lse=True)
        return o.square().sum() + lse.sum()

    leaves = [t.double().requires_grad_(True) for t in (q, k, v)]
    rows, cols = torch.arange(9)[:, None], torch.arange(9)[None, :]
    logits = (leaves[0] @ leaves[1].transpose(-1, -2)) * 0.25
    logits = 5.0 * torch.tanh(logits / 5.0) - slopes.double()[:, None, None] * (rows - cols).abs()
    logits = logits.masked_fill((cols > rows) | (cols < rows - 4), float("-inf"))
    want_o, want_lse = torch.softmax(logits, -1) @ leaves[2], torch.logsumexp(logits, -1)
    (want,) = torch.autograd.grad(want_o.square().sum() + want_lse.sum(), leaves[0])
    got = torch.func.grad(attention)(q)
    assert torch.allclose(got.double(), want, atol=1e-4)
    batched = torch.func.vmap(lambda qq: autotile.flash_attention(qq, k[0], v[0], causal=True))(q)
    assert torch.allclose(batched, torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True), atol=1e-5)
    # Packed sequences (a padding row past the last one: o 0, lse +inf) and fused expressions.
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    pq, pk, pv = (torch.randn(9, 2, 16, generator=gen) for _ in range(3))

    def packed(qq):
        o, lse = autotile.flash_attention_varlen(qq, pk, pv, cu, cu, 5, 5, causal=True, return_lse=True)
        return o.square().sum() + lse[:, :8].sum(), (o, lse)

    leaf = pq.clone().requires_grad_(True)
    loss, (o, lse) = packed(leaf)
    loss.backward()
    got, (o_t, lse_t) = torch.func.grad(packed, has_aux=True)(pq)
    assert torch.allclose(got, leaf.grad, atol=1e-5) and torch.allclose(o_t, o, atol=1e-5)
    assert torch.equal(o_t[8], torch.zeros(2, 16)) and torch.isinf(lse_t[:, 8]).all()
    fused = autotile.fuse("x * sigmoid(y) + 1")
    y = torch.randn(32, generator=gen)
    assert torch.allclose(torch.func.vmap(lambda xx: fused(x=xx, y=y))(x), x * torch.sigmoid(y) + 1, atol=1e-6)
    assert torch.allclose(torch.func.grad(lambda xx: fused(x=xx, y=y).sum())(x), torch.sigmoid(y).expand_as(x))


def test_meta_and_fake_tensors_give_the_outputs_shape_without_a_warning():
    """Meta tensors were refused ('no data to run on') where F.linear and SDPA return meta outputs, and fake tensors
    read their data pointer (torch warns that this will become an error)."""
    import warnings

    from torch._subclasses.fake_tensor import FakeTensorMode

    def calls(device=None):
        x, w, q = (torch.randn(*s, device=device) for s in ((2, 5, 32), (24, 32), (1, 2, 8, 16)))
        return (autotile.linear(x, w), autotile.matmul(x[0], w.t()), autotile.flash_attention(q, q, q, causal=True))

    for out, shape in zip(calls("meta"), ((2, 5, 24), (5, 24), (1, 2, 8, 16))):
        assert out.is_meta and out.shape == shape
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with FakeTensorMode():
            assert [tuple(t.shape) for t in calls()] == [(2, 5, 24), (5, 24), (1, 2, 8, 16)]


def test_a_residual_of_another_dtype_promotes_as_torch_adds_it():
    """A residual of another dtype was rounded into the output's dtype silently: under autocast a block written
    linear(..., residual=x) returned bf16 where F.linear(...) + x gives fp32. It is now added after the kernel, as
    torch's `+` promotes; the family refuses such a residual, so no kernel rounds it."""
    gen = torch.Generator().manual_seed(13)
    x, w, res = torch.randn(3, 16, generator=gen).half(), torch.randn(8, 16, generator=gen).half(), torch.randn(3, 8)
    got = autotile.linear(x, w, residual=res)
    want = torch.nn.functional.linear(x, w) + res
    assert got.dtype == want.dtype == torch.float32 and torch.allclose(got, want, atol=1e-3)
    got = autotile.matmul(x, w.t(), activation="relu", residual=res)
    assert got.dtype == torch.float32 and torch.allclose(got, torch.relu(x @ w.t()) + res, atol=1e-3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = autotile.linear(x.float(), w.float(), residual=res)
        assert torch.nn.functional.linear(x.float(), w.float()).dtype == torch.bfloat16
    # x @ w.T of the bf16-cast operands rounded to bf16 (half a step, 2**-8 of its size), plus the fp32 residual.
    product = x.bfloat16().double() @ w.bfloat16().double().T
    assert got.dtype == torch.float32
    assert ((got.double() - (product + res.double())).abs() <= 2**-8 * product.abs() + 1e-5).all()
    with pytest.raises(ShapeMismatchError, match="residual"):
        autotile.linear(x, w, residual=res[:1])
    assert autotile.explain("linear", x, w, residual=res)["problem"]["residual"] is False
    from autotile.families.gemm import FAMILY

    with pytest.raises(UnsupportedDtypeError, match="residual"):
        FAMILY.problem_from_tensors(x, w.t(), residual=res)


def test_explain_describes_the_call_the_op_runs_under_autocast_and_with_an_empty_dimension():
    """explain reported an fp32 problem under autocast where the call runs bf16, and refused calls with an empty
    dimension ('sizes must be >= 1') that the ops answer with torch's result."""
    x, w, q = torch.randn(3, 64), torch.randn(24, 64), torch.randn(1, 2, 8, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert autotile.linear(x, w).dtype == torch.bfloat16
        for op, args in (("linear", (x, w)), ("matmul", (x, w.t())), ("flash_attention", (q, q, q))):
            assert autotile.explain(op, *args)["problem"]["dtype"] == "bf16", op
    for op, args in (("linear", (torch.randn(0, 64), w)), ("matmul", (torch.randn(5, 64), torch.randn(64, 0))),
                     ("flash_attention", (q, q[:, :, :0], q[:, :, :0]))):
        info = autotile.explain(op, *args)
        assert info["source"] == "empty" and info["config"] is None, op
    with pytest.raises(ShapeMismatchError, match="in_features"):
        autotile.explain("linear", torch.randn(0, 63), w)


def test_bf16_results_on_the_cpu_round_to_nearest_as_on_a_gpu():
    """Triton's interpreter truncated every fp32 -> bf16 store: linear's errors reached a whole unit in the last place,
    biased toward zero (torch: half a unit, unbiased), and attention's were twice SDPA's."""
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(64, 64, generator=gen).bfloat16(), torch.randn(96, 64, generator=gen).bfloat16()
    exact = x.double() @ w.double().T
    unit = 2.0 ** (torch.floor(torch.log2(exact.abs())) - 7)
    error = (autotile.linear(x, w).double() - exact) / unit
    assert error.abs().max() <= 0.5 + 1e-3 and abs((error * exact.sign()).mean()) < 0.05
    q, k, v = (torch.randn(2, 2, 64, 64, generator=gen).bfloat16() for _ in range(3))
    exact = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
    ours = (autotile.flash_attention(q, k, v, causal=True).double() - exact).abs().max()
    theirs = (torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).double() - exact).abs().max()
    assert ours <= 1.25 * theirs, (ours, theirs)


def test_linear_takes_the_biases_f_linear_broadcasts_over_the_features():
    """A (1, N), (1,), (1, 1) or single-value bias, which F.linear broadcasts, was refused ('bias must have shape
    (N,)'); each now serves as the (N,) bias, gradients included. Others are still refused, as F.linear refuses."""
    gen = torch.Generator().manual_seed(17)
    x, w = torch.randn(2, 3, 24, generator=gen), torch.randn(10, 24, generator=gen)
    for shape in ((1, 10), (1,), (1, 1), ()):
        bias = torch.randn(shape, generator=gen, requires_grad=True)
        got, want = autotile.linear(x, w, bias), torch.nn.functional.linear(x, w, bias)
        assert torch.allclose(got, want, atol=1e-5), shape
        (g,), (g_want,) = torch.autograd.grad(got.sum(), bias), torch.autograd.grad(want.sum(), bias)
        assert g.shape == bias.shape and torch.allclose(g, g_want, atol=1e-4), shape
    with pytest.raises(ShapeMismatchError, match=r"bias must have shape \(10,\), got \(6, 10\)"):
        autotile.linear(x, w, torch.randn(6, 10))


@pytest.mark.parametrize("a_shape, w_shape", [((0, 5), (3, 5)), ((2, 0), (3, 0)), ((2, 5), (0, 5))])
def test_an_unknown_activation_is_refused_on_empty_calls_too(a_shape, w_shape):
    # Empty calls never build a problem (whose check refuses the name): they used to raise a bare KeyError.
    x, w = torch.randn(a_shape), torch.randn(w_shape)
    with pytest.raises(BadInputError, match="activation must be one of"):
        autotile.linear(x, w, activation="tanh")
    with pytest.raises(BadInputError, match="activation must be one of"):
        autotile.matmul(x, w.t(), activation="tanh")


@pytest.mark.parametrize("out_dtype", [torch.int32, torch.float64])
def test_an_output_dtype_the_kernels_do_not_write_is_refused_naming_those_they_do(out_dtype):
    # The message listed every dtype autotile knows (fp64 and fp8 among them), which the outputs then refused.
    with pytest.raises(UnsupportedDtypeError, match=r"out_dtype must be one of \('fp32', 'fp16', 'bf16'\)"):
        autotile.matmul(torch.randn(2, 5), torch.randn(5, 3), out_dtype=out_dtype)


@pytest.mark.parametrize("name, value, advice", [
    ("is_causal", True, "pass causal=True"), ("softmax_scale", 0.1, "pass scale="),
    ("window_size", (3, 0), r"pass window=\(left, right\)"), ("attn_mask", None, "arbitrary masks are not served"),
    ("dropout_p", 0.1, "dropout is not served"), ("foo", 1, "unexpected keyword argument 'foo'")])
def test_sdpa_and_flash_attn_arguments_get_what_to_pass_instead(name, value, advice):
    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    with pytest.raises(BadInputError, match=advice):
        autotile.flash_attention(q, k, v, **{name: value})
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(BadInputError, match=advice):
        autotile.flash_attention_varlen(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), cu, cu,
                                        8, 8, **{name: value})
    # What changes nothing is let through, as SDPA users pass it.
    torch.testing.assert_close(autotile.flash_attention(q, k, v, dropout_p=0.0, enable_gqa=True),
                               autotile.flash_attention(q, k, v))


def test_a_tensor_scale_is_read_by_value_and_refused_where_it_wants_a_gradient():
    from autotile.runtime import ops_flash

    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    with pytest.raises(BadInputError, match="requires grad"):
        autotile.flash_attention(q, k, v, scale=torch.tensor(0.3, requires_grad=True))
    with pytest.raises(BadInputError, match="requires grad"):
        autotile.flash_attention(q, k, v, softcap=torch.nn.Parameter(torch.tensor(5.0)))
    want = autotile.flash_attention(q, k, v, scale=torch.tensor(0.3))
    kept = len(ops_flash._calls)
    for _ in range(5):  # each a new tensor: keyed by value, not by the object
        torch.testing.assert_close(autotile.flash_attention(q, k, v, scale=torch.tensor(0.3)), want)
    assert len(ops_flash._calls) == kept
    with pytest.raises(BadInputError, match="softcap must be a finite number"):
        autotile.flash_attention(q, k, v, softcap="50")


def test_varlen_lengths_are_checked_where_torch_compile_traces_the_call():
    # Traced, the call skips its own check (max_seqlen may be symbolic); the op checks the real lengths.
    cu = torch.tensor([0, 70, 75], dtype=torch.int32)
    q, k, v = (torch.randn(75, 2, 16) for _ in range(3))
    compiled = torch.compile(lambda q, k, v, cu: autotile.flash_attention_varlen(q, k, v, cu, cu, 8, 8, causal=True),
                             backend="eager", fullgraph=True)
    with pytest.raises(BadInputError, match="longer than max_seqlen_q=8"):
        compiled(q, k, v, cu)
