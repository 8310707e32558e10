"""GEMM template correctness under the interpreter: awkward shapes, layouts, dtypes, epilogues, every variant."""
from __future__ import annotations

import random

import pytest
import torch

import autotile
from autotile.bench import Status, run_checked
from autotile.device import interpret_device
from autotile.errors import BadInputError, ShapeMismatchError, UnsupportedDtypeError
from autotile.families.checks import compare
from autotile.families.gemm import FAMILY, GemmProblem, contiguous_problem
from autotile.space import Config

CPU = interpret_device()


def configs_for(problem, extra: int = 2, seed: int = 0) -> list[Config]:
    """The default config, one config of each variant and schedule the space allows, and a few random ones."""
    feasible = list(FAMILY.space(problem, CPU).feasible())
    chosen = [FAMILY.default_config(problem, CPU)]
    for want in ({"VARIANT": "tma", "PERSISTENT": True}, {"VARIANT": "tma", "PERSISTENT": False},
                 {"SCHEDULE": "split_k"}, {"SCHEDULE": "stream_k"}, {"SWAP_AB": True}):
        match = [c for c in feasible if all(c[k] == v for k, v in want.items())]
        if match:
            chosen.append(random.Random(seed).choice(match))
    chosen += random.Random(seed + 1).sample(feasible, min(extra, len(feasible)))
    return chosen


CASES = [
    contiguous_problem(1, 1, 1, "fp32", "fp32"),
    contiguous_problem(67, 45, 129, "fp32", "fp32"),
    contiguous_problem(67, 45, 129, "fp16", "fp16", layout_a="col", layout_b="strided"),
    contiguous_problem(13, 70, 96, "fp16", "fp32", bias=True, activation="gelu"),  # M below every BLOCK_M
    contiguous_problem(64, 48, 256, "fp16", "fp16", layout_a="col", layout_b="col", activation="silu"),
    contiguous_problem(40, 64, 128, "fp8", "bf16", layout_b="col", bias=True, activation="relu"),
    contiguous_problem(33, 32, 64, "fp8", "fp32"),
    GemmProblem(48, 40, 64, "fp16", "fp16", aligned=False),  # storage offset by one element
    contiguous_problem(1, 80, 200, "bf16", "bf16", layout_b="col", residual=True),  # decode, nn.Linear layout
    contiguous_problem(29, 96, 136, "bf16", "fp32", layout_b="col", bias=True, activation="silu", residual=True),
    contiguous_problem(24, 144, 320, "fp8", "bf16", layout_b="col", scale_mode="row", bias=True, fp8_fast_accum=True),
    contiguous_problem(24, 144, 320, "fp8", "bf16", layout_b="col", scale_mode="block", residual=True),
]


@pytest.mark.parametrize("problem", CASES, ids=lambda p: f"{p.m}x{p.n}x{p.k}-{p.dtype}-{p.layout_a}{p.layout_b}-{p.activation}"
                         f"{'-residual' if p.residual else ''}-{p.scale_mode}{'-fast' if p.fp8_fast_accum else ''}")
def test_template_matches_reference(problem):
    for config in configs_for(problem):
        outcome, _ = run_checked(FAMILY, problem, config, CPU, seed=3)
        assert outcome.status is Status.OK, f"{config.to_json()}: {outcome.status.value}: {outcome.error}"


@pytest.mark.parametrize("persistent", [False, True])
def test_tma_tiles_clamp_their_last_row_tile(persistent, monkeypatch):
    """The tma variant's whole tiles start the last row tile at M - BLOCK_M and the last column tile at N - BLOCK_N
    (gemm_space.CLAMP_ROW_TILES, CLAMP_COL_TILES): 67 rows in 32-row tiles put it at row 35, over rows of the tile
    before it, and in 16-row tiles at row 51; 48 columns in 32-column tiles at column 16. C is right either way, each
    epilogue, and the same with the switches off."""
    from autotile.families import gemm_space

    problem = contiguous_problem(67, 48, 136, "fp16", "fp16", layout_b="col", bias=True, activation="gelu",
                                 residual=True)
    space = FAMILY.space(problem, CPU)
    for clamp in (True, False):
        monkeypatch.setattr(gemm_space, "CLAMP_ROW_TILES", clamp)
        monkeypatch.setattr(gemm_space, "CLAMP_COL_TILES", clamp)
        for block_m in (16, 32):
            config = next(c for c in space.feasible() if c["VARIANT"] == "tma" and c["PERSISTENT"] == persistent
                          and c["SCHEDULE"] == "data_parallel" and c["BLOCK_M"] == block_m and c["BLOCK_N"] == 32
                          and c["BLOCK_K"] == 64)
            switches = FAMILY.render_switches(problem, config)
            assert switches["CLAMP_ROWS"] == switches["CLAMP_COLS"] == clamp
            outcome, _ = run_checked(FAMILY, problem, config, CPU, seed=4)
            assert outcome.status is Status.OK, f"{config.to_json()}: {outcome.status.value}: {outcome.error}"


def test_check_catches_a_wrong_kernel_and_names_the_worst_element():
    problem = contiguous_problem(20, 24, 40, "fp16", "fp16")
    inputs = FAMILY.make_inputs(problem, CPU, seed=0)
    expected = FAMILY.reference(problem, inputs)
    outputs = FAMILY.allocate_outputs(problem, inputs)
    FAMILY.launch(problem, FAMILY.default_config(problem, CPU), inputs, outputs)
    assert FAMILY.check(problem, inputs, outputs, expected).ok
    outputs["c"][7, 11] += 0.5
    result = FAMILY.check(problem, inputs, outputs, expected)
    assert not result.ok and "(7, 11)" in result.message
    outputs["c"][3, 2] = float("nan")
    assert "never written" in compare("c", outputs["c"], expected["c"], FAMILY.tolerance(problem)).message


def test_matmul_op_on_sliced_and_transposed_inputs():
    base = torch.randn(80, 90)
    a = base[3:40, 5:66:2]  # 37 x 31, no unit stride
    b = torch.randn(50, 31).t()  # 31 x 50, column-major
    bias = torch.randn(50)
    out = autotile.matmul(a, b, bias=bias, activation="relu")
    torch.testing.assert_close(out, torch.relu(a @ b + bias), atol=1e-4, rtol=1e-5)
    half = autotile.matmul(a.half(), b.half(), out_dtype="float32")
    assert half.dtype == torch.float32
    torch.testing.assert_close(half, a.half().float() @ b.half().float(), atol=1e-2, rtol=1e-3)


def test_matmul_fp8_with_scales():
    a = torch.randn(32, 64)
    b = torch.randn(48, 64).t()
    sa, sb = a.abs().max() / 448, b.abs().max() / 448
    a8, b8 = (a / sa).to(torch.float8_e4m3fn), (b / sb).to(torch.float8_e4m3fn)
    out = autotile.matmul(a8, b8, scale_a=sa.reshape(1), scale_b=sb.reshape(1))
    assert out.dtype == torch.bfloat16
    want = (a8.double() @ b8.double()) * sa.double() * sb.double()
    torch.testing.assert_close(out.double(), want, atol=0.05, rtol=0.02)


def test_matmul_bad_input_names_the_problem():
    with pytest.raises(ShapeMismatchError, match=r"a.shape\[1\] must equal b.shape\[0\]"):
        autotile.matmul(torch.randn(3, 4), torch.randn(5, 6))
    with pytest.raises(UnsupportedDtypeError, match="cast both"):
        autotile.matmul(torch.randn(3, 4), torch.randn(4, 5).half())
    with pytest.raises(UnsupportedDtypeError):
        autotile.matmul(torch.randint(0, 3, (3, 4)), torch.randint(0, 3, (4, 5)))
    with pytest.raises(ShapeMismatchError, match="bias must have shape"):
        autotile.matmul(torch.randn(3, 4), torch.randn(4, 5), bias=torch.randn(4))
    with pytest.raises(UnsupportedDtypeError, match="output's dtype"):  # as F.linear: no silent rounding
        autotile.linear(torch.randn(3, 4).half(), torch.randn(6, 4).half(), torch.randn(6).bfloat16())
    with pytest.raises(UnsupportedDtypeError, match="output's dtype"):
        autotile.matmul(torch.randn(3, 4).half(), torch.randn(4, 5).half(), bias=torch.randn(5))
    with pytest.raises(BadInputError, match="activation must be one of"):
        autotile.matmul(torch.randn(3, 4), torch.randn(4, 5), activation="tanh")
    with pytest.raises(ShapeMismatchError, match="2-D"):
        autotile.matmul(torch.randn(2, 3, 4), torch.randn(4, 5))


def test_matmul_traces_under_torch_compile():
    a, b = torch.randn(24, 16), torch.randn(16, 8)
    compiled = torch.compile(lambda x, y: autotile.matmul(x, y) * 2, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(a, b), (a @ b) * 2, atol=1e-4, rtol=1e-5)
    torch.library.opcheck(torch.ops.autotile.matmul, (a, b, None, None, None, None, "none", "", False),
                          test_utils=("test_schema", "test_faketensor"))


def test_cost_counts_flops_and_fewest_bytes():
    cost = FAMILY.cost(contiguous_problem(128, 256, 64, "bf16", "bf16", bias=True))
    assert cost.flops == 2 * 128 * 256 * 64
    assert cost.bytes == (128 * 64 + 64 * 256) * 2 + 128 * 256 * 2 + 256 * 2


def test_bf16_and_fp16_on_the_cpu_match_float64():
    # Triton 3.6's interpreter computes bf16 tl.dot wrongly (errors of 1e10 and more); the CPU path upcasts.
    gen = torch.Generator().manual_seed(5)
    for dtype in (torch.bfloat16, torch.float16):
        a = torch.randn(33, 70, generator=gen).to(dtype)
        b = torch.randn(41, 70, generator=gen).to(dtype).t()  # nn.Linear layout
        out = autotile.matmul(a, b)
        want = a.double() @ b.double()
        problem = FAMILY.problem_from_tensors(a, b)
        result = compare("c", out, want, FAMILY.tolerance(problem))
        assert result.ok, f"{dtype}: {result.message}"


def test_problem_fields_are_checked_and_named():
    with pytest.raises(BadInputError, match="fp8 operands only"):
        GemmProblem(8, 8, 8, "bf16", "bf16", scale_mode="row")
    with pytest.raises(BadInputError, match="fp8 operands only"):
        GemmProblem(8, 8, 8, "bf16", "bf16", fp8_fast_accum=True)
    with pytest.raises(BadInputError, match="block scales"):
        GemmProblem(8, 8, 8, "fp8", "bf16", scale_mode="block", fp8_fast_accum=True)
    with pytest.raises(BadInputError, match="scale_mode must be one of"):
        GemmProblem(8, 8, 8, "fp8", "bf16", scale_mode="channel")


def test_scale_modes_follow_the_scale_shapes():
    a = torch.randn(4, 300).to(torch.float8_e4m3fn)
    b = torch.randn(200, 300).to(torch.float8_e4m3fn).t()  # (K, N) = (300, 200)

    def mode(sa, sb):
        return FAMILY.problem_from_tensors(a, b, scale_a=sa, scale_b=sb).scale_mode

    assert mode(None, None) == "tensor" and mode(torch.ones(1), torch.ones(())) == "tensor"
    assert mode(torch.ones(4, 1), torch.ones(1, 200)) == "row" and mode(torch.ones(4), torch.ones(200)) == "row"
    assert mode(torch.ones(4, 3), torch.ones(3, 2)) == "block"  # ceil(300/128) = 3 K groups, ceil(200/128) = 2
    with pytest.raises(ShapeMismatchError, match=r"\(4, 3\) and \(3, 2\) \(1 x 128 groups"):
        mode(torch.ones(4, 2), torch.ones(2, 2))
    with pytest.raises(BadInputError, match="float32"):
        mode(torch.ones(4, 1, dtype=torch.float16), torch.ones(1, 200))
    with pytest.raises(BadInputError, match="fp8|float8"):
        FAMILY.problem_from_tensors(torch.randn(4, 8), torch.randn(8, 2), scale_a=torch.ones(1))
    with pytest.raises(ShapeMismatchError, match="residual must have the output's shape"):
        FAMILY.problem_from_tensors(torch.randn(4, 8), torch.randn(8, 2), residual=torch.randn(2, 4))


@pytest.mark.parametrize("m, k, n, shape_a, shape_b", [(16, 32, 16, (16, 1), (1, 1)), (1, 64, 256, (1, 1), (1, 2))],
                         ids=["one-block-of-B", "one-token"])
def test_block_scales_holding_one_value_are_served_as_blocks(m, k, n, shape_a, shape_b):
    """K and N within one 128-block: B's block scale is one value (and at M = 1 so is A's); the op took such a scale
    for a per-tensor one and its launch failed."""
    torch.manual_seed(0)
    a = torch.randn(m, k).to(torch.float8_e4m3fn)
    b = torch.randn(k, n).to(torch.float8_e4m3fn)
    scale_a, scale_b = torch.rand(shape_a) + 0.5, torch.rand(shape_b) + 0.5
    problem = FAMILY.problem_from_tensors(a, b, scale_a=scale_a, scale_b=scale_b)
    assert problem.scale_mode == "block"
    out = autotile.matmul(a, b, scale_a=scale_a, scale_b=scale_b)
    ref = FAMILY.reference(problem, {"a": a, "b": b, "scale_a": scale_a, "scale_b": scale_b})["c"]
    tol = FAMILY.tolerance(problem)
    assert ((out.double() - ref).abs() <= tol.atol + tol.rtol * ref.abs()).all()


def test_keys_of_problems_without_the_later_fields_are_unchanged():
    # Winners stored before residual / scale_mode / fp8_fast_accum existed keep matching their problems.
    problem = contiguous_problem(16, 8192, 8192, "bf16", "bf16")
    key = FAMILY.problem_key(problem)
    assert "residual" not in key and "scale_mode" not in key and "fp8_fast_accum" not in key
    assert FAMILY.problem_from_dict(__import__("json").loads(key)) == problem
    assert "residual" in FAMILY.problem_key(contiguous_problem(16, 64, 64, residual=True))
    assert FAMILY.bucket(contiguous_problem(9, 64, 64)) == FAMILY.bucket(contiguous_problem(16, 64, 64))


def test_cost_counts_the_residual():
    plain = FAMILY.cost(contiguous_problem(128, 256, 64, "bf16", "bf16"))
    with_residual = FAMILY.cost(contiguous_problem(128, 256, 64, "bf16", "bf16", residual=True))
    assert with_residual.bytes - plain.bytes == 128 * 256 * 2


def test_fp8_bounds_grow_with_the_reduced_precision_runs_and_stay_far_below_a_wrong_result():
    """fp8's ~14-bit running sums: an outlier output's run of additions rounds by 2^-14 of its own size, so the
    relative part of the bound grows with the run (fast accumulation: all of K). Seen on the H200 at 8192^3 fast:
    324.66 computed as 320 by torch._scaled_mm(use_fast_accum=True) and by both of the family's variants."""
    fast = FAMILY.tolerance(contiguous_problem(8192, 8192, 8192, "fp8", "bf16", layout_b="col", fp8_fast_accum=True))
    precise = FAMILY.tolerance(contiguous_problem(8192, 8192, 8192, "fp8", "bf16", layout_b="col"))
    assert fast.atol + fast.rtol * 324.657 > abs(320 - 324.657)
    assert precise.rtol < fast.rtol
    # A wrong result, an eighth off at a typical output (sqrt(K) ~ 90), still fails both bounds by far.
    for tol in (fast, precise):
        assert tol.atol + tol.rtol * 90.5 < 90.5 / 8
