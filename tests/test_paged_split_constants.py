"""The balanced scheduler's constants overridden per launch (SplitConstants): the device follows the host mirror
(balanced_schedule), results still match a float64 reference, the default path is the module's constants, and
the kernel compiles for sm90 with other constants. Kernels run under Triton's CPU interpreter; the compile runs
in a child process (see compile_child.py).
"""
from __future__ import annotations

import json
import os

import torch

# Run as a script, this module is the compile child: Triton must not be in interpreter mode there.
COMPILE_CHILD = __name__ == "__main__"
if not torch.cuda.is_available() and not COMPILE_CHILD:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from compile_child import run_compile_child  # noqa: E402

from autotile.errors import BadInputError  # noqa: E402
from autotile.families import paged  # noqa: E402
from autotile.families.paged import (  # noqa: E402
    FAMILY, SplitConstants, balanced_max_chunks, balanced_schedule, cdiv, paged_launch,
)
from autotile.runtime.paged_plan import plan_paged_attention  # noqa: E402

BALANCED = dict(VARIANT="balanced", BLOCK_N=32, PARTITION_SIZE=256, num_warps=4, num_stages=2)
LENGTHS, HEADS_Q, HEADS_KV, DIM, NUM_SMS = [900, 12, 0, 450, 64], 4, 2, 64, 12


def test_bad_constants_are_refused_with_what_to_pass():
    for bad in ({"items_per_sm": 0}, {"margin_pct": 99}, {"candidates": 6}, {"overhead_tokens": -1},
                {"items_per_sm": True}, {"items_per_sm": 8.0}):
        with pytest.raises(BadInputError, match="split constant"):
            SplitConstants.of(bad)
    with pytest.raises(BadInputError, match="unknown split constants"):
        SplitConstants.of({"SPLIT_ITEMS_PER_SM": 8})
    with pytest.raises(BadInputError, match="split_constants must be"):
        SplitConstants.of((8, 128))
    with pytest.raises(BadInputError, match="margin_pct"):
        plan_paged_attention(batch=1, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16, max_context=512,
                             dtype=torch.float16, device="cpu", config=BALANCED, split_constants={"margin_pct": 50})


def test_the_default_path_is_the_module_constants():
    defaults = SplitConstants()
    assert (defaults.items_per_sm, defaults.overhead_tokens, defaults.margin_pct, defaults.candidates) == (
        paged.SPLIT_ITEMS_PER_SM, paged.SPLIT_OVERHEAD_TOKENS, paged.SPLIT_MARGIN_PCT, paged.SPLIT_CANDIDATES)
    plan = plan_paged_attention(batch=5, num_q_heads=HEADS_Q, num_kv_heads=HEADS_KV, head_dim=DIM, page_size=16,
                                max_context=1024, dtype=torch.float16, device="cpu", config=BALANCED,
                                num_sms=NUM_SMS)
    launch = plan.launch
    assert launch.split_constants == defaults
    assert launch._schedule_constants == dict(SPLIT_CANDIDATES=paged.SPLIT_CANDIDATES,
                                              SPLIT_OVERHEAD=paged.SPLIT_OVERHEAD_TOKENS,
                                              SPLIT_MARGIN_PCT=paged.SPLIT_MARGIN_PCT)
    assert launch.max_chunks == 5 + cdiv(paged.SPLIT_ITEMS_PER_SM * NUM_SMS, HEADS_KV)
    # The cached launches: None and the explicit defaults are one entry; other constants another.
    device = torch.device("cpu")
    assert paged_launch(plan.problem, plan.config, device, num_sms=NUM_SMS) is paged_launch(
        plan.problem, plan.config, device, num_sms=NUM_SMS, split_constants=SplitConstants())
    other = paged_launch(plan.problem, plan.config, device, num_sms=NUM_SMS, split_constants={"items_per_sm": 2})
    assert other is not paged_launch(plan.problem, plan.config, device, num_sms=NUM_SMS)
    assert other.max_chunks == 5 + cdiv(2 * NUM_SMS, HEADS_KV)
    for lengths in ([32768], [4096] * 64, [32768] + [300] * 15, LENGTHS):
        assert balanced_schedule(lengths, 8, 132, 256) == balanced_schedule(lengths, 8, 132, 256, defaults)


def test_overrides_move_the_host_schedule_as_the_cost_model_says():
    # A grid of one item per SM cannot hold 64 chunks of one 32k sequence: 1 + 132 / 8 rounded up = 18 at most.
    assert sum(balanced_schedule([32768], 8, 132, 256, {"items_per_sm": 1})) <= 18
    assert balanced_max_chunks(1, 8, 132, {"items_per_sm": 1}) == 18
    # An item overhead of 2**20 tokens outweighs anything a split saves: nothing is cut.
    assert balanced_schedule([32768], 8, 132, 256, {"overhead_tokens": 1 << 20}) == [1]
    # Two candidates: no split, or chunks of exactly PARTITION_SIZE.
    assert balanced_schedule([32768], 8, 132, 256, {"candidates": 2, "items_per_sm": 32}) == [128]


def _override_cases() -> list[dict]:
    """Constant sets that cut LENGTHS differently from the defaults (checked, so the test cannot pass vacuously)."""
    # Coarser chunks on a smaller grid; and no split at all (the combine kernel then merges nothing).
    cases = [{"overhead_tokens": 256, "margin_pct": 100, "items_per_sm": 3}, {"margin_pct": 150, "candidates": 4}]
    default = balanced_schedule(LENGTHS, HEADS_KV, NUM_SMS, 256)
    for case in cases:
        assert balanced_schedule(LENGTHS, HEADS_KV, NUM_SMS, 256, case) != default, case
    return cases


@pytest.mark.parametrize("constants", _override_cases(), ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_device_follows_the_host_mirror_and_matches_the_reference(constants):
    from test_paged_plan import PagedBatch, assert_close, tolerance  # float64 reference over a shuffled pool

    data = PagedBatch(LENGTHS, heads_q=HEADS_Q, heads_kv=HEADS_KV, dim=DIM, page_size=16, seed=3)
    plan = plan_paged_attention(batch=len(LENGTHS), num_q_heads=HEADS_Q, num_kv_heads=HEADS_KV, head_dim=DIM,
                                page_size=16, max_context=1024, dtype=torch.float16, device="cpu", config=BALANCED,
                                num_sms=NUM_SMS, return_lse=True, split_constants=constants)
    chunks = balanced_schedule(LENGTHS, HEADS_KV, NUM_SMS, 256, constants)
    assert plan.launch.max_chunks == balanced_max_chunks(len(LENGTHS), HEADS_KV, NUM_SMS, constants)
    workspace = plan.launch.workspace
    workspace.fill_(float("nan"))
    out, lse = plan.run(data.q[:, 0], data.k_cache, data.v_cache, data.block_table, data.context_lens)
    # The workspace slots the device wrote are the chunks of the sequences the mirror splits.
    rows = plan.problem.rows
    maxima = workspace[:plan.launch.max_chunks * HEADS_KV * rows].view(-1, HEADS_KV, rows)
    written = {c for c in range(maxima.shape[0]) if not torch.isnan(maxima[c]).all()}
    ends = torch.tensor(chunks).cumsum(0).tolist()
    assert written == {c for b, n in enumerate(chunks) if n > 1 for c in range(ends[b] - n, ends[b])}
    # The chunk size the device chose (log2, -1: no split) gives the mirror's counts.
    shift = int(plan.launch.schedule[0])
    device_chunks = [1 if shift < 0 else max(cdiv(n, 1 << shift), 1) for n in LENGTHS]
    assert device_chunks == chunks
    want, want_lse = data.reference(1 / DIM ** 0.5)
    assert_close(out[:, None], want, tolerance("fp16"), "out")
    assert_close(lse[:, None], want_lse, 1e-4, "lse")


# --- sm90 compile with non-default constants (child process) -------------------------------------------

COMPILE_CASES = {"overhead32-margin100-c16": dict(overhead_tokens=32, margin_pct=100, candidates=16),
                 "overhead256-margin125-c4": dict(overhead_tokens=256, margin_pct=125, candidates=4)}


def compile_balanced(constants: dict, *, cc: int = 90) -> dict:
    """Compile paged_attention_balanced (Llama-3 shapes: G 4, D 128, bf16) for `cc` with these constants."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    switches = dict(VARIANT="balanced", FP8_SCALES=False, WRITE_LSE=False, UPCAST_DOTS=False)
    kernel = paged._kernel_module(FAMILY.template, False, tuple(sorted(switches.items()))).paged_attention_balanced
    constexprs = dict(PAGE_SIZE=16, HEAD_DIM=128, GROUP=4, NUM_QUERIES=1, ROWS=16, BLOCK_N=64, PARTITION_SIZE=256,
                      BATCH_PAD=64, **SplitConstants.of(constants).kernel_constants())
    pointers = dict(q_ptr="bf16", out_ptr="bf16", k_ptr="bf16", v_ptr="bf16", block_table_ptr="i32",
                    context_lens_ptr="i32", schedule_ptr="i32")
    signature, attrs = {}, {}
    for index, param in enumerate(kernel.params):
        if param.is_constexpr:
            signature[param.name] = "constexpr"
        elif param.name.endswith("_ptr"):
            signature[param.name] = "*" + pointers.get(param.name, "fp32")
            attrs[(index,)] = [["tt.divisibility", 16]]
        else:
            signature[param.name] = "fp32" if param.name == "scale" else "i32"
            if param.name.startswith("stride"):  # as Triton specialises real launches: 16-element rows
                attrs[(index,)] = [["tt.divisibility", 16]]
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs),
                              target=GPUTarget("cuda", cc, 32), options={"num_warps": 2, "num_stages": 2})
    return dict(shared=compiled.metadata.shared, cp_async="cp.async" in compiled.asm["ptx"])


def test_balanced_kernel_compiles_for_sm90_with_other_constants():
    results = run_compile_child(__file__, timeout=300)
    assert set(results) == set(COMPILE_CASES)
    for case, facts in results.items():
        assert facts["shared"] <= 232448, f"{case} needs {facts['shared']} B of shared memory"
        assert facts["cp_async"], f"{case}: K/V tiles are not loaded ahead of use"


if __name__ == "__main__":
    print(json.dumps({case: compile_balanced(constants) for case, constants in COMPILE_CASES.items()}))
