"""benchmarks/policy_rule_ab.py: which rows it compares a rule on, how it turns the rule off, and its verdict."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from autotile.device import planned_device
from autotile.families import gemm_policy
from tests.scripts import loaded_script

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "policy_rule_ab.py"
H200 = planned_device("h200")


@pytest.fixture(scope="module")
def bench():
    yield from loaded_script(SCRIPT, "policy_rule_ab_script")


def test_changed_rows_are_where_the_rule_applies_and_the_rule_comes_back(bench):
    kept = gemm_policy._prefill_narrow_wide
    rows = bench.changed_rows("_prefill_narrow_wide", H200, ["qwen2.5-3b"], tokens=(256, 640, 1024, 2816, 4096))
    assert gemm_policy._prefill_narrow_wide is kept
    found = {(p.m, p.n, p.k) for p, _, _ in rows}
    # 640 tokens on N = 2048 (11 x 11 tiles of 64 x 192 in one wave), not N = 2560 (PREFILL_NARROW_WIDE_MAX_N), not
    # 1024 x 2048 (past one wave), not mid-sized M (its own rules).
    assert {(640, 2048, 2048), (640, 2048, 11008)} <= found
    assert all(n <= gemm_policy.PREFILL_NARROW_WIDE_MAX_N and m > gemm_policy.MID_MAX_M for m, n, _ in found)
    for problem, with_rule, without in rows:
        assert (with_rule["BLOCK_M"], with_rule["BLOCK_N"]) == (64, 192)
        assert all(with_rule[key] == value for key, value in gemm_policy._prefill_narrow_wide(problem, H200).items())
        assert (without["BLOCK_M"], without["BLOCK_N"]) != (64, 192)


def test_rule_off_names_the_known_rules_and_restores_after_an_error(bench):
    with pytest.raises(ValueError, match="_wide_one_wave"):
        with bench.rule_off("prefill_config"):
            pass
    kept = gemm_policy.token_tile_config
    with pytest.raises(RuntimeError):
        with bench.rule_off("token_tile_config"):
            assert gemm_policy.token_tile_config(None, H200) is None
            raise RuntimeError
    assert gemm_policy.token_tile_config is kept
    assert all(callable(getattr(gemm_policy, rule)) for rule in bench.RULES)


def test_drawn_rows_cap_each_weight_and_follow_the_seed(bench):
    rows = bench.changed_rows("_wide_one_wave", H200, ["llama3-8b", "qwen2.5-7b"], tokens=range(129, 200, 2))
    assert rows
    weights = {(p.n, p.k) for p, _, _ in rows}
    first = bench.drawn(rows, 2, seed=0)
    assert first == bench.drawn(rows, 2, seed=0)
    assert len(first) == sum(min(2, sum((p.n, p.k) == w for p, _, _ in rows)) for w in weights)
    for weight in weights:
        tokens = [p.m for p, _, _ in first if (p.n, p.k) == weight]
        assert tokens == sorted(tokens)
    assert any(bench.drawn(rows, 2, seed=seed) != first for seed in range(1, 5))


def test_verdict_pairs_the_default_with_the_rule_off(bench):
    timed = [{"cuBLAS_us": 10.0, "us": {"a [default]": 10.0, "b": 12.5}},
             {"cuBLAS_us": 10.0, "us": {"a [default]": 12.5, "b": 10.0}},
             {"cuBLAS_us": 10.0, "us": {"a [default]": 8.0}}]  # the other failed its check: not a pair
    text = bench.verdict(timed)
    assert text.startswith("2 rows: 0.894x of cuBLAS without the rule -> 0.894x with it")
    assert "ahead on 1" in text and "worst pair 0.800x" in text
    assert bench.verdict([]) == "no row timed both configs"


def test_time_plans_compiles_ahead_then_times_each_plan_and_writes_the_meta(bench, monkeypatch, tmp_path):
    """decode_stream_candidates.time_plans, which both scripts time their plans through (GPU parts stubbed)."""
    import json
    import time

    import torch

    streams = sys.modules["decode_stream_candidates"]
    compiled, timed = [], []
    monkeypatch.setattr(streams.gkb, "compile_ahead", lambda pairs, workers: compiled.extend(pairs))
    monkeypatch.setattr(streams, "time_shape", lambda problem, configs, rounds, gen, failures: timed.append(
        (problem, rounds)) or {"m": problem, "n": 1, "k": 1, "cuBLAS_us": 1.0, "us": {"x [default]": 1.0}})
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "stub GPU")
    monkeypatch.setattr(torch, "Generator", lambda device: type("Gen", (), {"manual_seed": lambda self, s: self})())
    out = tmp_path / "ab.json"
    plans = [(1, {"a": "default", "b": "rule off"}), (2, {"c": "default"})]
    assert bench.time_plans(plans, 3, 60, out, 2, time.monotonic(), rule="r", seed=4) == 0
    assert compiled == [(1, "a"), (1, "b"), (2, "c")]
    assert timed == [(1, 3), (2, 3)]
    written = json.loads(out.read_text())
    assert (written["device"], written["rule"], written["seed"], len(written["rows"])) == ("stub GPU", "r", 4, 2)


def test_defaults_verdict_gives_each_token_count_and_the_lowest_row(bench):
    streams = sys.modules["decode_stream_candidates"]
    rows = [{"m": 40, "n": 8, "k": 8, "cuBLAS_us": 10.0, "us": {"a [default]": 8.0}},
            {"m": 40, "n": 16, "k": 8, "cuBLAS_us": 10.0, "us": {"a [default]": 12.5}},
            {"m": 100, "n": 8, "k": 8, "cuBLAS_us": 9.0, "us": {"b [default]": 10.0}},
            {"m": 100, "n": 16, "k": 8, "cuBLAS_us": 9.0, "us": {}}]  # failed its check: not counted
    assert streams.defaults_verdict(rows) == (
        "default / cuBLAS over 3 rows: 0.965x (40: 1.000x, 100: 0.900x); lowest 40x16x8 0.800x")
    assert streams.defaults_verdict([]) == "no row timed"


def test_policy_checks_ab_the_rules_this_script_knows(bench):
    import re

    text = (SCRIPT.parent / "policy_checks.sh").read_text()
    default = re.search(r"rules=\$\{\*:-([^}]*)\}", text).group(1).split()
    assert default and set(default) <= set(bench.RULES)


def test_constants_set_refit_the_policy_and_come_back(bench):
    kept = gemm_policy.NARROW_SPLIT_MAX
    rows = bench.changed_rows({"NARROW_SPLIT_MAX": 4}, H200, ["llama3-8b"], tokens=(137, 161, 193, 300))
    assert gemm_policy.NARROW_SPLIT_MAX == kept == 3
    assert rows and all(with_set["SPLIT_K"] == 4 and as_is["SPLIT_K"] == 3 for _, with_set, as_is in rows)
    with pytest.raises(ValueError, match="numeric constant"):
        with bench.constants_set({"NARROW_SPLIT_MAX": 4, "regime": 1}):
            pass
    assert gemm_policy.NARROW_SPLIT_MAX == kept
    parsed = bench.parse_constants("NARROW_SPLIT_MAX=4,MID_LONG_K=4096")
    assert parsed == {"NARROW_SPLIT_MAX": 4.0, "MID_LONG_K": 4096.0}
    import argparse

    with pytest.raises(argparse.ArgumentTypeError, match="NAME=NUMBER"):
        bench.parse_constants("NARROW_SPLIT_MAX")
    timed = [{"cuBLAS_us": 10.0, "us": {"a [default]": 10.0, "b": 12.5}}]
    assert "without the change -> 1.000x with it; the change ahead on 1" in bench.verdict(timed, "the change")
