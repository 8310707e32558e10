"""The study driver: failures become statuses, infeasible configs never compile, the winner is stored."""
from __future__ import annotations

import pytest

from autotile.device import interpret_device
from autotile.families.gemm import GemmFamily, contiguous_problem
from autotile.store.db import open_engine
from autotile.store.repo import Store
from autotile.tune.driver import tune_problem

CPU = interpret_device()
PROBLEM = contiguous_problem(24, 32, 64, "fp16", "fp16")


class FlakyGemm(GemmFamily):
    """GEMM whose tma variant crashes and whose stream-K schedule computes garbage.

    Both are configs the study's enqueued seeds hold, so every run meets both kinds of failure: the
    proposals after the seeds follow the interpreter's wall-clock timings and differ from run to run.
    """

    def __init__(self):
        self.launched: list = []

    def launch(self, problem, config, inputs, outputs):
        self.launched.append(config)
        if config["VARIANT"] == "tma":
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        super().launch(problem, config, inputs, outputs)
        if config["SCHEDULE"] == "stream_k":
            outputs["c"].mul_(1.5)


def test_failed_candidates_cost_one_trial_each(tmp_path):
    family = FlakyGemm()
    seeds = family.seed_configs(PROBLEM, CPU)
    assert any(c["VARIANT"] == "tma" for c in seeds) and any(c["SCHEDULE"] == "stream_k" for c in seeds)  # the premise
    url = f"sqlite:///{tmp_path / 'flaky.sqlite'}"
    result = tune_problem(family, PROBLEM, CPU, trials=12, db_url=url, seed=1, retime_rounds=1)
    statuses = result.statuses
    assert sum(statuses.values()) == 12
    assert statuses.get("crash", 0) >= 1 and statuses.get("wrong_result", 0) >= 1 and statuses.get("ok", 0) >= 1
    assert result.winner is not None
    assert result.winner["VARIANT"] == "blocked" and result.winner["SCHEDULE"] != "stream_k"
    trials = Store(open_engine(url)).trials("gemm")
    crash = next(t for t in trials if t["status"] == "crash")
    assert "illegal memory access" in crash["error"]
    wrong = next(t for t in trials if t["status"] == "wrong_result")
    assert "worst at" in wrong["error"]
    space = family.space(PROBLEM, CPU)
    assert all(space.is_feasible(c) for c in family.launched)  # nothing infeasible reached the compiler


def test_winner_has_provenance_and_baseline(tmp_path):
    url = f"sqlite:///{tmp_path / 'win.sqlite'}"
    result = tune_problem(GemmFamily(), PROBLEM, CPU, trials=3, db_url=url, retime_rounds=2)
    (winner,) = Store(open_engine(url)).winners("gemm")
    assert winner.config == result.winner.to_json()
    assert winner.baseline_name == "torch.matmul (CPU)" and winner.baseline_ms > 0
    assert winner.interpreted and "3 trials" in winner.provenance
    assert winner.q20_ms <= winner.median_ms <= winner.q80_ms


def test_timeout_stops_the_search(tmp_path):
    result = tune_problem(GemmFamily(), PROBLEM, CPU, trials=50, timeout=0.0, db_url=f"sqlite:///{tmp_path / 't.sqlite'}",
                          retime_rounds=0)
    assert result.stopped_early.startswith("timeout") and result.trials_this_run == 0


def test_tiny_space_is_exhausted_not_looped(tmp_path):
    tiny = contiguous_problem(1, 1, 1, "fp32", "fp32")
    result = tune_problem(GemmFamily(), tiny, CPU, trials=30, db_url=f"sqlite:///{tmp_path / 'x.sqlite'}",
                          retime_rounds=1)
    feasible = len(list(GemmFamily().space(tiny, CPU).feasible()))
    assert sum(result.statuses.values()) == feasible < 30
    assert "every feasible config" in result.stopped_early


@pytest.mark.parametrize("bad", ["h100", "a100"])
def test_tuning_for_another_gpu_is_refused(bad):
    import torch

    from autotile.device import resolve_gpu
    from autotile.errors import DeviceMismatchError

    if torch.cuda.is_available():
        pytest.skip("checks the message on a machine without that GPU")
    with pytest.raises(DeviceMismatchError, match="--gpu interpret"):
        resolve_gpu(bad)


def test_nearest_feasible_is_a_config_the_fewest_steps_away():
    """Steps along ordered axes (block sizes, warps, stages, splits), a mismatch on the others; ties are broken
    by the proposal, reproducibly, and not always towards the first config of the grid."""
    import random

    from autotile.device import DeviceInfo
    from autotile.tune.search import _ConfigSource

    h200 = DeviceInfo("h200", "NVIDIA H200", (9, 0), 132, 150_000_000_000, 232448, "test")
    space = GemmFamily().space(contiguous_problem(4096, 4096, 4096, "bf16", "bf16"), h200)
    source = _ConfigSource(space)
    feasible = source.feasible()
    rng = random.Random(0)

    def distance(config, wanted):  # the definition, one axis at a time
        total = 0
        for axis in space.axes:
            ordered = type(axis.choices[0]) is int and len(axis.choices) >= 3
            if ordered:
                total += abs(axis.choices.index(config[axis.name]) - axis.choices.index(wanted[axis.name]))
            else:
                total += config[axis.name] != wanted[axis.name]
        return total

    firsts = 0
    for _ in range(8):
        wanted = {axis.name: rng.choice(axis.choices) for axis in space.axes}
        exclude = {c.hash for c in rng.sample(feasible, 200)}
        open_configs = [c for c in feasible if c.hash not in exclude]
        nearest = min(distance(c, wanted) for c in open_configs)
        ties = [c for c in open_configs if distance(c, wanted) == nearest]
        picked = source.nearest_feasible(wanted, exclude)
        assert picked in ties and source.nearest_feasible(wanted, exclude) == picked
        firsts += picked == ties[0] and len(ties) > 1
    assert firsts < 8
    # A taken BLOCK_N 64 proposal is replaced one step away (its BLOCK_N 32 or 128 neighbour, say), never by a
    # config that only shares as many values (BLOCK_N 256 counted as near as 32 before).
    wanted = next(c for c in feasible if c["BLOCK_N"] == 64 and {**c, "BLOCK_N": 32} in feasible)
    assert distance(source.nearest_feasible(dict(wanted), {wanted.hash}), wanted) == 1
    assert source.nearest_feasible({}, {c.hash for c in feasible}) is None
