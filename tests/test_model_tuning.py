"""Tuning what a model runs: the model table, traces, `tune --from-trace` and `tune gemm --model`."""
from __future__ import annotations

import json
import subprocess
import sys

import click
import pytest
import torch
from click.testing import CliRunner

import autotile
from autotile.cli.main import cli
from autotile.errors import BadInputError
from autotile.models import MODELS, TOKEN_BUCKETS, model_dims, parse_tokens, projections
from autotile.runtime.trace import TraceEntry
from autotile.store.db import open_engine
from autotile.store.repo import Store
from autotile.tune.plan import MIN_PROBLEM_S, PlannedProblem, parse_budget, plan_from_trace, tune_planned

TINY_DIMS = "hidden=32,intermediate=48,heads=2,kv_heads=1,head_dim=16"


def test_model_table_describes_the_layers_of_known_models():
    llama = model_dims("Llama3-8B")
    # q and o are both 4096 x 4096 in Llama-3-8B: one problem
    assert {(p.n, p.k) for p in projections(llama)} == {(6144, 4096), (4096, 4096), (1024, 4096), (28672, 4096),
                                                        (14336, 4096), (4096, 14336)}
    qwen = {(p.name, p.n, p.k, p.bias) for p in projections(MODELS["qwen2.5-7b"])}
    assert ("qkv", 4608, 3584, True) in qwen and ("down", 3584, 18944, False) in qwen
    gemma = {p.name: (p.n, p.k) for p in projections(MODELS["gemma2-9b"])}
    assert gemma["q"] == (4096, 3584) and gemma["o"] == (3584, 4096)  # 16 heads of 256 exceed the hidden size
    custom = model_dims(None, "hidden=64,intermediate=96,heads=4")
    assert (custom.kv_heads, custom.head_dim) == (4, 16)


@pytest.mark.parametrize("name, dims, message", [
    ("gpt-17", None, "unknown model"), (None, "hidden=64", "needs heads, intermediate"),
    (None, "hidden=64,intermediate=x,heads=2", "NAME=INTEGER"), (None, "hidden=64,intermediate=96,heads=3,kv_heads=2",
                                                                 "multiple of kv_heads"),
])
def test_bad_model_descriptions_are_refused_clearly(name, dims, message):
    with pytest.raises(BadInputError, match=message):
        model_dims(name, dims)


def test_tokens_and_budgets_parse_or_say_why_not():
    assert parse_tokens(None) == TOKEN_BUCKETS and parse_tokens("1, 16,16,128") == (1, 16, 128)
    with pytest.raises(BadInputError):
        parse_tokens("1,x")
    assert parse_budget("2m30s") == 150.0
    for bad in ("soon", "0", "-5m", ""):
        with pytest.raises(BadInputError):
            parse_budget(bad)


def _entry(m: int, calls: int, n: int = 32, k: int = 32) -> TraceEntry:
    return TraceEntry("gemm", "interpret", {"m": m, "n": n, "k": k, "dtype": "fp32", "out_dtype": "fp32",
                                            "layout_a": "row", "layout_b": "col", "bias": False,
                                            "activation": "none", "tf32": False, "aligned": True}, calls)


def test_a_trace_plan_merges_one_bucket_and_puts_most_calls_first():
    entries = [_entry(3, 5), _entry(4, 7), _entry(100, 2), _entry(4, 50, n=64),
               TraceEntry("nope", "interpret", {}, 1000)]
    planned, notes = plan_from_trace(entries)
    assert [(p.problem.m, p.problem.n, p.calls, p.covers) for p in planned] == [(4, 64, 50, 1), (4, 32, 12, 2),
                                                                                (100, 32, 2, 1)]
    assert any("unknown family" in n for n in notes)


def test_a_trace_problem_of_the_wrong_types_is_skipped_with_a_note_not_tuned():
    for field, value in (("m", 5.0), ("bias", 1), ("dtype", "float99"), ("n", -3.5)):
        bad = _entry(4, 9)
        bad.problem[field] = value
        planned, notes = plan_from_trace([bad, _entry(8, 3)])
        assert [p.problem.m for p in planned] == [8], field
        assert len(notes) == 1 and "does not rebuild" in notes[0], (field, notes)


def test_the_shards_of_a_plan_hold_every_problem_once_and_share_the_most_called():
    from autotile.errors import BadInputError
    from autotile.families.gemm import contiguous_problem
    from autotile.tune.plan import parse_shard, shard_of

    planned = [PlannedProblem(autotile_family(), contiguous_problem(m, 32, 32), 100 - m) for m in range(1, 8)]
    first, second = shard_of(planned, 1, 2), shard_of(planned, 2, 2)
    assert [p.problem.m for p in first] == [1, 3, 5, 7] and [p.problem.m for p in second] == [2, 4, 6]
    assert shard_of(planned, 3, 3) == [planned[2], planned[5]] and shard_of(planned, 1, 1) == planned
    assert parse_shard(" 2 / 3 ") == (2, 3)
    for bad in ("0/2", "3/2", "1", "a/b", "1/0"):
        with pytest.raises(BadInputError, match="--shard"):
            parse_shard(bad)


def test_the_budget_is_shared_and_what_it_misses_is_reported():
    from autotile.families.gemm import contiguous_problem

    planned = [PlannedProblem(autotile_family(), contiguous_problem(m, 32, 32), c) for m, c in ((1, 9), (2, 8), (3, 7))]
    seen = []

    def fake_tune(family, problem, device, *, trials, timeout, db_url, seed):
        seen.append(timeout)
        import time

        time.sleep(0.3)
        return problem

    outcome = tune_planned(planned, None, budget_s=30.0, db_url=None, tune=fake_tune)
    assert len(outcome.tuned) == 3 and seen[0] == pytest.approx(30.0 / 3, rel=0.05)
    # A budget below a problem's minimum each tunes the first (most called) problems at that minimum, in order,
    # and reports the rest: 8.5 s hold two starts of 8 s (each fake search takes 0.3 s), not three.
    seen.clear()
    outcome = tune_planned(planned, None, budget_s=MIN_PROBLEM_S + 0.5, db_url=None, tune=fake_tune)
    assert [p.m for p in outcome.tuned] == [1, 2] and [p.problem.m for p in outcome.skipped] == [3]
    assert seen[0] == pytest.approx(MIN_PROBLEM_S)
    outcome = tune_planned(planned, None, budget_s=MIN_PROBLEM_S - 1, db_url=None, tune=fake_tune)
    assert not outcome.tuned and len(outcome.skipped) == 3
    # A model's table counts no calls: its lines do not say "0 calls".
    lines = []
    tune_planned([PlannedProblem(autotile_family(), contiguous_problem(4, 32, 32), 0), planned[0]], None,
                 budget_s=None, db_url=None, tune=fake_tune, report=lines.append)
    assert "0 calls" not in lines[0] and lines[1].endswith(": 9 calls"), lines


def autotile_family():
    from autotile.families.gemm import FAMILY

    return FAMILY


def test_recorded_trace_is_tuned_from_the_cli_and_its_winners_are_served(tmp_path):
    trace = tmp_path / "trace.jsonl"
    db = tmp_path / "tuned.sqlite"
    script = (
        "import torch, autotile\n"
        "x, w = torch.randn(3, 32), torch.randn(40, 32)\n"
        "for _ in range(5): autotile.linear(x, w)\n"
        "autotile.matmul(torch.randn(6, 24), torch.randn(24, 16))\n"
    )
    env = {"AUTOTILE_RECORD": str(trace), "TRITON_INTERPRET": "1", "AUTOTILE_DB": f"sqlite:///{tmp_path / 'u.sqlite'}"}
    import os

    done = subprocess.run([sys.executable, "-c", script], env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    assert lines[0]["format"] == "autotile-trace" and lines[-1] == {"record": "end", "count": 2}
    assert lines[1]["calls"] == 5 and lines[1]["problem"]["layout_b"] == "col"

    result = CliRunner().invoke(cli, ["tune", "--from-trace", str(trace), "--gpu", "interpret", "--trials", "2",
                                      "--db", str(db)])
    assert result.exit_code == 0, result.output
    assert "2 recorded problem(s) -> 2 to tune" in result.output and "tuned 2 problem(s)" in result.output
    # The interpreter has no vendor op and no bucket to verify over: both winners serve their exact shape.
    assert "0 served by the vendor op, 0 generated winners verified over their bucket, 2 for their exact shape" \
        in result.output
    keys = {w.params["m"] for w in Store(open_engine(f"sqlite:///{db}", create=False)).winners("gemm")}
    assert keys == {3, 6}
    # The second of two shards: the less called problem alone, into its own database.
    shard_db = tmp_path / "shard.sqlite"
    result = CliRunner().invoke(cli, ["tune", "--from-trace", str(trace), "--gpu", "interpret", "--trials", "2",
                                      "--shard", "2/2", "--db", str(shard_db)])
    assert result.exit_code == 0, result.output
    assert "2 to tune, 1 in shard 2/2" in result.output and "tuned 1 problem(s)" in result.output
    keys = {w.params["m"] for w in Store(open_engine(f"sqlite:///{shard_db}", create=False)).winners("gemm")}
    assert keys == {6}
    result = CliRunner().invoke(cli, ["tune", "--from-trace", str(trace), "--gpu", "interpret", "--shard", "3/2"])
    assert result.exit_code != 0 and "--shard" in result.output and "Traceback" not in result.output


def test_from_trace_refuses_bad_files_in_one_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"format": "autotile-trace", "version": 7}\n')
    result = CliRunner().invoke(cli, ["tune", "--from-trace", str(bad), "--gpu", "interpret"])
    assert result.exit_code == 1 and "version 7" in result.output and "Traceback" not in result.output


def test_tune_gemm_for_a_described_model(tmp_path):
    db = tmp_path / "model.sqlite"
    result = CliRunner().invoke(cli, ["tune", "gemm", "--dims", TINY_DIMS, "--tokens", "2", "--dtype", "fp32",
                                      "--gpu", "interpret", "--trials", "1", "--db", str(db)])
    assert result.exit_code == 0, result.output
    winners = Store(open_engine(f"sqlite:///{db}", create=False)).winners("gemm")
    # qkv 64x32, q 32x32, kv 16x32, o 32x32 (same as q), gate_up 96x32, gate 48x32, down 32x48
    assert sorted((w.params["n"], w.params["k"]) for w in winners) == [(16, 32), (32, 32), (32, 48), (48, 32),
                                                                       (64, 32), (96, 32)]
    assert all(w.params["layout_b"] == "col" and w.params["m"] == 2 for w in winners)
    unknown = CliRunner().invoke(cli, ["tune", "gemm", "--model", "gpt-17", "--gpu", "interpret"])
    assert unknown.exit_code == 1 and "unknown model" in unknown.output
    mixed = CliRunner().invoke(cli, ["tune", "gemm", "--model", "llama3-8b", "--m", "4", "--gpu", "interpret"])
    assert mixed.exit_code != 0 and "--model describes the shapes" in mixed.output
    # Problem options the model run does not apply were dropped: the winners landed under keys never asked for.
    for family, extra in (("gemm", ["--bias", "--activation", "relu", "--layout-b", "row"]),
                          ("flash", ["--direction", "bwd", "--softcap", "30", "--causal", "no"])):
        dropped = CliRunner().invoke(cli, ["tune", family, "--dims", TINY_DIMS, "--tokens", "2", "--trials", "1",
                                           "--gpu", "interpret", *extra])
        assert dropped.exit_code == 2, dropped.output
        assert all(flag in dropped.output for flag in extra if flag.startswith("--")), dropped.output


def test_several_models_tune_each_shared_shape_once():
    from autotile.cli.tune_plan import _models
    from autotile.families import get_family
    from autotile.tune.plan import model_problems

    gemm = get_family("gemm")
    models = _models({"model": "llama3-8b, mistral-7b,qwen3-8b", "dims": None})
    planned = model_problems("gemm", models, (1,), "bf16")
    # Mistral-7B runs Llama-3-8B's six shapes; Qwen3-8B shares its attention projections, not its MLP's.
    assert len(planned) == 9
    flops = [gemm.cost(item.problem).flops for item in planned]
    assert flops == sorted(flops)
    with pytest.raises(click.UsageError, match="--model NAME"):
        _models({"model": " , ", "dims": None})


def test_flash_prefill_of_a_model_takes_a_batch_and_gemm_refuses_one(tmp_path):
    from autotile.cli.tune_plan import _models
    from autotile.errors import BadInputError
    from autotile.tune.plan import model_problems

    models = _models({"model": "llama3-8b", "dims": None})
    planned = model_problems("flash", models, (512, 2048), "bf16", batch=4)
    assert [(item.problem.batch, item.problem.seq_q, item.problem.heads_q) for item in planned] == [(4, 512, 32),
                                                                                                   (4, 2048, 32)]
    assert {item.problem.batch for item in model_problems("flash", models, (512,), "bf16")} == {1}
    with pytest.raises(BadInputError, match="--batch"):
        model_problems("gemm", models, (512,), "bf16", batch=4)
    # From the CLI: --batch beside --model is flash's batch, and gemm's --model refuses a shape option.
    db = tmp_path / "flash.sqlite"
    result = CliRunner().invoke(cli, ["tune", "flash", "--dims", "hidden=64,intermediate=128,heads=4,kv_heads=2,head_dim=16",
                                      "--tokens", "40", "--batch", "3", "--dtype", "fp32", "--gpu", "interpret",
                                      "--trials", "1", "--db", str(db)])
    assert result.exit_code == 0, result.output
    (winner,) = Store(open_engine(f"sqlite:///{db}", create=False)).winners("flash")
    assert (winner.params["batch"], winner.params["seq_q"], winner.params["heads_q"]) == (3, 40, 4)


def test_linear_on_cpu_runs_the_generated_kernel():
    x, w = torch.randn(3, 32), torch.randn(40, 32)
    info = autotile.explain("linear", x, w)
    assert info["source"] != "vendor" and info["vendor"] is None


@pytest.mark.parametrize("dims, message", [
    ("hidden=64,hidden=32,intermediate=96,heads=4", "hidden twice"),
    ("hidden=64,intermediate=96,heads=3", "not a multiple of heads=3; give head_dim"),
    ("hidden=64,intermediate=96,heads=4,head_dim=0", "head_dim must be an integer from 1"),
])
def test_model_descriptions_that_were_read_wrongly_are_refused(dims, message):
    """A repeated dimension was last-wins and a hidden size not a multiple of heads gave a floored head dim."""
    with pytest.raises(BadInputError, match=message):
        model_dims(None, dims)


def test_a_models_attention_features_are_what_its_flash_problems_run():
    """Gemma-2 soft-caps every layer's logits and windows its local layers (4096 tokens): `tune flash --model`
    tunes those calls (a prompt no longer than the window is a plain call there); a policy, which must beat the
    vendor op, takes the heads alone; --dims describes both for other models."""
    from autotile.models import MODELS, flash_problems, model_dims
    from autotile.tune.plan import model_problems

    gemma = [(p.seq_q, p.window_left, p.softcap) for p in flash_problems(MODELS["gemma2-9b"], (1024, 4096, 8192))]
    assert gemma == [(1024, -1, 50.0), (4096, -1, 50.0), (8192, -1, 50.0), (8192, 4095, 50.0)]
    plain = model_problems("flash", [MODELS["gemma2-9b"]], (1024, 8192), "bf16", features=False)
    assert [(p.problem.seq_q, p.problem.has_features) for p in plain] == [(1024, False), (8192, False)]
    assert all(not p.has_features for p in flash_problems(MODELS["llama3-8b"], (1024, 8192)))
    custom = model_dims(None, "hidden=2048,intermediate=8192,heads=16,kv_heads=4,softcap=30.0,sliding_window=512")
    assert (custom.softcap, custom.sliding_window) == (30.0, 512)
    with pytest.raises(BadInputError, match="softcap=NUMBER"):
        model_dims(None, "hidden=2048,intermediate=8192,heads=16,softcap=big")


def test_a_switch_like_record_value_names_no_file_and_a_relative_one_is_kept_absolute(tmp_path, monkeypatch, caplog):
    """AUTOTILE_RECORD=1 (set as the other switches are) wrote a trace file named '1' beside the model; a relative
    path was resolved at each write, so a model that changed folders after its first call split its trace."""
    from autotile.runtime import trace

    monkeypatch.setattr(trace, "_resolved", {})
    monkeypatch.chdir(tmp_path)
    for off in ("0", "off", " "):
        monkeypatch.setenv("AUTOTILE_RECORD", off)
        assert trace.recording_path() is None
    monkeypatch.setenv("AUTOTILE_RECORD", "1")
    with caplog.at_level("WARNING", logger="autotile.runtime"):
        assert trace.recording_path() is None and trace.recording_path() is None
    assert caplog.text.count("AUTOTILE_RECORD=1 names no trace file") == 1
    monkeypatch.setenv("AUTOTILE_RECORD", "rel.jsonl")
    first = trace.recording_path()
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path / "sub")
    assert trace.recording_path() == first == tmp_path / "rel.jsonl"
