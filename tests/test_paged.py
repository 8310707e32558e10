"""Paged decode attention under Triton's CPU interpreter, against references that never read a block table.

bf16 is checked on the GPU only (benchmarks/paged_bench.py): the interpreter's bf16 dot is wrong, and
the CPU path upcasts it, so a bf16 run here would not test the GPU's code.
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    # NOTE: the interpreter needs triton's own jit helpers (tl.zeros, tl.cdiv, ...) decorated in
    # interpreter mode, i.e. triton imported with TRITON_INTERPRET=1; torch.library may import triton first.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import autotile  # noqa: E402
from autotile.device import HOPPER_SMEM_PER_BLOCK, DeviceInfo, interpret_device  # noqa: E402
from autotile.errors import BadInputError, ShapeMismatchError, UnsupportedDtypeError  # noqa: E402
from autotile.families.paged import FAMILY, PagedProblem, cdiv  # noqa: E402
from autotile.kvcache import PagedKVCache  # noqa: E402
from autotile.runtime import ops_paged  # noqa: E402
from autotile.space import Config  # noqa: E402

CPU = interpret_device()
H200 = DeviceInfo("h200", "NVIDIA H200", (9, 0), 132, 150_000_000_000, HOPPER_SMEM_PER_BLOCK, "test")


def plain_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q (Q, Hq, D) the last Q positions of k, v (L, Hkv, D); float64 softmax attention, causal among the queries."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    logits = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    length, queries = k.shape[0], q.shape[0]
    hidden = torch.arange(length)[None, :] > (length - queries + torch.arange(queries))[:, None]
    logits = logits.masked_fill(hidden[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(logits, dim=-1), v)


def assert_close_to(got: torch.Tensor, want: torch.Tensor, problem: PagedProblem):
    from autotile.families.checks import compare

    result = compare("out", got, want, FAMILY.tolerance(problem))
    assert result.ok, result.message


# --- the op, fed by the cache manager, against contiguous copies kept on the side -------------------

def build_cache(lengths, page_size, heads, dim, dtype, seed=0, fork=None, **scales):
    """Sequences appended in interleaved chunks (so their pages are scattered), a few junk sequences
    allocated and freed in between (so pages are shuffled), and `fork=(parent, extra)` appending
    `extra` tokens to a fork of sequence `parent`. Returns the cache, ids and contiguous K/V copies."""
    gen = torch.Generator().manual_seed(seed)
    total_pages = sum(cdiv(n + 40, page_size) for n in lengths) + 16
    cache = PagedKVCache(num_layers=1, num_pages=total_pages, page_size=page_size, num_kv_heads=heads,
                         head_dim=dim, dtype=dtype, **scales)
    ids = list(range(len(lengths)))
    dense = {i: ([], []) for i in ids}
    for i in ids:
        cache.allocate(i)
    remaining = list(lengths)
    step = 0
    while any(remaining):
        for i in ids:
            n = min(remaining[i], 1 + (step * 7 + i * 3) % (2 * page_size))
            if n:
                k = torch.randn(n, heads, dim, generator=gen)
                v = torch.randn(n, heads, dim, generator=gen)
                cache.append(i, k, v)
                dense[i][0].append(k)
                dense[i][1].append(v)
                remaining[i] -= n
        junk = f"junk{step}"
        cache.allocate(junk)
        cache.append(junk, torch.randn(page_size + 1, heads, dim), torch.randn(page_size + 1, heads, dim))
        if step % 2:
            cache.free(junk)
        step += 1
    if fork is not None:
        parent, extra = fork
        child = len(ids)
        cache.fork(parent, child)
        k = torch.randn(extra, heads, dim, generator=gen)
        v = torch.randn(extra, heads, dim, generator=gen)
        cache.append(child, k, v)
        dense[child] = (dense[parent][0] + [k], dense[parent][1] + [v])
        ids.append(child)
    contiguous = {i: (torch.cat(ks), torch.cat(vs)) for i, (ks, vs) in dense.items()}
    return cache, ids, contiguous


@pytest.mark.parametrize("page_size", [8, 16])
def test_op_matches_contiguous_attention_for_awkward_lengths_and_forks(page_size):
    heads_q, heads_kv, dim = 8, 2, 64
    long = 5 * page_size + 3
    lengths = [1, page_size - 1, page_size, page_size + 1, long]
    # Sequence 4 (long, last page partly filled) is forked and the child grows past a page boundary.
    cache, ids, dense = build_cache(lengths, page_size, heads_kv, dim, torch.float16, fork=(4, page_size))
    assert cache.pages(5)[:4] == cache.pages(4)[:4]  # the child still shares the parent's full pages
    q = torch.randn(len(ids), heads_q, dim).half()
    table = cache.block_table(ids, max_pages=cdiv(long + page_size, page_size) + 2)
    out = autotile.paged_attention(q, cache.k_pools[0], cache.v_pools[0], table, cache.context_lens(ids))
    problem = ops_paged.problem_for(q, cache.k_pools[0], cache.v_pools[0], table, cache.context_lens(ids))[1]
    scale = dim ** -0.5
    want = torch.stack([plain_attention(q[i][None], k.half(), v.half(), scale)[0] for i, (k, v) in dense.items()])
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_close_to(out, want, problem)


def test_op_speculative_queries_and_fp8_cache_with_per_head_scales():
    heads_q, heads_kv, dim, page_size = 4, 1, 64, 16
    # Values are N(0, 1): |x| < 5, and 5 / 0.012 stays inside e4m3's range (448), so nothing saturates.
    k_scale, v_scale = torch.tensor([0.012]), torch.tensor([0.015])
    lengths = [3, 17, 40]
    cache, ids, dense = build_cache(lengths, page_size, heads_kv, dim, torch.float8_e4m3fn, seed=3,
                                    k_scale=k_scale, v_scale=v_scale)
    q = torch.randn(len(ids), 3, heads_q, dim).half()  # 3 speculative tokens: the last 3 positions
    table, lens = cache.block_table(ids), cache.context_lens(ids)
    out = autotile.paged_attention(q, cache.k_pools[0], cache.v_pools[0], table, lens,
                                   scale=0.1, k_scale=k_scale, v_scale=v_scale)
    want = []
    for i in ids:
        k, v = cache.gather(i)  # the stored e4m3 values: the reference sees what the kernel sees
        want.append(plain_attention(q[i], k.float() * k_scale, v.float() * v_scale, 0.1))
        # and those are the appended values up to e4m3 rounding (3 mantissa bits: 2**-4 relative)
        torch.testing.assert_close(k.float() * k_scale, dense[i][0], rtol=2**-4, atol=k_scale.item() * 2**-6)
    problem = ops_paged.problem_for(q, cache.k_pools[0], cache.v_pools[0], table, lens,
                                    k_scale=k_scale, v_scale=v_scale)[1]
    assert problem.num_queries == 3 and problem.kv_dtype == "fp8"
    assert_close_to(out, torch.stack(want), problem)


# --- the family: every variant and structural switch against its de-paging reference --------------

CASES = [
    # (problem, config): GQA/MQA/MHA, head dims 64/128/256, pages 8..128, split with a ragged batch,
    # speculative queries where a query sees nothing of the last partition, fp8, bf16 (upcast on CPU),
    # the balanced variant, and a prefill chunk of 24 query tokens per sequence.
    (PagedProblem(3, 8, 2, 64, 16, 70, 40, dtype="fp16", kv_dtype="fp16"),
     dict(VARIANT="whole", BLOCK_N=32, PARTITION_SIZE=256, num_warps=4, num_stages=2)),
    (PagedProblem(2, 8, 1, 64, 8, 600, 300, dtype="fp16", kv_dtype="fp16"),
     dict(VARIANT="split", BLOCK_N=32, PARTITION_SIZE=256, num_warps=4, num_stages=2)),
    (PagedProblem(2, 4, 2, 64, 16, 514, 300, num_queries=4, dtype="fp16", kv_dtype="fp16"),
     dict(VARIANT="split", BLOCK_N=64, PARTITION_SIZE=256, num_warps=4, num_stages=2)),
    (PagedProblem(2, 4, 4, 128, 32, 50, 30, num_queries=2, dtype="fp16", kv_dtype="fp8"),
     dict(VARIANT="whole", BLOCK_N=16, PARTITION_SIZE=256, num_warps=2, num_stages=1)),
    (PagedProblem(2, 2, 1, 256, 128, 300, 200, dtype="fp16", kv_dtype="fp16"),
     dict(VARIANT="whole", BLOCK_N=32, PARTITION_SIZE=256, num_warps=4, num_stages=3)),
    (PagedProblem(2, 4, 2, 128, 32, 70, 40, dtype="bf16", kv_dtype="bf16"),
     dict(VARIANT="whole", BLOCK_N=64, PARTITION_SIZE=256, num_warps=4, num_stages=3)),
    (PagedProblem(2, 8, 2, 96, 16, 600, 400, dtype="fp16", kv_dtype="fp16"),
     dict(VARIANT="balanced", BLOCK_N=32, PARTITION_SIZE=256, num_warps=4, num_stages=2)),
    (PagedProblem(2, 8, 2, 64, 16, 80, 60, num_queries=24, dtype="fp16", kv_dtype="fp16"),
     dict(VARIANT="prefill", BLOCK_N=32, PARTITION_SIZE=256, BLOCK_M=32, num_warps=4, num_stages=2)),
]


@pytest.mark.parametrize("problem,config", CASES, ids=lambda x: str(x.__dict__ if hasattr(x, "__dict__") else x))
def test_family_matches_reference(problem, config):
    space = FAMILY.space(problem, CPU)
    assert space.is_feasible(config), space.violations(config)
    inputs = FAMILY.make_inputs(problem, CPU, seed=7)
    outputs = FAMILY.allocate_outputs(problem, inputs)
    outputs["out"].fill_(float("nan"))  # every element must be written
    FAMILY.launch(problem, Config(config), inputs, outputs)
    result = FAMILY.check(problem, inputs, outputs, FAMILY.reference(problem, inputs))
    assert result.ok, result.message


def test_make_inputs_scatters_pages_among_pages_of_others():
    problem = PagedProblem(4, 8, 2, 64, 16, 100, 60, dtype="fp16", kv_dtype="fp16")
    inputs = FAMILY.make_inputs(problem, CPU)
    lengths = inputs["context_lens"].tolist()
    assert max(lengths) == 100 and len(set(lengths)) > 1
    owned = torch.cat([inputs["block_table"][b, :cdiv(n, 16)] for b, n in enumerate(lengths)])
    assert len(set(owned.tolist())) == owned.numel()  # no page owned twice
    assert owned.numel() < inputs["k_cache"].shape[0]  # the pool holds pages of no sequence here
    assert not torch.equal(owned, owned.sort().values)  # pages are shuffled
    assert (inputs["k_cache"] != 0).float().mean() > 0.99 and (inputs["v_cache"] != 0).float().mean() > 0.99


def test_a_wrong_page_fails_the_check_and_names_the_worst_element():
    problem, config = CASES[0]
    inputs = FAMILY.make_inputs(problem, CPU, seed=1)
    expected = FAMILY.reference(problem, inputs)
    wrong = dict(inputs, block_table=inputs["block_table"].clone())
    wrong["block_table"][1, 0] = wrong["block_table"][2, 0]  # sequence 1 reads one page of sequence 2
    outputs = FAMILY.allocate_outputs(problem, wrong)
    FAMILY.launch(problem, Config(config), wrong, outputs)
    result = FAMILY.check(problem, wrong, outputs, expected)
    assert not result.ok and "worst at (1, 0," in result.message


# --- the search space and defaults ------------------------------------------------------------------

def test_default_configs_are_feasible_and_split_few_long_sequences():
    for problem in FAMILY.default_suite():
        config = FAMILY.default_config(problem, H200)
        assert FAMILY.space(problem, H200).is_feasible(config)
    long_few = PagedProblem(8, 64, 8, 128, 16, 32768)
    many_short = PagedProblem(256, 32, 8, 128, 16, 1024)
    assert FAMILY.default_config(long_few, H200)["VARIANT"] == "balanced"
    assert FAMILY.default_config(many_short, H200)["VARIANT"] == "whole"
    chunk = PagedProblem(4, 32, 8, 128, 16, 4096, num_queries=512)
    assert FAMILY.default_config(chunk, H200)["VARIANT"] == "prefill"


def test_space_prunes_infeasible_configs_with_named_reasons():
    problem = PagedProblem(8, 64, 8, 256, 16, 32768)
    space = FAMILY.space(problem, H200)
    too_big = dict(VARIANT="whole", BLOCK_N=256, PARTITION_SIZE=256, num_warps=8, num_stages=4)
    assert any(v.startswith("shared_memory") for v in space.violations(too_big))
    stray = dict(VARIANT="whole", BLOCK_N=64, PARTITION_SIZE=1024, num_warps=4, num_stages=2)
    assert any(v.startswith("partition_split_only") for v in space.violations(stray))
    short = PagedProblem(8, 64, 8, 128, 16, 300)
    split = dict(VARIANT="split", BLOCK_N=64, PARTITION_SIZE=512, num_warps=4, num_stages=2)
    assert any(v.startswith("split_has_partitions") for v in FAMILY.space(short, H200).violations(split))
    assert 20 < sum(1 for _ in space.feasible()) < 600


def test_runtime_problems_bucket_context_lengths():
    def problem_of(lengths):
        q = torch.randn(len(lengths), 8, 64).half()
        cache = torch.randn(64, 16, 2, 64).half()
        table = torch.arange(len(lengths) * 16, dtype=torch.int32).reshape(len(lengths), 16) % 64
        return ops_paged.problem_for(q, cache, cache, table, torch.tensor(lengths, dtype=torch.int32))[1]

    a, b = problem_of([200, 150, 190]), problem_of([250, 180, 160])
    assert FAMILY.problem_key(a) == FAMILY.problem_key(b)
    assert (a.max_context, a.mean_context) == (256, 256)
    assert problem_of([250, 10, 10]).mean_context == 128


def test_cli_problems_default_to_the_anchor_suite():
    assert FAMILY.problems_from_cli() == FAMILY.default_suite()
    assert len(FAMILY.default_suite()) == 4
    problems = FAMILY.problems_from_cli(batch=(4, 8), context=(1000,), kv_dtype="fp8", dtype="fp16")
    assert [p.batch for p in problems] == [4, 8] and problems[0].kv_dtype == "fp8"
    with pytest.raises(BadInputError, match="both --batch and --context"):
        FAMILY.problems_from_cli(batch=(4,))


def test_cost_counts_kv_bytes_once():
    problem = PagedProblem(64, 32, 8, 128, 16, 4096)
    kv = 2 * 64 * 4096 * 8 * 128 * 2
    assert kv <= FAMILY.cost(problem).bytes < 1.01 * kv


# --- bad input ------------------------------------------------------------------------------------

def _good_args():
    q = torch.randn(2, 4, 64).half()
    cache = torch.randn(8, 16, 2, 64).half()
    table = torch.tensor([[0, 3], [5, 1]], dtype=torch.int32)
    return [q, cache, cache.clone(), table, torch.tensor([20, 9], dtype=torch.int32)]


@pytest.mark.parametrize("position,bad,error,message", [
    (0, torch.randn(2, 64).half(), ShapeMismatchError, "q must be"),
    (0, torch.randn(2, 3, 64).half(), ShapeMismatchError, "multiple of Hkv"),
    (0, torch.randn(2, 4, 64), UnsupportedDtypeError, "q must be one of"),
    (1, torch.randn(8, 16, 2, 64).bfloat16(), UnsupportedDtypeError, "k_cache is"),
    ((1, 2), torch.randn(8, 16, 2, 32).half(), ShapeMismatchError, "head dim"),
    (2, torch.randn(8, 8, 2, 64).half(), ShapeMismatchError, "one shape"),
    (3, torch.tensor([[0, 3], [5, 1]], dtype=torch.int64), UnsupportedDtypeError, "int32"),
    (3, torch.tensor([[0], [5]], dtype=torch.int32), ShapeMismatchError, "widen the table"),
    (3, torch.tensor([[0, 8], [5, 1]], dtype=torch.int32), BadInputError, "page 8 within the contexts"),
    (3, torch.tensor([[0, 3], [-1, 1]], dtype=torch.int32), BadInputError, "page -1 within the contexts"),
    (4, torch.tensor([20, -1], dtype=torch.int32), ShapeMismatchError, "negative length"),
    (4, torch.tensor([20, 9, 3], dtype=torch.int32), ShapeMismatchError, "context_lens must be"),
])
def test_bad_input_raises_autotile_errors(position, bad, error, message):
    args = _good_args()
    for index in position if isinstance(position, tuple) else (position,):
        args[index] = bad
    with pytest.raises(error, match=message):
        autotile.paged_attention(*args)


def test_fp8_cache_needs_scales():
    args = _good_args()
    args[1], args[2] = args[1].to(torch.float8_e4m3fn), args[2].to(torch.float8_e4m3fn)
    with pytest.raises(BadInputError, match="needs k_scale and v_scale"):
        autotile.paged_attention(*args)
    with pytest.raises(ShapeMismatchError, match="one per KV head"):
        autotile.paged_attention(*args, k_scale=torch.ones(3), v_scale=1.0)


def test_registered_op_traces_with_fake_tensors():
    q, k, v, table, lens = _good_args()
    for max_context, return_lse, features in ((None, False, ()), (32, True, ()), (32, False, (30.0, 7))):
        args = (q.unsqueeze(1), k, v, table, lens, 0.125, None, None, max_context, return_lse, *features)
        torch.library.opcheck(torch.ops.autotile.paged_attention.default, args,
                              test_utils=("test_schema", "test_faketensor"))
    explained = autotile.explain("paged_attention", q, k, v, table, lens)
    assert explained["family"] == "paged" and explained["source"] in ("user-db", "shipped-db", "default")
