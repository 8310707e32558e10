"""Serving real models: the vendor op as a candidate, verified serving ranges, autotile.linear, the served fast path."""
from __future__ import annotations

import dataclasses
import time
import weakref

import pytest
import torch

import autotile
from autotile.device import DeviceInfo, interpret_device
from autotile.errors import BadInputError
from autotile.families.base import VENDOR_KEY, is_vendor
from autotile.families.gemm import FAMILY, GemmFamily, contiguous_problem
from autotile.runtime import dispatch, ops_gemm
from autotile.space import Config
from autotile.store.db import open_engine
from autotile.store.repo import Store
from autotile.tune.driver import tune_problem, verify_range, vendor_study

CPU = interpret_device()
# A GPU as the runtime sees one: resolving needs no CUDA, only the device's facts.
H200 = DeviceInfo("h200", "NVIDIA H200", (9, 0), 132, 150_000_000_000, 232448, "580", interpret=False)
CUBLAS = Config({VENDOR_KEY: "cublas"})


def linear_problem(m: int, n: int = 96, k: int = 64, dtype: str = "bf16"):
    return contiguous_problem(m, n, k, dtype, dtype, layout_b="col")


def save(url: str, problem, device, config: Config, verified_range=None, kernel_config=None, ms: float = 1.0,
         baseline_ms: float | None = None):
    store = Store(open_engine(url))
    store.save_winner(problem_id=store.ensure_problem(FAMILY, problem), device=device,
                      device_id=store.ensure_device(device), toolchain_id=store.ensure_toolchain(),
                      config=config.to_json(), config_hash=config.hash, median_ms=ms, q20_ms=ms, q80_ms=ms,
                      interpreted=int(device.interpret), provenance="test", verified_range=verified_range,
                      kernel_config=kernel_config, baseline_ms=baseline_ms)


def test_untuned_gpu_shapes_get_the_vendor_op_and_the_interpreter_gets_the_kernel(user_db):
    problem = linear_problem(7)
    got = dispatch.resolve(FAMILY, problem, H200)
    assert (got.source, got.match, got.vendor, got.config) == ("vendor", "vendor", True, CUBLAS)
    on_cpu = dispatch.resolve(FAMILY, problem, CPU)
    assert on_cpu.source == "default" and not on_cpu.vendor


def test_a_winner_serves_the_range_it_was_verified_on_and_nothing_else(user_db):
    tuned = linear_problem(100)
    kernel = FAMILY.default_config(tuned, H200)
    save(user_db, tuned, H200, kernel, verified_range={"m": [65, 128]})
    for m, source, match in ((100, "user-db", "exact"), (65, "user-db", "range"), (128, "user-db", "range"),
                             (64, "vendor", "vendor"), (129, "vendor", "vendor")):
        got = dispatch.resolve(FAMILY, linear_problem(m), H200)
        assert (m, got.source, got.match) == (m, source, match)
        assert got.config == (kernel if source == "user-db" else CUBLAS)
    # Another weight (N) or another layout is another layer: the range does not reach it.
    assert dispatch.resolve(FAMILY, linear_problem(100, n=128), H200).source == "vendor"
    row_b = contiguous_problem(100, 96, 64, "bf16", "bf16", layout_b="row")
    assert dispatch.resolve(FAMILY, row_b, H200).source == "vendor"


def test_an_unverified_winner_never_serves_another_shape_where_a_vendor_op_exists(user_db):
    tuned = linear_problem(100)
    save(user_db, tuned, H200, FAMILY.default_config(tuned, H200), verified_range=None)
    assert dispatch.resolve(FAMILY, linear_problem(100), H200).match == "exact"
    assert dispatch.resolve(FAMILY, linear_problem(99), H200).source == "vendor"
    # Without a vendor op (the interpreter), the nearest tuned problem is still the best guess.
    save(user_db, tuned, CPU, FAMILY.default_config(tuned, CPU))
    dispatch.clear_cache()
    assert dispatch.resolve(FAMILY, linear_problem(99), CPU).match in ("bucket", "nearest")


def test_a_winner_that_only_ties_the_vendor_leaves_the_call_to_the_vendor(user_db, monkeypatch):
    kernel = FAMILY.default_config(linear_problem(100), H200)
    # (vendor ms over winner ms in the winner's own record, who serves)
    for speedup, served in ((0.68, CUBLAS), (1.01, CUBLAS), (1.019, CUBLAS), (1.021, kernel), (1.2, kernel)):
        save(user_db, linear_problem(100), H200, kernel, verified_range={"m": [65, 128]}, ms=0.1,
             baseline_ms=0.1 * speedup)
        dispatch.clear_cache()
        for m in (100, 70):
            assert dispatch.resolve(FAMILY, linear_problem(m), H200).config == served, (speedup, m)
    # Records without a vendor timing serve as before; generated kernels only: the winner serves.
    save(user_db, linear_problem(100), H200, kernel, ms=0.1, baseline_ms=None)
    dispatch.clear_cache()
    assert dispatch.resolve(FAMILY, linear_problem(100), H200).config == kernel
    save(user_db, linear_problem(100), H200, kernel, ms=0.1, baseline_ms=0.1)
    monkeypatch.setenv("AUTOTILE_VENDOR", "0")
    dispatch.clear_cache()
    assert dispatch.resolve(FAMILY, linear_problem(100), H200).config == kernel


def test_a_corrupt_range_is_not_served(user_db):
    tuned = linear_problem(100)
    for bad in ({"m": [65]}, {"m": ["65", "128"]}, {"m": [True, 200]}, {"n": [1, 10**6]}, {"m": 100}):
        save(user_db, tuned, H200, FAMILY.default_config(tuned, H200), verified_range=bad)
        dispatch.clear_cache()
        assert dispatch.resolve(FAMILY, linear_problem(90), H200).source == "vendor", bad


def test_vendor_off_serves_the_kept_kernel_of_a_vendor_winner(user_db, monkeypatch):
    tuned = linear_problem(100)
    kernel = FAMILY.default_config(tuned, H200)
    save(user_db, tuned, H200, CUBLAS, verified_range={"m": [65, 128]}, kernel_config=kernel.to_json())
    assert dispatch.resolve(FAMILY, linear_problem(70), H200).config == CUBLAS
    monkeypatch.setenv("AUTOTILE_VENDOR", "0")
    for m in (100, 70):
        got = dispatch.resolve(FAMILY, linear_problem(m), H200)
        assert not got.vendor and got.config == kernel
    untuned = dispatch.resolve(FAMILY, linear_problem(5), H200)
    assert untuned.source == "default" and not untuned.vendor


class _CpuVendorGemm(GemmFamily):
    """The gemm family with torch.matmul on the CPU as its vendor op, so the tuner's vendor path runs here."""

    def __init__(self, vendor_delay_s: float = 0.0, kernel_delay_s: float = 0.0):
        # Delays make the outcome independent of how busy the CPU is.
        self.vendor_delay_s = vendor_delay_s
        self.kernel_delay_s = kernel_delay_s

    def launch(self, problem, config, inputs, outputs):
        if self.kernel_delay_s:
            time.sleep(self.kernel_delay_s)
        super().launch(problem, config, inputs, outputs)

    def vendor_configs(self, problem, device):
        return [CUBLAS] if problem.out_dtype == problem.dtype else []

    def vendor_run(self, problem, config, inputs):
        if self.vendor_delay_s:
            time.sleep(self.vendor_delay_s)
        return super().vendor_run(problem, config, inputs)


def test_the_tuner_stores_the_vendor_op_when_it_wins(tmp_path, monkeypatch):
    monkeypatch.setattr("autotile.resources.shipped_db_path", lambda: tmp_path / "none.sqlite")
    url = f"sqlite:///{tmp_path / 'tune.sqlite'}"
    family = _CpuVendorGemm(kernel_delay_s=0.3)
    problem = contiguous_problem(12, 32, 32, "fp32", "fp32", layout_b="col")
    result = tune_problem(family, problem, CPU, trials=2, db_url=url, retime_rounds=1)
    assert result.vendor_won and result.baseline_name == "cuBLAS (torch.matmul)"
    assert result.verified_range == {"m": [9, 16]}
    store = Store(open_engine(url, create=False))
    (winner,) = store.winners()
    assert is_vendor(Config.from_json(winner.config)) and winner.verified_range == {"m": [9, 16]}
    assert winner.kernel_config is not None and winner.kernel_ms > 0  # the best generated kernel is kept
    vendor_rows = [t for t in store.trials() if t["study"] == vendor_study(result.study)]
    # One row timed before the first search trial, one from the final re-timing.
    assert [(t["config"], t["status"]) for t in vendor_rows] == [({VENDOR_KEY: "cublas"}, "ok")] * 2
    # The search's own count holds generated kernels only.
    assert result.trials_this_run == 2


def test_range_verification_needs_the_kernel_to_win_at_both_corners():
    problem = contiguous_problem(12, 32, 32, "fp32", "fp32", layout_b="col")
    config = FAMILY.default_config(problem, CPU)
    slow_vendor = _CpuVendorGemm(vendor_delay_s=0.5)
    verified, note = verify_range(slow_vendor, problem, config, CUBLAS, CPU, rounds=1)
    assert verified == {"m": [9, 16]}, note
    fast_vendor = _CpuVendorGemm(kernel_delay_s=0.5)
    verified, note = verify_range(fast_vendor, problem, config, CUBLAS, CPU, rounds=1)
    assert verified is None and "against the vendor" in note


def test_range_edges_are_the_bucket_corners():
    assert [p.m for p in FAMILY.range_edges(linear_problem(100))] == [65, 128]
    assert [p.m for p in FAMILY.range_edges(linear_problem(128))] == [65]
    assert FAMILY.range_edges(linear_problem(1)) == []
    assert FAMILY.serving_range(linear_problem(3)) == {"m": (3, 4)}


def test_linear_matches_functional_linear_with_leading_dims_and_bias():
    torch.manual_seed(0)
    x, w, b = torch.randn(2, 3, 40), torch.randn(24, 40), torch.randn(24)
    for activation, act in ((None, lambda y: y), ("gelu", torch.nn.functional.gelu)):
        got = autotile.linear(x, w, b, activation=activation)
        want = act(torch.nn.functional.linear(x.double(), w.double(), b.double()))
        assert got.shape == (2, 3, 24) and torch.allclose(got.double(), want, atol=1e-4, rtol=1e-4)
    assert autotile.explain("linear", x, w)["problem"]["layout_b"] == "col"
    with pytest.raises(BadInputError, match="in_features"):
        autotile.linear(x, torch.randn(24, 41))
    with pytest.raises(BadInputError, match="bias"):
        autotile.linear(x, w, torch.randn(23))


def test_scales_on_non_fp8_operands_are_refused():
    a, b = torch.randn(4, 8), torch.randn(8, 4)
    with pytest.raises(BadInputError, match="float8_e4m3fn operands only"):
        autotile.matmul(a, b, scale_a=torch.tensor(2.0))


def test_a_served_signature_is_worked_out_once(monkeypatch):
    a, b = torch.randn(9, 16), torch.randn(16, 8)
    first = autotile.matmul(a, b)
    calls = []
    original = FAMILY.problem_from_tensors
    monkeypatch.setattr(FAMILY, "problem_from_tensors", lambda *args, **kw: calls.append(1) or original(*args, **kw))
    second = autotile.matmul(a, b)
    assert calls == [] and torch.equal(first, second)
    autotile.matmul(a[:, :15], b[:15])  # another signature: worked out again
    assert calls == [1]


def test_the_trace_counts_each_problem_and_reads_back(tmp_path, monkeypatch):
    from autotile.runtime import trace

    path = tmp_path / "trace.jsonl"
    monkeypatch.setenv("AUTOTILE_RECORD", str(path))
    dispatch.clear_cache()
    a, b = torch.randn(5, 16), torch.randn(16, 8)
    for _ in range(3):
        autotile.matmul(a, b)
    autotile.linear(torch.randn(2, 16), torch.randn(8, 16))
    trace.flush()
    def calls() -> dict:  # every gemm problem this process served (other tests' too): keyed by the whole shape
        return {(e.problem["m"], e.problem["n"], e.problem["k"], e.problem["layout_b"]): e.calls
                for e in trace.read_trace(path) if e.family == "gemm"}

    entries = calls()
    assert entries[(5, 8, 16, "row")] >= 3 and entries[(2, 8, 16, "col")] >= 1
    before = entries[(5, 8, 16, "row")]
    autotile.matmul(a, b)
    trace.flush()  # merged with what the file holds
    assert calls()[(5, 8, 16, "row")] == before + 1


def test_the_trace_counts_paged_decode_and_prefill_runs(tmp_path, monkeypatch):
    """The paged ops and plans were never counted: tune --from-trace could not tune what a serving engine ran."""
    from autotile.kvcache import PagedKVCache
    from autotile.runtime import trace

    path = tmp_path / "trace.jsonl"
    monkeypatch.setenv("AUTOTILE_RECORD", str(path))
    cache = PagedKVCache(num_layers=1, num_pages=8, page_size=16, num_kv_heads=1, head_dim=32, dtype=torch.float16)
    cache.allocate("a")
    cache.append("a", torch.randn(20, 1, 32), torch.randn(20, 1, 32))
    tables = (cache.k_pools[0], cache.v_pools[0], cache.block_table(["a"]), cache.context_lens(["a"]))
    for _ in range(2):
        autotile.paged_attention(torch.randn(1, 4, 32).half(), *tables, max_context=48)
    slots = cache.reserve("a", 3)
    autotile.paged_prefill(torch.randn(3, 4, 32).half(), cache.k_pools[0], cache.v_pools[0], cache.block_table(["a"]),
                           torch.tensor([0, 3], dtype=torch.int32), cache.context_lens(["a"]),
                           k_new=torch.randn(3, 1, 32).half(), v_new=torch.randn(3, 1, 32).half(), slot_mapping=slots)
    trace.flush()
    paged = [e for e in trace.read_trace(path) if e.family == "paged"]
    decode = [e for e in paged if e.problem["num_queries"] == 1 and e.problem["head_dim"] == 32
              and e.problem["max_context"] == 64]
    assert decode and decode[0].calls >= 2
    assert any(e.problem.get("num_tokens") == 3 or e.problem["num_queries"] > 1 for e in paged), paged


@pytest.mark.parametrize("text, message", [
    ("", "empty"),
    ('{"format": "something-else"}\n', "not an autotile trace"),
    ('{"format": "autotile-trace", "version": 99}\n', "version 99"),
    ('{"format": "autotile-trace", "version": 1}\n{"family": "gemm"', "not JSON"),
    ('{"format": "autotile-trace", "version": 1}\n{"family": "gemm", "device": "x", "problem": {}, "calls": 2}\n',
     "cut short"),
    ('{"format": "autotile-trace", "version": 1}\n{"family": "gemm", "device": "x", "problem": {}, "calls": -1}\n',
     "positive integer"),
])
def test_bad_trace_files_get_clear_errors(tmp_path, text, message):
    from autotile.runtime.trace import TraceFormatError, read_trace

    path = tmp_path / "t.jsonl"
    path.write_text(text)
    with pytest.raises(TraceFormatError, match=message):
        read_trace(path)


def test_problem_fields_of_a_stored_range_must_match_except_alignment(user_db):
    tuned = linear_problem(100)
    save(user_db, tuned, H200, FAMILY.default_config(tuned, H200), verified_range={"m": [65, 128]})
    unaligned = dataclasses.replace(linear_problem(70), aligned=False)
    got = dispatch.resolve(FAMILY, unaligned, H200)
    # The borrowed config is validated against the unaligned problem's own space (no TMA there).
    assert got.match == "range" or got.source == "vendor"


def test_empty_operands_give_empty_results_like_torch():
    assert autotile.matmul(torch.randn(0, 8), torch.randn(8, 5)).shape == (0, 5)
    assert autotile.matmul(torch.randn(3, 8), torch.randn(8, 0)).shape == (3, 0)
    assert autotile.linear(torch.randn(2, 0, 8), torch.randn(5, 8)).shape == (2, 0, 5)


def test_linear_and_matmul_take_a_residual():
    torch.manual_seed(1)
    x, w, r = torch.randn(2, 3, 40), torch.randn(24, 40), torch.randn(2, 3, 24)
    want = torch.nn.functional.silu(x.double() @ w.double().T) + r.double()
    got = autotile.linear(x, w, activation="silu", residual=r)
    assert torch.allclose(got.double(), want, atol=1e-4, rtol=1e-4)
    got = autotile.matmul(x.reshape(6, 40), w.t(), activation="silu", residual=r.reshape(6, 24))
    assert torch.allclose(got.double(), want.reshape(6, 24), atol=1e-4, rtol=1e-4)
    with pytest.raises(BadInputError, match="residual"):
        autotile.linear(x, w, residual=torch.randn(3, 24))


def test_a_strided_bias_is_read_where_its_elements_are():
    # The kernel reads the bias at unit stride: a strided one (a view of every other element) is made contiguous.
    torch.manual_seed(2)
    x, w, bias = torch.randn(5, 16), torch.randn(8, 16), torch.randn(16)[::2]
    want = x.double() @ w.double().T + bias.double()
    torch.testing.assert_close(autotile.matmul(x, w.t(), bias=bias).double(), want, atol=1e-4, rtol=1e-4)
    for _ in range(2):  # the linear signature's later calls too
        torch.testing.assert_close(autotile.linear(x, w, bias).double(), want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(autotile.linear(x.view(5, 1, 16), w, bias).double(), want.view(5, 1, 8),
                               atol=1e-4, rtol=1e-4)


def test_vendor_served_linear_calls_skip_every_check_after_the_first(monkeypatch):
    # The interpreter has no vendor op; give the family one here so the served path is F.linear itself.
    monkeypatch.setattr(FAMILY, "vendor_configs", lambda problem, device: [CUBLAS])
    dispatch.clear_cache()
    try:
        x, w = torch.randn(3, 16), torch.randn(8, 16)
        first = autotile.linear(x, w)
        assert autotile.explain("linear", x, w)["vendor"] == "cuBLAS (torch.matmul)"
        monkeypatch.setattr(ops_gemm, "direct_call_ok", lambda *a: pytest.fail("a vendor-served call was checked"))
        assert torch.equal(autotile.linear(x, w), first)
        x.requires_grad_(True)  # F.linear itself records the backward
        autotile.linear(x, w).sum().backward()
        assert torch.allclose(x.grad, w.sum(0).expand(3, 16))
    finally:
        dispatch.clear_cache()


@pytest.fixture
def vendor_linear(monkeypatch):
    """Linear calls served by the vendor op, with F.linear watched: the interpreter has no vendor op of its own."""
    monkeypatch.setattr(FAMILY, "vendor_configs", lambda problem, device: [CUBLAS])
    f_linear_calls = []

    def f_linear(*args):
        f_linear_calls.append(args)
        return torch.nn.functional.linear(*args)
    monkeypatch.setattr(ops_gemm, "_f_linear", f_linear)
    dispatch.clear_cache()
    yield f_linear_calls
    dispatch.clear_cache()


def test_a_vendor_served_2d_linear_is_the_cublas_call_of_f_linear_on_a_kept_transpose(vendor_linear):
    torch.manual_seed(0)
    x, w, bias = torch.randn(3, 16), torch.randn(8, 16), torch.randn(8)
    autotile.linear(x, w), autotile.linear(x, w, bias)  # the first calls: served, and their entries kept
    vendor_linear.clear()
    # at::linear makes a 2-D x mm(x, w.t()), with a bias addmm(bias, x, w.t()): the same numbers, bit for bit.
    assert torch.equal(autotile.linear(x, w), torch.mm(x, w.t()))
    assert torch.equal(autotile.linear(x, w, bias), torch.addmm(bias, x, w.t()))
    assert not vendor_linear
    # The weight updated in place (an optimizer's step, a copy_ of new weights): the kept view shares its storage.
    with torch.no_grad():
        w.mul_(2)
    assert torch.equal(autotile.linear(x, w), torch.mm(x, w.t()))
    assert not vendor_linear


@pytest.mark.parametrize("change", ["new storage", "rows sliced in place", "transposed in place", "other dtype"])
def test_a_vendor_served_linear_takes_f_linear_once_the_weight_is_not_what_was_kept(vendor_linear, change):
    torch.manual_seed(0)
    x, w = torch.randn(4, 16), torch.randn(16, 16)
    autotile.linear(x, w)
    vendor_linear.clear()
    if change == "new storage":  # nn.Module.to() and .half() keep the Parameter and replace its data
        w.data = torch.randn(16, 16)
    elif change == "rows sliced in place":  # the same data pointer, fewer rows
        w.data = w.data[:8]
    elif change == "transposed in place":  # the same data pointer and shape, other strides
        w.data = w.data.t()
    else:  # the same data pointer and shape, another 32-bit dtype
        w.data = w.data.view(torch.int32)
        with pytest.raises(RuntimeError):
            autotile.linear(x, w)
        assert vendor_linear
        return
    assert torch.equal(autotile.linear(x, w), torch.nn.functional.linear(x, w))
    assert vendor_linear


def test_a_vendor_served_linear_takes_f_linear_where_autograd_modes_or_rank_need_it(vendor_linear):
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(8, 16))
    x, x3 = torch.randn(3, 16), torch.randn(2, 3, 16)
    bias = torch.randn(8)
    with torch.no_grad():
        autotile.linear(x, w), autotile.linear(x3, w), autotile.linear(x3, w, bias)
        vendor_linear.clear()
        autotile.linear(x, w)
        assert not vendor_linear  # a Parameter under no_grad: the kept transpose
        assert torch.equal(autotile.linear(x3, w), torch.matmul(x3, w.t()))  # leading dims, no bias: at::linear's
        assert not vendor_linear
        autotile.linear(x3, w, bias)
        assert len(vendor_linear) == 1  # leading dims and a bias: F.linear
    vendor_linear.clear()
    out = autotile.linear(x, w)  # grad on, and the weight requires it: F.linear records the backward
    assert len(vendor_linear) == 1 and out.requires_grad
    out.sum().backward()
    assert torch.allclose(w.grad, x.sum(0).expand(8, 16))

    class Watch(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))
    vendor_linear.clear()
    with torch.no_grad(), Watch():  # a function mode may handle F.linear itself
        autotile.linear(x, w)
    assert len(vendor_linear) == 1


def test_a_freed_weight_takes_its_vendor_entry_and_the_kept_view_with_it(vendor_linear):
    x, w = torch.randn(3, 16), torch.randn(8, 16)
    autotile.linear(x, w)
    (entry,) = [e for e in ops_gemm._linear_fast.values() if isinstance(e, ops_gemm._VendorLinear)]
    storage = weakref.ref(entry.weight_t)
    vendor_linear.clear()  # the watched first call's arguments
    del entry, w
    assert not ops_gemm._linear_fast and storage() is None


def test_vendor_served_matmul_calls_skip_every_check_after_the_first(monkeypatch):
    monkeypatch.setattr(FAMILY, "vendor_configs", lambda problem, device: [CUBLAS])
    dispatch.clear_cache()
    try:
        a, b = torch.randn(3, 16, dtype=torch.bfloat16), torch.randn(8, 16, dtype=torch.bfloat16).t()
        first = autotile.matmul(a, b)
        assert autotile.explain("matmul", a, b)["vendor"] == "cuBLAS (torch.matmul)"
        (counter,) = ops_gemm._matmul_fast.values()
        bias = torch.randn(8, dtype=torch.bfloat16)
        with_bias = autotile.matmul(a, b, bias=bias)  # a signature of its own, checked once

        def checked(*args):
            raise RuntimeError("a vendor-served call was checked")
        monkeypatch.setattr(ops_gemm, "direct_call_ok", checked)
        assert torch.equal(autotile.matmul(a, b), first) and counter[0] == 2
        assert torch.equal(autotile.matmul(a, b.contiguous()), first)  # other strides: torch.matmul is right too
        a.requires_grad_(True)  # torch.matmul itself records the backward
        autotile.matmul(a, b).float().sum().backward()
        assert torch.allclose(a.grad.float(), b.float().sum(1).expand(3, 16), rtol=1e-2, atol=1e-2)  # bf16 rounding
        assert torch.equal(autotile.matmul(a.detach(), b, bias=bias), with_bias)
        assert torch.allclose(with_bias.float(), torch.addmm(bias, a.detach(), b).float())
        with pytest.raises(RuntimeError, match="checked"):  # a bias of another shape is checked (and refused)
            autotile.matmul(a.detach(), b, bias=bias[:1])
        # An epilogue, or fp32 operands, take the full signature.
        with pytest.raises(RuntimeError, match="checked"):
            autotile.matmul(a.detach(), b, activation="relu")
        with pytest.raises(RuntimeError, match="checked"):
            autotile.matmul(a.detach().float(), b.float())
    finally:
        dispatch.clear_cache()
    assert not ops_gemm._matmul_fast


def test_a_bound_linear_short_key_launches_only_while_its_guards_hold(monkeypatch):
    """ops_gemm._FastLinear stands for the full signature of a kernel-served linear: every change the kernel was not
    bound for (the weight object or its storage, x's layout or alignment, another bias, autograd) gives None, so
    that the call takes the full signature. CPU tensors stand in for a GPU's (device index -1)."""
    monkeypatch.setattr(ops_gemm, "_current_cuda_device", lambda: -1)
    launched = []

    def launch(x, w, b):
        launched.append(x)
        return x.new_empty((x.numel() // x.shape[-1], w.shape[0]))
    x, w, b = torch.randn(4, 16), torch.nn.Parameter(torch.randn(8, 16)), torch.randn(8)
    served = ops_gemm._Served(None, [0])
    fast = ops_gemm._FastLinear(served, launch, -1, x, w, b)
    with torch.no_grad():
        assert fast(torch.randn(4, 16), w, b) is not None and served.calls[0] == 1
        assert fast(torch.randn(65)[1:].view(4, 16), w, b) is None  # misaligned
        assert fast(torch.randn(16, 4).t(), w, b) is None  # another layout
        assert fast(x, w, torch.randn(8)) is None  # another bias object
        assert fast(x, torch.nn.Parameter(w.detach().clone()), b) is None  # another weight object
        assert fast(x, w, None) is None  # the kernel was bound with a bias
    with torch.enable_grad():
        assert fast(x, w, b) is None  # the weight requires grad: the op's dispatcher path
    with torch.no_grad():
        w.data = torch.randn(8, 16)  # storage swapped
        assert fast(x, w, b) is None
    assert len(launched) == 1 and served.calls[0] == 1
    three_d = ops_gemm._FastLinear(served, launch, -1, torch.randn(2, 2, 16), w, None)
    with torch.no_grad():
        assert three_d(torch.randn(2, 2, 16), w, None).shape == (2, 2, 8)


def test_a_bound_matmul_short_key_launches_only_while_its_guards_hold(monkeypatch):
    """ops_gemm._FastMatmul stands for the rest of a kernel-served matmul's signature: other strides of a, b or the
    bias, a misaligned operand or autograd give None (the full signature). CPU tensors stand in for a GPU's."""
    monkeypatch.setattr(ops_gemm, "_current_cuda_device", lambda: -1)
    launched = []

    def launch(a, b, bias):
        launched.append(a)
        return a.new_empty((a.shape[0], b.shape[1]))
    w, bias = torch.randn(8, 16), torch.randn(8)
    a, b = torch.randn(4, 16), w.t()
    served = ops_gemm._Served(None, [0])
    fast = ops_gemm._FastMatmul(served, launch, -1, a, b, bias)
    assert fast(torch.randn(4, 16), w.t(), bias) is not None and served.calls[0] == 1  # a new view of the weight
    assert fast(torch.randn(65)[1:].view(4, 16), b, bias) is None  # misaligned a
    assert fast(torch.randn(16, 4).t(), b, bias) is None  # a of another layout
    assert fast(a, w.t().contiguous(), bias) is None  # b row-major: another problem
    assert fast(a, b, torch.randn(16)[::2]) is None  # a strided bias
    assert fast(a, b, torch.randn(9)[1:]) is None  # a misaligned bias
    assert fast(a.requires_grad_(), b, bias) is None  # autograd: the op's dispatcher path
    assert len(launched) == 1 and served.calls[0] == 1


def test_only_kernel_served_16_bit_matmuls_keep_a_short_key(monkeypatch):
    # The interpreter never binds a launcher: a bound launch is stood in for, to see which signatures keep one.
    monkeypatch.setattr(ops_gemm, "_current_cuda_device", lambda: -1)
    dispatch.clear_cache()
    try:
        served = ops_gemm._Served(lambda *args: None, [0])
        served.run.bound_launch = lambda: (lambda a, b, bias: None, -1)
        a, b = torch.randn(4, 16, dtype=torch.bfloat16), torch.randn(8, 16, dtype=torch.bfloat16).t()
        ops_gemm._keep_fast_matmul(served, ops_gemm._shape_key(a, b, None), a, b, None)
        assert not ops_gemm._matmul_fast  # CPU tensors: no kernel is bound for them
        monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
        ops_gemm._keep_fast_matmul(served, ops_gemm._shape_key(a.float(), b.float(), None), a.float(), b.float(), None)
        assert not ops_gemm._matmul_fast  # fp32: its signature also depends on the TF32 switch
        ops_gemm._keep_fast_matmul(served, ops_gemm._shape_key(a, b, None), a, b, None)
        assert isinstance(ops_gemm._matmul_fast[ops_gemm._shape_key(a, b, None)], ops_gemm._FastMatmul)
    finally:
        dispatch.clear_cache()


def test_a_bound_gemm_hands_the_launcher_the_tensors_it_was_bound_with_in_their_places(monkeypatch):
    """The bound fast path (a GPU's decode GEMMs) puts each call's tensors where the first call's were."""
    from types import SimpleNamespace

    from autotile.families import gemm_launch
    from autotile.families.gemm_launch import BoundGemm

    calls = []
    launcher = lambda *args: calls.append(args)  # noqa: E731
    a, b, c, bias = (torch.zeros(2) for _ in range(4))
    ws, counters = torch.zeros(3), torch.zeros(1, dtype=torch.int32)
    plain = SimpleNamespace(workspace=0, counters=0)
    bound = BoundGemm(launcher, plain, [a, bias, b, c, 16, 1], dict(a=a, b=b, c=c, bias=bias, residual=None,
                                                                    ws=None, counters=None), 0)
    a2, b2, c2, bias2 = (torch.ones(2) for _ in range(4))
    bound(a2, b2, c2, bias2, None)
    assert [t is u for t, u in zip(calls[-1], (a2, bias2, b2, c2))] == [True] * 4 and calls[-1][4:] == (16, 1)
    split = SimpleNamespace(workspace=3, counters=1)
    monkeypatch.setattr(gemm_launch, "workspace", lambda dev, n: ws)
    monkeypatch.setattr(gemm_launch, "tile_counters", lambda dev, n: counters)
    bound = BoundGemm(launcher, split, [a, b, c, ws, counters, 8], dict(a=a, b=b, c=c, bias=None,
                                                                        residual=None, ws=ws, counters=counters), 0)
    bound(a2, b2, c2, None, None)
    assert [t is u for t, u in zip(calls[-1], (a2, b2, c2, ws, counters))] == [True] * 5 and calls[-1][5:] == (8,)


def test_a_bound_descriptor_gemm_encodes_each_base_address_once_and_keeps_the_argument_order(monkeypatch):
    """The gluon_ws kernel takes host-built TMA descriptors: a bound call passes each operand's encoding, made the
    first time its base address is seen (the weight's once), then the pointers in their places."""
    from types import SimpleNamespace

    from autotile.families import gemm_launch
    from autotile.families.gemm_launch import BoundDescriptorGemm

    calls, encoded = [], []
    launcher = lambda *args: calls.append(args)  # noqa: E731

    def encoder(role):
        def encode(t):
            encoded.append((role, t.data_ptr()))
            return (f"map of {role} at {t.data_ptr()}", 7, 8)
        return encode

    a, b, c, bias = (torch.zeros(4) for _ in range(4))
    ws, counters = torch.zeros(3), torch.zeros(1, dtype=torch.int32)
    monkeypatch.setattr(gemm_launch, "split_buffers", lambda dev, n, count: (ws, counters))
    plan = SimpleNamespace(workspace=3, counters=1, descriptor_sources=("a", "b", "b", "c"))
    args = ["a desc", "b desc", "b2 desc", "c desc", bias, ws, counters, 16, 8, 32, 1]
    bound = BoundDescriptorGemm(launcher, [encoder("a"), encoder("b"), encoder("b2"), encoder("c")], plan, args,
                                dict(a=a, b=b, c=c, bias=bias, residual=None, ws=ws, counters=counters), 0)
    a2, c2, c3, bias2 = (torch.ones(4) for _ in range(4))
    bound(a2, b, c2, bias2, None)
    bound(a2, b.view(2, 2).t(), c3, bias2, None)  # the weight as its transpose: one base address
    first, second = calls
    p = lambda t: t.data_ptr()  # noqa: E731
    assert first[:12] == (f"map of a at {p(a2)}", 7, 8, f"map of b at {p(b)}", 7, 8, f"map of b2 at {p(b)}", 7, 8,
                          f"map of c at {p(c2)}", 7, 8)
    assert [t is u for t, u in zip(first[12:15], (bias2, ws, counters))] == [True] * 3 and first[15:] == (16, 8, 32, 1)
    assert second[9] == f"map of c at {p(c3)}" and second[:9] == first[:9]
    assert encoded == [("a", p(a2)), ("b", p(b)), ("b2", p(b)), ("c", p(c2)), ("c", p(c3))]
    # The tma variant unsplit, with no epilogue tensor: the descriptors and the integers only.
    plain = SimpleNamespace(workspace=0, counters=0, descriptor_sources=("a", "b", "c"))
    bound = BoundDescriptorGemm(launcher, [encoder("a"), encoder("b"), encoder("c")], plain,
                                ["a desc", "b desc", "c desc", 16, 8, 32], dict(a=a, b=b, c=c), 0)
    bound(a2, b, c2, None, None)
    assert calls[-1] == (f"map of a at {p(a2)}", 7, 8, f"map of b at {p(b)}", 7, 8, f"map of c at {p(c2)}", 7, 8,
                         16, 8, 32)


def test_family_launches_of_descriptor_kernels_bind_once_per_signature(monkeypatch):
    """FAMILY.launch of a gluon_ws plan (tuning and the benchmarks time through it) takes a bound launch kept per
    plan and call signature: the descriptors are not rebuilt per call, and another stride or plan binds anew."""
    from types import SimpleNamespace

    from autotile.families import gemm_launch

    binds, calls = [], []

    def bind_plan(plan, a, b, c, bias, residual):
        binds.append((plan, a.stride()))
        return lambda *tensors: calls.append((plan, tensors))

    monkeypatch.setattr(gemm_launch, "bind_plan", bind_plan)
    plan = SimpleNamespace(descriptor_sources=("a", "b", "c"), interpret=False, bound={})
    other = SimpleNamespace(descriptor_sources=("a", "b", "c"), interpret=False, bound={})
    a, b, c = torch.zeros(4, 8, dtype=torch.bfloat16), torch.zeros(8, 2, dtype=torch.bfloat16), torch.zeros(4, 2)
    padded = torch.zeros(4, 16, dtype=torch.bfloat16)[:, :8]
    for _ in range(3):
        assert gemm_launch._run_bound_descriptors(plan, a, b, c, {"bias": None})
    assert gemm_launch._run_bound_descriptors(plan, padded, b, c, {})
    assert gemm_launch._run_bound_descriptors(other, a, b, c, {})
    assert binds == [(plan, (8, 1)), (plan, (16, 1)), (other, (8, 1))] and len(calls) == 2
    scales = {"scale_a": torch.ones(1), "scale_b": torch.ones(1)}
    fp8 = a.to(torch.float8_e4m3fn)
    assert not gemm_launch._run_bound_descriptors(plan, fp8, b, c, scales)  # fp8: launched as before
