"""SDPA's backends as the flash family's vendor configs, and how the op serves each call signature.

On the CPU only SDPA's math backend runs, and the family lists no vendor config under the
interpreter; the serving tests list sdpa-math for CPU problems (monkeypatched) to run the whole
vendor path: resolve, explain, the op's forward, SDPA's own backward, our backward beside SDPA's
forward, AUTOTILE_VENDOR=0. The fused backends, CUDA-graph capture and sync-freedom run in the
gpu-marked tests at the end.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

import autotile
from autotile.device import DeviceInfo, interpret_device
from autotile.errors import ConfigOutsideSpaceError
from autotile.families import flash_vendor
from autotile.families.base import VENDOR_KEY
from autotile.families.flash import FAMILY, FlashProblem
from autotile.families.flash_reference import attention_grads, attention_math, log2_sum_exp
from autotile.layouts import matching_strides
from autotile.runtime import dispatch, fallback, ops_flash
from autotile.space import Config

INTERPRET = interpret_device()
H200 = DeviceInfo("h200", "NVIDIA H200", (9, 0), 132, 150_000_000_000, 232448, "test")
MATH = Config({VENDOR_KEY: "sdpa-math"})


def test_which_backends_compute_the_problem_as_defined():
    plain = FlashProblem("fwd", 2, 32, 8, 1000, 1000, 128, causal=True, dtype="bf16")
    assert [b for b in flash_vendor.BACKENDS if flash_vendor.expresses(b, plain)] == list(flash_vendor.BACKENDS[:2]) + [
        "sdpa-math"]  # GQA: the memory-efficient kernel takes one key/value head per query head
    # Causal with Sq != Sk: cuDNN's and the efficient kernel's causal masks are top-left; FlashAttention-2's
    # op is bottom-right (and gives 0 for rows that see no key), as is the math backend's additive mask.
    for sq, sk in ((300, 1000), (1000, 300)):
        p = dataclasses.replace(plain, seq_q=sq, seq_k=sk, heads_kv=32)
        assert [b for b in flash_vendor.BACKENDS if flash_vendor.expresses(b, p)] == ["sdpa-flash", "sdpa-math"]
    full = dataclasses.replace(plain, causal=False, seq_q=300, heads_kv=32)
    assert [b for b in flash_vendor.BACKENDS if flash_vendor.expresses(b, full)] == list(flash_vendor.BACKENDS)
    fp32 = dataclasses.replace(plain, dtype="fp32")
    assert [b for b in flash_vendor.BACKENDS if flash_vendor.expresses(b, fp32)] == ["sdpa-math"]
    odd_head = dataclasses.replace(plain, head_dim=100)  # fused kernels want multiples of 8 (SDPA pads with a copy)
    assert [b for b in flash_vendor.BACKENDS if flash_vendor.expresses(b, odd_head)] == ["sdpa-math"]


@pytest.mark.parametrize("change", [dict(window_left=16), dict(softcap=30.0), dict(alibi=True), dict(varlen=True),
                                    dict(dtype="fp8")])
def test_no_vendor_for_what_sdpa_cannot_express(change):
    problem = dataclasses.replace(FlashProblem("fwd", 2, 8, 8, 512, 512, 64, causal=True, dtype="bf16"), **change)
    assert flash_vendor.backends_for(problem, H200) == []


def test_no_vendor_under_the_interpreter():
    assert FAMILY.vendor_configs(FlashProblem("fwd", 1, 2, 2, 64, 64, 64, dtype="fp16"), INTERPRET) == []


def test_vendor_configs_are_ordered_and_validated(monkeypatch):
    monkeypatch.setattr(flash_vendor, "_torch_allows", lambda backend, problem, index: True)
    problem = FlashProblem("fwd", 2, 32, 32, 4096, 4096, 128, causal=True, dtype="bf16")
    configs = FAMILY.vendor_configs(problem, H200)
    assert [c[VENDOR_KEY] for c in configs] == ["sdpa-cudnn", "sdpa-flash", "sdpa-efficient", "sdpa-math"]
    assert FAMILY.validate_config(problem, H200, configs[0]) == configs[0]
    skewed = dataclasses.replace(problem, seq_q=1000)
    with pytest.raises(ConfigOutsideSpaceError, match="not a vendor op"):
        FAMILY.validate_config(skewed, H200, configs[0])  # cuDNN's causal mask is top-left: not this problem's


def test_problem_keys_of_plain_problems_are_unchanged():
    # Stored winners are keyed by these strings; the feature fields are left out at their "off" values.
    problem = FlashProblem("fwd", 2, 32, 32, 4096, 4096, 128, True, "bf16", True)
    assert FAMILY.problem_key(problem) == ('{"aligned":true,"batch":2,"causal":true,"direction":"fwd","dtype":"bf16",'
                                           '"head_dim":128,"heads_kv":32,"heads_q":32,"seq_k":4096,"seq_q":4096}')
    windowed = dataclasses.replace(problem, window_left=256)
    assert '"window_left":256' in FAMILY.problem_key(windowed)
    assert FAMILY.problem_from_dict(dataclasses.asdict(windowed)) == windowed


def test_serving_range_spans_batch_and_lengths():
    problem = FlashProblem("fwd", 4, 32, 8, 2000, 2000, 128, causal=True)
    assert FAMILY.serving_range(problem) == {"batch": (3, 4), "seq_q": (1025, 2048), "seq_k": (1025, 2048)}
    other = dataclasses.replace(problem, batch=3, seq_q=1500, seq_k=1500, aligned=False)
    assert FAMILY.in_range(other, problem, {"batch": [3, 4], "seq_q": [1025, 2048], "seq_k": [1025, 2048]})
    assert not FAMILY.in_range(dataclasses.replace(other, head_dim=64), problem,
                               {"batch": [3, 4], "seq_q": [1025, 2048], "seq_k": [1025, 2048]})


def test_a_vendor_backward_is_timed_without_its_forward(monkeypatch):
    """The generated backward is given O and LSE; the vendor's is timed alike: its forward runs once, when the
    timed call is made, and each timed run is the backward alone (through the kept graph)."""
    forwards = []
    plain = flash_vendor.forward

    def counting_forward(*args, **kwargs):
        forwards.append(1)
        return plain(*args, **kwargs)

    monkeypatch.setattr(flash_vendor, "forward", counting_forward)
    problem = FlashProblem("bwd", 1, 2, 1, 48, 40, 32, causal=False, dtype="fp32")
    inputs = FAMILY.make_inputs(problem, INTERPRET)
    run = FAMILY.timed_call(problem, MATH, inputs, FAMILY.allocate_outputs(problem, inputs))
    assert len(forwards) == 1
    grads = [run() for _ in range(3)]
    assert len(forwards) == 1  # no forward in the timed runs
    want = flash_vendor.backward("sdpa-math", inputs["do"], inputs["q"], inputs["k"], inputs["v"], inputs["o"],
                                 inputs["lse"], causal=False, scale=problem.head_dim ** -0.5)
    for got in grads:
        for g, w in zip(got, want):
            assert torch.allclose(g, w, atol=1e-5, rtol=1e-5)


def test_cudnns_backward_gets_its_lse_o_and_do_as_sdpas_own_backward_does(monkeypatch):
    """flash_vendor._cudnn_backward's arguments, with ATen's op stood in for on the CPU: the family's log2 LSE
    (B, H, Sq) goes as cuDNN's forward leaves its own, natural-log (B, H, Sq, 1); O goes in q's layout, as cuDNN's
    forward leaves its own; dO always laid out like O (torch caches the graph by q, k and v, and a second call whose
    dO is laid out otherwise gets wrong gradients). Where torch's op refuses them, the backward says so once and
    runs the forward again."""
    seen = {}

    def fake_backward(do, q, k, v, o, lse, seed, offset, bias, cum_q, cum_k, max_q, max_k, dropout, causal, scale):
        seen.update(do=do, o=o, lse=lse, bias=bias, cum=(cum_q, cum_k), lengths=(max_q, max_k), dropout=dropout,
                    causal=causal, scale=scale)
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), "extra"

    monkeypatch.setattr(flash_vendor, "CUDNN_BACKWARD_ON_GIVEN_LSE", True)
    monkeypatch.setattr(flash_vendor, "_cudnn_direct_ok", {})
    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention_backward", fake_backward)
    q = torch.randn(2, 4, 5, 8)
    k = v = torch.randn(2, 2, 7, 8)
    o = torch.randn(2, 5, 4, 8).transpose(1, 2)  # (B, S, H, D) memory
    do, lse = torch.randn(2, 4, 5, 8), torch.randn(2, 4, 5)
    grads = flash_vendor.backward(flash_vendor.CUDNN, do, q, k, v, o, lse, causal=True, scale=0.3)
    assert len(grads) == 3 and grads[1].shape == k.shape
    assert seen["lse"].shape == (2, 4, 5, 1) and seen["lse"].is_contiguous()
    assert torch.allclose(seen["lse"][..., 0], lse * flash_vendor.LN2)
    assert seen["o"].stride() == q.stride() and torch.equal(seen["o"], o)
    assert seen["do"] is do
    # q laid out (B, S, H, D) in memory: O follows it, and dO follows O whatever its own layout
    q_bshd = torch.randn(2, 5, 4, 8).transpose(1, 2)
    do_bshd = torch.randn(2, 5, 4, 8).transpose(1, 2)
    flash_vendor.backward(flash_vendor.CUDNN, do_bshd, q_bshd, k, v, o.contiguous(), lse, causal=True, scale=0.3)
    assert seen["o"].stride() == q_bshd.stride() and torch.equal(seen["o"], o)
    assert seen["do"] is do_bshd
    for other in (do, torch.randn(2, 4, 8, 5).transpose(2, 3)):  # heads-major; innermost stride not 1
        flash_vendor.backward(flash_vendor.CUDNN, other, q_bshd, k, v, o, lse, causal=True, scale=0.3)
        assert seen["do"].stride() == q_bshd.stride() and torch.equal(seen["do"], other)
    # q a slice of a fused QKV projection (not dense): O and dO dense in q's dimension order, as the op writes O
    q_slice = torch.randn(2, 5, 3, 4, 8)[:, :, 0].transpose(1, 2)
    flash_vendor.backward(flash_vendor.CUDNN, do, q_slice, k, v, o.contiguous(), lse, causal=True, scale=0.3)
    assert seen["o"].stride() == seen["do"].stride() == matching_strides(q_slice) == q_bshd.stride()
    assert torch.equal(seen["o"], o) and torch.equal(seen["do"], do)
    assert seen["bias"] is None and seen["cum"] == (None, None) and seen["lengths"] == (5, 7)
    assert (seen["dropout"], seen["causal"], seen["scale"]) == (0.0, True, 0.3)

    def refusing(*args, **kwargs):
        raise RuntimeError("cuDNN SDPA backward: bad arguments")

    forwards = []
    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention_backward", refusing)
    monkeypatch.setattr(flash_vendor, "forward", lambda backend, q, k, v, **kw: forwards.append(1) or (
        q + (k.sum() + v.sum()) * 0, None))
    with pytest.warns(RuntimeWarning, match="refused the forward's O and LSE"):
        flash_vendor.backward(flash_vendor.CUDNN, do, q, k, v, o, lse, causal=True, scale=0.3)
    flash_vendor.backward(flash_vendor.CUDNN, do, q, k, v, o, lse, causal=True, scale=0.3)  # no second warning
    assert len(forwards) == 2 and flash_vendor._cudnn_direct_ok == {q.device: False}


# --- serving through the op, with sdpa-math standing in for SDPA on the CPU --------------------------
@pytest.fixture
def math_vendor(monkeypatch):
    """List SDPA's math backend for plain CPU problems, as the fused backends are listed on a GPU."""
    monkeypatch.setattr(flash_vendor, "backends_for",
                        lambda p, d: [] if p.dtype == "fp8" or p.varlen or p.has_features else ["sdpa-math"])
    monkeypatch.delenv("AUTOTILE_VENDOR", raising=False)
    dispatch.clear_cache()
    yield
    dispatch.clear_cache()


def _qkv(gen, b, hq, hkv, sq, sk, d, dtype=torch.float32, grad=False):
    shapes = ((b, hq, sq, d), (b, hkv, sk, d), (b, hkv, sk, d))
    return [torch.randn(s, generator=gen, dtype=dtype).requires_grad_(grad) for s in shapes]


def test_untuned_shapes_are_served_by_the_vendor_and_explained(math_vendor):
    gen = torch.Generator().manual_seed(0)
    q, k, v = _qkv(gen, 1, 4, 2, 9, 14, 16)
    info = autotile.explain("flash_attention", q, k, v, causal=True)
    assert info["config"] == {VENDOR_KEY: "sdpa-math"} and info["source"] == "vendor"
    out = autotile.flash_attention(q, k, v, causal=True)
    want = attention_math(q.double(), k.double(), v.double(), causal=True, scale=0.25, dtype=torch.float64)
    assert (out.double() - want).abs().max() < 1e-5


def test_vendor_off_serves_the_generated_kernel(math_vendor, monkeypatch):
    monkeypatch.setenv("AUTOTILE_VENDOR", "0")
    dispatch.clear_cache()
    q, k, v = _qkv(torch.Generator().manual_seed(0), 1, 2, 2, 9, 9, 16)
    info = autotile.explain("flash_attention", q, k, v)
    assert info["source"] == "default" and VENDOR_KEY not in info["config"]
    calls = []
    monkeypatch.setattr(flash_vendor, "forward", lambda *a, **kw: calls.append(a))
    out = autotile.flash_attention(q, k, v)
    assert not calls and torch.isfinite(out).all()


def test_training_through_the_vendor_uses_sdpas_backward(math_vendor, monkeypatch):
    gen = torch.Generator().manual_seed(1)
    q, k, v = _qkv(gen, 2, 4, 1, 11, 7, 16, grad=True)  # MQA, Sq > Sk: rows that see no key
    kernels = []
    monkeypatch.setattr(ops_flash, "serve_backward", lambda *a, **kw: kernels.append(a))
    out = autotile.flash_attention(q, k, v, causal=True)
    do = torch.randn(out.shape, generator=gen)
    got = torch.autograd.grad(out, (q, k, v), do)
    assert not kernels  # SDPA's own autograd ran, not the family's backward
    want = attention_grads(*(t.detach().double() for t in (q, k, v)), do.double(), causal=True, scale=0.25,
                           dtype=torch.float64)
    for g, w in zip(got, want):
        assert (g.double() - w).abs().max() < 1e-5


def test_our_backward_beside_the_vendors_forward(math_vendor):
    # return_lse goes through the custom op: SDPA (math) serves the forward and its log-sum-exp, the
    # backward problem is served on its own (here the vendor again, but with dlse: the generated kernel).
    gen = torch.Generator().manual_seed(2)
    q, k, v = _qkv(gen, 1, 2, 2, 13, 10, 16, grad=True)
    out, lse = autotile.flash_attention(q, k, v, causal=True, return_lse=True)
    want_lse = log2_sum_exp(q.detach().double(), k.detach().double(), causal=True, scale=0.25) * 0.6931471805599453
    seen = torch.isfinite(want_lse)
    assert torch.allclose(lse[seen].double(), want_lse[seen], atol=1e-5) and torch.isinf(lse[~seen]).all()
    do = torch.randn(out.shape, generator=gen)
    got = torch.autograd.grad(out, (q, k, v), do)  # no lse gradient: the vendor's backward may serve it
    want = attention_grads(*(t.detach().double() for t in (q, k, v)), do.double(), causal=True, scale=0.25,
                           dtype=torch.float64)
    for g, w in zip(got, want):
        assert (g.double() - w).abs().max() < 1e-5


def test_an_untuned_backward_takes_the_gluon_backward_before_sdpas(monkeypatch):
    """ops_flash.gluon_before_vendor: where SDPA's backward of a forward it did not run would recompute that forward
    (or is FlashAttention-2's), the Gluon backward beats it; a stored winner, a fallback after a failure,
    deterministic mode and head dims the Gluon backward does not take keep the vendor op."""
    monkeypatch.setattr(flash_vendor, "CUDNN_BACKWARD_ON_GIVEN_LSE", False)
    problem = FlashProblem("bwd", 1, 32, 8, 4096, 4096, 128, causal=True, dtype="bf16")
    key = FAMILY.problem_key(problem)
    untuned = dispatch.Resolution(Config({VENDOR_KEY: "sdpa-cudnn"}), "vendor", H200.key, key, None, "vendor")
    assert ops_flash.gluon_before_vendor(problem, H200, untuned)
    flash_untuned = dataclasses.replace(untuned, config=Config({VENDOR_KEY: "sdpa-flash"}))
    assert ops_flash.gluon_before_vendor(problem, H200, flash_untuned)
    assert not ops_flash.gluon_before_vendor(problem, H200, dataclasses.replace(untuned, match="fallback"))
    stored = dataclasses.replace(untuned, source="user-db", tuned_for=key, match="exact")
    assert not ops_flash.gluon_before_vendor(problem, H200, stored)
    assert not ops_flash.gluon_before_vendor(dataclasses.replace(problem, head_dim=256), H200, untuned)
    assert not ops_flash.gluon_before_vendor(problem, INTERPRET, untuned)  # the CPU's default is the Triton one
    torch.use_deterministic_algorithms(True)
    try:
        assert not ops_flash.gluon_before_vendor(problem, H200, untuned)
    finally:
        torch.use_deterministic_algorithms(False)


def test_an_untuned_backward_takes_cudnns_on_the_given_lse_first(monkeypatch):
    """ops_flash.gluon_before_vendor: cuDNN's backward on the given O and LSE runs at its own speed and serves an
    untuned backward before the Gluon one, until torch's op refused those arguments on the device."""
    monkeypatch.setattr(flash_vendor, "CUDNN_BACKWARD_ON_GIVEN_LSE", True)
    monkeypatch.setattr(flash_vendor, "_cudnn_direct_ok", {})
    problem = FlashProblem("bwd", 1, 32, 8, 4096, 4096, 128, causal=True, dtype="bf16")
    untuned = dispatch.Resolution(Config({VENDOR_KEY: "sdpa-cudnn"}), "vendor", H200.key, FAMILY.problem_key(problem),
                                  None, "vendor")
    assert not ops_flash.gluon_before_vendor(problem, H200, untuned)
    # FlashAttention-2's backward takes the given LSE too, but the Gluon backward beats it.
    assert ops_flash.gluon_before_vendor(problem, H200, dataclasses.replace(untuned, config=Config({VENDOR_KEY:
                                                                                                    "sdpa-flash"})))
    flash_vendor._cudnn_direct_ok[torch.device(H200.torch_device)] = False
    assert ops_flash.gluon_before_vendor(problem, H200, untuned)


@pytest.mark.parametrize("gluon_first", [False, True])
def test_the_backward_of_a_generated_forward_skips_the_vendor_where_gluon_comes_first(monkeypatch, gluon_first):
    # The forward has no vendor op here (the generated kernel serves it); the backward lists sdpa-math and is served
    # by it, unless gluon_before_vendor holds (as on Hopper), when the family's kernel serves; both match float64.
    monkeypatch.setattr(flash_vendor, "backends_for", lambda p, d: ["sdpa-math"] if p.direction == "bwd" else [])
    monkeypatch.delenv("AUTOTILE_VENDOR", raising=False)
    monkeypatch.setattr(ops_flash, "gluon_before_vendor", lambda problem, device, resolution: gluon_first)
    dispatch.clear_cache()  # and the op's kept runners
    vendor_backwards = []
    plain = flash_vendor.backward
    monkeypatch.setattr(flash_vendor, "backward", lambda *a, **kw: vendor_backwards.append(a) or plain(*a, **kw))
    gen = torch.Generator().manual_seed(5)
    q, k, v = _qkv(gen, 1, 4, 2, 13, 10, 16, grad=True)
    try:
        out = autotile.flash_attention(q, k, v, causal=True)
        do = torch.randn(out.shape, generator=gen)
        got = torch.autograd.grad(out, (q, k, v), do)
    finally:
        dispatch.clear_cache()
    assert bool(vendor_backwards) != gluon_first
    want = attention_grads(*(t.detach().double() for t in (q, k, v)), do.double(), causal=True, scale=0.25,
                           dtype=torch.float64)
    for g, w in zip(got, want):
        assert (g.double() - w).abs().max() < 1e-5


def _save_forward_winner(url: str, problem) -> None:
    from autotile.store.db import open_engine
    from autotile.store.repo import Store

    config = FAMILY.default_config(problem, INTERPRET)
    store = Store(open_engine(url, create=True))
    store.save_winner(problem_id=store.ensure_problem(FAMILY, problem), device=INTERPRET,
                      device_id=store.ensure_device(INTERPRET), toolchain_id=store.ensure_toolchain(),
                      config=config.to_json(), config_hash=config.hash, median_ms=1.0, q20_ms=1.0, q80_ms=1.0,
                      interpreted=1, provenance="test", verified_range=None, kernel_config=None, baseline_ms=None)


def _forward_winner_and_math_vendor(tmp_path, monkeypatch, q, k, v) -> None:
    """A user database whose forward winner for (q, k, v, causal) is a generated kernel, no shipped database, and
    sdpa-math standing in for SDPA's backends (the interpreter has none)."""
    monkeypatch.setattr(flash_vendor, "backends_for",
                        lambda p, d: [] if p.dtype == "fp8" or p.varlen or p.has_features else ["sdpa-math"])
    url = f"sqlite:///{tmp_path / 'user.sqlite'}"
    monkeypatch.setenv("AUTOTILE_DB", url)
    monkeypatch.setattr("autotile.resources.shipped_db_path", lambda: tmp_path / "no-shipped.sqlite")
    monkeypatch.delenv("AUTOTILE_VENDOR", raising=False)
    _save_forward_winner(url, FAMILY.problem_from_tensors(q, k, v, causal=True))


def test_a_training_call_whose_backward_would_be_sdpas_runs_sdpas_pair(tmp_path, monkeypatch):
    """ops_flash.sdpa_training_pair: a stored forward winner (a generated kernel) and an untuned backward that SDPA
    would serve by running its forward again (sdpa-math stands in): calls needing gradients run SDPA's own forward
    and backward; calls without keep the winner; with AUTOTILE_VENDOR=0 the family's backward serves."""
    gen = torch.Generator().manual_seed(6)
    q, k, v = _qkv(gen, 1, 4, 2, 12, 12, 16, grad=True)
    _forward_winner_and_math_vendor(tmp_path, monkeypatch, q, k, v)
    sdpa_calls, backwards = [], []
    sdpa = ops_flash._sdpa
    monkeypatch.setattr(ops_flash, "_sdpa", lambda *a, **kw: sdpa_calls.append(kw) or sdpa(*a, **kw))
    serve = ops_flash.serve_backward
    monkeypatch.setattr(ops_flash, "serve_backward", lambda *a: backwards.append(a) or serve(*a))
    dispatch.clear_cache()
    try:
        info = autotile.explain("flash_attention", q, k, v, causal=True)
        assert info["source"] == "user-db" and info["vendor"] is None
        do = torch.randn(q.shape, generator=gen)
        want = attention_grads(*(t.detach().double() for t in (q, k, v)), do.double(), causal=True, scale=0.25,
                               dtype=torch.float64)
        got = torch.autograd.grad(autotile.flash_attention(q, k, v, causal=True), (q, k, v), do)
        assert len(sdpa_calls) == 1 and not backwards  # SDPA's pair: its own autograd
        for g, w in zip(got, want):
            assert (g.double() - w).abs().max() < 1e-5
        with torch.no_grad():
            autotile.flash_attention(q, k, v, causal=True)
        assert len(sdpa_calls) == 1  # no gradients: the stored winner
        monkeypatch.setenv("AUTOTILE_VENDOR", "0")
        dispatch.clear_cache()
        got = torch.autograd.grad(autotile.flash_attention(q, k, v, causal=True), (q, k, v), do)
        assert len(sdpa_calls) == 1 and backwards  # the family's forward and backward
        for g, w in zip(got, want):
            assert (g.double() - w).abs().max() < 1e-5
    finally:
        dispatch.clear_cache()


def test_a_host_bound_training_step_runs_sdpas_pair_even_where_its_backward_takes_o_and_lse(tmp_path, monkeypatch):
    """ops_flash.HOST_BOUND_STEP_FLOPS: where SDPA's backward would run on a generated forward's O and LSE (cuDNN's
    under CUDNN_BACKWARD_ON_GIVEN_LSE; sdpa-math stands in), a step with less forward work than the threshold runs
    SDPA's own pair, and a larger one the generated forward with the vendor's backward on its O and LSE."""
    monkeypatch.setattr(flash_vendor, "backward_takes_given_lse", lambda backend, device: True)
    gen = torch.Generator().manual_seed(8)
    q, k, v = _qkv(gen, 2, 4, 2, 12, 12, 16, grad=True)
    work = FAMILY.cost(FAMILY.problem_from_tensors(q, k, v, causal=True)).flops
    _forward_winner_and_math_vendor(tmp_path, monkeypatch, q, k, v)
    sdpa_calls, vendor_backwards = [], []
    sdpa = ops_flash._sdpa
    monkeypatch.setattr(ops_flash, "_sdpa", lambda *a, **kw: sdpa_calls.append(kw) or sdpa(*a, **kw))
    backward = flash_vendor.backward
    monkeypatch.setattr(flash_vendor, "backward", lambda *a, **kw: vendor_backwards.append(a[0]) or backward(*a, **kw))
    do = torch.randn(q.shape, generator=gen)
    want = attention_grads(*(t.detach().double() for t in (q, k, v)), do.double(), causal=True, scale=0.25,
                           dtype=torch.float64)
    try:
        for threshold, pair in ((work + 1, True), (work, False)):
            monkeypatch.setattr(ops_flash, "HOST_BOUND_STEP_FLOPS", threshold)
            dispatch.clear_cache()
            sdpa_calls.clear(), vendor_backwards.clear()
            got = torch.autograd.grad(autotile.flash_attention(q, k, v, causal=True), (q, k, v), do)
            assert (len(sdpa_calls), vendor_backwards) == ((1, []) if pair else (0, ["sdpa-math"])), threshold
            for g, w in zip(got, want):
                assert (g.double() - w).abs().max() < 1e-5
    finally:
        dispatch.clear_cache()


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_vendor_run_passes_the_family_check(direction):
    # The tuner checks a vendor config like any candidate: outputs (and the forward's log-sum-exp) vs float64.
    problem = FlashProblem(direction, 1, 4, 2, 19, 33, 16, causal=True, dtype="fp32")
    inputs = FAMILY.make_inputs(problem, INTERPRET)
    outputs = FAMILY.allocate_outputs(problem, inputs)
    FAMILY.run_config(problem, MATH, inputs, outputs)
    result = FAMILY.check(problem, inputs, outputs, FAMILY.reference(problem, inputs))
    assert result.ok, result.message
    FAMILY.timed_call(problem, MATH, inputs, outputs)()


def test_a_cached_call_repeats_no_resolution(monkeypatch):
    dispatch.clear_cache()
    q, k, v = _qkv(torch.Generator().manual_seed(3), 1, 2, 2, 5, 5, 16)
    autotile.flash_attention(q, k, v)
    resolved, real = [], fallback.resolve  # ops resolve through fallback.usable
    monkeypatch.setattr(fallback, "resolve", lambda *a: resolved.append(a) or real(*a))
    for _ in range(3):
        autotile.flash_attention(q, k, v)
    assert not resolved
    autotile.flash_attention(q, k, v, scale=0.3)  # a new signature is resolved once
    autotile.flash_attention(q, k, v, scale=0.3)
    assert len(resolved) == 1


def test_a_signature_sdpa_serves_skips_to_it_by_shapes(math_vendor, monkeypatch):
    # Short vendor-served calls are bound by host time: after the first call of a signature, SDPA runs behind a
    # key of shapes and dtypes, with the call counted for AUTOTILE_RECORD.
    # On the CPU, SDPA left to choose runs its own CPU kernel rather than the math backend listed here: both are
    # right, and the test is about the dispatch, so SDPA's choice counts as the listed backend.
    monkeypatch.setattr(ops_flash, "_sdpa_picks", lambda *a: True)
    gen = torch.Generator().manual_seed(4)
    q, k, v = _qkv(gen, 1, 4, 2, 9, 9, 16)
    first = autotile.flash_attention(q, k, v, causal=True)
    keys = []
    real_key = ops_flash._call_key
    monkeypatch.setattr(ops_flash, "_call_key", lambda *a: keys.append(a) or real_key(*a))
    (entry,) = ops_flash._sdpa_direct.values()
    before = entry[0][0]
    q2, k2, v2 = _qkv(gen, 1, 4, 2, 9, 9, 16)
    again = autotile.flash_attention(q2, k2, v2, causal=True)
    assert not keys and entry[0][0] == before + 1
    want = attention_math(q2.double(), k2.double(), v2.double(), causal=True, scale=0.25, dtype=torch.float64)
    assert (again.double() - want).abs().max() < 1e-5 and first.shape == again.shape
    # Asking for the log-sum-exp, or another mask, takes the full key.
    autotile.flash_attention(q2, k2, v2, causal=True, return_lse=True)
    autotile.flash_attention(q2, k2, v2, causal=False)
    assert len(keys) == 2
    dispatch.clear_cache()  # a new database or device: every signature is served afresh
    assert not ops_flash._sdpa_direct


# --- on the GPU -------------------------------------------------------------------------------------
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("direction", ["fwd", "bwd"])
@pytest.mark.parametrize("shape, causal", [((2, 8, 2, 300, 555, 128), True), ((1, 4, 4, 555, 300, 64), True),
                                           ((2, 4, 4, 257, 257, 96), True), ((1, 8, 8, 129, 700, 128), False),
                                           ((1, 8, 4, 300, 300, 256), True), ((2, 8, 2, 200, 200, 128), True)])
def test_gpu_every_vendor_config_is_right(direction, shape, causal):
    from autotile.device import cuda_device

    device = cuda_device()
    for dtype in ("bf16", "fp16"):
        problem = FlashProblem(direction, *shape, causal=causal, dtype=dtype)
        inputs = FAMILY.make_inputs(problem, device, seed=5)
        expected = FAMILY.reference(problem, inputs)
        for config in FAMILY.vendor_configs(problem, device):
            outputs = FAMILY.allocate_outputs(problem, inputs)
            FAMILY.run_config(problem, config, inputs, outputs)
            result = FAMILY.check(problem, inputs, outputs, expected)
            assert result.ok, f"{config.to_json()} {problem}: {result.message}"
        # cuDNN's backward ran on the given O and LSE, not its forward again after a refusal.
        assert flash_vendor._cudnn_direct_ok.get(inputs["q"].device, True)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("vendor", ["1", "0"], ids=["vendor", "kernels"])
def test_gpu_cuda_graph_capture_without_syncs(vendor, monkeypatch):
    monkeypatch.setenv("AUTOTILE_VENDOR", vendor)
    dispatch.clear_cache()
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, h, 512, 128, device="cuda", generator=gen).bfloat16() for h in (32, 8, 8))
    expected = autotile.flash_attention(q, k, v, causal=True)  # first call: resolves, compiles
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.graph(graph):
            out = autotile.flash_attention(q, k, v, causal=True)
        for _ in range(3):
            autotile.flash_attention(q, k, v, causal=True)  # eager calls: no sync either
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expected)
    dispatch.clear_cache()


def test_which_vendor_backwards_take_the_given_lse(monkeypatch):
    """flash_vendor.backward_takes_given_lse, which decides whether SDPA's own training pair is worth running:
    FlashAttention-2's always, cuDNN's only under CUDNN_BACKWARD_ON_GIVEN_LSE and until it refused on that device."""
    cpu = torch.device("cpu")
    monkeypatch.setattr(flash_vendor, "_cudnn_direct_ok", {})
    monkeypatch.setattr(flash_vendor, "CUDNN_BACKWARD_ON_GIVEN_LSE", False)
    assert flash_vendor.backward_takes_given_lse(flash_vendor.FLASH, cpu)
    assert not flash_vendor.backward_takes_given_lse(flash_vendor.CUDNN, cpu)
    assert not flash_vendor.backward_takes_given_lse(flash_vendor.MATH, cpu)
    monkeypatch.setattr(flash_vendor, "CUDNN_BACKWARD_ON_GIVEN_LSE", True)
    assert flash_vendor.backward_takes_given_lse(flash_vendor.CUDNN, cpu)
    assert not flash_vendor.backward_takes_given_lse(flash_vendor.EFFICIENT, cpu)
    flash_vendor._cudnn_direct_ok[cpu] = False
    assert not flash_vendor.backward_takes_given_lse(flash_vendor.CUDNN, cpu)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("heads_kv", [8, 2])
def test_gpu_a_generated_forwards_backward_is_cudnns_on_its_o_and_lse(monkeypatch, layout, heads_kv):
    """A training call whose forward a generated kernel serves (the forward's vendor configs withheld, as where a
    shipped policy or winner serves it): with CUDNN_BACKWARD_ON_GIVEN_LSE on, its untuned backward is cuDNN's run on
    that forward's O and LSE, for the layouts models pass (heads-major, or (B, S, H, D) transposed), MHA and GQA;
    gradients match float64."""
    listed = FAMILY.vendor_configs
    monkeypatch.setattr(FAMILY, "vendor_configs", lambda p, d: [] if p.direction == "fwd" else listed(p, d))
    monkeypatch.delenv("AUTOTILE_VENDOR", raising=False)
    monkeypatch.setattr(flash_vendor, "CUDNN_BACKWARD_ON_GIVEN_LSE", True)
    monkeypatch.setattr(flash_vendor, "_cudnn_direct_ok", {})
    monkeypatch.setattr(ops_flash, "HOST_BOUND_STEP_FLOPS", 0)  # a small step: SDPA's pair would serve it
    direct = []
    call = flash_vendor._cudnn_backward
    monkeypatch.setattr(flash_vendor, "_cudnn_backward", lambda *a, **kw: direct.append(1) or call(*a, **kw))
    dispatch.clear_cache()
    gen = torch.Generator(device="cuda").manual_seed(3)

    def tensor(heads):
        shape = (2, heads, 200, 128) if layout == "bhsd" else (2, 200, heads, 128)
        t = torch.randn(shape, device="cuda", generator=gen).bfloat16()
        return (t if layout == "bhsd" else t.transpose(1, 2)).requires_grad_(True)

    try:
        q, k, v = tensor(8), tensor(heads_kv), tensor(heads_kv)
        do = torch.randn(q.shape, device="cuda", generator=gen).bfloat16()
        got = torch.autograd.grad(autotile.flash_attention(q, k, v, causal=True), (q, k, v), do)
        assert direct, "the backward was not cuDNN's on the given O and LSE"
        assert flash_vendor._cudnn_direct_ok.get(q.device, True)
        want = attention_grads(*(t.detach().double() for t in (q, k, v)), do.double(), causal=True,
                               scale=128 ** -0.5, dtype=torch.float64)
        for g, w in zip(got, want):
            assert ((g.double() - w).abs().max() / w.abs().max()).item() < 1e-2
    finally:
        dispatch.clear_cache()


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("ours_first", [False, True])
def test_gpu_cudnn_direct_backward_beside_sdpas_own(monkeypatch, ours_first):
    """Torch caches cuDNN's backward graph by q, k and v alone, with the strides of O and dO it was built with
    (flash_vendor.CUDNN_BACKWARD_ON_GIVEN_LSE). SDPA's own backward and the direct call on the same (B, S, H, D)-laid
    q, k and v in one process, in either order, the direct call given O contiguous (as the family's forward writes it)
    and the same dO: both gradients match float64."""
    monkeypatch.setattr(flash_vendor, "CUDNN_BACKWARD_ON_GIVEN_LSE", True)
    monkeypatch.setattr(flash_vendor, "_cudnn_direct_ok", {})
    gen = torch.Generator(device="cuda").manual_seed(11)
    seq = 192 if ours_first else 160  # one graph key an order: neither finds the other's graph cached
    scale = 128 ** -0.5

    def bshd(heads):
        return torch.randn(2, seq, heads, 128, device="cuda", generator=gen).bfloat16().transpose(1, 2)

    q, k, v = bshd(8), bshd(4), bshd(4)
    do = bshd(8)  # the gradient a model's o.transpose(1, 2).reshape(B, S, -1) hands back: O's layout
    want = attention_grads(*(t.double() for t in (q, k, v)), do.double(), causal=True, scale=scale,
                           dtype=torch.float64)

    def sdpas_own():
        leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        out, _ = flash_vendor.forward(flash_vendor.CUDNN, *leaves, causal=True, scale=scale, need_lse=False)
        return torch.autograd.grad(out, leaves, do)

    def direct():
        o, lse = flash_vendor.forward(flash_vendor.CUDNN, q, k, v, causal=True, scale=scale, need_lse=True)
        return flash_vendor.backward(flash_vendor.CUDNN, do, q, k, v, o.contiguous(), lse, causal=True, scale=scale)

    for name, call in ((("direct", direct), ("SDPA's own", sdpas_own)) if ours_first
                       else (("SDPA's own", sdpas_own), ("direct", direct))):
        got = call()
        for g, w in zip(got, want):
            err = ((g.double() - w).abs().max() / w.abs().max()).item()
            assert err < 1e-2, f"{name}: relative error {err:.4f}"
    assert flash_vendor._cudnn_direct_ok.get(q.device, True)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("vendor", ["1", "0"], ids=["vendor", "kernels"])
def test_gpu_inductor_reads_the_ops_outputs_as_laid_out(vendor, monkeypatch):
    """Under torch.compile, Inductor's own kernels read the op's O and gradients with the strides its fake
    implementations promise (q's layout, autotile.layouts): a model's (B, S, H, D) projections, attention, and the
    transpose back fused into the next kernel, forward and backward, whichever kernel serves (SDPA's backend or the
    family's), against float64."""
    monkeypatch.setenv("AUTOTILE_VENDOR", vendor)
    dispatch.clear_cache()
    torch._dynamo.reset()
    gen = torch.Generator(device="cuda").manual_seed(5)
    batch, seq, dim = 2, 300, 128

    def block(q, k, v):
        def heads(t):
            return t.view(batch, seq, -1, dim).transpose(1, 2)
        o = autotile.flash_attention(heads(q), heads(k), heads(v), causal=True)
        return o.transpose(1, 2).reshape(batch, seq, -1) * 2.0

    q, k, v = (torch.randn(batch, seq, h * dim, device="cuda", generator=gen).bfloat16().requires_grad_(True)
               for h in (8, 2, 2))
    grad = torch.randn(batch, seq, 8 * dim, device="cuda", generator=gen).bfloat16()
    try:
        out = torch.compile(block)(q, k, v)
        got = torch.autograd.grad(out, (q, k, v), grad)
        leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
        want_o = attention_math(*(t.view(batch, seq, -1, dim).transpose(1, 2) for t in leaves), causal=True,
                                scale=dim ** -0.5, dtype=torch.float64).transpose(1, 2).reshape(batch, seq, -1) * 2.0
        want = torch.autograd.grad(want_o, leaves, grad.double())
        for g, w in zip((out, *got), (want_o, *want)):
            assert ((g.double() - w).abs().max() / w.abs().max()).item() < 1e-2
    finally:
        dispatch.clear_cache()
        torch._dynamo.reset()


@pytest.mark.gpu
@gpu
def test_gpu_cudnn_direct_backward_twice_with_do_laid_out_otherwise(monkeypatch):
    """Torch's cached cuDNN backward graph keeps the dO strides it was built with: a second call on the same q, k
    and v whose dO is laid out otherwise got wrong gradients (relative error ~1.8; SDPA's own backward does the same,
    results/cudnn_graph_cache_layouts_2026-12-05_h100.txt). The direct call lays dO out like O: both right."""
    monkeypatch.setattr(flash_vendor, "CUDNN_BACKWARD_ON_GIVEN_LSE", True)
    monkeypatch.setattr(flash_vendor, "_cudnn_direct_ok", {})
    gen = torch.Generator(device="cuda").manual_seed(13)
    scale = 128 ** -0.5

    def bshd(heads):
        return torch.randn(2, 224, heads, 128, device="cuda", generator=gen).bfloat16().transpose(1, 2)

    q, k, v = bshd(8), bshd(4), bshd(4)
    o, lse = flash_vendor.forward(flash_vendor.CUDNN, q, k, v, causal=True, scale=scale, need_lse=True)
    for do in (bshd(8), torch.randn(2, 8, 224, 128, device="cuda", generator=gen).bfloat16()):
        want = attention_grads(*(t.double() for t in (q, k, v)), do.double(), causal=True, scale=scale,
                               dtype=torch.float64)
        got = flash_vendor.backward(flash_vendor.CUDNN, do, q, k, v, o, lse, causal=True, scale=scale)
        for g, w in zip(got, want):
            assert ((g.double() - w).abs().max() / w.abs().max()).item() < 1e-2
    assert flash_vendor._cudnn_direct_ok.get(q.device, True)
