"""`autotile export-kernel`: the written module runs without autotile and matches the torch reference."""
from __future__ import annotations

import importlib.util
import re

import pytest
from click.testing import CliRunner

from autotile.cli.export_kernel import export_kernel_command
from autotile.device import interpret_device
from autotile.families.gemm import FAMILY, contiguous_problem
from autotile.space import Config
from autotile.store.db import open_engine
from autotile.store.repo import Store

CPU = interpret_device()


def run(*args):
    return CliRunner().invoke(export_kernel_command, [str(a) for a in args], catch_exceptions=False)


def load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check_against_reference(module, problem, seed=3):
    inputs = FAMILY.make_inputs(problem, CPU, seed=seed)
    c = module.matmul(inputs["a"], inputs["b"], inputs.get("bias"))
    result = FAMILY.check(problem, inputs, {"c": c}, FAMILY.reference(problem, inputs))
    assert result.ok, result.message


def test_the_stored_winner_is_written_and_runs_standalone(tmp_path):
    problem = contiguous_problem(40, 48, 160, "fp16", "fp16", bias=True, activation="gelu")
    config = Config(dict(FAMILY.default_config(problem, CPU), BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, SCHEDULE="split_k",
                         SPLIT_K=2, SWAP_AB=False, num_stages=2))
    FAMILY.space(problem, CPU).validate(config)
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    store = Store(open_engine(url))
    store.save_winner(problem_id=store.ensure_problem(FAMILY, problem), device=CPU, device_id=store.ensure_device(CPU),
                      toolchain_id=store.ensure_toolchain(), config=config.to_json(), config_hash=config.hash,
                      median_ms=2.5, q20_ms=2.4, q80_ms=2.6, interpreted=1, provenance="test")
    out = tmp_path / "my_kernel.py"
    result = run("gemm", "--m", 40, "--n", 48, "--k", 160, "--dtype", "fp16", "--bias", "--activation", "gelu",
                 "--gpu", "interpret", "--db", url, "--out", out)
    assert result.exit_code == 0, result.output
    assert "from exact winner" in result.output
    source = out.read_text()
    assert not re.search(r"^\s*(import|from) autotile", source, re.M)  # no autotile at run time
    assert "'SPLIT_K': 2" in source and "_NUM_STAGES = 2" in source and "measured 2.5000 ms" in source
    module = load(out, "exported_split_k")
    assert module.CONFIG == dict(config)
    check_against_reference(module, problem)
    inputs = FAMILY.make_inputs(problem, CPU)
    with pytest.raises(ValueError, match="must be \\(40, 160\\)"):
        module.matmul(inputs["a"][:, :100], inputs["b"], inputs["bias"])


def test_a_given_tma_config_on_an_odd_shape(tmp_path):
    problem = contiguous_problem(33, 64, 72, "fp32", "fp32")
    config = dict(VARIANT="tma", BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, GROUP_M=1, SPLIT_K=1, PERSISTENT=True,
                  WARP_SPECIALIZE=False, FLATTEN=False, num_warps=4, num_stages=2)
    out = tmp_path / "tma_kernel.py"
    result = run("gemm", "--m", 33, "--n", 64, "--k", 72, "--dtype", "fp32", "--gpu", "interpret",
                 "--config", Config(config).to_json(), "--db", tmp_path / "none.sqlite", "--out", out)
    assert result.exit_code == 0, result.output
    check_against_reference(load(out, "exported_tma"), problem)


def test_clear_errors(tmp_path):
    out = tmp_path / "k.py"
    result = run("flash", "--out", out)
    assert result.exit_code == 1 and "elementwise, gemm, paged only; flash is not supported because" in result.output
    outside = run("gemm", "--m", 8, "--n", 8, "--k", 8, "--gpu", "interpret", "--config", '{"BLOCK_M": 48}', "--out", out)
    assert outside.exit_code == 1 and "outside the search space" in outside.output
    assert not out.exists()


def test_partial_configs_stdout_unwritable_paths_and_why_a_winner_was_passed_over(tmp_path):
    """export-kernel's --config needed every axis (render's fills the rest from the default config); --out - wrote
    a file named '-'; a missing folder was reported as its '.partial' file; and an exact winner that is no longer a
    config of the space was passed over with 'nothing tuned for it'. The header named the database's full path."""
    shape = ("gemm", "--m", 40, "--n", 48, "--k", 160, "--dtype", "fp16", "--gpu", "interpret")
    partial = run(*shape, "--config", '{"BLOCK_N": 64, "num_stages": 2}', "--db", tmp_path / "none.sqlite",
                  "--out", tmp_path / "partial.py")
    assert partial.exit_code == 0, partial.output
    module = load(tmp_path / "partial.py", "exported_partial")
    assert module.CONFIG["BLOCK_N"] == 64 and module.CONFIG["num_stages"] == 2
    check_against_reference(module, contiguous_problem(40, 48, 160, "fp16", "fp16"))

    stdout = CliRunner().invoke(export_kernel_command, [str(a) for a in (*shape, "--db", tmp_path / "none.sqlite",
                                                                        "--out", "-")])
    assert stdout.exit_code == 0 and "def matmul(" in stdout.stdout and not (tmp_path / "-").exists()
    assert "wrote the module to standard output" in stdout.stderr

    missing = run(*shape, "--db", tmp_path / "none.sqlite", "--out", tmp_path / "nowhere" / "k.py")
    assert missing.exit_code == 1 and f"cannot write {tmp_path / 'nowhere' / 'k.py'}:" in missing.output
    assert ".partial" not in missing.output

    problem = contiguous_problem(40, 48, 160, "fp16", "fp16")
    url = f"sqlite:///{tmp_path / 'damaged.sqlite'}"
    store = Store(open_engine(url))
    config = dict(FAMILY.default_config(problem, CPU), BLOCK_M=48)  # no longer a config of the space
    store.save_winner(problem_id=store.ensure_problem(FAMILY, problem), device=CPU, device_id=store.ensure_device(CPU),
                      toolchain_id=store.ensure_toolchain(), config=Config(config).to_json(), config_hash="damaged",
                      median_ms=2.5, q20_ms=2.4, q80_ms=2.6, interpreted=1, provenance="test")
    passed = run(*shape, "--db", url, "--out", tmp_path / "default.py")
    assert passed.exit_code == 0, passed.output
    text = " ".join(passed.output.split())
    assert "from default config (the winner in damaged.sqlite is no longer a config of the space" in text
    assert str(tmp_path) not in (tmp_path / "default.py").read_text()


def test_a_winner_db_verify_found_failing_is_not_exported(tmp_path):
    """The runtime stops serving a winner db verify found failing; export-kernel still wrote it as the exact winner."""
    problem = contiguous_problem(40, 48, 160, "fp16", "fp16")
    url = f"sqlite:///{tmp_path / 'verified.sqlite'}"
    store = Store(open_engine(url))
    config = Config(dict(FAMILY.default_config(problem, CPU), BLOCK_N=64))
    store.save_winner(problem_id=store.ensure_problem(FAMILY, problem), device=CPU, device_id=store.ensure_device(CPU),
                      toolchain_id=store.ensure_toolchain(), config=config.to_json(), config_hash=config.hash,
                      median_ms=2.5, q20_ms=2.4, q80_ms=2.6, interpreted=1, provenance="test",
                      verify_status="wrong_result")
    result = run("gemm", "--m", 40, "--n", 48, "--k", 160, "--dtype", "fp16", "--gpu", "interpret", "--db", url,
                 "--out", tmp_path / "k.py")
    assert result.exit_code == 0, result.output
    assert "the winner in verified.sqlite is not served: db verify found wrong result" in " ".join(result.output.split())
