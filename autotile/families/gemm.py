"""Tiled GEMM: C = act(A @ B * scales + bias), fp32/tf32, fp16, bf16 and fp8 e4m3 operands.

The point of tiling is reuse: each (BLOCK_M x BLOCK_K) tile of A and
(BLOCK_K x BLOCK_N) tile of B is read from HBM once per output tile and used
BLOCK_N (resp. BLOCK_M) times from shared memory and registers.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import torch

from autotile.device import DeviceInfo, ensure_triton_allocator
from autotile.dtypes import canonical_dtype_name, element_size, torch_dtype
from autotile.errors import BadInputError, ShapeMismatchError, UnsupportedDtypeError
from autotile.families.base import VENDOR_KEY, Baseline, Cost, Family, ProblemOption, Tensors, Tolerance, next_pow2
from autotile.launch import launch as launch_kernel
from autotile.render import launching, load_kernel_module
from autotile.space import Axis, AxisKind, Config, Constraint, Space

OPERAND_DTYPES = ("fp32", "fp16", "bf16", "fp8")
OUTPUT_DTYPES = ("fp32", "fp16", "bf16")
ACTIVATIONS = ("none", "relu", "gelu", "silu")
LAYOUTS = ("row", "col", "strided")  # unit stride along the last dim / the first dim / neither

# Unit roundoff of each output dtype (half an ulp at 1.0).
_UNIT_ROUNDOFF = {"fp32": 2.0**-24, "fp16": 2.0**-11, "bf16": 2.0**-8}
# tf32 keeps 10 explicit mantissa bits of each fp32 operand, and the tensor cores truncate rather
# than round the other 13: a one-sided relative error of up to 2^-10 per operand.
_TF32_TRUNCATION = 2.0**-10
# Hopper's fp8 tensor cores accumulate in about 14 significant bits (DeepSeek-V3 report, sec. 3.3.2,
# which promotes to fp32 every 128 products); the kernel promotes once per K tile, at most every
# _FP8_MAX_BLOCK_K products.
_FP8_ACC_ROUNDOFF = 2.0**-14
_FP8_MAX_BLOCK_K = 256
# Workspace elements a split-K run may use (fp32): 2**28 is 1 GiB.
_SPLIT_K_WORKSPACE_LIMIT = 2**28
# Tile of the split-K reduction kernel: memory-bound and small, so not tuned.
_REDUCE_BLOCK = (32, 128)


@dataclass(frozen=True)
class GemmProblem:
    m: int
    n: int
    k: int
    dtype: str = "bf16"  # operand dtype: fp32, fp16, bf16, fp8 (e4m3, with per-tensor scales)
    out_dtype: str = "bf16"
    layout_a: str = "row"
    layout_b: str = "row"
    bias: bool = False
    activation: str = "none"
    tf32: bool = False  # fp32 operands only: tensor cores in tf32
    aligned: bool = True  # base pointers and leading strides are multiples of 16 bytes (TMA-able)

    def __post_init__(self):
        if min(self.m, self.n, self.k) < 1:
            raise ShapeMismatchError(f"GEMM sizes must be >= 1, got M={self.m} N={self.n} K={self.k}")
        if self.dtype not in OPERAND_DTYPES:
            raise UnsupportedDtypeError(f"GEMM operands must be one of {OPERAND_DTYPES}, got {self.dtype}")
        if self.out_dtype not in OUTPUT_DTYPES:
            raise UnsupportedDtypeError(f"GEMM output must be one of {OUTPUT_DTYPES}, got {self.out_dtype}")
        if self.activation not in ACTIVATIONS:
            raise BadInputError(f"activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        if self.layout_a not in LAYOUTS or self.layout_b not in LAYOUTS:
            raise BadInputError(f"layouts must be one of {LAYOUTS}")


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


def _tma_aligned(t: torch.Tensor) -> bool:
    size = t.element_size()
    lead = t.stride(0) if layout_of(t) == "row" else t.stride(1)
    return t.data_ptr() % 16 == 0 and (lead * size) % 16 == 0


_ACTIVATIONS_TORCH = {"none": None, "relu": torch.relu, "silu": torch.nn.functional.silu,
                      "gelu": torch.nn.functional.gelu}


def vendor_matmul(kind: str, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, activation: str,
                  out_dtype: torch.dtype, scale_a: torch.Tensor | None = None,
                  scale_b: torch.Tensor | None = None) -> torch.Tensor:
    """What PyTorch runs for this GEMM: cuBLAS through addmm/matmul (`kind` 'cublas'), or torch._scaled_mm for fp8
    ('scaled_mm'); the activation as a separate op, as a model without autotile applies it."""
    if kind == "scaled_mm":
        y = torch._scaled_mm(a, b, scale_a, scale_b, bias=bias, out_dtype=out_dtype)
    elif bias is None:
        y = torch.matmul(a, b)
    else:
        y = torch.addmm(bias, a, b)
    act = _ACTIVATIONS_TORCH[activation]
    return y if act is None else act(y)


class GemmFamily(Family):
    name = "gemm"
    template = "gemm.py.j2"
    problem_type = GemmProblem
    shape_fields = ("m", "n", "k")
    # N, K, dtypes, layouts and the epilogue are fixed by a layer's weight; M (tokens) varies per call.
    # M is bucketed by powers of two (1, 2, 4, ..., 8192, ...), as vLLM's shipped fused-MoE tables key it.
    serving_fields = ("m",)
    range_free_fields = ("aligned",)

    # --- problems -----------------------------------------------------------------
    def problem_from_tensors(self, a, b, bias=None, activation=None, out_dtype=None) -> GemmProblem:
        if a.dim() != 2 or b.dim() != 2:
            raise ShapeMismatchError(f"matmul takes 2-D a and b, got a{tuple(a.shape)} and b{tuple(b.shape)}")
        if a.shape[1] != b.shape[0]:
            raise ShapeMismatchError(f"a is {tuple(a.shape)} and b is {tuple(b.shape)}: a.shape[1] must equal b.shape[0]")
        if a.dtype != b.dtype:
            raise UnsupportedDtypeError(f"a is {a.dtype} and b is {b.dtype}: cast both to one dtype")
        if a.device != b.device:
            raise BadInputError(f"a is on {a.device} and b on {b.device}: move both to one device")
        dtype = canonical_dtype_name(a.dtype)
        if dtype not in OPERAND_DTYPES:
            raise UnsupportedDtypeError(f"matmul supports {OPERAND_DTYPES} operands, got {a.dtype}")
        out = canonical_dtype_name(out_dtype) if out_dtype is not None else ("bf16" if dtype == "fp8" else dtype)
        m, k = a.shape
        n = b.shape[1]
        if bias is not None and (bias.dim() != 1 or bias.shape[0] != n):
            raise ShapeMismatchError(f"bias must have shape ({n},), got {tuple(bias.shape)}")
        if bias is not None and bias.device != a.device:
            raise BadInputError(f"bias is on {bias.device}, a on {a.device}")
        tf32 = dtype == "fp32" and torch.backends.cuda.matmul.allow_tf32
        return GemmProblem(m, n, k, dtype, out, layout_of(a), layout_of(b), bias is not None,
                           activation or "none", tf32, _tma_aligned(a) and _tma_aligned(b))

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
            # torch._scaled_mm takes a row-major A, a column-major B and sizes that are multiples of 16.
            if p.layout_a == "row" and p.layout_b == "col" and p.k % 16 == 0 and p.n % 16 == 0 and hasattr(torch, "_scaled_mm"):
                return [Config({VENDOR_KEY: "scaled_mm"})]
            return []
        if p.out_dtype != p.dtype:
            return []  # cuBLAS through torch rounds to the operand dtype first: not the same result
        return [Config({VENDOR_KEY: "cublas"})]

    def vendor_run(self, problem: GemmProblem, config: Config, inputs: Tensors) -> Tensors:
        return {"c": vendor_matmul(config[VENDOR_KEY], inputs["a"], inputs["b"], inputs.get("bias"),
                                   problem.activation, torch_dtype(problem.out_dtype), inputs.get("scale_a"),
                                   inputs.get("scale_b"))}

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
    )

    def problems_from_cli(self, m=None, n=None, k=None, dtype="bf16", out_dtype=None, layout_a="row", layout_b="row",
                          bias=False, activation="none", tf32=False) -> list[GemmProblem]:
        if m is None and n is None and k is None:
            return self.default_suite()
        if None in (m, n, k):
            raise BadInputError("give all of --m, --n and --k (or none, for the default suite)")
        dt = canonical_dtype_name(dtype)
        out = canonical_dtype_name(out_dtype) if out_dtype else ("bf16" if dt == "fp8" else dt)
        return [contiguous_problem(m, n, k, dt, out, layout_a, layout_b, bias=bias, activation=activation,
                                   tf32=tf32 and dt == "fp32")]

    # --- the search -----------------------------------------------------------------
    def space(self, problem: GemmProblem, device: DeviceInfo) -> Space:
        p = problem
        in_size = element_size(p.dtype)
        out_size = element_size(p.out_dtype)
        k_tiles = lambda c: math.ceil(p.k / c["BLOCK_K"])  # noqa: E731

        def smem_bytes(c) -> int:
            # Pipelined operand tiles, plus the output tile staged for the TMA store.
            operands = (c["BLOCK_M"] + c["BLOCK_N"]) * c["BLOCK_K"] * in_size * c["num_stages"]
            staging = c["BLOCK_M"] * c["BLOCK_N"] * out_size if c["VARIANT"] == "tma" else 0
            return operands + staging

        axes = [
            Axis("VARIANT", ("blocked", "tma"), AxisKind.RENDER),
            Axis("BLOCK_M", (16, 32, 64, 128, 256)),
            Axis("BLOCK_N", (32, 64, 128, 256)),
            Axis("BLOCK_K", (32, 64, 128, 256)),
            Axis("GROUP_M", (1, 4, 8, 16)),
            Axis("SPLIT_K", (1, 2, 4, 8, 16)),
            Axis("PERSISTENT", (False, True)),
            Axis("WARP_SPECIALIZE", (False, True)),
            Axis("FLATTEN", (False, True)),
            Axis("num_warps", (4, 8)),
            Axis("num_stages", (2, 3, 4, 5)),
        ]
        constraints = [
            Constraint("shared_memory", lambda c: smem_bytes(c) <= device.smem_per_block,
                       lambda c: f"needs {smem_bytes(c)} B of shared memory, the device allows {device.smem_per_block} B"),
            Constraint("accumulator_registers", lambda c: c["BLOCK_M"] * c["BLOCK_N"] <= 128 * 32 * c["num_warps"],
                       "the fp32 accumulator needs more than 128 registers a thread"),
            Constraint("work_per_warp", lambda c: c["BLOCK_M"] * c["BLOCK_N"] >= 128 * c["num_warps"],
                       "tile too small to give every warp a full mma"),
            Constraint("fp8_block_k", lambda c: p.dtype != "fp8" or c["BLOCK_K"] >= 64,
                       "fp8 tensor-core tiles need BLOCK_K >= 64 (32 bytes of K at least twice)"),
            Constraint("tile_within_problem",
                       lambda c: c["BLOCK_M"] <= max(16, next_pow2(p.m)) and c["BLOCK_N"] <= max(32, next_pow2(p.n))
                       and c["BLOCK_K"] <= max(32, next_pow2(p.k)),
                       "a block larger than the next power of two of its dimension only computes padding"),
            Constraint("tma_alignment", lambda c: c["VARIANT"] != "tma" or self._tma_ok(p),
                       "TMA needs unit-stride operands with 16-byte aligned rows and base pointers"),
            Constraint("split_k_blocked_only", lambda c: c["SPLIT_K"] == 1 or c["VARIANT"] == "blocked",
                       "split-K is implemented by the blocked variant"),
            Constraint("split_k_depth", lambda c: c["SPLIT_K"] == 1 or k_tiles(c) >= 2 * c["SPLIT_K"],
                       "each split needs at least two K tiles"),
            Constraint("split_k_workspace", lambda c: c["SPLIT_K"] == 1 or c["SPLIT_K"] * p.m * p.n <= _SPLIT_K_WORKSPACE_LIMIT,
                       "the split-K workspace would exceed 1 GiB"),
            Constraint("persistent_tma_only", lambda c: c["VARIANT"] == "tma" or not (c["PERSISTENT"] or c["WARP_SPECIALIZE"] or c["FLATTEN"]),
                       "PERSISTENT, WARP_SPECIALIZE and FLATTEN only change the tma variant's tile loop"),
            Constraint("group_m_useful", lambda c: c["GROUP_M"] == 1 or math.ceil(p.m / c["BLOCK_M"]) > 1,
                       "grouped ordering needs more than one row of tiles"),
        ]
        return Space(axes, constraints)

    @staticmethod
    def _tma_ok(p: GemmProblem) -> bool:
        return (p.aligned and p.layout_a != "strided" and p.layout_b != "strided"
                and (p.n * element_size(p.out_dtype)) % 16 == 0)

    def default_config(self, problem: GemmProblem, device: DeviceInfo) -> Config:
        preferred = dict(VARIANT="blocked", BLOCK_M=min(128, max(16, next_pow2(problem.m))), BLOCK_N=min(128, max(32, next_pow2(problem.n))),
                         BLOCK_K=64 if problem.k >= 64 else 32, GROUP_M=8 if problem.m > 128 else 1, SPLIT_K=1,
                         PERSISTENT=False, WARP_SPECIALIZE=False, FLATTEN=False, num_warps=4, num_stages=3)
        return self.first_feasible(problem, device, preferred)

    def seed_configs(self, problem: GemmProblem, device: DeviceInfo) -> list[Config]:
        """Known-good starting points, tried right after the default config.

        From the anchors (shared/anchors, H200 2026-11-29): one fixed 128x256x64 w8 s3 Triton
        config reaches 614-671 TFLOP/s on large bf16 GEMMs; Triton's persistent TMA tutorial
        uses 128x{128,256}x{64,128} with 3-4 stages; skinny M wants small BLOCK_M with split-K.
        """
        big = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, SPLIT_K=1, num_warps=8, num_stages=3,
                   WARP_SPECIALIZE=False, FLATTEN=False)
        wanted = [
            dict(big, VARIANT="tma", PERSISTENT=True),
            dict(big, VARIANT="tma", PERSISTENT=False),
            dict(big, VARIANT="blocked", PERSISTENT=False),
            dict(big, VARIANT="tma", PERSISTENT=True, BLOCK_N=128, BLOCK_K=128, num_stages=4),
            dict(big, VARIANT="tma", PERSISTENT=True, BLOCK_N=128, num_warps=4, num_stages=4),
            dict(big, VARIANT="blocked", PERSISTENT=False, BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, GROUP_M=1,
                 SPLIT_K=4, num_warps=4, num_stages=4),
            dict(big, VARIANT="blocked", PERSISTENT=False, BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4,
                 num_stages=4),
        ]
        space = self.space(problem, device)
        return [Config(w) for w in wanted if space.is_feasible(w)]

    # --- data -----------------------------------------------------------------------
    def make_inputs(self, problem: GemmProblem, device: DeviceInfo, seed: int = 0) -> Tensors:
        p = problem
        dev = device.torch_device
        # Drawn on the device itself: a fresh 8192 x 8192 operand per trial costs microseconds there.
        gen = torch.Generator(device=dev).manual_seed(seed)

        def operand(rows: int, cols: int, layout: str) -> tuple[torch.Tensor, torch.Tensor | None]:
            values = torch.randn(rows, cols, generator=gen, device=dev)
            scale = None
            if p.dtype == "fp8":
                # Per-tensor scaling as fp8 training recipes do: amax maps to e4m3's largest value, 448.
                scale = values.abs().max() / 448.0
                values = values / scale
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
            return t, (scale.reshape(1).float() if scale is not None else None)

        a, scale_a = operand(p.m, p.k, p.layout_a)
        b, scale_b = operand(p.k, p.n, p.layout_b)
        inputs: Tensors = {"a": a, "b": b}
        if scale_a is not None:
            inputs["scale_a"], inputs["scale_b"] = scale_a, scale_b
        if p.bias:
            inputs["bias"] = torch.randn(p.n, generator=gen, device=dev).to(torch_dtype(p.out_dtype))
        return inputs

    def allocate_outputs(self, problem: GemmProblem, inputs: Tensors) -> Tensors:
        return {"c": torch.empty(problem.m, problem.n, dtype=torch_dtype(problem.out_dtype), device=inputs["a"].device)}

    def reference(self, problem: GemmProblem, inputs: Tensors) -> Tensors:
        acc = inputs["a"].to(torch.float64) @ inputs["b"].to(torch.float64)
        if "scale_a" in inputs:
            acc = acc * (inputs["scale_a"].double() * inputs["scale_b"].double())
        if "bias" in inputs:
            acc = acc + inputs["bias"].double()
        acc = {"none": lambda x: x, "relu": torch.relu, "silu": torch.nn.functional.silu,
               "gelu": torch.nn.functional.gelu}[problem.activation](acc)
        return {"c": acc}

    def tolerance(self, problem: GemmProblem) -> Tolerance:
        # The reference uses the same (already rounded) operands in float64, so what is left is
        # (1) rounding the result to out_dtype: rtol = 2 units of roundoff, plus atol for values near 0;
        # (2) fp32 accumulation: partial sums grow like sqrt(K), each of K additions rounds by 2^-24
        #     of that, ~ K * 2^-24 in a random walk;
        # (3) tf32: truncating both operands biases every product low by up to 2 * 2^-10 relative, so
        #     the result is off by up to that fraction of itself (rtol) plus a random part ~ sqrt(K) * 2^-10;
        # (4) fp8 on Hopper: each K tile (<= 256 products) is summed in ~14 bits before it joins the
        #     fp32 sum: ~ sqrt(256) * sqrt(256) * 2^-14 per tile, sqrt(K / 256) tiles.
        # Inputs are N(0, 1) (fp8 ones scaled back to that by their scales); a factor 4 on each
        # random term leaves room for the tails of the distribution over ~1e5 outputs, and no more.
        out = _UNIT_ROUNDOFF[problem.out_dtype]
        k = problem.k
        atol = 4.0 * k * 2.0**-24 + 2.0 * out
        rtol = 2.0 * out
        if problem.tf32:
            atol += 4.0 * math.sqrt(k) * _TF32_TRUNCATION
            rtol += 2.0 * _TF32_TRUNCATION
        if problem.dtype == "fp8":
            atol += 4.0 * math.sqrt(k * _FP8_MAX_BLOCK_K) * _FP8_ACC_ROUNDOFF
        return Tolerance(atol=atol, rtol=rtol)

    def cost(self, problem: GemmProblem) -> Cost:
        p = problem
        in_size, out_size = element_size(p.dtype), element_size(p.out_dtype)
        moved = (p.m * p.k + p.k * p.n) * in_size + p.m * p.n * out_size + (p.n * out_size if p.bias else 0)
        return Cost(flops=2.0 * p.m * p.n * p.k, bytes=float(moved))

    def baseline(self, problem: GemmProblem, inputs: Tensors) -> Baseline | None:
        a, b, bias = inputs["a"], inputs["b"], inputs.get("bias")
        act = {"none": None, "relu": torch.relu, "silu": torch.nn.functional.silu, "gelu": torch.nn.functional.gelu}[problem.activation]
        out_dtype = torch_dtype(problem.out_dtype)
        if problem.dtype == "fp8":
            if not hasattr(torch, "_scaled_mm") or problem.layout_a != "row" or problem.layout_b != "col":
                return None  # _scaled_mm takes a row-major A and a column-major B only

            def run():
                y = torch._scaled_mm(a, b, inputs["scale_a"], inputs["scale_b"], bias=bias, out_dtype=out_dtype)
                return act(y) if act else y
            return Baseline("torch._scaled_mm", run)

        def run():
            y = torch.matmul(a, b) if bias is None else torch.addmm(bias.to(a.dtype), a, b)
            y = act(y) if act else y
            return y if y.dtype == out_dtype else y.to(out_dtype)
        return Baseline("torch.matmul (cuBLAS)" if a.is_cuda else "torch.matmul (CPU)", run)

    # --- running --------------------------------------------------------------------
    def render_switches(self, problem: GemmProblem, config: Config) -> dict:
        index_64 = max(problem.m * problem.k, problem.k * problem.n, problem.m * problem.n) * 2 >= 2**31
        return dict(
            VARIANT=config["VARIANT"], HAS_BIAS=problem.bias, ACTIVATION=problem.activation,
            SCALED=problem.dtype == "fp8", A_COL=problem.layout_a == "col", B_COL=problem.layout_b == "col",
            INPUT_PRECISION=("tf32" if problem.tf32 else "ieee") if problem.dtype == "fp32" else "",
            INDEX_64=index_64, FP8_PROMOTE=problem.dtype == "fp8",
        )

    def launch(self, problem: GemmProblem, config: Config, inputs: Tensors, outputs: Tensors) -> None:
        a, b, c = inputs["a"], inputs["b"], outputs["c"]
        plan = _launch_plan(self, problem, config, a.device)
        bias = inputs.get("bias", c)  # unused pointers still need a tensor
        scale_a = inputs.get("scale_a", c)
        scale_b = inputs.get("scale_b", c)
        m, n, k = problem.m, problem.n, problem.k
        ws = torch.empty(plan.split_k, m, n, dtype=torch.float32, device=a.device) if plan.split_k > 1 else c
        with launching(plan.interpret):
            launch_kernel(
                plan.kernel, plan.grid, a, b, c, ws, bias, scale_a, scale_b, m, n, k,
                a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
                **plan.constexprs,
            )
            if plan.split_k > 1:
                bm, bn = _REDUCE_BLOCK
                launch_kernel(
                    plan.reduce, (triton_cdiv(m, bm), triton_cdiv(n, bn)),
                    ws, c, bias, scale_a, scale_b, m, n, c.stride(0), c.stride(1),
                    SPLIT_K=plan.split_k, BLOCK_M=bm, BLOCK_N=bn, num_warps=4,
                )


@dataclasses.dataclass(frozen=True)
class _LaunchPlan:
    """Everything about one (problem, config) launch that does not depend on the tensors' addresses."""

    kernel: object
    reduce: object
    grid: tuple
    constexprs: dict
    split_k: int
    interpret: bool


@functools.lru_cache(maxsize=4096)
def _launch_plan(family: GemmFamily, problem: GemmProblem, config: Config, dev: torch.device) -> _LaunchPlan:
    # Worked out once per (problem, config, device): a launch then costs Triton's own launch only.
    interpret = dev.type == "cpu"
    module = load_kernel_module(family.template, interpret=interpret, **family.render_switches(problem, config))
    names = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "SPLIT_K", "WARP_SPECIALIZE", "FLATTEN", "num_warps", "num_stages")
    tiles = triton_cdiv(problem.m, config["BLOCK_M"]) * triton_cdiv(problem.n, config["BLOCK_N"])
    if config["VARIANT"] == "tma":
        grid = (min(tiles, _sm_count(dev)) if config["PERSISTENT"] else tiles,)
        if not interpret:
            ensure_triton_allocator()
    else:
        grid = (tiles, config["SPLIT_K"])
    return _LaunchPlan(module.gemm_kernel, getattr(module, "gemm_splitk_reduce", None), grid,
                       {n: config[n] for n in names}, config["SPLIT_K"], interpret)


def triton_cdiv(x: int, y: int) -> int:
    return (x + y - 1) // y


@functools.lru_cache(maxsize=None)
def _sm_count(dev: torch.device) -> int:
    if dev.type == "cpu":
        return 4  # the interpreter runs programs one after another; a few exercise the persistent loop
    return torch.cuda.get_device_properties(dev).multi_processor_count


FAMILY = GemmFamily()
