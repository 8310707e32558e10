"""Gemma-2's soft-capped prefill through `autotile.flash_attention`, the Gluon forward's soft-capping off and on (GPU).

    PYTHONPATH=. python benchmarks/prototypes/gluon_softcap_time.py --out OUT/gluon_softcap.md [--flex]

`flash_space.GLUON_SOFTCAP` decides whether soft-capped calls may take the Gluon forward (on) or stay on the
Triton forward (off). For each shape each setting is resolved through the op (what `explain` names), checked
against a float32 reference, and captured in a CUDA graph; the two graphs are then replayed in interleaved rounds
of `do_bench` medians with L2 flushed. `--flex` adds FlexAttention (torch.compile, soft-capping as a score_mod:
what a PyTorch user runs for Gemma-2) on the 1 x 4096 rows.
"""
from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

# (model, Hq, Hkv, D): Gemma-2-9B and Gemma-2-27B heads; both cap logits at 50 (their config's attn_logit_softcapping).
MODELS = (("gemma2-9b", 16, 8, 256), ("gemma2-27b", 32, 16, 128))
SHAPES = ((1, 4096), (4, 2048), (16, 512))
SOFTCAP = 50.0


def reference(q, k, v, softcap: float) -> torch.Tensor:
    """Causal soft-capped attention in float32, one head group at a time (bounded memory)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1).float(), v.repeat_interleave(group, 1).float()
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    seq = q.shape[2]
    mask = torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril()
    for h in range(q.shape[1]):
        s = q[:, h].float() @ k[:, h].transpose(-1, -2) * q.shape[-1] ** -0.5
        s = softcap * torch.tanh(s / softcap)
        out[:, h] = torch.softmax(s.masked_fill(~mask, float("-inf")), -1) @ v[:, h]
    return out


def graph_of(fn):
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def served(gluon: bool, q, k, v):
    """The op's call with GLUON_SOFTCAP set as asked, its output, and what explain() says serves it."""
    import autotile
    from autotile.families import flash_space
    from autotile.runtime.dispatch import clear_cache

    flash_space.GLUON_SOFTCAP = gluon
    clear_cache()
    info = autotile.explain("flash_attention", q, k, v, causal=True, softcap=SOFTCAP)
    out = autotile.flash_attention(q, k, v, causal=True, softcap=SOFTCAP)
    replay = graph_of(lambda: autotile.flash_attention(q, k, v, causal=True, softcap=SOFTCAP))
    return replay, out, f"{info['source']} {info['config']}"


def flex_call(q, k, v):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def softcap_mod(score, b, h, q_idx, kv_idx):
        return SOFTCAP * torch.tanh(score / SOFTCAP)

    seq = q.shape[2]
    mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, seq, seq, device=q.device)
    compiled = torch.compile(flex_attention, dynamic=False)
    return lambda: compiled(q, k, v, score_mod=softcap_mod, block_mask=mask, enable_gqa=True)


def main() -> None:
    import triton.testing

    from autotile.bench import interleaved_medians

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--flex", action="store_true")
    args = parser.parse_args()
    rows = []
    for name, hq, hkv, dim in MODELS:
        for batch, seq in SHAPES:
            gen = torch.Generator(device="cuda").manual_seed(seq + dim)
            q, k, v = (torch.randn(batch, h, seq, dim, device="cuda", generator=gen, dtype=torch.bfloat16)
                       for h in (hq, hkv, hkv))
            want = reference(q, k, v, SOFTCAP)
            impls, errs, what = {}, {}, {}
            for label, gluon in (("triton", False), ("gluon", True)):
                impls[label], out, what[label] = served(gluon, q, k, v)
                errs[label] = ((out.float() - want).abs().max() / want.abs().max()).item()
            if args.flex and (batch, seq) == (1, 4096):
                impls["flex"] = flex_call(q, k, v)
                flex_out = impls["flex"]()
                errs["flex"] = ((flex_out.float() - want).abs().max() / want.abs().max()).item()
            ms = interleaved_medians(impls, args.rounds, lambda fn: triton.testing.do_bench(fn, warmup=10, rep=40))
            flops = 4 * batch * hq * seq * seq * dim / 2  # causal: half the score matrix
            row = dict(model=name, shape=f"{batch} x {seq}", ms=ms, errs=errs, what=what,
                       tflops={key: flops / (t * 1e-3) / 1e12 for key, t in ms.items()})
            rows.append(row)
            print(f"{name} {batch}x{seq}: " + ", ".join(
                f"{key} {t:.4f} ms ({row['tflops'][key]:.0f} TF/s, err {errs[key]:.4f})" for key, t in ms.items())
                + f" | {what}", flush=True)
    import triton

    lines = [f"# Gemma-2 soft-capped causal prefill through the op, {torch.cuda.get_device_name()}, torch "
             f"{torch.__version__}, triton {triton.__version__}, {datetime.date.today()}, bf16, softcap {SOFTCAP:g}, "
             f"CUDA-graph replays, medians of {args.rounds} interleaved rounds", "",
             "| model | B x S | Triton forward ms (TF/s) | Gluon forward ms (TF/s) | Gluon / Triton speed-up | "
             "FlexAttention ms | rel err Triton / Gluon | served (Gluon on) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ms, tf = r["ms"], r["tflops"]
        flex = f"{ms['flex']:.4f} ({tf['flex']:.0f})" if "flex" in ms else "-"
        lines.append(f"| {r['model']} | {r['shape']} | {ms['triton']:.4f} ({tf['triton']:.0f}) | "
                     f"{ms['gluon']:.4f} ({tf['gluon']:.0f}) | {ms['triton'] / ms['gluon']:.3f}x | {flex} | "
                     f"{r['errs']['triton']:.4f} / {r['errs']['gluon']:.4f} | `{r['what']['gluon']}` |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
