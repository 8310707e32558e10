"""Every GEMM variant compiles for the GPUs it is meant for, checked on the CPU.

Triton compiles for an explicit target with the ptxas it ships: sm90 for every variant, sm80 for those
without TMA or fp8. The arguments are bound as a launch would bind them (pointer alignment, integers that
are 1 or multiples of 16), so the kernels compiled are the ones a GPU would run. For the policy's own
configs on LLM shapes, ptxas must report no register spills and no serialised wgmma. The compiles run
in one child process: this test process set TRITON_INTERPRET=1 before Triton was imported, and Triton
fixes at import whether its own language helpers (tl.cdiv, ...) are compiled or interpreted.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
import subprocess
import tempfile

import pytest
from compile_child import map_in_processes, run_compile_child
import torch
import triton
from triton.backends.compiler import GPUTarget

from autotile.device import HOPPER_SMEM_PER_BLOCK, DeviceInfo, interpret_device
from autotile.dtypes import torch_dtype
from autotile.families.gemm import FAMILY, GemmProblem, contiguous_problem
from autotile.families.gemm_launch import _CONSTEXPRS
from autotile.render import load_kernel_module
from autotile.space import Config
from autotile.xcompile import compile_kernel

H200 = DeviceInfo("h200", "NVIDIA H200", (9, 0), 132, 150_000_000_000, HOPPER_SMEM_PER_BLOCK, "test")
A100 = DeviceInfo("a100", "NVIDIA A100", (8, 0), 108, 80_000_000_000, 166912, "test")


def placeholder_inputs(p: GemmProblem) -> dict:
    """Tensors of the problem's shapes, layouts, dtypes and alignment (values do not matter to a compiler)."""
    pad = 0 if p.aligned else 1

    def operand(rows, cols, layout, dtype):
        if layout == "row":
            return torch.empty(rows * cols + pad, dtype=dtype)[pad:].view(rows, cols)
        if layout == "col":
            return torch.empty(rows * cols + pad, dtype=dtype)[pad:].view(cols, rows).t()
        return torch.empty(rows, 2 * cols, dtype=dtype)[:, ::2]

    inputs = {"a": operand(p.m, p.k, p.layout_a, torch_dtype(p.dtype)), "b": operand(p.k, p.n, p.layout_b, torch_dtype(p.dtype))}
    out = torch_dtype(p.out_dtype)
    if p.dtype == "fp8":
        groups_k, groups_n = math.ceil(p.k / 128), math.ceil(p.n / 128)
        shapes = {"tensor": ((1,), (1,)), "row": ((p.m, 1), (1, p.n)), "block": ((p.m, groups_k), (groups_k, groups_n))}
        shape_a, shape_b = shapes[p.scale_mode]
        inputs["scale_a"], inputs["scale_b"] = torch.ones(shape_a), torch.ones(shape_b)
    if p.bias:
        inputs["bias"] = torch.empty(p.n, dtype=out)
    if p.residual:
        inputs["residual"] = torch.empty(p.m, p.n, dtype=out)
    return inputs


def compile_for(problem: GemmProblem, config, arch: int, device: DeviceInfo = H200):
    """The kernel of (problem, config) compiled for sm`arch`, its arguments bound as a launch binds them."""
    config = FAMILY.space(problem, device).validate(config)
    module = load_kernel_module(FAMILY.template, interpret=False, **FAMILY.render_switches(problem, config))
    inputs = placeholder_inputs(problem)
    c = torch.empty(problem.m, problem.n, dtype=torch_dtype(problem.out_dtype))
    grid, workspace, counters, stream_k = module.launch_geometry(
        problem.m, problem.n, problem.k, config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"], config["SPLIT_K"],
        config["PERSISTENT"], device.sm_count)
    ws = torch.empty(workspace, dtype=torch.float32) if workspace else None
    tile_counters = torch.zeros(counters, dtype=torch.int32) if counters else None
    args = module.kernel_args(inputs["a"], inputs["b"], c, inputs.get("bias"), inputs.get("residual"),
                              inputs.get("scale_a"), inputs.get("scale_b"), ws, tile_counters, stream_k,
                              (config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]))
    kwargs = {name: config.get(name, 1) for name in _CONSTEXPRS}
    # Bound as JITFunction.run binds a launch, and built from Gluon's own IR for the gluon_ws variant.
    compiled, _ = compile_kernel(module.gemm_kernel, GPUTarget("cuda", arch, 32), tuple(args), kwargs)
    return compiled


def ptxas_report(compiled, arch: int) -> str:
    """What `ptxas -v` says about the kernel: registers, spills, and performance warnings."""
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as ptx:
        ptx.write(compiled.asm["ptx"])
        ptx.flush()
        result = subprocess.run([triton.knobs.nvidia.ptxas.path, f"-arch=sm_{arch}{'a' if arch == 90 else ''}", "-v",
                                 ptx.name, "-o", "/dev/null"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stderr


def cfg(**values) -> Config:
    base = dict(VARIANT="blocked", SCHEDULE="data_parallel", SPLIT_K=1, PERSISTENT=False, WARP_SPECIALIZE=False,
                FLATTEN=False, SWAP_AB=False, BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)
    base.update(values)
    return Config(base)


LINEAR = contiguous_problem(512, 1024, 1024, "bf16", "bf16", layout_b="col")
DECODE = contiguous_problem(8, 1024, 2048, "bf16", "bf16", layout_b="col")
EPILOGUE = contiguous_problem(300, 1000, 520, "fp16", "fp16", bias=True, activation="gelu", residual=True)
TF32 = contiguous_problem(256, 512, 512, "fp32", "fp32", tf32=True)
FP32 = contiguous_problem(256, 512, 512, "fp32", "fp32")
FP8 = contiguous_problem(512, 1024, 1024, "fp8", "bf16", layout_b="col")
FP8_FAST = dataclasses.replace(FP8, fp8_fast_accum=True)
FP8_ROW = dataclasses.replace(FP8, scale_mode="row", bias=True)
FP8_BLOCK = dataclasses.replace(FP8, scale_mode="block", residual=True)
ODD = contiguous_problem(100, 300, 77, "bf16", "bf16", layout_a="strided", layout_b="col")
FP8_DECODE = contiguous_problem(8, 1024, 2048, "fp8", "bf16", layout_b="col")
FP8_BLOCK_DECODE = dataclasses.replace(FP8_DECODE, scale_mode="block")

DECODE_CFG = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=5)
VARIANTS = [
    (LINEAR, cfg()),
    (LINEAR, cfg(SCHEDULE="stream_k")),
    (LINEAR, cfg(SCHEDULE="split_k", SPLIT_K=2)),
    (LINEAR, cfg(VARIANT="tma", PERSISTENT=True, BLOCK_N=256)),
    (LINEAR, cfg(VARIANT="tma", PERSISTENT=True, WARP_SPECIALIZE=True, BLOCK_N=256)),
    (LINEAR, cfg(VARIANT="tma", PERSISTENT=True, FLATTEN=True)),
    (LINEAR, cfg(VARIANT="tma", PERSISTENT=True, BLOCK_N=256, EPILOGUE_SUBTILE=True, num_stages=4)),
    (LINEAR, cfg(VARIANT="tma", SCHEDULE="stream_k", BLOCK_N=256)),
    (LINEAR, cfg(VARIANT="tma", SCHEDULE="split_k", SPLIT_K=3)),
    (DECODE, cfg(SCHEDULE="split_k", SPLIT_K=4, SWAP_AB=True, **DECODE_CFG)),
    (DECODE, cfg(SCHEDULE="split_k", SPLIT_K=4, **DECODE_CFG)),
    (DECODE, cfg(VARIANT="tma", SCHEDULE="split_k", SPLIT_K=4, SWAP_AB=True, **DECODE_CFG)),
    (DECODE, cfg(VARIANT="tma", SCHEDULE="stream_k", **DECODE_CFG)),
    (DECODE, cfg(SCHEDULE="stream_k", SWAP_AB=True, **DECODE_CFG)),
    (EPILOGUE, cfg(SCHEDULE="stream_k", BLOCK_N=64, num_warps=4)),
    (EPILOGUE, cfg(SCHEDULE="split_k", SPLIT_K=2, BLOCK_N=64, num_warps=4)),
    (EPILOGUE, cfg(VARIANT="tma", PERSISTENT=True)),
    (TF32, cfg(BLOCK_K=32)),
    (TF32, cfg(VARIANT="tma", SCHEDULE="stream_k", BLOCK_K=32)),
    (FP32, cfg(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, num_warps=4)),
    (FP8, Config(dict(cfg(VARIANT="tma", PERSISTENT=True, BLOCK_K=128, num_stages=4), PROMOTE_TILES=2))),
    (FP8_DECODE, Config(dict(cfg(SCHEDULE="split_k", SPLIT_K=2, SWAP_AB=True, **DECODE_CFG), PROMOTE_TILES=2))),
    (FP8_FAST, cfg(VARIANT="tma", PERSISTENT=True, BLOCK_N=256, BLOCK_K=128)),
    (FP8_FAST, cfg(VARIANT="tma", SCHEDULE="stream_k", BLOCK_N=256, BLOCK_K=128)),
    (FP8_FAST, cfg(VARIANT="tma", PERSISTENT=True, BLOCK_N=256, BLOCK_K=128, EPILOGUE_SUBTILE=True, num_stages=4)),
    (FP8_ROW, Config(dict(cfg(SCHEDULE="stream_k", BLOCK_K=128), PROMOTE_TILES=1))),
    (FP8_BLOCK, cfg(VARIANT="tma", PERSISTENT=True, BLOCK_K=128, num_stages=4)),
    (FP8_BLOCK_DECODE, cfg(SCHEDULE="split_k", SPLIT_K=2, SWAP_AB=True, **DECODE_CFG)),
    (FP8_BLOCK, cfg(VARIANT="tma", SCHEDULE="stream_k", BLOCK_K=64, num_stages=4)),
    (ODD, cfg(SCHEDULE="stream_k", GROUP_M=1)),
]


def _id(case) -> str:
    p, c = case
    extra = f"-{p.scale_mode}{'-fast' if p.fp8_fast_accum else ''}" if p.dtype == "fp8" else "-tf32" if p.tf32 else ""
    return (f"{p.m}x{p.n}x{p.k}-{p.dtype}{extra}-{c['VARIANT']}-{c['SCHEDULE']}{'-swap' if c['SWAP_AB'] else ''}"
            f"{'-persistent' if c['PERSISTENT'] else ''}{'-ws' if c['WARP_SPECIALIZE'] else ''}"
            f"{'-flat' if c['FLATTEN'] else ''}{'-subtile' if c.get('EPILOGUE_SUBTILE') else ''}")


SM80 = [case for case in VARIANTS if case[1]["VARIANT"] == "blocked" and case[0].dtype != "fp8"]


# The policy's configs (what an untuned shape gets) for LLM projections in nn.Linear layout.
POLICY_SHAPES = [
    contiguous_problem(1, 4096, 4096, "bf16", "bf16", layout_b="col"),
    contiguous_problem(16, 28672, 4096, "bf16", "bf16", layout_b="col"),
    contiguous_problem(4, 3584, 18944, "bf16", "bf16", layout_b="col"),
    contiguous_problem(64, 6144, 4096, "bf16", "bf16", layout_b="col"),
    contiguous_problem(96, 4096, 14336, "bf16", "bf16", layout_b="col"),  # a 128-token streaming tile
    contiguous_problem(256, 4096, 14336, "bf16", "bf16", layout_b="col"),
    contiguous_problem(192, 512, 3584, "bf16", "bf16", layout_b="col"),  # swapped 16-token tiles (narrow weight)
    contiguous_problem(384, 1024, 4096, "bf16", "bf16", layout_b="col"),  # swapped 64-token tiles
    contiguous_problem(96, 1024, 5120, "bf16", "bf16", layout_b="col"),  # 32-token tiles split in two
    contiguous_problem(448, 1280, 5120, "bf16", "bf16", layout_b="col"),  # one wave of TMA tiles, narrow weight
    contiguous_problem(1032, 1024, 4096, "bf16", "bf16", layout_b="col"),  # one wave of 64 x 192 Gluon tiles
    contiguous_problem(2048, 4608, 3584, "bf16", "bf16", layout_b="col", bias=True),
    contiguous_problem(3000, 5000, 1536, "bf16", "bf16", layout_b="col"),
    contiguous_problem(4096, 4096, 4096, "fp8", "bf16", layout_b="col"),
    contiguous_problem(4096, 4096, 4096, "fp8", "bf16", layout_b="col", fp8_fast_accum=True),
    contiguous_problem(2048, 4096, 4096, "fp8", "bf16", layout_b="col", scale_mode="block"),
    contiguous_problem(1, 4096, 4096, "fp8", "bf16", layout_b="col", scale_mode="row"),
]


def _policy_id(p: GemmProblem) -> str:
    return f"{p.m}x{p.n}x{p.k}-{p.dtype}-{p.scale_mode}{'-fast' if p.fp8_fast_accum else ''}"


def _compile_one(job: tuple) -> tuple[str, dict]:
    name, problem, config, arch, device = job
    try:
        compiled = compile_for(problem, config, arch, device)
        ptx = compiled.asm["ptx"]
        return name, {"error": None, "wgmma": "wgmma.mma_async" in ptx, "mma_sync": "mma.sync" in ptx,
                      "scratch": compiled.metadata.global_scratch_size,
                      "ptxas": ptxas_report(compiled, arch) if name.startswith("policy-") else "",
                      "config": config.to_json()}
    except Exception as exc:  # noqa: BLE001 - reported per case by the tests
        return name, {"error": f"{type(exc).__name__}: {str(exc)[-3000:]}"}


def _compile_all() -> dict[str, dict]:
    """Per case: the compile error (or None), which MMAs the PTX uses, and (policy cases) ptxas's report."""
    jobs = [(f"sm90-{_id(c)}", c[0], c[1], 90, H200) for c in VARIANTS]
    jobs += [(f"sm80-{_id(c)}", c[0], c[1], 80, A100) for c in SM80]
    jobs += [(f"policy-{_policy_id(p)}", p, FAMILY.default_config(p, H200), 90, H200) for p in POLICY_SHAPES]
    return dict(map_in_processes(_compile_one, jobs))


@pytest.fixture(scope="module")
def compiled() -> dict[str, dict]:
    return run_compile_child(__file__, timeout=900)


@pytest.mark.parametrize("case", VARIANTS, ids=[_id(c) for c in VARIANTS])
def test_every_variant_compiles_for_sm90(compiled, case):
    problem, config = case
    FAMILY.space(problem, H200).validate(config)
    result = compiled[f"sm90-{_id(case)}"]
    assert result["error"] is None, result["error"]
    # The TMA descriptors are kernel parameters built on the host: no kernel takes scratch memory at each launch.
    assert result["scratch"] == 0, result
    if problem.dtype != "fp32" and (config["SWAP_AB"] or config["BLOCK_M"] >= 64):
        # A warpgroup's MMA covers 64 rows: enough rows (or N on that side) runs Hopper's asynchronous wgmma.
        assert result["wgmma"], "expected wgmma.mma_async in the PTX"


@pytest.mark.parametrize("case", SM80, ids=[_id(c) for c in SM80])
def test_pointer_variants_compile_for_sm80(compiled, case):
    result = compiled[f"sm80-{_id(case)}"]
    assert result["error"] is None, result["error"]
    assert result["mma_sync"] or case[0].dtype == "fp32"


@pytest.mark.parametrize("problem", POLICY_SHAPES, ids=_policy_id)
def test_policy_configs_compile_without_spills_or_serialised_mma(compiled, problem):
    result = compiled[f"policy-{_policy_id(problem)}"]
    assert result["error"] is None, result["error"]
    report = result["ptxas"]
    registers = int(re.search(r"Used (\d+) registers", report).group(1))
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", report)]
    assert not any(spills), f"{result['config']}: ptxas spills registers ({registers} used):\n{report}"
    assert "C7515" not in report and "C7517" not in report, f"{result['config']}: wgmma serialised:\n{report}"


def test_the_cpu_device_matches_the_h200_space():
    # The interpreter's constraints count an H200's SMs and shared memory: the same configs are feasible, but for
    # the Gluon variant, which the interpreter does not run.
    problem = contiguous_problem(64, 4096, 4096, "bf16", "bf16", layout_b="col")
    h200 = {c for c in FAMILY.space(problem, H200).feasible() if c["VARIANT"] != "gluon_ws"}
    assert set(FAMILY.space(problem, interpret_device()).feasible()) == h200


if __name__ == "__main__":
    print(json.dumps(_compile_all()))
