"""Search spaces: named constraints prune, configs are canonical, out-of-space configs are refused by name."""
from __future__ import annotations

import pytest

from autotile.device import DeviceInfo, interpret_device
from autotile.errors import ConfigOutsideSpaceError
from autotile.families.gemm import FAMILY, contiguous_problem
from autotile.space import Axis, AxisKind, Config, Constraint, Space

SMALL_SMEM = DeviceInfo("other:small", "small GPU", (8, 0), 10, 1, 64 * 1024, "test")


def test_config_is_canonical_and_hashable():
    a = Config({"b": 1, "a": True})
    b = Config(a=True, b=1)
    assert a == b and hash(a) == hash(b) and a.hash == b.hash
    assert a.to_json() == '{"a":true,"b":1}'
    assert Config.from_json(a.to_json()) == a


def test_constraint_names_the_rule_it_breaks():
    space = Space([Axis("BLOCK", (16, 32, 64)), Axis("num_warps", (4, 8), AxisKind.META)],
                  [Constraint("fits", lambda c: c["BLOCK"] <= 32, lambda c: f"BLOCK {c['BLOCK']} > 32")])
    assert len(list(space.feasible())) == 4
    with pytest.raises(ConfigOutsideSpaceError, match="fits: BLOCK 64 > 32"):
        space.validate({"BLOCK": 64, "num_warps": 4})
    with pytest.raises(ConfigOutsideSpaceError, match="unknown axes"):
        space.validate({"BLOCK": 16, "num_warps": 4, "EXTRA": 1})
    with pytest.raises(ConfigOutsideSpaceError, match="is not one of"):
        space.validate({"BLOCK": 17, "num_warps": 4})
    with pytest.raises(ConfigOutsideSpaceError, match="missing axes"):
        space.validate({"BLOCK": 16})


def test_an_upgrade_maps_configs_of_an_earlier_space_onto_this_one():
    # A config stored before the LOADS axis existed names the pointer-load kernel: validate fills that in, and
    # the upgraded config is still checked against every constraint.
    def upgrade(config):
        return config if "LOADS" in config else {**dict(config), "LOADS": "pointer"}

    space = Space([Axis("LOADS", ("pointer", "tma"), AxisKind.RENDER), Axis("BLOCK", (16, 32, 64))],
                  [Constraint("fits", lambda c: c["BLOCK"] <= 32, "BLOCK > 32")], upgrade=upgrade)
    assert space.validate({"BLOCK": 16}) == Config(LOADS="pointer", BLOCK=16)
    assert space.validate({"BLOCK": 16, "LOADS": "tma"}) == Config(LOADS="tma", BLOCK=16)
    assert space.violations({"BLOCK": 64}) == ["fits: BLOCK > 32"]
    assert space.admit({"BLOCK": 16}) == Config(LOADS="pointer", BLOCK=16) and space.admit({"BLOCK": 64}) is None
    assert not Space([Axis("LOADS", ("pointer",)), Axis("BLOCK", (16,))]).is_feasible({"BLOCK": 16})


def test_shared_memory_constraint_follows_the_device():
    problem = contiguous_problem(4096, 4096, 4096, "bf16", "bf16")
    big = dict(VARIANT="blocked", BLOCK_M=256, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, SPLIT_K=1, PERSISTENT=False,
               WARP_SPECIALIZE=False, FLATTEN=False, num_warps=8, num_stages=3)
    # (256 + 128) * 128 * 2 B * 3 stages = 288 KiB: beyond any GPU's per-block limit
    assert any(v.startswith("shared_memory") for v in FAMILY.space(problem, interpret_device()).violations(big))
    fits_hopper = dict(big, BLOCK_M=128, num_stages=3)  # 192 KiB
    assert FAMILY.space(problem, interpret_device()).is_feasible(fits_hopper)
    assert not FAMILY.space(problem, SMALL_SMEM).is_feasible(fits_hopper)
    for config in FAMILY.space(problem, SMALL_SMEM).feasible():
        assert (config["BLOCK_M"] + config["BLOCK_N"]) * config["BLOCK_K"] * 2 * config["num_stages"] <= 64 * 1024


def test_tma_needs_aligned_operands_and_tiles_stay_within_the_problem():
    odd = contiguous_problem(1000, 3000, 777, "bf16", "bf16")
    assert not odd.aligned
    configs = list(FAMILY.space(odd, interpret_device()).feasible())
    assert configs and all(c["VARIANT"] == "blocked" for c in configs)
    tiny = contiguous_problem(1, 1, 1, "fp32", "fp32")
    for config in FAMILY.space(tiny, interpret_device()).feasible():
        assert config["BLOCK_M"] == 16 and config["BLOCK_N"] == 32 and config["BLOCK_K"] == 32


def test_default_and_seed_configs_are_in_the_space():
    for problem in [contiguous_problem(1, 1, 1, "fp32", "fp32"), contiguous_problem(16, 8192, 8192),
                    contiguous_problem(8192, 8192, 8192, "fp8", "bf16", layout_b="col"),
                    contiguous_problem(67, 45, 129, "fp16", "fp16", layout_a="strided")]:
        space = FAMILY.space(problem, interpret_device())
        assert space.is_feasible(FAMILY.default_config(problem, interpret_device()))
        for config in FAMILY.seed_configs(problem, interpret_device()):
            assert space.is_feasible(config)


def test_staged_enumeration_equals_filtering_the_grid():
    import random

    from autotile.families.gemm_space import StagedSpace, rule

    rng = random.Random(3)
    axes = [Axis("A", (1, 2, 3, 4)), Axis("B", (True, False)), Axis("C", ("x", "y", "z")), Axis("D", (8, 16, 32))]
    for _ in range(20):
        limit, pick, cap = rng.randint(2, 6), rng.choice("xyz"), rng.choice((8, 16, 32))
        rules = [rule("a_b", ("A", "B"), lambda c, limit=limit: c["A"] + int(c["B"]) <= limit, "A + B"),
                 rule("c_d", ("C", "D"), lambda c, pick=pick, cap=cap: c["C"] != pick or c["D"] < cap, "C, D"),
                 rule("a_d", ("D", "A"), lambda c: c["A"] * c["D"] <= 64, "A * D")]
        staged = StagedSpace(axes, rules)
        plain = Space(axes, [r.constraint for r in rules])
        assert list(staged.feasible()) == list(plain.feasible())


def test_configs_stored_before_the_schedule_axes_still_validate():
    # Winners stored before SCHEDULE, SWAP_AB and PROMOTE_TILES existed name the same kernels today.
    legacy = dict(VARIANT="blocked", BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, SPLIT_K=2, PERSISTENT=False,
                  WARP_SPECIALIZE=False, FLATTEN=False, num_warps=4, num_stages=3)
    problem = contiguous_problem(128, 4096, 4096, "bf16", "bf16")
    config = FAMILY.space(problem, interpret_device()).validate(legacy)
    assert config["SCHEDULE"] == "split_k" and config["SWAP_AB"] is False
    fp8 = contiguous_problem(4096, 4096, 4096, "fp8", "bf16", layout_b="col")
    legacy_fp8 = dict(legacy, VARIANT="tma", BLOCK_M=128, BLOCK_K=128, SPLIT_K=1, PERSISTENT=True, num_warps=8, num_stages=4)
    config = FAMILY.space(fp8, interpret_device()).validate(legacy_fp8)
    assert config["SCHEDULE"] == "data_parallel" and config["PROMOTE_TILES"] == 1  # promoted every K tile, as then
    with pytest.raises(ConfigOutsideSpaceError, match="missing axes"):
        FAMILY.space(problem, interpret_device()).validate({k: v for k, v in legacy.items() if k != "GROUP_M"})
