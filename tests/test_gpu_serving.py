"""On a GPU: the served ops run without host syncs, capture in CUDA graphs, and give the vendor's results."""
from __future__ import annotations

import pytest
import torch

import autotile
from autotile.runtime import dispatch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(autouse=True)
def empty_user_db(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOTILE_DB", f"sqlite:///{tmp_path / 'empty.sqlite'}")
    dispatch.clear_cache()
    yield
    dispatch.clear_cache()


def _linear_inputs(m=16, n=1024, k=512, bias=False):
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16) if bias else None
    return x, w, b


@pytest.mark.parametrize("vendor", ["1", "0"])
def test_linear_and_matmul_capture_in_a_graph_without_syncs(monkeypatch, vendor):
    monkeypatch.setenv("AUTOTILE_VENDOR", vendor)
    x, w, b = _linear_inputs(bias=True)
    ops = [lambda: autotile.linear(x, w, b, activation="silu"), lambda: autotile.linear(x, w, b),
           lambda: autotile.linear(x, w), lambda: autotile.matmul(x, w.t())]
    for op in ops:
        op()  # first call of the signature: resolution and compilation happen outside the graph
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        torch.cuda.set_sync_debug_mode("error")
        try:
            op()  # a served call does no host sync
            with torch.cuda.graph(graph):
                out = op()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, op(), atol=2e-2, rtol=2e-2)


def test_untuned_shapes_are_served_by_the_vendor_and_match_it():
    x, w, b = _linear_inputs(m=37, n=3000, k=777, bias=True)
    info = autotile.explain("linear", x, w, b)
    assert info["source"] == "vendor" and info["vendor"] == "cuBLAS (torch.matmul)"
    torch.testing.assert_close(autotile.linear(x, w, b), torch.nn.functional.linear(x, w, b), atol=0, rtol=0)
    # Later calls take F.linear's own cuBLAS call on a kept transpose of the weight: the same bits.
    weight = torch.nn.Parameter(w)
    steps = torch.randn(4, 1, 777, device="cuda", dtype=torch.bfloat16)  # a decode step's (batch, 1, hidden)
    for inputs, bias in ((x, b), (x, None), (steps, None), (steps, b)):
        for _ in range(2):
            with torch.no_grad():
                got = autotile.linear(inputs, weight, bias)
            assert torch.equal(got, torch.nn.functional.linear(inputs, w, bias))


def test_vendor_off_runs_the_generated_kernel_correctly(monkeypatch):
    monkeypatch.setenv("AUTOTILE_VENDOR", "0")
    for m in (1, 5, 16, 300):
        x, w, b = _linear_inputs(m=m, n=520, k=1000, bias=True)
        info = autotile.explain("linear", x, w, b)
        assert info["vendor"] is None
        want = torch.nn.functional.linear(x.double(), w.double(), b.double())
        torch.testing.assert_close(autotile.linear(x, w, b).double(), want, atol=3e-2, rtol=2e-2)


def test_bound_linear_short_key_guards_fall_back_where_the_signature_changed(monkeypatch):
    # Later calls of a kernel-served linear take the short key (ops_gemm._FastLinear); each guard that fails must
    # send the call down the full signature, never to a kernel bound for other tensors.
    from autotile.runtime import ops_gemm

    monkeypatch.setenv("AUTOTILE_VENDOR", "0")
    x, w, b = _linear_inputs(m=8, n=520, k=1024, bias=True)

    def check(x, w, b):
        want = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
        got = autotile.linear(x, w, b)
        assert got.shape == want.shape
        torch.testing.assert_close(got.double(), want, atol=3e-2, rtol=2e-2)

    for _ in range(3):
        check(torch.randn_like(x), w, b)
    assert any(isinstance(v, ops_gemm._FastLinear) for v in ops_gemm._linear_fast.values())
    check(torch.randn(8 * 1024 + 1, device="cuda", dtype=torch.bfloat16)[1:].view(8, 1024), w, b)  # misaligned x
    check(torch.randn(1024, 8, device="cuda", dtype=torch.bfloat16).t(), w, b)  # x of another layout
    check(x, w, torch.randn_like(b))  # another bias object
    check(x, w, torch.randn(1040, device="cuda", dtype=torch.bfloat16)[::2])  # a strided bias
    w.data = torch.randn_like(w) / 32  # the weight's storage swapped, as checkpoint loaders do
    check(x, w, b)
    w.data = torch.randn(520, 2048, device="cuda", dtype=torch.bfloat16)[:, ::2]  # same shape, other strides
    check(x, w, b)
    check(torch.randn(2, 4, 1024, device="cuda", dtype=torch.bfloat16), w, None)  # leading batch dims
    check(torch.randn(2, 4, 1024, device="cuda", dtype=torch.bfloat16), w, None)
    with torch.inference_mode():
        check(torch.randn(2, 4, 1024, device="cuda", dtype=torch.bfloat16), w, None)


def test_bound_matmul_short_key_guards_fall_back_where_the_signature_changed(monkeypatch):
    # Later calls of a kernel-served matmul take the shapes' key (ops_gemm._FastMatmul); a call of other strides or
    # alignment must take the full signature, never the kernel bound for the first layout.
    from autotile.runtime import ops_gemm

    monkeypatch.setenv("AUTOTILE_VENDOR", "0")
    x, w, b = _linear_inputs(m=8, n=520, k=1024, bias=True)

    def check(a, b_operand, bias):
        want = a.double() @ b_operand.double() + (0 if bias is None else bias.double())
        torch.testing.assert_close(autotile.matmul(a, b_operand, bias=bias).double(), want, atol=3e-2, rtol=2e-2)

    for _ in range(3):
        check(torch.randn_like(x), w.t(), b)
    assert any(isinstance(v, ops_gemm._FastMatmul) for v in ops_gemm._matmul_fast.values())
    check(torch.randn(8 * 1024 + 1, device="cuda", dtype=torch.bfloat16)[1:].view(8, 1024), w.t(), b)  # misaligned
    check(torch.randn(1024, 8, device="cuda", dtype=torch.bfloat16).t(), w.t(), b)  # a of another layout
    check(x, w.t().contiguous(), b)  # b row-major
    check(x, (torch.randn_like(w) / 32).t(), torch.randn_like(b))  # another weight and bias: the same layout
    check(x, w.t(), torch.randn(1040, device="cuda", dtype=torch.bfloat16)[::2])  # a strided bias


@pytest.mark.parametrize("n", [1024, 4608])  # 128-column tiles; 144-column ones (two descriptors of B and C)
def test_gluon_ws_linear_takes_host_descriptors_of_each_calls_tensors(monkeypatch, n):
    # The gluon_ws kernel takes TMA descriptors built on the host, kept per base address by the bound launch: calls
    # with new activations, a swapped weight and a CUDA-graph capture must each get descriptors of their own tensors.
    from autotile.runtime import ops_gemm

    monkeypatch.setenv("AUTOTILE_VENDOR", "0")
    x, w, b = _linear_inputs(m=600 if n == 1024 else 1024, n=n, k=512 if n == 1024 else 2048, bias=True)
    served = autotile.explain("linear", x, w, b)["config"]
    assert served["VARIANT"] == "gluon_ws", served

    def check(x, w, b, got=None):
        want = torch.nn.functional.linear(x.double(), w.double(), b.double())
        got = autotile.linear(x, w, b) if got is None else got
        torch.testing.assert_close(got.double(), want, atol=3e-2, rtol=2e-2)

    for _ in range(3):
        check(torch.randn_like(x), w, b)
    assert any(isinstance(v, ops_gemm._FastLinear) for v in ops_gemm._linear_fast.values())
    w.data = torch.randn_like(w) / 32  # the weight's storage swapped: a new base address
    check(torch.randn_like(x), w, b)
    autotile.linear(x, w, b)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.graph(graph):
            out = autotile.linear(x, w, b)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    check(x, w, b, out)


def test_fuse_captures_in_a_graph_without_syncs():
    f = autotile.fuse("sin(x)**2 + cos(x)*y")
    x, y = torch.randn(10_000, device="cuda"), torch.randn(10_000, device="cuda")
    f(x=x, y=y)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.graph(graph):
            out = f(x=x, y=y)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.testing.assert_close(out, torch.sin(x) ** 2 + torch.cos(x) * y, atol=1e-5, rtol=1e-5)
