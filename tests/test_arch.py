"""Search spaces that know the device's architecture: what each profile gets, what a problem the device cannot
run gets, the interpreter standing in for the H200, unknown GPUs, and `tune --dry-run` on a CPU machine."""
from __future__ import annotations

import dataclasses

import pytest
from click.testing import CliRunner

from autotile.arch import Feature, UnsupportedOnDevice, arch_of, require_dtypes
from autotile.cli.main import cli
from autotile.device import PROFILES, DeviceInfo, interpret_device, planned_device, profile_archs
from autotile.families import get_family
from autotile.families.flash import FlashProblem, uses_tma
from autotile.families.gemm import contiguous_problem
from autotile.families.gemm_space import StagedSpace, rule
from autotile.families.paged import PagedProblem
from autotile.space import Axis, Constraint, Space
from autotile.tune.dry_run import plan_tune, removed_by
from autotile.xcompile import representative_problems

GPUS = ("a100", "l40s", "h100", "h200")
FAMILIES = ("gemm", "flash", "paged", "elementwise")


def _cases():
    for family, problems in representative_problems().items():
        for problem in problems:
            yield family, problem


CASES = list(_cases())


def _id(case) -> str:
    family, problem = case
    return f"{family}-{get_family(family).problem_key(problem)[:60]}"


def test_profiles_say_what_their_gpus_have():
    for name in GPUS:
        profile = PROFILES[name]
        assert profile.sm_count > 0 and profile.smem_per_block > 0 and profile.memory_bytes > 0, name
        assert profile.registers_per_sm == 65536 and profile.sources, name
        assert planned_device(name).planned and planned_device(name).key.startswith(name + "/sm")
    assert not interpret_device().planned
    assert {cc: name for cc, name in profile_archs().items()} == {(9, 0): "h200", (8, 0): "a100", (8, 9): "l40s"}
    a100, l40s, h200 = (arch_of(planned_device(n)) for n in ("a100", "l40s", "h200"))
    assert (a100.name, a100.smem_per_block, a100.max_threads_per_sm) == ("sm80", 166912, 2048)
    assert (l40s.name, l40s.smem_per_block, l40s.max_threads_per_sm) == ("sm89", 101376, 1536)
    assert a100.features == {Feature.BF16, Feature.TF32}
    assert l40s.features == {Feature.BF16, Feature.TF32, Feature.FP8}
    assert h200.features == set(Feature)


def test_the_interpreter_is_hopper_unless_told_otherwise():
    assert arch_of(interpret_device()).name == "sm90"
    as_a100 = dataclasses.replace(interpret_device(), compute_capability=(8, 0))
    assert not arch_of(as_a100).supports(Feature.TMA)
    problem = FlashProblem("fwd", 1, 4, 2, 512, 512, 128)
    flash = get_family("flash")
    assert any(uses_tma(c) for c in flash.space(problem, interpret_device()).feasible())
    assert not any(uses_tma(c) for c in flash.space(problem, as_a100).feasible())


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_the_interpreter_keeps_the_h200_space(case):
    """All of it but the GEMM and flash families' Gluon variants, which Triton's interpreter does not run."""
    family_name, problem = case
    family = get_family(family_name)
    h200 = planned_device("h200")
    triton_only = lambda configs: [c for c in configs if "gluon_ws" not in (c.get("VARIANT"), c.get("LOADS"))]  # noqa: E731
    interpreted = list(family.space(problem, interpret_device()).feasible())
    assert triton_only(interpreted) == interpreted
    assert set(interpreted) == set(triton_only(family.space(problem, h200).feasible()))
    assert family.seed_configs(problem, interpret_device()) == triton_only(family.seed_configs(problem, h200))


@pytest.mark.parametrize("gpu", GPUS)
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_defaults_and_seeds_are_points_of_every_profiles_space(case, gpu):
    family_name, problem = case
    family, device = get_family(family_name), planned_device(gpu)
    try:
        space = family.space(problem, device)
    except UnsupportedOnDevice:
        assert gpu == "a100" and "fp8" in repr(problem), "only fp8 is refused, and only on sm80"
        return
    default = family.default_config(problem, device)
    assert space.is_feasible(default), space.violations(default)
    for seed in family.seed_configs(problem, device):
        assert space.is_feasible(seed), (seed, space.violations(seed))


def test_smaller_gpus_keep_seeds_of_the_hopper_tile_shapes():
    # D = 128 flash seeds need 128-163 KiB at 2-3 stages: an L40S (99 KiB) gets each tile shape with fewer
    # stages (or the nearest that fits), not an empty seed list.
    problem = FlashProblem("fwd", 1, 8, 8, 4096, 4096, 128, causal=True)
    flash = get_family("flash")
    seeds = flash.seed_configs(problem, planned_device("l40s"))
    assert len(seeds) >= 2
    assert {(c["BLOCK_M"], c["BLOCK_N"]) for c in seeds} >= {(128, 64), (64, 64)}
    assert all(c["LOADS"] == "pointer" and not c["WARP_SPECIALIZE"] for c in seeds)


@pytest.mark.parametrize("gpu", ("a100", "l40s"))
def test_hopper_only_variants_leave_older_spaces(gpu):
    device = planned_device(gpu)
    gemm = get_family("gemm").space(contiguous_problem(2048, 2048, 2048, layout_b="col"), device)
    assert not any(c["VARIANT"] == "tma" or c["WARP_SPECIALIZE"] for c in gemm.feasible())
    assert "needs_tma" in gemm.violations(dict(next(iter(gemm.feasible())), VARIANT="tma"))[0]
    flash = list(get_family("flash").space(FlashProblem("fwd", 2, 8, 8, 2048, 2048, 64), device).feasible())
    assert flash and not any(uses_tma(c) or c["WARP_SPECIALIZE"] or c["LOADS"].endswith("_lookahead") for c in flash)
    hopper = get_family("flash").space(FlashProblem("fwd", 2, 8, 8, 2048, 2048, 64), planned_device("h200"))
    assert any(c["LOADS"] == "tma_lookahead" and c["WARP_SPECIALIZE"] for c in hopper.feasible())


def test_shared_memory_comes_from_the_device():
    problem = FlashProblem("fwd", 1, 8, 8, 4096, 4096, 128)
    flash = get_family("flash")
    l40s, a100 = planned_device("l40s"), planned_device("a100")
    biggest = {name: max(c["BLOCK_N"] * c["num_stages"] for c in flash.space(problem, d).feasible())
               for name, d in (("l40s", l40s), ("a100", a100))}
    assert biggest["l40s"] < biggest["a100"]


@pytest.mark.parametrize("family_name, problem", [
    ("gemm", contiguous_problem(64, 256, 256, "fp8", "bf16", layout_b="col")),
    ("flash", FlashProblem("fwd", 1, 2, 2, 128, 128, 64, dtype="fp8")),
    ("paged", PagedProblem(2, 4, 4, 64, 16, 100, dtype="fp16", kv_dtype="fp8")),
])
def test_fp8_on_sm80_is_refused_before_any_trial(family_name, problem):
    family, a100 = get_family(family_name), planned_device("a100")
    for ask in (family.space, family.default_config, family.seed_configs):
        with pytest.raises(UnsupportedOnDevice, match=r"fp8 e4m3 tensor cores \(sm89 and newer\).*sm80"):
            ask(problem, a100)
    assert family.vendor_configs(problem, a100) == []  # torch._scaled_mm needs sm89 too
    family.space(problem, planned_device("l40s"))


def test_the_runtime_on_an_a100_refuses_fp8_and_serves_bf16():
    from autotile.runtime.dispatch import resolve

    gemm, a100 = get_family("gemm"), planned_device("a100")
    with pytest.raises(UnsupportedOnDevice, match="sm89"):
        resolve(gemm, contiguous_problem(16, 512, 512, "fp8", "bf16", layout_b="col"), a100)
    served = resolve(gemm, contiguous_problem(4096, 4096, 4096, layout_b="col"), a100)
    assert served.vendor or served.config["VARIANT"] == "blocked"


def test_bf16_needs_ampere_and_tf32_too():
    turing = DeviceInfo("other:tesla-t4", "Tesla T4", (7, 5), 40, 16 * 10**9, 65536, "test")
    with pytest.raises(UnsupportedOnDevice, match="bf16"):
        get_family("gemm").space(contiguous_problem(64, 64, 64, "bf16", "bf16"), turing)
    with pytest.raises(UnsupportedOnDevice, match="tf32"):
        get_family("gemm").space(contiguous_problem(64, 64, 64, "fp32", "fp32", tf32=True), turing)
    assert get_family("gemm").space(contiguous_problem(64, 64, 64, "fp16", "fp16"), turing).is_feasible(
        get_family("gemm").default_config(contiguous_problem(64, 64, 64, "fp16", "fp16"), turing))
    with pytest.raises(UnsupportedOnDevice, match="sm75"):
        arch_of(DeviceInfo("other:v100", "Tesla V100", (7, 0), 80, 16 * 10**9, 98304, "test"))
    require_dtypes(planned_device("a100"), ["fp16", "fp32", "bf16", "tf32"], "anything")


def test_an_unknown_gpu_gets_the_space_of_its_own_architecture():
    # An RTX 4090 (sm89, 128 SMs, 99 KiB a block) and an RTX 5090 (sm120): no profile, cc and limits from CUDA.
    ada = DeviceInfo("other:geforce-rtx-4090", "NVIDIA GeForce RTX 4090", (8, 9), 128, 24 * 10**9, 101376, "test")
    blackwell = DeviceInfo("other:geforce-rtx-5090", "NVIDIA GeForce RTX 5090", (12, 0), 170, 32 * 10**9, 101376, "t")
    problem = FlashProblem("fwd", 1, 8, 8, 4096, 4096, 64)
    flash = get_family("flash")
    ada_space = set(flash.space(problem, ada).feasible())
    assert ada_space == set(flash.space(problem, planned_device("l40s")).feasible())
    assert ada_space != set(flash.space(problem, planned_device("h200")).feasible())
    consumer = list(flash.space(problem, blackwell).feasible())
    assert any(uses_tma(c) for c in consumer) and not any(c["WARP_SPECIALIZE"] for c in consumer)
    assert arch_of(ada).max_threads_per_sm == 1536
    get_family("flash").space(FlashProblem("fwd", 1, 2, 2, 128, 128, 64, dtype="fp8"), ada)


def test_staged_pruning_counts_match_a_brute_force_count():
    axes = [Axis("A", (1, 2, 3, 4)), Axis("B", (1, 2, 3)), Axis("C", (True, False))]
    rules = [rule("a_small", ("A",), lambda c: c["A"] < 4, "A < 4"),
             rule("sum", ("A", "B"), lambda c: c["A"] + c["B"] <= 4, "A + B <= 4"),
             rule("c_odd", ("A", "C"), lambda c: c["C"] or c["A"] % 2 == 1, "C or A odd")]
    staged = StagedSpace(axes, rules)
    plain = Space(axes, [r.constraint for r in rules])
    assert removed_by(staged) == removed_by(plain)
    grid, feasible, removed = removed_by(staged)
    assert (grid, feasible) == (24, len(list(plain.feasible())))
    assert removed == {"a_small": 6, "sum": 6, "c_odd": 2} and feasible == 10
    space = get_family("gemm").space(contiguous_problem(64, 512, 512, layout_b="col"), planned_device("a100"))
    grid, feasible, removed = removed_by(space)
    assert feasible == sum(1 for _ in space.feasible()) and grid == feasible + sum(removed.values())


def test_plan_tune_lists_what_the_search_tries_first():
    flash = get_family("flash")
    problem = FlashProblem("fwd", 1, 8, 8, 2048, 2048, 128, causal=True)
    plan = plan_tune(flash, problem, planned_device("a100"), db_url=None, warm_start=False)
    assert plan.first[0] == ("default", flash.default_config(problem, planned_device("a100")))
    assert [c for r, c in plan.first if r == "seed"] == [c for c in flash.seed_configs(problem, planned_device("a100"))
                                                         if c != plan.first[0][1]]
    assert plan.removed["needs_tma"] > 0 and plan.removed["needs_async_mma"] > 0
    assert plan.grid == plan.feasible + sum(plan.removed.values())
    assert plan_tune(flash, problem, planned_device("h200"), warm_start=False).removed["needs_tma"] == 0


@pytest.fixture
def run():
    runner = CliRunner()
    return lambda *args: runner.invoke(cli, list(args), catch_exceptions=False)


SHAPES = {
    "gemm": ("--m", "64", "--n", "512", "--k", "512", "--layout-b", "col"),
    "flash": ("--seq", "1024", "--head-dim", "128", "--heads", "8", "--causal", "yes"),
    "paged": ("--batch", "8", "--context", "2048"),
    "elementwise": ("--expr", "silu(x)*x", "--numel", "65536", "--dtype", "bf16"),
}


@pytest.mark.parametrize("gpu", GPUS + ("interpret",))
@pytest.mark.parametrize("family", FAMILIES)
def test_dry_run_works_for_every_profile_on_a_cpu_machine(run, tmp_path, family, gpu):
    db = tmp_path / "absent.sqlite"
    result = run("tune", family, *SHAPES[family], "--gpu", gpu, "--dry-run", "--db", str(db))
    assert result.exit_code == 0, result.output
    assert "first configs the search tries" in result.output and "    default " in result.output
    assert "space:" in result.output and "pruned by" in result.output
    if gpu in ("a100", "l40s") and family in ("gemm", "flash"):
        assert "needs_tma" in result.output
    assert not db.exists(), "a dry run wrote a database"


def test_dry_run_reads_the_database_without_writing_it(run, tmp_path):
    from autotile.store.db import open_engine

    db = tmp_path / "tuning.sqlite"
    open_engine(f"sqlite:///{db}").dispose()
    before = (db.stat().st_size, db.stat().st_mtime_ns)
    result = run("tune", "gemm", *SHAPES["gemm"], "--gpu", "a100", "--dry-run", "--db", str(db))
    assert result.exit_code == 0, result.output
    assert "no warm start: nothing near this problem is tuned on a100/sm80" in result.output
    # SQLite's read-only mode may leave an empty write-ahead log beside the file (readers' shared memory).
    assert (db.stat().st_size, db.stat().st_mtime_ns) == before
    wal = tmp_path / "tuning.sqlite-wal"
    assert not wal.exists() or wal.stat().st_size == 0


def test_dry_run_of_fp8_on_an_a100_says_why_and_fails(run, tmp_path):
    result = run("tune", "gemm", "--m", "64", "--n", "256", "--k", "256", "--dtype", "fp8", "--layout-b", "col",
                 "--gpu", "a100", "--dry-run", "--db", str(tmp_path / "x.sqlite"))
    assert result.exit_code == 1
    assert "cannot run on a100/sm80" in result.output and "sm89 and newer" in result.output


def test_dry_run_of_an_unknown_profile_names_the_known_ones(run, tmp_path):
    result = run("tune", "gemm", *SHAPES["gemm"], "--gpu", "b300", "--dry-run")
    assert result.exit_code != 0 and "known: a100, h100, h200, l40s" in result.output


def test_architecture_constraints_name_the_feature_and_the_device():
    space = get_family("flash").space(FlashProblem("fwd", 1, 8, 8, 1024, 1024, 64), planned_device("a100"))
    config = {"LOADS": "tma_lookahead", "BLOCK_M": 128, "BLOCK_N": 64, "WARP_SPECIALIZE": True, "num_warps": 8,
              "num_stages": 2}
    problems = " ".join(space.violations(config))
    for name in ("needs_tma", "needs_warp_specialize", "needs_async_mma"):
        assert name in problems
    assert "sm80" in problems and "sm90" in problems
    assert isinstance(space.constraints[-1], Constraint)

