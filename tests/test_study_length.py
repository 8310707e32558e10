"""benchmarks/study_length.py: the sampled problems and the shipped winners they key, the verdict and the report,
and the script end to end in its smoke mode (the CPU interpreter, a tiny problem, 2- and 4-trial studies)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from scripts import loaded_script

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "study_length.py"


@pytest.fixture(scope="module")
def sl():
    yield from loaded_script(SCRIPT, "study_length")


def test_the_samples_are_the_model_paths_problems_and_the_shipped_tables_hold_them(sl):
    from autotile.families.gemm import FAMILY
    from autotile.models import model_dims
    from autotile.resources import shipped_db_path
    from autotile.store.db import read_only_url

    samples = sl.sample_problems(model_dims(sl.MODEL), sl.SAMPLES, "bf16")
    shapes = {label: (item.problem.m, item.problem.n, item.problem.k) for label, item in samples}
    assert shapes == {"q_proj": (1, 4096, 4096), "k/v_proj": (4, 1024, 4096), "gate_up": (16, 28672, 4096),
                      "o_proj": (64, 4096, 4096), "down_proj": (256, 4096, 14336)}
    # Tuned in the CLI's order (fewest FLOPs first), as nn.Linear weights (B column-major), bf16 in and out.
    flops = [FAMILY.cost(item.problem).flops for _, item in samples]
    assert flops == sorted(flops)
    for _, item in samples:
        p = item.problem
        assert (p.layout_a, p.layout_b, p.dtype, p.out_dtype, p.bias) == ("row", "col", "bf16", "bf16", False)
    # Each key is one the whole-model run stored: the shipped database has a winner for it on the H200.
    url = read_only_url(shipped_db_path())
    for label, item in samples:
        winner = sl.shipped_winner(url, FAMILY, item.problem, "h200/sm90")
        assert winner is not None, label
        assert winner["trials"] >= 1 and winner["winner_ms"] > 0 and winner["config"]
    assert sl.shipped_winner(url, FAMILY, samples[0][1].problem, "interpret") is None
    with pytest.raises(ValueError, match="no projection"):
        sl.sample_problems(model_dims(sl.MODEL), (("x", 1, "lm_head"),), "bf16")


def test_judge_and_config_summary(sl):
    assert sl.judge(1.02, 1.0) == (pytest.approx(1.02), "yes")
    assert sl.judge(0.9, 1.0)[1] == "yes"  # a short winner faster than the long one is within too
    assert sl.judge(1.05, 1.0, same_config=True)[1] == "same config"  # the same winner: the ratio is noise
    assert sl.judge(1.021, 1.0)[1] == "no"
    assert sl.judge(1.0, None) == (None, "n/a") and sl.judge(None, 1.0) == (None, "n/a")
    config = {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "SCHEDULE": "data_parallel", "SPLIT_K": 1,
              "VARIANT": "tma", "PERSISTENT": True, "WARP_SPECIALIZE": False, "SWAP_AB": False, "GROUP_M": 8,
              "num_warps": 8, "num_stages": 3}
    assert sl.config_summary(config) == "64x128x64, tma, persistent, group 8, w8 s3"


def _row(sl, label, short_ms, long_ms, short_check="ok"):
    checks = {name: {"ok": True, "status": "ok", "message": "c: ok"} for name in ("short", "long", "F.linear")}
    if short_check != "ok":
        checks["short"] = {"ok": False, "status": short_check, "message": "c: 3 of 40 outside"}
    ms = {"long": long_ms, "F.linear": 0.0201, "torch.matmul": 0.0200}
    if short_check == "ok":
        ms["short"] = short_ms
    ratio, within = sl.judge(ms.get("short"), long_ms)
    config = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "SCHEDULE": "split_k", "SPLIT_K": 4, "SWAP_AB": True,
              "num_warps": 4, "num_stages": 5}
    return {"label": label, "shape": "1x4096x4096", "problem_key": "{}", "ratio": ratio, "within": within,
            "short": {"config": config, "winner_ms": 0.017, "baseline_name": "cuBLAS", "baseline_ms": 0.019,
                      "trials": 6},
            "long": {"config": {"VENDOR": "cublas"}, "winner_ms": 0.0169, "trials": 50, "seconds": 31.0,
                     "stopped_early": "", "cut": label == "cut"},
            "timing": {"checks": checks, "ms": ms}, "same_config": False}


def test_markdown_table_verdict_and_notes(sl):
    rows = [_row(sl, "q_proj", 0.0171, 0.0170), _row(sl, "slow", 0.0180, 0.0170),
            _row(sl, "cut", 0.0, 0.0170, short_check="wrong_result")]
    meta = {"date": "2026-12-02", "device": "NVIDIA H200", "model": "llama3-8b", "dtype": "bf16", "rounds": 5,
            "rerun_short": False, "shipped_toolchain": "torch 2.11.0+cu130, triton 3.6.0, cuda 13.0",
            "short_trials": 10, "short_patience": 4, "long_trials": 50, "long_patience": 20,
            "long_run": {"seconds": 150.0, "budget_s": 270.0, "failed": {"{\"m\":64}": "RuntimeError: boom"}}}
    text = sl.markdown(rows, meta)
    lines = {line.split(" | ")[0]: line for line in text.splitlines() if line.startswith("| ")}
    assert lines["| q_proj"].endswith("| 17.10 | 17.00 | 20.10 | 20.00 | 1.006 | yes |")
    assert "| 16x64x128 split-K 4, swap AB, w4 s5 | vendor (cublas) |" in lines["| q_proj"]
    assert lines["| slow"].endswith("| 1.059 | no |")
    # A winner that fails its check is never timed or judged.
    assert "| WRONG |" in lines["| cut"] and lines["| cut"].endswith("| - | n/a |")
    assert "**Within 2% on 1 of 2 problems** (3 sampled" in text
    assert "the shipped tuning_db/ winner (torch 2.11.0+cu130" in text
    assert "150.0 s for 3 problem(s)" in text and "failed: {\"m\":64}: RuntimeError: boom" in text
    assert "CUT by its share of the budget" in text and "not timed: short: wrong_result" in text


def test_smoke_run_end_to_end(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))}
    env.pop("TRITON_INTERPRET", None)  # the script sets it itself under --smoke
    out = tmp_path / "report"
    run = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--out", str(out)], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    data = json.loads((out / "study_length.json").read_text())
    assert (out / "study_length.md").read_text() in run.stdout
    (row,) = data["rows"]
    assert row["label"] == "down_proj" and row["shape"] == "20x40x24"
    # Both studies ran to their trial counts in fresh databases, and each stored a generated winner.
    assert row["short"]["trials"] == 2 and row["long"]["trials"] == 4
    assert "VENDOR" not in row["short"]["config"] and "VENDOR" not in row["long"]["config"]
    assert data["meta"]["long_run"]["trials"] == 4 and data["meta"]["short_run"]["trials"] == 2
    # Every callable passed its check and was timed; the verdict follows from the two times.
    timing = row["timing"]
    assert all(c["ok"] for c in timing["checks"].values()), timing["checks"]
    assert set(timing["ms"]) == {"short", "long", "F.linear", "torch.matmul"}
    assert row["ratio"] == pytest.approx(timing["ms"]["short"] / timing["ms"]["long"])
    if row["same_config"]:
        assert row["within"] == "same config"  # one winner timed twice: no difference between the studies
    else:
        assert row["within"] == ("yes" if row["ratio"] <= 1.02 else "no")
    assert "| down_proj | 20x40x24 |" in run.stdout
