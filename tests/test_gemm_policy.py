"""The GEMM policy: every LLM projection gets a feasible default config, each regime gets the kernel it
should, and the seeds of a search are distinct points of the space around it."""
from __future__ import annotations

import dataclasses
import math

import pytest

from autotile.device import HOPPER_SMEM_PER_BLOCK, DeviceInfo, interpret_device
from autotile.families.gemm import FAMILY, contiguous_problem
from autotile.families.gemm_policy import (
    FILL_SMS, LONG_K_GLUON_SPLIT_MIN_K, MID_GLUON_FEW_FILL, MID_GLUON_FILL, MID_LONG_K, MID_SWAPPED_MAX_EMPTY,
    NARROW_MIN_K, STREAM_MAX_M, TOKEN_TILE_FEW_ROW_READS, TOKEN_TILE_ROW_READS, WIDE_STREAM_MAX_M, prefill_config,
    programs, regime, tiled_mid_config, token_tile_config, wave_efficiency,
)
from autotile.families.gemm_space import FP8_PRECISE_INTERVAL, SPLIT_K_CHOICES, SPLIT_K_WORKSPACE_LIMIT, tile_count
from autotile.models import MODELS, TOKEN_BUCKETS, projections
from autotile.space import Config

H200 = DeviceInfo("h200", "NVIDIA H200", (9, 0), 132, 150_000_000_000, HOPPER_SMEM_PER_BLOCK, "test")
A100 = DeviceInfo("a100", "NVIDIA A100", (8, 0), 108, 80_000_000_000, 166912, "test")
FP8_MODES = ({}, {"fp8_fast_accum": True}, {"scale_mode": "row"}, {"scale_mode": "block"})


def llm_problems(dtype: str, extra: dict, tokens=TOKEN_BUCKETS + (3, 24, 100, 3000)):
    out = "bf16" if dtype == "fp8" else dtype
    for model in MODELS.values():
        for proj in projections(model):
            for m in tokens:
                yield contiguous_problem(m, proj.n, proj.k, dtype, out, layout_b="col", bias=proj.bias, **extra)


@pytest.mark.parametrize("dtype,extra", [("bf16", {}), ("fp16", {})] + [("fp8", mode) for mode in FP8_MODES],
                         ids=["bf16", "fp16", "fp8", "fp8-fast", "fp8-row", "fp8-block"])
def test_every_llm_projection_has_a_feasible_default(dtype, extra):
    # Llama, Mistral, Qwen, Phi and Gemma projections (fused and not) at every M bucket and a few odd M,
    # among them 8192 x 57344 x 8192 and 8192 x 37888 x 3584, which once raised "no feasible config".
    for problem in llm_problems(dtype, extra):
        for device in (H200, interpret_device()) if dtype == "bf16" else (H200,):
            config = FAMILY.default_config(problem, device)
            space = FAMILY.space(problem, device)
            assert space.is_feasible(config), (problem, space.violations(config))
            if config["SCHEDULE"] == "split_k":
                tiles = tile_count(problem, config["BLOCK_M"], config["BLOCK_N"])
                assert tiles * config["SPLIT_K"] * config["BLOCK_M"] * config["BLOCK_N"] <= SPLIT_K_WORKSPACE_LIMIT


@pytest.mark.parametrize("m,n,k", [(8192, 57344, 8192), (8192, 37888, 3584)])
def test_the_shapes_that_raised_no_feasible_config(m, n, k):
    for layout_b in ("row", "col"):
        problem = contiguous_problem(m, n, k, "bf16", "bf16", layout_b=layout_b)
        for device in (H200, A100, interpret_device()):
            assert FAMILY.space(problem, device).is_feasible(FAMILY.default_config(problem, device))


def test_decode_splits_narrow_weights_over_k():
    problem = contiguous_problem(1, 1024, 4096, "bf16", "bf16", layout_b="col")
    assert regime(problem) == "decode"
    config = FAMILY.default_config(problem, H200)
    assert config["BLOCK_M"] == 16 and config["SWAP_AB"] and config["SCHEDULE"] == "split_k"
    tiles = tile_count(problem, config["BLOCK_M"], config["BLOCK_N"])
    assert config["SPLIT_K"] > 1 and tiles * config["SPLIT_K"] <= programs(problem, config, H200), "one wave"
    # No SWAP_AB before Hopper.
    assert not FAMILY.default_config(problem, A100)["SWAP_AB"]


@pytest.mark.parametrize("n,k,width,swap", [
    (2048, 3584, 32, False), (4096, 4096, 32, False), (4608, 3584, 64, True), (8192, 3072, 64, True),
    (9216, 3072, 128, True), (14336, 4096, 128, True), (28672, 4096, 64, True), (4096, 14336, 32, False),
    (8960, 1536, 128, True), (1536, 1536, 64, True), (1024, 2048, 32, False), (896, 896, 64, True)])
def test_decode_takes_whole_tiles_where_the_weight_is_wide_enough(n, k, width, swap):
    # The narrowest width whose tiles fit one an SM; past 128-column tiles in one wave, 64-column waves.
    for m in (1, 16):
        config = FAMILY.default_config(contiguous_problem(m, n, k, "bf16", "bf16", layout_b="col"), H200)
        assert config["SCHEDULE"] == "data_parallel" and config["SPLIT_K"] == 1
        assert (config["BLOCK_M"], config["BLOCK_N"], config["SWAP_AB"]) == (16, width, swap)


@pytest.mark.parametrize("m,width,swap", [(32, 32, False), (48, 32, False), (64, 32, False)])
def test_streaming_takes_decode_s_whole_tiles(m, width, swap):
    config = FAMILY.default_config(contiguous_problem(m, 4096, 4096, "bf16", "bf16", layout_b="col"), H200)
    assert config["SCHEDULE"] == "data_parallel" and config["BLOCK_M"] >= m
    assert (config["BLOCK_N"], config["SWAP_AB"]) == (width, swap)
    # 64 tokens: 32 x 256 tiles overflow shared memory in 5 stages, so 128-deep ones.
    assert config["BLOCK_K"] == (256 if m <= 32 else 128)
    narrow = FAMILY.default_config(contiguous_problem(m, 1024, 4096, "bf16", "bf16", layout_b="col"), H200)
    assert narrow["SCHEDULE"] == "split_k"


def test_decode_keeps_the_split_outside_the_measured_rule():
    # Very short K, fp8, and GPUs without wgmma keep the split-K rule.
    for problem, device in ((contiguous_problem(1, 4096, 512, "bf16", "bf16", layout_b="col"), H200),
                            (contiguous_problem(1, 4096, 4096, "fp8", "bf16", layout_b="col"), H200),
                            (contiguous_problem(1, 4096, 4096, "bf16", "bf16", layout_b="col"), A100)):
        assert FAMILY.default_config(problem, device)["SCHEDULE"] == "split_k", problem


def test_prefill_takes_large_tma_tiles_and_irregular_shapes_stream_k():
    # The Triton variants' prefill rule (Hopper serves the Gluon variant instead: the next test).
    square = prefill_config(contiguous_problem(4096, 4096, 4096, "bf16", "bf16", layout_b="col"), H200, gluon=False)
    assert (square["VARIANT"], square["PERSISTENT"], square["BLOCK_M"], square["BLOCK_N"]) == ("tma", True, 128, 256)
    # A last wave a third empty: stream-K for fp8 (and tf32); 16-bit operands keep the persistent data-parallel
    # tiles, which the H200 measured faster (gemm_policy.prefill_config).
    for dtype, out, extra, schedule in (("fp8", "bf16", {}, "stream_k"), ("bf16", "bf16", {}, "data_parallel")):
        irregular = contiguous_problem(3000, 5000, 1536, dtype, out, layout_b="col", **extra)
        config = prefill_config(irregular, H200, gluon=False)
        tiles = tile_count(irregular, config["BLOCK_M"], config["BLOCK_N"])
        assert wave_efficiency(tiles, programs(irregular, config, H200)) < 0.92
        assert config["SCHEDULE"] == schedule, dtype
    assert config["PERSISTENT"]
    unaligned = FAMILY.default_config(contiguous_problem(1000, 3000, 777, "bf16", "bf16"), H200)
    assert unaligned["VARIANT"] == "blocked"


def test_hopper_prefill_takes_the_gluon_variant_in_whole_tiles():
    # results/gluon_gemm_2026-12-04_bf16.md: whole 128 x 256 x 64 tiles, 128 x 128 where those fill the waves better
    # (2048 x 4608 x 3584: 73% of the slots busy against 87%); the tma variant's default is the first seed.
    def default(m, n, k, dtype="bf16", **extra):
        problem = contiguous_problem(m, n, k, dtype, "bf16", layout_b="col", **extra)
        return problem, FAMILY.default_config(problem, H200)

    # 192-column tiles where they fill the waves best by 5% (2048 x 4608 x 3584: 97% against 87%; 3000 x 5000 x 1536:
    # 98% against 91%), not where they tie (4096 x 4608 x 3584 with 128 x 128, 2048 x 6144 x 4096 with 128 x 256).
    # Two-part 144 and 160 where their waves are shorter by 5% in the model (results/gluon_gemm_2026-12-04_parts.md:
    # 1024 x 4608 x 3584 0.805x of cuBLAS against 0.716x, 1024 x 5120 x 5120 0.852x against 0.789x), not at 2048 tokens
    # where 128 x 128 led both.
    for m, n, k, width in ((4096, 4096, 4096, 256), (3000, 5000, 1536, 192), (2048, 4608, 3584, 192),
                           (4096, 4608, 3584, 128), (2048, 6144, 4096, 256), (1024, 4608, 3584, 144),
                           (1024, 5120, 5120, 160), (2048, 5120, 5120, 128), (1024, 6144, 4096, 128)):
        problem, config = default(m, n, k)
        assert (config["VARIANT"], config["SCHEDULE"], config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]) == \
            ("gluon_ws", "data_parallel", 128, width, 64), config
        seeds = FAMILY.seed_configs(problem, H200)
        assert seeds[0]["VARIANT"] == "tma" and seeds[0]["PERSISTENT"]
        assert any(s["VARIANT"] == "gluon_ws" and s["EPILOGUE_SUBTILE"] for s in seeds)
        assert any(s["VARIANT"] == "gluon_ws" and s["SCHEDULE"] == "stream_k" for s in seeds)
        assert any(s["VARIANT"] == "gluon_ws" and s["SCHEDULE"] == "split_k" and s["SPLIT_K"] == 2 for s in seeds)
        tried = [config, *seeds]  # a seed equal to the default is not repeated
        assert {144, 160, 192} <= {s["BLOCK_N"] for s in tried if s["VARIANT"] == "gluon_ws"}
    _, precise = default(4096, 4096, 4096, "fp8")
    _, fast = default(4096, 4096, 4096, "fp8", fp8_fast_accum=True)
    assert (precise["VARIANT"], precise["SCHEDULE"], precise["BLOCK_N"]) == ("gluon_ws", "data_parallel", 128)
    assert (fast["VARIANT"], fast["SCHEDULE"], fast["BLOCK_N"]) == ("gluon_ws", "data_parallel", 256)
    # Where Gluon does not run (an A100, the interpreter) the Triton variants' rules decide.
    for device in (A100, interpret_device()):
        assert FAMILY.default_config(contiguous_problem(4096, 4096, 4096, "bf16", "bf16", layout_b="col"),
                                     device)["VARIANT"] != "gluon_ws"


def test_fp8_accumulation_modes():
    precise = contiguous_problem(4096, 4096, 4096, "fp8", "bf16", layout_b="col")
    # On Hopper, precise fp8 is the Gluon variant's (one promotion per 128-wide K tile); the tma variant, whose
    # promotion drains the MMAs, is seeded summing two K tiles between promotions.
    gluon = FAMILY.default_config(precise, H200)
    assert gluon["VARIANT"] == "gluon_ws" and gluon["PROMOTE_TILES"] * gluon["BLOCK_K"] <= FP8_PRECISE_INTERVAL
    config = next(c for c in FAMILY.seed_configs(precise, H200) if c["VARIANT"] == "tma" and c["PROMOTE_TILES"] > 1)
    assert config["PROMOTE_TILES"] * config["BLOCK_K"] <= FP8_PRECISE_INTERVAL
    fast = FAMILY.default_config(dataclasses.replace(precise, fp8_fast_accum=True), H200)
    assert "PROMOTE_TILES" not in fast and (fast["BLOCK_N"], fast["BLOCK_K"]) == (256, 128)
    block = FAMILY.default_config(dataclasses.replace(precise, scale_mode="block"), H200)
    assert 128 % block["BLOCK_K"] == 0 and "PROMOTE_TILES" not in block
    # Two accumulators (precise, block) must fit the registers: 128 x 256 does not, at 8 warps.
    space = FAMILY.space(precise, H200)
    assert any("accumulator_registers" in v for v in space.violations(dict(config, BLOCK_N=256)))


@pytest.mark.parametrize("problem", [contiguous_problem(1, 4096, 4096, "bf16", "bf16", layout_b="col"),
                                     contiguous_problem(64, 6144, 4096, "bf16", "bf16", layout_b="col"),
                                     contiguous_problem(2048, 4096, 4096, "bf16", "bf16", layout_b="col"),
                                     contiguous_problem(3000, 5000, 1536, "bf16", "bf16", layout_b="col"),
                                     contiguous_problem(4096, 4096, 4096, "fp8", "bf16", layout_b="col")],
                         ids=lambda p: f"{p.m}x{p.n}x{p.k}-{p.dtype}")
def test_seeds_are_distinct_points_around_the_default(problem):
    default = FAMILY.default_config(problem, H200)
    seeds = FAMILY.seed_configs(problem, H200)
    space = FAMILY.space(problem, H200)
    assert len(seeds) >= 3 and len(set(seeds)) == len(seeds) and default not in seeds
    assert all(space.is_feasible(seed) for seed in seeds)
    # A short search tries the schedules the default did not take.
    assert {seed["SCHEDULE"] for seed in seeds} - {default["SCHEDULE"]}


def test_mid_sized_m_fills_the_gpu():
    for m in (32, 64, 128, 256, 512):
        problem = contiguous_problem(m, 4096, 4096, "bf16", "bf16", layout_b="col")
        config = FAMILY.default_config(problem, H200)
        tiles = tile_count(problem, config["BLOCK_M"], config["BLOCK_N"])
        slots = programs(problem, config, H200)
        if m <= STREAM_MAX_M:
            # The weight-streaming kernel: every token in one tile, swapped but for 32-column tiles.
            assert config["BLOCK_M"] >= m and (config["SWAP_AB"] or config["BLOCK_N"] == 32), (m, config)
        assert config["SCHEDULE"] != "stream_k", (m, config)
        # Split over K only as far as the SMs need: one split fewer would leave a fifth of them without work.
        programs_now = tiles * config["SPLIT_K"]
        assert programs_now >= FILL_SMS * H200.sm_count, (m, config)
        if config["SCHEDULE"] == "split_k":
            fewer = SPLIT_K_CHOICES[SPLIT_K_CHOICES.index(config["SPLIT_K"]) - 1]
            assert tiles * fewer < FILL_SMS * H200.sm_count, (m, config)
        assert programs_now <= 2 * slots, (m, config)


@pytest.mark.parametrize("m", [65, 96, 128])
def test_wide_streaming_where_its_programs_fit_one_wave(m):
    # Up to WIDE_STREAM_MAX_M tokens the weight streams through one swapped tile when tiles x splits fit the
    # first wave (o and down projections); qkv's 96 tiles x 2 splits would take 1.45 waves: tiles instead.
    one_wave = contiguous_problem(m, 4096, 14336, "bf16", "bf16", layout_b="col")
    config = FAMILY.default_config(one_wave, H200)
    assert config["SWAP_AB"] and config["BLOCK_M"] == WIDE_STREAM_MAX_M and config["BLOCK_M"] >= m, config
    assert tile_count(one_wave, config["BLOCK_M"], config["BLOCK_N"]) * config["SPLIT_K"] <= programs(one_wave, config, H200)
    two_waves = contiguous_problem(m, 6144, 4096, "bf16", "bf16", layout_b="col")
    tiled = FAMILY.default_config(two_waves, H200)
    assert not tiled["SWAP_AB"], tiled
    assert any(seed["SWAP_AB"] for seed in FAMILY.seed_configs(two_waves, H200))  # the search still tries it
    beyond = contiguous_problem(WIDE_STREAM_MAX_M + 1, 4096, 14336, "bf16", "bf16", layout_b="col")
    assert not FAMILY.default_config(beyond, H200)["SWAP_AB"]


@pytest.mark.parametrize("m,n,k,split", [(100, 3072, 8192, 2), (100, 3072, 3072, 2), (112, 3072, 4096, 2)])
def test_wide_streaming_splits_in_one_wave_where_its_filling_split_takes_more(m, n, k, split):
    # results/mid_n3072_2026-12-06d_h100.json: at 100 tokens on N = 3072, 48 tiles ran whole where three parts would
    # take 1.1 waves; two parts (73% of the SMs) ran 0.846x of cuBLAS at K = 8192 against 0.584x.
    problem = contiguous_problem(m, n, k, "bf16", "bf16", layout_b="col")
    config = FAMILY.default_config(problem, H200)
    assert (config["SWAP_AB"], config["BLOCK_M"], config["SCHEDULE"], config["SPLIT_K"]) == \
        (True, WIDE_STREAM_MAX_M, "split_k", split), config
    tiles = tile_count(problem, config["BLOCK_M"], config["BLOCK_N"])
    assert tiles * split <= programs(problem, config, H200) < tiles * (split + 1)
    assert FAMILY.space(problem, H200).is_feasible(config)


@pytest.mark.parametrize("m", [65, 96, 128])
def test_few_tokens_beyond_one_streaming_wave(m):
    # results/gemm_policy_sweep_2026-12-02_mid.md, M = 96 and 128 where wide streaming takes more than one wave:
    # qkv takes the one-wave TMA tiles from FEW_TOKENS_FILL_SMS of the SMs; gate_up streams unsplit through
    # swapped 128-token tiles, 128 weight rows deep 64 (Llama-3-8B) unless 64 rows deep 128 fill the waves
    # better (Qwen2.5-7B: 296 tiles on 264 slots against 592 on 132).
    def default(n, k):
        return FAMILY.default_config(contiguous_problem(m, n, k, "bf16", "bf16", layout_b="col"), H200)

    for qkv in (default(6144, 4096), default(4608, 3584)):
        assert (qkv["VARIANT"], qkv["SCHEDULE"], qkv["BLOCK_M"], qkv["BLOCK_N"]) == ("tma", "data_parallel", 64, 128)
    llama, qwen = default(28672, 4096), default(37888, 3584)
    for gate_up, width in ((llama, 128), (qwen, 64)):
        assert gate_up["SWAP_AB"] and gate_up["SCHEDULE"] == "data_parallel", gate_up
        assert (gate_up["BLOCK_M"], gate_up["BLOCK_N"], gate_up["num_warps"]) == (WIDE_STREAM_MAX_M, width, 4), gate_up
    # Without TMA or wgmma (an A100) the tiled rules decide, as before.
    a100 = FAMILY.default_config(contiguous_problem(m, 28672, 4096, "bf16", "bf16", layout_b="col"), A100)
    assert not a100["SWAP_AB"], a100


@pytest.mark.parametrize("m,n,k,tile", [(256, 4096, 4096, (64, 128)), (256, 4096, 14336, (64, 128)),
                                        (512, 3584, 18944, (128, 128)), (512, 4096, 4096, (128, 128))])
def test_mid_tiles_on_tma_where_they_fit_one_wave(m, n, k, tile):
    # Measured on the H200 (results/gemm_mid_tiles_2026-12-02.txt): TMA tiles that fill one wave beat the pointer-
    # loaded 64 x 128 tiles and the long-K split; where they would take more than one wave they lost, and do not apply.
    # The Triton variants' rule (at 512 tokens Hopper serves the Gluon variant's tiles: the next test).
    problem = contiguous_problem(m, n, k, "bf16", "bf16", layout_b="col")
    config = tiled_mid_config(problem, H200, gluon=False)
    assert FAMILY.space(problem, H200).is_feasible(config)
    assert (config["VARIANT"], config["SCHEDULE"]) == ("tma", "data_parallel"), config
    assert (config["BLOCK_M"], config["BLOCK_N"]) == tile, config
    tiles = tile_count(problem, *tile)
    assert FILL_SMS * H200.sm_count <= tiles <= programs(problem, config, H200)
    two_waves = contiguous_problem(256, 6144, 4096, "bf16", "bf16", layout_b="col")
    assert tiled_mid_config(two_waves, H200, gluon=False)["VARIANT"] == "blocked"
    # Without TMA (an A100) the rule does not apply.
    assert FAMILY.default_config(problem, A100)["VARIANT"] == "blocked"


@pytest.mark.parametrize("m,n,k,tile", [
    (512, 28672, 4096, (128, 128)), (512, 4096, 14336, (128, 128)), (512, 3584, 3584, (128, 128)),
    (256, 37888, 3584, (128, 192)), (512, 6144, 4096, (128, 192)), (512, 4608, 3584, (128, 144)),
    (256, 6144, 4096, (64, 192)), (256, 4608, 3584, (64, 192)), (256, 4096, 4096, None), (256, 4096, 14336, None),
    (200, 14336, 4096, (128, 256)), (256, 28672, 4096, (128, 256)), (320, 22016, 4096, (128, 256))])
def test_mid_gluon_tiles_of_the_shortest_modelled_makespan_where_they_fill_the_sms(m, n, k, tile):
    # results/gemm_policy_sweep_2026-12-04_mid.md: the best Gluon tile of each shape (or one within 4%); where no
    # tile fills MID_GLUON_FILL of the SMs the tiled rules keep the shape (the Gluon tiles ran 0.73-0.87x of cuBLAS).
    # 128 x 256 tiles where they take fewer waves of the same modelled work
    # (results/mid_wide_tiles_2026-12-06c_h100.json).
    problem = contiguous_problem(m, n, k, "bf16", "bf16", layout_b="col")
    config = FAMILY.default_config(problem, H200)
    assert (config["VARIANT"] == "gluon_ws") == (tile is not None), config
    if tile is not None:
        assert (config["SCHEDULE"], config["BLOCK_M"], config["BLOCK_N"]) == ("data_parallel", *tile), config
        assert tile_count(problem, *tile) >= MID_GLUON_FILL * H200.sm_count
        assert config["EPILOGUE_SUBTILE"] == (tile in ((128, 128), (128, 256)))  # C in halves
    else:
        assert any(s["VARIANT"] == "gluon_ws" for s in FAMILY.seed_configs(problem, H200))  # still searched
    assert FAMILY.default_config(problem, A100)["VARIANT"] != "gluon_ws"


def test_no_warp_specialised_four_warp_tiles_of_128_rows():
    # Triton 3.6 left most of C unwritten with them on the H200 (results/gemm_mid_tiles_2026-12-02.txt).
    problem = contiguous_problem(256, 4096, 4096, "bf16", "bf16", layout_b="col")
    space = FAMILY.space(problem, H200)
    base = dict(VARIANT="tma", SCHEDULE="data_parallel", SPLIT_K=1, PERSISTENT=False, WARP_SPECIALIZE=True,
                FLATTEN=False, SWAP_AB=False, GROUP_M=8, BLOCK_M=128, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=4)
    assert any("warp_specialize_tile" in v for v in space.violations(base))
    assert space.is_feasible(dict(base, num_warps=8))
    assert space.is_feasible(dict(base, BLOCK_M=64, BLOCK_N=128))


def test_one_stage_fewer_where_it_saves_a_wave():
    # 512 x 4608 x 3584: 288 pointer-loaded 64 x 128 tiles take two waves at 4 stages (2 programs an SM) and one at 3
    # (3 an SM); 256 x 6144 x 4096 fits one wave at 4 stages already and keeps them (H200,
    # results/gemm_mid_tiles_2026-12-02b_waves.txt). The tiled rules' (on Hopper the Gluon tiles serve both shapes).
    problem = contiguous_problem(512, 4608, 3584, "bf16", "bf16", layout_b="col")
    saves = tiled_mid_config(problem, H200, gluon=False)
    keeps = tiled_mid_config(contiguous_problem(256, 6144, 4096, "bf16", "bf16", layout_b="col"), H200, gluon=False)
    assert (saves["VARIANT"], saves["BLOCK_M"], saves["BLOCK_N"], saves["num_stages"]) == ("blocked", 64, 128, 3)
    assert (keeps["VARIANT"], keeps["BLOCK_M"], keeps["BLOCK_N"], keeps["num_stages"]) == ("blocked", 64, 128, 4)
    tiles = tile_count(problem, 64, 128)
    assert programs(problem, dict(saves, num_stages=4), H200) < tiles <= programs(problem, saves, H200)


@pytest.mark.parametrize("m,n,k,tile", [
    (192, 4096, 14336, (64, 192)), (176, 3584, 14336, (64, 192)), (192, 4096, 4096, None), (192, 3584, 3584, None),
    (192, 4608, 3584, None), (256, 4096, 4096, None)])
def test_mid_gluon_tiles_on_fewer_sms_after_the_one_wave_tma_tiles(m, n, k, tile):
    # results/mid_candidates_2026-12-06_h100.json (CUDA-graph streams): at 192 tokens 64 x 192 Gluon tiles on 43-50%
    # of the SMs led the split 64 x 128 tiles; where the one-wave TMA tiles fill FILL_SMS of the SMs those still lead
    # (192 x 4608 x 3584: 1.02x of cuBLAS against 0.91x; 256 x 4096 x 4096: 1.03x against 0.91x), and below MID_LONG_K
    # on fewer SMs too (test_narrow_weights_take_one_wave_tma_tiles_on_fewer_sms).
    problem = contiguous_problem(m, n, k, "bf16", "bf16", layout_b="col")
    config = FAMILY.default_config(problem, H200)
    if tile is None:
        assert config["VARIANT"] != "gluon_ws", config
    else:
        # From MID_LONG_K they split over K in two (test_long_k_weights_split_few_tiles_in_two).
        schedule = "split_k" if k >= MID_LONG_K else "data_parallel"
        assert (config["VARIANT"], config["SCHEDULE"], config["BLOCK_M"], config["BLOCK_N"]) == \
            ("gluon_ws", schedule, *tile), config
        assert MID_GLUON_FEW_FILL * H200.sm_count <= tile_count(problem, *tile) < MID_GLUON_FILL * H200.sm_count
    assert FAMILY.default_config(problem, A100)["VARIANT"] != "gluon_ws"


@pytest.mark.parametrize("m,n,k,narrow", [
    (320, 2048, 3584, True), (384, 2048, 3584, True), (320, 2048, 4096, True), (384, 2048, 4096, True),
    (448, 1280, 5120, True), (512, 1280, 5120, True), (448, 2048, 3584, True), (176, 3072, 3072, True),
    (176, 3072, 8192, True), (320, 2048, 14336, True), (208, 2560, 10240, True), (192, 4096, 4096, True),
    (176, 3584, 3584, True), (176, 4096, 4096, True), (160, 3584, 3584, True), (160, 4096, 4096, True),
    (152, 3584, 4096, True), (176, 4096, 14336, False), (256, 1280, 5120, False), (176, 2560, 10240, False)])
def test_narrow_weights_take_one_wave_tma_tiles_on_fewer_sms(m, n, k, narrow):
    # NARROW_ONE_WAVE (results/narrow_one_wave_2026-12-06c_h100.json, mid_n3072_2026-12-06d_h100.json, CUDA-graph
    # streams, H100): where no token tile applies, one wave of 64 x 128 x 128 TMA tiles on 40-80% of the SMs led every
    # Gluon tile (448 x 1280 x 5120: 0.976x of cuBLAS against 0.700x; 176 x 3072 x 8192: 0.837x against 0.625x); above
    # MID_LONG_K too, from 208 tokens (results/longk_candidates_2026-12-07_h100.json). Wider weights below MID_LONG_K
    # the same (176 x 4096 x 4096: 0.885x against 0.771x, results/clamp_ab_cols_2026-12-07_h100.json), in place of
    # swapped few-fill tiles too (160 x 4096 x 4096: 0.867x against 0.760x for swapped 80 x 128,
    # results/wide_one_wave_all_2026-12-07_h100.json); from it they,
    # token tiles (256 x 1280) and Gluon tiles split over a long K in one wave (176 x 2560 x 10240) keep their rules.
    problem = contiguous_problem(m, n, k, "bf16", "bf16", layout_b="col")
    config = FAMILY.default_config(problem, H200)
    tma_tile = (config["VARIANT"], config["SCHEDULE"], config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]) == \
        ("tma", "data_parallel", 64, 128, 128)
    assert tma_tile == narrow, config
    if not narrow:
        return
    assert token_tile_config(problem, H200) is None
    assert MID_GLUON_FEW_FILL * H200.sm_count <= tile_count(problem, 64, 128) <= programs(problem, config, H200)
    assert FAMILY.space(problem, H200).is_feasible(config)
    # B row-major keeps the rules before (unmeasured); a search starts from the Gluon tiles and the other TMA tile too.
    if tile_count(problem, 64, 128) < FILL_SMS * H200.sm_count:
        assert FAMILY.default_config(dataclasses.replace(problem, layout_b="row"), H200)["BLOCK_K"] != 128
    seeds = {(c["VARIANT"], c["BLOCK_M"], c["BLOCK_N"]) for c in (config, *FAMILY.seed_configs(problem, H200))}
    assert {("gluon_ws", 64, 192), ("gluon_ws", 64, 128), ("tma", 64, 128), ("tma", 128, 128)} <= seeds


@pytest.mark.parametrize("m,n,k,split", [
    (144, 2560, 10240, 2), (192, 2304, 9216, 2), (144, 1536, 8960, 3), (176, 2048, 11008, 2), (208, 2048, 11008, 2),
    (208, 2560, 10240, None), (176, 1024, 8192, None), (176, 2560, 4096, None)])
def test_narrow_long_k_weights_split_gluon_tiles_ahead_of_token_tiles(m, n, k, split):
    # NARROW_LONG_K_MIN_N (results/longk_candidates_2026-12-07_h100.json, CUDA-graph streams, H100): from MID_LONG_K,
    # N of 1536-3072, the 64 x 128 Gluon tiles split over K where two parts or more take one wave (144 x 2560 x 10240:
    # 0.84x of cuBLAS, against 0.54x for the 128 x 128 split tiles before); past that, the one-wave TMA tiles (208 x
    # 2560); below 1536 columns the token tiles' long-K rule, and below MID_LONG_K the rules before.
    problem = contiguous_problem(m, n, k, "bf16", "bf16", layout_b="col")
    config = FAMILY.default_config(problem, H200)
    tiles = (config["VARIANT"], config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"])
    split_tiles = tiles == ("gluon_ws", 64, 128, 64)
    assert split_tiles == (split is not None), config
    if split is not None:
        assert (config["SCHEDULE"], config["SPLIT_K"]) == ("split_k", split), config
        assert tile_count(problem, 64, 128) * split <= H200.sm_count
        assert FAMILY.space(problem, H200).is_feasible(config)
    assert FAMILY.default_config(problem, A100)["VARIANT"] != "gluon_ws"


@pytest.mark.parametrize("m,n,k,tile", [
    (144, 3584, 18944, (80, 128, True)), (160, 4096, 11008, (80, 128, True)), (176, 3584, 18944, (64, 192, False)),
    (192, 3584, 14336, (64, 192, False))])
def test_long_k_weights_split_few_tiles_in_two(m, n, k, tile):
    # _long_k_halves (same table): from MID_LONG_K, the few-fill Gluon tiles split over K in two where that takes one
    # wave (144 x 3584 x 18944, swapped 80 x 128: 0.77x of cuBLAS whole -> 0.96x; 176 x 3584 x 18944, 64 x 192: 0.80x
    # -> 0.96x). Two-part tiles both (gemm_space.GLUON_TWO_PART_SPLIT). Below MID_LONG_K both give way to the
    # one-wave TMA tiles (_wide_one_wave).
    problem = contiguous_problem(m, n, k, "bf16", "bf16", layout_b="col")
    config = FAMILY.default_config(problem, H200)
    assert (config["VARIANT"], config["BLOCK_M"], config["BLOCK_N"], config["SWAP_AB"]) == ("gluon_ws", *tile), config
    assert (config["SCHEDULE"], config["SPLIT_K"]) == ("split_k", 2), config
    assert 2 * tile_count(problem, *tile[:2]) <= H200.sm_count
    assert FAMILY.space(problem, H200).is_feasible(config)
    shorter = FAMILY.default_config(dataclasses.replace(problem, k=MID_LONG_K // 2), H200)
    assert (shorter["VARIANT"], shorter["BLOCK_M"], shorter["BLOCK_N"], shorter["SWAP_AB"], shorter["SCHEDULE"]) == \
        ("tma", 64, 128, False, "data_parallel"), shorter


@pytest.mark.parametrize("m,n,k,split", [
    (192, 1024, 4096, 3), (256, 1024, 4096, 3), (384, 1024, 4096, 2), (512, 1024, 4096, 2), (192, 2048, 4096, 2),
    (256, 2048, 4096, 2), (192, 512, 3584, 3), (448, 512, 3584, 3), (384, 1024, 5120, 2), (160, 1024, 3072, 3),
    (224, 1024, 3072, 1), (448, 1024, 3072, 1), (224, 2048, 3584, 1)])
def test_narrow_mid_weights_take_gluon_tiles_split_over_k_in_one_wave(m, n, k, split):
    # results/mid_narrow_2026-12-06_h100.json and _b_h100.json (CUDA-graph streams): the best split of 64 x 128 Gluon
    # tiles on each shape, 0.64-0.95x of cuBLAS against 0.45-0.84x for the tiled rules' split 64 x 128 tiles; whole
    # tiles from NARROW_WHOLE_MIN_TILES up to NARROW_WHOLE_MAX_K. In nn.Linear layout token tiles come first
    # (test_narrow_weights_take_swapped_token_tiles); B row-major keeps these.
    problem = contiguous_problem(m, n, k, "bf16", "bf16", layout_b="row")
    config = FAMILY.default_config(problem, H200)
    schedule = "split_k" if split > 1 else "data_parallel"
    assert (config["VARIANT"], config["SCHEDULE"], config["BLOCK_M"], config["BLOCK_N"], config["SPLIT_K"]) == \
        ("gluon_ws", schedule, 64, 128, split), config
    assert tile_count(problem, 64, 128) * max(split, 2) <= H200.sm_count
    assert FAMILY.space(problem, H200).is_feasible(config)
    # Short K keeps the tiled rules (unmeasured there), as does a GPU without the Gluon variant.
    short = contiguous_problem(m, n, NARROW_MIN_K - 512, "bf16", "bf16", layout_b="row")
    assert FAMILY.default_config(short, H200)["VARIANT"] != "gluon_ws"
    assert FAMILY.default_config(problem, A100)["VARIANT"] != "gluon_ws"


@pytest.mark.parametrize("m,n,k,block_m", [
    (160, 512, 3584, 16), (192, 512, 3584, 16), (256, 512, 3584, 16), (384, 512, 3584, 32), (512, 512, 3584, 32),
    (640, 512, 3584, 64), (160, 1024, 4096, 32), (384, 1024, 3072, 64), (512, 1024, 4096, 64), (160, 2048, 3584, 64),
    (256, 2048, 3584, 64), (256, 1280, 4096, 64),
    (512, 2048, 3584, None), (384, 2048, 3584, None), (192, 4096, 4096, None), (1024, 512, 3584, None),
    (64, 1024, 4096, None), (192, 1024, NARROW_MIN_K - 512, None)])
def test_narrow_weights_take_swapped_token_tiles(m, n, k, block_m):
    # results/token_tiles_narrow_{,b_}2026-12-06_h100.json (CUDA-graph streams, H100): 64 weight rows by 16-64 tokens,
    # as cuBLAS tiles k and v projections; 0.73-1.07x of cuBLAS against 0.61-0.79x for the Gluon tiles before.
    # The fewest tokens a tile that take one wave with each weight row read at most TOKEN_TILE_ROW_READS / N times.
    # From LONG_K_GLUON_SPLIT_MIN_K the policy serves Gluon split tiles in their place
    # (test_long_k_narrow_weights_past_one_wave_of_split_token_tiles_take_gluon_tiles_split_over_k).
    problem = contiguous_problem(m, n, k, "bf16", "bf16", layout_b="col")
    config = FAMILY.default_config(problem, H200)
    assert (token_tile_config(problem, H200) is not None) == (block_m is not None)
    if block_m is None:
        assert not (config["SWAP_AB"] and config["BLOCK_M"] < m), config
        return
    if k >= LONG_K_GLUON_SPLIT_MIN_K:
        assert config["VARIANT"] == "gluon_ws", config
        config = FAMILY.validate_config(problem, H200, Config(token_tile_config(problem, H200)))
    assert (config["VARIANT"], config["SCHEDULE"], config["SWAP_AB"], config["BLOCK_M"], config["BLOCK_N"]) == \
        ("blocked", "data_parallel", True, block_m, 64), config
    reads = -(-m // block_m)
    assert reads * n <= TOKEN_TILE_ROW_READS and tile_count(problem, block_m, 64) <= programs(problem, config, H200)
    assert FAMILY.space(problem, H200).is_feasible(config)
    # Off Hopper, and for B row-major, the rules before decide (unmeasured for token tiles).
    assert not FAMILY.default_config(problem, A100)["SWAP_AB"]
    assert token_tile_config(dataclasses.replace(problem, layout_b="row"), H200) is None


@pytest.mark.parametrize("m,n,k,split", [
    (176, 1024, 5120, 2), (224, 1024, 8192, 2), (160, 1280, 5120, 2), (256, 1024, 5120, 2),
    # K under LONG_K_GLUON_SPLIT_MIN_K: whole tiles (past one wave of split tiles, and from that K,
    # test_long_k_..._take_gluon_tiles_split_over_k).
    (176, 1024, LONG_K_GLUON_SPLIT_MIN_K - 512, 1)])
def test_long_k_narrow_weights_split_64_token_tiles_in_two_where_they_take_one_wave(m, n, k, split):
    # TOKEN_TILE_LONG_K (results/token_tiles_longk_2026-12-06d_h100.json): above 128 tokens, from K = 5120, 64-token
    # tiles split in two led the whole 32-token tiles (seven rows 0.838x -> 0.944x of cuBLAS).
    problem = contiguous_problem(m, n, k, "bf16", "bf16", layout_b="col")
    config = FAMILY.default_config(problem, H200)
    assert config["SWAP_AB"] and config["BLOCK_N"] == 64, config
    assert config["SPLIT_K"] == split and (config["BLOCK_M"] == 64 if split > 1 else True), config
    if split > 1:
        assert config["SCHEDULE"] == "split_k" and 2 * tile_count(problem, 64, 64) <= programs(problem, config, H200)
    assert FAMILY.space(problem, H200).is_feasible(config)


@pytest.mark.parametrize("m,n,k,split", [
    (256, 1280, 5120, 3), (448, 1024, 8192, 2), (480, 1024, 5120, 2), (512, 1024, 5120, 2), (225, 2048, 6144, 2),
    (257, 1024, 4096, 3), (377, 1024, 4096, 2), (241, 2048, 4608, 2), (161, 896, 4864, 3)])
def test_long_k_narrow_weights_past_one_wave_of_split_token_tiles_take_gluon_tiles_split_over_k(m, n, k, split):
    # _long_k_gluon_split (results/long_k_gluon_split_ab_2026-12-07f_h100.json and _oos_: 28 rows at 129-505 tokens,
    # N 1024-2048, K 5120-16384, 0.823x / 0.789x of cuBLAS with whole 64-token tiles -> 1.019x / 0.986x, each ahead;
    # gluon_split_k4096_ab_*2026-12-07f_h100.json: 18 rows at K 4096-4864, 0.922x / 0.912x -> 1.005x / 0.979x).
    problem = contiguous_problem(m, n, k, "bf16", "bf16", layout_b="col")
    config = FAMILY.default_config(problem, H200)
    assert (config["VARIANT"], config["SCHEDULE"], config["BLOCK_M"], config["BLOCK_N"], config["SPLIT_K"],
            config["SWAP_AB"]) == ("gluon_ws", "split_k", 64, 128, split, False), config
    token = token_tile_config(problem, H200)
    assert token is not None and token["SCHEDULE"] == "data_parallel", "only where whole token tiles were the rule"
    assert tile_count(problem, 64, 128) * split <= H200.sm_count
    assert FAMILY.space(problem, H200).is_feasible(config)
    # Under LONG_K_GLUON_SPLIT_MIN_K the whole token tiles stay; so do the rules before for B row-major and off Hopper.
    shorter = contiguous_problem(m, n, LONG_K_GLUON_SPLIT_MIN_K - 512, "bf16", "bf16", layout_b="col")
    assert FAMILY.default_config(shorter, H200)["SWAP_AB"]
    assert FAMILY.default_config(problem, A100)["VARIANT"] != "gluon_ws"


@pytest.mark.parametrize("m,n,k,block_m,split", [
    (96, 512, 4096, 16, 1), (128, 512, 4096, 16, 1), (96, 1024, 5120, 32, 2), (128, 1024, 5120, 32, 2),
    (96, 1024, 8192, 32, 2), (128, 2048, 4608, 64, 2), (96, 2048, 4608, 64, 2), (64, 1024, 4096, None, None),
    (128, 4096, 4096, None, None)])
def test_few_tokens_on_narrow_weights_take_token_tiles_split_where_they_fill_half_the_sms(m, n, k, block_m, split):
    # TOKEN_TILE_FEW_ROW_READS (results/token_tiles_oos_2026-12-06c_h100.json): at 96-128 tokens the best token tile
    # read each weight row at most 4096 / N times, split in two where it filled at most half the SMs (not 16-token
    # tiles): 0.76-1.05x of cuBLAS against 0.55-0.90x for the streaming rules.
    problem = contiguous_problem(m, n, k, "bf16", "bf16", layout_b="col")
    config = FAMILY.default_config(problem, H200)
    if block_m is None:
        assert not (config["SWAP_AB"] and config["BLOCK_M"] < m), config
        return
    assert (config["SWAP_AB"], config["BLOCK_M"], config["BLOCK_N"], config["SPLIT_K"]) == (True, block_m, 64, split), \
        config
    tiles = tile_count(problem, block_m, 64)
    assert -(-m // block_m) * n <= TOKEN_TILE_FEW_ROW_READS and tiles * split <= programs(problem, config, H200)
    assert FAMILY.space(problem, H200).is_feasible(config)
    # The streaming rule it replaced is a seed.
    seeds = FAMILY.seed_configs(problem, H200)
    assert any(c["SWAP_AB"] and c["BLOCK_M"] >= m for c in seeds)


def test_token_tile_seeds_try_the_other_sizes_and_the_rules_before():
    problem = contiguous_problem(256, 1024, 4096, "bf16", "bf16", layout_b="col")
    seeds = FAMILY.seed_configs(problem, H200)
    token = {(c["BLOCK_M"], c["SCHEDULE"]) for c in seeds if c["SWAP_AB"] and c["BLOCK_N"] == 64}
    assert {(16, "data_parallel"), (64, "data_parallel"), (32, "split_k"), (64, "split_k")} <= token
    # The Triton tiles of the rules without token tiles, and the Gluon variant's seeds, are still among them.
    before = FAMILY.validate_config(problem, H200, Config(tiled_mid_config(problem, H200, gluon=False,
                                                                           token_tiles=False)))
    assert before in seeds and not before["SWAP_AB"]
    assert any(c["VARIANT"] == "gluon_ws" for c in seeds)


def test_token_tiles_enter_the_space_for_narrow_weights_only():
    tile = dict(FAMILY.default_config(contiguous_problem(192, 512, 3584, "bf16", "bf16", layout_b="col"), H200))
    assert tile["SWAP_AB"] and tile["BLOCK_M"] == 16
    for n, m, feasible in ((512, 192, True), (2048, 640, True), (4096, 192, False), (512, 1024, False)):
        problem = contiguous_problem(m, n, 3584, "bf16", "bf16", layout_b="col")
        assert FAMILY.space(problem, H200).is_feasible(Config(tile)) == feasible, (m, n)


@pytest.mark.parametrize("m,n,k,narrow", [
    (768, 1024, 4096, True), (1024, 1024, 4096, True), (768, 512, 3584, True), (1536, 512, 3584, True),
    (1024, 1024, 5120, True), (1536, 1024, 4096, False), (768, 2048, 3584, False), (2048, 4096, 4096, False)])
def test_narrow_prefill_takes_one_wave_of_64_row_tiles(m, n, k, narrow):
    # results/prefill_narrow_2026-12-06_h100.json: where 64 x 128 tiles take one wave they ran 0.65-1.09x of cuBLAS
    # against 0.42-0.78x for the 128-row tiles; where they take two (1536 x 1024) the 128-row tiles led. In nn.Linear
    # layout they load on TMA 128 deep (_prefill_narrow_tma: 40 rows 0.957x -> 0.973x / 0.986x,
    # results/prefill_narrow_tma_ab_*2026-12-07f_h100.json); B row-major keeps the Gluon variant's.
    for layout_b, variant, block_k in (("col", "tma", 128), ("row", "gluon_ws", 64)):
        problem = contiguous_problem(m, n, k, "bf16", "bf16", layout_b=layout_b)
        config = FAMILY.default_config(problem, H200)
        one_wave = (config["VARIANT"], config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"], config["SCHEDULE"])
        assert (one_wave == (variant, 64, 128, block_k, "data_parallel")) == narrow, config
        assert narrow or config["VARIANT"] == "gluon_ws", config
        assert (tile_count(problem, 64, 128) <= programs(problem, config, H200)) == narrow
        assert FAMILY.space(problem, H200).is_feasible(config)
    assert FAMILY.default_config(problem, A100)["VARIANT"] != "gluon_ws"


@pytest.mark.parametrize("m,n,k,wide", [
    (1024, 1280, 5120, True), (1032, 1024, 4096, True), (648, 2048, 3584, True), (768, 2048, 3584, True),
    (2496, 512, 2048, True), (1416, 896, 4864, True), (704, 2304, 9216, True), (552, 2560, 4096, False),
    (1024, 1024, 4096, False), (1024, 4096, 4096, False), (4096, 1024, 4096, False)])
def test_narrow_prefill_takes_one_wave_of_64_x_192_gluon_tiles(m, n, k, wide):
    # PREFILL_NARROW_WIDE (H100, CUDA-graph streams, results/prefill_narrow_wide_ab_2026-12-07c_h100.json and _oos_):
    # where 64 x 128 tiles take more than one wave and 64 x 192 ones fill most SMs in one, these led the 128-row tiles
    # on 154 of 155 rows up to N = 2304, 0.840x -> 1.004x of cuBLAS (1024 x 1280 x 5120: 0.767x -> 0.942x); at N = 2560
    # they lost.
    problem = contiguous_problem(m, n, k, "bf16", "bf16", layout_b="col")
    config = FAMILY.default_config(problem, H200)
    assert ((config["VARIANT"], config["BLOCK_M"], config["BLOCK_N"], config["SCHEDULE"]) ==
            ("gluon_ws", 64, 192, "data_parallel")) == wide, config
    if wide:
        assert tile_count(problem, 64, 128) > H200.sm_count
        assert MID_GLUON_FILL * H200.sm_count <= tile_count(problem, 64, 192) <= H200.sm_count
        assert FAMILY.space(problem, H200).is_feasible(config)
    assert FAMILY.default_config(problem, A100)["VARIANT"] != "gluon_ws"


@pytest.mark.parametrize("m,n,k,tile", [
    (288, 5120, 4096, (96, 128)), (264, 5120, 4096, (96, 128)), (288, 28672, 4096, (144, 128)),
    (300, 28672, 4096, (160, 128)), (400, 37888, 3584, (144, 128)), (300, 16384, 3072, (160, 128)),
    (300, 4096, 14336, (80, 128))])
def test_mid_swapped_gluon_tiles_where_their_token_side_cuts_m_better(m, n, k, tile):
    # H100, CUDA-graph streams, results/gluon_swap*_2026-12-07_h100.json: each the best tile timed, from 0.46-0.91x of
    # cuBLAS (the unswapped Gluon default, its last row tile part-empty) to 0.83-1.05x.
    problem = contiguous_problem(m, n, k, "bf16", "bf16", layout_b="col")
    config = FAMILY.default_config(problem, H200)
    assert config["VARIANT"] == "gluon_ws" and config["SWAP_AB"], config
    assert (config["SCHEDULE"], config["BLOCK_M"], config["BLOCK_N"]) == ("data_parallel", *tile), config
    assert math.ceil(m / tile[0]) * tile[0] <= (1 + MID_SWAPPED_MAX_EMPTY) * m
    assert FAMILY.space(problem, H200).admit(config) == config
    # B row-major: no swapped tiles (the kernel's A is W's rows, K-major).
    assert not FAMILY.default_config(contiguous_problem(m, n, k, "bf16", "bf16"), H200)["SWAP_AB"]


@pytest.mark.parametrize("m,n,k", [(320, 22016, 4096), (512, 28672, 4096), (176, 6144, 4096)])
def test_mid_swapped_gluon_tiles_leave_shapes_the_unswapped_tiles_fit(m, n, k):
    # 128 x 256 at 320 x 22016 x 4096 ran 0.99x of cuBLAS (results/mid_wide_tiles_2026-12-06c_h100.json); 512 tokens
    # are four whole 128-row tiles; 64 x 192 at 176 x 6144 x 4096 ran 1.09x (results/gluon_swap_grid_2026-12-07_h100.json).
    config = FAMILY.default_config(contiguous_problem(m, n, k, "bf16", "bf16", layout_b="col"), H200)
    assert config["VARIANT"] == "gluon_ws" and not config["SWAP_AB"], config


@pytest.mark.parametrize("m,n,k,split", [(3000, 3584, 18944, 3), (2048, 3584, 18944, 4), (2048, 4096, 14336, 1),
                                         (4096, 4096, 4096, 1), (1377, 28672, 3584, 1)])
def test_long_k_prefill_tails_split_where_the_model_saves_a_share_of_the_makespan(monkeypatch, m, n, k, split):
    # PREFILL_TAIL_SPLIT (off until timed): 3000 x 3584 x 18944, two whole waves of 128 x 256 tiles and 72 left, splits
    # them three ways (two ways saves no round); 2048 x 4096 x 14336's tail is nearly a wave; K = 4096 and 3584 are
    # short of PREFILL_TAIL_SPLIT_MIN_K (1377 x 28672 x 3584 would split three ways): whole tiles.
    from autotile.families import gemm_policy

    problem = contiguous_problem(m, n, k, "bf16", "bf16", layout_b="col")
    whole = FAMILY.default_config(problem, H200)
    assert whole["SCHEDULE"] == "data_parallel"
    monkeypatch.setattr(gemm_policy, "PREFILL_TAIL_SPLIT_GAIN", 0.03)
    config = FAMILY.default_config(problem, H200)
    assert dict(config, SCHEDULE="data_parallel", SPLIT_K=1) == dict(whole), config
    assert (config["SCHEDULE"], config["SPLIT_K"]) == (("split_k", split) if split > 1 else ("data_parallel", 1))
    assert FAMILY.space(problem, H200).is_feasible(config)
    if split > 1:
        modelled = {s: gemm_policy._tail_split_makespan(problem, whole, H200, s) for s in (1, 2, split)}
        assert modelled[split] < 0.97 * modelled[1] and modelled[2] >= modelled[split]
