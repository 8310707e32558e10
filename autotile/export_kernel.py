"""`autotile export-kernel`: the tuned kernel as one standalone Triton module, without autotile at run time.

The module is the family's template rendered with the winner's switches, then
a small launcher with the winner's constexprs, num_warps and num_stages baked
in. It imports torch and triton only. Only the gemm family has a launcher
writer so far (see `export_not_supported_reason`).
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import autotile
from autotile.device import DeviceInfo
from autotile.errors import AutotileError, ConfigOutsideSpaceError, DatabaseError
from autotile.families import get_family
from autotile.families.base import Family
from autotile.render import render_source
from autotile.space import Config


class ExportNotSupportedError(AutotileError):
    """A family whose launch cannot be written out as a standalone launcher (yet)."""


# Why each family without a launcher writer has none: its launch builds run-time state a fixed
# launcher of one tuned config does not have.
_UNSUPPORTED = {
    "flash": "its launch picks the forward kernel or the three backward kernels and sizes LSE/delta buffers "
             "from the softmax scale and direction at run time",
    "paged": "its launch sizes split-partition workspaces from the context lengths and re-renders with "
             "UPCAST_DOTS under the interpreter",
    "elementwise": "its launch lays out shapes and strides from the expression's lowering plan for each call",
}


def export_not_supported_reason(family_name: str) -> str | None:
    """None when `family_name` can be exported, else why not."""
    if family_name in _LAUNCHER_WRITERS:
        return None
    why = _UNSUPPORTED.get(family_name, "it has no launcher writer")
    return (f"export-kernel writes standalone kernels for {', '.join(sorted(_LAUNCHER_WRITERS))} only; "
            f"{family_name} is not supported because {why}")


@dataclass(frozen=True)
class ExportedKernel:
    family: str
    problem_key: str
    device_key: str
    config: Config
    origin: str  # 'exact winner in <db>', 'nearest winner (...) in <db>', 'config given', 'default config'
    median_ms: float | None
    source: str


def _stored_winner(family: Family, problem, device: DeviceInfo, db_url: str | None) -> tuple[Config, str, float] | None:
    """The winner for `problem` from the database (then the shipped one): exact problem, else the nearest tuned one."""
    from autotile.resources import shipped_db_path
    from autotile.store.db import default_db_url, open_engine, read_only_url
    from autotile.store.repo import Store

    sources = [db_url or default_db_url()]
    if shipped_db_path().exists():
        sources.append(read_only_url(shipped_db_path()))
    space = family.space(problem, device)
    key = family.problem_key(problem)
    for url in sources:
        try:
            winners = Store(open_engine(url, create=False)).winners(family.name, device.key)
        except DatabaseError:
            continue
        ranked = []
        for w in winners:
            if w.problem_key == key:
                ranked.append((-1.0, w))
                continue
            try:
                distance = family.distance(problem, family.problem_from_dict(w.params))
            except Exception:  # noqa: BLE001 - a row from another version of the family
                continue
            if distance is not None:
                ranked.append((distance, w))
        for distance, w in sorted(ranked, key=lambda r: r[0]):
            try:
                config = space.validate(Config.from_json(w.config))
            except ConfigOutsideSpaceError:
                continue
            where = "shipped tuning_db" if "mode=ro" in url else url
            origin = f"exact winner in {where}" if distance < 0 else f"nearest winner (tuned for {w.problem_key}) in {where}"
            return config, origin, w.median_ms
    return None


def export_kernel(family_name: str, problem, device: DeviceInfo, *, db_url: str | None = None,
                  config: Config | dict | None = None) -> ExportedKernel:
    """The standalone module for `problem`: the given config, else the stored winner, else the default config.

    >>> from autotile.families.gemm import contiguous_problem
    >>> from autotile.device import interpret_device
    >>> kernel = export_kernel("gemm", contiguous_problem(64, 64, 64, "fp16", "fp16"), interpret_device())
    >>> "def matmul(" in kernel.source
    True
    """
    reason = export_not_supported_reason(family_name)
    if reason:
        raise ExportNotSupportedError(reason)
    family = get_family(family_name)
    space = family.space(problem, device)
    median_ms = None
    if config is not None:
        chosen, origin = space.validate(config), "config given"
    else:
        found = _stored_winner(family, problem, device, db_url)
        if found is not None:
            chosen, origin, median_ms = found
        else:
            chosen, origin = family.default_config(problem, device), "default config (nothing tuned for it)"
    kernel = render_source(family.template, **family.render_switches(problem, chosen))
    timing = f"; measured {median_ms:.4f} ms" if median_ms is not None else ""
    header = "\n".join([
        f"# Standalone {family_name} kernel written by autotile {autotile.__version__} `export-kernel`.",
        f"# problem: {family.problem_key(problem)}",
        f"# config:  {chosen.to_json()}",
        f"# from: {origin}; device {device.key}{timing}",
        "# Needs torch and triton only. The launcher at the end checks that its inputs match this problem.",
    ])
    launcher = _LAUNCHER_WRITERS[family_name](problem, chosen)
    source = f"{header}\n{kernel.rstrip()}\n\n{launcher}"
    compile(source, f"<export-kernel {family_name}>", "exec")
    return ExportedKernel(family_name, family.problem_key(problem), device.key, chosen, origin, median_ms, source)


def write_kernel(kernel: ExportedKernel, out: Path) -> Path:
    """Write the module to `out` (whole, then renamed into place)."""
    out = Path(out)
    partial = out.with_name(out.name + ".partial")
    partial.write_text(kernel.source, encoding="utf-8")
    partial.replace(out)
    return out


def _gemm_launcher(problem, config: Config) -> str:
    from autotile.families.gemm import _REDUCE_BLOCK

    # NOTE: _REDUCE_BLOCK is private to families/gemm.py; the launcher must use the reduce tile the
    # family launches with, so it is read from there rather than copied.
    constexprs = {n: config[n] for n in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "SPLIT_K", "WARP_SPECIALIZE",
                                         "FLATTEN")}
    params = dataclasses.asdict(problem)
    return _GEMM_LAUNCHER.format(
        problem=json.dumps(params, sort_keys=True), config=repr(dict(config)), constexprs=repr(constexprs),
        num_warps=config["num_warps"], num_stages=config["num_stages"], variant=repr(config["VARIANT"]),
        persistent=bool(config["PERSISTENT"]), reduce_block=repr(tuple(_REDUCE_BLOCK)),
        m=problem.m, n=problem.n, k=problem.k,
    )


_GEMM_LAUNCHER = '''# --- launcher: the tuned config, baked in -------------------------------------------------------
import json as _json

import torch

PROBLEM = _json.loads({problem!r})
CONFIG = {config}
_CONSTEXPRS = {constexprs}
_NUM_WARPS = {num_warps}
_NUM_STAGES = {num_stages}
_VARIANT = {variant}
_PERSISTENT = {persistent}
_REDUCE_BLOCK = {reduce_block}  # (BLOCK_M, BLOCK_N) of the split-K reduction
_DTYPES = {{"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
           "fp8": getattr(torch, "float8_e4m3fn", None)}}
_allocator_set = False


def _cdiv(x, y):
    return (x + y - 1) // y


def _layout(t):
    if t.stride(-1) == 1 or t.shape[-1] == 1:
        return "row"
    if t.stride(0) == 1 or t.shape[0] == 1:
        return "col"
    return "strided"


def _check(name, t, shape, dtype, layout):
    if tuple(t.shape) != shape or t.dtype != dtype:
        raise ValueError(f"{{name}} must be {{shape}} {{dtype}} for this kernel, got {{tuple(t.shape)}} {{t.dtype}}")
    if layout is not None and _layout(t) != layout:
        raise ValueError(f"{{name}} must have layout {{layout!r}} (the kernel was rendered for it), got {{_layout(t)!r}}")
    if _VARIANT == "tma" and (t.data_ptr() % 16 or (max(t.stride()) * t.element_size()) % 16):
        raise ValueError(f"{{name}}: the TMA kernel needs 16-byte aligned base pointers and leading strides")


def matmul(a, b, bias=None, scale_a=None, scale_b=None):
    """C = act(scale_a * scale_b * (a @ b) + bias) for the one problem this kernel was tuned for (see PROBLEM).

    a ({m}, {k}) and b ({k}, {n}) of PROBLEM["dtype"] in PROBLEM's layouts; bias ({n},) when PROBLEM["bias"];
    scale_a, scale_b (1,) float32 for fp8. Returns C ({m}, {n}) of PROBLEM["out_dtype"].
    """
    m, n, k = PROBLEM["m"], PROBLEM["n"], PROBLEM["k"]
    operand = _DTYPES[PROBLEM["dtype"]]
    _check("a", a, (m, k), operand, None if PROBLEM["layout_a"] == "strided" else PROBLEM["layout_a"])
    _check("b", b, (k, n), operand, None if PROBLEM["layout_b"] == "strided" else PROBLEM["layout_b"])
    if (bias is not None) != PROBLEM["bias"]:
        raise ValueError("this kernel was rendered " + ("with" if PROBLEM["bias"] else "without") + " a bias")
    if (PROBLEM["dtype"] == "fp8") != (scale_a is not None and scale_b is not None):
        raise ValueError("pass scale_a and scale_b exactly when the operands are fp8")
    c = torch.empty(m, n, dtype=_DTYPES[PROBLEM["out_dtype"]], device=a.device)
    split = _CONSTEXPRS["SPLIT_K"]
    ws = torch.empty(split, m, n, dtype=torch.float32, device=a.device) if split > 1 else c
    bias_arg = bias if bias is not None else c  # unused pointers still need a tensor
    scale_a_arg = scale_a if scale_a is not None else c
    scale_b_arg = scale_b if scale_b is not None else c
    tiles = _cdiv(m, _CONSTEXPRS["BLOCK_M"]) * _cdiv(n, _CONSTEXPRS["BLOCK_N"])
    if _VARIANT == "tma":
        sms = torch.cuda.get_device_properties(a.device).multi_processor_count if a.is_cuda else 4
        grid = (min(tiles, sms) if _PERSISTENT else tiles,)
        global _allocator_set
        if a.is_cuda and not _allocator_set:  # TMA descriptors built on the device need scratch memory
            triton.set_allocator(lambda size, alignment, stream: torch.empty(size, device="cuda", dtype=torch.int8))
            _allocator_set = True
    else:
        grid = (tiles, split)
    gemm_kernel[grid](
        a, b, c, ws, bias_arg, scale_a_arg, scale_b_arg, m, n, k,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
        **_CONSTEXPRS, num_warps=_NUM_WARPS, num_stages=_NUM_STAGES,
    )
    if split > 1:
        bm, bn = _REDUCE_BLOCK
        gemm_splitk_reduce[(_cdiv(m, bm), _cdiv(n, bn))](
            ws, c, bias_arg, scale_a_arg, scale_b_arg, m, n, c.stride(0), c.stride(1),
            SPLIT_K=split, BLOCK_M=bm, BLOCK_N=bn, num_warps=4,
        )
    return c
'''

_LAUNCHER_WRITERS = {"gemm": _gemm_launcher}
