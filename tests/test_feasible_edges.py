"""Problems at the edges of their families' spaces: each has a feasible config that computes the right numbers,
and the CLI turns what it cannot tune into a one-line error."""
from __future__ import annotations

import json
import math

import pytest
import torch
from click.testing import CliRunner

import autotile
from autotile.cli.db import db_group
from autotile.cli.main import cli
from autotile.device import interpret_device, planned_device
from autotile.families import gemm as gemm_module
from autotile.families.base import is_vendor
from autotile.families.gemm import FAMILY as GEMM, contiguous_problem
from autotile.families.gemm_space import StagedSpace, rule
from autotile.families.paged import FAMILY as PAGED, PagedProblem
from autotile.kvcache import PagedKVCache
from autotile.runtime import dispatch
from autotile.space import Axis
from autotile.tune.driver import tune_problem

CPU = interpret_device()
H200 = planned_device("h200")


# --- fp8 GEMM with K <= 32 -------------------------------------------------------------------------

def fp8_operands(k: int, scales: str, seed: int = 0):
    """a (4, k), b (k, 8) in e4m3 and their scales, with the float64 product they stand for."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(4, k, generator=gen).to(torch.float8_e4m3fn)
    b = torch.randn(k, 8, generator=gen).to(torch.float8_e4m3fn)
    if scales == "tensor":
        scale_a, scale_b = torch.tensor(0.5), torch.tensor(1.5)
    else:
        scale_a, scale_b = torch.rand(4, 1, generator=gen) + 0.5, torch.rand(1, 8, generator=gen) + 0.5
    want = (a.double() @ b.double()) * scale_a.double() * scale_b.double()
    return a, b, scale_a, scale_b, want


def assert_bf16_close(got: torch.Tensor, want: torch.Tensor) -> None:
    # Exact fp8 products summed in fp32, rounded once to bf16 (unit roundoff 2^-8).
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want, rtol=2.0**-7, atol=1e-3)


@pytest.mark.parametrize("k", [16, 32])
def test_fp8_short_k_spaces_hold_the_smallest_fp8_tile(k):
    for scales in ("tensor", "row", "block"):
        problem = contiguous_problem(4, 16, k, "fp8", "bf16", layout_b="col", scale_mode=scales)
        for device in (CPU, H200):
            assert GEMM.default_config(problem, device)["BLOCK_K"] == 64
            assert {c["BLOCK_K"] for c in GEMM.space(problem, device).feasible()} == {64}


@pytest.mark.parametrize("k", [16, 32])
@pytest.mark.parametrize("scales", ["tensor", "row"])
def test_fp8_short_k_default_config_computes_the_product(user_db, k, scales):
    a, b, scale_a, scale_b, want = fp8_operands(k, scales)
    assert autotile.explain("matmul", a, b, scale_a=scale_a, scale_b=scale_b)["source"] == "default"
    assert_bf16_close(autotile.matmul(a, b, scale_a=scale_a, scale_b=scale_b), want)


@pytest.mark.parametrize("k, scales", [(16, "tensor"), (32, "row")])
def test_fp8_short_k_tuned_winner_computes_the_product(user_db, k, scales):
    a, b, scale_a, scale_b, want = fp8_operands(k, scales, seed=1)
    problem = GEMM.problem_from_tensors(a, b, scale_a=scale_a, scale_b=scale_b)
    result = tune_problem(GEMM, problem, CPU, trials=2, db_url=user_db, retime_rounds=1)
    assert result.winner is not None and not is_vendor(result.winner)
    dispatch.clear_cache()
    assert autotile.explain("matmul", a, b, scale_a=scale_a, scale_b=scale_b)["source"] == "user-db"
    assert_bf16_close(autotile.matmul(a, b, scale_a=scale_a, scale_b=scale_b), want)


# --- paged attention at head dim 16 ----------------------------------------------------------------

def test_paged_head_dim_16_short_contexts_are_feasible_and_longer_ones_unchanged():
    for context, queries in ((1, 1), (5, 1), (16, 1), (16, 4), (16, 16)):
        problem = PagedProblem(1, 4, 2, 16, 16, context, num_queries=queries, dtype="fp16", kv_dtype="fp16")
        for device in (CPU, H200):
            assert PAGED.default_config(problem, device)["BLOCK_N"] == 32  # the smallest that gives every thread work
    # From 17 tokens (or D 32) the spaces are what they were: 32 tokens a tile at most, 16 on 2 warps allowed.
    assert max(c["BLOCK_N"] for c in PAGED.space(PagedProblem(1, 4, 2, 16, 16, 17), CPU).feasible()) == 32
    short_wide = {(c["BLOCK_N"], c["num_warps"]) for c in PAGED.space(PagedProblem(1, 4, 2, 32, 16, 5), CPU).feasible()}
    assert short_wide == {(16, 2)}


def cache_with(contexts: list[int], heads_kv: int, dim: int, seed: int = 0) -> PagedKVCache:
    gen = torch.Generator().manual_seed(seed)
    cache = PagedKVCache(num_layers=1, num_pages=16, page_size=16, num_kv_heads=heads_kv, head_dim=dim,
                         dtype=torch.float16)
    for i, n in enumerate(contexts):
        cache.allocate(i)
        if n:
            cache.append(i, torch.randn(n, heads_kv, dim, generator=gen), torch.randn(n, heads_kv, dim, generator=gen))
    return cache


def attention64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """float64 softmax attention of q (Q, Hq, D), the last Q positions of k, v (N, Hkv, D), causal among them."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(group, dim=1) for t in (k, v))
    logits = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    n, new = k.shape[0], q.shape[0]
    hidden = torch.arange(n)[None, :] > (n - new + torch.arange(new))[:, None]
    weights = torch.softmax(logits.masked_fill(hidden[None], -math.inf), dim=-1)
    return torch.einsum("hqk,khd->qhd", weights, v)


# fp16 weights and output: 2u absolute and 2u relative (tests/test_paged_prefill.py's tolerance).
PAGED_TOL = dict(atol=2 * 2.0**-11 * 2, rtol=2 * 2.0**-11)


def test_paged_decode_at_head_dim_16_over_short_contexts(user_db):
    contexts = [1, 5, 16]
    cache = cache_with(contexts, heads_kv=2, dim=16)
    q = torch.randn(len(contexts), 4, 16, generator=torch.Generator().manual_seed(1)).half()
    out = autotile.paged_attention(q, cache.k_pools[0], cache.v_pools[0], cache.block_table(list(range(3))),
                                   cache.context_lens(list(range(3))))
    for b in range(len(contexts)):
        k, v = cache.gather(b)
        torch.testing.assert_close(out[b].double(), attention64(q[b:b + 1], k, v, 0.25)[0], **PAGED_TOL)


def test_paged_prefill_at_head_dim_16_after_a_cached_prefix(user_db):
    gen = torch.Generator().manual_seed(2)
    for prefix, new in ((2, 3), (10, 6), (0, 16)):  # contexts of 5, 16 and 16 (decode-variant and prefill-variant)
        cache = cache_with([prefix], heads_kv=2, dim=16)
        slots = cache.reserve(0, new)
        q = torch.randn(new, 4, 16, generator=gen).half()
        k_new, v_new = torch.randn(new, 2, 16, generator=gen).half(), torch.randn(new, 2, 16, generator=gen).half()
        out = autotile.paged_prefill(q, cache.k_pools[0], cache.v_pools[0], cache.block_table([0]),
                                     torch.tensor([0, new], dtype=torch.int32), cache.context_lens([0]),
                                     k_new=k_new, v_new=v_new, slot_mapping=slots)
        k, v = cache.gather(0)
        assert k.shape[0] == prefix + new
        torch.testing.assert_close(out.double(), attention64(q, k, v, 0.25), **PAGED_TOL)


# --- the CLI ---------------------------------------------------------------------------------------

@pytest.fixture
def run(tmp_path):
    runner = CliRunner()
    db = str(tmp_path / "cli.sqlite")

    def invoke(*args):
        return runner.invoke(cli, list(args) + ["--db", db], catch_exceptions=False)

    return invoke


def assert_one_line_error(result, words: str) -> None:
    assert result.exit_code == 1, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1 and words in errors[0], result.output
    assert "Traceback" not in result.output


def test_cli_plans_and_tunes_fp8_with_k_16(run):
    planned = run("tune", "gemm", "--m", "4", "--n", "16", "--k", "16", "--dtype", "fp8", "--gpu", "h200", "--dry-run")
    assert planned.exit_code == 0, planned.output
    assert '"BLOCK_K":64' in planned.output
    tuned = run("tune", "gemm", "--m", "4", "--n", "16", "--k", "16", "--dtype", "fp8", "--gpu", "interpret",
                "--trials", "2")
    assert tuned.exit_code == 0 and "winner (interpret)" in tuned.output, tuned.output


def test_cli_reports_a_problem_no_config_fits_in_one_line(run, monkeypatch):
    never = StagedSpace([Axis("BLOCK_M", (16,))], [rule("never", ("BLOCK_M",), lambda c: False, "never holds")])
    monkeypatch.setattr(gemm_module, "gemm_space", lambda problem, device: never)
    shape = ("--m", "4", "--n", "16", "--k", "16", "--dtype", "fp16")
    for extra in (("--gpu", "interpret", "--trials", "2"), ("--gpu", "interpret", "--dry-run")):
        assert_one_line_error(run("tune", "gemm", *shape, *extra), "has no feasible config")


@pytest.mark.parametrize("args, words", [
    (("flash", "--seq", "0", "--head-dim", "64", "--trials", "2"), "--seq must be >= 1, got 0"),
    (("flash", "--seq", "64", "--batch", "0", "--head-dim", "64", "--dry-run"), "--batch must be >= 1, got 0"),
    (("flash", "--seq", "64", "--kv-heads", "0", "--head-dim", "64", "--dry-run"), "--kv-heads must be >= 1, got 0"),
    (("elementwise", "--expr", "x+1", "--numel", "0", "--trials", "2"), "--numel must be >= 1, got 0"),
], ids=["flash seq", "flash batch", "flash kv heads", "elementwise numel"])
def test_cli_refuses_sizes_below_one(run, args, words):
    assert_one_line_error(run("tune", *args, "--gpu", "interpret"), words)


def test_import_shows_a_small_integer_it_refuses(tmp_path):
    url = f"sqlite:///{tmp_path / 'tuned.sqlite'}"
    tune_problem(autotile.families.get_family("elementwise"),
                 autotile.families.get_family("elementwise").problem_for_expression("x + 1", "fp32", 64),
                 CPU, trials=1, db_url=url, retime_rounds=1)
    export = tmp_path / "winners.jsonl"
    runner = CliRunner()
    assert runner.invoke(db_group, ["export", "--out", str(export), "--db", url], catch_exceptions=False).exit_code == 0
    header, record, end = export.read_text().splitlines()
    bad = json.loads(record)
    bad["problem"]["numel"] = 0
    export.write_text("\n".join([header, json.dumps(bad), end]) + "\n")
    result = runner.invoke(db_group, ["import", str(export), "--db", f"sqlite:///{tmp_path / 'target.sqlite'}"],
                           catch_exceptions=False)
    assert "problem.numel must be an integer in [1, 9223372036854775807], got 0" in result.stderr, result.output


# --- paged decode of KV groups wider than a decode program ----------------------------------------------------------
@pytest.mark.parametrize("heads_q, heads_kv, head_dim, contexts", [(71, 1, 64, [5, 40]), (160, 2, 32, [17, 3])],
                         ids=["falcon-7b-71-to-1", "80-a-group-2-groups"])
def test_paged_decode_of_a_kv_group_wider_than_a_decode_program_matches_float64(heads_q, heads_kv, head_dim, contexts):
    """One query a sequence, more than MAX_DECODE_ROWS query heads a KV head (Falcon-7B: 71 over 1): the prefill
    variant holds the group; before, no config was feasible and the op raised."""
    gen = torch.Generator().manual_seed(9)
    cache = PagedKVCache(num_layers=1, num_pages=16, page_size=16, num_kv_heads=heads_kv, head_dim=head_dim)
    keys, values = [], []
    for seq, n in enumerate(contexts):
        cache.allocate(seq)
        k, v = (torch.randn(n, heads_kv, head_dim, generator=gen).half() for _ in range(2))
        cache.append(seq, k, v)
        keys.append(k), values.append(v)
    q = torch.randn(len(contexts), heads_q, head_dim, generator=gen).half()
    seqs = list(range(len(contexts)))
    out = autotile.paged_attention(q, cache.k_pools[0], cache.v_pools[0], cache.block_table(seqs),
                                   cache.context_lens(seqs))
    group = heads_q // heads_kv
    for seq in seqs:
        k, v = (t.double().repeat_interleave(group, 1) for t in (keys[seq], values[seq]))
        scores = torch.einsum("hd,nhd->hn", q[seq].double(), k) / math.sqrt(head_dim)
        want = torch.einsum("hn,nhd->hd", torch.softmax(scores, -1), v)
        assert (out[seq].double() - want).abs().max().item() < 4e-3
    problem = PagedProblem(batch=8, num_q_heads=heads_q, num_kv_heads=heads_kv, head_dim=head_dim, page_size=16,
                           max_context=4096)
    assert PAGED.default_config(problem, H200)["VARIANT"] == "prefill"
