"""Paged decode with a sliding window and soft-capping (Mistral-7B, Gemma-2-9B heads) on the GPU, side by side.

    PYTHONPATH=. python benchmarks/paged_features_bench.py --out OUT/paged_features.md     # ~2 min on an H200
    PYTHONPATH=. python benchmarks/paged_features_bench.py --smoke --out /tmp/smoke.md     # CPU, tiny

For each case (heads, head dim, window, softcap, batch x context), first the planned run against a float32
reference over the de-paged K/V of the first and last sequences, then, replayed from CUDA graphs and
interleaved: the planned run with the features; the same plan without them (every key of the context read:
what a window saves); and gather + SDPA under the window's mask (SDPA has no soft-capping: Gemma-2's rows time
it without, a lower bound of that baseline). TB/s count the K and V bytes the window leaves (batch x
min(context, window + 1) keys); copy bandwidth is measured in the same run.
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from paged_bench import Setting, capture, copy_bandwidth_tbps, log, make_decode, side_by_side  # noqa: E402

# (model, Hq, Hkv, D, window, softcap): Mistral-7B v0.1's 4096-token sliding window; Gemma-2-9B's local layers
# (a 4096-token window and logits capped at 50).
MODELS = (("mistral-7b", 32, 8, 128, 4095, 0.0), ("gemma2-9b", 16, 8, 256, 4095, 50.0))
SHAPES = ((1, 32768), (8, 16384), (32, 8192), (64, 4096))
SMOKE_MODELS = (("smoke", 4, 2, 32, 40, 5.0),)
SMOKE_SHAPES = ((2, 150),)


def reference(data, b: int, softcap: float, window: int, scale: float) -> torch.Tensor:
    """(Hq, D) float32 attention of sequence b's query over its de-paged K/V, windowed and soft-capped."""
    n = data.lengths[b]
    pages = data.block_table[b, :-(-n // data.page_size)].long()
    k = data.k_cache[pages].float().flatten(0, 1)[:n]
    v = data.v_cache[pages].float().flatten(0, 1)[:n]
    q = data.q[b, 0].float()  # (Hq, D)
    group = q.shape[0] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # (n, Hq, D)
    logits = torch.einsum("hd,khd->hk", q, k) * scale
    if softcap > 0:
        logits = softcap * torch.tanh(logits / softcap)
    keys = torch.arange(n, device=q.device)
    logits = logits.masked_fill(keys[None, :] < n - 1 - window, float("-inf"))
    return torch.einsum("hk,khd->hd", torch.softmax(logits, -1), v)


def windowed_sdpa(data, window: int, scale: float):
    """Gather the pages, then SDPA under the window's mask: what a user writes without a paged kernel."""
    span = data.block_table.shape[1] * data.page_size
    positions = torch.arange(span, device=data.q.device)
    last = data.context_lens.long()[:, None] - 1  # (B, 1)
    mask = ((positions[None, :] <= last) & (positions[None, :] >= last - window))[:, None, None, :]
    q = data.q.transpose(1, 2)  # (B, Hq, 1, D)
    tables = data.block_table.long()

    def run():
        k = data.k_cache[tables].flatten(1, 2).transpose(1, 2)  # (B, Hkv, span, D)
        v = data.v_cache[tables].flatten(1, 2).transpose(1, 2)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                                                enable_gqa=True)
    return run


def run_case(setting: Setting, model, batch: int, context: int, copy_tbps: float) -> dict:
    import autotile

    name, heads_q, heads_kv, dim, window, softcap = model
    device = "cuda" if setting.cuda else "cpu"
    dtype = torch.bfloat16 if setting.cuda else torch.float16
    data = make_decode([context] * batch, heads_q, heads_kv, dim, dtype=dtype, device=device, seed=batch)
    scale = dim ** -0.5
    plans = {label: autotile.plan_paged_attention(
        batch=batch, num_q_heads=heads_q, num_kv_heads=heads_kv, head_dim=dim, page_size=data.page_size,
        max_context=context, dtype=dtype, device=device, **features)
        for label, features in (("features", dict(softcap=softcap, window=window)), ("plain", {}))}
    out = {label: torch.empty_like(data.q) for label in plans}
    args = (data.q, data.k_cache, data.v_cache, data.block_table, data.context_lens)
    plans["features"].run(*args, scale=scale, out=out["features"])
    worst = 0.0
    for b in sorted({0, batch - 1}):
        want = reference(data, b, softcap, window, scale)
        err = ((out["features"][b, 0].float() - want).abs().max() / want.abs().max()).item()
        worst = max(worst, err)
    impls = {label: capture(setting, lambda plan=plan, label=label: plan.run(*args, scale=scale, out=out[label]))
             for label, plan in plans.items()}
    sdpa = windowed_sdpa(data, window, scale)
    impls["gather + SDPA"] = capture(setting, sdpa)
    ms = side_by_side(setting, impls)
    keys = batch * min(context, window + 1)
    kv_bytes = 2 * keys * heads_kv * dim * data.k_cache.element_size()
    tbps = kv_bytes / (ms["features"] * 1e-3) / 1e12
    row = dict(model=name, batch=batch, context=context, window=window, softcap=softcap, rel_err=worst,
               ms=ms["features"], plain_ms=ms["plain"], sdpa_ms=ms["gather + SDPA"], tbps=tbps,
               copy_share=tbps / copy_tbps, config=plans["features"].config.to_json())
    log(f"{name} {batch} x {context}: {ms['features']:.4f} ms ({tbps:.2f} TB/s, {row['copy_share']:.0%} of copy), "
        f"plain {ms['plain']:.4f}, gather + SDPA {ms['gather + SDPA']:.4f}, rel err {worst:.4f}")
    return row


def markdown(rows: list[dict], copy_tbps: float, setting: Setting) -> str:
    name = torch.cuda.get_device_name() if setting.cuda else "CPU interpreter (smoke)"
    import triton

    lines = [f"# Paged decode with a sliding window and soft-capping, {name}, torch {torch.__version__}, triton "
             f"{triton.__version__}, {datetime.date.today()}, {'bf16' if setting.cuda else 'fp16'}, pages of 16, "
             f"{'CUDA-graph replays' if setting.cuda else 'eager'}, medians of "
             f"{setting.rounds} interleaved rounds; copy bandwidth {copy_tbps:.2f} TB/s", "",
             "| model | B x context | window / softcap | autotile ms | TB/s (window's keys) | % of copy | "
             "same plan, no features, ms | gather + SDPA (masked) ms | vs gather + SDPA | rel err | config |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['batch']} x {r['context']} | {r['window']} / {r['softcap']:g} | "
                     f"{r['ms']:.4f} | {r['tbps']:.2f} | {r['copy_share']:.0%} | {r['plain_ms']:.4f} | "
                     f"{r['sdpa_ms']:.4f} | {r['sdpa_ms'] / r['ms']:.2f}x | {r['rel_err']:.4f} | `{r['config']}` |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="markdown file to write")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU interpreter: checks the script")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    setting = Setting("cpu" if args.smoke else "cuda", args.smoke, True, 1 if args.smoke else args.rounds)
    copy_tbps = copy_bandwidth_tbps(setting)
    rows = []
    for model in SMOKE_MODELS if args.smoke else MODELS:
        for batch, context in SMOKE_SHAPES if args.smoke else SHAPES:
            rows.append(run_case(setting, model, batch, context, copy_tbps))
    text = markdown(rows, copy_tbps, setting)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    bad = [r for r in rows if r["rel_err"] > 2e-2]
    if bad:
        raise SystemExit(f"{len(bad)} case(s) off the float32 reference by more than 2e-2")


if __name__ == "__main__":
    main()
