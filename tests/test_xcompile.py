"""Cross-compiling every family for every profile's architecture, on a CPU machine (autotile.xcompile).

The compile check runs in one child process (with a pool of two): this test process imported Triton with
TRITON_INTERPRET=1, and Triton fixes at import whether its language helpers compile. For each profile's
architecture (sm80: A100, sm89: L40S, sm90: H200) it compiles the default, the seeds and a covering sample
of the space of a few representative problems per family, with Triton's own ptxas, and checks that each
kernel fits the profile's shared memory. The plan below keeps it near two minutes on two CI cores (flash
compiles take 3-10 s each: its seeds are compiled where shared memory is tightest, the L40S's 99 KiB);
`python -m autotile.xcompile --sample N` runs the same check on as many configs as wanted.
"""
from __future__ import annotations

import dataclasses
import json
import time

import pytest
from compile_child import run_compile_child
import torch

from autotile.device import DeviceInfo, meta_stands_for, planned_device
from autotile.errors import DeviceMismatchError
from autotile.families import get_family
from autotile.launch import compile_instead
from autotile.xcompile import (
    CrossCompileError, covering_sample, meta_inputs, meta_like, representative_problems, require_compiler_mode,
)

# (family, index into representative_problems()[family], profile, with seeds, covering sample size).
# Seeds are split between sm80 and sm89 where the two compile the same instructions, and compiled where
# shared memory is tightest (the L40S) for flash; the flash backward (three kernels, ~10 s) on the L40S only
# (tests/test_flash_compile.py compiles it for sm90). The whole list: 95-110 configs.
PLAN = [
    *[("gemm", i, "a100", i in (0, 2), 1) for i in range(3)],
    *[("gemm", i, "l40s", i in (1, 3), 1) for i in range(4)],
    *[("gemm", i, "h200", False, 1) for i in range(4)],
    ("flash", 0, "a100", True, 0), ("flash", 1, "a100", False, 0),
    ("flash", 0, "l40s", True, 1), ("flash", 1, "l40s", False, 0), ("flash", 2, "l40s", True, 0),
    ("flash", 3, "l40s", True, 0),
    *[("flash", i, "h200", False, 0) for i in range(3)],
    ("paged", 0, "a100", True, 0), ("paged", 1, "a100", True, 0),
    *[("paged", i, "l40s", True, 0) for i in range(3)],
    *[("paged", i, "h200", False, 1) for i in range(3)],
    ("elementwise", 1, "a100", True, 1), ("elementwise", 1, "l40s", False, 1), ("elementwise", 1, "h200", False, 1),
]


def _jobs() -> list[tuple]:
    from autotile.xcompile import plan_jobs

    problems = representative_problems()
    jobs = []
    for family, index, gpu, seeds, sample in PLAN:
        jobs += plan_jobs([family], [planned_device(gpu)], sample, seed=0,
                          problems={family: [problems[family][index]]}, seeds=seeds)
    return jobs


def _run_as_probe() -> dict:
    """What run_as hands the driver, without a GPU: CompiledKernel's launch replaced by a recorder."""
    from triton.compiler.compiler import CompiledKernel

    from autotile.xcompile import run_as

    calls = []

    def recorder(self, grid):
        def runner(*args):
            calls.append({"name": self.name, "head": self.kernel[:400].decode(errors="replace"),
                          "nul": self.kernel.endswith(b"\0"), "grid": list(grid), "args": len(args),
                          "params": len(self.src.fn.params)})
        return runner

    family = get_family("elementwise")
    problem = representative_problems()["elementwise"][1]
    inputs = meta_inputs(family, problem)
    outputs = family.allocate_outputs(problem, inputs)
    original = CompiledKernel.__getitem__
    CompiledKernel.__getitem__ = recorder
    try:
        with meta_stands_for(planned_device("a100")), run_as((8, 0)) as hook:
            family.launch(problem, family.default_config(problem, planned_device("a100")), inputs, outputs)
            family.launch(problem, family.default_config(problem, planned_device("a100")), inputs, outputs)
    finally:
        CompiledKernel.__getitem__ = original
    return {"calls": calls, "launched": hook.launched, "kept": len(hook._kept)}


def _compile_all() -> dict:
    from autotile.xcompile import run_jobs, summary_table

    started = time.monotonic()
    jobs = _jobs()
    results = run_jobs(jobs, processes=2)
    return {"results": [dataclasses.asdict(r) for r in results], "run_as": _run_as_probe(),
            "table": summary_table(results), "seconds": time.monotonic() - started}


@pytest.fixture(scope="module")
def compiled() -> dict:
    return run_compile_child(__file__, timeout=900)


def test_every_planned_config_compiles_and_fits_its_architecture(compiled):
    results = compiled["results"]
    print(f"\n{compiled['table']}\n{len(results)} configs in {compiled['seconds']:.0f} s")
    failed = [f"{r['family']} {r['device_key']} {r['role']} {r['problem_key']} {r['config']}\n    {r['error']}"
              for r in results if r["error"]]
    assert not failed, "\n".join(failed)
    covered = {(r["family"], r["device_key"].split("/")[1], r["role"]) for r in results}
    for family in ("gemm", "flash", "paged", "elementwise"):
        for arch in ("sm80", "sm89", "sm90"):
            assert (family, arch, "default") in covered, (family, arch)
        assert {(family, arch, "seed") for arch in ("sm80", "sm89")} & covered, family
        assert any(key[0] == family and key[2] == "sample" for key in covered), family


def test_older_architectures_get_their_own_instructions(compiled):
    by_arch: dict[str, set] = {}
    for r in compiled["results"]:
        for kernel in r["kernels"]:
            by_arch.setdefault(r["device_key"].split("/")[1], set()).update(kernel["ptx_features"])
    assert "wgmma" in by_arch["sm90"] and "tma" in by_arch["sm90"]
    for arch in ("sm80", "sm89"):
        assert "mma.sync" in by_arch[arch] and "cp.async" in by_arch[arch]
        assert not {"wgmma", "tma", "setmaxnreg"} & by_arch[arch], by_arch[arch]


def test_every_kernel_reports_its_shared_memory_and_registers(compiled):
    limits = {planned_device(g).key: planned_device(g).smem_per_block for g in ("a100", "l40s", "h200")}
    for r in compiled["results"]:
        assert r["kernels"], r
        for kernel in r["kernels"]:
            assert 0 <= kernel["shared"] <= limits[r["device_key"]]
            # ptxas' allotment, read back from the cubin: spills show as stack.
            assert 0 < kernel["registers"] <= 255 and kernel["stack"] >= 0, kernel


def test_run_as_hands_the_driver_ptx_for_the_older_architecture(compiled):
    probe = compiled["run_as"]
    assert probe["launched"] == ["elementwise_kernel"] * 2 and probe["kept"] == 1  # compiled once, launched twice
    for call in probe["calls"]:
        assert call["name"] == "elementwise_kernel" and call["nul"]
        assert ".target sm_80" in call["head"] and len(call["grid"]) == 3
        assert call["args"] == call["params"]  # every parameter, constexprs included, as JITFunction.run passes


# --- in this process: no compiler needed ---------------------------------------------------------------

def test_meta_tensors_keep_shape_strides_offset_and_alignment():
    base = torch.empty(4 * 7 + 1, dtype=torch.float16)
    unaligned = base[1:].view(4, 7).t()
    meta = meta_like(unaligned)
    assert meta.device.type == "meta" and meta.dtype == torch.float16
    assert (meta.shape, meta.stride(), meta.storage_offset()) == (unaligned.shape, unaligned.stride(), 1)
    assert meta.data_ptr() % 16 == 2  # one fp16 element past a 16-byte boundary, as the CPU tensor's layout says
    scalar = torch.tensor(0.5, dtype=torch.float64)
    assert meta_like(scalar) is scalar  # host-side scalars stay readable


@pytest.mark.parametrize("varlen,aligned", [(False, True), (False, False), (True, True)])
def test_the_flash_backward_compiles_from_its_inputs_layout_without_running_attention(varlen, aligned, monkeypatch):
    from autotile.device import interpret_device
    from autotile.families.flash import FlashProblem

    family = get_family("flash")
    problem = FlashProblem("bwd", 2, 4, 2, 67, 131, 64, causal=True, aligned=aligned, varlen=varlen)
    real = family.make_inputs(problem, interpret_device())
    # The layout alone never computes the forward (seconds to a minute of CPU at long sequences).
    monkeypatch.setattr(type(family), "_attend", lambda *a, **k: pytest.fail("attention computed for a layout"))
    layout = family.make_layout_inputs(problem, interpret_device())
    meta = meta_inputs(family, problem)
    assert set(layout) == set(real) == set(meta)
    for name, tensor in real.items():
        for other in (layout[name], meta[name]):
            assert (other.shape, other.stride(), other.dtype) == (tensor.shape, tensor.stride(), tensor.dtype), name
            assert other.storage_offset() == tensor.storage_offset(), name


def test_meta_tensors_need_a_device_to_stand_for():
    with pytest.raises(DeviceMismatchError, match="meta"):
        from autotile.device import current_device

        current_device(torch.device("meta"))
    with meta_stands_for(planned_device("l40s")) as device:
        from autotile.device import current_device

        assert current_device(torch.device("meta")) is device


@pytest.mark.parametrize("family_name, index, kernels", [
    ("gemm", 1, ["gemm_kernel"]),
    ("flash", 3, ["attn_bwd_preprocess", "attn_bwd_dkdv", "attn_bwd_dq"]),
    ("paged", 1, ["paged_prefill_kernel"]),
    ("elementwise", 1, ["elementwise_kernel"]),
])
def test_compile_instead_sees_every_launch_with_gpu_render_switches(family_name, index, kernels):
    family = get_family(family_name)
    problem = representative_problems()[family_name][index]
    device = planned_device("a100")
    seen = []

    def record(kernel, grid, args, kwargs):
        seen.append((kernel.__name__, kernel.fn.__module__, grid, args, kwargs))

    inputs = meta_inputs(family, problem)
    outputs = family.allocate_outputs(problem, inputs)
    with meta_stands_for(device), compile_instead(record):
        family.launch(problem, family.default_config(problem, device), inputs, outputs)
    assert [name for name, *_ in seen] == kernels
    for name, module, grid, args, kwargs in seen:
        # Rendered for the compiler (autotile_kernels.cuda_*), never the interpreter's upcast dots.
        assert module.startswith("autotile_kernels.cuda_"), module
        assert all(not isinstance(a, torch.Tensor) or a.device.type in ("meta", "cpu") for a in args)
        assert "num_warps" in kwargs and all(g >= 1 for g in grid)


def test_covering_sample_takes_every_structural_value():
    family = get_family("gemm")
    problem = representative_problems()["gemm"][0]
    space = family.space(problem, planned_device("h200"))
    sample = covering_sample(space, 8, seed=3)
    assert len(sample) == 8 and len(set(sample)) == 8 and all(space.is_feasible(c) for c in sample)
    feasible = list(space.feasible())  # ~30k configs: enumerated once for every axis
    for axis in ("VARIANT", "SCHEDULE", "PERSISTENT", "WARP_SPECIALIZE", "FLATTEN"):
        assert {c[axis] for c in sample} == {c[axis] for c in feasible}, axis


def test_cross_compiling_refuses_the_interpreter_and_an_interpreted_triton(monkeypatch):
    import triton.language.standard as standard
    from triton.runtime.interpreter import InterpretedFunction

    from autotile.device import interpret_device
    from autotile.xcompile import compile_config

    family = get_family("elementwise")
    problem = representative_problems()["elementwise"][0]
    with pytest.raises(CrossCompileError, match="interpreter compiles nothing"):
        compile_config(family, problem, family.default_config(problem, interpret_device()), interpret_device())
    # What Triton's helpers are when it was imported with TRITON_INTERPRET=1.
    monkeypatch.setattr(standard, "cdiv", InterpretedFunction(standard.cdiv.fn))
    with pytest.raises(CrossCompileError, match="TRITON_INTERPRET=1"):
        require_compiler_mode()


def test_an_unknown_gpu_is_compiled_for_its_own_architecture():
    from autotile.xcompile import gpu_target

    rtx = DeviceInfo("other:geforce-rtx-3090", "NVIDIA GeForce RTX 3090", (8, 6), 82, 24 * 10**9, 101376, "test")
    assert (gpu_target(rtx.compute_capability).arch, gpu_target((9, 0)).arch) == (86, 90)


if __name__ == "__main__":
    print(json.dumps(_compile_all()))


def test_spills_count_inside_wgmma_loops_only():
    """sass_mma_loop_spills reads loops from backward branches; a barrier wait's retry path after the last EXIT,
    which branches back into the kernel, is no loop."""
    from autotile.xcompile import sass_mma_loop_spills

    def sass(*lines):
        return "\n".join(f"        /*{16 * i:04x}*/  {text} ;" for i, text in enumerate(lines))

    in_loop = sass("LDL R2, [R1]", "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ", "LDL R3, [R1+0x4]",
                   "@P0 BRA 0x10", "EXIT", "BRA 0x50")
    assert sass_mma_loop_spills(in_loop) == 1  # the LDL before the loop is once a run
    outside = sass("LDL R2, [R1]", "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ", "@P0 BRA 0x10", "EXIT",
                   "LDL R3, [R1+0x4]", "BRA 0x0")
    assert sass_mma_loop_spills(outside) == 0
    assert sass_mma_loop_spills(sass("LDL R2, [R1]", "@P0 BRA 0x0", "EXIT")) is None  # no wgmma loop
