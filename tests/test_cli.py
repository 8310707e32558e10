"""The CLI through click's CliRunner: tune, list, show, render, env, and clear errors."""
from __future__ import annotations

import json

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
