"""Compile-ahead's pool compiling for real: forked processes, meta inputs, Triton's on-disk cache (CPU machines).

The compile runs in a child process without TRITON_INTERPRET (Triton fixes at import whether its helpers
compile), which forks the pool's processes and compiles for the H200's architecture with Triton's own ptxas.
The GPU half (tests/test_compile_ahead_gpu.py) checks that a trial's real launch finds what the pool compiled.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import torch
from compile_child import run_compile_child

from autotile.device import interpret_device
from autotile.families import get_family
from autotile.families.gemm import GemmProblem
from autotile.tune.compile_ahead import input_layout, meta_inputs_from
from autotile.xcompile import meta_like

# Odd sizes, weight in nn.Linear layout, and an unaligned problem (its operands start one element in).
PROBLEMS = [GemmProblem(40, 96, 136, "fp16", "fp16", layout_b="col"),
            GemmProblem(33, 64, 72, "fp16", "fp16", aligned=False)]


def _cache_entries(cache: Path) -> set[str]:
    return {str(p.relative_to(cache)) for p in cache.rglob("*") if p.is_file() and not p.name.endswith(".lock")}


def _compile_in_pool() -> dict:
    from autotile.device import planned_device
    from autotile.tune.compile_ahead import CompileAhead
    from autotile.xcompile import compile_config

    family, h200 = get_family("gemm"), planned_device("h200")
    cache = Path(os.environ["TRITON_CACHE_DIR"])
    report = []
    for problem in PROBLEMS:
        configs = [family.default_config(problem, h200), *family.seed_configs(problem, h200)[:1]]
        before = _cache_entries(cache)
        pool = CompileAhead(family, problem, h200, 0, processes=2)
        try:
            pool.submit(configs)
            for config in configs:
                pool.wait_for(config, limit_s=300)
            pids = {p.pid for p in pool._pool._processes.values()}
        finally:
            pool.close()
        compiled = _cache_entries(cache) - before
        # This process compiles the same configs from its own meta inputs: every kernel is found in the cache.
        for config in configs:
            compile_config(family, problem, config, h200, read_resources=False)
        report.append({"compiled": pool.compiled, "cubins": sorted(c for c in compiled if c.endswith(".cubin")),
                       "new_after_pool": sorted(_cache_entries(cache) - before - compiled),
                       "pool_pids": sorted(pids), "configs": len(configs)})
    return {"problems": report, "pid": os.getpid()}


def test_the_pool_compiles_into_the_cache_a_launch_reads(tmp_path):
    os.environ["AUTOTILE_COMPILE_AHEAD_TEST_CACHE"] = str(tmp_path)
    try:
        result = run_compile_child(__file__, timeout=600)
    finally:
        os.environ.pop("AUTOTILE_COMPILE_AHEAD_TEST_CACHE")
    for problem in result["problems"]:
        assert problem["compiled"] == problem["configs"]
        assert problem["cubins"] and all("gemm_kernel" in c for c in problem["cubins"])
        # The same kernels compiled again in the tuner's process add nothing: the keys are the pool's.
        assert problem["new_after_pool"] == []
        assert problem["pool_pids"] and result["pid"] not in problem["pool_pids"]


def test_an_input_layout_gives_back_meta_tensors_of_the_same_layout():
    family = get_family("gemm")
    for problem in PROBLEMS:
        inputs = family.make_inputs(problem, interpret_device())
        layout = input_layout(inputs)
        json.dumps(layout)  # plain values only: it travels with every job
        rebuilt = meta_inputs_from(layout)
        for name, tensor in inputs.items():
            expected = meta_like(tensor)
            got = rebuilt[name]
            assert got.device.type == "meta" and got.dtype == expected.dtype
            assert (got.shape, got.stride(), got.storage_offset()) == (expected.shape, expected.stride(),
                                                                      expected.storage_offset())
            assert got.data_ptr() % 16 == expected.data_ptr() % 16
    scalar = input_layout({"scale": torch.tensor(2.0), "n": 3, "none": None})
    assert scalar["n"] == 3 and scalar["none"] is None and scalar["scale"].item() == 2.0


if __name__ == "__main__":
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(dir=os.environ.get("AUTOTILE_COMPILE_AHEAD_TEST_CACHE"))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    print(json.dumps(_compile_in_pool()))


def test_a_paged_launch_on_meta_tensors_takes_the_constants_of_the_gpu_they_stand_for():
    """The balanced kernel's SM count and programmatic dependent launch are launch arguments: on meta tensors
    they are the stand-in GPU's (an H200's 132 SMs and sm90), as on that GPU, not the machine's CPU count."""
    from autotile.device import meta_stands_for, planned_device
    from autotile.families.paged import FAMILY as PAGED, PagedProblem, paged_launch

    problem = PagedProblem(4, 8, 2, 128, 16, 1000)
    for name, pdl in (("h200", True), ("a100", False)):
        gpu = planned_device(name)
        config = dict(PAGED.default_config(problem, gpu), VARIANT="balanced")
        with meta_stands_for(gpu):
            launch = paged_launch(problem, config, torch.device("meta"))
        assert (launch.num_sms, launch.pdl) == (gpu.sm_count, pdl)
