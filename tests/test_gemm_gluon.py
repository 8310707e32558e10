"""The GEMM family's Gluon variant (templates/gemm_gluon_ws.py.j2) on the CPU: where the space offers it, what the
policy serves with it, its stream-K partition, and its kernels compiled for sm90 with Triton's own ptxas.

Gluon kernels do not run under Triton's interpreter; tests/test_gemm_gpu.py runs them against float64.
"""
from __future__ import annotations

import json
import random
import sys

import pytest

from autotile.device import interpret_device, planned_device
from autotile.families import gemm_space
from autotile.families.gemm import FAMILY, contiguous_problem
from autotile.families.gemm_policy import gluon_config, gluon_swapped_config
from autotile.families.gemm_space import (GLUON_SWAP_TOKEN_TILES, GLUON_TWO_PART, GLUON_WIDE_NS, accumulator_registers,
                                          programs_per_sm)
from autotile.render import render_source

H200 = planned_device("h200")
FP8_PRECISE = contiguous_problem(4096, 4096, 4096, "fp8", "bf16", layout_b="col")


def gluon_configs(problem, device):
    return [c for c in FAMILY.space(problem, device).feasible() if c["VARIANT"] == "gluon_ws"]


def test_the_space_offers_gluon_ws_on_hopper_only():
    assert gluon_configs(FP8_PRECISE, H200)
    assert not gluon_configs(FP8_PRECISE, interpret_device())  # Gluon does not run under the interpreter
    assert not gluon_configs(contiguous_problem(4096, 4096, 4096, "bf16", "bf16", layout_b="col"), planned_device("a100"))


@pytest.mark.parametrize("problem", [
    contiguous_problem(4096, 4096, 4096, "fp8", "bf16", layout_b="row"),  # fp8 wgmma reads B K-major only
    contiguous_problem(4096, 4096, 4096, "bf16", "bf16", layout_a="col"),
    contiguous_problem(4096, 4096, 4096, "fp8", "bf16", layout_b="col", scale_mode="block"),
    contiguous_problem(1000, 1000, 1003, "bf16", "bf16"),  # rows of 1003 elements: no TMA
], ids=["fp8-b-row", "a-col", "block-scales", "unaligned"])
def test_gluon_ws_is_infeasible_where_it_does_not_apply(problem):
    assert not gluon_configs(problem, H200)


def test_gluon_ws_configs_keep_its_structure():
    for config in gluon_configs(FP8_PRECISE, H200):
        assert config["SCHEDULE"] in ("stream_k", "data_parallel", "split_k", "pingpong") and config["num_warps"] == 4
        assert not config["SWAP_AB"]
        assert config["BLOCK_M"] in (64, 128) and config["PROMOTE_TILES"] == 1
        assert config["BLOCK_N"] <= 128  # precise: its fp32 sum and a K tile's accumulator fit a consumer


def test_fp8_prefill_defaults_to_gluon_ws_with_the_tma_variant_among_the_seeds():
    default = FAMILY.default_config(FP8_PRECISE, H200)
    assert (default["VARIANT"], default["BLOCK_M"], default["BLOCK_N"], default["BLOCK_K"]) == ("gluon_ws", 128, 128, 128)
    assert any(c["VARIANT"] == "tma" for c in FAMILY.seed_configs(FP8_PRECISE, H200))
    fast = contiguous_problem(4096, 4096, 4096, "fp8", "bf16", layout_b="col", fp8_fast_accum=True)
    default = FAMILY.default_config(fast, H200)
    assert (default["VARIANT"], default["BLOCK_N"], default["SCHEDULE"]) == ("gluon_ws", 256, "data_parallel")
    assert any(c["VARIANT"] == "tma" for c in FAMILY.seed_configs(fast, H200))


def _launch_geometry(schedule: str = "stream_k", SWAP_AB: bool = False):
    """The rendering's host-side launch_geometry, plain Python, taken from its source.

    NOTE: importing the rendered module would import Gluon, whose decorators fail in a process where Triton runs
    its interpreter (TRITON_INTERPRET=1, as in this test process).
    """
    switches = dict(VARIANT="gluon_ws", SCHEDULE=schedule, SWAP_AB=SWAP_AB, EPILOGUE_SUBTILE=False, HAS_BIAS=False,
                    HAS_RESIDUAL=False, ACTIVATION="none", SCALES="none", FP8_PROMOTE=False, A_COL=False, B_COL=True,
                    EVEN_N=False, EVEN_K=False, STREAM_B=False, INPUT_PRECISION="", INDEX_64=False, UPCAST_DOTS=False,
                    WIDE_N=False, CLAMP_ROWS=True, CLAMP_COLS=True, COALESCED_PARTIALS=False,
                    OWNED_SPLITS=False)
    source = render_source(FAMILY.template, **switches)
    host = source[source.index("def launch_geometry"):source.index("def kernel_args")]
    namespace: dict = {}
    exec(host, namespace)  # noqa: S102 - the template's own host code
    return namespace["launch_geometry"]


def test_stream_k_shares_cover_every_k_iteration_once_and_name_their_contributors():
    """The kernel's partition, written out: whole tiles round-robin, then each program's even share of the rest;
    a split tile's contributors are the programs the kernel's q_first..q_last formula names, in order."""
    geometry = _launch_geometry()
    rng = random.Random(0)
    for _ in range(3000):
        m, n, k = rng.randint(1, 3000), rng.randint(1, 3000), rng.randint(1, 3000)
        bm, bn, bk = rng.choice((64, 128)), rng.choice((64, 128, 256)), rng.choice((64, 128))
        programs = rng.randint(1, 140)
        (grid,), _, _, (dp_tiles, sk_iters, sk_programs) = geometry(m, n, k, bm, bn, bk, 1, False, programs)
        tiles, k_tiles = -(-m // bm) * -(-n // bn), -(-k // bk)
        assert grid <= programs and dp_tiles % programs == 0 or dp_tiles == tiles
        covered = [0] * (tiles * k_tiles)
        owners: dict[int, list] = {}
        for q in range(grid):
            for tile in range(q, dp_tiles, grid):
                for it in range(tile * k_tiles, (tile + 1) * k_tiles):
                    covered[it] += 1
            pid = min(q, sk_programs)
            lo = dp_tiles * k_tiles + pid * sk_iters // sk_programs
            hi = dp_tiles * k_tiles + min(pid + 1, sk_programs) * sk_iters // sk_programs
            it = lo
            while it < hi:
                tile = it // k_tiles
                seg_end = min(hi, (tile + 1) * k_tiles)
                for i in range(it, seg_end):
                    covered[i] += 1
                if not (it == tile * k_tiles and seg_end == (tile + 1) * k_tiles):
                    owners.setdefault(tile, []).append((q, it != lo))
                it = seg_end
        assert set(covered) == {1}, (m, n, k, bm, bn, bk, programs)
        for tile, contributors in owners.items():
            first = tile * k_tiles - dp_tiles * k_tiles
            q_first = ((first + 1) * sk_programs - 1) // sk_iters
            q_last = ((first + k_tiles) * sk_programs - 1) // sk_iters
            assert [q for q, _ in contributors] == list(range(q_first, q_last + 1))
            assert all((q * sk_iters // sk_programs < first) == second for q, second in contributors)


@pytest.mark.parametrize("width", GLUON_WIDE_NS)
def test_two_part_tile_widths_are_the_gluon_variants_for_16_bit_whole_tiles(width, monkeypatch):
    problem = contiguous_problem(512, 4608, 3584, "bf16", "bf16", layout_b="col")
    space = FAMILY.space(problem, H200)
    monkeypatch.setattr(gemm_space, "GLUON_TWO_PART_SPLIT", False)
    wide = [c for c in space.feasible() if c["BLOCK_N"] == width]
    assert wide and all(c["VARIANT"] == "gluon_ws" and c["SCHEDULE"] == "data_parallel"
                        and not c["EPILOGUE_SUBTILE"] for c in wide)
    assert {c["BLOCK_M"] for c in wide} == {64, 128}
    assert not [c for c in FAMILY.space(FP8_PRECISE, H200).feasible() if c["BLOCK_N"] == width]
    assert not [c for c in FAMILY.space(problem, interpret_device()).feasible() if c["BLOCK_N"] == width]
    assert FAMILY.render_switches(problem, wide[0])["WIDE_N"]
    assert not FAMILY.render_switches(problem, space.admit(dict(wide[0], BLOCK_N=128)))["WIDE_N"]
    # Split over K too with GLUON_TWO_PART_SPLIT on (the default since its GPU checks passed).
    monkeypatch.setattr(gemm_space, "GLUON_TWO_PART_SPLIT", True)
    assert {c["SCHEDULE"] for c in space.feasible() if c["BLOCK_N"] == width} == {"data_parallel", "split_k"}


def test_swapped_gluon_tiles_put_tokens_on_the_wgmma_n_side_up_to_1024_tokens():
    """SWAP_AB gluon_ws: BLOCK_M tokens (any of GLUON_SWAP_TOKEN_TILES) over 64 or 128 weight rows (BLOCK_N), B as W
    (N, K); the two-part token tiles whole or split over K (GLUON_TWO_PART_SPLIT), never stream-K; the tile's consumer
    warpgroups are its weight rows'."""
    problem = contiguous_problem(300, 5120, 4096, "bf16", "bf16", layout_b="col")
    swapped = [c for c in gluon_configs(problem, H200) if c["SWAP_AB"]]
    assert {c["BLOCK_M"] for c in swapped} == set(GLUON_SWAP_TOKEN_TILES)
    assert {c["BLOCK_N"] for c in swapped} == {64, 128}
    assert {c["SCHEDULE"] for c in swapped} == {"data_parallel", "split_k", "stream_k"}  # C^T whole: no pingpong
    assert not any(c["EPILOGUE_SUBTILE"] for c in swapped)
    assert {c["SCHEDULE"] for c in swapped if c["BLOCK_M"] in GLUON_TWO_PART} == {"data_parallel", "split_k"}
    wide = next(c for c in swapped if c["BLOCK_M"] == 96 and c["BLOCK_N"] == 64)
    switches = FAMILY.render_switches(problem, wide)
    assert switches["WIDE_N"] and switches["B_COL"] and switches["SWAP_AB"]
    assert accumulator_registers(problem, wide) == 64 * 96 // 128
    assert programs_per_sm(problem, dict(wide, num_stages=2), H200) >= 1
    assert not [c for c in gluon_configs(contiguous_problem(1025, 5120, 4096, "bf16", "bf16", layout_b="col"), H200)
                if c["SWAP_AB"]]
    assert not [c for c in gluon_configs(contiguous_problem(300, 5120, 4096, "bf16", "bf16", layout_b="row"), H200)
                if c["SWAP_AB"]]


def test_swapped_launch_geometry_tiles_c_transposed():
    """The swapped kernel's tiles are C^T's: BLOCK_N weight rows by BLOCK_M tokens, a counter per 64 weight rows."""
    geometry = _launch_geometry("split_k", SWAP_AB=True)
    plain = _launch_geometry("split_k")
    for m, n, k, bm, bn in ((300, 1000, 3584, 32, 64), (77, 4104, 2056, 16, 128), (1000, 1032, 1000, 64, 128)):
        swapped = geometry(m, n, k, bm, bn, 64, 3, False, 132)
        assert swapped == plain(n, m, k, bn, bm, 64, 3, False, 132)
        (_, _, counters, (dp_tiles, _, units)) = swapped
        assert units == 0 or counters == (-(-m // bm) * -(-n // bn) - dp_tiles) * (bn // 64)


def test_split_tail_covers_every_k_iteration_once_at_shared_offsets():
    """split_k: whole waves of whole tiles, then each tile left over in SPLIT_K parts (fewer where K is short) at the
    same K offsets for every such tile; every unit writes its own workspace slot and every tail tile has a counter."""
    geometry = _launch_geometry("split_k")
    rng = random.Random(1)
    for _ in range(3000):
        m, n, k = rng.randint(1, 5000), rng.randint(1, 5000), rng.randint(1, 5000)
        bm, bn, bk = rng.choice((64, 128)), rng.choice((64, 128, 256)), rng.choice((64, 128))
        split, programs = rng.choice((2, 3, 4, 6, 8, 12, 16)), rng.randint(1, 140)
        (grid,), ws, counters, (dp_tiles, splits, units) = geometry(m, n, k, bm, bn, bk, split, False, programs)
        tiles, k_tiles = -(-m // bm) * -(-n // bn), -(-k // bk)
        assert 1 <= grid <= programs and dp_tiles % programs == 0 or dp_tiles == tiles
        covered = [0] * (tiles * k_tiles)
        for q in range(grid):
            for tile in range(q, dp_tiles, grid):
                for kt in range(k_tiles):
                    covered[tile * k_tiles + kt] += 1
            for u in range(q, units, grid):  # the kernel's tail loop
                r, j = u % (tiles - dp_tiles), u // (tiles - dp_tiles)
                k_lo, k_hi = j * k_tiles // splits, (j + 1) * k_tiles // splits
                assert k_hi > k_lo, "every split holds a K tile"
                for kt in range(k_lo, k_hi):
                    covered[(dp_tiles + r) * k_tiles + kt] += 1
        assert set(covered) == {1}, (m, n, k, bm, bn, bk, split, programs)
        if units:
            assert splits == min(split, k_tiles) > 1 and units == (tiles - dp_tiles) * splits
            assert ws >= units * bm * bn and counters == (tiles - dp_tiles) * (bm // 64)


def test_whole_gluon_tiles_clamp_their_last_row_and_column_tiles(monkeypatch):
    """CLAMP_ROWS and CLAMP_COLS (the last row tile ends at row M, the last column tile at column N) for the Gluon
    variant's whole tiles only: a split tile's sums run in another order than the whole tile before it, which the
    clamped tile overlaps. Swapped tiles clamp their columns (the tokens) only. Off with gemm_space's switches."""
    problem = contiguous_problem(392, 4096, 14336, "bf16", "bf16", layout_b="col")
    space = FAMILY.space(problem, H200)

    def clamped(**tiles):
        switches = FAMILY.render_switches(problem, space.admit(gluon_config(problem, **tiles)))
        return switches["CLAMP_ROWS"], switches["CLAMP_COLS"]

    assert clamped(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_stages=5) == (True, True)
    assert clamped(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_stages=4, SCHEDULE="pingpong") == (True, True)
    assert clamped(BLOCK_M=64, BLOCK_N=192, BLOCK_K=64, num_stages=6) == (True, True)
    assert clamped(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_stages=5, SCHEDULE="split_k", SPLIT_K=2) == (False, False)
    assert clamped(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_stages=5, SCHEDULE="stream_k") == (False, False)
    swapped = FAMILY.render_switches(problem, space.admit(gluon_swapped_config(problem, H200, BLOCK_M=144,
                                                                                BLOCK_N=128)))
    assert (swapped["CLAMP_ROWS"], swapped["CLAMP_COLS"]) == (False, True)
    monkeypatch.setattr(gemm_space, "CLAMP_ROW_TILES", False)
    assert clamped(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_stages=5) == (False, True)
    monkeypatch.setattr(gemm_space, "CLAMP_COL_TILES", False)
    assert clamped(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_stages=5) == (False, False)


CASES = [
    (dict(m=300, n=1000, k=784, dtype="fp16", out_dtype="fp16", layout_b="row", bias=True, activation="gelu",
          residual=True), dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_stages=4)),
    (dict(m=512, n=1024, k=512, dtype="bf16", out_dtype="bf16", layout_b="col", activation="silu"),
     dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_stages=3)),
    (dict(m=512, n=512, k=512, dtype="fp8", out_dtype="bf16", layout_b="col", scale_mode="row"),
     dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_stages=4, PROMOTE_TILES=1)),
    (dict(m=512, n=512, k=512, dtype="fp8", out_dtype="bf16", layout_b="col", fp8_fast_accum=True, bias=True),
     dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=128, num_stages=3)),
    # Whole tiles only, C through a half-width buffer: four stages of 128 x 256 x 64 fit beside it.
    (dict(m=1000, n=3000, k=776, dtype="bf16", out_dtype="bf16", layout_b="col", bias=True, residual=True),
     dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_stages=4, SCHEDULE="data_parallel", EPILOGUE_SUBTILE=True)),
    # 192-column tiles as a 128- and a 64-column part (WIDE_N), B row-major, with an activation.
    (dict(m=512, n=4608, k=3584, dtype="bf16", out_dtype="bf16", layout_b="row", activation="silu"),
     dict(BLOCK_M=128, BLOCK_N=192, BLOCK_K=64, num_stages=4, SCHEDULE="data_parallel")),
    # The other two-part widths: 128 + 16 (B as W), 128 + 32 (B row-major, a bias), 64 + 32 on one consumer.
    (dict(m=1024, n=4608, k=3584, dtype="bf16", out_dtype="bf16", layout_b="col"),
     dict(BLOCK_M=128, BLOCK_N=144, BLOCK_K=64, num_stages=4, SCHEDULE="data_parallel")),
    (dict(m=1000, n=5000, k=1000, dtype="fp16", out_dtype="fp16", layout_b="row", bias=True),
     dict(BLOCK_M=128, BLOCK_N=160, BLOCK_K=64, num_stages=4, SCHEDULE="data_parallel")),
    (dict(m=300, n=3072, k=3072, dtype="bf16", out_dtype="bf16", layout_b="col", residual=True),
     dict(BLOCK_M=64, BLOCK_N=96, BLOCK_K=64, num_stages=6, SCHEDULE="data_parallel")),
    # Two-part tiles split over K: 128 + 64 columns with a bias and a residual.
    (dict(m=300, n=2560, k=10240, dtype="bf16", out_dtype="bf16", layout_b="col", bias=True, residual=True),
     dict(BLOCK_M=128, BLOCK_N=192, BLOCK_K=64, num_stages=4, SCHEDULE="split_k", SPLIT_K=3)),
    # Ping-pong: two consumer warpgroups, each a whole 128 x 128 tile (B row-major, every epilogue), or fp8 with
    # fast accumulation; 64 x 256 tiles with C in halves.
    (dict(m=300, n=1000, k=784, dtype="fp16", out_dtype="fp16", layout_b="row", bias=True, activation="gelu",
          residual=True), dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_stages=4, SCHEDULE="pingpong")),
    (dict(m=512, n=512, k=512, dtype="fp8", out_dtype="bf16", layout_b="col", fp8_fast_accum=True),
     dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_stages=5, SCHEDULE="pingpong")),
    (dict(m=3000, n=5000, k=1536, dtype="bf16", out_dtype="bf16", layout_b="col"),
     dict(BLOCK_M=64, BLOCK_N=256, BLOCK_K=64, num_stages=4, SCHEDULE="pingpong", EPILOGUE_SUBTILE=True)),
    # The tail split over K, with a bias and a residual.
    (dict(m=3000, n=5000, k=1536, dtype="bf16", out_dtype="bf16", layout_b="col", bias=True, residual=True),
     dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_stages=3, SCHEDULE="split_k", SPLIT_K=3)),
    # Every tile split (narrow weights, gemm_policy._narrow_gluon_split), on one consumer warpgroup.
    (dict(m=200, n=1000, k=3584, dtype="bf16", out_dtype="bf16", layout_b="col", bias=True),
     dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_stages=6, SCHEDULE="split_k", SPLIT_K=3)),
    # Swapped (C^T = W X^T): 96 tokens a tile in two parts over 128 weight rows; 32 tokens over 64 rows split over K
    # with a bias a weight row; fp8 row scales over stream-K's split tiles, every epilogue.
    (dict(m=288, n=5120, k=4096, dtype="bf16", out_dtype="bf16", layout_b="col"),
     dict(BLOCK_M=96, BLOCK_N=128, BLOCK_K=64, num_stages=5, SCHEDULE="data_parallel", SWAP_AB=True, GROUP_M=1)),
    (dict(m=200, n=1000, k=3584, dtype="bf16", out_dtype="bf16", layout_b="col", bias=True),
     dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, num_stages=6, SCHEDULE="split_k", SPLIT_K=3, SWAP_AB=True, GROUP_M=1)),
    # 144 tokens in two parts over 128 weight rows, split over K (narrow weights, few tiles), with a bias.
    (dict(m=144, n=2560, k=10240, dtype="bf16", out_dtype="bf16", layout_b="col", bias=True),
     dict(BLOCK_M=144, BLOCK_N=128, BLOCK_K=64, num_stages=5, SCHEDULE="split_k", SPLIT_K=4, SWAP_AB=True, GROUP_M=1)),
    (dict(m=300, n=1024, k=1008, dtype="fp8", out_dtype="bf16", layout_b="col", scale_mode="row", bias=True,
          activation="gelu", residual=True),
     dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, num_stages=4, PROMOTE_TILES=1, SWAP_AB=True, GROUP_M=1)),
    # Split 4 ways in 128 x 128 tiles, as switched by default: partials in register order, the last contributor
    # keeping its own sum in registers beside the total.
    (dict(m=1000, n=520, k=3576, dtype="bf16", out_dtype="bf16", layout_b="col", bias=True, activation="silu"),
     dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_stages=5, SCHEDULE="split_k", SPLIT_K=4)),
    # Row-major partials (gemm_space.COALESCED_PARTIALS off; on by default): split 128 x 128 tiles, stream-K, and
    # two-part tiles split over K.
    (dict(m=1024, n=512, k=3584, dtype="bf16", out_dtype="bf16", layout_b="col"),
     dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_stages=5, SCHEDULE="split_k", SPLIT_K=4, COALESCED_PARTIALS=False)),
    (dict(m=576, n=2560, k=4096, dtype="bf16", out_dtype="bf16", layout_b="col", bias=True),
     dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_stages=5, COALESCED_PARTIALS=False)),
    (dict(m=300, n=2560, k=10240, dtype="bf16", out_dtype="bf16", layout_b="col"),
     dict(BLOCK_M=128, BLOCK_N=192, BLOCK_K=64, num_stages=4, SCHEDULE="split_k", SPLIT_K=3, COALESCED_PARTIALS=False)),
    # Split tiles finished by fixed owners (gemm_space.OWNED_SPLITS, off; tiles of two warpgroups), with an
    # epilogue, swapped and not.
    (dict(m=1024, n=512, k=3584, dtype="bf16", out_dtype="bf16", layout_b="col", bias=True, activation="silu"),
     dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_stages=5, SCHEDULE="split_k", SPLIT_K=4, OWNED_SPLITS=True)),
    (dict(m=100, n=3072, k=3072, dtype="bf16", out_dtype="bf16", layout_b="col"),
     dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_stages=5, SCHEDULE="split_k", SPLIT_K=2, SWAP_AB=True, GROUP_M=1,
          OWNED_SPLITS=True)),
]


def test_owned_splits_take_split_tiles_of_two_warpgroups_only(monkeypatch):
    # One warpgroup has no rows to share out: 64-row kernel tiles keep the last arrival's protocol.
    from autotile.families import gemm_space

    base = dict(VARIANT="gluon_ws", SCHEDULE="split_k", SPLIT_K=2, SWAP_AB=False, BLOCK_M=128, BLOCK_N=128)
    assert not gemm_space.OWNED_SPLITS, "off: a hang where the grid is not resident at once (gemm_space says how)"
    assert not gemm_space.owned_splits(base)
    monkeypatch.setattr(gemm_space, "OWNED_SPLITS", True)
    assert gemm_space.owned_splits(base)
    assert not gemm_space.owned_splits(dict(base, BLOCK_M=64))
    assert gemm_space.owned_splits(dict(base, SWAP_AB=True, BLOCK_M=64))  # 128 weight rows
    assert not gemm_space.owned_splits(dict(base, SWAP_AB=True, BLOCK_N=64))
    assert not gemm_space.owned_splits(dict(base, SCHEDULE="stream_k"))
    assert not gemm_space.owned_splits(dict(base, VARIANT="tma"))


def _compile_case(case) -> dict:
    from autotile.families import gemm_space
    from autotile.xcompile import compile_config

    problem, tiles = case
    tiles = dict(tiles)
    default = gemm_space.COALESCED_PARTIALS, gemm_space.OWNED_SPLITS
    gemm_space.COALESCED_PARTIALS = tiles.pop("COALESCED_PARTIALS", default[0])
    gemm_space.OWNED_SPLITS = tiles.pop("OWNED_SPLITS", default[1])
    try:
        p = contiguous_problem(**problem)
        config = dict(dict(VARIANT="gluon_ws", SCHEDULE="stream_k", SPLIT_K=1, PERSISTENT=False,
                           WARP_SPECIALIZE=False, FLATTEN=False, SWAP_AB=False, EPILOGUE_SUBTILE=False, GROUP_M=8,
                           num_warps=4), **tiles)
        feasible = FAMILY.space(p, H200).admit(config) is not None
        kernels = compile_config(FAMILY, p, config, H200)
    finally:
        # the worker process compiles other cases after this one
        gemm_space.COALESCED_PARTIALS, gemm_space.OWNED_SPLITS = default
    return dict(feasible=feasible, kernels=[(k.name, k.shared, k.registers, k.stack, list(k.ptx_features),
                                             k.global_scratch) for k in kernels])


def _compile_cases() -> list:
    from compile_child import map_in_processes

    return map_in_processes(_compile_case, CASES)


def test_gluon_ws_kernels_compile_for_sm90():
    from compile_child import run_compile_child

    results = run_compile_child(__file__)
    assert len(results) == len(CASES)
    for (problem, tiles), result in zip(CASES, results):
        assert result["feasible"], (problem, tiles)
        (name, shared, registers, stack, features, scratch), = result["kernels"]
        assert name == "gemm_kernel" and shared <= H200.smem_per_block
        assert scratch == 0, "the TMA descriptors are kernel parameters, built on the host (no scratch a launch)"
        assert "wgmma" in " ".join(features)
        if tiles.get("SCHEDULE") == "split_k" and tiles["BLOCK_N"] <= 128 and not tiles.get("SWAP_AB"):
            assert stack == 0, "the last split holds its own sum beside the total without spilling"
        if problem["dtype"] == "fp8" and not problem.get("fp8_fast_accum"):
            assert stack == 0, "precise fp8 128 x 128 tiles fit the consumers' registers"


if __name__ == "__main__":
    sys.stdout.write(json.dumps(_compile_cases()) + "\n")
