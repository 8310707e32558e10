"""benchmarks/drop_losers.py: which shipped winners lose through the public op."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.scripts import loaded_script

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "drop_losers.py"


@pytest.fixture(scope="module")
def drop():
    yield from loaded_script(SCRIPT, "drop_losers_script")


def _row(ratio, served="shipped-db/exact", tuned_for="K4", retimed=None, **extra):
    row = {"model": "m", "proj": "kv", "m": 4, "ratio": ratio, "served": served, "tuned_for": tuned_for,
           "device": "h200/sm90", **extra}
    if retimed is not None:
        row["diagnosis"] = {"retimed": retimed}  # (ours ms, vendor ms)
    return row


def test_a_winner_slow_in_both_timings_is_dropped(drop):
    lost = drop.losers([_row(0.93, retimed=(0.0100, 0.0095))], 0.97)
    assert list(lost) == [("h200/sm90", "K4")]


def test_a_second_timing_at_par_keeps_the_winner(drop):
    # Noise on a 10-us call: 0.94x, then 1.02x on the second timing.
    assert drop.losers([_row(0.94, retimed=(0.0100, 0.0102))], 0.97) == {}


def test_rows_the_winner_did_not_serve_are_ignored(drop):
    rows = [_row(0.90, served="cuBLAS (torch.matmul)", tuned_for=None), _row(0.90, served="user-db/exact"),
            {"model": "m", "proj": "kv", "m": 4, "error": "RuntimeError: boom"}, _row(1.05)]
    assert drop.losers(rows, 0.97) == {}


def test_rows_of_one_winner_are_grouped(drop):
    lost = drop.losers([_row(0.95, tuned_for="K16"), _row(0.96, tuned_for="K16"), _row(0.99, tuned_for="K16")],
                       0.97)
    assert [len(rows) for rows in lost.values()] == [2]


def test_a_file_that_is_not_a_serve_run_is_refused_clearly(drop, tmp_path, monkeypatch):
    bad = tmp_path / "table.md"
    bad.write_text("| not | json |")
    monkeypatch.setattr("sys.argv", ["drop_losers.py", str(bad), "--dry-run"])
    with pytest.raises(SystemExit, match="not the JSON serve_bench.py writes"):
        drop.main()


@pytest.fixture(scope="module")
def stream():
    yield from loaded_script(SCRIPT.parent / "decode_stream_bench.py", "decode_stream_bench_script")


def _stream_row(served_us, retimed_us=None):
    row = {"label": "llama3-8b qkv", "m": 16, "n": 6144, "k": 4096, "weights": 11, "errors": [], "cuBLAS_us": 15.3,
           "served_us": served_us, "generated_us": served_us, "weight_bytes": 6144 * 4096 * 2,
           "served_by": "shipped-db/exact blocked 16x128x128", "served_tuned_for": "K16", "device": "h200/sm90",
           "generated_by": "shipped-db/exact blocked 16x128x128"}
    return row if retimed_us is None else {**row, "retimed_us": retimed_us}


def test_decode_stream_rows_feed_drop_losers(drop, stream):
    """decode_stream_bench.py writes its rows as serve_bench.py's JSON: a winner slow in both of its streamed timings
    is dropped; one at par the second time is kept."""
    lost = drop.losers([stream.serve_row(_stream_row(17.3, retimed_us=(17.0, 15.2)))], 0.97)
    assert list(lost) == [("h200/sm90", "K16")] and lost[("h200/sm90", "K16")][0]["proj"] == "qkv"
    assert drop.losers([stream.serve_row(_stream_row(17.3, retimed_us=(15.0, 15.2)))], 0.97) == {}
    assert drop.losers([stream.serve_row(_stream_row(14.0))], 0.97) == {}
    assert "(again 0.894x)" in stream.markdown([_stream_row(17.3, retimed_us=(17.0, 15.2))], 4.2, "# h")


@pytest.fixture(scope="module")
def candidates_script():
    yield from loaded_script(SCRIPT.parent / "decode_stream_candidates.py", "decode_stream_candidates_script")


def test_decode_stream_candidates_are_points_of_the_space(candidates_script):
    """The candidates the few-token policy was set from: the default first, every one feasible, whole tiles and
    splits both among them, with every token in one tile."""
    from autotile.families.gemm import FAMILY, contiguous_problem

    h200 = candidates_script.gkb.H200_PLAN
    for m, n, k in ((1, 4096, 4096), (64, 1024, 4096)):
        problem = contiguous_problem(m, n, k, "bf16", "bf16", layout_b="col")
        found = candidates_script.candidates(problem, h200)
        configs = list(found)
        assert found[configs[0]] == "default" and configs[0] == FAMILY.default_config(problem, h200)
        space = FAMILY.space(problem, h200)
        assert all(space.is_feasible(c) for c in configs)
        assert {c["SCHEDULE"] for c in configs} >= {"data_parallel", "split_k", "stream_k"}
        assert any(origin == "tile" and c["BLOCK_M"] >= m for c, origin in found.items())


def test_token_tiles_only_when_asked(candidates_script):
    """--token-tiles adds swapped tiles of fewer tokens than M above 64 tokens, which the space admits for narrow
    weights only (gemm_space.token_tiles_fit); the rest of the list stays the space's."""
    from autotile.families.gemm import FAMILY, contiguous_problem

    h200 = candidates_script.gkb.H200_PLAN
    problem = contiguous_problem(192, 4096, 4096, "bf16", "bf16", layout_b="col")
    plain = candidates_script.candidates(problem, h200)
    found = candidates_script.candidates(problem, h200, token_tiles=True)
    extra = [c for c, origin in found.items() if origin == "token tile"]
    assert "token tile" not in plain.values() and len(extra) == len(found) - len(plain)
    assert extra and all(c["SWAP_AB"] and c["BLOCK_M"] < problem.m for c in extra)
    space = FAMILY.space(problem, h200)
    assert all(space.is_feasible(c) for c in plain) and not any(space.is_feasible(c) for c in extra)
    few = contiguous_problem(64, 512, 3584, "bf16", "bf16", layout_b="col")
    assert "token tile" not in candidates_script.candidates(few, h200, token_tiles=True).values()


def test_gluon_swap_candidates_split_two_part_tiles_only_behind_their_switch(candidates_script, monkeypatch):
    """--gluon-swap: swapped Gluon tiles, each admitted by the space; where the tiles are fewer than the SMs they split
    2 and 3 ways and in as many parts as fill one wave; two-part token tiles split only with
    gemm_space.GLUON_TWO_PART_SPLIT on (the default)."""
    from autotile.families import gemm_space
    from autotile.families.gemm import FAMILY, contiguous_problem
    from autotile.families.gemm_space import GLUON_TWO_PART

    h200 = candidates_script.gkb.H200_PLAN
    problem = contiguous_problem(144, 2560, 10240, "bf16", "bf16", layout_b="col")  # 20 tiles of 144 x 128

    def swapped():
        found = candidates_script.candidates(problem, h200, gluon_swap=True)
        return [c for c, origin in found.items() if origin == "gluon swap"]

    monkeypatch.setattr(gemm_space, "GLUON_TWO_PART_SPLIT", False)
    off = swapped()
    assert off and all(c["SWAP_AB"] and FAMILY.space(problem, h200).is_feasible(c) for c in off)
    assert not [c for c in off if c["BLOCK_M"] in GLUON_TWO_PART and c["SPLIT_K"] > 1]
    monkeypatch.setattr(gemm_space, "GLUON_TWO_PART_SPLIT", True)
    splits = {c["SPLIT_K"] for c in swapped() if c["BLOCK_M"] == 144 and c["BLOCK_N"] == 128}
    assert splits == {1, 2, 3, h200.sm_count // 20}
