"""Soft-capped and windowed prefill through `autotile.flash_attention`, the Gluon forward's feature off and on (GPU).

    PYTHONPATH=. python benchmarks/prototypes/gluon_features_time.py --feature softcap --out OUT/softcap.md [--flex]
    PYTHONPATH=. python benchmarks/prototypes/gluon_features_time.py --feature window --out OUT/window.md [--flex]
    PYTHONPATH=. python benchmarks/prototypes/gluon_features_time.py --feature two_sided --out OUT/two_sided.md
    PYTHONPATH=. python benchmarks/prototypes/gluon_features_time.py --feature alibi --out OUT/alibi.md

`flash_space.GLUON_SOFTCAP` (Gemma-2's capped logits), `flash_space.GLUON_WINDOW` (sliding windows: Mistral-7B
v0.1, Gemma-2's and Gemma-3's local layers) and `flash_space.GLUON_TWO_SIDED_WINDOW` (windows with both sides, not
causal: ModernBERT's local layers) and `flash_space.GLUON_ALIBI` (ALiBi's slopes: MPT, BLOOM) decide whether such calls may take the Gluon forward (on) or stay on the
Triton forward (off). For each shape each setting is resolved through the op (what `explain` names), checked
against a float32 reference, and captured in a CUDA graph; the graphs are then replayed in interleaved rounds of
`do_bench` medians with L2 flushed. Window rows also time the same call without its window (every causal key: what a
kernel without windows would cost). `--flex` adds FlexAttention (torch.compile, the feature as a score_mod or block
mask: what a PyTorch user runs for these models) on each model's first shape.
"""
from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

# (model, Hq, Hkv, D, window (left keys; -1: none), softcap, shapes (batch, tokens)): the models' own heads, causal.
# Gemma-2 caps logits at 50 (attn_logit_softcapping) and its local layers see 4096 tokens; Gemma-3's local layers
# 1024; Mistral-7B v0.1 4096. TWO_SIDED_CASES are not causal: their window (left, right) keys either side; ModernBERT's
# local layers see 64 keys each side (local_attention 128).
SOFTCAP_CASES = (("gemma2-9b", 16, 8, 256, -1, 50.0, ((1, 4096), (4, 2048), (16, 512))),
                 ("gemma2-27b", 32, 16, 128, -1, 50.0, ((1, 4096), (4, 2048), (16, 512))))
WINDOW_CASES = (("mistral-7b-v0.1", 32, 8, 128, 4095, 0.0, ((1, 8192), (1, 16384))),
                ("gemma3-12b", 16, 8, 256, 1023, 0.0, ((1, 4096), (1, 8192))),
                ("gemma3-27b", 32, 16, 128, 1023, 0.0, ((1, 8192), (2, 4096))),
                ("gemma2-9b local", 16, 8, 256, 4095, 50.0, ((1, 8192),)))
TWO_SIDED_CASES = (("modernbert-base", 12, 12, 64, (64, 64), 0.0, ((4, 8192), (16, 2048))),
                   ("modernbert-large", 16, 16, 64, (64, 64), 0.0, ((4, 8192),)))
# ALiBi: MPT-7B and BLOOM-7B1 (32 heads of 128, MHA), causal, the ALiBi paper's slopes.
ALIBI_CASES = (("mpt-7b", 32, 32, 128, -1, 0.0, ((1, 4096), (4, 2048), (16, 512))),)
SWITCH = {"softcap": "GLUON_SOFTCAP", "window": "GLUON_WINDOW", "two_sided": "GLUON_TWO_SIDED_WINDOW",
          "alibi": "GLUON_ALIBI"}


def sides(window) -> tuple[int, int, bool]:
    """(left, right, causal) of a case's window: keys left of the diagonal (-1: none) for causal cases, or a pair of
    sides for calls that are not causal."""
    return (*window, False) if isinstance(window, tuple) else (window, -1, True)


def reference(q, k, v, window, softcap: float, slopes=None) -> torch.Tensor:
    """Attention in float32, windowed, soft-capped and ALiBi-biased as the case asks, one head at a time (bounded
    memory)."""
    left, right, causal = sides(window)
    group = q.shape[1] // k.shape[1]
    seq = q.shape[2]
    rows = torch.arange(seq, device=q.device)[:, None]
    cols = torch.arange(seq, device=q.device)[None, :]
    seen = ((cols <= rows) if causal else (cols <= rows + right) if right >= 0 else True) & (
        (cols >= rows - left) if left >= 0 else True)
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for h in range(q.shape[1]):
        kh, vh = k[:, h // group].float(), v[:, h // group].float()
        s = q[:, h].float() @ kh.transpose(-1, -2) * q.shape[-1] ** -0.5
        if softcap > 0:
            s = softcap * torch.tanh(s / softcap)
        if slopes is not None:
            s = s - slopes[h] * (rows - cols).abs()
        out[:, h] = torch.softmax(s.masked_fill(~seen, float("-inf")), -1) @ vh
    return out


def graph_of(fn):
    """A replay of fn captured in a CUDA graph. The replay holds fn, and so what fn holds: the graph holds only raw
    addresses, and tensors that died with fn were released at the next capture (an illegal access on replay)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()

    def replay():
        graph.replay()
    replay.holds = fn
    return replay


def served(switch: str, on: bool, q, k, v, causal: bool = True, **features):
    """The op's call with the Gluon switch set as asked: a graph replay, its output, and what explain() names."""
    import autotile
    from autotile.families import flash_space
    from autotile.runtime.dispatch import clear_cache

    setattr(flash_space, switch, on)
    clear_cache()
    info = autotile.explain("flash_attention", q, k, v, causal=causal, **features)
    out = autotile.flash_attention(q, k, v, causal=causal, **features)
    replay = graph_of(lambda: autotile.flash_attention(q, k, v, causal=causal, **features))
    return replay, out, f"{info['source']} {info['config']}"


def gluon_tiles(switch: str, q, k, v, causal: bool = True, **features) -> dict:
    """Each Gluon key block's deepest pipeline the space offers for the call (the default among them), launched
    through the family as graph replays: which tile the policy should take with the feature."""
    from autotile.device import current_device
    from autotile.families import flash_space
    from autotile.families.flash import FAMILY

    setattr(flash_space, switch, True)
    problem = FAMILY.problem_from_tensors(q, k, v, causal=causal, **features)
    return {f"gluon {block_n} keys x {config['num_stages']}": kept_replay(problem, config, q, k, v)[0]
            for block_n, config in sorted(deepest_gluon(problem, current_device(q.device)).items())}


def deepest_gluon(problem, device) -> dict:
    """BLOCK_N -> the deepest pipeline of the Gluon forward the space offers for `problem` with that key block."""
    from autotile.families.flash import FAMILY, GLUON_WS

    deepest = {}
    for c in FAMILY.space(problem, device).feasible():
        if c["LOADS"] == GLUON_WS and c["num_stages"] > deepest.get(c["BLOCK_N"], {}).get("num_stages", 0):
            deepest[c["BLOCK_N"]] = c
    return deepest


def kept_replay(problem, config, q, k, v, **more) -> tuple:
    """(a graph replay of `config`'s kept plan on q, k, v and `more` inputs (a packed call's cumulative lengths), as
    the op's, its outputs) through the family."""
    from autotile.families.flash import FAMILY

    inputs = {"q": q, "k": k, "v": v, **more}
    outputs = FAMILY.allocate_outputs(problem, inputs)
    plan, plan_args = FAMILY._planned(problem, config, inputs, outputs, scale=q.shape[-1] ** -0.5, keep=True)
    return graph_of(lambda: plan(*plan_args)), outputs


def flex_call(q, k, v, window, softcap: float, slopes=None):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def capped(score, b, h, q_idx, kv_idx):
        return softcap * torch.tanh(score / softcap)

    def biased(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx).abs()

    left, right, causal = sides(window)

    def seen(b, h, qi, ki):
        if not causal:
            return (qi - ki <= left) & (ki - qi <= right)  # (the two-sided cases have both sides)
        return (qi >= ki) & (qi - ki <= left) if left >= 0 else qi >= ki

    seq = q.shape[2]
    mask = create_block_mask(seen, None, None, seq, seq, device=q.device)
    compiled = torch.compile(flex_attention, dynamic=False)
    score_mod = capped if softcap > 0 else biased if slopes is not None else None
    return lambda: compiled(q, k, v, score_mod=score_mod, block_mask=mask, enable_gqa=True)


def write_table(out: Path, lines: list[str], rows: list[dict], what: str) -> None:
    """The table's lines written to `out` and printed; exits non-zero where a `what` (each row's "errs") is off the
    float32 reference by more than 2e-2."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    worst = max(max(r["errs"].values()) for r in rows)
    if worst > 2e-2:
        raise SystemExit(f"a {what} is off the float32 reference by {worst:.4f}")


def main() -> None:
    import triton
    import triton.testing

    from autotile.bench import interleaved_medians

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--feature", choices=sorted(SWITCH), required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--flex", action="store_true")
    parser.add_argument("--tiles", action="store_true", help="also time each Gluon key block (printed, not tabled)")
    args = parser.parse_args()
    switch = SWITCH[args.feature]
    rows = []
    from autotile.families.flash_reference import seen_pairs

    from autotile.families.flash import alibi_slopes

    cases = {"softcap": SOFTCAP_CASES, "window": WINDOW_CASES, "two_sided": TWO_SIDED_CASES,
             "alibi": ALIBI_CASES}[args.feature]
    for name, hq, hkv, dim, window, softcap, shapes in cases:
        left, right, causal = sides(window)
        features = dict(softcap=softcap) if softcap > 0 else {}
        if left >= 0:
            features["window"] = (left, 0 if causal else right)
        for batch, seq in shapes:
            gen = torch.Generator(device="cuda").manual_seed(seq + dim)
            q, k, v = (torch.randn(batch, h, seq, dim, device="cuda", generator=gen, dtype=torch.bfloat16)
                       for h in (hq, hkv, hkv))
            slopes = alibi_slopes(hq).cuda() if args.feature == "alibi" else None
            if slopes is not None:
                features["alibi_slopes"] = slopes
            want = reference(q, k, v, window, softcap, slopes)
            impls, errs, what = {}, {}, {}
            for label, on in (("triton", False), ("gluon", True)):
                impls[label], out, what[label] = served(switch, on, q, k, v, causal, **features)
                errs[label] = ((out.float() - want).abs().max() / want.abs().max()).item()
            if left >= 0:
                unwindowed = {key: value for key, value in features.items() if key != "window"}
                impls["no window"], _, what["no window"] = served(switch, True, q, k, v, causal, **unwindowed)
            if args.tiles:
                impls.update(gluon_tiles(switch, q, k, v, causal, **features))
            if args.flex and (batch, seq) == shapes[0]:
                impls["flex"] = flex_call(q, k, v, window, softcap, slopes)
                errs["flex"] = ((impls["flex"]().float() - want).abs().max() / want.abs().max()).item()
            ms = interleaved_medians(impls, args.rounds, lambda fn: triton.testing.do_bench(fn, warmup=10, rep=40))
            flops = 4 * batch * hq * seen_pairs(seq, seq, causal, left, right) * dim
            row = dict(model=name, shape=f"{batch} x {seq}", window=window, softcap=softcap, ms=ms, errs=errs,
                       what=what, tflops={key: flops / (t * 1e-3) / 1e12 for key, t in ms.items()})
            rows.append(row)
            print(f"{name} {batch}x{seq}: " + ", ".join(f"{key} {t:.4f} ms ({row['tflops'][key]:.0f} TF/s)"
                                                       for key, t in ms.items()) + f" | err {errs} | {what}", flush=True)

    def cell(r, key):
        return f"{r['ms'][key]:.4f} ({r['tflops'][key]:.0f})" if key in r["ms"] else "-"

    lines = [f"# Gluon forward {args.feature} off and on, prefill through the op (causal but for two_sided), {torch.cuda.get_device_name()}, "
             f"torch {torch.__version__}, triton {triton.__version__}, {datetime.date.today()}, bf16, CUDA-graph "
             f"replays, medians of {args.rounds} interleaved rounds; TF/s count the pairs the call's mask leaves", "",
             "| model | B x S | window / softcap | Triton forward ms (TF/s) | Gluon forward ms (TF/s) | Gluon / Triton | "
             "no window ms | FlexAttention ms | rel err Triton / Gluon / Flex | served (on) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        flex_err = f" / {r['errs']['flex']:.4f}" if "flex" in r["errs"] else ""
        lines.append(f"| {r['model']} | {r['shape']} | {r['window']} / {r['softcap']:g} | {cell(r, 'triton')} | "
                     f"{cell(r, 'gluon')} | {r['ms']['triton'] / r['ms']['gluon']:.3f}x | {cell(r, 'no window')} | "
                     f"{cell(r, 'flex')} | {r['errs']['triton']:.4f} / {r['errs']['gluon']:.4f}{flex_err} | "
                     f"`{r['what']['gluon']}` |")
    write_table(args.out, lines, rows, "call")


if __name__ == "__main__":
    main()
