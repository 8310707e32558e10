"""Tiled GEMM: C = act(scales * (A @ B) + bias) + residual; fp32/tf32, fp16, bf16 and fp8 e4m3 operands.

The point of tiling is reuse: each (BLOCK_M x BLOCK_K) tile of A and
(BLOCK_K x BLOCK_N) tile of B is read from HBM once per output tile and used
BLOCK_N (resp. BLOCK_M) times from shared memory and registers. Where the tiles
do not fill the GPU (decode-sized M, long K, tile counts that leave the last
wave mostly empty) the work of a tile is split over several programs, by equal
K shares (split-K) or by an even share of all K iterations (stream-K), and
finished deterministically in the same launch (templates/gemm.py.j2).

Modules: gemm_space.py (axes, constraints, resource estimates), gemm_policy.py
(the config of an untuned shape and the seeds of a search, per regime),
gemm_launch.py (launch plans, the workspace and the tile counters).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from autotile.arch import Feature, arch_of
from autotile.device import DeviceInfo
from autotile.dtypes import canonical_dtype_name, element_size, torch_dtype
from autotile.errors import BadInputError, ShapeMismatchError, UnsupportedDtypeError
from autotile.families.base import (
    VENDOR_KEY, Baseline, Cost, Family, ProblemOption, Tensors, Tolerance, is_vendor,
)
from autotile.families.gemm_launch import bind_gemm, launch_plan, run_plan
from autotile.families.gemm_policy import preferred_config, seed_variations
from autotile.families.gemm_space import (FP8_PRECISE_INTERVAL, GLUON_TWO_PART, GLUON_WS, SCALE_BLOCK,
                                          clamps_col_tiles, clamps_row_tiles, coalesced_partials, gemm_space,
                                          gluon_swapped, gluon_tile_cols, owned_splits)
from autotile.layouts import base_aligned
from autotile.space import Config, Space

OPERAND_DTYPES = ("fp32", "fp16", "bf16", "fp8")
OUTPUT_DTYPES = ("fp32", "fp16", "bf16")
ACTIVATIONS = ("none", "relu", "gelu", "silu")
LAYOUTS = ("row", "col", "strided")  # unit stride along the last dim / the first dim / neither
# fp8 scales: one per operand, one per row of A and per column of B (C's rows and columns), or one per
# 1 x 128 group of A's K and per 128 x 128 block of B (DeepSeek-V3's recipe for fp8 LLM weights).
SCALE_MODES = ("tensor", "row", "block")
# Problem fields added after winners were first stored: a problem's key leaves them out while they hold
# these defaults, so keys (and stored winners) of problems that do not use them stay what they were.
_LATER_FIELDS = {"residual": False, "scale_mode": "tensor", "fp8_fast_accum": False}

# Unit roundoff of each output dtype (half an ulp at 1.0).
_UNIT_ROUNDOFF = {"fp32": 2.0**-24, "fp16": 2.0**-11, "bf16": 2.0**-8}
# tf32 keeps 10 explicit mantissa bits of each fp32 operand, and the tensor cores truncate rather
# than round the other 13: a one-sided relative error of up to 2^-10 per operand.
_TF32_TRUNCATION = 2.0**-10
# Hopper's fp8 tensor cores accumulate in about 14 significant bits (DeepSeek-V3 report, sec. 3.3.2,
# which promotes to fp32 every 128 products). Precise mode promotes at least every
# FP8_PRECISE_INTERVAL products, block scales every SCALE_BLOCK; fast accumulation never does.
_FP8_ACC_ROUNDOFF = 2.0**-14
# e4m3's largest finite value: scales map each group's largest magnitude onto it.
_E4M3_MAX = 448.0


# Why fp8_fast_accum and block scales exclude each other (GemmProblem and GemmFamily.check_operands say it).
BLOCK_SCALES_PROMOTE = ("block scales are applied to each 128-wide K group's sum, which promotes it to fp32 there: "
                        "fp8_fast_accum does not apply to them; leave it False")


@dataclass(frozen=True)
class GemmProblem:
    m: int
    n: int
    k: int
    dtype: str = "bf16"  # operand dtype: fp32, fp16, bf16, fp8 (e4m3, with scales as scale_mode says)
    out_dtype: str = "bf16"
    layout_a: str = "row"
    layout_b: str = "row"
    bias: bool = False
    activation: str = "none"
    tf32: bool = False  # fp32 operands only: tensor cores in tf32
    aligned: bool = True  # base pointers and leading strides are multiples of 16 bytes (TMA-able)
    residual: bool = False  # add a residual (M, N) tensor after the activation
    scale_mode: str = "tensor"  # fp8 scales: 'tensor', 'row' or 'block' (see SCALE_MODES); 'tensor' otherwise
    fp8_fast_accum: bool = False  # fp8: never promote the tensor cores' partial sums (_scaled_mm's use_fast_accum)

    def __post_init__(self):
        if min(self.m, self.n, self.k) < 1:
            raise ShapeMismatchError(f"GEMM sizes must be >= 1, got M={self.m} N={self.n} K={self.k}")
        if self.dtype not in OPERAND_DTYPES:
            raise UnsupportedDtypeError(f"GEMM operands must be one of {OPERAND_DTYPES}, got {self.dtype}")
        if self.out_dtype not in OUTPUT_DTYPES:
            raise UnsupportedDtypeError(f"GEMM output must be one of {OUTPUT_DTYPES}, got {self.out_dtype}")
        check_activation(self.activation)
        if self.layout_a not in LAYOUTS or self.layout_b not in LAYOUTS:
            raise BadInputError(f"layouts must be one of {LAYOUTS}")
        if self.scale_mode not in SCALE_MODES:
            raise BadInputError(f"scale_mode must be one of {SCALE_MODES}, got {self.scale_mode!r}")
        if self.dtype != "fp8" and (self.scale_mode != "tensor" or self.fp8_fast_accum):
            raise BadInputError(f"scale_mode and fp8_fast_accum apply to fp8 operands only, not {self.dtype}: "
                                "leave them at their defaults")
        if self.scale_mode == "block" and self.fp8_fast_accum:
            raise BadInputError(BLOCK_SCALES_PROMOTE)


def contiguous_problem(m: int, n: int, k: int, dtype: str = "bf16", out_dtype: str = "bf16", layout_a: str = "row",
                       layout_b: str = "row", **flags) -> GemmProblem:
    """The problem of freshly allocated operands: TMA alignment follows from the leading dimensions."""
    size = element_size(dtype)
    lead_a = k if layout_a == "row" else m
    lead_b = n if layout_b == "row" else k
    aligned = (lead_a * size) % 16 == 0 and (lead_b * size) % 16 == 0
    return GemmProblem(m, n, k, dtype, out_dtype, layout_a, layout_b, aligned=aligned, **flags)


def layout_of(t: torch.Tensor) -> str:
    if t.stride(-1) == 1 or t.shape[-1] == 1:
        return "row"
    if t.stride(0) == 1 or t.shape[0] == 1:
        return "col"
    return "strided"


def scale_mode_of(m: int, n: int, k: int, scale_a, scale_b, device) -> str:
    """'tensor', 'row' or 'block' from the shapes of fp8 scales (None counts as a per-tensor scale of 1)."""
    groups_k, groups_n = math.ceil(k / SCALE_BLOCK), math.ceil(n / SCALE_BLOCK)
    for name, scale in (("scale_a", scale_a), ("scale_b", scale_b)):
        if scale is not None and (not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32
                                  or scale.device != device):
            raise BadInputError(f"{name} must be a float32 tensor on {device}")
    shape_a = (1,) if scale_a is None else tuple(scale_a.shape)
    shape_b = (1,) if scale_b is None else tuple(scale_b.shape)
    if math.prod(shape_a) == 1 and math.prod(shape_b) == 1:
        return "tensor"
    if shape_a in ((m, 1), (m,)) and shape_b in ((1, n), (n,)):
        return "row"
    if shape_a == (m, groups_k) and shape_b == (groups_k, groups_n):
        return "block"
    raise ShapeMismatchError(
        f"fp8 scales of shapes {shape_a} and {shape_b} fit no scaling of this ({m} x {k}) @ ({k} x {n}) matmul: "
        f"pass one value each (per tensor), ({m}, 1) and (1, {n}) (per row of A and column of B), or "
        f"({m}, {groups_k}) and ({groups_k}, {groups_n}) (1 x {SCALE_BLOCK} groups of A, {SCALE_BLOCK} x "
        f"{SCALE_BLOCK} blocks of B)")


def _tma_aligned(t: torch.Tensor) -> bool:
    size = t.element_size()
    lead = t.stride(0) if layout_of(t) == "row" else t.stride(1)
    return base_aligned(t) and (lead * size) % 16 == 0


_ACTIVATIONS_TORCH = {"none": None, "relu": torch.relu, "silu": torch.nn.functional.silu,
                      "gelu": torch.nn.functional.gelu}


def vendor_matmul(kind: str, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, activation: str,
                  out_dtype: torch.dtype, scale_a: torch.Tensor | None = None,
                  scale_b: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                  fast_accum: bool = False) -> torch.Tensor:
    """What PyTorch runs for this GEMM: cuBLAS through addmm/matmul (`kind` 'cublas'), or torch._scaled_mm for fp8
    ('scaled_mm', per-tensor or row-wise scales); the activation and the residual add as separate ops, as a model
    without autotile applies them."""
    if kind == "scaled_mm":
        if scale_a.numel() == 1 and scale_b.numel() == 1:  # per tensor, of whatever shape ((1, 1, 1) too)
            scale_a, scale_b = scale_a.reshape(()), scale_b.reshape(())
        else:  # row-wise (scale_mode_of): _scaled_mm takes contiguous (M, 1) and (1, N), also at M = 1
            scale_a, scale_b = scale_a.reshape(-1, 1).contiguous(), scale_b.reshape(1, -1).contiguous()
        y = torch._scaled_mm(a, b, scale_a, scale_b, bias=bias, out_dtype=out_dtype, use_fast_accum=fast_accum)
    elif bias is None:
        y = torch.matmul(a, b)
    else:
        y = torch.addmm(bias, a, b)
    act = _ACTIVATIONS_TORCH[activation]
    y = y if act is None else act(y)
    return y if residual is None else y + residual


class GemmFamily(Family):
    name = "gemm"
    template = "gemm.py.j2"
    problem_type = GemmProblem
    shape_fields = ("m", "n", "k")
    # N, K, dtypes, layouts and the epilogue are fixed by a layer's weight; M (tokens) varies per call.
    # M is bucketed by powers of two (1, 2, 4, ..., 8192, ...), as vLLM's shipped fused-MoE tables key it.
    serving_fields = ("m",)
    later_fields = _LATER_FIELDS
    range_free_fields = ("aligned",)

    # --- problems -----------------------------------------------------------------
    def problem_from_tensors(self, a, b, bias=None, activation=None, out_dtype=None, *, residual=None,
                             scale_a=None, scale_b=None, fp8_fast_accum: bool = False) -> GemmProblem:
        """The problem of one call: C = act(scales * (a @ b) + bias) + residual.

        fp8 scales (float32): both of one element (per tensor); scale_a (M, 1) and scale_b (1, N) (per row
        of A and column of B, as torch._scaled_mm's row-wise scaling); or scale_a (M, ceil(K/128)) and
        scale_b (ceil(K/128), ceil(N/128)) (per 1 x 128 group of A and 128 x 128 block of B: for a weight
        W (N, K) with block scales S (ceil(N/128), ceil(K/128)), b = W.t() and scale_b = S.t()).

        >>> import torch
        >>> a = torch.randn(4, 256).to(torch.float8_e4m3fn)
        >>> w = torch.randn(384, 256).to(torch.float8_e4m3fn)
        >>> FAMILY.problem_from_tensors(a, w.t(), scale_a=torch.ones(4, 2), scale_b=torch.ones(2, 3)).scale_mode
        'block'
        """
        dtype, out, scale_mode = self.check_operands(a, b, bias, out_dtype, residual=residual, scale_a=scale_a,
                                                     scale_b=scale_b, fp8_fast_accum=fp8_fast_accum)
        m, k = a.shape
        n = b.shape[1]
        tf32 = dtype == "fp32" and torch.backends.cuda.matmul.allow_tf32
        return GemmProblem(m, n, k, dtype, out, layout_of(a), layout_of(b), bias is not None,
                           activation or "none", tf32, _tma_aligned(a) and _tma_aligned(b),
                           residual=residual is not None, scale_mode=scale_mode, fp8_fast_accum=bool(fp8_fast_accum))

    def check_operands(self, a, b, bias=None, out_dtype=None, *, residual=None, scale_a=None,
                       scale_b=None, fp8_fast_accum=False) -> tuple[str, str, str]:
        """The checks of a call's tensors that hold whatever its sizes (an empty call is checked too): the
        operands' and the output's dtype names, and the scale mode (gemm.scale_mode_of; 'tensor' but for fp8)."""
        if a.dim() != 2 or b.dim() != 2:
            raise ShapeMismatchError(
                f"matmul takes 2-D a (M, K) and b (K, N), got a{tuple(a.shape)} and b{tuple(b.shape)}: for "
                f"activations with leading dims call autotile.linear(x, weight) or pass a.reshape(-1, K); batched b "
                f"(as torch.bmm) is not served: call torch.matmul")
        if a.shape[1] != b.shape[0]:
            raise ShapeMismatchError(f"a is {tuple(a.shape)} and b is {tuple(b.shape)}: a.shape[1] must equal b.shape[0]")
        if a.dtype != b.dtype:
            raise UnsupportedDtypeError(f"a is {a.dtype} and b is {b.dtype}: cast both to one dtype")
        if a.device != b.device:
            raise BadInputError(f"a is on {a.device} and b on {b.device}: move both to one device")
        dtype = canonical_dtype_name(a.dtype) if a.is_floating_point() else str(a.dtype)
        if dtype not in OPERAND_DTYPES:
            raise UnsupportedDtypeError(f"the gemm kernels take {OPERAND_DTYPES} operands, got {a.dtype}: cast them "
                                        "(e.g. .to(torch.bfloat16)), or call torch for other dtypes")
        out = _output_dtype_name(out_dtype) if out_dtype is not None else ("bf16" if dtype == "fp8" else dtype)
        m, k = a.shape
        n = b.shape[1]
        if bias is not None and (bias.dim() != 1 or bias.shape[0] != n):
            raise ShapeMismatchError(f"bias must have shape ({n},), got {tuple(bias.shape)}")
        if bias is not None and bias.device != a.device:
            raise BadInputError(f"bias is on {bias.device}, a on {a.device}")
        if bias is not None and not (bias.is_floating_point() and bias.dtype == torch_dtype(out)):
            # As F.linear and torch.addmm: a bias of another dtype would be rounded into the output's silently.
            raise UnsupportedDtypeError(f"bias is {bias.dtype} but the output is {out}: pass the bias in the output's "
                                        "dtype (bias.to(...))")
        if residual is not None:
            if tuple(residual.shape) != (m, n):
                raise ShapeMismatchError(f"residual must have the output's shape ({m}, {n}), got {tuple(residual.shape)}")
            if residual.device != a.device or not residual.is_floating_point():
                raise BadInputError(f"residual must be a floating-point tensor on {a.device}, got {residual.dtype} "
                                    f"on {residual.device}")
            if residual.dtype != torch_dtype(out):
                # The public ops add such a residual after the kernel, promoting as torch's `+` does
                # (ops_gemm.residual_apart); a fused one would be rounded into the output's dtype silently.
                raise UnsupportedDtypeError(f"residual is {residual.dtype} but the output is {out}: pass the residual "
                                            "in the output's dtype (residual.to(...))")
        if fp8_fast_accum not in (False, True):  # "no" would read as True
            raise BadInputError(f"fp8_fast_accum must be True or False, got {fp8_fast_accum!r}")
        if dtype != "fp8" and (scale_a is not None or scale_b is not None or fp8_fast_accum):
            raise BadInputError(f"scale_a, scale_b and fp8_fast_accum apply to float8_e4m3fn operands only; these are "
                                f"{a.dtype}: leave them out")
        scale_mode = scale_mode_of(m, n, k, scale_a, scale_b, a.device) if dtype == "fp8" else "tensor"
        if scale_mode == "block" and fp8_fast_accum:
            raise BadInputError(BLOCK_SCALES_PROMOTE)
        return dtype, out, scale_mode

    def distance(self, problem: GemmProblem, other: GemmProblem) -> float | None:
        # Alignment does not change what a config computes, only whether the TMA variant may run;
        # the runtime validates every borrowed config against this problem's space anyway.
        return super().distance(problem, dataclasses.replace(other, aligned=problem.aligned))

    def vendor_configs(self, problem: GemmProblem, device: DeviceInfo) -> list[Config]:
        # NOTE: none under the interpreter: CPU calls exist to run the generated kernel, and a CPU BLAS
        # would win every "tuning" run there.
        if device.interpret:
            return []
        p = problem
        if p.dtype == "fp8":
            # torch._scaled_mm takes a row-major A, a column-major B, sizes that are multiples of 16, and per-tensor
            # or row-wise scales (block scales have no vendor op in PyTorch); row-wise scaling outputs bf16.
            if (p.layout_a == "row" and p.layout_b == "col" and p.k % 16 == 0 and p.n % 16 == 0
                    and hasattr(torch, "_scaled_mm") and p.scale_mode != "block"
                    and (p.scale_mode == "tensor" or p.out_dtype == "bf16") and arch_of(device).supports(Feature.FP8)):
                return [Config({VENDOR_KEY: "scaled_mm"})]
            return []
        if p.out_dtype != p.dtype:
            return []  # cuBLAS through torch rounds to the operand dtype first: not the same result
        return [Config({VENDOR_KEY: "cublas"})]

    def vendor_run(self, problem: GemmProblem, config: Config, inputs: Tensors) -> Tensors:
        return {"c": vendor_matmul(config[VENDOR_KEY], inputs["a"], inputs["b"], inputs.get("bias"),
                                   problem.activation, torch_dtype(problem.out_dtype), inputs.get("scale_a"),
                                   inputs.get("scale_b"), inputs.get("residual"), problem.fp8_fast_accum)}

    def default_suite(self) -> list[GemmProblem]:
        return [contiguous_problem(s, s, s, "bf16", "bf16") for s in (1024, 2048, 4096)]

    def presets(self) -> dict[str, list[GemmProblem]]:
        # The shapes of benchmarks/gemm_bench.py: square, an MLP up-projection, skinny decode GEMMs, odd sizes.
        bf16 = [(2048, 2048, 2048), (4096, 4096, 4096), (8192, 8192, 8192), (4096, 14336, 4096),
                (128, 28672, 8192), (16, 8192, 8192), (1000, 3000, 777)]
        return {
            "default": self.default_suite(),
            "bench-bf16": [contiguous_problem(m, n, k, "bf16", "bf16") for m, n, k in bf16],
            "bench-fp8": [contiguous_problem(s, s, s, "fp8", "bf16", layout_b="col") for s in (8192, 4096)],
        }

    cli_options = (
        ProblemOption("m", int, "rows of A and C"),
        ProblemOption("n", int, "columns of B and C"),
        ProblemOption("k", int, "the reduced dimension"),
        ProblemOption("dtype", str, "operand dtype: fp32/float32, fp16/float16, bf16/bfloat16, fp8/float8_e4m3fn", "bf16"),
        ProblemOption("out_dtype", str, "output dtype (default: the operand dtype; bf16 for fp8)"),
        ProblemOption("layout_a", str, "A's layout: row (K contiguous), col (A = X.T), strided", "row", LAYOUTS),
        ProblemOption("layout_b", str, "B's layout: row (N contiguous), col (B = W.T, as nn.Linear), strided", "row", LAYOUTS),
        ProblemOption("bias", bool, "fuse a bias add", False),
        ProblemOption("activation", str, "fused activation", "none", ACTIVATIONS),
        ProblemOption("tf32", bool, "fp32 operands on tensor cores in tf32", False),
        ProblemOption("residual", bool, "fuse a residual add (after the activation)", False),
        ProblemOption("scale_mode", str, "fp8 scales: tensor, row (per row of A / column of B), block (1x128 / 128x128)",
                      "tensor", SCALE_MODES),
        ProblemOption("fp8_fast_accum", bool, "fp8: accumulate in the tensor cores without promotion", False),
    )

    def problems_from_cli(self, m=None, n=None, k=None, dtype="bf16", out_dtype=None, layout_a="row", layout_b="row",
                          bias=False, activation="none", tf32=False, residual=False, scale_mode="tensor",
                          fp8_fast_accum=False) -> list[GemmProblem]:
        if m is None and n is None and k is None:
            return self.default_suite()
        if None in (m, n, k):
            raise BadInputError("give all of --m, --n and --k (or none, for the default suite)")
        dt = canonical_dtype_name(dtype)
        out = canonical_dtype_name(out_dtype) if out_dtype else ("bf16" if dt == "fp8" else dt)
        if tf32 and dt != "fp32":
            raise BadInputError(f"--tf32 lets fp32 operands use the tensor cores; {dt} operands use them anyway: "
                                "drop --tf32, or pass --dtype fp32")
        return [contiguous_problem(m, n, k, dt, out, layout_a, layout_b, bias=bias, activation=activation,
                                   tf32=tf32, residual=residual, scale_mode=scale_mode,
                                   fp8_fast_accum=fp8_fast_accum)]

    # --- the search -----------------------------------------------------------------
    def space(self, problem: GemmProblem, device: DeviceInfo) -> Space:
        return gemm_space(problem, device)

    def default_config(self, problem: GemmProblem, device: DeviceInfo) -> Config:
        """The policy's config for the problem's regime (gemm_policy.py), or the feasible config nearest to it.

        >>> from autotile.device import interpret_device
        >>> config = FAMILY.default_config(contiguous_problem(1, 1024, 4096, layout_b="col"), interpret_device())
        >>> config["SCHEDULE"], config["BLOCK_M"], config["SPLIT_K"]
        ('split_k', 16, 4)
        """
        return self.first_feasible(problem, device, preferred_config(problem, device))

    def seed_configs(self, problem: GemmProblem, device: DeviceInfo) -> list[Config]:
        """Starting points per regime around the default (gemm_policy.seed_variations), each a point of the space."""
        space = self.space(problem, device)
        seeds, seen = [], {self.default_config(problem, device)}
        for wanted in seed_variations(problem, device):
            config = space.admit(wanted)  # upgraded: the policy's dicts need not name every axis
            if config is not None and config not in seen:
                seen.add(config)
                seeds.append(config)
        return seeds

    # --- data -----------------------------------------------------------------------
    def make_inputs(self, problem: GemmProblem, device: DeviceInfo, seed: int = 0) -> Tensors:
        p = problem
        dev = device.torch_device
        # Drawn on the device itself: a fresh 8192 x 8192 operand per trial costs microseconds there.
        gen = torch.Generator(device=dev).manual_seed(seed)

        def operand(rows: int, cols: int, layout: str, group: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor | None]:
            values = torch.randn(rows, cols, generator=gen, device=dev)
            scale = None
            if p.dtype == "fp8":
                # Scaling as fp8 recipes do: each group's largest magnitude maps to e4m3's largest value.
                scale = _group_amax(values, group) / _E4M3_MAX
                values = values / _expand_scale(scale, rows, cols, group)
            dt = torch_dtype(p.dtype)
            # Unaligned problems get their storage offset by one element, which breaks 16-byte alignment.
            pad = 0 if p.aligned else 1
            if layout == "row":
                t = torch.empty(rows * cols + pad, dtype=dt, device=dev)[pad:].view(rows, cols)
            elif layout == "col":
                t = torch.empty(rows * cols + pad, dtype=dt, device=dev)[pad:].view(cols, rows).t()
            else:  # every other column of a wider matrix: no unit stride anywhere
                t = torch.empty(rows, 2 * cols, dtype=dt, device=dev)[:, ::2]
            t.copy_(values.to(dt))
            if scale is not None and p.scale_mode == "tensor":
                scale = scale.reshape(1)
            return t, scale

        group_a, group_b = _scale_groups(p)
        a, scale_a = operand(p.m, p.k, p.layout_a, group_a)
        b, scale_b = operand(p.k, p.n, p.layout_b, group_b)
        inputs: Tensors = {"a": a, "b": b}
        if scale_a is not None:
            inputs["scale_a"], inputs["scale_b"] = scale_a, scale_b
        if p.bias:
            inputs["bias"] = torch.randn(p.n, generator=gen, device=dev).to(torch_dtype(p.out_dtype))
        if p.residual:
            inputs["residual"] = torch.randn(p.m, p.n, generator=gen, device=dev).to(torch_dtype(p.out_dtype))
        return inputs

    def allocate_outputs(self, problem: GemmProblem, inputs: Tensors) -> Tensors:
        return {"c": torch.empty(problem.m, problem.n, dtype=torch_dtype(problem.out_dtype), device=inputs["a"].device)}

    def reference(self, problem: GemmProblem, inputs: Tensors) -> Tensors:
        a, b = inputs["a"].to(torch.float64), inputs["b"].to(torch.float64)
        if "scale_a" in inputs:
            # Dequantise each operand with its own scales (per tensor, row/column or block) before the product.
            group_a, group_b = _scale_groups(problem)
            a = a * _expand_scale(inputs["scale_a"].double(), problem.m, problem.k, group_a)
            b = b * _expand_scale(inputs["scale_b"].double(), problem.k, problem.n, group_b)
        acc = a @ b
        if "bias" in inputs:
            acc = acc + inputs["bias"].double()
        acc = {"none": lambda x: x, "relu": torch.relu, "silu": torch.nn.functional.silu,
               "gelu": torch.nn.functional.gelu}[problem.activation](acc)
        if "residual" in inputs:
            acc = acc + inputs["residual"].double()
        return {"c": acc}

    def tolerance(self, problem: GemmProblem) -> Tolerance:
        # The reference uses the same (already rounded) operands in float64, so what is left is
        # (1) rounding the result to out_dtype: rtol = 2 units of roundoff, plus atol for values near 0;
        # (2) fp32 accumulation: partial sums grow like sqrt(K), each of K additions rounds by 2^-24
        #     of that, ~ K * 2^-24 in a random walk; split-K and stream-K add a handful of partial sums
        #     more, which the same bound covers;
        # (3) tf32: truncating both operands biases every product low by up to 2 * 2^-10 relative, so
        #     the result is off by up to that fraction of itself (rtol) plus a random part ~ sqrt(K) * 2^-10;
        # (4) fp8 on Hopper: runs of I products are summed in ~14 bits before they join the fp32 sum:
        #     ~ sqrt(I) * sqrt(I) * 2^-14 per run, sqrt(K / I) runs, so sqrt(K * I) * 2^-14 in all, with
        #     I <= FP8_PRECISE_INTERVAL (precise), I = SCALE_BLOCK (block scales), I = K (fast accumulation).
        # (5) an output far out in the tail got there through running sums of its own size: each addition
        #     rounds by 2^-24 of |c|, a random walk of sqrt(K) of them -- rtol 2 * sqrt(K) * 2^-24. (Seen on
        #     the H200: 37x1000x2000 bf16 -> fp32, c = 162.9 (3.6 sigma), error 5.1e-4 against an atol of 4.8e-4.)
        # (6) the same holds for fp8's ~14-bit running sums: an outlier's run of I additions rounds each by 2^-14
        #     of its own size, rtol 2 * sqrt(I) * 2^-14. (Seen on the H200: 8192^3 with fast accumulation, an output
        #     of 324.7 (3.6 sigma) off by 4.66 against an allowed 4.55, the same for torch._scaled_mm(use_fast_accum=
        #     True) as for both of the family's variants; results/fp8_fast_bound_2026-12-02.txt.)
        # Inputs are N(0, 1) (fp8 ones scaled back to that by their scales); a factor 4 on each
        # random term leaves room for the tails of the distribution over ~1e5 outputs, and no more.
        out = _UNIT_ROUNDOFF[problem.out_dtype]
        k = problem.k
        atol = 4.0 * k * 2.0**-24 + 2.0 * out
        rtol = 2.0 * out + 2.0 * math.sqrt(k) * 2.0**-24
        if problem.tf32:
            atol += 4.0 * math.sqrt(k) * _TF32_TRUNCATION
            rtol += 2.0 * _TF32_TRUNCATION
        if problem.dtype == "fp8":
            interval = fp8_promotion_interval(problem)
            atol += 4.0 * math.sqrt(k * interval) * _FP8_ACC_ROUNDOFF
            rtol += 2.0 * math.sqrt(interval) * _FP8_ACC_ROUNDOFF
        return Tolerance(atol=atol, rtol=rtol)

    def cost(self, problem: GemmProblem) -> Cost:
        p = problem
        in_size, out_size = element_size(p.dtype), element_size(p.out_dtype)
        moved = (p.m * p.k + p.k * p.n) * in_size + p.m * p.n * out_size + (p.n * out_size if p.bias else 0)
        if p.residual:
            moved += p.m * p.n * out_size
        return Cost(flops=2.0 * p.m * p.n * p.k, bytes=float(moved))

    def baseline(self, problem: GemmProblem, inputs: Tensors) -> Baseline | None:
        a, b, bias = inputs["a"], inputs["b"], inputs.get("bias")
        act = {"none": None, "relu": torch.relu, "silu": torch.nn.functional.silu, "gelu": torch.nn.functional.gelu}[problem.activation]
        residual = inputs.get("residual")
        out_dtype = torch_dtype(problem.out_dtype)
        if problem.dtype == "fp8":
            if (not hasattr(torch, "_scaled_mm") or problem.layout_a != "row" or problem.layout_b != "col"
                    or problem.scale_mode == "block"):
                return None  # _scaled_mm takes a row-major A and a column-major B, and tensor or row-wise scales

            def run():
                y = torch._scaled_mm(a, b, inputs["scale_a"], inputs["scale_b"], bias=bias, out_dtype=out_dtype,
                                     use_fast_accum=problem.fp8_fast_accum)
                y = act(y) if act else y
                return y if residual is None else y + residual
            return Baseline("torch._scaled_mm", run)

        def run():
            y = torch.matmul(a, b) if bias is None else torch.addmm(bias.to(a.dtype), a, b)
            y = act(y) if act else y
            y = y if residual is None else y + residual
            return y if y.dtype == out_dtype else y.to(out_dtype)
        return Baseline("torch.matmul (cuBLAS)" if a.is_cuda else "torch.matmul (CPU)", run)

    # --- running --------------------------------------------------------------------
    def render_switches(self, problem: GemmProblem, config: Config) -> dict:
        p = problem
        index_64 = max(p.m * p.k, p.k * p.n, p.m * p.n) * 2 >= 2**31
        blocked = config["VARIANT"] == "blocked"
        return dict(
            VARIANT=config["VARIANT"], SCHEDULE=config["SCHEDULE"], SWAP_AB=config["SWAP_AB"],
            EPILOGUE_SUBTILE=config.get("EPILOGUE_SUBTILE", False),
            HAS_BIAS=p.bias, HAS_RESIDUAL=p.residual, ACTIVATION=p.activation,
            SCALES=p.scale_mode if p.dtype == "fp8" else "none",
            FP8_PROMOTE=p.dtype == "fp8" and not p.fp8_fast_accum and p.scale_mode != "block",
            # A swapped gluon_ws kernel's B is X (M, K): K-major as a W (N, K) is.
            A_COL=p.layout_a == "col", B_COL=p.layout_b == "col" or gluon_swapped(config),
            EVEN_N=blocked and p.n % config["BLOCK_N"] == 0, EVEN_K=blocked and p.k % config["BLOCK_K"] == 0,
            STREAM_B=blocked and math.ceil(p.m / config["BLOCK_M"]) == 1,
            INPUT_PRECISION=("tf32" if p.tf32 else "ieee") if p.dtype == "fp32" else "",
            INDEX_64=index_64, UPCAST_DOTS=False,
            WIDE_N=config["VARIANT"] == GLUON_WS and gluon_tile_cols(config) in GLUON_TWO_PART,
            CLAMP_ROWS=clamps_row_tiles(config), CLAMP_COLS=clamps_col_tiles(config),
            COALESCED_PARTIALS=coalesced_partials(config), OWNED_SPLITS=owned_splits(config),
        )

    def launch(self, problem: GemmProblem, config: Config, inputs: Tensors, outputs: Tensors) -> None:
        a = inputs["a"]
        run_plan(launch_plan(self, problem, config, a.device), a, inputs["b"], outputs["c"], inputs)

    def timed_call(self, problem: GemmProblem, config: Config, inputs: Tensors, outputs: Tensors):
        """A generated kernel is timed as autotile.matmul and autotile.linear serve it: bound to its compiled
        launcher after one launch through its plan.

        NOTE: `launch` costs 27-42 us of host time a call on the H200 machines, which the eager timing of a 10-20 us
        decode GEMM counts: a split-K winner the tuner stored at 16.5 us timed 32.9 us through it in another
        process, while the served call launches bound.
        """
        a = inputs["a"]
        if is_vendor(config) or not a.is_cuda:
            return super().timed_call(problem, config, inputs, outputs)
        b, c, bias, residual = inputs["b"], outputs["c"], inputs.get("bias"), inputs.get("residual")
        bound = bind_gemm(self, problem, config, a, b, c, bias, residual)
        if not bound:  # fp8 (its scales), or a launch Triton's own path took: the plan serves it
            return super().timed_call(problem, config, inputs, outputs)
        return lambda: bound(a, b, c, bias, residual)


def check_activation(name) -> None:
    """Refuse an epilogue activation the kernels do not have."""
    if name not in ACTIVATIONS:
        raise BadInputError(f"activation must be one of {ACTIVATIONS}, got {name!r}")


def _output_dtype_name(out_dtype) -> str:
    """out_dtype's name, refused (naming the outputs the kernels write) where it is none of OUTPUT_DTYPES."""
    try:
        name = canonical_dtype_name(out_dtype)
    except UnsupportedDtypeError:
        name = None
    if name not in OUTPUT_DTYPES:
        raise UnsupportedDtypeError(f"out_dtype must be one of {OUTPUT_DTYPES} (torch.float32, torch.float16, "
                                    f"torch.bfloat16), got {out_dtype!r}")
    return name


def fp8_promotion_interval(problem: GemmProblem) -> int:
    """Most products the tensor cores sum at their reduced precision before fp32 takes over (the accuracy bound)."""
    if problem.scale_mode == "block":
        return SCALE_BLOCK
    return problem.k if problem.fp8_fast_accum else min(problem.k, FP8_PRECISE_INTERVAL)


def _scale_groups(problem: GemmProblem) -> tuple[tuple[int, int], tuple[int, int]]:
    """The (rows, cols) that one scale covers, of A (M, K) and of B (K, N)."""
    p = problem
    if p.scale_mode == "row":
        return (1, p.k), (p.k, 1)
    if p.scale_mode == "block":
        return (1, SCALE_BLOCK), (SCALE_BLOCK, SCALE_BLOCK)
    return (p.m, p.k), (p.k, p.n)


def _group_amax(values: torch.Tensor, group: tuple[int, int]) -> torch.Tensor:
    """Largest magnitude of each (group[0] x group[1]) block of `values` (edge blocks may be smaller)."""
    rows, cols = values.shape
    gr, gc = group
    padded = torch.zeros(math.ceil(rows / gr) * gr, math.ceil(cols / gc) * gc, device=values.device)
    padded[:rows, :cols] = values.abs()
    amax = padded.view(padded.shape[0] // gr, gr, padded.shape[1] // gc, gc).amax(dim=(1, 3))
    return amax.clamp_min(1e-12)


def _expand_scale(scale: torch.Tensor, rows: int, cols: int, group: tuple[int, int]) -> torch.Tensor:
    """A scale per group (any shape whose elements are the groups, row-major) spread to every element."""
    gr, gc = group
    grid = scale.reshape(math.ceil(rows / gr), math.ceil(cols / gc))
    return grid.repeat_interleave(gr, dim=0)[:rows].repeat_interleave(gc, dim=1)[:, :cols]


FAMILY = GemmFamily()
