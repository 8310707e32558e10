"""The launchers `autotile export-kernel` appends to a rendered kernel: one writer per supported family.

A writer turns (problem, config) into Python source that imports torch only (the rendered kernel
above it imports triton), checks that a call matches the one tuned problem with clear errors, and
launches the kernel with the tuned config. Where a family lays out its launch on the host at call
time (elementwise strides, paged workspaces), the few lines of that logic are copied into the
launcher text: the written module must run without autotile.
"""
from __future__ import annotations

import dataclasses
import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass

from autotile.errors import BadInputError
from autotile.space import Config


@dataclass(frozen=True)
class LauncherWriter:
    """How one family's standalone module is finished."""

    entry_point: str  # the function the written module exposes, named after the public op
    write: Callable[[object, Config, dict], str]  # (problem, config, render switches used) -> launcher source
    # Render switches that make the kernel correct under Triton's CPU interpreter, for exports filed
    # under the interpreter device (such a kernel still compiles for a GPU, where it runs slower).
    interpreter_switches: Callable[[object], dict] = lambda problem: {}
    # (problem, config, space) -> (the config the module runs, a note saying what changed, '' for nothing): for
    # configs whose schedule the launcher cannot reproduce on its own.
    exportable: Callable[[object, Config, object], tuple[Config, str]] = lambda problem, config, space: (config, "")


def _constants(**values) -> str:
    """`NAME = <repr>` lines: plain Python literals the launcher body reads (never text to execute)."""
    return "\n".join(f"{name} = {value!r}" for name, value in values.items())


_LAUNCHER_RULE = "# --- launcher: the tuned config, baked in " + "-" * 55


# --- gemm -------------------------------------------------------------------------------

def _gemm_launcher(problem, config: Config, switches: dict) -> str:
    from autotile.device import interpret_device
    from autotile.families.gemm_launch import INTERPRETER_PROGRAMS
    from autotile.families.gemm_space import programs_per_sm, upgrade_config

    # The rendered kernel's module carries its own host side (launch_geometry, kernel_args), so the
    # launcher computes no schedule of its own; programs per SM is the family's estimate for Hopper.
    config = Config(upgrade_config(problem, config))
    constexprs = {n: config.get(n, 1) for n in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "SPLIT_K", "PROMOTE_TILES",
                                                "WARP_SPECIALIZE", "FLATTEN")}
    params = dataclasses.asdict(problem)
    return _GEMM_LAUNCHER.format(
        upcast=bool(switches.get("UPCAST_DOTS", False)),
        problem=json.dumps(params, sort_keys=True), config=repr(dict(config)), constexprs=repr(constexprs),
        num_warps=config["num_warps"], num_stages=config["num_stages"], variant=repr(config["VARIANT"]),
        persistent=bool(config["PERSISTENT"]), per_sm=programs_per_sm(problem, config, interpret_device()),
        cpu_programs=INTERPRETER_PROGRAMS, m=problem.m, n=problem.n, k=problem.k,
    )


def _gemm_interpreter_switches(problem) -> dict:
    # NOTE: Triton 3.6's interpreter computes bf16 tl.dot wrongly (see autotile/families/gemm_launch.py).
    return {"UPCAST_DOTS": problem.dtype in ("bf16", "fp16", "fp8")}


_GEMM_LAUNCHER = '''# --- launcher: the tuned config, baked in -------------------------------------------------------
import json as _json
import os

import torch

PROBLEM = _json.loads({problem!r})
CONFIG = {config}
_CONSTEXPRS = {constexprs}
_NUM_WARPS = {num_warps}
_NUM_STAGES = {num_stages}
_VARIANT = {variant}
_PERSISTENT = {persistent}
_PROGRAMS_PER_SM = {per_sm}  # programs of this config one Hopper SM holds at once
_CPU_PROGRAMS = {cpu_programs}  # programs the interpreter pretends run at once
_UPCAST_DOTS = {upcast}  # exported for Triton's CPU interpreter: 16-bit and fp8 dots in fp32
_DTYPES = {{"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
           "fp8": getattr(torch, "float8_e4m3fn", None)}}


def _layout(t):
    if t.stride(-1) == 1 or t.shape[-1] == 1:
        return "row"
    if t.stride(0) == 1 or t.shape[0] == 1:
        return "col"
    return "strided"


def _check(name, t, shape, dtype, layout, device=None, tma=True):
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{{name}} must be a torch.Tensor, got {{type(t).__name__}}")
    if tuple(t.shape) != shape or t.dtype != dtype:
        raise ValueError(f"{{name}} must be {{shape}} {{dtype}} for this kernel, got {{tuple(t.shape)}} {{t.dtype}}")
    if device is not None and t.device != device:
        raise ValueError(f"{{name}} is on {{t.device}}, a on {{device}}: use one device")
    if layout is not None and _layout(t) != layout:
        raise ValueError(f"{{name}} must have layout {{layout!r}} (the kernel was rendered for it), got {{_layout(t)!r}}")
    if tma and _VARIANT in ("tma", "gluon_ws") and (t.data_ptr() % 16 or (max(t.stride()) * t.element_size()) % 16):
        raise ValueError(f"{{name}}: the TMA kernel needs 16-byte aligned base pointers and leading strides")


def _scale_shapes(m, n, k):
    """(scale_a's, scale_b's) accepted shapes for PROBLEM["scale_mode"]."""
    mode, groups_k, groups_n = PROBLEM.get("scale_mode", "tensor"), -(-k // 128), -(-n // 128)
    if mode == "row":
        return ((m, 1), (m,)), ((1, n), (n,))
    if mode == "block":
        return ((m, groups_k),), ((groups_k, groups_n),)
    return ((), (1,), (1, 1)), ((), (1,), (1, 1))


def matmul(a, b, bias=None, scale_a=None, scale_b=None, residual=None):
    """C = act(scales * (a @ b) + bias) + residual for the one problem this kernel was tuned for (see PROBLEM).

    a ({m}, {k}) and b ({k}, {n}) of PROBLEM["dtype"] in PROBLEM's layouts; bias ({n},) when PROBLEM["bias"];
    residual ({m}, {n}) when PROBLEM["residual"]; float32 scale_a, scale_b for fp8 as PROBLEM["scale_mode"] says
    (tensor: one value each; row: ({m}, 1) and (1, {n}); block: per 1 x 128 group of a and 128 x 128 block of b).
    Returns C ({m}, {n}) of PROBLEM["out_dtype"].
    """
    m, n, k = PROBLEM["m"], PROBLEM["n"], PROBLEM["k"]
    operand = _DTYPES[PROBLEM["dtype"]]
    _check("a", a, (m, k), operand, None if PROBLEM["layout_a"] == "strided" else PROBLEM["layout_a"])
    _check("b", b, (k, n), operand, None if PROBLEM["layout_b"] == "strided" else PROBLEM["layout_b"], a.device)
    if (bias is not None) != PROBLEM["bias"]:
        raise ValueError("this kernel was rendered " + ("with" if PROBLEM["bias"] else "without") + " a bias")
    if (residual is not None) != PROBLEM.get("residual", False):
        raise ValueError("this kernel was rendered " + ("with" if PROBLEM.get("residual") else "without") + " a residual")
    if (PROBLEM["dtype"] == "fp8") != (scale_a is not None and scale_b is not None):
        raise ValueError("pass scale_a and scale_b exactly when the operands are fp8")
    out = _DTYPES[PROBLEM["out_dtype"]]
    if bias is not None:
        _check("bias", bias, (n,), out, None, a.device, tma=False)
    if residual is not None:
        _check("residual", residual, (m, n), out, None, a.device, tma=False)
    if scale_a is not None:
        for name, scale, shapes in zip(("scale_a", "scale_b"), (scale_a, scale_b), _scale_shapes(m, n, k)):
            if not isinstance(scale, torch.Tensor) or tuple(scale.shape) not in shapes or scale.dtype != torch.float32:
                raise ValueError(f"{{name}} must be float32 of shape {{' or '.join(map(str, shapes))}} "
                                 f"({{PROBLEM.get('scale_mode', 'tensor')}} scales), got "
                                 f"{{getattr(scale, 'dtype', type(scale).__name__)}} {{tuple(getattr(scale, 'shape', ()))}}")
            if scale.device != a.device:
                raise ValueError(f"{{name}} is on {{scale.device}}, a on {{a.device}}: use one device")
    if not a.is_cuda:
        if os.environ.get("TRITON_INTERPRET", "").strip().lower() not in ("1", "true", "yes", "on"):
            raise RuntimeError("CPU tensors run under Triton's interpreter: set TRITON_INTERPRET=1 before triton is "
                               "imported, or pass CUDA tensors")
        if PROBLEM["dtype"] in ("bf16", "fp8") and not _UPCAST_DOTS:
            raise ValueError("this kernel was exported for a GPU; Triton's CPU interpreter computes its "
                             f"{{PROBLEM['dtype']}} dots wrongly: export with --gpu interpret to run it on CPU tensors")
    c = torch.empty(m, n, dtype=out, device=a.device)
    if a.is_cuda:
        programs = torch.cuda.get_device_properties(a.device).multi_processor_count * _PROGRAMS_PER_SM
    else:
        programs = _CPU_PROGRAMS
    grid, workspace, counters, stream_k = launch_geometry(
        m, n, k, _CONSTEXPRS["BLOCK_M"], _CONSTEXPRS["BLOCK_N"], _CONSTEXPRS["BLOCK_K"], _CONSTEXPRS["SPLIT_K"],
        _PERSISTENT, programs)
    ws = torch.empty(workspace, dtype=torch.float32, device=a.device) if workspace else None
    tile_counters = torch.zeros(counters, dtype=torch.int32, device=a.device) if counters else None
    # The TMA variants' descriptors are built on the host by kernel_args: no launch needs Triton's scratch allocator.
    args = kernel_args(a, b, c, bias, residual, scale_a, scale_b, ws, tile_counters, stream_k,
                       (_CONSTEXPRS["BLOCK_M"], _CONSTEXPRS["BLOCK_N"], _CONSTEXPRS["BLOCK_K"]))
    gemm_kernel[grid](*args, **_CONSTEXPRS, num_warps=_NUM_WARPS, num_stages=_NUM_STAGES)
    return c
'''



# --- elementwise ------------------------------------------------------------------------

def _elementwise_launcher(problem, config: Config, switches: dict) -> str:
    from autotile.expr import DTYPE_NAMES
    from autotile.families import elementwise as elementwise_family
    from autotile.families.elementwise import FAMILY

    plan = FAMILY.plan(problem)
    bits_of = {s["index"]: s["bits"] for s in plan.steps if s["op"] == "scalar"}
    strided = problem.layout == "strided"
    return "\n".join([
        _LAUNCHER_RULE,
        "import contextlib as _contextlib",
        "import math as _math",
        "import struct as _struct",
        "",
        "import torch",
        "",
        _constants(
            PROBLEM=dataclasses.asdict(problem), CONFIG=dict(config), EXPRESSION=problem.expr,
            _INPUTS=tuple((n, plan.specs[n].dtype, plan.specs[n].kind) for n in plan.expression.inputs),
            _TENSOR_NAMES=plan.tensor_names, _SCALAR_NAMES=plan.scalar_names,
            _SCALAR_AS_FP64_BITS=tuple(bool(bits_of.get(i)) for i in range(len(plan.scalar_names))),
            _ONE_ELEMENT=tuple(sorted(plan.one_element)),
            _OUTPUTS=tuple((n, DTYPE_NAMES[d]) for n, d in zip(plan.expression.output_names, plan.output_dtypes)),
            _BARE=plan.expression.bare, _STRIDED=strided, _RANK=problem.rank if strided else 1,
            _INDEX_64=switches["INDEX_64"],
            _BLOCK_SIZE=config["BLOCK_SIZE"], _NUM_WARPS=config["num_warps"], _NUM_STAGES=config["num_stages"],
            _PERSISTENT=config["PERSISTENT"], _PROGRAMS_PER_SM=config["PROGRAMS_PER_SM"],
        ),
        # The family's own _collapse, so the written module lays out dimensions exactly as autotile does.
        _ELEMENTWISE_BODY.replace("# <collapse>\n", "from collections.abc import Sequence\n\n\n"
                                  + inspect.getsource(elementwise_family._collapse)),
    ])


def _elementwise_interpreter_switches(problem) -> dict:
    # The kernel rounds bf16 outputs itself (the interpreter's fp32 -> bf16 cast truncates).
    return {"INTERPRETED": True}


# NOTE: the slack and the persistent grid below are copies of autotile/families/elementwise.py
# (_INT32_SLACK, _INTERPRET_SMS, launch_plan, run): the written module must not import autotile.
# _collapse is the family's own function, inserted as source at the marker.
_ELEMENTWISE_BODY = '''# Offsets stay 32-bit while every reachable offset, plus one grid-stride step past the end, is
# below 2^31.
_INT32_SLACK = 2**25
_INTERPRET_SMS = 4  # programs per "SM" of the persistent grid under Triton's CPU interpreter
_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "fp64": torch.float64,
           "i8": torch.int8, "u8": torch.uint8, "i16": torch.int16, "i32": torch.int32, "i64": torch.int64,
           "bool": torch.bool}
_SCALAR_TYPES = {"bool": bool, "int": int, "float": float}


# <collapse>


def _checked_inputs(values):
    """The inputs by name, each checked against the tuned problem; 0-d tensors moved to the others' device."""
    names = [name for name, _, _ in _INPUTS]
    missing, extra = [n for n in names if n not in values], sorted(set(values) - set(names))
    if missing or extra:
        raise TypeError(f"{EXPRESSION!r} takes exactly {names} by name; missing {missing}, unexpected {extra}")
    for name, dtype, kind in _INPUTS:
        value = values[name]
        if kind == "scalar":
            if type(value) is not _SCALAR_TYPES[dtype]:
                raise TypeError(f"{name} must be a Python {dtype} for this kernel, got {type(value).__name__}")
            continue
        if not isinstance(value, torch.Tensor) or (value.dim() == 0) != (kind == "zero_dim"):
            want = "a 0-d tensor" if kind == "zero_dim" else "a tensor with at least one dimension"
            raise TypeError(f"{name} must be {want} for this kernel, got {type(value).__name__}")
        if value.dtype != _DTYPES[dtype]:
            raise ValueError(f"{name} must be {_DTYPES[dtype]} for this kernel, got {value.dtype}")
    tensors = [values[n] for n in _TENSOR_NAMES]
    devices = {t.device for t in tensors if t.dim() > 0} or {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(f"inputs are on different devices {sorted(map(str, devices))}; move them to one device")
    device = devices.pop()
    return {n: v.to(device) if isinstance(v, torch.Tensor) else v for n, v in values.items()}, device


def _geometry(tensors):
    """(broadcast shape, numel, kernel geometry arguments) of one call, checked against the rendered layout."""
    try:
        shape = tuple(torch.broadcast_shapes(*(t.shape for t in tensors.values())))
    except RuntimeError:
        shapes = ", ".join(f"{n}{tuple(t.shape)}" for n, t in tensors.items())
        raise ValueError(f"input shapes do not broadcast together: {shapes}") from None
    numel = _math.prod(shape)
    if numel != PROBLEM["numel"]:
        raise ValueError(f"this kernel was tuned for outputs of {PROBLEM['numel']} elements; "
                         f"these inputs broadcast to {shape} ({numel} elements)")
    for name in _ONE_ELEMENT:
        if tensors[name].numel() != 1:
            raise ValueError(f"{name} must hold a single element for this kernel (it is loaded once), "
                             f"got shape {tuple(tensors[name].shape)}")
    addressed = [n for n in _TENSOR_NAMES if n not in _ONE_ELEMENT]
    sizes, strides = _collapse(shape, [tensors[n].expand(shape).stride() for n in addressed])
    max_offset = max([numel] + [sum((s - 1) * st for s, st in zip(sizes, c)) for c in strides])
    if not _INDEX_64 and max_offset + _INT32_SLACK >= 2**31:
        raise ValueError(f"these strides reach offset {max_offset}; the kernel was rendered with 32-bit offsets")
    contiguous = len(sizes) == 1 and all(c == (1,) for c in strides)
    if not _STRIDED:
        if not contiguous:
            raise ValueError("this kernel was rendered for contiguous inputs of the output's shape (flat offsets); "
                             "these broadcast or are strided: pass .contiguous() tensors of one shape")
        return shape, numel, (numel,)
    if len(sizes) > _RANK:
        raise ValueError(f"these inputs collapse to {len(sizes)} strided dimensions ({sizes}); "
                         f"the kernel was rendered for at most {_RANK} (tuned for {PROBLEM['shape']})")
    # Fewer dims than the kernel decomposes: leading dims of size 1 (stride 0) address the same elements.
    pad = _RANK - len(sizes)
    sizes = (1,) * pad + sizes
    strides = [(0,) * pad + c for c in strides]
    return shape, numel, (numel,) + sizes + tuple(v for c in strides for v in c)


def fused(**values):
    """The outputs of EXPRESSION for the one problem this kernel was tuned for (see PROBLEM).

    Inputs by name as in autotile.fuse(EXPRESSION): tensors of the dtypes in _INPUTS (broadcast together
    as torch does, in the layout class the kernel was rendered for) and Python numbers for scalars.
    Returns a contiguous tensor of the broadcast shape, or a tuple of them for an expression of
    assignments. NOTE: under Triton's CPU interpreter, a kernel exported for a GPU truncates bf16
    outputs where the GPU rounds to nearest even; export with --gpu interpret for CPU runs.
    """
    values, device = _checked_inputs(values)
    tensors = {n: values[n] for n in _TENSOR_NAMES}
    shape, numel, geometry = _geometry(tensors)
    outputs = [torch.empty(shape, dtype=_DTYPES[dtype], device=device) for _, dtype in _OUTPUTS]
    if numel:
        scalars = []
        for name, as_bits in zip(_SCALAR_NAMES, _SCALAR_AS_FP64_BITS):
            value = values[name]
            # The kernel reads fp64 scalars from their int64 bits and bools as 0/1 integers.
            scalars.append(_struct.unpack("<q", _struct.pack("<d", float(value)))[0] if as_bits
                           else int(value) if isinstance(value, bool) else value)
        programs = (numel + _BLOCK_SIZE - 1) // _BLOCK_SIZE
        if _PERSISTENT:
            on_gpu = device.type == "cuda"
            sms = torch.cuda.get_device_properties(device).multi_processor_count if on_gpu else _INTERPRET_SMS
            programs = min(programs, sms * _PROGRAMS_PER_SM)
        on_device = torch.cuda.device(device) if device.type == "cuda" else _contextlib.nullcontext()
        with on_device:
            elementwise_kernel[(max(programs, 1),)](
                *tensors.values(), *scalars, *outputs, *geometry,
                BLOCK_SIZE=_BLOCK_SIZE, EVEN=numel % _BLOCK_SIZE == 0, num_warps=_NUM_WARPS, num_stages=_NUM_STAGES,
            )
    return outputs[0] if _BARE else tuple(outputs)
'''


# --- paged ------------------------------------------------------------------------------

def _paged_launcher(problem, config: Config, switches: dict) -> str:
    from autotile.families.paged import feature_args

    split = config["VARIANT"] == "split"
    return "\n".join([
        _LAUNCHER_RULE,
        "import contextlib as _contextlib",
        "import math as _math",
        "",
        "import torch",
        "",
        _constants(
            PROBLEM=dataclasses.asdict(problem), CONFIG=dict(config),
            _SPLIT=split, _UPCAST_DOTS=switches["UPCAST_DOTS"],
            _PARTITIONS=-(-problem.max_context // config["PARTITION_SIZE"]) if split else 1,
            _SHAPE_CONSTEXPRS=dict(PAGE_SIZE=problem.page_size, HEAD_DIM=problem.head_dim, GROUP=problem.group,
                                   NUM_QUERIES=problem.num_queries, ROWS=problem.rows),
            _BLOCK_N=config["BLOCK_N"], _PARTITION_SIZE=config["PARTITION_SIZE"],
            _NUM_WARPS=config["num_warps"], _NUM_STAGES=config["num_stages"],
            _FEATURES=feature_args(problem),  # as PagedLaunch passes them
        ),
        _PAGED_BODY,
    ])


def _paged_interpreter_switches(problem) -> dict:
    # NOTE: Triton 3.6's interpreter computes bf16 tl.dot wrongly (see PagedFamily.launch); upcast the operands.
    return {"UPCAST_DOTS": "bf16" in (problem.dtype, problem.kv_dtype)}


# NOTE: the checks and the workspace layout below are copies of autotile/runtime/ops_paged.py
# (_check_layout, _scale_tensor, _problem) and PagedFamily.launch: the written module must not import autotile.
_PAGED_BODY = '''_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp8": getattr(torch, "float8_e4m3fn", None)}


def _check_shapes(q4, k_cache, v_cache, block_table, context_lens):
    """Shapes, dtypes, devices and strides against the tuned problem; no values read."""
    p = PROBLEM
    want_q = (p["batch"], p["num_queries"], p["num_q_heads"], p["head_dim"])
    if tuple(q4.shape) != want_q or q4.dtype != _DTYPES[p["dtype"]]:
        raise ValueError(f"q must be {want_q} (or {want_q[:1] + want_q[2:]} for one query token) of "
                         f"{_DTYPES[p['dtype']]} for this kernel, got {tuple(q4.shape)} {q4.dtype}")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        want = (p["page_size"], p["num_kv_heads"], p["head_dim"])
        if cache.dim() != 4 or tuple(cache.shape[1:]) != want or cache.dtype != _DTYPES[p["kv_dtype"]]:
            raise ValueError(f"{name} must be (num_pages, {', '.join(map(str, want))}) of {_DTYPES[p['kv_dtype']]} "
                             f"for this kernel, got {tuple(cache.shape)} {cache.dtype}")
        if cache.stride(-1) != 1:
            raise ValueError(f"{name} must have unit stride along the head dim (pages may be strided otherwise)")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must have one shape")
    if block_table.dim() != 2 or block_table.shape[0] != p["batch"] or block_table.dtype != torch.int32:
        raise ValueError(f"block_table must be ({p['batch']}, max_pages) int32, "
                         f"got {tuple(block_table.shape)} {block_table.dtype}")
    if tuple(context_lens.shape) != (p["batch"],) or context_lens.dtype != torch.int32:
        raise ValueError(f"context_lens must be ({p['batch']},) int32, "
                         f"got {tuple(context_lens.shape)} {context_lens.dtype}")
    devices = {t.device for t in (q4, k_cache, v_cache, block_table, context_lens)}
    if len(devices) != 1:
        raise ValueError(f"q, caches, block_table and context_lens are on {sorted(map(str, devices))}: use one device")
    if q4.device.type == "cpu" and "bf16" in (p["dtype"], p["kv_dtype"]) and not _UPCAST_DOTS:
        raise ValueError("this kernel was exported for a GPU; Triton's CPU interpreter computes its bf16 dots "
                         "wrongly: export with --gpu interpret to run it on CPU tensors")


def _check_contexts(block_table, context_lens, num_pages):
    """Context lengths within the tuned maximum and the table, pages in the cache (one device sync)."""
    p = PROBLEM
    pages_in_use = (torch.arange(block_table.shape[1], device=block_table.device)[None, :]
                    < (context_lens[:, None] + p["page_size"] - 1) // p["page_size"])
    used = torch.where(pages_in_use, block_table, 0)
    # 0 marks a padding row (its output is zeros), as in autotile's own op.
    shortest_used = torch.where(context_lens > 0, context_lens, torch.iinfo(torch.int32).max).min()
    longest, shortest, shortest_used, top_page, bottom_page = torch.stack(
        [context_lens.max(), context_lens.min(), shortest_used, used.max(), used.min()]).tolist()
    if shortest < 0:
        raise ValueError(f"context_lens holds a negative length ({shortest}); 0 marks a padding row")
    if longest > 0 and shortest_used < p["num_queries"]:
        raise ValueError(f"every context must hold its {p['num_queries']} query token(s), or be 0 for a padding row; "
                         f"the shortest is {shortest_used}")
    if longest > p["max_context"]:
        raise ValueError(f"this kernel was tuned for contexts of at most {p['max_context']} tokens, got {longest}")
    if longest > block_table.shape[1] * p["page_size"]:
        raise ValueError(f"a context of {longest} tokens needs more than block_table's {block_table.shape[1]} pages")
    if bottom_page < 0 or top_page >= num_pages:
        raise ValueError(f"block_table points at page {top_page if top_page >= num_pages else bottom_page} within "
                         f"the contexts, outside the cache's {num_pages} pages")


def _fp8_scale(scale, name, device):
    """None, or a float / 1-element / (Hkv,) tensor -> (Hkv,) float32 on the device, for fp8 caches only."""
    heads = PROBLEM["num_kv_heads"]
    if (scale is not None) != (PROBLEM["kv_dtype"] == "fp8"):
        raise ValueError(f"pass {name} exactly when the caches are fp8 (stored values times the scale are K and V)")
    if scale is None:
        return None
    t = torch.as_tensor(scale, dtype=torch.float32, device=device).reshape(-1)
    if t.numel() not in (1, heads):
        raise ValueError(f"{name} must hold one value or one per KV head ({heads}), got {t.numel()}")
    return t.expand(heads).contiguous()


def paged_attention(q, k_cache, v_cache, block_table, context_lens, scale=None, k_scale=None, v_scale=None):
    """Decode attention over a paged KV cache for the one problem this kernel was tuned for (see PROBLEM).

    As autotile.paged_attention: q (B, Hq, D), or (B, Q, Hq, D) whose Q queries are the last Q positions
    of each context; k_cache, v_cache (num_pages, page_size, Hkv, D); block_table (B, max_pages) int32;
    context_lens (B,) int32, at most PROBLEM["max_context"]; k_scale, v_scale (a float or one per KV
    head) for fp8 caches; scale defaults to 1/sqrt(D). Returns a tensor shaped and typed like q.
    """
    if q.dim() not in (3, 4) or (q.dim() == 3 and PROBLEM["num_queries"] != 1):
        plain = " or (B, Hq, D)" if PROBLEM["num_queries"] == 1 else ""
        raise ValueError(f"q must be (B, {PROBLEM['num_queries']}, Hq, D){plain} for this kernel, got {tuple(q.shape)}")
    q4 = q if q.dim() == 4 else q.unsqueeze(1)
    _check_shapes(q4, k_cache, v_cache, block_table, context_lens)
    k_scale, v_scale = _fp8_scale(k_scale, "k_scale", q.device), _fp8_scale(v_scale, "v_scale", q.device)
    q4 = q4 if q4.stride(-1) == 1 else q4.contiguous()
    block_table = block_table if block_table.stride(-1) == 1 else block_table.contiguous()
    context_lens = context_lens.contiguous()
    _check_contexts(block_table, context_lens, k_cache.shape[0])
    scale = 1.0 / _math.sqrt(PROBLEM["head_dim"]) if scale is None else float(scale)
    out = torch.empty(q4.shape, dtype=q4.dtype, device=q4.device)
    batch, heads_kv, rows = PROBLEM["batch"], PROBLEM["num_kv_heads"], _SHAPE_CONSTEXPRS["ROWS"]
    if _SPLIT:
        # Workspace (B, Hkv, partitions, ROWS[, HEAD_DIM]) fp32: each partition's max, sum and accumulator.
        cut = batch * heads_kv * _PARTITIONS * rows
        ws = torch.empty(cut * (PROBLEM["head_dim"] + 2), dtype=torch.float32, device=q4.device)
        ws_max, ws_sum, ws_acc = ws[:cut], ws[cut:2 * cut], ws[2 * cut:]
    else:
        ws_max = ws_sum = ws_acc = out  # unused pointers still need a tensor
    on_device = torch.cuda.device(q4.device) if q4.is_cuda else _contextlib.nullcontext()
    with on_device:
        paged_attention_kernel[(heads_kv, batch, _PARTITIONS)](
            q4, k_cache, v_cache, out, block_table, context_lens,
            k_scale if k_scale is not None else out, v_scale if v_scale is not None else out,
            ws_acc, ws_max, ws_sum, scale, *_FEATURES, _PARTITIONS,
            q4.stride(0), q4.stride(1), q4.stride(2), out.stride(0), out.stride(1), out.stride(2),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_table.stride(0),
            **_SHAPE_CONSTEXPRS, BLOCK_N=_BLOCK_N, PARTITION_SIZE=_PARTITION_SIZE,
            num_warps=_NUM_WARPS, num_stages=_NUM_STAGES,
        )
        if _SPLIT:
            paged_attention_reduce[(heads_kv, batch)](
                out, context_lens, ws_acc, ws_max, ws_sum, _PARTITIONS,
                out.stride(0), out.stride(1), out.stride(2),
                HEAD_DIM=PROBLEM["head_dim"], GROUP=_SHAPE_CONSTEXPRS["GROUP"], ROWS=rows,
                NUM_QUERIES=PROBLEM["num_queries"], PARTITION_SIZE=_PARTITION_SIZE, num_warps=4,
            )
    return out if q.dim() == 4 else out.squeeze(1)
'''


def _paged_exportable(problem, config: Config, space) -> tuple[Config, str]:
    """The launcher walks a context whole or in fixed partitions ('whole', 'split'). The balanced variant's
    per-step schedule is planned on the device by the runtime, and the prefill variant's query tiles serve packed
    prompts: their modules run the nearest walk of the two, with the same key tiles, and say so."""
    if config["VARIANT"] not in ("balanced", "prefill"):
        return config, ""
    walks = ("split", "whole") if config["VARIANT"] == "balanced" else ("whole",)
    decode_block_m = space.axis("BLOCK_M").choices[0]  # decode walks keep the first (paged: block_m_prefill_only)
    for walk in walks:
        admitted = space.admit(dict(config, VARIANT=walk, BLOCK_M=decode_block_m))
        if admitted is not None:
            return admitted, (f"the {config['VARIANT']} variant is not exportable (its schedule is the runtime's): "
                              f"this module runs the {walk} walk with its key tiles")
    why = "; ".join(space.violations(dict(config, VARIANT=walks[-1], BLOCK_M=decode_block_m)))
    raise BadInputError(f"the {config['VARIANT']} variant is not exportable, and no whole or split walk holds this "
                        f"problem ({why}): call autotile.paged_prefill for prompts of many tokens")


LAUNCHER_WRITERS = {
    "gemm": LauncherWriter("matmul", _gemm_launcher, _gemm_interpreter_switches),
    "elementwise": LauncherWriter("fused", _elementwise_launcher, _elementwise_interpreter_switches),
    "paged": LauncherWriter("paged_attention", _paged_launcher, _paged_interpreter_switches, _paged_exportable),
}
