"""Run-time lookup order: user database, shipped database, exact, bucket, nearest, default; never benchmarks."""
from __future__ import annotations

import pytest
import torch

import autotile
from autotile import bench
from autotile.device import interpret_device
from autotile.families.gemm import FAMILY, GemmProblem, contiguous_problem
from autotile.runtime import dispatch
from autotile.space import Config
from autotile.store.db import open_engine
from autotile.store.repo import Store

CPU = interpret_device()


def store_winner(url: str, problem, config: dict, ms: float = 1.0) -> None:
    store = Store(open_engine(url))
    store.save_winner(problem_id=store.ensure_problem(FAMILY, problem), device=CPU, device_id=store.ensure_device(CPU),
                      toolchain_id=store.ensure_toolchain(), config=Config(config).to_json(),
                      config_hash=Config(config).hash, median_ms=ms, q20_ms=ms, q80_ms=ms, interpreted=1,
                      provenance="test")


def config_with(problem, **changes) -> dict:
    return dict(FAMILY.default_config(problem, CPU), **changes)


@pytest.fixture
def databases(tmp_path, monkeypatch):
    user = f"sqlite:///{tmp_path / 'user.sqlite'}"
    shipped = tmp_path / "shipped.sqlite"
    monkeypatch.setenv("AUTOTILE_DB", user)
    monkeypatch.setattr("autotile.resources.shipped_db_path", lambda: shipped)
    monkeypatch.setattr(bench, "time_fn", lambda *a, **k: pytest.fail("the runtime must never benchmark"))
    dispatch.clear_cache()
    yield user, f"sqlite:///{shipped}"
    dispatch.clear_cache()


def test_default_when_nothing_is_stored(databases):
    problem = contiguous_problem(300, 100, 96, "fp32", "fp32")
    got = dispatch.resolve(FAMILY, problem, CPU)
    assert got.source == "default" and got.config == FAMILY.default_config(problem, CPU)


def test_user_db_comes_before_shipped_db(databases):
    user, shipped = databases
    problem = contiguous_problem(300, 100, 96, "fp32", "fp32")
    store_winner(shipped, problem, config_with(problem, GROUP_M=4))
    got = dispatch.resolve(FAMILY, problem, CPU)
    assert (got.source, got.match, got.config["GROUP_M"]) == ("shipped-db", "exact", 4)
    store_winner(user, problem, config_with(problem, GROUP_M=16))
    dispatch.clear_cache()
    got = dispatch.resolve(FAMILY, problem, CPU)
    assert (got.source, got.match, got.config["GROUP_M"]) == ("user-db", "exact", 16)


def test_bucket_then_nearest(databases):
    user, _ = databases
    tuned = contiguous_problem(300, 100, 96, "fp32", "fp32")
    far = contiguous_problem(1000, 900, 96, "fp32", "fp32")
    store_winner(user, tuned, config_with(tuned, GROUP_M=4))
    store_winner(user, far, config_with(far, GROUP_M=16))
    near = contiguous_problem(320, 112, 96, "fp32", "fp32")  # same power-of-two bucket as `tuned`
    got = dispatch.resolve(FAMILY, near, CPU)
    assert (got.match, got.config["GROUP_M"]) == ("bucket", 4)
    assert got.tuned_for == FAMILY.problem_key(tuned)
    between = contiguous_problem(600, 400, 96, "fp32", "fp32")
    got = dispatch.resolve(FAMILY, between, CPU)
    assert (got.match, got.config["GROUP_M"]) == ("nearest", 16)
    other_dtype = contiguous_problem(300, 100, 96, "fp16", "fp16")  # never served by an fp32 winner
    assert dispatch.resolve(FAMILY, other_dtype, CPU).source == "default"


def test_config_outside_the_space_is_skipped(databases):
    user, _ = databases
    problem = contiguous_problem(300, 100, 96, "fp32", "fp32")
    store_winner(user, problem, config_with(problem, BLOCK_M=512))  # not a BLOCK_M choice
    got = dispatch.resolve(FAMILY, problem, CPU)
    assert got.source == "default"


def test_memoised_and_explained(databases):
    user, _ = databases
    a, b = torch.randn(300, 96), torch.randn(96, 100)
    problem = FAMILY.problem_from_tensors(a, b)
    store_winner(user, problem, config_with(problem, GROUP_M=4))
    first = dispatch.resolve(FAMILY, problem, CPU)
    assert dispatch.resolve(FAMILY, problem, CPU) is first
    info = autotile.explain("matmul", a, b)
    assert info["source"] == "user-db" and info["config"]["GROUP_M"] == 4 and info["device"] == "interpret"
    torch.testing.assert_close(autotile.matmul(a, b), a @ b, atol=1e-4, rtol=1e-5)


def test_corrupt_user_db_falls_back_with_a_warning(databases, tmp_path, monkeypatch, caplog):
    corrupt = tmp_path / "corrupt.sqlite"
    corrupt.write_bytes(b"garbage" * 100)
    monkeypatch.setenv("AUTOTILE_DB", str(corrupt))
    dispatch.clear_cache()
    problem = GemmProblem(64, 64, 64, "fp32", "fp32")
    assert dispatch.resolve(FAMILY, problem, CPU).source == "default"
    assert "not a SQLite database" in caplog.text


def test_running_tuned_ops_imports_neither_optuna_nor_alembic():
    import subprocess
    import sys

    script = ("import sys, torch, autotile\n"
              "a = torch.randn(8, 8); autotile.matmul(a, a); autotile.fuse('x * 2')(x=a)\n"
              "print(sorted(m for m in ('optuna', 'alembic') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_a_winner_db_verify_found_failing_is_not_served_and_list_says_why(databases):
    """db verify stored its findings, but nothing read them: a winner it found computing wrongly kept being served,
    and `list` called every finding "another toolchain or driver"."""
    from click.testing import CliRunner

    from autotile.cli.main import cli

    user, shipped = databases
    problem = contiguous_problem(300, 100, 96, "fp32", "fp32")
    store_winner(shipped, problem, config_with(problem, GROUP_M=4))
    store_winner(user, problem, config_with(problem, GROUP_M=16))
    store = Store(open_engine(user))
    ((winner, *_),) = store.winner_rows(FAMILY.name, CPU.key)
    # db verify leaves `stale` 0 for a winner of this toolchain: the marks were read only where it was 1.
    for status, regression, stale, served, words in (
            ("regression", 0.21, 1, 16, "timed it +21% slower; still served"),
            ("regression", 0.21, 0, 16, "timed it +21% slower; still served"),
            ("wrong_result", None, 1, 4, "found wrong result; not served"),
            ("outside_space", None, 0, 4, "found outside space; not served")):
        store.update_winner(winner.id, verify_status=status, regression=regression, stale=stale)
        dispatch.clear_cache()
        assert dispatch.resolve(FAMILY, problem, CPU).config["GROUP_M"] == served
        for command in ("list", "show"):
            listed = CliRunner().invoke(cli, [command, *(["gemm"] if command == "show" else []), "--db", user])
            assert words in " ".join(listed.output.split()), (command, listed.output)
