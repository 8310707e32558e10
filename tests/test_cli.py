"""The CLI through click's CliRunner: tune, list, show, render, env, and clear errors."""
from __future__ import annotations

import json
import os

import pytest
import torch
from click.testing import CliRunner

from autotile.cli.main import cli


@pytest.fixture
def run():
    runner = CliRunner()

    def invoke(*args):
        return runner.invoke(cli, list(args), catch_exceptions=False)

    return invoke


def test_tune_list_show_end_to_end(run, tmp_path):
    db = str(tmp_path / "cli.sqlite")
    result = run("tune", "gemm", "--m", "20", "--n", "24", "--k", "40", "--dtype", "float16", "--gpu", "interpret",
                 "--trials", "2", "--db", db)
    assert result.exit_code == 0, result.output
    assert "winner (interpret)" in result.output and "CPU timings" in result.output
    listing = run("list", "--db", db)
    assert listing.exit_code == 0 and "gemm" in listing.output and "m=20" in listing.output
    shown = run("show", "gemm", "--db", db)
    assert shown.exit_code == 0 and "trials: {'ok': 2}" in shown.output
    elsewhere = run("list", "--device", "h200/sm90", "--db", db)  # a filter that matches nothing says what is there
    assert elsewhere.exit_code == 0 and "no winners stored for device 'h200/sm90'" in elsewhere.output
    assert "families gemm on devices interpret" in elsewhere.output


def test_dtype_takes_short_and_torch_names(run, tmp_path):
    for name in ("bf16", "bfloat16", "fp32", "float32"):
        result = run("render", "gemm", "--m", "64", "--n", "64", "--k", "64", "--dtype", name)
        assert result.exit_code == 0, result.output
        assert "def gemm_kernel(" in result.output


def test_render_refuses_a_config_outside_the_space(run):
    result = run("render", "gemm", "--m", "64", "--n", "64", "--k", "64", "--config", '{"BLOCK_M": 7}')
    assert result.exit_code == 1 and "outside the search space" in result.output and "BLOCK_M=7" in result.output


def test_repeatable_options_take_their_default(run):
    # elementwise's --dtype is repeatable with default fp32: leaving it out renders the fp32 kernel.
    result = run("render", "elementwise", "--expr", "x * 2 + 1", "--numel", "1000")
    assert result.exit_code == 0, result.output
    assert "def elementwise_kernel(" in result.output


def test_bad_input_gets_a_clear_error(run, tmp_path):
    bad_dtype = run("tune", "gemm", "--m", "8", "--n", "8", "--k", "8", "--dtype", "int8", "--gpu", "interpret")
    assert bad_dtype.exit_code == 1 and "unknown dtype 'int8'" in bad_dtype.output
    partial = run("tune", "gemm", "--m", "8", "--gpu", "interpret")
    assert partial.exit_code == 1 and "--m, --n and --k" in partial.output
    corrupt = tmp_path / "corrupt.sqlite"
    corrupt.write_bytes(b"not sqlite" * 20)
    listing = run("list", "--db", str(corrupt))
    assert listing.exit_code == 1 and "not a SQLite database" in listing.output
    if not torch.cuda.is_available():
        wrong_gpu = run("tune", "gemm", "--m", "8", "--n", "8", "--k", "8", "--gpu", "h200")
        assert wrong_gpu.exit_code == 1 and "no CUDA GPU is present" in wrong_gpu.output


def test_env_reports_versions_and_paths(run):
    result = run("env")
    info = json.loads(result.output)
    assert info["triton"] == "3.6.0" and "kernel_cache" in info and "database" in info


def test_bench_times_the_served_config_beside_the_baseline(run):
    result = run("bench", "gemm", "--m", "20", "--n", "24", "--k", "40", "--dtype", "fp16", "--gpu", "interpret",
                 "--rounds", "1")
    assert result.exit_code == 0, result.output
    assert "interpreter timings" in result.output and "torch.matmul (CPU)" in result.output
    assert "default (default)" in result.output


def test_every_designed_command_exists(run):
    listing = run("--help").output
    for command in ("tune", "list", "show", "bench", "report", "render", "db", "export-kernel", "env"):
        assert f"  {command} " in listing, command
    db_help = run("db", "--help").output
    for sub in ("export", "import", "merge", "verify", "upgrade"):
        assert f"  {sub} " in db_help, sub


# --- what a new user runs into -----------------------------------------------------------------------

@pytest.fixture
def planned(monkeypatch):
    """The problems `autotile tune` would run, recorded instead of tuned."""
    import autotile.cli.main as main

    seen = []
    monkeypatch.setattr(main, "tune_each", lambda problems, tune_one: seen.extend(problems))
    return seen


def test_preset_refuses_shape_options(run):
    result = CliRunner().invoke(cli, ["tune", "gemm", "--preset", "bench-bf16", "--m", "64", "--dtype", "fp16",
                                      "--gpu", "interpret"])
    assert result.exit_code == 2 and "--preset bench-bf16 names its own problems, so --m, --dtype" in result.output


def test_unknown_families_exit_non_zero(run):
    for args in (["list", "--family", "nope"], ["show", "nope"]):
        result = CliRunner().invoke(cli, args)
        assert result.exit_code == 2 and "unknown family 'nope'" in result.output, args


def test_a_tune_where_every_trial_fails_exits_1(tmp_path, monkeypatch):
    from autotile.bench import Status, TrialOutcome
    from autotile.tune.workers import InProcessEvaluator

    monkeypatch.setattr(InProcessEvaluator, "evaluate",
                        lambda self, number, config: TrialOutcome(Status.COMPILE_ERROR, error="no such instruction"))
    result = CliRunner().invoke(cli, ["tune", "elementwise", "--expr", "x + 1", "--numel", "64", "--gpu", "interpret",
                                      "--trials", "2", "--db", str(tmp_path / "f.sqlite")])
    assert result.exit_code == 1, result.output
    assert "1 of 1 problem(s) got no winner: every trial failed" in result.output


def test_flags_are_the_same_in_every_family(planned):
    for args, want in (
        (["flash", "--seq", "64,128", "--head-dim", "64", "--heads", "4", "--kv-heads", "2", "--dtype", "bfloat16"],
         {("seq_q", 64), ("seq_q", 128), ("heads_q", 4), ("heads_kv", 2), ("dtype", "bf16")}),
        (["flash", "--seq", "64", "--seq", "256", "--head-dim", "64", "--heads-kv", "8"],  # the older spelling
         {("seq_q", 64), ("seq_q", 256), ("heads_kv", 8)}),
        (["paged", "--batch", "2,4", "--context", "64", "--heads", "8", "--kv-heads", "2", "--dtype", "float16"],
         {("batch", 2), ("batch", 4), ("num_q_heads", 8), ("num_kv_heads", 2), ("dtype", "fp16")}),
        (["paged", "--batch", "2", "--context", "64", "--q-heads", "16"], {("num_q_heads", 16)}),
        (["elementwise", "--expr", "x * 2", "--numel", "64,128", "--dtype", "bfloat16,float32"],
         {("numel", 64), ("numel", 128), ("inputs", "x:bf16:tensor"), ("inputs", "x:fp32:tensor")}),
    ):
        planned.clear()
        result = CliRunner().invoke(cli, ["tune", *args, "--gpu", "interpret"], catch_exceptions=False)
        assert result.exit_code == 0, (args, result.output)
        seen = {(k, v) for p in planned for k, v in vars(p).items()}
        assert want <= seen, (args, want - seen)
    bad = CliRunner().invoke(cli, ["tune", "flash", "--dtype", "int8", "--gpu", "interpret"])
    assert bad.exit_code == 2 and "'int8' is not one of fp32, fp16, bf16, fp8" in bad.output


def test_interpreter_runs_get_small_defaults_or_say_what_will_run(planned):
    result = CliRunner().invoke(cli, ["tune", "elementwise", "--expr", "x * 2", "--gpu", "interpret"])
    assert result.exit_code == 0 and [p.numel for p in planned] == [1 << 16]
    assert "--numel defaults to 65536" in result.stderr
    planned.clear()
    suite = CliRunner().invoke(cli, ["tune", "flash", "--gpu", "interpret", "--trials", "7"])
    assert suite.exit_code == 0 and len(planned) > 1
    assert f"the default flash suite runs: {len(planned)} problems" in suite.stderr and "up to 7 trials" in suite.stderr


def test_the_progress_bar_fits_80_columns(tmp_path, monkeypatch):
    import io
    import re

    from rich.console import Console

    import autotile.cli.progress as progress

    screen = io.StringIO()
    monkeypatch.setattr(progress, "Console", lambda **kw: Console(file=screen, force_terminal=True, width=80))
    result = CliRunner().invoke(cli, ["tune", "elementwise", "--expr", "sin(x) * cos(x) + x * 2 - 1", "--numel", "96",
                                      "--gpu", "interpret", "--trials", "2", "--db", str(tmp_path / "p.sqlite")],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    lines = [re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", line) for line in re.split(r"[\r\n]", screen.getvalue())]
    bar = [line for line in lines if "best" in line]
    assert bar and all(len(line.rstrip()) <= 80 for line in lines), max(lines, key=len)
    assert any("2/2" in line and "ms" in line for line in bar)  # count and best time stay on screen


def test_bench_reads_the_database_given(tmp_path):
    from autotile.device import interpret_device
    from autotile.families.elementwise import FAMILY
    from autotile.runtime import dispatch
    from autotile.tune.driver import tune_problem

    db = tmp_path / "bench.sqlite"
    problem = FAMILY.problems_from_cli(expr="x + 1", numel=(64,), dtype=("fp32",))[0]
    tune_problem(FAMILY, problem, interpret_device(), trials=1, db_url=f"sqlite:///{db}", retime_rounds=1)
    before = os.environ.get("AUTOTILE_DB")
    try:
        result = CliRunner().invoke(cli, ["bench", "elementwise", "--expr", "x + 1", "--numel", "64", "--gpu",
                                          "interpret", "--rounds", "1", "--db", str(db)], catch_exceptions=False)
    finally:
        os.environ["AUTOTILE_DB"] = before
        dispatch.clear_cache()
    assert result.exit_code == 0 and "user-db (exact)" in result.output, result.output


def test_render_fills_missing_axes_from_the_default_config(run):
    from autotile.device import interpret_device
    from autotile.families.gemm import FAMILY

    result = run("render", "gemm", "--m", "64", "--n", "64", "--k", "64", "--config", '{"BLOCK_M": 32}')
    assert result.exit_code == 0, result.output
    shown = json.loads(result.output.splitlines()[1].removeprefix("# config:").strip())
    default = FAMILY.default_config(FAMILY.problems_from_cli(m=64, n=64, k=64)[0], interpret_device())
    assert shown == {**default, "BLOCK_M": 32}


def test_export_kernel_help_lists_only_what_it_exports(run):
    listing = run("export-kernel", "--help").output
    commands = listing.split("Commands:")[1]
    assert "gemm" in commands and "elementwise" in commands and "flash" not in commands
    refused = CliRunner().invoke(cli, ["export-kernel", "flash", "--out", "x.py"])
    assert refused.exit_code == 1 and "flash is not supported because" in refused.output
