"""Soft-capping and sliding windows in paged attention (Gemma-2, Mistral), under Triton's CPU interpreter, against
a float64 reference that reads the pages one sequence at a time."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # see tests/test_paged.py

import pytest  # noqa: E402

import autotile  # noqa: E402
from autotile.device import interpret_device  # noqa: E402
from autotile.errors import BadInputError  # noqa: E402
from autotile.families.paged import FAMILY, PagedProblem  # noqa: E402
from autotile.render import render_source  # noqa: E402

CPU = interpret_device()


def reference(inputs: dict, softcap: float, window: int, num_queries: int, scale: float) -> torch.Tensor:
    """(B, Q, Hq, D) float64: query j of a sequence of n tokens sits at n - Q + j and sees keys from
    max(0, its position - window) (all where window is -1) up to itself, its logits soft-capped where softcap > 0."""
    q = inputs["q"].double()
    batch, _, heads, _ = q.shape
    out = torch.zeros_like(q)
    for b in range(batch):
        n = int(inputs["context_lens"][b])
        pages = inputs["block_table"][b].long()
        k = inputs["k_cache"][pages].double().flatten(0, 1)[:n]
        v = inputs["v_cache"][pages].double().flatten(0, 1)[:n]
        group = heads // k.shape[1]
        for h in range(heads):
            for j in range(num_queries):
                position = n - num_queries + j
                logits = (k[:, h // group] @ q[b, j, h]) * scale
                if softcap > 0:
                    logits = softcap * torch.tanh(logits / softcap)
                keys = torch.arange(n)
                seen = (keys <= position) & ((keys >= position - window) if window >= 0 else True)
                out[b, j, h] = torch.softmax(logits.masked_fill(~seen, float("-inf")), 0) @ v[:, h // group]
    return out


# (variant, softcap, window): windows narrower than a token tile, starting mid-partition (a split partition's
# tiles must still end at its end), 0 (the query's own key), and wider than every context.
CASES = [
    ("whole", 5.0, -1), ("whole", 0.0, 7), ("whole", 3.0, 100),
    ("split", 0.0, 100), ("split", 3.0, 300), ("split", 0.0, 0),
    ("balanced", 0.0, 100), ("balanced", 3.0, 7), ("balanced", 2.0, 5000),
    ("prefill", 5.0, -1), ("prefill", 0.0, 7), ("prefill", 3.0, 100),
]


@pytest.mark.parametrize("variant,softcap,window", CASES)
def test_every_variant_soft_caps_and_windows_as_the_float64_reference(variant, softcap, window):
    queries = 20 if variant == "prefill" else 3
    problem = PagedProblem(batch=3, num_q_heads=4, num_kv_heads=2, head_dim=32, page_size=8, max_context=700,
                           mean_context=400, num_queries=queries, dtype="fp16", kv_dtype="fp16", softcap=softcap,
                           window=window)
    inputs = FAMILY.make_inputs(problem, CPU, seed=1)
    outputs = FAMILY.allocate_outputs(problem, inputs)
    config = FAMILY.validate_config(problem, CPU, dict(
        VARIANT=variant, BLOCK_N=32, PARTITION_SIZE=256, BLOCK_M=32 if variant == "prefill" else 16, num_warps=4,
        num_stages=3))
    FAMILY.launch(problem, config, inputs, outputs)
    want = reference(inputs, softcap, window, queries, float(inputs["scale"]))
    err = (outputs["out"].double() - want).abs().max().item()
    assert err < 4e-3, err
    # The family's own check (its reference has the features too) agrees.
    assert FAMILY.check(problem, inputs, outputs, FAMILY.reference(problem, inputs)).ok


def _pages(lengths, page_size=8, heads_kv=2, dim=32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    width = max(-(-n // page_size) for n in lengths)
    pool = width * len(lengths) + 3
    table = torch.randperm(pool, generator=gen)[:width * len(lengths)].view(len(lengths), width).to(torch.int32)
    k = torch.randn(pool, page_size, heads_kv, dim, generator=gen).half()
    v = torch.randn(pool, page_size, heads_kv, dim, generator=gen).half()
    return k, v, table, torch.tensor(lengths, dtype=torch.int32)


def test_the_public_ops_and_plans_take_softcap_and_window():
    k, v, table, lens = _pages([37, 90, 5])
    q = torch.randn(3, 4, 32).half()
    inputs = {"q": q[:, None], "k_cache": k, "v_cache": v, "block_table": table, "context_lens": lens}
    want = reference(inputs, 30.0, 9, 1, 32 ** -0.5)[:, 0]
    got = autotile.paged_attention(q, k, v, table, lens, softcap=30.0, window=9)
    assert (got.double() - want).abs().max() < 4e-3
    # A flash-style (left, 0) window, and a plan made once for the step.
    got = autotile.paged_attention(q, k, v, table, lens, softcap=30.0, window=(9, 0), max_context=96)
    assert (got.double() - want).abs().max() < 4e-3
    plan = autotile.plan_paged_attention(batch=3, num_q_heads=4, num_kv_heads=2, head_dim=32, page_size=8,
                                         max_context=96, dtype=torch.float16, device="cpu", softcap=30.0, window=9)
    assert (plan.run(q, k, v, table, lens).double() - want).abs().max() < 4e-3
    # Without the features the result differs: the call above did not ignore them.
    plain = autotile.paged_attention(q, k, v, table, lens)
    assert (plain.double() - want).abs().max() > 1e-2
    info = autotile.explain("paged_attention", q, k, v, table, lens, softcap=30.0, window=9)
    assert info["problem"]["softcap"] == 30.0 and info["problem"]["window"] == 9
    assert '"window":9' in info["problem_key"]
    # A window wider than every context the step may hold masks nothing: explain names the plain problem the plan
    # serves, as the plan drops the window.
    wide = autotile.explain("paged_attention", q, k, v, table, lens, window=4096, max_context=96)
    plain_plan = autotile.plan_paged_attention(batch=3, num_q_heads=4, num_kv_heads=2, head_dim=32, page_size=8,
                                               max_context=96, dtype=torch.float16, device="cpu", window=4096)
    assert wide["problem"]["window"] == -1 == plain_plan.problem.window


@pytest.mark.parametrize("cached", [False, True], ids=["fresh-prompts", "cached-prefix"])
def test_paged_prefill_windows_fresh_prompts_and_cached_prefixes_alike(cached):
    """Fresh prompts of one length run as dense attention (autotile.flash_attention, with the same features);
    a cached prefix runs the paged prefill kernel."""
    lengths, new = ([40, 40], [40, 40]) if not cached else ([40, 70], [12, 30])
    k, v, table, lens = _pages(lengths, seed=2)
    gen = torch.Generator().manual_seed(3)
    tokens = sum(new)
    q = torch.randn(tokens, 4, 32, generator=gen).half()
    k_new = torch.randn(tokens, 2, 32, generator=gen).half()
    v_new = torch.randn(tokens, 2, 32, generator=gen).half()
    slots = torch.cat([table[b].long().repeat_interleave(8)[n - m:n] * 8 + torch.arange(n - m, n) % 8
                       for b, (n, m) in enumerate(zip(lengths, new))])
    cu = torch.tensor([0, new[0], tokens], dtype=torch.int32)
    got = autotile.paged_prefill(q, k, v, table, cu, lens, k_new=k_new, v_new=v_new, slot_mapping=slots,
                                 max_context=max(lengths), softcap=4.0, window=6)
    start = 0
    for b, (n, m) in enumerate(zip(lengths, new)):
        inputs = {"q": q[start:start + m][None], "k_cache": k, "v_cache": v, "block_table": table[b:b + 1],
                  "context_lens": lens[b:b + 1]}
        want = reference(inputs, 4.0, 6, m, 32 ** -0.5)[0]
        assert (got[start:start + m].double() - want).abs().max() < 4e-3, b
        start += m


@pytest.mark.parametrize("kwargs,words", [
    (dict(softcap=-1.0), "softcap must be a finite number >= 0"),
    (dict(softcap=float("inf")), "softcap must be a finite number >= 0"),
    (dict(window=-2), "window must be an int >= 0"),
    (dict(window=2.5), "window must be an int >= 0"),
    (dict(window=(4, 3)), "right 0 or -1"),
])
def test_bad_features_get_a_clear_error(kwargs, words):
    k, v, table, lens = _pages([9])
    with pytest.raises(BadInputError, match=words):
        autotile.paged_attention(torch.randn(1, 4, 32).half(), k, v, table, lens, **kwargs)


def test_a_plain_call_renders_the_kernels_it_always_had_and_keeps_its_key():
    """Features are render switches: off, the kernels' source names neither (a plain call pays nothing) and the
    problem's key is the one databases were shipped with."""
    for variant in ("whole", "split", "balanced", "prefill"):
        source = render_source(FAMILY.template, VARIANT=variant, FP8_SCALES=False, WRITE_LSE=False, UPCAST_DOTS=False,
                        PREFETCH_PAGES=True, SOFTCAP=False, WINDOW=False)
        assert "softcap" not in source and "window" not in source and "_tanh" not in source, variant
        featured = render_source(FAMILY.template, VARIANT=variant, FP8_SCALES=False, WRITE_LSE=False, UPCAST_DOTS=False,
                          PREFETCH_PAGES=True, SOFTCAP=True, WINDOW=True)
        assert "_tanh(" in featured and "window" in featured, variant
    plain = PagedProblem(4, 32, 8, 128, 16, 4096)
    assert FAMILY.problem_key(plain) == ('{"batch":4,"dtype":"bf16","head_dim":128,"kv_dtype":"bf16",'
                                         '"max_context":4096,"mean_context":4096,"num_kv_heads":8,"num_q_heads":32,'
                                         '"num_queries":1,"page_size":16}')
    windowed = PagedProblem(4, 32, 8, 128, 16, 4096, window=4095)
    assert FAMILY.problem_key(windowed) != FAMILY.problem_key(plain)
    assert FAMILY.distance(windowed, plain) is None  # a plain winner never serves a windowed call
    # The work a window leaves: 4096 keys -> 1 + 511 at window 511.
    assert FAMILY.cost(PagedProblem(4, 32, 8, 128, 16, 4096, window=511)).bytes < FAMILY.cost(plain).bytes / 7


def test_the_benchmark_script_runs_in_its_smoke_mode(tmp_path):
    """benchmarks/paged_features_bench.py, which the GPU runs: its checks and table, on the interpreter."""
    root = Path(__file__).resolve().parent.parent
    out = tmp_path / "features.md"
    done = subprocess.run([sys.executable, str(root / "benchmarks" / "paged_features_bench.py"), "--smoke", "--out",
                           str(out)], cwd=root, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(root)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "| smoke | 2 x 150 | 40 / 5 |" in out.read_text()


def test_a_window_wider_than_the_plans_contexts_is_a_plain_plan():
    plan = autotile.plan_paged_attention(batch=2, num_q_heads=4, num_kv_heads=2, head_dim=32, page_size=8,
                                         max_context=96, dtype=torch.float16, device="cpu", window=4095)
    assert plan.problem.window == -1 and plan.window == -1
    plan = autotile.plan_paged_attention(batch=2, num_q_heads=4, num_kv_heads=2, head_dim=32, page_size=8,
                                         max_context=96, dtype=torch.float16, device="cpu", window=94)
    assert plan.problem.window == 94


def test_the_balanced_kernel_schedules_only_the_keys_a_window_leaves():
    """The device's choice (the chunk size it leaves for the combine kernel) is the host mirror's with a window, and
    a window narrower than the contexts splits them less."""
    from autotile.families.paged import balanced_schedule, paged_launch

    lengths = [4000, 3000]
    problem = PagedProblem(batch=2, num_q_heads=4, num_kv_heads=2, head_dim=32, page_size=16, max_context=4096,
                           mean_context=3500, dtype="fp16", kv_dtype="fp16", window=300)
    config = FAMILY.validate_config(problem, CPU, dict(VARIANT="balanced", BLOCK_N=32, PARTITION_SIZE=256,
                                                       BLOCK_M=16, num_warps=4, num_stages=3))
    k, v, table, lens = _pages(lengths, page_size=16, seed=5)
    launch = paged_launch(problem, config, torch.device("cpu"), num_sms=8)
    q = torch.randn(2, 1, 4, 32).half()
    out = torch.empty_like(q)
    launch.decode(q, k, v, table, lens, out, scale=32 ** -0.5)
    shift = int(launch.schedule[0])
    spans = [min(n, 1 + 300) for n in lengths]
    on_device = [1 if shift < 0 else -(-n // (1 << shift)) for n in spans]
    assert on_device == balanced_schedule(lengths, 2, 8, 256, window=300)
    assert sum(on_device) < sum(balanced_schedule(lengths, 2, 8, 256))
    want = reference({"q": q, "k_cache": k, "v_cache": v, "block_table": table, "context_lens": lens}, 0.0, 300, 1,
                     32 ** -0.5)
    assert (out.double() - want).abs().max() < 4e-3
