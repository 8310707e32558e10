"""Render Jinja2 templates into Triton source, write it to the kernel cache, import it.

Every rendered source is `ast.parse`d and written as `<sha>.py` under the
kernel cache, so tracebacks and Triton's errors point at readable code.
Template switches are structure only (bools, small ints, names from a family's
own enums): user text never reaches a template.
"""
from __future__ import annotations

import ast
import contextlib
import functools
import hashlib
import importlib.util
import json
import os
import sys
import tempfile
import threading
import warnings
from pathlib import Path
from types import ModuleType

import jinja2
import jinja2.meta

from autotile.errors import AutotileError, KernelCacheError
from autotile.paths import user_cache_dir
from autotile.resources import templates_dir


class TemplateRenderError(AutotileError):
    """A template rendered into something that is not valid Python."""


def configured_cache_dir() -> Path:
    """Where rendered kernels are kept: $AUTOTILE_CACHE_DIR/kernels, else $XDG_CACHE_HOME/autotile/kernels, else
    ~/.cache/autotile/kernels. Blank values count as unset, and a relative XDG_CACHE_HOME is ignored, as the XDG
    base directory specification says."""
    root = (os.environ.get("AUTOTILE_CACHE_DIR") or "").strip()
    return (Path(root).expanduser() if root else user_cache_dir()) / "kernels"


def kernel_cache_dir() -> Path:
    """The configured kernel cache folder, created; KernelCacheError where it cannot be."""
    path = configured_cache_dir()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise _cache_error(path, exc) from exc
    return path


def _cache_error(path: Path, exc: OSError) -> KernelCacheError:
    return KernelCacheError(f"cannot write rendered kernels to {path} ({exc.strerror or exc}): point "
                            "AUTOTILE_CACHE_DIR at a writable folder (it holds <folder>/kernels), or free some space")


@functools.lru_cache(maxsize=1)
def environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates_dir())),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )


def _check_switch(name: str, value) -> None:
    """Switch values are structure: numbers, bools, identifiers, or containers of those."""
    if isinstance(value, (bool, int, float)) or value is None:
        return
    if isinstance(value, str) and (value == "" or value.replace("_", "").isalnum()):
        return
    if isinstance(value, (tuple, list)):
        for item in value:
            _check_switch(name, item)
        return
    if isinstance(value, dict):
        for key, item in value.items():
            _check_switch(name, key)
            _check_switch(name, item)
        return
    raise TemplateRenderError(f"template switch {name}={value!r} is not a plain identifier, number or bool")


def render_source(template: str, **switches) -> str:
    """Render `template` with `switches` and return Python source that parses."""
    for name, value in switches.items():
        _check_switch(name, value)
    source = environment().get_template(template).render(**switches)
    try:
        ast.parse(source)
    except SyntaxError as exc:
        lines = source.splitlines()
        around = "\n".join(f"{i + 1:4d}| {lines[i]}" for i in range(max(0, (exc.lineno or 1) - 3), min(len(lines), (exc.lineno or 1) + 2)))
        raise TemplateRenderError(f"{template} rendered invalid Python at line {exc.lineno}: {exc.msg}\n{around}") from None
    return source


@functools.lru_cache(maxsize=None)
def template_sha(template: str) -> str:
    """Hash of a template's text and of the templates it includes or imports (gemm.py.j2 renders gemm_gluon_ws.py.j2
    and takes macros from gemm_common.j2): timings measured with another version of any of them are not comparable.
    A template that uses no other hashes as its own file's bytes alone."""
    digest = hashlib.sha256()
    for name in template_files(template):
        digest.update((templates_dir() / name).read_bytes())
    return digest.hexdigest()[:12]


def template_files(template: str) -> list[str]:
    """`template` first, then every template it includes or imports, directly or not, sorted by name."""
    seen: set[str] = set()
    pending = [template]
    while pending:
        name = pending.pop()
        if name in seen:
            continue
        seen.add(name)
        source = (templates_dir() / name).read_text()
        pending += [n for n in jinja2.meta.find_referenced_templates(environment().parse(source)) if n is not None]
    return [template] + sorted(seen - {template})


def source_sha(source: str) -> str:
    return hashlib.sha256(source.encode()).hexdigest()[:20]


def write_to_cache(source: str) -> Path:
    """The file holding `source` in the kernel cache (written if it is not there yet). A file there that does not
    hold its source (cut short by a crash, or edited) is written again; a cache that cannot be written is replaced,
    for this process, by a temporary folder. Each says so once: a broken cache never breaks a model."""
    name = f"{source_sha(source)}.py"
    try:
        return _cached_file(kernel_cache_dir() / name, source)
    except KernelCacheError as exc:
        try:
            return _cached_file(_process_folder(exc) / name, source)
        except (KernelCacheError, OSError):
            raise exc from None


def _cached_file(path: Path, source: str) -> Path:
    try:
        held = path.read_text(encoding="utf-8") if path.exists() else None
    except (OSError, UnicodeDecodeError):
        held = ""
    if held == source:
        return path
    if held is not None:
        _warn_once(f"damaged:{path.parent}", f"autotile: the kernel cache file {path} did not hold the kernel its name "
                                              "stands for (cut short or edited); it is written again")
    # Written whole then renamed: several tuning processes may render the same kernel at once.
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(source)
        os.replace(tmp, path)
    except OSError as exc:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        raise _cache_error(path.parent, exc) from exc
    return path


_process_cache: list[Path] = []
_warned: set[str] = set()


def _process_folder(reason: KernelCacheError) -> Path:
    """A temporary kernel folder of this process's own (removed at exit), for a cache that cannot be written."""
    if not _process_cache:
        import atexit
        import shutil

        folder = Path(tempfile.mkdtemp(prefix="autotile-kernels-"))
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        _process_cache.append(folder)
    _warn_once(f"unwritable:{configured_cache_dir()}", f"autotile: {reason}; this process renders its kernels into "
                                                      f"{_process_cache[0]} instead (they are not kept after it)")
    return _process_cache[0]


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=4)


_INTERPRET_LOCK = threading.RLock()


@contextlib.contextmanager
def interpreter_mode(on: bool):
    """Run (or import) Triton code under the CPU interpreter, or compiled, whatever the environment says.

    NOTE: triton decides interpreter vs compiler from TRITON_INTERPRET when a
    function is decorated and again at some run-time points, so the variable
    is set for the whole import or launch; CPU tensors take the interpreter
    even on a machine with a GPU.
    """
    with _INTERPRET_LOCK, warnings.catch_warnings():
        # NOTE: Triton 3.6's interpreter converts one-element numpy arrays to scalars, which numpy >= 1.25 deprecates:
        # a warning at every interpreted launch about Triton's code, not the caller's.
        warnings.filterwarnings("ignore", message="Conversion of an array with ndim > 0 to a scalar",
                                category=DeprecationWarning)
        before = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1" if on else "0"
        swapped = []
        try:
            if on:
                swapped += _interpret_language_helpers()
                swapped += _round_bf16_to_nearest()
            yield
        finally:
            for module, name, original in swapped:
                setattr(module, name, original)
            if before is None:
                os.environ.pop("TRITON_INTERPRET", None)
            else:
                os.environ["TRITON_INTERPRET"] = before


def _interpret_language_helpers() -> list:
    """Swap triton.language's own @jit helpers (tl.zeros, tl.sum, x.sum(), tl.cdiv, ...) for interpreted copies.

    NOTE: triton 3.6 decides at *its own* import whether those helpers are
    compiled or interpreted; imported without TRITON_INTERPRET=1 (any machine
    with a GPU), they refuse to run under the interpreter. Swapping them for
    the duration of an interpreted launch lets CPU tensors run on such machines.
    """
    import triton.language as tl
    import triton.language.standard as standard
    from triton.runtime.jit import JITFunction

    swapped = []
    # tensor methods (x.sum(), x.to(...).max()) are the same helpers bound to the tensor class
    for module in (tl, standard, tl.tensor):
        for name, value in list(vars(module).items()):
            if isinstance(value, JITFunction):
                replacement = _INTERPRETED_HELPERS.get(id(value))
                if replacement is None:
                    replacement = _INTERPRETED_HELPERS[id(value)] = _BindableInterpreted(value.fn)
                swapped.append((module, name, value))
                setattr(module, name, replacement)
    return swapped


_INTERPRETED_HELPERS: dict[int, object] = {}


def _round_bf16_to_nearest() -> list:
    """Swap the interpreter's fp32 -> bf16 casts for ones that round to nearest even, as the GPU's do.

    NOTE: Triton 3.6's interpreter truncates them (InterpreterBuilder.cast_impl passes no rounding mode, and
    create_fp_to_fp's rtne still truncates half the time): every bf16 value a kernel stored on the CPU was up to a
    whole unit in the last place off, biased toward zero (twice torch's error in a model's logits)."""
    builder, rounding = _bf16_rounding_casts()
    swapped = [(builder, name, getattr(builder, name)) for name in rounding]  # as they are now (calls may nest)
    for name, method in rounding.items():
        setattr(builder, name, method)
    return swapped


@functools.lru_cache(maxsize=1)
def _bf16_rounding_casts() -> tuple:
    """(InterpreterBuilder, the rounding cast methods by name), built once around its own."""
    import numpy as np
    from triton._C.libtriton import ir as _ir
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

    import triton.language as tl

    cast, fp_to_fp = InterpreterBuilder.cast_impl, InterpreterBuilder.create_fp_to_fp

    def rounded(src):
        bits = np.ascontiguousarray(src.data, dtype=np.float32).view(np.uint32)
        half = ((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
        half = np.where(np.isnan(src.data), np.uint32(0x7FC0), half).astype(np.uint16)
        return TensorHandle(half.view(np.uint16), tl.bfloat16)

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return rounded(src)
        return cast(self, src, dst_type)

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        # Only where the GPU rounds to nearest: the default, or asked for (a kernel's rtz stays a truncation).
        nearest = rounding_mode is None or rounding_mode == _ir.ROUNDING_MODE.RTNE
        if nearest and src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return rounded(src)
        return fp_to_fp(self, src, dst_type, rounding_mode)

    return InterpreterBuilder, {"cast_impl": cast_impl, "create_fp_to_fp": create_fp_to_fp}


def _bindable_interpreted_class():
    from triton.runtime.interpreter import InterpretedFunction

    class BindableInterpreted(InterpretedFunction):
        """An interpreted helper that also works as a tensor method (binds `self` like a function)."""

        def __get__(self, instance, owner=None):
            return self if instance is None else functools.partial(self, instance)

    return BindableInterpreted


def _BindableInterpreted(fn):  # noqa: N802 - a constructor, built on first use so triton loads lazily
    global _BINDABLE
    if _BINDABLE is None:
        _BINDABLE = _bindable_interpreted_class()
    return _BINDABLE(fn)


_BINDABLE = None


def launching(interpret: bool):
    """Context for launching an already imported kernel: the interpreter's set-up, or nothing at all.

    A compiled kernel does not consult TRITON_INTERPRET when it launches, so the compiled path stays
    free of environment writes and locks (it is on every call of a tuned op).
    """
    return interpreter_mode(True) if interpret else contextlib.nullcontext()


@functools.lru_cache(maxsize=None)
def _import_path(path_str: str, sha: str, interpret: bool) -> ModuleType:
    name = f"autotile_kernels.{'interp' if interpret else 'cuda'}_{sha}"
    spec = importlib.util.spec_from_file_location(name, path_str)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    with interpreter_mode(interpret):
        spec.loader.exec_module(module)
    return module


_loaded: dict[object, ModuleType] = {}


def load_kernel_module(template: str, *, interpret: bool, **switches) -> ModuleType:
    """Render, write to the kernel cache and import; memoised by template and switches.

    `interpret` picks Triton's CPU interpreter (CPU tensors) or the compiler (CUDA tensors).
    After the first call with a set of switches this is one dict lookup: launches stay cheap.
    """
    try:
        memo_key = (template, interpret, tuple(sorted(switches.items())))
        module = _loaded.get(memo_key)
    except TypeError:  # unhashable switch values (lists, dicts): key by their JSON
        memo_key = json.dumps([template, interpret, switches], sort_keys=True, default=str)
        module = _loaded.get(memo_key)
    if module is None:
        # NOTE: one thread at a time renders and imports: ast.parse is not thread-safe in CPython 3.11 ("AST
        # constructor recursion depth mismatch" when a server's threads make their first calls together). The lock
        # is the interpreter's, which imports take anyway, so no two locks are ever taken in either order.
        with _INTERPRET_LOCK:
            module = _loaded.get(memo_key)
            if module is None:
                source = render_source(template, **switches)
                path = write_to_cache(source)
                module = _loaded[memo_key] = _import_path(str(path), source_sha(source), interpret)
    return module
