"""Warm starts: the nearest tuned problems' winners and best configs open a new problem's study."""
from __future__ import annotations

import pytest

from autotile.device import DeviceInfo, interpret_device
from autotile.families.gemm import FAMILY, contiguous_problem
from autotile.space import Config
from autotile.store.db import open_engine
from autotile.store.repo import Store
from autotile.tune.simulate import synthetic_device
from autotile.tune.warmstart import Neighbour, rank_neighbours, warm_configs, warm_start

CPU = interpret_device()
H200 = synthetic_device()


def _config(**changes) -> Config:
    """A config of the small problems below: the family's default for one of them, data-parallel and not
    swapped (so that any tile shape of them is feasible), with `changes`."""
    base = FAMILY.default_config(contiguous_problem(32, 256, 256, "fp16", "fp16"), CPU)
    return Config({**base, "SWAP_AB": False, "SCHEDULE": "data_parallel", "SPLIT_K": 1, **changes})


def test_neighbours_are_ranked_by_shape_distance_same_layout_first():
    new = contiguous_problem(48, 4096, 4096)
    tuned = [
        (contiguous_problem(48, 4096, 4096), "itself"),
        (contiguous_problem(64, 4096, 4096), "m64"),  # |log2(64/48)| = 0.415
        (contiguous_problem(16, 4096, 4096), "m16"),  # 1.585
        (contiguous_problem(48, 4096, 4096, layout_b="col"), "col"),  # same shape, other layout: second tier
        (contiguous_problem(48, 4096, 4096, "fp16", "fp16"), "fp16"),  # another dtype: never
        (contiguous_problem(48, 4096, 4096, activation="relu"), "relu"),  # another epilogue: never
        (contiguous_problem(48 * 2**9, 4096, 4096), "far"),  # 9 octaves: past MAX_DISTANCE
    ]
    ranked = rank_neighbours(FAMILY, new, tuned, max_neighbours=5)
    assert [n.configs for n in ranked] == ["m64", "m16"] and [n.tier for n in ranked] == [0, 0]
    assert ranked[0].distance == pytest.approx(0.415, abs=1e-3)
    only_other_layout = rank_neighbours(FAMILY, new, tuned[3:], max_neighbours=5)
    assert [(n.configs, n.tier) for n in only_other_layout] == [("col", 1)]
    assert rank_neighbours(FAMILY, new, [tuned[0], tuned[4]]) == []  # itself and another dtype only


def test_warm_configs_take_each_neighbours_best_in_turn_on_the_new_grid():
    space = FAMILY.space(contiguous_problem(32, 256, 256, "fp16", "fp16"), CPU)
    a1, a2, a3 = _config(BLOCK_N=32), _config(BLOCK_N=128), _config(BLOCK_N=256)
    b1 = _config(BLOCK_M=128)  # breaks tile_within_problem for M=32, but is on the grid: kept (the search adapts it)
    off_grid = _config(BLOCK_M=512)
    vendor = Config(VENDOR="cublas")
    neighbours = [Neighbour(None, 1.0, 0, (vendor, a1, a2, a3)), Neighbour(None, 2.0, 0, (off_grid, b1, a1))]
    warm = warm_configs(space, neighbours, per_neighbour=3, limit=8)
    assert list(warm.configs) == [a1, a2, b1, a3]  # round robin, the off-grid one and the repeat of a1 dropped
    assert warm.off_grid == 1 and not space.is_feasible(b1)
    assert list(warm_configs(space, neighbours, per_neighbour=3, limit=2).configs) == [a1, a2]
    assert list(warm_configs(space, neighbours, exclude=[a1]).configs)[:2] == [a2, b1]


def _record(store: Store, problem, device, rows, winner=None, kernel=None):
    ids = store.ensure_problem(FAMILY, problem), store.ensure_device(device), store.ensure_toolchain()
    for number, (config, status, ms) in enumerate(rows):
        store.record_trial(problem_id=ids[0], device_id=ids[1], toolchain_id=ids[2], study=f"s{problem.m}",
                           number=number, config=config.to_json(), config_hash=config.hash, status=status,
                           median_ms=ms, q20_ms=ms, q80_ms=ms)
    if winner is not None:
        store.save_winner(problem_id=ids[0], device=device, device_id=ids[1], toolchain_id=ids[2],
                          config=winner.to_json(), config_hash=winner.hash, median_ms=0.1, q20_ms=0.1, q80_ms=0.1,
                          interpreted=0, runner_up_ms=None, margin=None, baseline_name="", baseline_ms=None,
                          trials_run=len(rows), provenance="test", kernel_config=kernel)


def test_warm_start_reads_winners_and_best_trials_of_the_nearest_problems(tmp_path):
    engine = open_engine(f"sqlite:///{tmp_path / 'w.sqlite'}")
    store = Store(engine)
    c = [_config(BLOCK_N=n, num_stages=s) for n in (32, 64, 128) for s in (2, 3)]
    # M=64: the vendor op won; its best kernel is c[5]. Trials best first: c[1] (1.0), c[0] (2.0); c[2] failed.
    _record(store, contiguous_problem(64, 256, 256), H200, [(c[0], "ok", 2.0), (c[1], "ok", 1.0),
                                                            (c[2], "compile_error", None)],
            winner=Config(VENDOR="cublas"), kernel=c[5].to_json())
    _record(store, contiguous_problem(128, 256, 256), H200, [(c[3], "ok", 1.0)])  # farther
    a100 = DeviceInfo("a100", "A100", (8, 0), 108, 1, 166912, "x")
    _record(store, contiguous_problem(32, 256, 256), a100, [(c[4], "ok", 0.1)])  # another device key: never
    new = contiguous_problem(40, 256, 256)
    warm = warm_start(engine, FAMILY, new, H200, neighbours=2, per_neighbour=3, limit=8)
    assert [n.problem.m for n in warm.neighbours] == [64, 128]
    # Round robin over the two: M=64's kernel winner, M=128's best, M=64's best trials.
    assert list(warm.configs) == [c[5], c[3], c[1], c[0]]
    assert "64x256x256" in warm.describe(FAMILY)
    assert warm_start(engine, FAMILY, new, CPU).configs == ()  # nothing tuned under the interpreter


def test_a_new_study_runs_the_neighbours_best_right_after_the_default(tmp_path):
    """Through the tuner (on the interpreter): the second trial of a new problem is its neighbour's best config;
    a resumed study is not warm-started again."""
    url = f"sqlite:///{tmp_path / 'n.sqlite'}"
    store = Store(open_engine(url))
    neighbour = contiguous_problem(16, 32, 64, "fp16", "fp16")
    new = contiguous_problem(24, 32, 64, "fp16", "fp16")
    best = _config(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, num_warps=4, num_stages=3)
    assert FAMILY.space(new, CPU).is_feasible(best) and best != FAMILY.default_config(new, CPU)
    _record(store, neighbour, CPU, [(best, "ok", 0.5)])
    seen = []
    result = tune_problem_cpu(new, url, trials=2, progress=lambda p: seen.append(p.last_config))
    assert seen == [FAMILY.default_config(new, CPU), best]
    assert "16x32x64" in result.warm_start
    again = tune_problem_cpu(new, url, trials=3)
    assert again.warm_start == "" and again.trials_this_run == 1


def tune_problem_cpu(problem, url, **kwargs):
    from autotile.tune.driver import tune_problem

    return tune_problem(FAMILY, problem, CPU, db_url=url, retime_rounds=0, **kwargs)
