"""The search's proposals: ordinal axes snapped to their choices, old categorical studies, shipped warm starts."""
from __future__ import annotations

import optuna
import pytest

from autotile.families.flash import FAMILY as FLASH
from autotile.families.flash import FlashProblem
from autotile.space import Axis, Config, Space
from autotile.store.db import open_engine
from autotile.store.repo import Store
from autotile.tune import sampling
from autotile.tune.search import _ConfigSource, make_sampler
from autotile.tune.simulate import synthetic_device
from autotile.tune.warmstart import shipped_engine, warm_start

H200 = synthetic_device()
LLAMA_PREFILL = FlashProblem("fwd", batch=2, heads_q=32, heads_kv=8, seq_q=4096, seq_k=4096, head_dim=128,
                             causal=True, dtype="bf16")
SPACE = Space([Axis("BLOCK_N", (16, 32, 64, 128, 256)), Axis("num_stages", (2, 3, 4)), Axis("LOADS", ("a", "b")),
               Axis("num_warps", (4, 8))])


def test_ordinal_axes_are_integers_of_three_or_more_choices():
    assert [sampling.is_ordinal(a) for a in SPACE.axes] == [True, True, False, False]
    blocks, stages = SPACE.axes[0], SPACE.axes[1]
    assert [sampling.snap(blocks, v) for v in (1, 22, 23, 45, 46, 181, 182, 999)] == [16, 16, 32, 32, 64, 128, 256,
                                                                                     256]
    assert [sampling.snap(stages, v) for v in (2, 3, 4)] == [2, 3, 4]


def test_every_proposal_is_a_point_of_the_grid_and_enqueued_configs_come_back_unchanged():
    study = optuna.create_study(sampler=make_sampler(0))
    enqueued = {"BLOCK_N": 32, "num_stages": 4, "LOADS": "b", "num_warps": 8}
    study.enqueue_trial(enqueued)
    seen = []
    for number in range(30):
        trial = study.ask()
        config = sampling.suggest(trial, SPACE)
        assert SPACE.violations(config) == []  # every value one of its axis' choices
        if number == 0:
            assert config == enqueued
        seen.append(config["BLOCK_N"])
        study.tell(trial, float(abs(config["BLOCK_N"] - 32) + config["num_stages"]))
    assert len(set(seen)) >= 3  # the integer range reaches the choices between the ends, not just the ends


def test_a_study_an_older_version_started_keeps_its_categorical_axes():
    """Optuna refuses another kind of distribution under a name a study already holds: such an axis stays a
    category there instead of failing the resumed run."""
    study = optuna.create_study(sampler=make_sampler(1))
    old = study.ask()
    old_config = {a.name: old.suggest_categorical(a.name, list(a.choices)) for a in SPACE.axes}
    study.tell(old, 1.0)
    for _ in range(3):
        trial = study.ask()
        config = sampling.suggest(trial, SPACE)
        assert set(config) == set(old_config) and SPACE.violations(config) == []
        assert isinstance(trial.distributions["BLOCK_N"], optuna.distributions.CategoricalDistribution)
        study.tell(trial, 2.0)


def test_the_config_source_proposes_through_the_ordinal_encoding():
    study = optuna.create_study(sampler=make_sampler(2))
    trial = study.ask()
    config = _ConfigSource(SPACE).suggest(trial)
    assert isinstance(trial.distributions["BLOCK_N"], optuna.distributions.IntDistribution)
    assert trial.distributions["BLOCK_N"].log and not trial.distributions["num_stages"].log
    assert config["BLOCK_N"] in SPACE.axis("BLOCK_N").choices


def test_step_distance_counts_steps_on_ordered_axes_and_mismatches_on_the_others():
    import numpy as np

    codes = np.array([[1, 1, 0, 0], [3, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]], dtype=np.int16)
    target = np.array([2, 1, 0, 0], dtype=np.int16)
    assert sampling.step_distance(SPACE, codes, target).tolist() == [1, 1, 3, 3]
    unknown = np.array([-1, 1, 0, 0], dtype=np.int16)  # a value outside the axis: as far as the axis is long
    assert sampling.step_distance(SPACE, codes[:1], unknown).tolist() == [5]


@pytest.mark.skipif(shipped_engine() is None, reason="no shipped tuning_db/ in this install")
def test_a_flash_problem_can_warm_start_from_the_shipped_winners(tmp_path):
    engine = open_engine(f"sqlite:///{tmp_path / 'user.sqlite'}")
    assert warm_start(engine, FLASH, LLAMA_PREFILL, H200).configs == ()  # opt-in (see warm_start)
    warm = warm_start(engine, FLASH, LLAMA_PREFILL, H200, shipped=True)
    assert warm.neighbours and all(FLASH.problem_key(n.problem) != FLASH.problem_key(LLAMA_PREFILL)
                                   for n in warm.neighbours)
    assert warm.neighbours[0].problem.heads_kv == 32 and warm.neighbours[0].distance == pytest.approx(2.0)
    assert warm_start(engine, FLASH, LLAMA_PREFILL, H200, shipped=False).configs == ()
    # A problem tuned in the user's database as well is read from there: its own best trial leads.
    nearest = warm.neighbours[0].problem
    mine = Config(dict(LOADS="pointer", BLOCK_M=64, BLOCK_N=32, WARP_SPECIALIZE=False, MASKS_IN_LOOP=False,
                       TILE_QUEUE=False, num_warps=4, num_stages=2))
    store = Store(engine)
    ids = store.ensure_problem(FLASH, nearest), store.ensure_device(H200), store.ensure_toolchain()
    store.record_trial(problem_id=ids[0], device_id=ids[1], toolchain_id=ids[2], study="mine", number=0,
                       config=mine.to_json(), config_hash=mine.hash, status="ok", median_ms=0.1, q20_ms=0.1,
                       q80_ms=0.1)
    again = warm_start(engine, FLASH, LLAMA_PREFILL, H200, shipped=True)
    assert again.configs[0] == mine and mine not in warm.configs


@pytest.mark.skipif(shipped_engine() is None, reason="no shipped tuning_db/ in this install")
def test_the_benchmark_never_seeds_a_table_with_its_own_problem():
    """A table of a problem the shipped database holds: the simulated warm start leaves that problem out."""
    import dataclasses
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from search_efficiency import shipped_neighbours, warm_for

    from autotile.tune.simulate import synthetic_table

    shipped = [p for p, _ in shipped_neighbours(FLASH, H200.key) if p.direction == "fwd"]
    own = next(p for p in shipped if p.head_dim == 128 and p.causal and p.seq_q == 4096)
    configs = list(FLASH.space(own, H200).feasible())[:40] + [FLASH.default_config(own, H200)]
    table = synthetic_table(FLASH, own, H200, configs)
    warm = warm_for(FLASH, own, table, [], shipped=True)
    keys = {FLASH.problem_key(n.problem) for n in warm.neighbours}
    assert warm.neighbours and FLASH.problem_key(own) not in keys
    assert dataclasses.asdict(own) == table.problem
