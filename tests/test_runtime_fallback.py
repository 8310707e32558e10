"""A served generated kernel that cannot build or launch here: one warning, then the next choice serves its calls.

Failures are injected where each family builds or launches a kernel, for one config (a stored winner, or the
default); results must still equal an independent float64 torch reference, which only the next choice can have
computed. Errors that are not build or launch failures (bad input, CUDA errors that poison the context, anything
while a CUDA graph is captured) must reach the caller unchanged, and mark nothing.
"""
from __future__ import annotations

import dataclasses
import logging
import math

import pytest
import torch
from triton.compiler.errors import CompilationError
from triton.runtime.errors import InterpreterError, OutOfResources, PTXASError

import autotile
from autotile.device import interpret_device
from autotile.errors import BadInputError, KernelUnusableError, ShapeMismatchError
from autotile.families import elementwise, flash, gemm, paged
from autotile.families.base import VENDOR_KEY
from autotile.kvcache import PagedKVCache
from autotile.runtime import dispatch, fallback, ops_elementwise, ops_flash, ops_flash_varlen, ops_gemm
from autotile.runtime.paged_plan import plan_paged_attention
from autotile.space import Config
from autotile.store.db import open_engine
from autotile.store.repo import Store

SHARED_MEMORY = OutOfResources(262144, 232448, "shared memory")


@pytest.fixture
def warnings_seen(caplog):
    caplog.set_level(logging.WARNING, logger="autotile.runtime")
    return lambda: [r.getMessage() for r in caplog.records if "failed to build or launch" in r.getMessage()]


def store_winner(url: str, family, problem, device, changes: dict) -> Config:
    """The default config with `changes`, stored as the exact winner of `problem`; returns it."""
    config = family.validate_config(problem, device, Config(dict(family.default_config(problem, device), **changes)))
    store = Store(open_engine(url))
    store.save_winner(problem_id=store.ensure_problem(family, problem), device=device,
                      device_id=store.ensure_device(device), toolchain_id=store.ensure_toolchain(),
                      config=config.to_json(), config_hash=config.hash, median_ms=1.0, q20_ms=1.0, q80_ms=1.0,
                      interpreted=1, provenance="test")
    dispatch.clear_cache()
    assert dispatch.resolve(family, problem, device).config == config  # the winner is what serves the problem
    return config


def assert_close(got: torch.Tensor, want: torch.Tensor, tol: float = 1e-4) -> None:
    error = (got.double() - want.double()).abs()
    worst = int(error.argmax())
    assert float(error.max()) <= tol, (f"worst element {worst}: got {got.flatten()[worst].item()}, "
                                       f"want {want.flatten()[worst].item()}")


# --- gemm -----------------------------------------------------------------------------------------

@pytest.fixture
def gemm_launches(monkeypatch):
    """([configs launched, in order], {config: exception its launch raises}) for the gemm family."""
    real, tried, failing = gemm.FAMILY.launch, [], {}

    def launch(problem, config, inputs, outputs):
        tried.append(config)
        if config in failing:
            raise failing[config]
        return real(problem, config, inputs, outputs)
    monkeypatch.setattr(gemm.FAMILY, "launch", launch)
    return tried, failing


def _operands(m=33, k=17, n=5):
    gen = torch.Generator().manual_seed(0)
    return torch.randn(m, k, generator=gen), torch.randn(k, n, generator=gen)


def test_a_winner_that_cannot_build_falls_back_to_the_default_once(user_db, gemm_launches, warnings_seen):
    a, b = _operands()
    _, problem, device = ops_gemm.problem_for(a, b)
    winner = store_winner(user_db, gemm.FAMILY, problem, device, {"num_stages": 2})
    default = gemm.FAMILY.default_config(problem, device)
    tried, failing = gemm_launches
    failing[winner] = SHARED_MEMORY
    for _ in range(3):
        assert_close(autotile.matmul(a, b), a.double() @ b.double())
    assert tried == [winner, default, default, default]
    (warning,) = warnings_seen()
    for part in ("gemm", gemm.FAMILY.problem_key(problem), winner.to_json(), "OutOfResources: out of resource",
                 "your tuning database", default.to_json(), "autotile tune gemm", "--from-trace"):
        assert part in warning
    # Served objects hold the plain runner once a call returned: later calls pay nothing for the fallback.
    assert all("guard" not in served.run.__qualname__ for served in ops_gemm._served.values())
    # The mark, not only the kept runner, keeps the winner away: a new signature of the problem skips it too.
    ops_gemm._forget_served()
    autotile.matmul(a, b)
    assert tried[-1] == default and winner not in tried[1:]
    info = autotile.explain("matmul", a, b)
    assert (info["config"], info["source"], info["match"]) == (dict(default), "default", "fallback")
    (mark,) = info["unusable"]
    assert mark["config"] == dict(winner) and mark["source"] == "user-db"
    assert mark["error"].startswith("OutOfResources: out of resource: shared memory")


def test_clear_cache_forgets_the_marks(user_db, gemm_launches, warnings_seen):
    # clear_cache is what a user calls after re-tuning: a new winner was compiled and checked on this machine.
    a, b = _operands()
    _, problem, device = ops_gemm.problem_for(a, b)
    winner = store_winner(user_db, gemm.FAMILY, problem, device, {"num_stages": 2})
    tried, failing = gemm_launches
    failing[winner] = SHARED_MEMORY
    autotile.matmul(a, b)
    dispatch.clear_cache()
    info = autotile.explain("matmul", a, b)
    assert (info["config"], info["match"], info["unusable"]) == (dict(winner), "exact", [])
    del failing[winner]  # e.g. the driver was fixed, and the tuned winner builds now
    tried.clear()
    assert_close(autotile.matmul(a, b), a.double() @ b.double())
    assert tried == [winner] and len(warnings_seen()) == 1


def test_a_gemm_winner_falls_back_to_the_vendor_op_where_there_is_one(user_db, gemm_launches, monkeypatch,
                                                                      warnings_seen):
    monkeypatch.setattr(gemm.FAMILY, "vendor_configs", lambda problem, device: [Config({VENDOR_KEY: "cublas"})])
    a, b = _operands()
    _, problem, device = ops_gemm.problem_for(a, b)
    winner = store_winner(user_db, gemm.FAMILY, problem, device, {"num_stages": 2})
    gen = torch.Generator().manual_seed(1)
    x, weight, bias = (torch.randn(*shape, generator=gen) for shape in ((2, 9, 17), (6, 17), (6,)))
    _, linear_problem, _ = ops_gemm.linear_problem_for(x, weight, bias)
    linear_winner = store_winner(user_db, gemm.FAMILY, linear_problem, device, {"num_stages": 2})
    tried, failing = gemm_launches
    failing[winner] = PTXASError("ptxas fatal: Unresolved extern function")
    failing[linear_winner] = CompilationError(None, None, "the Gluon kernel needs sm_100")
    for _ in range(2):
        assert_close(autotile.matmul(a, b), a.double() @ b.double())
        assert_close(autotile.linear(x, weight, bias), x.double() @ weight.double().T + bias.double())
    assert tried == [winner, linear_winner]  # each tried once; cuBLAS (torch.matmul on the CPU) served the rest
    assert len(warnings_seen()) == 2 and all("cuBLAS (torch.matmul)" in w for w in warnings_seen())
    info = autotile.explain("matmul", a, b)
    assert (info["source"], info["vendor"], info["match"]) == ("vendor", "cuBLAS (torch.matmul)", "fallback")


def test_a_default_that_cannot_build_raises_a_clear_chained_error(user_db, gemm_launches, warnings_seen):
    a, b = _operands()
    _, problem, device = ops_gemm.problem_for(a, b)
    default = gemm.FAMILY.default_config(problem, device)
    tried, failing = gemm_launches
    failing[default] = SHARED_MEMORY
    with pytest.raises(KernelUnusableError, match="default config") as raised:
        autotile.matmul(a, b)
    assert raised.value.__cause__ is SHARED_MEMORY and default.to_json() in str(raised.value)
    with pytest.raises(KernelUnusableError):  # said at once: the failing kernel is not built again
        autotile.matmul(a, b)
    assert tried == [default] and not warnings_seen()


@pytest.mark.parametrize("error", [
    RuntimeError("CUDA error: an illegal memory access was encountered\nCUDA kernel errors might be asynchronously "
                 "reported at some other API call"),
    RuntimeError("Triton Error [CUDA]: an illegal memory access was encountered"),
    RuntimeError("CUDA error: device-side assert triggered"),
    BadInputError("a check inside the op refused the call"),
    ValueError("not a build failure"),
], ids=["cuda-illegal-access", "triton-illegal-access", "device-side-assert", "autotile-error", "value-error"])
def test_errors_that_are_not_build_failures_reach_the_caller_and_mark_nothing(user_db, gemm_launches, warnings_seen,
                                                                              error):
    a, b = _operands()
    _, problem, device = ops_gemm.problem_for(a, b)
    winner = store_winner(user_db, gemm.FAMILY, problem, device, {"num_stages": 2})
    tried, failing = gemm_launches
    failing[winner] = error
    for _ in range(2):
        with pytest.raises(type(error)) as raised:
            autotile.matmul(a, b)
        assert raised.value is error
    assert tried == [winner, winner]  # never retried with another kernel, and not marked
    assert not fallback.marks_for(gemm.FAMILY, problem) and not warnings_seen()


def test_bad_user_input_still_raises(user_db, gemm_launches, warnings_seen):
    a, b = _operands()
    _, problem, device = ops_gemm.problem_for(a, b)
    _, failing = gemm_launches
    failing[gemm.FAMILY.default_config(problem, device)] = SHARED_MEMORY  # armed, but the checks come first
    with pytest.raises(ShapeMismatchError):
        autotile.matmul(a, torch.randn(16, 5))
    with pytest.raises(ShapeMismatchError):
        autotile.linear(torch.randn(3, 17), torch.randn(4, 16))
    assert not warnings_seen()


def test_a_failure_while_a_cuda_graph_is_captured_is_raised_as_it_is(user_db, gemm_launches, monkeypatch,
                                                                      warnings_seen):
    a, b = _operands()
    _, problem, device = ops_gemm.problem_for(a, b)
    winner = store_winner(user_db, gemm.FAMILY, problem, device, {"num_stages": 2})
    tried, failing = gemm_launches
    failing[winner] = SHARED_MEMORY
    with monkeypatch.context() as capture:
        capture.setattr(torch.cuda, "is_available", lambda: True)
        capture.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
        with pytest.raises(OutOfResources):
            autotile.matmul(a, b)
    assert not fallback.marks_for(gemm.FAMILY, problem) and not warnings_seen()
    # Outside the capture the same served signature falls back.
    assert_close(autotile.matmul(a, b), a.double() @ b.double())
    assert len(warnings_seen()) == 1 and tried[0] == tried[1] == winner


@pytest.mark.parametrize("error, build_failure", [
    (SHARED_MEMORY, True),
    (PTXASError("ptxas error: Entry function uses too much shared data"), True),
    (CompilationError("def f(): pass", None, "unsupported layout"), True),
    (RuntimeError("PassManager::run failed"), True),
    (RuntimeError("Triton Error [CUDA]: too many resources requested for launch"), True),
    (RuntimeError("Triton Error [CUDA]: no kernel image is available for execution on the device"), True),
    (RuntimeError("CUDA error: an illegal memory access was encountered"), False),
    (RuntimeError("Triton Error [CUDA]: unspecified launch failure"), False),
    (RuntimeError("Triton Error [CUDA]: misaligned address"), False),
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), False),
    (InterpreterError("index out of bounds in the interpreted kernel"), False),
    (ShapeMismatchError("operand shapes do not fit"), False),
    (RuntimeError("expected a CUDA tensor"), False),
    (TypeError("launch() got an unexpected keyword argument"), False),
])
def test_which_errors_are_build_or_launch_failures(error, build_failure):
    assert fallback.is_build_failure(error) is build_failure


# --- flash ----------------------------------------------------------------------------------------

@pytest.fixture
def flash_plans(monkeypatch):
    """([(config, direction, store_lse) of each launch of a plan], {config: exception}) for the flash family."""
    real, launched, failing = flash.FAMILY.plan, [], {}

    def plan(problem, config, inputs, outputs, *, scale, keep=False, store_lse=True):
        inner = real(problem, config, inputs, outputs, scale=scale, keep=keep, store_lse=store_lse)
        what = (config, problem.direction, store_lse)

        def launch(*args):
            launched.append(what)
            fails = failing.get(config)
            if fails is not None and fails[1:] == what[1:]:
                raise fails[0]
            return inner(*args)
        return launch
    monkeypatch.setattr(flash.FAMILY, "plan", plan)
    return launched, failing


def attention(q, k, v, causal: bool):
    """float64 o and natural-log lse of softmax(q k^T / sqrt(D)) v, causal from the top left (Sq == Sk here)."""
    logits = q.double() @ k.double().transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        seq = q.shape[-2]
        logits = logits.masked_fill(torch.ones(seq, seq, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(logits, dim=-1) @ v.double(), torch.logsumexp(logits, dim=-1)


def _qkv(requires_grad=False):
    gen = torch.Generator().manual_seed(2)
    return [torch.randn(1, 2, 7, 16, generator=gen).requires_grad_(requires_grad) for _ in range(3)]


def test_a_flash_render_that_fails_after_the_other_worked_hands_over_the_call(user_db, flash_plans, warnings_seen):
    # Inference calls run the forward that writes no log-sum-exp; the first call asking for it compiles the other
    # render, which fails here: that call and every later one are served by the default config.
    q, k, v = _qkv()
    _, problem, device = ops_flash.problem_for(q, k, v, causal=True)
    winner = store_winner(user_db, flash.FAMILY, problem, device, {"BLOCK_N": 32})
    default = flash.FAMILY.default_config(problem, device)
    launched, failing = flash_plans
    failing[winner] = (SHARED_MEMORY, "fwd", True)
    want_o, want_lse = attention(q, k, v, causal=True)
    assert_close(autotile.flash_attention(q, k, v, causal=True), want_o)
    assert launched == [(winner, "fwd", False)] and not warnings_seen()
    for _ in range(2):
        o, lse = autotile.flash_attention(q, k, v, causal=True, return_lse=True)
        assert_close(o, want_o)
        assert_close(lse, want_lse)
    assert_close(autotile.flash_attention(q, k, v, causal=True), want_o)
    assert launched == [(winner, "fwd", False), (winner, "fwd", True), (default, "fwd", True), (default, "fwd", True),
                        (default, "fwd", False)]
    (warning,) = warnings_seen()
    assert "flash" in warning and winner.to_json() in warning and default.to_json() in warning


def test_a_flash_winner_falls_back_to_sdpa_where_it_serves(user_db, flash_plans, monkeypatch, warnings_seen):
    monkeypatch.setattr(flash.FAMILY, "vendor_configs", lambda problem, device: [Config({VENDOR_KEY: "sdpa-math"})])
    q, k, v = _qkv()
    _, problem, device = ops_flash.problem_for(q, k, v, causal=True)
    winner = store_winner(user_db, flash.FAMILY, problem, device, {"BLOCK_N": 32})
    launched, failing = flash_plans
    failing[winner] = (CompilationError(None, None, "Gluon: no tcgen05 on this GPU"), "fwd", False)
    for _ in range(2):
        assert_close(autotile.flash_attention(q, k, v, causal=True), attention(q, k, v, causal=True)[0])
    assert launched == [(winner, "fwd", False)]
    (warning,) = warnings_seen()
    assert "SDPA (math)" in warning


def test_a_flash_backward_that_cannot_build_falls_back(user_db, flash_plans, warnings_seen):
    q, k, v = _qkv(requires_grad=True)
    _, forward, device = ops_flash.problem_for(q, k, v, causal=True)
    backward = dataclasses.replace(forward, direction="bwd")
    winner = store_winner(user_db, flash.FAMILY, backward, device, {"num_stages": 3})
    launched, failing = flash_plans
    failing[winner] = (RuntimeError("PassManager::run failed"), "bwd", True)
    grads = []
    for _ in range(2):
        out = autotile.flash_attention(q, k, v, causal=True)
        grads.append(torch.autograd.grad((out * out).sum(), (q, k, v)))
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = attention(q64, k64, v64, causal=True)[0]
    want = torch.autograd.grad((ref * ref).sum(), (q64, k64, v64))
    for got in grads:
        for g, w in zip(got, want):
            assert_close(g, w, tol=2e-4)
    assert [c for c, direction, _ in launched if direction == "bwd"].count(winner) == 1
    assert len(warnings_seen()) == 1


def test_a_varlen_winner_that_cannot_build_falls_back(user_db, flash_plans, warnings_seen):
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(9, 2, 16, generator=gen) for _ in range(3))
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    _, problem, device = ops_flash_varlen.problem_for(q, k, v, cu, cu, 5, 5, causal=True)
    winner = store_winner(user_db, flash.FAMILY, problem, device, {"BLOCK_N": 32})
    launched, failing = flash_plans
    failing[winner] = (SHARED_MEMORY, "fwd", False)
    for _ in range(2):
        out = autotile.flash_attention_varlen(q, k, v, cu, cu, 5, 5, causal=True)
        for start, end in ((0, 4), (4, 9)):
            want = attention(*(t[start:end].transpose(0, 1) for t in (q, k, v)), causal=True)[0].transpose(0, 1)
            assert_close(out[start:end], want)
    assert [c for c, _, _ in launched].count(winner) == 1 and len(warnings_seen()) == 1


# --- elementwise ----------------------------------------------------------------------------------

def test_a_fused_expression_whose_winner_cannot_build_falls_back(user_db, monkeypatch, warnings_seen):
    gen = torch.Generator().manual_seed(4)
    x, y = torch.randn(1000, generator=gen), torch.randn(1000, generator=gen)
    _, problem, device = ops_elementwise.problem_for("x * 2 + sin(y)", x=x, y=y)
    winner = store_winner(user_db, elementwise.FAMILY, problem, device, {"BLOCK_SIZE": 512})
    real, blocks = elementwise.FAMILY.run, []

    def run(plan, launch, inputs, outputs):
        blocks.append(launch.meta["BLOCK_SIZE"])
        if launch.meta["BLOCK_SIZE"] == winner["BLOCK_SIZE"]:
            raise SHARED_MEMORY
        return real(plan, launch, inputs, outputs)
    monkeypatch.setattr(elementwise.FAMILY, "run", run)
    fused = autotile.fuse("x * 2 + sin(y)")
    for _ in range(3):
        assert_close(fused(x=x, y=y), x.double() * 2 + torch.sin(y.double()), tol=1e-5)
    assert blocks.count(winner["BLOCK_SIZE"]) == 1 and len(blocks) == 4
    assert len(warnings_seen()) == 1


# --- paged ----------------------------------------------------------------------------------------

def test_a_paged_plan_whose_winner_cannot_launch_falls_back(user_db, monkeypatch, warnings_seen):
    heads, kv_heads, dim, page_size = 4, 2, 64, 16
    gen = torch.Generator().manual_seed(5)
    cache = PagedKVCache(num_layers=1, num_pages=8, page_size=page_size, num_kv_heads=kv_heads, head_dim=dim,
                         dtype=torch.float16)
    kept = {}
    for seq, n in (("a", 20), ("b", 37)):
        cache.allocate(seq)
        kept[seq] = tuple(torch.randn(n, kv_heads, dim, generator=gen).half() for _ in range(2))
        cache.append(seq, *kept[seq])
    q = torch.randn(2, heads, dim, generator=gen).half()
    args = (cache.k_pools[0], cache.v_pools[0], cache.block_table(["a", "b"]), cache.context_lens(["a", "b"]))
    shape = dict(batch=2, num_q_heads=heads, num_kv_heads=kv_heads, head_dim=dim, page_size=page_size,
                 max_context=64, dtype=torch.float16, device="cpu")
    problem = plan_paged_attention(**shape).problem
    device = interpret_device()
    winner = store_winner(user_db, paged.FAMILY, problem, device, {"BLOCK_N": 16})
    real, launched = paged.PagedLaunch.decode_or_prefill, []

    def decode_or_prefill(self, *a, **kw):
        launched.append(self.config)
        if self.config == winner:
            raise SHARED_MEMORY
        return real(self, *a, **kw)
    monkeypatch.setattr(paged.PagedLaunch, "decode_or_prefill", decode_or_prefill)
    plan = plan_paged_attention(**shape)
    assert plan.config == winner
    for seq, row in (("a", 0), ("b", 1)):
        want = _decode_reference(q[row], *kept[seq], heads // kv_heads)
        for _ in range(2):
            assert_close(plan.run(q, *args)[row], want, tol=2e-3)
    assert launched.count(winner) == 1 and len(launched) == 5 and plan.config != winner
    # The one-call form plans afresh for the same problem: the mark keeps the winner away.
    assert_close(autotile.paged_attention(q, *args, max_context=64)[1], _decode_reference(q[1], *kept["b"], 2),
                 tol=2e-3)
    assert launched.count(winner) == 1 and len(warnings_seen()) == 1


def _decode_reference(q, k, v, group: int):
    """One query token (Hq, D) over a whole context k, v (L, Hkv, D), float64."""
    k, v = k.double().repeat_interleave(group, dim=1), v.double().repeat_interleave(group, dim=1)
    logits = torch.einsum("hd,lhd->hl", q.double(), k) / math.sqrt(q.shape[-1])
    return torch.einsum("hl,lhd->hd", torch.softmax(logits, dim=-1), v)
