"""Chunked prefill over a paged KV cache under Triton's CPU interpreter: packed ragged queries (cu_seqlens_q),
each new token attending causally to its sequence's cached prefix and the new tokens before it; the new
tokens' K/V written into the pages PagedKVCache reserved. Checked against a float64 reference over
contiguous copies of K and V.
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
from autotile.kvcache import PagedKVCache  # noqa: E402
from autotile.runtime.paged_plan import plan_paged_prefill  # noqa: E402

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}


class PrefillBatch:
    """Sequences with cached prefixes of contexts[b] - new[b] tokens in a PagedKVCache (appended in interleaved
    chunks, with junk sequences between them so pages are shuffled), and the new tokens' q, K, V and slots."""

    def __init__(self, contexts, new, *, heads_q, heads_kv, dim, page_size, dtype="fp16", kv_dtype=None, seed=0):
        gen = torch.Generator().manual_seed(seed)
        kv_dtype = kv_dtype or dtype
        scales = dict(k_scale=0.01, v_scale=0.012) if kv_dtype == "fp8" else {}
        pages = sum(-(-n // page_size) for n in contexts) + 2 * len(contexts) + 8
        self.cache = PagedKVCache(num_layers=1, num_pages=pages, page_size=page_size, num_kv_heads=heads_kv,
                                  head_dim=dim, dtype=DTYPES[kv_dtype], **scales)
        self.ids = list(range(len(contexts)))
        prefix = [c - n for c, n in zip(contexts, new)]
        for i in self.ids:
            self.cache.allocate(i)
        step = 0
        while any(self.cache.length(i) < prefix[i] for i in self.ids):
            for i in self.ids:
                n = min(prefix[i] - self.cache.length(i), 3 + (5 * step + i) % page_size)
                if n > 0:
                    self.cache.append(i, torch.randn(n, heads_kv, dim, generator=gen),
                                      torch.randn(n, heads_kv, dim, generator=gen))
            junk = f"junk{step}"
            self.cache.allocate(junk)
            self.cache.append(junk, torch.randn(2, heads_kv, dim), torch.randn(2, heads_kv, dim))
            if step % 2:
                self.cache.free(junk)
            step += 1
        self.slots = torch.cat([self.cache.reserve(i, n) for i, n in zip(self.ids, new)])
        total = sum(new)
        self.q = torch.randn(total, heads_q, dim, generator=gen).to(DTYPES[dtype])
        self.k_new = torch.randn(total, heads_kv, dim, generator=gen).to(DTYPES[dtype])
        self.v_new = torch.randn(total, heads_kv, dim, generator=gen).to(DTYPES[dtype])
        self.cu_seqlens = torch.tensor([0] + torch.tensor(new).cumsum(0).tolist(), dtype=torch.int32)
        self.block_table = self.cache.block_table(self.ids)
        self.context_lens = self.cache.context_lens(self.ids)
        self.new, self.contexts = list(new), list(contexts)
        self.k_scale, self.v_scale = self.cache.k_scale, self.cache.v_scale

    def args(self):
        return (self.q, self.cache.k_pools[0], self.cache.v_pools[0], self.block_table, self.cu_seqlens,
                self.context_lens)

    def writes(self):
        return dict(k_new=self.k_new, v_new=self.v_new, slot_mapping=self.slots)

    def reference(self, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """float64 (out (T, Hq, D), lse (T, Hq)) over the cache's contents read back as contiguous tensors."""
        out = torch.zeros(self.q.shape, dtype=torch.float64)
        lse = torch.zeros(self.q.shape[:2], dtype=torch.float64)
        for b, i in enumerate(self.ids):
            start, end = int(self.cu_seqlens[b]), int(self.cu_seqlens[b + 1])
            if start == end:
                continue
            k, v = (t.double() for t in self.cache.gather(i))
            if self.k_scale is not None:
                k, v = k * self.k_scale.double()[None, :, None], v * self.v_scale.double()[None, :, None]
            group = self.q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            logits = torch.einsum("qhd,khd->hqk", self.q[start:end].double(), k) * scale
            n, new = k.shape[0], end - start
            hidden = torch.arange(n)[None, :] > (n - new + torch.arange(new))[:, None]
            logits = logits.masked_fill(hidden[None], -math.inf)
            out[start:end] = torch.einsum("hqk,khd->qhd", torch.softmax(logits, dim=-1), v)
            lse[start:end] = torch.logsumexp(logits, dim=-1).transpose(0, 1)
        return out, lse


def assert_close(got, want, tol, what):
    """|got - want| <= atol + rtol |want| (tol: (atol, rtol) or atol), naming the worst element."""
    atol, rtol = tol if isinstance(tol, tuple) else (tol, 0.0)
    err = (got.double() - want).abs()
    excess = err - (atol + rtol * want.abs())
    worst = tuple(int(i) for i in torch.unravel_index(excess.argmax(), excess.shape))
    assert excess.max() <= 0, (f"{what}: |err| {float(err[worst]):.3g} above atol {atol:.3g} + rtol {rtol:.3g} x "
                               f"|{float(want[worst]):.4g}| at {worst}")


def tolerance(dtype: str) -> tuple[float, float]:
    """(atol, rtol), as PagedFamily.tolerance justifies them: attention weights rounded to the query dtype before
    the P @ V dot move the output by u times a weighted mean of |v| (V ~ N(0, 1): below 2), 2u absolute; the
    output rounded to its dtype, 2u relative."""
    u = {"fp16": 2.0**-11, "bf16": 2.0**-8}[dtype]
    return 2 * u, 2 * u


# (contexts, new tokens, Hq, Hkv, D, page_size, dtype, kv_dtype, BLOCK_M, BLOCK_N)
CASES = [
    ([70, 33, 16, 5], [30, 33, 1, 0], 8, 2, 96, 16, "fp16", None, 16, 16),  # ragged, pure prefill, 1 token, none
    ([45, 25], [45, 7], 4, 4, 64, 8, "bf16", None, 32, 32),  # MHA, bf16, blocks across pages of 8
    ([50, 21], [20, 21], 8, 2, 128, 16, "fp16", "fp8", 16, 32),  # fp8 cache written from fp16 tokens
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"D{c[4]}-{c[2]}/{c[3]}-{c[7] or c[6]}")
def test_prefill_writes_the_new_tokens_and_attends_causally(case):
    contexts, new, heads_q, heads_kv, dim, page_size, dtype, kv_dtype, block_m, block_n = case
    data = PrefillBatch(contexts, new, heads_q=heads_q, heads_kv=heads_kv, dim=dim, page_size=page_size,
                        dtype=dtype, kv_dtype=kv_dtype, seed=dim)
    config = dict(VARIANT="prefill", BLOCK_N=block_n, PARTITION_SIZE=256, BLOCK_M=block_m, num_warps=4, num_stages=2)
    plan = plan_paged_prefill(batch=len(contexts), num_tokens=sum(new), num_q_heads=heads_q, num_kv_heads=heads_kv,
                              head_dim=dim, page_size=page_size, max_context=max(contexts), dtype=DTYPES[dtype],
                              kv_dtype=DTYPES[kv_dtype or dtype], device="cpu", return_lse=True, config=config,
                              checks=True)
    scale = 0.9 / math.sqrt(dim)
    out = torch.full_like(data.q, float("nan"))
    got, lse = plan.run(*data.args(), **data.writes(), scale=scale, k_scale=data.k_scale, v_scale=data.v_scale,
                        out=out)
    assert got is out and lse.shape == data.q.shape[:2]
    # The new tokens are in their pages (as the cache's dtype stores them).
    for b, i in enumerate(data.ids):
        k, _ = data.cache.gather(i)
        start, end = int(data.cu_seqlens[b]), int(data.cu_seqlens[b + 1])
        stored = k[contexts[b] - new[b]:].float()
        if data.k_scale is not None:
            stored = stored * data.k_scale[None, :, None]
            torch.testing.assert_close(stored, data.k_new[start:end].float(), rtol=2**-3, atol=1e-2)
        else:
            assert torch.equal(stored, data.k_new[start:end].float())
    want, want_lse = data.reference(scale)
    assert_close(out, want, tolerance(dtype), "out")
    assert_close(lse, want_lse, 1e-4, "lse")


def test_two_chunks_give_what_one_prefill_gives():
    """Chunked prefill: the second chunk attends to the first chunk's K/V, now cached, plus its own."""
    gen = torch.Generator().manual_seed(3)
    tokens, heads, dim = 40, 2, 64
    q = torch.randn(tokens, 4, dim, generator=gen).half()
    k = torch.randn(tokens, heads, dim, generator=gen).half()
    v = torch.randn(tokens, heads, dim, generator=gen).half()
    results = []
    for cut in (tokens, 17):
        cache = PagedKVCache(num_layers=1, num_pages=8, page_size=16, num_kv_heads=heads, head_dim=dim)
        cache.allocate("s")
        outs = []
        for lo, hi in ((0, cut), (cut, tokens)):
            if lo == hi:
                continue
            slots = cache.reserve("s", hi - lo)
            outs.append(autotile.paged_prefill(
                q[lo:hi], cache.k_pools[0], cache.v_pools[0], cache.block_table(["s"], max_pages=3),
                torch.tensor([0, hi - lo], dtype=torch.int32), cache.context_lens(["s"]),
                k_new=k[lo:hi], v_new=v[lo:hi], slot_mapping=slots, max_context=tokens))
        results.append(torch.cat(outs))
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=2 * 2.0**-11)


def test_one_call_reads_the_lengths_without_a_bound_and_refuses_bad_packing(monkeypatch):
    data = PrefillBatch([30, 20], [12, 20], heads_q=4, heads_kv=2, dim=64, page_size=16)
    out = autotile.paged_prefill(*data.args(), **data.writes())
    want, _ = data.reference(1 / 8)
    assert_close(out, want, tolerance("fp16"), "out")
    bounded = autotile.paged_prefill(*data.args(), max_context=32)  # the pages already hold the new tokens
    assert torch.equal(bounded, out)
    q, k_cache, v_cache, table, cu, lens = data.args()
    with pytest.raises(ShapeMismatchError, match="sequence 0 has 12 new tokens but a context of 5"):
        autotile.paged_prefill(q, k_cache, v_cache, table, cu, torch.tensor([5, 20], dtype=torch.int32))
    with pytest.raises(ShapeMismatchError, match="cu_seqlens_q must start at 0"):
        autotile.paged_prefill(q, k_cache, v_cache, table, torch.tensor([0, 12, 31], dtype=torch.int32), lens)
    with pytest.raises(BadInputError, match="together"):
        autotile.paged_prefill(*data.args(), k_new=data.k_new, max_context=32)
    with pytest.raises(BadInputError, match="finite"):
        autotile.paged_prefill(*data.args(), scale=float("inf"))
    # Slots that do not follow the block table would leave the new positions' pages stale (zeros, here: the
    # second sequence's output rows came back 0 without a word).
    k_new, v_new, slots = data.k_new, data.v_new, data.slots
    for bad, words in ((torch.zeros_like(slots), "more than once"), (slots.flip(0), "belongs in slot"),
                       (slots - 10**6, "outside the cache")):
        with pytest.raises(BadInputError, match=words):
            autotile.paged_prefill(*data.args(), k_new=k_new, v_new=v_new, slot_mapping=bad)
    empty = autotile.paged_prefill(torch.zeros(0, 4, 64).half(), k_cache, v_cache, table[:0],
                                   torch.zeros(1, dtype=torch.int32), lens[:0], return_lse=True)
    assert empty[0].shape == (0, 4, 64) and empty[1].shape == (0, 4)


def test_the_prefill_run_reads_nothing_back(monkeypatch):
    data = PrefillBatch([40, 9], [16, 9], heads_q=4, heads_kv=2, dim=64, page_size=16)
    plan = plan_paged_prefill(batch=2, num_tokens=25, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16,
                              max_context=64, dtype=torch.float16, device="cpu", checks=False)  # as on a GPU
    for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__"):
        original = getattr(torch.Tensor, name)

        def guard(self, *args, _original=original, _name=name, **kwargs):
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller.startswith("autotile"):
                raise AssertionError(f"{_name} called from {caller} on the run path")
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, guard)
    out = plan.run(*data.args(), **data.writes())
    monkeypatch.undo()
    want, _ = data.reference(1 / 8)
    assert_close(out, want, tolerance("fp16"), "out")


def test_registered_prefill_op_traces_with_fake_tensors():
    data = PrefillBatch([20], [4], heads_q=2, heads_kv=1, dim=64, page_size=16)
    q, k_cache, v_cache, table, cu, lens = data.args()
    args = (q, k_cache, v_cache, table, cu, lens, data.k_new, data.v_new, data.slots, 0.125, None, None, 32, True)
    torch.library.opcheck(torch.ops.autotile.paged_prefill.default, args, test_utils=("test_schema", "test_faketensor"))


def test_a_plan_for_few_new_tokens_a_sequence_still_gets_prefill_blocks():
    # Mixed steps pack one or two new tokens a sequence: the smallest query block still serves them.
    for heads_q, heads_kv in ((8, 2), (4, 4), (40, 8), (32, 1)):
        plan = plan_paged_prefill(batch=16, num_tokens=16, num_q_heads=heads_q, num_kv_heads=heads_kv, head_dim=128,
                                  page_size=16, max_context=4096, dtype=torch.float16, device="cpu")
        assert plan.config["VARIANT"] == "prefill" and plan.config["BLOCK_M"] >= heads_q // heads_kv


def test_fresh_prompts_of_one_length_attend_as_dense_causal_attention(monkeypatch):
    """B sequences of max_context new tokens and nothing cached: the plan and the one-call op run dense causal
    attention on the new tokens (autotile.paged_fresh), still writing the pages; a given config keeps the kernel."""
    import autotile.runtime.paged_fresh as fresh

    calls = []
    real = fresh.fresh_prefill
    for module in ("autotile.runtime.paged_plan", "autotile.runtime.ops_paged"):
        monkeypatch.setattr(f"{module}.fresh_prefill", lambda *a, **k: calls.append(1) or real(*a, **k))
    data = PrefillBatch([21, 21, 21], [21, 21, 21], heads_q=8, heads_kv=2, dim=64, page_size=16, seed=5)
    scale = 0.7 / math.sqrt(64)
    plan = plan_paged_prefill(batch=3, num_tokens=63, num_q_heads=8, num_kv_heads=2, head_dim=64, page_size=16,
                              max_context=21, dtype=torch.float16, device="cpu", return_lse=True)
    out, lse = plan.run(*data.args(), **data.writes(), scale=scale, out=torch.full_like(data.q, float("nan")))
    assert calls == [1]
    want, want_lse = data.reference(scale)  # over the pages, which hold the new tokens now
    assert_close(out, want, tolerance("fp16"), "out")
    assert_close(lse, want_lse, 1e-4, "lse")
    for b, i in enumerate(data.ids):  # the pages hold the new tokens for the decode steps that follow
        assert torch.equal(data.cache.gather(i)[0], data.k_new[21 * b:21 * (b + 1)])
    one_call = autotile.paged_prefill(*data.args(), **data.writes(), scale=scale, max_context=21)
    assert calls == [1, 1] and torch.equal(one_call, out)
    # A given config, a bound above the prompts, or no new K/V at hand: the paged kernel.
    kernel_config = dict(VARIANT="prefill", BLOCK_N=16, PARTITION_SIZE=256, BLOCK_M=16, num_warps=4, num_stages=2)
    for kwargs, run_kwargs in ((dict(max_context=21, config=kernel_config), data.writes()),
                               (dict(max_context=32), data.writes()), (dict(max_context=21), {})):
        other = plan_paged_prefill(batch=3, num_tokens=63, num_q_heads=8, num_kv_heads=2, head_dim=64, page_size=16,
                                   dtype=torch.float16, device="cpu", **kwargs)
        assert_close(other.run(*data.args(), **run_kwargs, scale=scale), want, tolerance("fp16"), str(kwargs))
    assert calls == [1, 1]
