"""The short launch path (autotile.launch) and the eager bypass of the dispatcher (autotile.runtime.eager)."""
from __future__ import annotations

import itertools

import pytest
import torch
import triton.language as tl
from torch._subclasses.fake_tensor import FakeTensorMode
from triton._C.libtriton import native_specialize_impl
from triton.backends.nvidia.compiler import CUDABackend
from triton.runtime.jit import JITFunction

from autotile import launch
from autotile.runtime.eager import direct_call_ok

INTS = [0, 1, 2, 15, 16, 17, 32, 48, -1, -16, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 16, -2**31, -2**31 - 1,
        2**40, 2**63 - 16, 2**63, 2**64 - 16]


def _triton_key(value):
    return native_specialize_impl(CUDABackend, value, False, True, True)


def test_argument_key_separates_whatever_triton_specialises_on():
    # Two arguments with one key must get one Triton specialisation, or a kept kernel would be reused wrongly.
    storage = torch.zeros(64, dtype=torch.float32)
    half = torch.zeros(64, dtype=torch.float16)
    values = INTS + [True, False, 1.0, 0.5, None, storage, storage[1:], storage[4:], half, half[8:], half[1:]]
    for x, y in itertools.combinations(values, 2):
        if launch._signature((x,)) == launch._signature((y,)):
            assert _triton_key(x) == _triton_key(y), (x, y)


def test_argument_key_of_unknown_types_falls_back_to_triton():
    with pytest.raises(launch._Unknown):
        launch._signature((1, "text"))


def _signature_only(x_ptr, n, BLOCK: tl.constexpr, EXTRA: tl.constexpr = 7):
    pass


def test_trailing_arguments_follow_the_signature():
    # JITFunction directly: under the interpreter (the tests' default) triton.jit gives an InterpretedFunction.
    kernel = JITFunction(_signature_only)
    assert launch._trailing_args(kernel, 2, {"BLOCK": 64, "num_warps": 4}) == (64, 7)
    assert launch._trailing_args(kernel, 1, {"n": 5, "BLOCK": 64, "EXTRA": 3}) == (5, 64, 3)


def test_direct_calls_only_for_plain_tensors_without_autograd():
    plain = torch.ones(3)
    leaf = torch.ones(3, requires_grad=True)
    assert direct_call_ok(plain, None, 1.5)
    assert not direct_call_ok(plain, leaf)
    with torch.no_grad():
        assert direct_call_ok(plain, leaf)
    assert not direct_call_ok(torch.ones(3, device="meta"))
    with FakeTensorMode():
        assert not direct_call_ok(torch.ones(3))


def test_matmul_on_fake_tensors_still_gives_shapes():
    import autotile

    with FakeTensorMode():
        a, b = torch.empty(5, 7), torch.empty(7, 3)
        assert autotile.matmul(a, b).shape == (5, 3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the short path launches compiled kernels: GPU only")
def test_kept_kernels_give_the_results_of_fresh_launches():
    from autotile.device import cuda_device
    from autotile.families.gemm import FAMILY, contiguous_problem

    device = cuda_device(0)
    problem = contiguous_problem(100, 72, 40, "fp16", "fp16")
    config = FAMILY.default_config(problem, device)
    base = torch.randn(200 * 40 + 8, device="cuda", dtype=torch.float16)
    b = torch.randn(40, 72, device="cuda", dtype=torch.float16)
    for offset in (0, 0, 1, 8, 1):  # aligned, again (kept kernel), unaligned, aligned, unaligned again
        a = base[offset:offset + 100 * 40].view(100, 40)
        out = FAMILY.allocate_outputs(problem, {"a": a, "b": b})
        FAMILY.launch(problem, config, {"a": a, "b": b}, out)
        torch.testing.assert_close(out["c"].float(), a.float() @ b.float(), atol=0.05, rtol=0.01)


def test_triton_allocator_is_set_in_each_thread_that_launches():
    # Triton keeps its scratch allocator in a ContextVar: autograd's backward thread and a server's workers start
    # without the one the first launching thread set, and TMA kernels failed there ("no allocator was set").
    import threading

    import triton
    from triton.runtime._allocation import NullAllocator, _allocator

    from autotile.device import ensure_triton_allocator

    def own(size, alignment, stream):  # a user's allocator
        raise AssertionError("never called here")

    seen = {}

    def fresh_thread():
        seen["none_before"] = isinstance(_allocator.get(), NullAllocator)
        ensure_triton_allocator()
        seen["set_after"] = not isinstance(_allocator.get(), NullAllocator)

    def thread_with_its_own():
        triton.set_allocator(own)
        ensure_triton_allocator()
        seen["kept"] = _allocator.get() is own

    for target in (fresh_thread, thread_with_its_own):
        worker = threading.Thread(target=target)
        worker.start()
        worker.join()
    assert seen == {"none_before": True, "set_after": True, "kept": True}


def _recorded_launcher(calls: list, scratch: int):
    """A launcher running Triton 3.6's own Python wrapper (CudaLauncher.__call__), a recorder in place of its C launch."""
    from triton.backends.nvidia.driver import CudaLauncher

    run = CudaLauncher.__new__(CudaLauncher)
    run.num_ctas, run.launch = 1, lambda *args: calls.append(args)
    run.global_scratch_size, run.global_scratch_align = scratch, 128
    run.profile_scratch_size, run.profile_scratch_align = 0, 1
    run.launch_cooperative_grid, run.launch_pdl = False, True
    return run


def _bind_fake(monkeypatch, run):
    """launch.bind of a JITFunction whose compile gives a kernel launched by `run` (device 0, stream 777)."""
    from types import SimpleNamespace

    compiled = SimpleNamespace(run=run, function=5, packed_metadata=("meta",))
    monkeypatch.setattr(launch, "_driver", (lambda: 0, lambda device: 777))  # (current device, its stream)
    monkeypatch.setattr(JITFunction, "__getitem__", lambda self, grid: (lambda *a, **k: compiled))
    return launch.bind(JITFunction(_signature_only), (3, 2), "x", 10, BLOCK=64, num_warps=4)


def test_bound_launchers_call_tritons_c_launch_as_its_wrapper_would(monkeypatch):
    # bind() skips the Python wrapper of Triton's launcher (~1.3 us a launch) where the kernel needs no scratch
    # buffers: its C launch must get exactly the arguments the wrapper would hand it.
    from types import SimpleNamespace

    from triton.backends.nvidia.driver import CudaLauncher
    from triton.runtime._allocation import _allocator

    calls, wrapper_calls = [], []
    wrapper = CudaLauncher.__call__
    monkeypatch.setattr(CudaLauncher, "__call__", lambda self, *a: (wrapper_calls.append(1), wrapper(self, *a)))
    token = _allocator.set(lambda size, alignment, stream: SimpleNamespace(size=size))
    try:
        for scratch in (0, 64):
            run = _recorded_launcher(calls, scratch)
            bound = _bind_fake(monkeypatch, run)
            calls.clear()
            wrapper_calls.clear()
            bound("y", 11)
            assert len(wrapper_calls) == (1 if scratch else 0)  # scratch buffers: the wrapper allocates them
            run(3, 2, 1, 777, 5, ("meta",), None, None, None, "y", 11, 64, 7)  # the wrapper, as launch.launch calls it
            direct, wrapped = calls
            assert direct[:7] == wrapped[:7] and direct[8:] == wrapped[8:]
            assert (direct[7] is None) == (wrapped[7] is None) and getattr(direct[7], "size", 0) == getattr(
                wrapped[7], "size", 0)
    finally:
        _allocator.reset(token)


def test_launches_that_build_descriptors_ask_for_the_allocator_in_the_launching_thread(monkeypatch):
    # The op's backward runs in autograd's thread, where the allocator the forward's thread set is missing: a bound
    # launch of a kernel with scratch buffers sets it (autotile.device.ensure_triton_allocator) in whichever thread
    # launches, every time; one without scratch never asks.
    import threading
    from types import SimpleNamespace

    from triton.runtime._allocation import _allocator

    asked = []

    def ensure():  # records the asking thread, and gives it an allocator as the real one would
        asked.append(threading.get_ident())
        _allocator.set(lambda size, alignment, stream: SimpleNamespace(size=size))

    monkeypatch.setattr(launch, "ensure_triton_allocator", ensure)
    token = _allocator.set(_allocator.get())  # this thread's allocator is restored at the end
    try:
        tma = _bind_fake(monkeypatch, _recorded_launcher([], 64))
        pointer = _bind_fake(monkeypatch, _recorded_launcher([], 0))
        asked.clear()  # (binding launched each once, in this thread)
        failed = []
        worker = threading.Thread(target=lambda: (tma("y", 11), pointer("y", 11), failed.append(False)))
        worker.start()
        worker.join()
        tma("y", 11)
    finally:
        _allocator.reset(token)
    assert failed == [False] and asked == [worker.ident, threading.get_ident()]


def _descriptor(t, block, swizzle_dtype=None):
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    gl_dtype = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}
    layout = gl.NVMMASharedLayout.get_default_for(block, gl_dtype[swizzle_dtype or t.dtype])
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block, layout)


def test_descriptor_arguments_key_as_triton_specialises_them():
    # Host-built TMA descriptors (the gluon_ws GEMM's) take the short launch path: their key must separate what
    # Triton's does (base dtype, block shape, layout), or a kept kernel would be reused for another descriptor.
    bf16, f16 = torch.zeros(64, 64, dtype=torch.bfloat16), torch.zeros(64, 64, dtype=torch.float16)
    values = [_descriptor(bf16, [64, 32]), _descriptor(bf16, [32, 64]), _descriptor(f16, [64, 32]),
              _descriptor(bf16[:32], [64, 32]), _descriptor(bf16, [64, 32], torch.float32),
              _descriptor(torch.zeros(128, 64, dtype=torch.bfloat16), [64, 32])]
    for x, y in itertools.combinations(values, 2):
        if launch._signature((x,)) == launch._signature((y,)):
            assert _triton_key(x) == _triton_key(y), (x, y)
    assert len({launch._signature((x,)) for x in values}) == 4  # the base's shape is no specialisation


def test_bound_descriptor_launchers_call_tritons_c_launch_as_its_wrapper_would(monkeypatch):
    # bind_descriptors hands Triton's C launch the descriptors expanded by the caller's encoders (once a base
    # address): the C launch must get exactly what Triton's wrapper (which expands them itself) would hand it.
    from types import SimpleNamespace

    from triton.backends.nvidia.driver import CudaLauncher, wrap_handle_tensordesc

    calls = []
    run = CudaLauncher.__new__(CudaLauncher)
    signature = {"x_ptr": "tensordesc<bf16[16, 32]>", "n": "i32", "BLOCK": "constexpr", "EXTRA": "constexpr"}
    run.num_ctas = 1
    run.launch = wrap_handle_tensordesc(lambda *args: calls.append(args), signature, None)
    run.global_scratch_size, run.global_scratch_align, run.profile_scratch_size, run.profile_scratch_align = 0, 1, 0, 1
    run.launch_cooperative_grid, run.launch_pdl = False, True
    compiled = SimpleNamespace(run=run, function=5, packed_metadata=("meta",), metadata=SimpleNamespace())
    monkeypatch.setattr(launch, "_driver", (lambda: 0, lambda device: 777))
    monkeypatch.setattr(JITFunction, "__getitem__", lambda self, grid: (lambda *a, **k: compiled))
    bound_with = torch.zeros(32, 64, dtype=torch.bfloat16)
    launcher, encoders = launch.bind_descriptors(JITFunction(_signature_only), (3, 2),
                                                 _descriptor(bound_with, [16, 32]), 10, BLOCK=64, num_warps=4)
    other = torch.zeros(32, 64, dtype=torch.bfloat16)
    calls.clear()
    launcher(*encoders[0](other), 11)
    run(3, 2, 1, 777, 5, ("meta",), None, None, None, _descriptor(other, [16, 32]), 11, 64, 7)
    direct, wrapped = calls
    assert direct == wrapped and direct[13] is other


def test_first_loads_from_many_threads_render_one_at_a_time(monkeypatch):
    """A server's threads making their first calls together raced in ast.parse ("SystemError: AST constructor
    recursion depth mismatch", CPython 3.11): kernel modules are now rendered and imported one at a time."""
    import threading
    import time

    from autotile import render

    inside, most = [0], [0]
    real = render.render_source

    def slow_render(template, **switches):
        inside[0] += 1
        most[0] = max(most[0], inside[0])
        time.sleep(0.02)
        try:
            return real(template, **switches)
        finally:
            inside[0] -= 1

    from autotile.device import interpret_device
    from autotile.families.gemm import FAMILY, contiguous_problem

    problems = [contiguous_problem(64, 64, 64, "fp32", "fp32", bias=bias, activation=act)
                for bias in (False, True) for act in ("none", "relu", "silu")]
    switches = [FAMILY.render_switches(p, FAMILY.default_config(p, interpret_device())) for p in problems]
    monkeypatch.setattr(render, "render_source", slow_render)
    monkeypatch.setattr(render, "_loaded", {})
    errors = []

    def load(i):
        try:
            render.load_kernel_module(FAMILY.template, interpret=True, **switches[i])
        except Exception as exc:  # noqa: BLE001 - the test reports every thread's failure
            errors.append(exc)

    threads = [threading.Thread(target=load, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and most[0] == 1
