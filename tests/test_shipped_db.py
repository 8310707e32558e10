"""The shipped tuning database and its sorted text dump agree, and every shipped config is in its space."""
from __future__ import annotations

import json

import pytest

from autotile.device import DeviceInfo, HOPPER_SMEM_PER_BLOCK
from autotile.families import flash_vendor, get_family
from autotile.families.base import VENDOR_KEY
from autotile.resources import shipped_db_path, shipped_dump_path
from autotile.store.db import open_engine, read_only_url
from autotile.store.ship import dump_winners

pytestmark = pytest.mark.skipif(not shipped_db_path().exists(), reason="no shipped winners yet")


def test_dump_matches_database():
    engine = open_engine(read_only_url(shipped_db_path()), create=False)
    assert shipped_dump_path().read_text() == dump_winners(engine), \
        "tuning_db/winners.txt is stale: run python benchmarks/ship_winners.py (no arguments) to rewrite it"


def test_shipped_configs_are_valid_for_their_problems():
    h200 = DeviceInfo("h200", "NVIDIA H200", (9, 0), 132, 150_000_000_000, HOPPER_SMEM_PER_BLOCK, "test")
    for line in shipped_dump_path().read_text().splitlines():
        record = json.loads(line)
        if "policy" in record:  # a tuned policy: its config serves the lowest corner of its range too
            family = get_family(record["policy"])
            corner = {name: bounds[0] for name, bounds in record["verified_range"].items()}
            problem = family.problem_from_dict({**record["fixed"], **corner})
            assert family.in_range(problem, problem, record["verified_range"])
        else:
            family = get_family(record["family"])
            problem = family.problem_from_dict(record["problem"])
        config = record["config"]
        if family.name == "flash" and VENDOR_KEY in config:
            # Whether an SDPA backend runs is torch's call on the GPU (flash_vendor._torch_allows probes CUDA); on
            # this machine: that the backend computes the problem as the family defines it.
            assert flash_vendor.expresses(config[VENDOR_KEY], problem), record
        else:
            family.validate_config(problem, h200, config)
        if "kernel_config" in record:
            family.space(problem, h200).validate(record["kernel_config"])
