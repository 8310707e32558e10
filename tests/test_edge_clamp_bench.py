"""benchmarks/edge_clamp_bench.py: which configs it times clamped beside unclamped, and its switches."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from autotile.device import interpret_device, planned_device
from autotile.families import gemm_space
from autotile.families.gemm import FAMILY, contiguous_problem
from tests.scripts import loaded_script

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "edge_clamp_bench.py"
H200 = planned_device("h200")


@pytest.fixture(scope="module")
def bench():
    yield from loaded_script(SCRIPT, "edge_clamp_bench_script")


@pytest.mark.parametrize("row", [(176, 4096, 4096), (392, 28672, 4096), (3000, 5000, 1536)])
def test_every_row_times_the_default_first_then_admitted_tiles_each_clamped_on_some_edge(bench, row):
    problem = contiguous_problem(*row, "bf16", "bf16", layout_b="col")
    configs = bench.configs_for(problem, H200)
    assert configs[0] == ("default " + bench.gkb.short(configs[0][1]), FAMILY.default_config(problem, H200))
    space = FAMILY.space(problem, H200)
    assert all(space.is_feasible(config) for _, config in configs)
    tiles = configs[1:]
    swapped = problem.m <= gemm_space.GLUON_SWAP_MAX_M  # swapped Gluon tiles only up to it
    assert len(tiles) == len(bench.EDGE_TILES) + (len(bench.SWAPPED_TILES) if swapped else 0)
    assert all(gemm_space.clamps_col_tiles(config) for _, config in tiles)
    assert {config["SWAP_AB"] for _, config in tiles} == ({False, True} if swapped else {False})


def test_set_clamps_turns_the_chosen_edges_on_and_drops_the_plans(bench, monkeypatch):
    from autotile.families.gemm_launch import launch_plan

    monkeypatch.setattr(gemm_space, "CLAMP_ROW_TILES", True)
    monkeypatch.setattr(gemm_space, "CLAMP_COL_TILES", True)
    problem = contiguous_problem(64, 64, 64, "fp32", "fp32")
    launch_plan(FAMILY, problem, FAMILY.default_config(problem, interpret_device()), torch.device("cpu"))
    assert launch_plan.cache_info().currsize > 0
    bench.set_clamps("rows", True)
    assert (gemm_space.CLAMP_ROW_TILES, gemm_space.CLAMP_COL_TILES) == (True, False)
    assert launch_plan.cache_info().currsize == 0
    bench.set_clamps("both", False)
    assert (gemm_space.CLAMP_ROW_TILES, gemm_space.CLAMP_COL_TILES) == (False, False)
    bench.set_clamps("both", True)
    assert (gemm_space.CLAMP_ROW_TILES, gemm_space.CLAMP_COL_TILES) == (True, True)


def test_rows_are_written_after_each_and_the_budget_stops_the_rest(bench, tmp_path, capsys):
    """decode_stream_candidates.time_rows, which both scripts time their rows through."""
    import json
    import time

    out = tmp_path / "rows.json"
    seen = []

    def time_one(item, failures):
        seen.append(item)
        if item == 2:
            failures.append("2: wrong")
        return {"item": item}

    started = time.monotonic()
    assert bench.time_rows([1, 2, 3], time_one, lambda row: f"row {row['item']}", 60, out, started, edges="rows") == 1
    written = json.loads(out.read_text())
    assert written == {"edges": "rows", "rows": [{"item": 1}, {"item": 2}, {"item": 3}], "failures": ["2: wrong"]}
    assert "row 3" in capsys.readouterr().out
    # The budget spent before the first row: nothing timed, nothing written over the file, the stop reported.
    assert bench.time_rows([1, 2], time_one, str, 60, out, started - 120) == 1
    assert seen == [1, 2, 3] and json.loads(out.read_text()) == written
    assert "FAILED budget of 60 s spent: 2 rows not timed" in capsys.readouterr().out
    assert bench.time_rows([1], time_one, str, 60, out, time.monotonic()) == 0
    assert json.loads(out.read_text()) == {"rows": [{"item": 1}], "failures": []}
