"""Decode plans (plan/run split) under Triton's CPU interpreter, against a float64 reference that never reads
a block table: every variant, head dims 64-256 (padded ones too), GQA 1-16 and MQA, speculative queries,
padding rows, LSE; the run reads nothing back and allocates nothing; checks live in the plan or AUTOTILE_CHECKS.
"""
from __future__ import annotations

import math
import os
import sys

import torch

if not torch.cuda.is_available():
    # NOTE: the interpreter needs triton's own jit helpers decorated in interpreter mode (see test_paged.py).
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import autotile  # noqa: E402
from autotile.errors import BadInputError, ShapeMismatchError  # noqa: E402
from autotile.families.paged import balanced_max_chunks, balanced_schedule, cdiv  # noqa: E402
from autotile.runtime import ops_paged, paged_plan  # noqa: E402
from autotile.runtime.paged_plan import merge_attention_states, plan_paged_attention  # noqa: E402

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}


class PagedBatch:
    """A shuffled page pool holding `lengths` tokens per sequence, with float64 dense copies on the side.

    Pages of all sequences are interleaved at random in a pool with spare pages, and table entries past a
    sequence's pages point at random pages (the kernels must never read them).
    """

    def __init__(self, lengths, *, heads_q, heads_kv, dim, page_size, queries=1, dtype="fp16", kv_dtype=None,
                 seed=0, table_width=None):
        gen = torch.Generator().manual_seed(seed)
        kv_dtype = kv_dtype or dtype
        self.lengths, self.page_size, self.queries = list(lengths), page_size, queries
        owned = [cdiv(n, page_size) for n in lengths]
        width = table_width or max(owned + [1])
        num_pages = sum(owned) + 3
        order = torch.randperm(num_pages, generator=gen)
        self.block_table = torch.randint(0, num_pages, (len(lengths), width), generator=gen, dtype=torch.int32)
        taken = 0
        for b, n in enumerate(owned):
            self.block_table[b, :n] = order[taken:taken + n].to(torch.int32)
            taken += n
        k = torch.randn(num_pages, page_size, heads_kv, dim, generator=gen)
        v = torch.randn(num_pages, page_size, heads_kv, dim, generator=gen)
        self.k_scale = self.v_scale = None
        if kv_dtype == "fp8":
            self.k_scale = (k.abs().amax(dim=(0, 1, 3)) / 448.0).float()
            self.v_scale = (v.abs().amax(dim=(0, 1, 3)) / 448.0).float()
            k, v = k / self.k_scale[None, None, :, None], v / self.v_scale[None, None, :, None]
        self.k_cache, self.v_cache = k.to(DTYPES[kv_dtype]), v.to(DTYPES[kv_dtype])
        self.context_lens = torch.tensor(lengths, dtype=torch.int32)
        self.q = torch.randn(len(lengths), queries, heads_q, dim, generator=gen).to(DTYPES[dtype])

    def dense(self, b: int, name: str) -> torch.Tensor:
        """Sequence b's K or V as float64 (length, Hkv, D), dequantised: no kernel, no block table trick."""
        cache, scale = (self.k_cache, self.k_scale) if name == "k" else (self.v_cache, self.v_scale)
        rows = [cache[int(self.block_table[b, t // self.page_size]), t % self.page_size]
                for t in range(self.lengths[b])]
        dense = torch.stack(rows).double() if rows else cache.new_zeros((0, *cache.shape[2:])).double()
        return dense if scale is None else dense * scale.double()[None, :, None]

    def reference(self, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(out (B, Q, Hq, D), lse (B, Q, Hq)) in float64; padding rows (length 0) give 0 and -inf."""
        batch, queries, heads, dim = self.q.shape
        out = torch.zeros(self.q.shape, dtype=torch.float64)
        lse = torch.full((batch, queries, heads), -math.inf, dtype=torch.float64)
        for b, n in enumerate(self.lengths):
            if n == 0:
                continue
            k, v = self.dense(b, "k"), self.dense(b, "v")
            group = heads // k.shape[1]
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # (n, Hq, D)
            logits = torch.einsum("qhd,khd->hqk", self.q[b].double(), k) * scale
            hidden = torch.arange(n)[None, :] > (n - queries + torch.arange(queries))[:, None]
            logits = logits.masked_fill(hidden[None], -math.inf)
            out[b] = torch.einsum("hqk,khd->qhd", torch.softmax(logits, dim=-1), v)
            lse[b] = torch.logsumexp(logits, dim=-1).transpose(0, 1)
        return out, lse


def tolerance(dtype: str) -> tuple[float, float]:
    """(atol, rtol), as PagedFamily.tolerance justifies them: attention weights rounded to the query dtype before
    the P @ V dot move the output by u times a weighted mean of |v| (V ~ N(0, 1): below 2), 2u absolute; the
    output rounded to its dtype, 2u relative."""
    u = {"fp16": 2.0**-11, "bf16": 2.0**-8}[dtype]
    return 2 * u, 2 * u


def assert_close(got, want, tol, what):
    """|got - want| <= atol + rtol |want| where want is finite (tol: (atol, rtol) or atol); elsewhere the same
    infinities."""
    atol, rtol = tol if isinstance(tol, tuple) else (tol, 0.0)
    got = got.double()
    finite = torch.isfinite(want)
    assert torch.equal(got[~finite], want[~finite]), f"{what}: rows of -inf LSE / padding differ"
    excess = torch.where(finite, (got - want).abs() - (atol + rtol * want.abs()), torch.zeros_like(got))
    worst = tuple(int(i) for i in torch.unravel_index(excess.argmax(), excess.shape))
    assert excess.max() <= 0, (f"{what}: |err| {float((got - want).abs()[worst]):.3g} above atol {atol:.3g} + "
                               f"rtol {rtol:.3g} x |{float(want[worst]):.4g}| at {worst}")


CONFIGS = {
    "whole": dict(VARIANT="whole", BLOCK_N=32, PARTITION_SIZE=256, num_warps=4, num_stages=2),
    "split": dict(VARIANT="split", BLOCK_N=32, PARTITION_SIZE=256, num_warps=4, num_stages=2),
    "balanced": dict(VARIANT="balanced", BLOCK_N=32, PARTITION_SIZE=256, num_warps=4, num_stages=2),
}

# (variant, lengths, Hq, Hkv, D, page_size, Q, dtype, kv_dtype)
CASES = [
    ("balanced", [700, 0, 35, 300], 8, 2, 96, 16, 1, "fp16", None),  # Phi-3's D, a padding row, one long sequence
    ("balanced", [1100], 16, 1, 64, 32, 1, "fp16", None),  # MQA, a single long sequence cut into many chunks
    ("balanced", [520, 17, 100], 4, 4, 80, 8, 1, "bf16", None),  # MHA (GQA 1), D 80, bf16
    ("balanced", [600, 40], 16, 1, 112, 16, 3, "fp16", "fp8"),  # G 16, speculative Q=3, fp8 cache, D 112
    ("whole", [33, 0, 64, 5], 8, 4, 256, 16, 1, "fp16", None),  # D 256, a padding row
    ("split", [300, 257, 2], 4, 2, 128, 64, 2, "bf16", None),  # speculative Q=2 over partitions
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-D{c[4]}-{c[2]}/{c[3]}-Q{c[6]}-{c[8] or c[7]}")
def test_plan_matches_float64_reference(case):
    variant, lengths, heads_q, heads_kv, dim, page_size, queries, dtype, kv_dtype = case
    data = PagedBatch(lengths, heads_q=heads_q, heads_kv=heads_kv, dim=dim, page_size=page_size, queries=queries,
                      dtype=dtype, kv_dtype=kv_dtype, seed=len(lengths) + dim)
    num_sms = 16  # few "SMs" keep the interpreted grid small; the balanced scheduler still cuts long sequences
    plan = plan_paged_attention(batch=len(lengths), num_q_heads=heads_q, num_kv_heads=heads_kv, head_dim=dim,
                                page_size=page_size, max_context=max(lengths), dtype=DTYPES[dtype],
                                kv_dtype=DTYPES[kv_dtype or dtype], num_queries=queries, device="cpu",
                                return_lse=True, config=CONFIGS[variant], num_sms=num_sms)
    if variant == "balanced":
        chunks = balanced_schedule(lengths, heads_kv, num_sms, 256)
        assert max(chunks) > 1, f"this case should split: {chunks}"
    out = torch.full_like(data.q, float("nan"))
    lse = torch.full(data.q.shape[:3], float("nan"))
    scale = 0.7 / math.sqrt(dim)
    got, got_lse = plan.run(data.q, data.k_cache, data.v_cache, data.block_table, data.context_lens, scale=scale,
                            k_scale=data.k_scale, v_scale=data.v_scale, out=out, lse=lse)
    assert got is out and got_lse is lse
    want, want_lse = data.reference(scale)
    assert_close(out, want, tolerance(dtype), "out")
    # LSE: fp32 logits of exact products and an fp32 running sum over < 2k terms: 1e-4 absolute.
    assert_close(lse, want_lse, 1e-4, "lse")


def test_the_combine_merges_chunks_over_several_steps(monkeypatch):
    """A sequence cut into more chunks than the combine merges a step (2 here: COMBINE_STEP_ELEMENTS over D 64)
    rescales its running result to each new maximum, as the steps of a long context at D 256 on a GPU do."""
    from autotile.families import paged

    monkeypatch.setattr(paged, "COMBINE_STEP_ELEMENTS", 2 * 64)
    assert paged.combine_parts_block(64) == 2
    lengths = [700, 0, 35, 300]
    assert balanced_schedule(lengths, 2, 16, 256)[0] >= 3
    data = PagedBatch(lengths, heads_q=8, heads_kv=2, dim=64, page_size=16, seed=4)
    plan = plan_paged_attention(batch=4, num_q_heads=8, num_kv_heads=2, head_dim=64, page_size=16, max_context=704,
                                dtype=torch.float16, device="cpu", return_lse=True, config=CONFIGS["balanced"],
                                num_sms=16)
    out, lse = plan.run(data.q[:, 0], data.k_cache, data.v_cache, data.block_table, data.context_lens)
    want, want_lse = data.reference(1 / 8)
    assert_close(out[:, None], want, tolerance("fp16"), "out")
    assert_close(lse[:, None], want_lse, 1e-4, "lse")


def test_balanced_kernels_cut_the_chunks_the_schedule_says():
    """The scheduler runs on the device; the workspace slots it fills must be those of balanced_schedule."""
    lengths, heads_kv, num_sms = [900, 12, 0, 450, 64], 2, 12
    data = PagedBatch(lengths, heads_q=4, heads_kv=heads_kv, dim=64, page_size=16)
    plan = plan_paged_attention(batch=5, num_q_heads=4, num_kv_heads=heads_kv, head_dim=64, page_size=16,
                                max_context=1024, dtype=torch.float16, device="cpu", config=CONFIGS["balanced"],
                                num_sms=num_sms)
    chunks = balanced_schedule(lengths, heads_kv, num_sms, 256)
    assert chunks[0] > 1 and chunks[1] == chunks[2] == 1, chunks
    workspace = plan.launch.workspace
    workspace.fill_(float("nan"))
    plan.run(data.q[:, 0], data.k_cache, data.v_cache, data.block_table, data.context_lens)
    rows = plan.problem.rows
    maxima = workspace[:plan.launch.max_chunks * heads_kv * rows].view(-1, heads_kv, rows)  # (chunk, head, row)
    written = {c for c in range(maxima.shape[0]) if not torch.isnan(maxima[c]).all()}
    ends = torch.tensor(chunks).cumsum(0).tolist()
    expected = {c for b, n in enumerate(chunks) if n > 1 for c in range(ends[b] - n, ends[b])}
    assert written == expected
    assert plan.launch.max_chunks == balanced_max_chunks(5, heads_kv, num_sms)


def test_schedule_fills_the_gpu_for_any_mix():
    # On an H200 (132 SMs): one 32k sequence is cut into ~4 items per SM; 64 x 4k is left whole
    # (512 programs already fill it); 256 ragged short contexts are left whole; a long outlier among
    # short ones is cut.
    assert balanced_schedule([32768], 8, 132, 256) == [64]
    assert balanced_schedule([4096] * 64, 8, 132, 256) == [1] * 64
    ragged = [100 + (3900 * i) // 255 for i in range(256)]
    assert balanced_schedule(ragged, 8, 132, 256) == [1] * 256
    mixed = balanced_schedule([32768] + [300] * 15, 8, 132, 256)
    assert mixed[0] >= 16 and mixed[1:] == [1] * 15
    for lengths in ([32768], [4096] * 64, ragged, [32768] + [300] * 15, [1] * 256):
        assert sum(balanced_schedule(lengths, 8, 132, 256)) <= balanced_max_chunks(len(lengths), 8, 132)


def guarded(monkeypatch, names, owner, prefix="autotile"):
    """Make `owner.name` raise when called from autotile's own code (Triton's interpreter may use them)."""
    for name in names:
        original = getattr(owner, name)

        def guard(*args, _original=original, _name=name, **kwargs):
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller.startswith(prefix):
                raise AssertionError(f"{_name} called from {caller} on the run path")
            return _original(*args, **kwargs)
        monkeypatch.setattr(owner, name, guard)


def test_the_run_reads_nothing_back_and_allocates_nothing(monkeypatch):
    lengths = [600, 3, 0, 20]
    data = PagedBatch(lengths, heads_q=8, heads_kv=2, dim=64, page_size=16, dtype="fp16")
    assert balanced_schedule(lengths, 2, 8, 256)[0] > 1  # the combine kernel runs too
    plans = [plan_paged_attention(batch=4, num_q_heads=8, num_kv_heads=2, head_dim=64, page_size=16,
                                  max_context=608, dtype=torch.float16, device="cpu", return_lse=True,
                                  config=CONFIGS[variant], num_sms=8, checks=False)  # a GPU run's contract
             for variant in ("balanced", "whole")]
    q = data.q[:, 0]
    reference = [plan.run(q, data.k_cache, data.v_cache, data.block_table, data.context_lens) for plan in plans]
    out, lse = torch.empty_like(q), torch.empty(q.shape[:2])
    guarded(monkeypatch, ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__",
                          "nonzero", "new_empty", "new_zeros", "clone", "contiguous"), torch.Tensor)
    guarded(monkeypatch, ("empty", "empty_like", "zeros", "zeros_like", "full", "tensor", "as_tensor", "arange",
                          "stack", "cat"), torch)
    guarded(monkeypatch, ("synchronize",), torch.cuda)
    for plan, (want, want_lse) in zip(plans, reference):
        plan.run(q, data.k_cache, data.v_cache, data.block_table, data.context_lens, out=out, lse=lse)
        assert torch.equal(out, want) and torch.equal(lse, want_lse)
    monkeypatch.undo()


def test_the_one_call_op_with_max_context_reads_nothing_back(monkeypatch):
    data = PagedBatch([70, 33], heads_q=4, heads_kv=1, dim=64, page_size=16)
    q = data.q[:, 0]
    args = (q, data.k_cache, data.v_cache, data.block_table, data.context_lens)
    # As on a GPU, where nothing is checked unless asked: CPU calls always check their values.
    monkeypatch.setattr(paged_plan, "checks_on", lambda device: False)
    first = autotile.paged_attention(*args, max_context=128)  # compiles and keeps the plan
    guarded(monkeypatch, ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__"), torch.Tensor)
    again = autotile.paged_attention(*args, max_context=128)
    monkeypatch.undo()
    assert torch.equal(first, again)
    synced = autotile.paged_attention(*args)  # no bound: reads the lengths back (and checks them)
    want, _ = data.reference(1 / 8)
    assert_close(synced[:, None], want, tolerance("fp16"), "out")
    assert torch.equal(synced, first)


def test_new_inputs_in_the_same_buffers_give_fresh_results():
    """What a CUDA graph replay sees: the same tensors, new contents. Nothing may be cached from the last run."""
    first = PagedBatch([600, 9, 300], heads_q=4, heads_kv=2, dim=64, page_size=16, seed=1, table_width=40)
    second = PagedBatch([12, 610, 0], heads_q=4, heads_kv=2, dim=64, page_size=16, seed=2, table_width=40)
    plan = plan_paged_attention(batch=3, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16, max_context=640,
                                dtype=torch.float16, device="cpu", config=CONFIGS["balanced"], num_sms=16,
                                return_lse=True)
    pages = max(first.k_cache.shape[0], second.k_cache.shape[0])
    buffers = dict(q=first.q[:, 0].clone(), k=torch.zeros(pages, 16, 2, 64).half(),
                   v=torch.zeros(pages, 16, 2, 64).half(), table=first.block_table.clone(),
                   lens=first.context_lens.clone())
    out, lse = torch.empty_like(buffers["q"]), torch.empty(3, 4)

    def load(data):
        buffers["q"].copy_(data.q[:, 0])
        buffers["k"][:data.k_cache.shape[0]] = data.k_cache
        buffers["v"][:data.v_cache.shape[0]] = data.v_cache
        buffers["table"].copy_(data.block_table)
        buffers["lens"].copy_(data.context_lens)

    def run():
        plan.run(buffers["q"], buffers["k"], buffers["v"], buffers["table"], buffers["lens"], out=out, lse=lse)

    load(first)
    run()
    load(second)
    run()
    want, want_lse = second.reference(1 / 8)
    assert_close(out[:, None], want, tolerance("fp16"), "out after new inputs")
    assert_close(lse[:, None], want_lse, 1e-4, "lse after new inputs")


def test_lse_merges_two_halves_of_a_context_into_the_whole():
    """Prefix sharing: attend a shared prefix and each suffix separately, merge by LSE."""
    data = PagedBatch([300, 200], heads_q=8, heads_kv=2, dim=64, page_size=16, seed=5)
    q = data.q[:, 0]
    whole = autotile.paged_attention(q, data.k_cache, data.v_cache, data.block_table, data.context_lens,
                                     return_lse=True)
    split_at = torch.tensor([128, 64], dtype=torch.int32)  # whole pages
    prefix_table = data.block_table
    suffix_table = torch.stack([torch.roll(data.block_table[b], -int(split_at[b]) // 16) for b in range(2)])
    a = autotile.paged_attention(q, data.k_cache, data.v_cache, prefix_table, split_at, return_lse=True)
    b = autotile.paged_attention(q, data.k_cache, data.v_cache, suffix_table, data.context_lens - split_at,
                                 return_lse=True)
    merged, merged_lse = merge_attention_states(a[0], a[1], b[0], b[1])
    # Each half is within tolerance and their weights sum to 1; the merge rounds once more to fp16 (u).
    assert_close(merged, whole[0].double(), tuple(1.5 * t for t in tolerance("fp16")), "merged out")
    assert_close(merged_lse, whole[1].double(), 1e-4, "merged lse")
    assert whole[1].shape == (2, 8) and whole[1].dtype == torch.float32


def test_checks_mode_reads_values_and_names_what_is_wrong(monkeypatch):
    data = PagedBatch([40, 20], heads_q=4, heads_kv=2, dim=64, page_size=16, table_width=4)
    q = data.q[:, 0]
    plan = plan_paged_attention(batch=2, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16, max_context=48,
                                dtype=torch.float16, device="cpu", checks=True)
    pages = data.k_cache.shape[0]
    bad_page = data.block_table.clone()
    bad_page[1, 0] = pages
    with pytest.raises(BadInputError, match=f"page {pages} within the contexts"):
        plan.run(q, data.k_cache, data.v_cache, bad_page, data.context_lens)
    with pytest.raises(ShapeMismatchError, match="longer than the planned max_context=48"):
        plan.run(q, data.k_cache, data.v_cache, data.block_table, torch.tensor([49, 20], dtype=torch.int32))
    with pytest.raises(ShapeMismatchError, match="widen the table"):
        plan.run(q, data.k_cache, data.v_cache, data.block_table[:, :2], torch.tensor([40, 20], dtype=torch.int32))
    spec = plan_paged_attention(batch=2, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16, max_context=48,
                                num_queries=3, dtype=torch.float16, device="cpu", checks=True)
    with pytest.raises(ShapeMismatchError, match="hold its 3 query tokens"):
        spec.run(torch.zeros(2, 3, 4, 64).half(), data.k_cache, data.v_cache, data.block_table,
                 torch.tensor([2, 20], dtype=torch.int32))
    monkeypatch.setenv("AUTOTILE_CHECKS", "1")  # the documented switch, read when a plan is made
    checked = plan_paged_attention(batch=2, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16, max_context=48,
                                   dtype=torch.float16, device="cpu")
    with pytest.raises(BadInputError, match="outside the cache"):
        checked.run(q, data.k_cache, data.v_cache, bad_page, data.context_lens)
    with pytest.raises(BadInputError, match="outside the cache"):
        autotile.paged_attention(q, data.k_cache, data.v_cache, bad_page, data.context_lens, max_context=48)


@pytest.mark.parametrize("change, words", [
    (dict(batch=2.5), "batch must be an int"), (dict(max_context=48.0), "max_context must be an int"),
    (dict(num_queries=1.5), "num_queries must be an int"), (dict(mean_context=100), "mean_context must be"),
    (dict(mean_context=0), "mean_context must be"), (dict(num_sms=0), "num_sms must be >= 1"),
], ids=lambda v: str(v))
def test_plan_sizes_are_ints_in_range_not_truncated(change, words):
    """2.5 sequences used to plan 2 (the third's rows then went unwritten); a mean context past the longest, and no
    SMs, were taken as given. mean_context is a hint and may be an average: 17.5 plans as 18."""
    base = dict(batch=2, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16, max_context=48, device="cpu")
    with pytest.raises(BadInputError, match=words):
        plan_paged_attention(**{**base, **change})
    assert plan_paged_attention(**{**base, "mean_context": 17.5}).problem.mean_context <= 48


def test_plan_refuses_tensors_it_was_not_made_for():
    data = PagedBatch([40, 20], heads_q=4, heads_kv=2, dim=64, page_size=16)
    plan = plan_paged_attention(batch=2, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16, max_context=48,
                                dtype=torch.float16, device="cpu")
    q = data.q[:, 0]
    args = [q, data.k_cache, data.v_cache, data.block_table, data.context_lens]
    with pytest.raises(ShapeMismatchError, match=r"q must be \(2, 4, 64\)"):
        plan.run(q[:1], *args[1:])
    with pytest.raises(ShapeMismatchError, match="k_cache must be"):
        plan.run(q, data.k_cache.float(), *args[2:])
    with pytest.raises(ShapeMismatchError, match="context_lens must be"):
        plan.run(*args[:4], data.context_lens.long())
    with pytest.raises(ShapeMismatchError, match="out must be"):
        plan.run(*args, out=torch.empty(2, 4, 64))
    with pytest.raises(BadInputError, match="return_lse"):
        plan.run(*args, lse=torch.empty(2, 4))
    with pytest.raises(BadInputError, match="finite"):
        plan.run(*args, scale=float("nan"))
    with pytest.raises(BadInputError, match="Python number"):
        plan.run(*args, scale=torch.tensor(0.1))
    fp8 = PagedBatch([40, 20], heads_q=4, heads_kv=2, dim=64, page_size=16, kv_dtype="fp8")
    plan8 = plan_paged_attention(batch=2, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16, max_context=48,
                                 dtype=torch.float16, kv_dtype=torch.float8_e4m3fn, device="cpu")
    with pytest.raises(BadInputError, match=r"k_scale as a \(2,\) float32 tensor"):
        plan8.run(q, fp8.k_cache, fp8.v_cache, fp8.block_table, fp8.context_lens, k_scale=0.1, v_scale=fp8.v_scale)
    with pytest.raises(ShapeMismatchError, match="head_dim must be a multiple of 8"):
        plan_paged_attention(batch=2, num_q_heads=4, num_kv_heads=2, head_dim=100, page_size=16, max_context=48,
                             device="cpu")


def test_query_groups_too_wide_for_a_decode_tile_run_the_prefill_blocks():
    # MQA with 32 query heads and Q=4 speculative tokens: 128 query rows a KV head, more than a decode tile.
    data = PagedBatch([90, 0, 37], heads_q=32, heads_kv=1, dim=64, page_size=16, queries=4, seed=9)
    plan = plan_paged_attention(batch=3, num_q_heads=32, num_kv_heads=1, head_dim=64, page_size=16, max_context=96,
                                num_queries=4, dtype=torch.float16, device="cpu", return_lse=True)
    assert plan.config["VARIANT"] == "prefill"
    out, lse = plan.run(data.q, data.k_cache, data.v_cache, data.block_table, data.context_lens)
    want, want_lse = data.reference(1 / 8)
    assert_close(out, want, tolerance("fp16"), "out")
    assert_close(lse, want_lse, 1e-4, "lse")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_scales_are_refused(bad):
    data = PagedBatch([20], heads_q=2, heads_kv=1, dim=64, page_size=16)
    with pytest.raises(BadInputError, match="scale must be a finite number"):
        autotile.paged_attention(data.q[:, 0], data.k_cache, data.v_cache, data.block_table, data.context_lens,
                                 scale=bad)


def test_an_empty_batch_gives_empty_outputs():
    cache = torch.randn(4, 16, 2, 64).half()
    q = torch.randn(0, 8, 64).half()
    table, lens = torch.zeros(0, 3, dtype=torch.int32), torch.zeros(0, dtype=torch.int32)
    out = autotile.paged_attention(q, cache, cache, table, lens)
    assert out.shape == (0, 8, 64)
    out, lse = autotile.paged_attention(q, cache, cache, table, lens, max_context=64, return_lse=True)
    assert out.shape == (0, 8, 64) and lse.shape == (0, 8)
    plan = plan_paged_attention(batch=0, num_q_heads=8, num_kv_heads=2, head_dim=64, page_size=16, max_context=64,
                                dtype=torch.float16, device="cpu")
    assert plan.run(q, cache, cache, table, lens).shape == (0, 8, 64)


def test_speculative_queries_return_lse_per_query_and_explain_names_the_plan_problem():
    data = PagedBatch([70, 44], heads_q=4, heads_kv=2, dim=64, page_size=16, queries=2, seed=3)
    out, lse = autotile.paged_attention(data.q, data.k_cache, data.v_cache, data.block_table, data.context_lens,
                                        max_context=100, return_lse=True)
    want, want_lse = data.reference(1 / 8)
    assert out.shape == (2, 2, 4, 64) and lse.shape == (2, 2, 4)
    assert_close(out, want, tolerance("fp16"), "out")
    assert_close(lse, want_lse, 1e-4, "lse")
    info = autotile.explain("paged_attention", data.q, data.k_cache, data.v_cache, data.block_table,
                            data.context_lens, max_context=100)
    assert info["problem"]["max_context"] == 128 and info["problem"]["num_queries"] == 2
    assert info["config"] == dict(ops_paged._decode_plan(data.q, data.k_cache, 128, None, False).config)


def test_configs_not_tuned_for_the_exact_problem_run_with_the_balanced_scheduler():
    from autotile.device import interpret_device
    from autotile.families.paged import FAMILY, PagedProblem, balanced_tile
    from autotile.runtime.dispatch import Resolution
    from autotile.runtime.paged_plan import served_config
    from autotile.space import Config

    device = interpret_device()
    problem = PagedProblem(64, 32, 8, 128, 16, 4096)
    tuned = Config(VARIANT="whole", BLOCK_N=128, PARTITION_SIZE=256, BLOCK_M=16, num_warps=8, num_stages=2)
    assert FAMILY.space(problem, device).is_feasible(tuned)
    exact = Resolution(tuned, "shipped-db", device.key, "key", "key", "exact")
    assert served_config(problem, device, exact) is tuned
    nearby = Resolution(tuned, "shipped-db", device.key, "key", "other", "nearest")
    # ... with the measured balanced tile: 64 tokens, two in flight (3 stages), 4 warps where (sequence, KV
    # head) items outnumber the SMs and D <= 128, 32 tokens for few items.
    assert balanced_tile(problem, device.sm_count) == dict(BLOCK_N=64, num_warps=4, num_stages=3)
    assert dict(served_config(problem, device, nearby)) == dict(tuned, VARIANT="balanced", BLOCK_N=64, num_warps=4,
                                                                num_stages=3)
    one_long = PagedProblem(1, 32, 8, 128, 16, 32768)
    assert balanced_tile(one_long, 132) == dict(BLOCK_N=32, num_warps=4, num_stages=3)
    assert balanced_tile(PagedProblem(64, 16, 8, 256, 16, 32768), 132)["BLOCK_N"] == 32  # D = 256
    short = PagedProblem(64, 32, 8, 128, 16, 256)  # nothing to split: kept as it is
    whole = Config(dict(tuned, BLOCK_N=64))
    assert served_config(short, device, Resolution(whole, "default", device.key, "k")) is whole
    # A plan (and explain) of an untuned shape: the default's tile shape, balanced scheduling.
    plan = plan_paged_attention(batch=64, num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16,
                                max_context=4096, dtype=torch.float16, device="cpu")
    assert plan.config["VARIANT"] == "balanced" and plan.source == "default, default, balanced"
    q, cache = torch.zeros(64, 32, 128).half(), torch.zeros(8, 16, 8, 128).half()
    table, lens = torch.zeros(64, 256, dtype=torch.int32), torch.full((64,), 4096, dtype=torch.int32)
    info = autotile.explain("paged_attention", q, cache, cache, table, lens, max_context=4096)
    assert info["config"] == dict(plan.config)
