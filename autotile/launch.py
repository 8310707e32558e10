"""Launching a compiled Triton kernel with less host work than `kernel[grid](...)`.

Triton 3.6's `JITFunction.run` binds the arguments, computes the specialisation key,
looks the compiled kernel up and builds launch metadata on every call: 24-49 µs of host
time per GEMM launch on the H200 machines (benchmarks/results/launch_overhead_2026-11-29.md),
against 25-37 µs of GPU time of a 2048^3 or 16x8192x8192 bf16 GEMM: short kernels were
host-bound. Through this module the same launches took 19-31 µs, as cuBLAS's 13-21 µs.

`launch(kernel, grid, *args, **kwargs)` does what `kernel[grid](*args, **kwargs)` does.
The first call of a (kernel, device, keyword arguments, argument signature) goes
through Triton and keeps the CompiledKernel it returns; later calls hand the arguments
straight to that kernel's C launcher. The argument signature is at least as fine as
Triton's specialisation (dtype and 16-byte alignment of each tensor; for each integer,
whether it is 1, a multiple of 16, and its width), so a cached kernel is only reused
where Triton would pick the same one.

Triton's own path is kept for the interpreter, for argument types not recognised here,
while launch hooks are registered (profilers read their metadata), and while compiling
only (`compile_ahead.compile_only`). Within `compile_instead(fn)` a launch runs nothing:
it hands the kernel and its arguments to `fn`, which cross-compiles them (autotile.xcompile).
"""
from __future__ import annotations

import threading

import torch

from autotile.device import ensure_triton_allocator

_compiled: dict[tuple, tuple] = {}  # key -> (CompiledKernel, trailing arguments)
_lock = threading.Lock()
_state = threading.local()  # .slow: Triton's own path for this thread (compile-only blocks)
_bindings = None  # see _triton_bindings
_driver = None  # see _driver_calls


class _Unknown(Exception):
    """An argument whose specialisation this module does not reproduce: Triton's path handles it."""


_INT32_MIN, _INT32_END, _INT64_END = -2**31, 2**31, 2**63
_PLAIN = frozenset({float, bool, type(None)})  # Triton gives these one type each, never a value specialisation


def _signature(args: tuple) -> tuple:
    """One entry per argument, at least as fine as Triton's specialisation of it.

    NOTE: written as one loop with exact type tests first: isinstance(x, torch.Tensor) goes through the
    tensor metaclass and a per-argument helper doubled the cost (12 µs for a GEMM's 16 arguments).
    """
    out = []
    for x in args:
        kind = type(x)
        if kind is int:
            out.append((x == 1, not x & 15, _INT32_MIN <= x < _INT32_END, x < _INT64_END))
        elif kind is torch.Tensor or isinstance(x, torch.Tensor):
            out.append((x.dtype, not x.data_ptr() & 15))
        elif kind in _PLAIN:
            out.append(kind)
        elif kind in _descriptor_types():
            # Triton specialises a descriptor on its base's dtype, its block shape and (Gluon's) its layout; key None.
            out.append((kind, x.base.dtype, tuple(x.block_shape), getattr(x, "layout", None), x.padding))
        else:
            raise _Unknown
    return tuple(out)


_host_descriptors = None


def _descriptor_types() -> tuple:
    """The classes of host-built TMA descriptors, Triton's and Gluon's (the GEMM templates take them), imported once."""
    global _host_descriptors
    if _host_descriptors is None:
        from triton.tools.tensor_descriptor import TensorDescriptor

        types = [TensorDescriptor]
        try:
            from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor

            types.append(GluonTensorDescriptor)
        except ImportError:  # a Triton without Gluon
            pass
        _host_descriptors = tuple(types)
    return _host_descriptors


def argument_signature(args: tuple) -> tuple:
    """A hashable signature of launch arguments, at least as fine as Triton's specialisation of them (dtypes,
    16-byte alignment, integers that are 1 or multiples of 16, their widths): equal signatures compile alike.
    Raises TypeError for an argument it does not know."""
    try:
        return _signature(args)
    except _Unknown:
        raise TypeError("an argument of a type whose specialisation autotile.launch does not reproduce") from None


def _triton_bindings() -> tuple:
    """(JITFunction, knobs.runtime), imported once."""
    global _bindings
    if _bindings is None:
        from triton import knobs
        from triton.runtime.jit import JITFunction

        _bindings = (JITFunction, knobs.runtime)
    return _bindings


def _driver_calls() -> tuple:
    """(get_current_device, get_current_stream) of Triton's active driver; first asked for on a GPU launch."""
    global _driver
    if _driver is None:
        from triton.runtime import driver

        _driver = (driver.active.get_current_device, driver.active.get_current_stream)
    return _driver


def _hooks_registered(runtime) -> bool:
    for hook in (runtime.launch_enter_hook, runtime.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return True
    return False


class slow_path:
    """Within this block, this thread launches through Triton's own `kernel[grid](...)`."""

    def __enter__(self):
        self._before = getattr(_state, "slow", False)
        _state.slow = True
        return self

    def __exit__(self, *exc):
        _state.slow = self._before


class compile_instead(slow_path):
    """Within this block, this thread's launches (`launch`, `bind`) run nothing: each calls
    `compile_fn(kernel, grid, args, kwargs)` instead, with the arguments a family's own launch passes.

    The hot path pays nothing for it: the hook is looked at only on the slow path, which this block turns on.
    """

    def __init__(self, compile_fn):
        self._compile_fn = compile_fn

    def __enter__(self):
        self._before_fn = getattr(_state, "compile_fn", None)
        _state.compile_fn = self._compile_fn
        return super().__enter__()

    def __exit__(self, *exc):
        _state.compile_fn = self._before_fn
        return super().__exit__(*exc)


def _slow_launch(kernel, grid: tuple, args: tuple, kwargs: dict):
    """Triton's own `kernel[grid](...)`, or the compile-instead hook when one is set."""
    compile_fn = getattr(_state, "compile_fn", None)
    if compile_fn is not None:
        compile_fn(kernel, grid, args, kwargs)
        return None
    ensure_triton_allocator()
    return kernel[grid](*args, **kwargs)


def _needs_scratch(run) -> bool:
    """Whether a compiled kernel's launcher allocates scratch through Triton's allocator at each launch (kernels that
    build TMA descriptors on the device do); True where the launcher does not say."""
    return getattr(run, "global_scratch_size", 1) != 0


def launch(kernel, grid: tuple, *args, **kwargs) -> None:
    """`kernel[grid](*args, **kwargs)`, with the compiled kernel reused from the second call of a signature on.

    Positional arguments are the kernel's leading parameters; keyword arguments are its constexpr
    parameters and Triton's launch options (num_warps, num_stages, ...).
    """
    jit_function, runtime = _triton_bindings()
    if not isinstance(kernel, jit_function) or getattr(_state, "slow", False) or _hooks_registered(runtime):
        _slow_launch(kernel, grid, args, kwargs)
        return
    get_device, get_stream = _driver_calls()
    device = get_device()
    try:
        key = (kernel, device, tuple(kwargs.items()), _signature(args))
        entry = _compiled.get(key)
    except (_Unknown, TypeError):  # TypeError: an unhashable keyword value
        ensure_triton_allocator()
        kernel[grid](*args, **kwargs)
        return
    if entry is None:
        ensure_triton_allocator()
        compiled = kernel[grid](*args, **kwargs)
        if compiled is not None and hasattr(compiled, "packed_metadata"):
            with _lock:
                _compiled[key] = (compiled, _trailing_args(kernel, len(args), kwargs), _needs_scratch(compiled.run))
        return
    compiled, trailing, scratch = entry
    if scratch:
        ensure_triton_allocator()
    grid_y = grid[1] if len(grid) > 1 else 1
    grid_z = grid[2] if len(grid) > 2 else 1
    # The launcher takes every parameter in order, constexprs included (it skips those itself).
    compiled.run(grid[0], grid_y, grid_z, get_stream(device), compiled.function, compiled.packed_metadata,
                 None, None, None, *args, *trailing)


def bind(kernel, grid: tuple, *args, **kwargs):
    """Launch `kernel[grid](*args, **kwargs)` now, and return a launcher for later calls with the same signature.

    `launcher(*args)` takes new positional arguments that match these in every way Triton specialises on
    (dtypes, 16-byte alignment of pointers, the integers' classes; the caller guarantees it, e.g. by keying
    launchers on shapes, strides and alignment) and hands them straight to the compiled kernel's C launcher on
    the current stream of this device: no signature is computed per call. Returns None where the fast path
    does not apply (the interpreter, launch hooks, compile-only blocks); the caller then keeps calling `launch`.
    """
    compiled = _launch_compiled(kernel, grid, args, kwargs)
    if compiled is None:
        return None
    trailing = _trailing_args(kernel, len(args), kwargs)
    direct = c_launch(compiled.run)
    if direct is not None:
        return _direct_launcher(direct, compiled, grid, trailing)
    get_device, get_stream = _driver_calls()
    device = get_device()
    grid_x, grid_y, grid_z = (tuple(grid) + (1, 1))[:3]
    run, function, metadata = compiled.run, compiled.function, compiled.packed_metadata
    scratch = _needs_scratch(run)

    def launcher(*call_args) -> None:
        if scratch:
            ensure_triton_allocator()
        run(grid_x, grid_y, grid_z, get_stream(device), function, metadata, None, None, None, *call_args, *trailing)
    return launcher


def bind_descriptors(kernel, grid: tuple, *args, **kwargs):
    """`bind` for a kernel whose arguments include host-built TMA descriptors (Triton's or Gluon's TensorDescriptors):
    launch now, and return (launcher, encoders) for later calls, or None where the fast path does not apply.

    Triton's launcher turns each descriptor into a CUtensorMap (cuTensorMapEncodeTiled) on every call. Here the
    caller does it, once per base address: `encoders[i](tensor)` is the i-th descriptor argument with `tensor` as
    its base (the shape, strides and block of the descriptor bound), expanded as the C launcher takes it; and
    `launcher(*call_args)` takes the arguments with each descriptor so expanded.
    """
    compiled = _launch_compiled(kernel, grid, args, kwargs)
    if compiled is None:
        return None
    direct = c_launch(compiled.run, expanded=True)
    if direct is None:
        return None
    from triton.backends.nvidia.driver import make_tensordesc_arg

    descriptors = [x for x in args if type(x) in _descriptor_types()]
    metas = getattr(compiled.metadata, "tensordesc_meta", None) or [None] * len(descriptors)
    if len(metas) != len(descriptors):
        return None

    def encoder(bound, meta):
        def encode(tensor) -> tuple:
            # Triton's own expansion, of a stand-in with the bound shape, strides and padding and this base.
            stand_in = _DescriptorStandIn(tensor, bound.shape, bound.strides, bound.padding)
            return tuple(make_tensordesc_arg(stand_in, meta))
        return encode

    launcher = _direct_launcher(direct, compiled, grid, _trailing_args(kernel, len(args), kwargs))
    return launcher, [encoder(d, m) for d, m in zip(descriptors, metas)]


class KeptEncodings:
    """One descriptor argument of a bound launch (an encoder of bind_descriptors), its encodings kept per base address.

    A bound launch fixes the descriptor's shape, strides and block, so its encoding depends only on the base
    tensor's address: a weight's is encoded once, and activations and outputs, which the caching allocator hands
    out at few addresses, mostly hit. NOTE: encoding (cuTensorMapEncodeTiled through Triton's make_tensordesc_arg)
    costs a few us of host time a descriptor; a kept one costs a dict lookup.
    """

    __slots__ = ("encode", "kept")

    # Base addresses kept before the encodings are dropped and begun again. One signature serves a projection of
    # every layer (80 weights of one shape in Llama-3-70B), and a cache that cycles through more addresses than it
    # keeps would encode on every call.
    KEPT_ADDRESSES = 1024

    def __init__(self, encode):
        self.encode = encode
        self.kept: dict[int, tuple] = {}

    def __call__(self, tensor) -> tuple:
        """The descriptor over `tensor`, expanded as the bound launcher takes it."""
        address = tensor.data_ptr()
        encoding = self.kept.get(address)
        if encoding is None:
            if len(self.kept) >= self.KEPT_ADDRESSES:
                self.kept.clear()
            encoding = self.kept[address] = self.encode(tensor)
        return encoding


def _launch_compiled(kernel, grid: tuple, args: tuple, kwargs: dict):
    """Launch `kernel[grid](*args, **kwargs)` now; the CompiledKernel it ran, where a bound launcher may follow, else
    None (the interpreter, launch hooks, compile-only blocks: launched through Triton's own path or the hook)."""
    jit_function, runtime = _triton_bindings()
    if not isinstance(kernel, jit_function) or getattr(_state, "slow", False) or _hooks_registered(runtime):
        _slow_launch(kernel, grid, args, kwargs)
        return None
    ensure_triton_allocator()
    compiled = kernel[grid](*args, **kwargs)
    return compiled if compiled is not None and hasattr(compiled, "packed_metadata") else None


def _direct_launcher(direct: tuple, compiled, grid: tuple, trailing: tuple):
    """A launcher calling the C launch function of `direct` (c_launch's) with `compiled`'s kernel on the current
    stream of this device."""
    c_call, cooperative, pdl = direct
    get_device, get_stream = _driver_calls()
    device = get_device()
    grid_x, grid_y, grid_z = (tuple(grid) + (1, 1))[:3]
    function, metadata = compiled.function, compiled.packed_metadata

    def launcher(*call_args) -> None:
        c_call(grid_x, grid_y, grid_z, get_stream(device), function, cooperative, pdl, None, None, metadata, None,
               None, None, *call_args, *trailing)
    return launcher


class _DescriptorStandIn:
    """What Triton's make_tensordesc_arg reads of a TensorDescriptor, without its checks (done at bind time)."""

    __slots__ = ("base", "shape", "strides", "padding")

    def __init__(self, base, shape, strides, padding):
        self.base, self.shape, self.strides, self.padding = base, shape, strides, padding


# The Triton version whose launcher's Python wrapper c_launch reproduces.
_C_LAUNCH_TRITON = "3.6.0"


def c_launch(run, expanded: bool = False) -> tuple | None:
    """(C launch function, cooperative-grid flag, PDL flag) of a compiled kernel's launcher, where calling it
    directly does all that the launcher's Python wrapper would: Triton 3.6, and a kernel that needs no scratch
    buffers (the wrapper's only other work is allocating them). None otherwise: call `run` itself.

    A kernel with TMA descriptor arguments has its C function wrapped in one that expands each descriptor
    (triton.backends.nvidia.driver.wrap_handle_tensordesc): `expanded` asks for the C function under it, which
    takes the descriptors expanded already (bind_descriptors); without `expanded`, the wrapper.

    NOTE: the wrapper (triton.backends.nvidia.driver.CudaLauncher.__call__) costs ~1.3 us of host time a launch
    (a nested function and two scratch checks), a tenth of a decode GEMM's whole host budget; bound launchers skip
    it. tests/test_launch.py checks the arguments against the wrapper's own call.
    """
    import triton

    if triton.__version__ != _C_LAUNCH_TRITON:
        return None
    try:
        if run.global_scratch_size or run.profile_scratch_size:
            return None
        launch = run.launch
        if expanded:
            launch = _unwrapped(launch)
        return launch, run.launch_cooperative_grid, run.launch_pdl
    except AttributeError:
        return None


def _unwrapped(launch):
    """The C launch function under Triton 3.6's descriptor-expanding wrapper (the closure's `launcher`), or
    `launch` itself where it is not wrapped."""
    code = getattr(launch, "__code__", None)
    if code is None or "launcher" not in code.co_freevars:
        return launch
    return launch.__closure__[code.co_freevars.index("launcher")].cell_contents


def _trailing_args(kernel, positional: int, kwargs: dict) -> tuple:
    """The values of the kernel's parameters after the positional ones: keyword values, else defaults."""
    values = []
    for param in kernel.params[positional:]:
        if param.name in kwargs:
            values.append(kwargs[param.name])
        else:
            values.append(param.default)
    return tuple(values)


def clear() -> None:
    """Forget the kept compiled kernels (tests; a changed kernel cache)."""
    with _lock:
        _compiled.clear()
