"""The roofline pruning model: a lower bound below real H200 times, calibration, and what it drops in a search."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from autotile.device import DeviceInfo, interpret_device
from autotile.families.flash import FAMILY as FLASH
from autotile.families.flash import FlashProblem
from autotile.families.gemm import FAMILY as GEMM
from autotile.families.gemm import contiguous_problem
from autotile.space import Config
from autotile.tune.prune import HBM_HEADROOM, LAUNCH_FLOOR_MS, MIN_OBSERVED, Pruner, bound_function

H200 = DeviceInfo("h200", "NVIDIA H200", (9, 0), 132, 150_000_000_000, 232448, "test")
SHIPPED = Path(__file__).resolve().parent.parent / "tuning_db" / "winners.txt"


def _shipped_h200(family: str) -> list[dict]:
    rows = [json.loads(line) for line in SHIPPED.read_text().splitlines() if line.strip()]
    # Winners only (policy lines name no problem), and generated kernels only (a vendor winner has no tiles).
    return [r for r in rows if r.get("family") == family and r["device"] == "h200/sm90" and "VENDOR" not in r["config"]]


def test_bound_is_below_every_shipped_h200_gemm_and_flash_time():
    """Measured H200 winners (tuning_db/winners.txt) take at least as long as the model's lower bound for them."""
    checked = 0
    for family, direction_ok in ((GEMM, lambda p: True), (FLASH, lambda p: p["direction"] == "fwd")):
        for row in _shipped_h200(family.name):
            if not direction_ok(row["problem"]):
                continue
            problem = family.problem_from_dict(row["problem"])
            fn, roof = bound_function(family, problem, H200)
            bound = float(fn(problem, roof, [Config(row["config"])])[0])
            assert 0 < bound <= row["median_ms"], (row["problem"], bound, row["median_ms"])
            checked += 1
    assert checked >= 15  # the gemm and forward flash winners of the shipped database


def test_small_tiles_of_a_large_gemm_are_bounded_far_above_large_ones():
    problem = contiguous_problem(4096, 4096, 4096, "bf16", "bf16")
    configs = list(GEMM.space(problem, H200).feasible())
    pruner = Pruner.for_problem(GEMM, problem, H200, configs)
    by_tile = {}
    for config, bound in zip(configs, pruner.bounds):
        key = (config["BLOCK_M"], config["BLOCK_N"])
        by_tile[key] = min(by_tile.get(key, np.inf), bound)
    assert by_tile[(16, 32)] > 3 * by_tile[(128, 256)]
    assert by_tile[(64, 64)] > by_tile[(128, 128)]
    # The best 4096^3 bf16 time seen on the H200 (cuBLAS, 0.193 ms) is near the floor: the bound is tight there.
    assert 0.15 < pruner.floor_ms() < 0.22


def test_a_memory_bound_gemm_leaves_nothing_to_prune():
    """M=16 decode GEMMs are bound by reading the weight: every tile costs about that, so the model drops none."""
    problem = contiguous_problem(16, 14336, 4096, "bf16", "bf16", layout_b="col")
    configs = list(GEMM.space(problem, H200).feasible())
    pruner = Pruner.for_problem(GEMM, problem, H200, configs)
    # H200 copy rate 4.30 TB/s, with the HBM term's headroom for a stream of reads alone.
    compulsory_ms = GEMM.cost(problem).bytes / (HBM_HEADROOM * 4.30e12) * 1e3 + LAUNCH_FLOOR_MS
    assert pruner.floor_ms() == pytest.approx(compulsory_ms, rel=0.01)
    for config, bound in zip(configs[:MIN_OBSERVED], pruner.bounds[:MIN_OBSERVED]):
        pruner.observe(config, 2.0 * bound)
    assert pruner.share_dropped() < 0.2


def test_calibration_and_the_drop_rule():
    configs = [Config(X=i) for i in range(6)]
    pruner = Pruner(configs, np.array([1.0, 1.0, 2.0, 3.0, 4.0, 10.0]), margin=0.5, min_observed=2)
    pruner.observe(configs[0], 2.0)
    assert pruner.alive().all() and pruner.reason(configs[5]) == ""  # one observation: nothing dropped yet
    pruner.observe(configs[2], 3.0)  # ratios 2.0 and 1.5: scale 1.5; best 2.0, limit 3.0
    assert pruner.scale == 1.5 and pruner.threshold_ms() == 3.0
    # Calibrated bounds 1.5, 1.5, 3.0, 4.5, 6.0, 15.0 against 3.0: the last three are dropped.
    assert pruner.alive().tolist() == [True, True, True, False, False, False]
    assert "4.5 ms" in pruner.reason(configs[3]) and pruner.drops(configs[5]) and not pruner.drops(configs[2])
    for config, bound in zip(configs, pruner.bounds):  # every observed config stays above its calibrated bound
        if config in (configs[0], configs[2]):
            assert pruner.scale * bound <= {0: 2.0, 2: 3.0}[config["X"]]
    pruner.observe(Config(X=99), 0.1)  # not a config of the space: ignored
    assert pruner.best_ms == 2.0


def test_no_model_under_the_interpreter_for_backward_flash_or_other_families():
    gemm = contiguous_problem(64, 64, 64, "fp16", "fp16")
    assert bound_function(GEMM, gemm, interpret_device()) is None
    unknown = DeviceInfo("other:rtx-9000", "RTX 9000", (12, 0), 100, 1, 100_000, "x")
    assert bound_function(GEMM, gemm, unknown) is None
    bwd = FlashProblem("bwd", 1, 2, 2, 128, 128, 64, False, "bf16")
    assert bound_function(FLASH, bwd, H200) is None
    fwd = FlashProblem("fwd", 1, 2, 2, 128, 128, 64, False, "bf16")
    assert bound_function(FLASH, fwd, H200) is not None
    windowed = FlashProblem("fwd", 1, 2, 2, 128, 128, 64, True, "bf16", window_left=32)
    assert bound_function(FLASH, windowed, H200) is None  # fewer keys than the bound counts
    from autotile.families import get_family

    assert bound_function(get_family("paged"), object(), H200) is None


def test_a_pruned_search_never_runs_a_config_the_model_had_dropped(tmp_path):
    """Through the tuner's own loop (on a synthesised H200 table): dropped proposals are told pruned, with the model's
    reason, and are never evaluated while dropped."""
    from autotile.tune.driver import tune_problem
    from autotile.tune.simulate import synthetic_table

    problem = contiguous_problem(2048, 2048, 2048, "bf16", "bf16")
    table = synthetic_table(GEMM, problem)
    seen = []
    result = tune_problem(GEMM, problem, table.device, trials=40, seed=3, simulate=table, warm_start=False,
                          progress=lambda p: seen.append(p.last_config))
    assert result.simulated and sum(result.statuses.values()) == 40
    # Replaying the same observations: no evaluated config was dropped by the calibration of the trials before it.
    configs = [row.config for row in table.rows.values()]
    check = Pruner.for_problem(GEMM, problem, table.device, configs)
    for config in seen:
        assert not check.drops(config), config
        row = table.lookup(config)
        if row.median_ms is not None:
            check.observe(config, row.median_ms)
    # The model was at work: most of this space can no longer come close. (Most proposals TPE makes here break a
    # constraint and are replaced by the nearest config the model keeps, so few are dropped as proposals.)
    assert check.active and check.share_dropped() > 0.5

