"""Every paged kernel compiles for Hopper (sm90) and Ampere (sm80) with Triton's own ptxas, on a machine without a GPU.

Arguments are specialised as Triton specialises real launches (pointers and strides divisible by 16), so
the checks also see what the GPU would run: K/V loads pipelined through cp.async, tensor-core dots
(wgmma on sm90) in the prefill kernel. The compiles run in one child process: the tests' own process has
triton's language helpers in interpreter mode (TRITON_INTERPRET=1, see conftest.py).
"""
from __future__ import annotations

import json
import re

import pytest
from compile_child import launch_signature, run_compile_child
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from autotile.families.paged import (
    FAMILY, SPLIT_CANDIDATES, SPLIT_MARGIN_PCT, SPLIT_OVERHEAD_TOKENS, PagedProblem,
    _kernel_module, combine_parts_block, prefetches_pages, shared_memory_bytes,
)

KERNELS = {
    "whole": ("paged_attention_kernel",),
    "split": ("paged_attention_kernel", "paged_attention_reduce"),
    "balanced": ("paged_attention_balanced", "paged_attention_combine"),
    "prefill": ("paged_prefill_kernel",),
}


def compile_variant(variant, *, cc=90, dtype="bf16", fp8=False, lse=False, head_dim=128, group=4, queries=1,
                    block_n=64, block_m=64, num_warps=4, num_stages=3, softcap=False, window=False):
    """Compile every kernel of a variant; returns {kernel name: CompiledKernel}."""
    switches = dict(VARIANT=variant, FP8_SCALES=fp8, WRITE_LSE=lse, UPCAST_DOTS=False,
                    PREFETCH_PAGES=prefetches_pages(num_stages), SOFTCAP=softcap, WINDOW=window)
    module = _kernel_module(FAMILY.template, False, tuple(sorted(switches.items())))
    kv = "fp8e4nv" if fp8 else dtype
    pointers = dict(q_ptr=dtype, out_ptr=dtype, k_ptr=kv, v_ptr=kv, block_table_ptr="i32", context_lens_ptr="i32",
                    cu_seqlens_q_ptr="i32", schedule_ptr="i32")
    constants = dict(PAGE_SIZE=16, HEAD_DIM=head_dim, GROUP=group, NUM_QUERIES=queries,
                     ROWS=max(16, triton.next_power_of_2(group * queries)), BLOCK_N=block_n, PARTITION_SIZE=256,
                     BLOCK_M=block_m, BATCH_PAD=64, PARTS_BLOCK=combine_parts_block(head_dim), PDL=cc >= 90,
                     SPLIT_CANDIDATES=SPLIT_CANDIDATES,
                     SPLIT_OVERHEAD=SPLIT_OVERHEAD_TOKENS, SPLIT_MARGIN_PCT=SPLIT_MARGIN_PCT)
    compiled = {}
    for name in KERNELS[variant]:
        kernel = getattr(module, name)
        signature, attrs = launch_signature(kernel, pointers)
        used = {n: constants[n] for n, kind in signature.items() if kind == "constexpr"}
        source = ASTSource(fn=kernel, signature=signature, constexprs=used, attrs=attrs)
        compiled[name] = triton.compile(source, target=GPUTarget("cuda", cc, 32),
                                        options={"num_warps": num_warps, "num_stages": num_stages})
    return compiled


CASES = {
    "whole-lse-d96": dict(variant="whole", lse=True, head_dim=96),
    "split-fp8": dict(variant="split", fp8=True, dtype="fp16"),
    "balanced-lse-d80-g16": dict(variant="balanced", lse=True, head_dim=80, group=16),
    "balanced-d256-q4": dict(variant="balanced", head_dim=256, block_n=32, num_stages=2, group=1, queries=4),
    "prefill-fp8-d96": dict(variant="prefill", head_dim=96, fp8=True, dtype="fp16", block_m=64, block_n=64),
    "prefill-d128": dict(variant="prefill", block_m=128, num_warps=8),
    "balanced-sm80": dict(variant="balanced", cc=80),
    "prefill-sm80": dict(variant="prefill", cc=80, block_m=128, num_warps=8),
    # Decode loops at the pipeline depths STAGE_CHOICES offers: the space's shared-memory model must be exact.
    "balanced-s2": dict(variant="balanced", num_stages=2),
    "balanced-s5": dict(variant="balanced", num_stages=5),
    "balanced-s4": dict(variant="balanced", num_stages=4),
    "whole-n128-s3": dict(variant="whole", block_n=128, num_stages=3),
    "split-d256-s5": dict(variant="split", head_dim=256, block_n=32, num_stages=5, group=8),
    "balanced-s5-sm80": dict(variant="balanced", cc=80, num_stages=5),
    # Model features (Gemma-2's soft-capping and window at its heads; a window alone elsewhere).
    "balanced-gemma2": dict(variant="balanced", head_dim=256, block_n=32, group=2, softcap=True, window=True),
    "split-window": dict(variant="split", window=True, lse=True),
    "whole-softcap-fp8": dict(variant="whole", softcap=True, fp8=True, dtype="fp16"),
    "prefill-gemma2": dict(variant="prefill", head_dim=256, block_m=64, block_n=64, num_stages=2, group=2,
                           softcap=True, window=True),
}
DECODE_MODEL_CASES = ("balanced-s2", "balanced-s5", "balanced-s4", "whole-n128-s3", "split-d256-s5",
                      "balanced-s5-sm80", "whole-lse-d96", "balanced-lse-d80-g16")


def compile_cases() -> dict:
    """{case: {kernel: {shared, ptx features}}}, compiled in this process (which must not be interpreting)."""
    results = {}
    for case, options in CASES.items():
        options = dict(options)
        variant = options.pop("variant")
        results[case] = {name: dict(shared=k.metadata.shared, cp_async="cp.async" in k.asm["ptx"],
                                    wgmma="wgmma" in k.asm["ptx"], mma_sync="mma.sync" in k.asm["ptx"],
                                    griddep=sorted(set(re.findall(r"griddepcontrol\.(\w+)", k.asm["ptx"]))))
                         for name, k in compile_variant(variant, **options).items()}
    return results


@pytest.fixture(scope="module")
def compiled() -> dict:
    return run_compile_child(__file__, timeout=600)


def test_every_kernel_compiles_within_the_shared_memory_of_its_gpu(compiled):
    assert set(compiled) == set(CASES)
    for case, kernels in compiled.items():
        limit = 166912 if CASES[case].get("cc") == 80 else 232448  # A100 163 KiB, H100/H200 227 KiB a block
        assert set(kernels) == set(KERNELS[CASES[case]["variant"]])
        for name, facts in kernels.items():
            assert facts["shared"] <= limit, f"{case} {name} needs {facts['shared']} B of shared memory"


def case_problem_and_config(case: str) -> tuple[PagedProblem, dict]:
    options = dict(dtype="bf16", head_dim=128, group=4, queries=1, block_n=64, num_stages=3, num_warps=4)
    options.update({k: v for k, v in CASES[case].items() if k not in ("cc", "lse", "fp8", "softcap", "window")})
    problem = PagedProblem(1, 8 * options["group"], 8, options["head_dim"], 16, 4096, 4096, options["queries"],
                           options["dtype"], options["dtype"])
    config = dict(VARIANT=options["variant"], BLOCK_N=options["block_n"], PARTITION_SIZE=256, BLOCK_M=16,
                  num_warps=options["num_warps"], num_stages=options["num_stages"])
    return problem, config


def test_the_space_knows_what_a_decode_program_allocates(compiled):
    # The decode loops' K/V buffers follow num_stages (decode_kv_buffers); the space must not
    # offer configs that do not fit, nor refuse deep pipelines that do.
    for case in DECODE_MODEL_CASES:
        problem, config = case_problem_and_config(case)
        main_kernel = KERNELS[config["VARIANT"]][0]
        assert compiled[case][main_kernel]["shared"] == shared_memory_bytes(problem, config), case
    # n stages keep n - 1 K/V tiles in flight (the page ids come from the step before): 4 at 5 stages.
    assert compiled["balanced-s5"]["paged_attention_balanced"]["shared"] > \
        3.5 * compiled["balanced-s2"]["paged_attention_balanced"]["shared"]


def test_the_gpu_code_pipelines_its_loads_and_uses_tensor_cores(compiled):
    balanced = compiled["balanced-lse-d80-g16"]["paged_attention_balanced"]
    assert balanced["cp_async"], "K/V tiles are not loaded ahead of use"
    hopper = compiled["prefill-d128"]["paged_prefill_kernel"]
    assert hopper["wgmma"] and hopper["cp_async"]
    ampere = compiled["prefill-sm80"]["paged_prefill_kernel"]
    assert ampere["mma_sync"] and ampere["cp_async"]


def test_the_combine_kernel_is_a_programmatic_dependent_launch_on_hopper(compiled):
    # sm90: the balanced kernel lets the combine launch early and the combine waits for its results;
    # sm80 has no griddepcontrol, so neither appears there.
    hopper = compiled["balanced-s2"]
    assert hopper["paged_attention_balanced"]["griddep"] == ["launch_dependents"]
    assert hopper["paged_attention_combine"]["griddep"] == ["wait"]
    for kernel in compiled["balanced-sm80"].values():
        assert kernel["griddep"] == []


if __name__ == "__main__":
    print(json.dumps(compile_cases()))
