"""Edges of the paged attention API as a serving engine meets them: output buffers it hands in, partial results it
merges, new tokens it writes, fp8 scales and devices it names. Each case once gave a wrong result or an error that
did not say what to do.
"""
from __future__ import annotations

import math
import os

import torch

if not torch.cuda.is_available():
    # NOTE: the interpreter needs triton's own jit helpers decorated in interpreter mode (see test_paged.py).
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import autotile  # noqa: E402
from autotile.errors import BadInputError, ShapeMismatchError  # noqa: E402
from autotile.kvcache import PagedKVCache  # noqa: E402
from autotile.runtime.paged_plan import merge_attention_states, plan_paged_attention, plan_paged_prefill  # noqa: E402

FP16_TOLERANCE = 4 * 2.0**-11  # (P rounded to fp16 before P @ V, |V| < ~2) + the output's rounding: 2u + 2u


def filled_cache(lengths, *, heads_kv, dim, page_size=16, seed=0):
    """A cache holding `lengths` tokens per sequence (ids 0..B-1), appended in turns so that pages interleave."""
    gen = torch.Generator().manual_seed(seed)
    cache = PagedKVCache(num_layers=1, num_pages=sum(-(-n // page_size) for n in lengths) + 2, page_size=page_size,
                         num_kv_heads=heads_kv, head_dim=dim)
    for seq in range(len(lengths)):
        cache.allocate(seq)
    for start in range(0, max(lengths), 7):
        for seq, n in enumerate(lengths):
            if start < n:
                count = min(7, n - start)
                cache.append(seq, *(torch.randn(count, heads_kv, dim, generator=gen).half() for _ in range(2)))
    return cache


def reference(q, cache, seq, scale):
    """float64 attention of q (Q, Hq, D), the last Q positions of sequence `seq`, over its whole context:
    (out (Q, Hq, D), lse (Q, Hq)), causal among the queries."""
    k, v = (t.double().repeat_interleave(q.shape[1] // cache.num_kv_heads, dim=1) for t in cache.gather(seq))
    logits = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    length, queries = k.shape[0], q.shape[0]
    hidden = torch.arange(length)[None, :] > (length - queries + torch.arange(queries))[:, None]
    logits = logits.masked_fill(hidden[None], -math.inf)
    return torch.einsum("hqk,khd->qhd", torch.softmax(logits, dim=-1), v), torch.logsumexp(logits, -1).T


# --- output buffers -------------------------------------------------------------------------------

def test_speculative_decode_fills_an_out_buffer_whose_rows_do_not_pack():
    """Q=16 query tokens a sequence run the prefill blocks over (B * Q) packed rows. An out/lse buffer laid out
    (Q, B, ...) and transposed cannot be viewed that way; the kernel wrote into a packed copy and out kept its
    old contents."""
    lengths, queries, heads_q, dim = [40, 17], 16, 4, 64
    cache = filled_cache(lengths, heads_kv=1, dim=dim)
    plan = plan_paged_attention(batch=2, num_q_heads=heads_q, num_kv_heads=1, head_dim=dim, page_size=16,
                                max_context=64, dtype=torch.float16, num_queries=queries, return_lse=True,
                                device="cpu")
    assert plan.config["VARIANT"] == "prefill"
    q = torch.randn(2, queries, heads_q, dim, generator=torch.Generator().manual_seed(1)).half()
    out = torch.full((queries, 2, heads_q, dim), 7.0, dtype=torch.float16).transpose(0, 1)
    lse = torch.full((queries, 2, heads_q), 7.0).transpose(0, 1)
    plan.run(q, cache.k_pools[0], cache.v_pools[0], cache.block_table([0, 1]), cache.context_lens([0, 1]),
             out=out, lse=lse)
    for seq in range(2):
        want, want_lse = reference(q[seq], cache, seq, 1 / math.sqrt(dim))
        assert (out[seq].double() - want).abs().max() < FP16_TOLERANCE
        assert (lse[seq].double() - want_lse).abs().max() < 1e-4


def test_plans_refuse_an_out_buffer_strided_along_the_head_dim():
    """The kernels store a row as D consecutive elements: an out with stride(-1) != 1 got rows scattered across
    heads (a wrong result, and writes past the buffer's rows)."""
    cache = filled_cache([20, 5], heads_kv=2, dim=64)
    table, lengths = cache.block_table([0, 1]), cache.context_lens([0, 1])
    decode = plan_paged_attention(batch=2, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16, max_context=32,
                                  dtype=torch.float16, device="cpu")
    q = torch.randn(2, 4, 64).half()
    with pytest.raises(BadInputError, match="unit stride along the head dim.*empty_like"):
        decode.run(q, cache.k_pools[0], cache.v_pools[0], table, lengths,
                   out=torch.empty(2, 64, 4, dtype=torch.float16).transpose(1, 2))
    prefill = plan_paged_prefill(batch=2, num_tokens=3, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16,
                                 max_context=32, dtype=torch.float16, device="cpu")
    with pytest.raises(BadInputError, match="unit stride along the head dim"):
        prefill.run(torch.randn(3, 4, 64).half(), cache.k_pools[0], cache.v_pools[0], table,
                    torch.tensor([0, 2, 3], dtype=torch.int32), lengths,
                    out=torch.empty(3, 64, 4, dtype=torch.float16).transpose(1, 2))


# --- merging partial results ----------------------------------------------------------------------

def test_merge_refuses_lses_that_do_not_match_the_rows_of_out():
    """flash_attention_varlen gives lse (Hq, total_q) beside out (total_q, Hq, D): where T = Hq broadcasting paired
    rows with other rows' LSEs, and a (T, 1) lse beside a (T, H) result spread over the heads; both returned
    numbers, other mismatches torch's own broadcasting error."""
    out_a, out_b = torch.randn(6, 4, 8), torch.randn(6, 4, 8)
    with pytest.raises(ShapeMismatchError, match=r"lse_a must be \(6, 4\).*transpose"):
        merge_attention_states(out_a, torch.randn(4, 6), out_b, torch.randn(6, 4))
    with pytest.raises(ShapeMismatchError, match=r"lse_b must be \(6, 4\)"):
        merge_attention_states(out_a, torch.randn(6, 4), out_b, torch.randn(6, 1))
    with pytest.raises(ShapeMismatchError, match="must have one shape"):
        merge_attention_states(out_a, torch.randn(6, 4), out_b[:, :1], torch.randn(6, 1))


# --- new tokens of a prefill step -----------------------------------------------------------------

def _prefill_step(cache, new):
    """q and the new tokens' K/V of sequences 0..B-1 of `cache`, their slots reserved, packed."""
    gen = torch.Generator().manual_seed(2)
    slots = torch.cat([cache.reserve(seq, n) for seq, n in enumerate(new)])
    tokens = sum(new)
    q = torch.randn(tokens, 4, 64, generator=gen).half()
    k_new, v_new = (torch.randn(tokens, 2, 64, generator=gen).half() for _ in range(2))
    cu_seqlens = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    return q, k_new, v_new, slots, cu_seqlens


def test_prefill_refuses_fewer_slots_than_new_tokens():
    """Writing K/V for some of the step's tokens only left the others' slots stale, and the kernel attended to
    whatever they held."""
    cache = filled_cache([30, 3], heads_kv=2, dim=64)
    q, k_new, v_new, slots, cu_seqlens = _prefill_step(cache, [4, 2])
    ids = [0, 1]
    args = (q, cache.k_pools[0], cache.v_pools[0], cache.block_table(ids), cu_seqlens, cache.context_lens(ids))
    plan = plan_paged_prefill(batch=2, num_tokens=6, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16,
                              max_context=64, dtype=torch.float16, device="cpu")
    with pytest.raises(ShapeMismatchError, match=r"slot_mapping must be \(6,\)"):
        plan.run(*args, k_new=k_new[:4], v_new=v_new[:4], slot_mapping=slots[:4])
    with pytest.raises(ShapeMismatchError, match=r"slot_mapping must be \(6,\)"):
        autotile.paged_prefill(*args, k_new=k_new[:4], v_new=v_new[:4], slot_mapping=slots[:4], max_context=64)


@pytest.mark.parametrize("max_context", [None, 8])
def test_fresh_prompts_with_new_tokens_but_no_slots_say_what_to_pass(max_context):
    """Prompts of one length and no cached prefix take the dense path, which wrote K/V to slot_mapping=None
    (AttributeError: 'NoneType' object has no attribute 'shape')."""
    cache = PagedKVCache(num_layers=1, num_pages=4, page_size=16, num_kv_heads=2, head_dim=64)
    for seq in (0, 1):
        cache.allocate(seq)
    q, k_new, v_new, _, cu_seqlens = _prefill_step(cache, [8, 8])
    with pytest.raises(BadInputError, match="pass k_new, v_new and slot_mapping together"):
        autotile.paged_prefill(q, cache.k_pools[0], cache.v_pools[0], cache.block_table([0, 1]), cu_seqlens,
                               cache.context_lens([0, 1]), k_new=k_new, v_new=v_new, max_context=max_context)


# --- fp8 scales and devices -------------------------------------------------------------------------

@pytest.mark.parametrize("k_scale", [0.0, -0.5, float("nan"), float("inf"), torch.tensor([0.01, 0.0])],
                         ids=["zero", "negative", "nan", "inf", "one-head-zero"])
def test_an_fp8_cache_refuses_scales_it_cannot_divide_by(k_scale):
    """Writes divide by the scale: a zero stored inf/NaN clamped to +-448 and every read came back garbage."""
    with pytest.raises(BadInputError, match="k_scale must be finite and > 0"):
        PagedKVCache(num_layers=1, num_pages=2, page_size=16, num_kv_heads=2, head_dim=64,
                     dtype=torch.float8_e4m3fn, k_scale=k_scale, v_scale=0.01)


@pytest.mark.parametrize("k_scale", [0.0, float("nan"), [0.01, -1.0], torch.tensor([0.01, 0.0])],
                         ids=["zero", "nan", "list-negative", "tensor-one-head-zero"])
def test_the_one_call_op_refuses_fp8_scales_it_cannot_multiply_by(k_scale):
    """The one-call op took k_scale = 0 (or NaN) and returned zeros (or NaN) for every row without a word. Host
    numbers are checked always, device tensors where checks are on (the CPU by default)."""
    cache = filled_cache([20, 37], heads_kv=2, dim=64)
    k_fp8, v_fp8 = (pool.to(torch.float8_e4m3fn) for pool in (cache.k_pools[0], cache.v_pools[0]))
    q = torch.randn(2, 4, 64).half()
    with pytest.raises(BadInputError, match="k_scale must be finite and > 0"):
        autotile.paged_attention(q, k_fp8, v_fp8, cache.block_table([0, 1]), cache.context_lens([0, 1]),
                                 k_scale=k_scale, v_scale=1.0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_a_cuda_plan_on_a_machine_without_cuda_says_to_run_on_the_cpu():
    """torch's own 'AssertionError: Torch not compiled with CUDA enabled' came out of the plan's constructor."""
    with pytest.raises(BadInputError, match="no CUDA device.*device='cpu'"):
        plan_paged_attention(batch=1, num_q_heads=4, num_kv_heads=1, head_dim=64, page_size=16, max_context=64,
                             dtype=torch.float16, device="cuda")


@pytest.mark.parametrize("checks_env", [None, "0"])
@pytest.mark.parametrize("call", ["plan", "plan-prefill", "one-call"])
def test_cpu_runs_check_page_ids_by_default(call, checks_env, monkeypatch):
    """A page id out of range read outside the interpreter's buffers: the process died (a segmentation fault) on the
    trusted paths (a plan's run, the one-call op given max_context). CPU runs now check their values, which is free
    there, even under AUTOTILE_CHECKS=0; a plan's checks=False keeps a GPU run's contract."""
    if checks_env is not None:
        monkeypatch.setenv("AUTOTILE_CHECKS", checks_env)
    cache = filled_cache([20, 37], heads_kv=1, dim=64)
    table = cache.block_table([0, 1]).clone()
    table[1, 1] = 10_000  # the second page of sequence 1
    lengths = cache.context_lens([0, 1])
    q = torch.randn(2, 4, 64).half()
    args = (cache.k_pools[0], cache.v_pools[0], table)
    with pytest.raises(BadInputError, match="page"):
        if call == "plan":
            plan = plan_paged_attention(batch=2, num_q_heads=4, num_kv_heads=1, head_dim=64, page_size=16,
                                        max_context=64, dtype=torch.float16, device="cpu")
            plan.run(q, *args, lengths)
        elif call == "plan-prefill":
            plan = plan_paged_prefill(batch=2, num_tokens=2, num_q_heads=4, num_kv_heads=1, head_dim=64,
                                      page_size=16, max_context=64, dtype=torch.float16, device="cpu")
            plan.run(q, *args, torch.tensor([0, 1, 2], dtype=torch.int32), lengths)
        else:
            autotile.paged_attention(q, *args, lengths, max_context=64)


def test_explain_names_what_a_prefill_step_runs():
    """explain("paged_prefill", ...) was an unknown op; it now gives the problem and config of the call's plan."""
    from autotile.runtime import ops_paged

    cache = filled_cache([30], heads_kv=2, dim=64)
    slots = cache.reserve(0, 10)
    args = (torch.randn(10, 8, 64).half(), cache.k_pools[0], cache.v_pools[0], cache.block_table([0]),
            torch.tensor([0, 10], dtype=torch.int32), cache.context_lens([0]))
    info = autotile.explain("paged_prefill", *args, slot_mapping=slots)
    assert info["op"] == "paged_prefill" and info["config"]["VARIANT"] == "prefill"
    ops_paged._plans.clear()
    autotile.paged_prefill(*args, k_new=torch.randn(10, 2, 64).half(), v_new=torch.randn(10, 2, 64).half(),
                           slot_mapping=slots)
    (plan,) = ops_paged._plans.values()
    assert info["problem"] == vars(plan.problem) and info["config"] == dict(plan.config)
    assert autotile.explain("paged_prefill", *args, max_context=100)["problem"]["max_context"] == 128
    with pytest.raises(BadInputError, match="max_context"):
        autotile.explain("paged_prefill", *args, max_context=0)


def test_max_context_takes_any_host_integer():
    """Engines keep lengths in NumPy integers; max_context=np.int64(64) was refused."""
    np = pytest.importorskip("numpy")
    cache = filled_cache([20, 37], heads_kv=1, dim=64)
    args = (torch.randn(2, 4, 64).half(), cache.k_pools[0], cache.v_pools[0], cache.block_table([0, 1]),
            cache.context_lens([0, 1]))
    assert torch.equal(autotile.paged_attention(*args, max_context=np.int64(64)),
                       autotile.paged_attention(*args, max_context=64))
    with pytest.raises(BadInputError, match="host int"):
        autotile.paged_attention(*args, max_context=torch.tensor(64))


def test_a_head_major_cache_is_served_through_a_transposed_view_and_the_error_says_so():
    """FlashInfer's HND caches (num_pages, Hkv, page_size, D) read as pages of Hkv-token rows: the heads check
    failed with no word of the layout."""
    cache = filled_cache([20, 37], heads_kv=2, dim=64)
    q = torch.randn(2, 4, 64, generator=torch.Generator().manual_seed(1)).half()
    head_major = [pool.transpose(1, 2).contiguous() for pool in (cache.k_pools[0], cache.v_pools[0])]
    tables = (cache.block_table([0, 1]), cache.context_lens([0, 1]))
    out = autotile.paged_attention(q, *(pool.transpose(1, 2) for pool in head_major), *tables)
    for seq in range(2):
        want, _ = reference(q[seq:seq + 1], cache, seq, 1 / math.sqrt(64))
        assert (out[seq].double() - want[0]).abs().max() < FP16_TOLERANCE
    with pytest.raises(ShapeMismatchError, match=r"cache.transpose\(1, 2\)"):
        autotile.paged_attention(q, *head_major, *tables)


def _decode_plan_and_args(kv_dtype=None):
    cache = filled_cache([20, 37], heads_kv=1, dim=64)
    plan = plan_paged_attention(batch=2, num_q_heads=4, num_kv_heads=1, head_dim=64, page_size=16, max_context=64,
                                dtype=torch.float16, device="cpu", kv_dtype=kv_dtype)
    q = torch.randn(2, 4, 64, generator=torch.Generator().manual_seed(3)).half()
    return plan, q, (cache.k_pools[0], cache.v_pools[0], cache.block_table([0, 1]), cache.context_lens([0, 1]))


def test_plan_runs_name_an_argument_that_is_not_a_tensor():
    """plan.run and paged_prefill's new tokens took a list as far as `.shape`: an AttributeError deep inside."""
    plan, q, (k, v, table, lengths) = _decode_plan_and_args()
    with pytest.raises(BadInputError, match=r"context_lens must be a tensor of int32 .* got list"):
        plan.run(q, k, v, table, [20, 37])
    with pytest.raises(BadInputError, match=r"block_table must be a tensor .* got list"):
        plan.run(q, k, v, table.tolist(), lengths)
    with pytest.raises(BadInputError, match="q must be a tensor of the queries"):
        plan.run(q.tolist(), k, v, table, lengths)
    cache = filled_cache([10], heads_kv=1, dim=64)
    slots = cache.reserve(0, 3)
    args = (torch.randn(3, 4, 64).half(), cache.k_pools[0], cache.v_pools[0], cache.block_table([0]),
            torch.tensor([0, 3], dtype=torch.int32), cache.context_lens([0]))
    new = dict(k_new=torch.randn(3, 1, 64).half(), v_new=torch.randn(3, 1, 64).half())
    with pytest.raises(BadInputError, match=r"slot_mapping must be a tensor of the new tokens' slots .* got list"):
        autotile.paged_prefill(*args, **new, slot_mapping=slots.tolist())
    prefill = plan_paged_prefill(batch=1, num_tokens=3, num_q_heads=4, num_kv_heads=1, head_dim=64, page_size=16,
                                 max_context=64, dtype=torch.float16, device="cpu")
    with pytest.raises(BadInputError, match=r"slot_mapping must be a tensor .* got list"):
        prefill.run(*args, **new, slot_mapping=slots.tolist())


def test_a_plan_run_inside_torch_compile_runs_eagerly():
    """The plan's run is no custom op: dynamo failed on its host state (KeyError(torch.uint64), an RLock). It is
    now a graph break, and the compiled function gives the eager result."""
    plan, q, args = _decode_plan_and_args()
    want = plan.run(q, *args)
    compiled = torch.compile(lambda q: plan.run(q, *args) * 2, backend="eager")
    assert torch.equal(compiled(q), want * 2)


def test_a_plan_says_once_that_its_output_carries_no_gradient(monkeypatch):
    monkeypatch.setattr("autotile.runtime.paged_plan._warned_grad", False)
    plan, q, args = _decode_plan_and_args()
    with pytest.warns(UserWarning, match="serve inference and record no autograd graph"):
        plan.run(q.clone().requires_grad_(), *args)
    with torch.inference_mode():
        plan.run(q, *args)  # nothing to say


def test_checked_fp8_runs_refuse_scales_that_are_not_finite_and_positive():
    cache = PagedKVCache(num_layers=1, num_pages=4, page_size=16, num_kv_heads=2, head_dim=64, dtype=torch.float8_e4m3fn,
                         k_scale=0.5, v_scale=0.25)
    cache.allocate("a")
    cache.append("a", torch.randn(20, 2, 64), torch.randn(20, 2, 64))
    plan = plan_paged_attention(batch=1, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16, max_context=64,
                                dtype=torch.float16, kv_dtype=torch.float8_e4m3fn, device="cpu")
    args = (torch.randn(1, 4, 64).half(), cache.k_pools[0], cache.v_pools[0], cache.block_table(["a"]),
            cache.context_lens(["a"]))
    plan.run(*args, k_scale=cache.k_scale, v_scale=cache.v_scale)
    for bad in (torch.tensor([0.0, 1.0]), torch.tensor([1.0, -1.0]), torch.tensor([float("nan"), 1.0])):
        with pytest.raises(BadInputError, match="finite and > 0"):
            plan.run(*args, k_scale=bad, v_scale=cache.v_scale)


def test_a_prefill_plan_for_no_sequences_refuses_tokens():
    """batch=0 with 5 rows of q returned an uninitialised torch.empty."""
    plan = plan_paged_prefill(batch=0, num_tokens=0, num_q_heads=4, num_kv_heads=1, head_dim=64, page_size=16,
                              max_context=64, dtype=torch.float16, device="cpu")
    cache = torch.zeros(2, 16, 1, 64, dtype=torch.float16)
    empty = (torch.zeros(0, 1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32), torch.zeros(0, dtype=torch.int32))
    assert plan.run(torch.randn(0, 4, 64).half(), cache, cache, *empty).shape == (0, 4, 64)
    with pytest.raises(ShapeMismatchError, match="batch=0"):
        plan.run(torch.randn(5, 4, 64).half(), cache, cache, *empty)


def test_a_plan_made_for_cpu_0_serves_cpu_tensors():
    # 'cpu:0' names the one CPU device (a cache made with it keeps it), whose tensors say 'cpu'.
    cache = PagedKVCache(num_layers=1, num_pages=4, page_size=16, num_kv_heads=2, head_dim=64, device="cpu:0")
    cache.allocate("a")
    cache.append("a", torch.randn(20, 2, 64).half(), torch.randn(20, 2, 64).half())
    plan = plan_paged_attention(batch=1, num_q_heads=8, num_kv_heads=2, head_dim=64, page_size=16, max_context=64,
                                dtype=torch.float16, device=cache.device)
    q = torch.randn(1, 8, 64).half()
    args = (cache.k_pools[0], cache.v_pools[0], cache.block_table(["a"]), cache.context_lens(["a"]))
    torch.testing.assert_close(plan.run(q, *args), autotile.paged_attention(q, *args, max_context=64))
    # A q with D not of unit stride: the message shows its strides and says what to do.
    with pytest.raises(ShapeMismatchError, match=r"strides \(512, 1, 8\): pass q.contiguous\(\)"):
        plan.run(torch.randn(1, 64, 8).half().transpose(1, 2), *args)


def test_the_one_call_paged_ops_refuse_a_q_that_wants_a_gradient():
    # They have no backward: the output used to claim one and backward failed with torch's own message.
    cache = filled_cache([20], heads_kv=2, dim=64)
    args = (cache.k_pools[0], cache.v_pools[0], cache.block_table([0]), cache.context_lens([0]))
    q = torch.randn(1, 8, 64).half().requires_grad_()
    with pytest.raises(BadInputError, match="no backward, but q requires grad"):
        autotile.paged_attention(q, *args)
    with pytest.raises(BadInputError, match="torch.func"):
        torch.func.grad(lambda q: autotile.paged_attention(q, *args).float().sum())(q.detach())
    with pytest.raises(BadInputError, match="no backward, but q requires grad"):
        autotile.paged_prefill(q, args[0], args[1], args[2], torch.tensor([0, 1], dtype=torch.int32), args[3])
    with torch.inference_mode():
        assert autotile.paged_attention(q, *args).shape == q.shape


def test_the_cache_manager_refuses_what_the_ops_would_at_their_first_call():
    with pytest.raises(ShapeMismatchError, match="head_dim must be a multiple of 8"):
        PagedKVCache(num_layers=1, num_pages=4, page_size=16, num_kv_heads=2, head_dim=20)
    with pytest.raises(BadInputError, match="apply to fp8 caches only"):
        PagedKVCache(num_layers=1, num_pages=4, page_size=16, num_kv_heads=2, head_dim=64, k_scale=0.5, v_scale=0.5)


def test_slots_off_the_table_name_context_lens_too():
    # context_lens taken before reserve leaves the new tokens out of the context: the slots then look wrong.
    cache = filled_cache([20], heads_kv=2, dim=64)
    before = cache.context_lens([0])
    slots = cache.reserve(0, 5)
    k_new, v_new = (torch.randn(5, 2, 64).half() for _ in range(2))
    with pytest.raises(BadInputError, match="count the new tokens in context_lens"):
        autotile.paged_prefill(torch.randn(5, 8, 64).half(), cache.k_pools[0], cache.v_pools[0], cache.block_table([0]),
                               torch.tensor([0, 5], dtype=torch.int32), before, k_new=k_new, v_new=v_new,
                               slot_mapping=slots)
