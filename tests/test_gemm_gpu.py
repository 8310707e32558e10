"""GEMM kernels on a GPU: split-K and stream-K against float64 and bit for bit over repeated runs (the order in
which programs finish varies on a GPU), and launches captured in CUDA graphs without host syncs.

Skipped without a CUDA device; benchmarks/gemm_kernels_bench.py runs the wider sweep and the timings.
"""
from __future__ import annotations

import pytest
import torch

from autotile.bench import poison
from autotile.device import cuda_device
from autotile.families import gemm_space
from autotile.families.gemm import FAMILY, contiguous_problem
from autotile.families.gemm_space import GLUON_WIDE_NS

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PROBLEMS = [
    contiguous_problem(1, 4096, 4104, "bf16", "bf16", layout_b="col", residual=True),
    contiguous_problem(16, 3584, 18944, "bf16", "bf16", layout_b="col", bias=True),
    contiguous_problem(3000, 5000, 1536, "bf16", "bf16", layout_b="col", activation="silu"),
    contiguous_problem(64, 6144, 4096, "fp8", "bf16", layout_b="col", scale_mode="block"),
    contiguous_problem(2048, 4096, 4096, "fp8", "bf16", layout_b="col", scale_mode="row"),
]


def schedules(problem, device):
    """The default config and, where the space has them, a split-K and a stream-K config."""
    configs = [FAMILY.default_config(problem, device)]
    feasible = list(FAMILY.space(problem, device).feasible())
    for schedule in ("split_k", "stream_k"):
        match = [c for c in feasible if c["SCHEDULE"] == schedule]
        if match and all(c["SCHEDULE"] != schedule for c in configs):
            configs.append(max(match, key=lambda c: (c["BLOCK_M"] * c["BLOCK_N"], c["num_stages"])))
    return configs


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_right_and_repeatable(problem, config, inputs, expected, runs: int) -> torch.Tensor:
    """`config` launched `runs` times on poisoned outputs: the first result within tolerance of float64, and every
    other bit for bit the same (the order in which split tiles' programs finish varies between runs). Returns the
    result's bits."""
    results = []
    for _ in range(runs):
        outputs = FAMILY.allocate_outputs(problem, inputs)
        poison(outputs)
        FAMILY.launch(problem, config, inputs, outputs)
        results.append(bits(outputs["c"]).clone())
    torch.cuda.synchronize()
    result = FAMILY.check(problem, inputs, {"c": results[0].view(outputs["c"].dtype)}, expected)
    assert result.ok, f"{config.to_json()}: {result.message}"
    assert all(torch.equal(results[0], r) for r in results[1:]), f"{config.to_json()}: results differ between runs"
    return results[0]


def assert_switch_keeps_bits(switch: str, problem, configs, inputs, expected, monkeypatch) -> None:
    """Each config right and repeatable with gemm_space's `switch` off and on, and the same bits either way: for
    switches that change where a split tile's partials go or who sums them, never what is summed or in which order."""
    from autotile.families import gemm_launch

    results = {}
    for on in (False, True):
        monkeypatch.setattr(gemm_space, switch, on)
        gemm_launch.launch_plan.cache_clear()  # the plans render the template once
        for config in configs:
            results.setdefault(config.to_json(), []).append(
                assert_right_and_repeatable(problem, config, inputs, expected, runs=2))
    gemm_launch.launch_plan.cache_clear()
    for name, (off, on) in results.items():
        assert torch.equal(off, on), f"{name}: {switch} changed the result"


def assert_admitted_and_right(problem, wanted: list[dict], seed: int) -> None:
    """Each config of `wanted` admitted by the space as it is, then right and repeatable over three runs."""
    device = cuda_device(0)
    inputs = FAMILY.make_inputs(problem, device, seed=seed)
    expected = FAMILY.reference(problem, inputs)
    space = FAMILY.space(problem, device)
    for config in wanted:
        admitted = space.admit(config)
        assert admitted is not None, (config, space.violations(config))
        assert_right_and_repeatable(problem, admitted, inputs, expected, runs=3)


@pytest.mark.parametrize("problem", PROBLEMS, ids=lambda p: f"{p.m}x{p.n}x{p.k}-{p.dtype}-{p.scale_mode}")
def test_split_tiles_match_float64_and_repeat_bit_for_bit(problem):
    device = cuda_device(0)
    inputs = FAMILY.make_inputs(problem, device, seed=3)
    expected = FAMILY.reference(problem, inputs)
    for config in schedules(problem, device):
        assert_right_and_repeatable(problem, config, inputs, expected, runs=6)


def test_split_k_and_stream_k_launches_capture_in_cuda_graphs():
    device = cuda_device(0)
    problem = contiguous_problem(8, 4096, 4096, "bf16", "bf16", layout_b="col")
    inputs = FAMILY.make_inputs(problem, device, seed=1)
    expected = FAMILY.reference(problem, inputs)
    for config in schedules(problem, device)[:3]:
        outputs = FAMILY.allocate_outputs(problem, inputs)
        FAMILY.launch(problem, config, inputs, outputs)  # compile and plan outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        torch.cuda.set_sync_debug_mode("error")
        try:
            with torch.cuda.graph(graph):
                FAMILY.launch(problem, config, inputs, outputs)
            for _ in range(3):
                outputs["c"].fill_(float("nan"))
                graph.replay()
                eager = FAMILY.allocate_outputs(problem, inputs)
                FAMILY.launch(problem, config, inputs, eager)  # eager launches between replays share nothing
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        for out in (outputs, eager):
            result = FAMILY.check(problem, inputs, out, expected)
            assert result.ok, f"{config.to_json()}: {result.message}"


def test_captured_split_launches_take_graph_counters_zeroed_once():
    # Two graphs of one split config, replayed in turns with eager launches between: each captured launch takes
    # counters of its own from the device's arena (no memset node), and leaves them zero after every replay.
    from autotile.families import gemm_launch

    device = cuda_device(0)
    problem = contiguous_problem(1, 1024, 4096, "bf16", "bf16", layout_b="col")
    config = FAMILY.default_config(problem, device)
    assert config["SCHEDULE"] == "split_k", config
    inputs = FAMILY.make_inputs(problem, device, seed=2)
    expected = FAMILY.reference(problem, inputs)
    eager = FAMILY.allocate_outputs(problem, inputs)
    FAMILY.launch(problem, config, inputs, eager)  # plans, and makes the arena outside any capture
    torch.cuda.synchronize()
    arena = gemm_launch._graph_arenas[torch.cuda.current_device()]
    first = arena[1]
    graphs, outputs = [], []
    for _ in range(2):
        out = FAMILY.allocate_outputs(problem, inputs)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            FAMILY.launch(problem, config, inputs, out)
        graphs.append(graph)
        outputs.append(out)
    assert arena[1] > first, "the captured launches took counters from the arena"
    for _ in range(4):
        for graph, out in zip(graphs, outputs):
            out["c"].fill_(float("nan"))
            graph.replay()
            FAMILY.launch(problem, config, inputs, eager)
    torch.cuda.synchronize()
    for out in outputs + [eager]:
        result = FAMILY.check(problem, inputs, out, expected)
        assert result.ok, result.message
    assert int(arena[0][first:arena[1]].count_nonzero()) == 0, "replays leave their counters zero"


@pytest.mark.parametrize("problem", [
    contiguous_problem(300, 1000, 784, "bf16", "bf16", layout_b="row", bias=True, activation="gelu", residual=True),
    contiguous_problem(513, 4616, 2056, "fp16", "fp16", layout_b="col", activation="silu"),
], ids=["bf16-b-row", "fp16-b-col"])
def test_gluon_ws_two_part_tiles_match_float64(problem, monkeypatch):
    """WIDE_N: 96-, 144-, 160- and 192-column tiles held as a power-of-two part and a 16-, 32- or 64-column rest, N
    not a multiple of any, each epilogue, one and two consumer warpgroups, whole and split over K (gemm_space's
    GLUON_TWO_PART_SPLIT, on since this test and the swapped one passed on an H100:
    results/gemm_two_part_split_tests_2026-12-07_h100.txt)."""
    monkeypatch.setattr(gemm_space, "GLUON_TWO_PART_SPLIT", True)
    device = cuda_device(0)
    inputs = FAMILY.make_inputs(problem, device, seed=5)
    expected = FAMILY.reference(problem, inputs)
    for width in GLUON_WIDE_NS:
        configs = [c for c in FAMILY.space(problem, device).feasible() if c["BLOCK_N"] == width
                   and c["BLOCK_K"] == 64 and c["num_stages"] == 4 and c["GROUP_M"] in (1, 8)]
        assert {c["BLOCK_M"] for c in configs} == {64, 128}
        for block_m in (64, 128):
            for schedule, split in (("data_parallel", 1), ("split_k", 3)):
                config = next(c for c in configs if c["BLOCK_M"] == block_m and c["SCHEDULE"] == schedule
                              and c["SPLIT_K"] == split)
                assert_right_and_repeatable(problem, config, inputs, expected, runs=2)


@pytest.mark.parametrize("problem", [
    contiguous_problem(1024, 512, 3584, "bf16", "bf16", layout_b="col", bias=True),
    contiguous_problem(300, 2600, 4104, "fp16", "fp16", layout_b="row", activation="silu", residual=True),
], ids=["bf16-b-col", "fp16-b-row"])
def test_partials_in_register_order_give_the_row_major_layouts_bits(problem, monkeypatch):
    """gemm_space.COALESCED_PARTIALS changes where a split tile's partials lie in the workspace, not what is summed
    or in which order: split-K (2 and 4 ways, 128 x 128 and two-part 128 + 64 tiles) and stream-K give the same bits
    with it on as off, and match float64."""
    monkeypatch.setattr(gemm_space, "GLUON_TWO_PART_SPLIT", True)
    device = cuda_device(0)
    inputs = FAMILY.make_inputs(problem, device, seed=7)
    expected = FAMILY.reference(problem, inputs)
    feasible = [c for c in FAMILY.space(problem, device).feasible() if c["VARIANT"] == "gluon_ws"
                and not c["SWAP_AB"] and c["BLOCK_M"] == 128 and c["BLOCK_K"] == 64 and c["GROUP_M"] == 8]
    wanted = [(128, "split_k", 2), (128, "split_k", 4), (128, "stream_k", 1), (192, "split_k", 3)]
    configs = [max((c for c in feasible if (c["BLOCK_N"], c["SCHEDULE"], c["SPLIT_K"]) == w),
                   key=lambda c: c["num_stages"]) for w in wanted]
    assert_switch_keeps_bits("COALESCED_PARTIALS", problem, configs, inputs, expected, monkeypatch)


@pytest.mark.parametrize("problem", [
    contiguous_problem(1024, 512, 3584, "bf16", "bf16", layout_b="col", bias=True, activation="silu"),
    contiguous_problem(100, 3072, 3080, "bf16", "bf16", layout_b="col"),
    contiguous_problem(300, 2600, 4104, "fp16", "fp16", layout_b="row", residual=True),
], ids=["bf16-128x128", "bf16-swapped", "fp16-b-row"])
def test_owned_splits_give_the_last_arrivals_bits(problem, monkeypatch):
    """gemm_space.OWNED_SPLITS changes which contributor finishes a split tile's rows, not what is summed or in which
    order: split-K 2, 3 and 4 ways, in tiles of two warpgroups (owned) and of one (the last arrival's protocol either
    way), swapped and not, where each program runs one split and (fp16-b-row, 4 ways) where programs run several and
    the template keeps the last arrival's protocol, give the same bits with it on as off, match float64 and repeat
    (the counters start from zero again)."""
    device = cuda_device(0)
    inputs = FAMILY.make_inputs(problem, device, seed=11)
    expected = FAMILY.reference(problem, inputs)
    feasible = [c for c in FAMILY.space(problem, device).feasible() if c["VARIANT"] == "gluon_ws"
                and c["SCHEDULE"] == "split_k" and c["BLOCK_N"] <= 128 and c["BLOCK_K"] == 64]
    wanted = [(128, 128, False, 4), (128, 128, False, 2), (64, 128, False, 3), (64, 128, True, 2)]
    configs = {}
    for c in feasible:
        key = (c["BLOCK_M"], c["BLOCK_N"], c["SWAP_AB"], c["SPLIT_K"])
        if key in wanted:
            configs[key] = max(configs.get(key, c), c, key=lambda x: (x["GROUP_M"], x["num_stages"]))
    assert len(configs) >= 3, sorted(configs)
    assert_switch_keeps_bits("OWNED_SPLITS", problem, configs.values(), inputs, expected, monkeypatch)


GLUON_PROBLEMS = [
    contiguous_problem(77, 1000, 784, "bf16", "bf16", layout_b="row", bias=True, activation="gelu", residual=True),
    contiguous_problem(513, 4104, 2056, "fp16", "fp16", layout_b="col", activation="silu"),
    contiguous_problem(200, 1008, 768, "fp8", "bf16", layout_b="col"),
    contiguous_problem(3000, 5008, 1536, "fp8", "bf16", layout_b="col", scale_mode="row", bias=True),
    contiguous_problem(1000, 4096, 4096, "fp8", "bf16", layout_b="col", fp8_fast_accum=True),
]


@pytest.mark.parametrize("problem", GLUON_PROBLEMS, ids=lambda p: f"{p.m}x{p.n}x{p.k}-{p.dtype}-{p.scale_mode}"
                         f"{'-fast' if p.fp8_fast_accum else ''}")
def test_gluon_ws_matches_float64_and_repeats_bit_for_bit(problem):
    """The Gluon variant under each schedule (whole tiles; then stream-K's or split-K's share of the last wave:
    every shape here leaves one part-empty), with one and two consumer warpgroups, C stored whole and in halves,
    and each epilogue."""
    device = cuda_device(0)
    inputs = FAMILY.make_inputs(problem, device, seed=5)
    expected = FAMILY.reference(problem, inputs)
    feasible = [c for c in FAMILY.space(problem, device).feasible()
                if c["VARIANT"] == "gluon_ws" and not c["SWAP_AB"] and c["BLOCK_K"] <= 128 and c["BLOCK_N"] >= 128]
    narrowest_k = min((c["BLOCK_K"] for c in feasible), default=0)
    widest_n = max((c["BLOCK_N"] for c in feasible), default=0)
    configs = {}
    for c in feasible:
        two = c["BLOCK_M"] == 128 and c["BLOCK_N"] == widest_n
        one = c["BLOCK_M"] == 64 and c["BLOCK_N"] == 128
        halves = c["EPILOGUE_SUBTILE"] and not (two and c["SCHEDULE"] == "data_parallel")
        if c["BLOCK_K"] != narrowest_k or not (two or one) or halves or c["SPLIT_K"] not in (1, 3):
            continue
        key = (c["BLOCK_M"], c["BLOCK_N"], c["SCHEDULE"], c["EPILOGUE_SUBTILE"])
        configs[key] = max(configs.get(key, c), c, key=lambda x: (x["GROUP_M"], x["num_stages"]))
    assert {key[2] for key in configs} >= {"data_parallel", "stream_k", "split_k"}, configs.keys()
    for config in configs.values():
        assert_right_and_repeatable(problem, config, inputs, expected, runs=3)


# (problem, pingpong tiles): odd sizes and each epilogue; 3000 x 5008 gives each warpgroup 3-4 tiles of 128 x 128
# (many hand-overs of the turn), 1000 x 1000 x 104 fewer K tiles than ring slots, 77 rows one tile row.
PINGPONG_CASES = [
    (contiguous_problem(77, 1000, 784, "bf16", "bf16", layout_b="row", bias=True, activation="gelu", residual=True),
     [dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_stages=4),
      dict(BLOCK_M=64, BLOCK_N=256, BLOCK_K=64, num_stages=4, EPILOGUE_SUBTILE=True)]),
    (contiguous_problem(3000, 5008, 1536, "bf16", "bf16", layout_b="col", bias=True),
     [dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_stages=5),
      dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_stages=6, EPILOGUE_SUBTILE=True),
      dict(BLOCK_M=64, BLOCK_N=256, BLOCK_K=64, num_stages=4)]),
    (contiguous_problem(1000, 1000, 104, "fp16", "fp16", layout_b="col", activation="silu"),
     [dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_stages=5)]),
    (contiguous_problem(1000, 4096, 4096, "fp8", "bf16", layout_b="col", scale_mode="row"),
     [dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, num_stages=6)]),
    (contiguous_problem(1000, 4096, 4096, "fp8", "bf16", layout_b="col", fp8_fast_accum=True, residual=True),
     [dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_stages=5)]),
]


@pytest.mark.parametrize("problem,tiles", PINGPONG_CASES,
                         ids=[f"{p.m}x{p.n}x{p.k}-{p.dtype}{'-fast' if p.fp8_fast_accum else ''}" for p, _ in PINGPONG_CASES])
def test_gluon_ws_pingpong_matches_float64_and_repeats_bit_for_bit(problem, tiles):
    """The pingpong schedule: two consumer warpgroups taking whole tiles in turn, each with its own C staging."""
    from autotile.families.gemm_policy import gluon_config

    assert_admitted_and_right(problem, [gluon_config(problem, SCHEDULE="pingpong", **t) for t in tiles], seed=9)


# (problem, swapped tiles): tokens (BLOCK_M) on wgmma's N side over 64 or 128 weight rows (BLOCK_N); M never a
# multiple of the token tile, N not of the weight rows, each epilogue (a bias is a weight row's), fp8 row scales.
SWAPPED_CASES = [
    (contiguous_problem(300, 1000, 784, "fp16", "fp16", layout_b="col", bias=True, activation="gelu", residual=True),
     [dict(BLOCK_M=96, BLOCK_N=128), dict(BLOCK_M=80, BLOCK_N=128), dict(BLOCK_M=64, BLOCK_N=64, SCHEDULE="stream_k"),
      dict(BLOCK_M=32, BLOCK_N=128, SCHEDULE="split_k", SPLIT_K=3), dict(BLOCK_M=160, BLOCK_N=64),
      dict(BLOCK_M=96, BLOCK_N=128, SCHEDULE="split_k", SPLIT_K=3)]),
    (contiguous_problem(77, 4104, 2056, "bf16", "bf16", layout_b="col", activation="silu"),
     [dict(BLOCK_M=16, BLOCK_N=64, SCHEDULE="split_k", SPLIT_K=2), dict(BLOCK_M=96, BLOCK_N=128),
      dict(BLOCK_M=128, BLOCK_N=128, SCHEDULE="stream_k"), dict(BLOCK_M=80, BLOCK_N=64, SCHEDULE="split_k", SPLIT_K=2)]),
    # Two-part token tiles split over K where the tiles are few (narrow weights, long K), K not a multiple of the
    # splits' K tiles.
    (contiguous_problem(150, 2568, 10200, "bf16", "bf16", layout_b="col", bias=True, residual=True),
     [dict(BLOCK_M=144, BLOCK_N=128, SCHEDULE="split_k", SPLIT_K=4),
      dict(BLOCK_M=160, BLOCK_N=64, SCHEDULE="split_k", SPLIT_K=3)]),
    (contiguous_problem(1000, 1032, 1000, "bf16", "bf16", layout_b="col", bias=True),
     [dict(BLOCK_M=256, BLOCK_N=64), dict(BLOCK_M=192, BLOCK_N=128)]),
    (contiguous_problem(200, 1008, 768, "fp8", "bf16", layout_b="col", scale_mode="row", bias=True),
     [dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, num_stages=4),
      dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, SCHEDULE="split_k", SPLIT_K=3)]),
]


@pytest.mark.parametrize("problem,tiles", SWAPPED_CASES, ids=[f"{p.m}x{p.n}x{p.k}-{p.dtype}" for p, _ in SWAPPED_CASES])
def test_gluon_ws_swapped_tiles_match_float64_and_repeat_bit_for_bit(problem, tiles, monkeypatch):
    """Swapped Gluon tiles (C^T = W X^T, C^T stored transposed through the staging buffer) under each schedule, two-part
    token tiles split over K included (gemm_space.GLUON_TWO_PART_SPLIT, on here)."""
    from autotile.families.gemm_policy import gluon_swapped_config

    monkeypatch.setattr(gemm_space, "GLUON_TWO_PART_SPLIT", True)
    device = cuda_device(0)
    assert_admitted_and_right(problem, [gluon_swapped_config(problem, device, **t) for t in tiles], seed=11)


# (problem, tiles of the Gluon or, with VARIANT "tma", the tma variant) whose last row tile starts at M - BLOCK_M and
# last column tile at N - BLOCK_N (gemm_space.CLAMP_ROW_TILES, CLAMP_COL_TILES): 392 rows leave 8 of the last
# 128-row tile, 300 rows 44 of the last 64; 1000 columns 104 of the last 128 and 136 of the last 144, 4104 columns 8
# of the last 128; swapped tiles (SWAP_AB) clamp the tokens, 300 in 96- or 144-token tiles. Whole tiles
# (data_parallel, pingpong), each epilogue, fp8 row and block scales.
CLAMPED_CASES = [
    (contiguous_problem(392, 1000, 784, "bf16", "bf16", layout_b="row", bias=True, activation="gelu", residual=True),
     [dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_stages=5),
      dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_stages=4, SCHEDULE="pingpong"),
      dict(BLOCK_M=128, BLOCK_N=144, BLOCK_K=64, num_stages=4),
      dict(VARIANT="tma", BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_stages=4, num_warps=8, PERSISTENT=True)]),
    (contiguous_problem(300, 1000, 784, "fp16", "fp16", layout_b="col", bias=True, activation="gelu", residual=True),
     [dict(SWAP_AB=True, BLOCK_M=96, BLOCK_N=128), dict(SWAP_AB=True, BLOCK_M=144, BLOCK_N=64)]),
    (contiguous_problem(300, 4104, 2056, "fp16", "fp16", layout_b="col", activation="silu"),
     [dict(BLOCK_M=64, BLOCK_N=192, BLOCK_K=64, num_stages=6),
      dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_stages=6, EPILOGUE_SUBTILE=True),
      dict(BLOCK_M=64, BLOCK_N=256, BLOCK_K=64, num_stages=4, SCHEDULE="pingpong", EPILOGUE_SUBTILE=True),
      dict(VARIANT="tma", BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, num_stages=4),
      dict(VARIANT="tma", BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_stages=3, num_warps=8, EPILOGUE_SUBTILE=True)]),
    (contiguous_problem(200, 1008, 768, "fp8", "bf16", layout_b="col", scale_mode="row", bias=True),
     [dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_stages=4, PROMOTE_TILES=1)]),
    (contiguous_problem(200, 1024, 1024, "fp8", "bf16", layout_b="col", scale_mode="block", residual=True),
     [dict(VARIANT="tma", BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_stages=4, num_warps=8)]),
]


@pytest.mark.parametrize("problem,tiles", CLAMPED_CASES, ids=[f"{p.m}x{p.n}x{p.k}-{p.dtype}" for p, _ in CLAMPED_CASES])
def test_clamped_last_row_tile_matches_float64_and_the_unclamped_bit_for_bit(problem, tiles, monkeypatch):
    """The last row tile moved back to end at row M recomputes rows of the tile before it: C is right, repeatable, and
    bit for bit what the tiles give unclamped (the rows written twice get the same values)."""
    from autotile.families.gemm_launch import launch_plan
    from autotile.families.gemm_policy import gluon_config, gluon_swapped_config

    device = cuda_device(0)
    inputs = FAMILY.make_inputs(problem, device, seed=13)
    expected = FAMILY.reference(problem, inputs)
    space = FAMILY.space(problem, device)
    for wanted in tiles:
        swap = wanted.get("SWAP_AB", False)
        asked = gluon_swapped_config(problem, device, **wanted) if swap else gluon_config(problem, **wanted)
        config = space.admit(asked)
        assert config is not None, (wanted, space.violations(asked))
        results = {}
        for clamp in (True, False):
            monkeypatch.setattr(gemm_space, "CLAMP_ROW_TILES", clamp)
            monkeypatch.setattr(gemm_space, "CLAMP_COL_TILES", clamp)
            launch_plan.cache_clear()
            switches = FAMILY.render_switches(problem, config)
            assert switches["CLAMP_COLS"] == clamp and switches["CLAMP_ROWS"] == (clamp and not config["SWAP_AB"])
            assert_right_and_repeatable(problem, config, inputs, expected, runs=2)
            outputs = FAMILY.allocate_outputs(problem, inputs)
            FAMILY.launch(problem, config, inputs, outputs)
            results[clamp] = bits(outputs["c"]).clone()
        launch_plan.cache_clear()
        assert torch.equal(results[True], results[False]), f"{config.to_json()}: clamped differs from unclamped"


TMA_PROBLEMS = [
    contiguous_problem(1000, 3000, 776, "bf16", "bf16", layout_b="col", bias=True, residual=True),
    contiguous_problem(512, 4104, 2048, "fp16", "fp16", layout_a="col", layout_b="row", activation="silu"),
    contiguous_problem(2048, 2048, 2048, "fp8", "bf16", layout_b="col", scale_mode="block"),
]


@pytest.mark.parametrize("problem", TMA_PROBLEMS, ids=lambda p: f"{p.m}x{p.n}x{p.k}-{p.dtype}-a{p.layout_a}")
def test_tma_variant_takes_host_descriptors_of_each_calls_tensors(problem):
    """The tma variant's descriptors are built on the host, kept per base address: each schedule, persistent and
    not, C whole and in halves, A column-major, fp8 scales; every run writes a new C (a new descriptor)."""
    device = cuda_device(0)
    inputs = FAMILY.make_inputs(problem, device, seed=7)
    expected = FAMILY.reference(problem, inputs)
    wanted = {("data_parallel", True, False), ("data_parallel", False, True), ("split_k", False, False),
              ("stream_k", False, True)}  # (schedule, persistent, C in halves)
    picked = {}
    for c in FAMILY.space(problem, device).feasible():
        key = (c["SCHEDULE"], c["PERSISTENT"], c["EPILOGUE_SUBTILE"])
        if (c["VARIANT"] == "tma" and key in wanted and not c["WARP_SPECIALIZE"] and not c["FLATTEN"]
                and c["BLOCK_M"] == 128 and c["BLOCK_K"] == 64 and c["num_stages"] == 3 and c["GROUP_M"] == 8):
            if key not in picked or c["BLOCK_N"] > picked[key]["BLOCK_N"]:
                picked[key] = c
    assert set(picked) == wanted, picked
    for config in picked.values():
        assert_right_and_repeatable(problem, config, inputs, expected, runs=3)
