"""Split-K and stream-K under the interpreter: every reduction order against float64, results that do not
depend on the order programs run in, tile counters left at zero, and the stream-K partition itself."""
from __future__ import annotations

import contextlib
import random

import pytest
import torch

from autotile.bench import Status, poison, run_checked
from autotile.device import interpret_device
from autotile.families import gemm_launch
from autotile.families.gemm import FAMILY, contiguous_problem
from autotile.render import load_kernel_module
from autotile.space import Config

CPU = interpret_device()


def config(**values) -> Config:
    base = dict(VARIANT="blocked", SCHEDULE="data_parallel", SPLIT_K=1, PERSISTENT=False, WARP_SPECIALIZE=False,
                FLATTEN=False, SWAP_AB=False, BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=1, num_warps=4, num_stages=2)
    base.update(values)
    return Config(base)


@contextlib.contextmanager
def interpreter_programs(count: int):
    """Stream-K and persistent grids as if `count` programs ran at once."""
    before = gemm_launch.INTERPRETER_PROGRAMS
    gemm_launch.INTERPRETER_PROGRAMS = count
    gemm_launch.launch_plan.cache_clear()
    try:
        yield
    finally:
        gemm_launch.INTERPRETER_PROGRAMS = before
        gemm_launch.launch_plan.cache_clear()


@contextlib.contextmanager
def programs_run_in(order: str, seed: int = 0):
    """Run the interpreter's programs in reverse or shuffled order instead of by program id.

    NOTE: the interpreter walks the grid in id order; remapping the index it hands each program is the
    one place to change that, and it changes nothing else.
    """
    from triton.runtime.interpreter import interpreter_builder as builder

    original = builder.set_grid_idx
    orders: dict[tuple, list] = {}

    def remapped(x, y, z):
        dims = builder.grid_dim
        total = dims[0] * dims[1] * dims[2]
        if dims not in orders:
            ids = list(range(total))
            if order == "reverse":
                ids.reverse()
            else:
                random.Random(seed).shuffle(ids)
            orders[dims] = ids
        linear = orders[dims][(x * dims[1] + y) * dims[2] + z]
        original(linear // (dims[1] * dims[2]), (linear // dims[2]) % dims[1], linear % dims[2])

    builder.set_grid_idx = remapped
    try:
        yield
    finally:
        del builder.set_grid_idx  # the instance attribute shadowed the method


def run(problem, cfg, inputs) -> torch.Tensor:
    outputs = FAMILY.allocate_outputs(problem, inputs)
    poison(outputs)
    FAMILY.launch(problem, cfg, inputs, outputs)
    return outputs["c"]


# K = 200 is 7 tiles of 32, the last one partial: 2 and 3 splits do not divide it, and with 3, 4, 5 or 7
# programs stream-K's shares begin and end inside tiles (6 tiles of 32 x 32: whole waves, a partial last
# wave, or fewer tiles than programs).
ODD = contiguous_problem(37, 70, 200, "bf16", "fp32", layout_b="col", bias=True, activation="gelu", residual=True)
ORDERS = [("split_k", 2, 3), ("split_k", 3, 3), ("split_k", 3, 4), ("stream_k", 1, 3), ("stream_k", 1, 4),
          ("stream_k", 1, 5), ("stream_k", 1, 7), ("stream_k", 1, 2)]


@pytest.mark.parametrize("schedule,split,programs", ORDERS, ids=[f"{s}-{k}-p{p}" for s, k, p in ORDERS])
def test_every_reduction_order_matches_float64(schedule, split, programs):
    cfg = config(SCHEDULE=schedule, SPLIT_K=split, BLOCK_M=32, BLOCK_N=32)
    with interpreter_programs(programs):
        outcome, _ = run_checked(FAMILY, ODD, cfg, CPU, seed=7)
    assert outcome.status is Status.OK, outcome.error


@pytest.mark.parametrize("cfg", [config(SCHEDULE="split_k", SPLIT_K=3, BLOCK_M=32, BLOCK_N=32),
                                 config(SCHEDULE="stream_k", BLOCK_M=32, BLOCK_N=32)], ids=["split_k", "stream_k"])
def test_the_result_does_not_depend_on_the_order_programs_finish(cfg):
    inputs = FAMILY.make_inputs(ODD, CPU, seed=3)
    with interpreter_programs(5):
        in_order = run(ODD, cfg, inputs)
        with programs_run_in("reverse"):
            reversed_ = run(ODD, cfg, inputs)
        with programs_run_in("shuffled", seed=11):
            shuffled = run(ODD, cfg, inputs)
    # Bit for bit: the last contributor adds the partials in contributor order, whoever it is.
    assert torch.equal(in_order, reversed_) and torch.equal(in_order, shuffled)
    assert FAMILY.check(ODD, inputs, {"c": in_order}, FAMILY.reference(ODD, inputs)).ok


# The TMA store of C in two halves (C tiles of 128 x 128 at least): N = 136 leaves the second column tile 8 wide (its
# right half wholly clipped), M = 130 the second row tile 2 rows high.
SUBTILED = contiguous_problem(130, 136, 200, "bf16", "fp32", layout_b="col", bias=True, activation="gelu", residual=True)
SUBTILE_CASES = [("data_parallel", 1, False), ("data_parallel", 1, True), ("split_k", 3, False), ("stream_k", 1, False)]


@pytest.mark.parametrize("schedule,split,persistent", SUBTILE_CASES,
                         ids=[f"{s}-{k}{'-persistent' if p else ''}" for s, k, p in SUBTILE_CASES])
def test_epilogue_subtile_stores_every_column(schedule, split, persistent):
    cfg = config(VARIANT="tma", SCHEDULE=schedule, SPLIT_K=split, PERSISTENT=persistent, EPILOGUE_SUBTILE=True,
                 BLOCK_M=128, BLOCK_N=128)
    FAMILY.space(SUBTILED, CPU).validate(cfg)
    with interpreter_programs(3):
        outcome, _ = run_checked(FAMILY, SUBTILED, cfg, CPU, seed=5)
    assert outcome.status is Status.OK, outcome.error


def test_epilogue_subtile_needs_a_staged_store_and_wide_tiles():
    space = FAMILY.space(SUBTILED, CPU)
    assert "epilogue_subtile_staged_only" in " ".join(space.violations(config(EPILOGUE_SUBTILE=True, BLOCK_N=64)))
    assert "epilogue_subtile_width" in " ".join(space.violations(config(VARIANT="tma", EPILOGUE_SUBTILE=True)))
    assert "epilogue_subtile_width" in " ".join(space.violations(config(VARIANT="tma", EPILOGUE_SUBTILE=True,
                                                                        BLOCK_M=64, BLOCK_N=128)))
    # A config stored before the axis existed stores C whole.
    stored = {k: v for k, v in config(VARIANT="tma", BLOCK_N=64).items() if k != "EPILOGUE_SUBTILE"}
    assert space.validate(stored)["EPILOGUE_SUBTILE"] is False


def test_tile_counters_are_zero_after_every_launch():
    problem = contiguous_problem(3, 64, 256, "fp16", "fp16", layout_b="col")
    inputs = FAMILY.make_inputs(problem, CPU, seed=1)
    first = None
    for cfg in (config(SCHEDULE="split_k", SPLIT_K=4, BLOCK_N=32), config(SCHEDULE="stream_k", BLOCK_N=32)):
        for _ in range(2):
            out = run(problem, cfg, inputs)
            first = out if first is None else first
            torch.testing.assert_close(out, first, atol=2e-3, rtol=1e-3)
            counters = gemm_launch.tile_counters(torch.device("cpu"), 1)
            assert not counters.any(), f"{cfg['SCHEDULE']} left counters set: {counters.nonzero().flatten()[:8]}"


def test_split_buffers_are_the_kept_workspace_and_counters():
    cpu = torch.device("cpu")
    ws, counters = gemm_launch.split_buffers(cpu, 4096, 8)
    assert ws is gemm_launch.workspace(cpu, 4096) and counters is gemm_launch.tile_counters(cpu, 8)
    assert ws.numel() >= 4096 and counters.numel() >= 8 and not counters.any()
    assert gemm_launch.split_buffers(cpu, 0, 8) == (None, counters)
    assert gemm_launch.split_buffers(cpu, 4096, 0) == (ws, None)


def test_a_failed_launch_drops_its_counters(monkeypatch):
    problem = contiguous_problem(3, 64, 256, "fp16", "fp16")
    inputs = FAMILY.make_inputs(problem, CPU, seed=1)
    half_counted = gemm_launch.tile_counters(torch.device("cpu"), 1)

    def fails_halfway(*args, **kwargs):
        half_counted[0] = 1  # as a launch that raised after some contributors arrived would leave it
        raise RuntimeError("launch failed")

    monkeypatch.setattr(gemm_launch, "launch_kernel", fails_halfway)
    with pytest.raises(RuntimeError, match="launch failed"):
        FAMILY.launch(problem, config(SCHEDULE="split_k", SPLIT_K=2), inputs, FAMILY.allocate_outputs(problem, inputs))
    fresh = gemm_launch.tile_counters(torch.device("cpu"), 1)
    assert fresh is not half_counted and not fresh.any()


DECODE = [
    (contiguous_problem(1, 96, 296, "bf16", "bf16", layout_b="col"), config(SCHEDULE="split_k", SPLIT_K=3, SWAP_AB=True, BLOCK_N=64)),
    (contiguous_problem(1, 96, 296, "bf16", "bf16", layout_b="col"), config(VARIANT="tma", SCHEDULE="split_k", SPLIT_K=2,
                                                                            SWAP_AB=True, BLOCK_N=64, BLOCK_K=64)),
    (contiguous_problem(5, 100, 300, "fp16", "fp16", layout_b="col", bias=True), config(SCHEDULE="stream_k", SWAP_AB=True,
                                                                                       BLOCK_N=64)),
    (contiguous_problem(16, 64, 512, "bf16", "bf16", layout_b="col"), config(VARIANT="tma", SCHEDULE="stream_k", BLOCK_K=64)),
    # The mid-M weight-streaming seed (gemm_policy.streaming_config): 37 tokens in one 64-row swapped tile.
    (contiguous_problem(37, 72, 300, "bf16", "bf16", layout_b="col"), config(SCHEDULE="split_k", SPLIT_K=3, SWAP_AB=True,
                                                                            BLOCK_M=64, BLOCK_N=64)),
    # Wide streaming tiles (up to gemm_space.SWAP_MAX_M tokens in the MMA's N side): 97 tokens in a 128-token tile,
    # K = 200 split 3 ways at BLOCK_K 32 (7 K tiles: splits of 2, 2 and 3, the last one partial).
    (contiguous_problem(97, 80, 200, "fp16", "fp16", layout_b="col", bias=True),
     config(SCHEDULE="split_k", SPLIT_K=3, SWAP_AB=True, BLOCK_M=128, BLOCK_N=64, BLOCK_K=32, GROUP_M=1)),
    # Token tiles of a narrow weight (gemm_policy.token_tile_config): 150 tokens in ten swapped 16-token tiles, the
    # last one partial, K not a multiple of the tile.
    (contiguous_problem(150, 72, 200, "bf16", "bf16", layout_b="col"),
     config(SWAP_AB=True, BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, GROUP_M=1)),
]


@pytest.mark.parametrize("problem,cfg", DECODE, ids=[f"{p.m}x{p.n}x{p.k}-{c['VARIANT']}-{c['SCHEDULE']}" for p, c in DECODE])
def test_decode_shapes(problem, cfg):
    FAMILY.space(problem, CPU).validate(cfg)
    outcome, _ = run_checked(FAMILY, problem, cfg, CPU, seed=2)
    assert outcome.status is Status.OK, outcome.error


# fp8 scales with K = 480 (four 128-wide scale groups, the last partial), N = 144 (a partial 128-column
# block), BLOCK_K = 64 (two K tiles per group) and splits whose boundaries fall inside groups (3 splits of
# 8 K tiles end at tiles 2 and 5).
FP8 = [
    ("block", False, config(SCHEDULE="split_k", SPLIT_K=3, BLOCK_K=64, BLOCK_N=64)),
    ("block", False, config(SCHEDULE="stream_k", BLOCK_K=64, BLOCK_N=64, SWAP_AB=True)),
    ("block", False, config(VARIANT="tma", BLOCK_K=128, BLOCK_N=64)),
    ("row", False, Config(dict(config(SCHEDULE="stream_k", BLOCK_K=64, BLOCK_N=64), PROMOTE_TILES=2))),
    ("row", True, config(VARIANT="tma", SCHEDULE="split_k", SPLIT_K=2, BLOCK_K=64, BLOCK_N=64)),
    ("tensor", False, Config(dict(config(VARIANT="tma", PERSISTENT=True, BLOCK_K=64, BLOCK_N=64), PROMOTE_TILES=4))),
]


@pytest.mark.parametrize("mode,fast,cfg", FP8, ids=[f"{m}-{'fast' if f else 'precise'}-{c['VARIANT']}-{c['SCHEDULE']}"
                                                   for m, f, c in FP8])
def test_fp8_scales_in_every_schedule(mode, fast, cfg):
    problem = contiguous_problem(24, 144, 480, "fp8", "bf16", layout_b="col", scale_mode=mode, fp8_fast_accum=fast,
                                 bias=True, residual=True)
    FAMILY.space(problem, CPU).validate(cfg)
    with interpreter_programs(4):
        outcome, _ = run_checked(FAMILY, problem, cfg, CPU, seed=4)
    assert outcome.status is Status.OK, outcome.error


def test_a_wrong_scale_is_caught():
    problem = contiguous_problem(24, 144, 480, "fp8", "bf16", layout_b="col", scale_mode="block")
    inputs = FAMILY.make_inputs(problem, CPU, seed=4)
    expected = FAMILY.reference(problem, inputs)
    inputs["scale_b"] = inputs["scale_b"].clone()
    inputs["scale_b"][2, 1] *= 1.5  # the third K group of the second column block
    out = run(problem, config(SCHEDULE="split_k", SPLIT_K=3, BLOCK_K=64, BLOCK_N=64), inputs)
    result = FAMILY.check(problem, inputs, {"c": out}, expected)
    assert not result.ok and "outside tolerance" in result.message


# --- the stream-K partition, checked in plain Python over many shapes -------------------------------

def _geometry(tiles_m, tiles_n, k_tiles, programs):
    problem = contiguous_problem(16 * tiles_m, 32 * tiles_n, 32 * k_tiles, "fp16", "fp16")
    module = load_kernel_module(FAMILY.template, interpret=True,
                                **FAMILY.render_switches(problem, config(SCHEDULE="stream_k")))
    return module.launch_geometry(problem.m, problem.n, problem.k, 16, 32, 32, 1, False, programs)


@pytest.mark.parametrize("seed", range(4))
def test_stream_k_partition_covers_every_iteration_once(seed):
    rng = random.Random(seed)
    for _ in range(150):
        tiles_m, tiles_n, k_tiles, programs = rng.randint(1, 9), rng.randint(1, 9), rng.randint(1, 40), rng.randint(1, 140)
        (grid,), workspace, counters, (dp_tiles, sk_programs, sk_iters) = _geometry(tiles_m, tiles_n, k_tiles, programs)
        tiles = tiles_m * tiles_n
        assert counters == tiles and grid == dp_tiles + sk_programs and workspace == 2 * sk_programs * 16 * 32
        assert dp_tiles % programs == 0 and sk_programs <= programs
        covered = [0] * (tiles * k_tiles)
        slots = set()
        for pid in range(grid):
            if pid < dp_tiles:
                start, end = pid * k_tiles, (pid + 1) * k_tiles
            else:
                q = pid - dp_tiles
                start = dp_tiles * k_tiles + q * sk_iters // sk_programs
                end = dp_tiles * k_tiles + (q + 1) * sk_iters // sk_programs
                assert end > start, "every stream-K program gets work"
            it = start
            while it < end:  # the kernel's walk over its segments
                tile = it // k_tiles
                seg_end = min(end, (tile + 1) * k_tiles)
                for i in range(it, seg_end):
                    covered[i] += 1
                whole = it == tile * k_tiles and seg_end == (tile + 1) * k_tiles
                if not whole:
                    slot = 2 * q + (it != start)
                    assert slot not in slots and 0 <= slot < 2 * sk_programs
                    slots.add(slot)
                    first = tile * k_tiles - dp_tiles * k_tiles
                    q_first = ((first + 1) * sk_programs - 1) // sk_iters
                    q_last = ((first + k_tiles) * sk_programs - 1) // sk_iters
                    assert q_first <= q <= q_last
                    owners = [qq for qq in range(sk_programs) if qq * sk_iters // sk_programs < first + k_tiles
                              and (qq + 1) * sk_iters // sk_programs > first]
                    assert owners == list(range(q_first, q_last + 1))
                    began_before = q * sk_iters // sk_programs < first
                    assert slot == 2 * q + began_before  # where the finishing program looks for it
                it = seg_end
        assert covered == [1] * (tiles * k_tiles)
        if sk_programs:
            shares = [(q + 1) * sk_iters // sk_programs - q * sk_iters // sk_programs for q in range(sk_programs)]
            assert max(shares) - min(shares) <= 1  # an even spread of the stream-K iterations
            if tiles >= programs:  # the hybrid: between half a tile and one and a half tiles each
                assert k_tiles // 2 <= min(shares) and max(shares) <= (3 * k_tiles + 1) // 2


def test_64_bit_offsets_in_every_schedule(monkeypatch):
    # Problems past 2**31 elements take 64-bit offsets (INDEX_64); too large to run here, so it is forced.
    from autotile.families.gemm import GemmFamily

    rendered = GemmFamily.render_switches
    monkeypatch.setattr(GemmFamily, "render_switches", lambda self, p, c: dict(rendered(self, p, c), INDEX_64=True))
    gemm_launch.launch_plan.cache_clear()
    try:
        for schedule, split in (("data_parallel", 1), ("split_k", 3), ("stream_k", 1)):
            cfg = config(SCHEDULE=schedule, SPLIT_K=split, BLOCK_M=32, BLOCK_N=32)
            outcome, _ = run_checked(FAMILY, ODD, cfg, CPU, seed=1)
            assert outcome.status is Status.OK, f"{schedule}: {outcome.error}"
        source = load_kernel_module(FAMILY.template, interpret=True, **FAMILY.render_switches(ODD, cfg))
        assert "off_m.to(tl.int64)" in open(source.__file__).read()
    finally:
        gemm_launch.launch_plan.cache_clear()
