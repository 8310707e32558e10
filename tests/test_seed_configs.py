"""Every family's default and seed configs are points of its space, on the H200 and on the interpreter."""
from __future__ import annotations

import pytest

from autotile.device import HOPPER_SMEM_PER_BLOCK, DeviceInfo, interpret_device
from autotile.families import family_names, get_family

H200 = DeviceInfo("h200", "NVIDIA H200", (9, 0), 132, 150_000_000_000, HOPPER_SMEM_PER_BLOCK, "test")


@pytest.mark.parametrize("name", family_names())
@pytest.mark.parametrize("device", [H200, interpret_device()], ids=["h200", "interpret"])
def test_default_and_seed_configs_are_feasible(name, device):
    family = get_family(name)
    problems = family.default_suite()
    assert problems, f"{name} has no default suite"
    for problem in problems:
        space = family.space(problem, device)
        default = family.default_config(problem, device)
        assert space.is_feasible(default)
        seeds = family.seed_configs(problem, device)
        assert all(space.is_feasible(c) for c in seeds)
        # Complete configs, as the space names them: a seed missing an axis is the same kernel as the complete
        # config under another name, and a search would time it twice.
        assert all(set(c) == set(space.names()) for c in [default, *seeds]), name
        assert len(set(seeds)) == len(seeds)
