"""Decode GEMMs as a model's decode step streams them: every call on its own weight, in a CUDA graph.

Run from the repository root on a CUDA machine:
    python benchmarks/decode_stream_bench.py --out results/decode_stream.md            # ~3 min on an H200
    python benchmarks/decode_stream_bench.py --quick --out results/decode_stream.md    # ~1 min

Why another decode timing: `serve_bench.py` and `gemm_kernels_bench.py` time one weight over and over with
do_bench, which flushes L2 before each call by writing a buffer far larger than L2. The flush's dirty lines
are written back to DRAM while the timed call reads its weight, and a 10-20 us call also carries its whole
launch ramp. A decode step reads each layer's weights once, back to back, from a CUDA graph (vLLM's, or
torch.compile's): nothing flushed, launch gaps a graph's. Here, for each projection shape, R distinct weights
(R x weight bytes >= STREAM_BYTES, far past the H200's 50 MB of L2) are called once each, one call after the
other, in one captured graph. Three graphs a shape, replayed in interleaved rounds (medians):
- cuBLAS: `F.linear(x, w_i, bias)`;
- the op as served: `autotile.linear(x, w_i, bias)` with the shipped database (the vendor op where it wins);
- the family's kernels alone: the same op with AUTOTILE_VENDOR=0 (issue 13's measure).
Each reports us a call, TB/s of weight bytes and that rate's share of the copy bandwidth measured in the
same run (`gemm_kernels_bench.copy_tbps`: bytes read plus written by a 1 GiB device copy). The op's output is
checked against F.linear's first. Writes the table as markdown to --out, and its rows as JSON beside it (.json:
`benchmarks/drop_losers.py` drops a shipped winner that lost there in both timings); exit status 1 when a check
failed.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gemm_kernels_bench import copy_tbps, geomean  # noqa: E402

MODELS = ("llama3-8b", "qwen2.5-7b", "mistral-nemo-12b", "phi3-mini", "gemma2-9b", "llama3-70b")
QUICK_MODELS = ("llama3-8b", "qwen2.5-7b")
TOKENS = (1, 4, 8, 16)
QUICK_TOKENS = (1, 16)
# Bytes of distinct weights each graph streams: 10x the H200's L2 (50 MB), so no call finds its weight there.
STREAM_BYTES = 512 * 2**20
MAX_WEIGHTS = 64
COPY_TARGET = 0.80  # issue 13: M <= 16 at >= 80% of copy bandwidth on weight bytes
# bf16 outputs of two summation orders: a few units of bf16 roundoff of the largest value (as serve_bench.py).
REL_TOLERANCE = 2e-2


def weights_for(n: int, k: int) -> int:
    """How many distinct (N, K) bf16 weights one graph walks."""
    return max(1, min(MAX_WEIGHTS, math.ceil(STREAM_BYTES / (n * k * 2))))


def graph_ms_per_call(graph, calls: int, replays: int = 3) -> float:
    """GPU time of `replays` replays of a captured graph, per call in it (ms)."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / (replays * calls)


def captured(op, x, weights, bias):
    """A CUDA graph of op(x, w, bias) for every weight, and its outputs (kept alive beside it)."""
    from autotile.bench import cuda_graph_of

    outputs = []

    def walk():
        outputs.clear()
        for w in weights:
            outputs.append(op(x, w, bias))

    return cuda_graph_of(walk), outputs


def with_vendor(enabled: bool) -> None:
    """Serve the vendor op where it wins (the default), or the family's kernels alone; memoised answers dropped."""
    from autotile.runtime import dispatch

    os.environ["AUTOTILE_VENDOR"] = "1" if enabled else "0"
    dispatch.clear_cache()


def served(info: dict) -> str:
    """What `autotile.explain` says serves a call: the vendor op, or source/match and the config's tiles."""
    if info["vendor"]:
        return info["vendor"]
    c = info["config"]
    return f"{info['source']}/{info['match']} {c.get('VARIANT')} {c.get('BLOCK_M')}x{c.get('BLOCK_N')}x{c.get('BLOCK_K')}"


def serve_row(row: dict) -> dict:
    """A timed row as `benchmarks/drop_losers.py` reads serve_bench.py's (the op as served beside F.linear; a row
    below SLOW_ROW carries its second timing, (ours, theirs), as `diagnosis.retimed`)."""
    model, _, proj = row["label"].partition(" ")
    out = {"model": model, "proj": proj, "m": row["m"], "n": row["n"], "k": row["k"], "served": row["served_by"],
           "tuned_for": row["served_tuned_for"], "device": row["device"]}
    if "cuBLAS_us" not in row:
        return {**out, "error": "; ".join(row["errors"])}
    out.update(ours_ms=row["served_us"] / 1e3, vendor_ms=row["cuBLAS_us"] / 1e3,
               ratio=row["cuBLAS_us"] / row["served_us"])
    if "retimed_us" in row:
        out["diagnosis"] = {"retimed": [row["retimed_us"][0] / 1e3, row["retimed_us"][1] / 1e3]}
    return out


# Served rows below this ratio are timed a second time (drop_losers.py drops a winner only where both lose).
SLOW_ROW = 0.97


def shape_row(label: str, m: int, n: int, k: int, has_bias: bool, rounds: int, gen) -> dict:
    import torch
    import torch.nn.functional as F

    import autotile
    from autotile.bench import interleaved_medians

    count = weights_for(n, k)
    weights = [torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) / math.sqrt(k)
               for _ in range(count)]
    bias = torch.randn(n, device="cuda", generator=gen, dtype=torch.bfloat16) if has_bias else None
    x = torch.randn(m, k, device="cuda", generator=gen, dtype=torch.bfloat16)
    want = F.linear(x, weights[0], bias).float()
    row = {"label": label, "m": m, "n": n, "k": k, "weights": count, "errors": []}
    graphs = {"cuBLAS": captured(F.linear, x, weights, bias)}
    for mode, vendor in (("served", True), ("generated", False)):
        with_vendor(vendor)
        got = autotile.linear(x, weights[0], bias).float()
        rel = (got - want).abs().max().item() / (want.abs().max().item() + 1e-6)
        if rel > REL_TOLERANCE:
            row["errors"].append(f"{mode}: relative error {rel:.3g}")
        info = autotile.explain("linear", x, weights[0], bias)
        row[f"{mode}_by"] = served(info)
        if vendor:
            row.update(served_tuned_for=info["tuned_for"], device=info["device"])
        graphs[mode] = captured(autotile.linear, x, weights, bias)
    with_vendor(True)
    for graph, _ in graphs.values():
        graph.replay()
    torch.cuda.synchronize()
    ms = interleaved_medians({name: g for name, (g, _) in graphs.items()}, rounds,
                             lambda g: graph_ms_per_call(g, count))
    row.update({f"{name}_us": value * 1e3 for name, value in ms.items()})
    if row["cuBLAS_us"] / row["served_us"] < SLOW_ROW:
        again = interleaved_medians({name: graphs[name][0] for name in ("served", "cuBLAS")}, rounds,
                                    lambda g: graph_ms_per_call(g, count))
        row["retimed_us"] = (again["served"] * 1e3, again["cuBLAS"] * 1e3)
    row["weight_bytes"] = n * k * 2
    del graphs, weights
    torch.cuda.empty_cache()
    return row


def markdown(rows: list[dict], copy: float, header: str) -> str:
    def tbps(row, name):
        return row["weight_bytes"] / (row[f"{name}_us"] * 1e-6) / 1e12

    def again(row) -> str:
        return f" (again {row['retimed_us'][1] / row['retimed_us'][0]:.3f}x)" if "retimed_us" in row else ""

    lines = [header, "",
             "| shape | M | weights | cuBLAS us | served us | generated us | TB/s cuBLAS / served / generated | "
             "share of copy (generated) | cuBLAS / served | cuBLAS / generated | served by | generated by |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "cuBLAS_us" not in r:
            lines.append(f"| {r['label']} {r['n']}x{r['k']} | {r['m']} | FAILED: {'; '.join(r['errors'])} |")
            continue
        rates = " / ".join(f"{tbps(r, name):.2f}" for name in ("cuBLAS", "served", "generated"))
        lines.append(
            f"| {r['label']} {r['n']}x{r['k']} | {r['m']} | {r['weights']} | {r['cuBLAS_us']:.1f} | {r['served_us']:.1f} | "
            f"{r['generated_us']:.1f} | {rates} | {tbps(r, 'generated') / copy:.0%} | "
            f"{r['cuBLAS_us'] / r['served_us']:.3f}x{again(r)} | {r['cuBLAS_us'] / r['generated_us']:.3f}x | "
            f"{r['served_by']} | "
            f"{r['generated_by']} |" + (f" WRONG: {'; '.join(r['errors'])}" if r["errors"] else ""))
    timed = [r for r in rows if "cuBLAS_us" in r]
    lines += ["", "| M | shapes | geomean cuBLAS / served | geomean cuBLAS / generated | lowest generated | "
              "share of copy, generated: lowest / median | cuBLAS's: lowest / median | shapes >= 80% (generated) |",
              "|---|---|---|---|---|---|---|---|"]
    for m in sorted({r["m"] for r in timed}) + ["all"]:
        group = [r for r in timed if m == "all" or r["m"] == m]
        if not group:
            continue
        served_ratio = [r["cuBLAS_us"] / r["served_us"] for r in group]
        generated_ratio = [r["cuBLAS_us"] / r["generated_us"] for r in group]
        share = [tbps(r, "generated") / copy for r in group]
        vendor_share = [tbps(r, "cuBLAS") / copy for r in group]
        lines.append(f"| {m} | {len(group)} | {geomean(served_ratio):.3f}x | {geomean(generated_ratio):.3f}x | "
                     f"{min(generated_ratio):.3f}x | {min(share):.0%} / {statistics.median(share):.0%} | "
                     f"{min(vendor_share):.0%} / {statistics.median(vendor_share):.0%} | "
                     f"{sum(s >= COPY_TARGET for s in share)} of {len(group)} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("decode_stream.md"), help="markdown file to write")
    parser.add_argument("--quick", action="store_true", help="two models at 1 and 16 tokens")
    parser.add_argument("--models", default=None, help="comma-separated models (default: a spread of six)")
    parser.add_argument("--tokens", default=None, help="comma-separated token counts, each <= 16 (default: 1,4,8,16)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--db", default=None, help="user database (default: a new empty one: shipped winners only)")
    args = parser.parse_args()
    os.environ["AUTOTILE_DB"] = args.db or f"sqlite:///{tempfile.mkdtemp()}/empty.sqlite"
    import torch
    import triton

    if not torch.cuda.is_available():
        print("no CUDA GPU: this benchmark runs on a GPU only")
        return 2
    from autotile.models import MODELS as TABLE, projections

    models = args.models.split(",") if args.models else (QUICK_MODELS if args.quick else MODELS)
    tokens = tuple(int(t) for t in args.tokens.split(",")) if args.tokens else (
        QUICK_TOKENS if args.quick else TOKENS)
    copy = copy_tbps()
    print(f"copy bandwidth {copy:.2f} TB/s", flush=True)
    props = torch.cuda.get_device_properties(0)
    header = (f"# Decode GEMMs streamed as a decode step reads them (CUDA graphs, one weight a call)\n\n"
              f"{props.name} ({props.multi_processor_count} SMs), {datetime.date.today().isoformat()}, torch "
              f"{torch.__version__}, triton {triton.__version__}; copy bandwidth in this run {copy:.2f} TB/s "
              f"(read + written); medians of {args.rounds} interleaved rounds of 3 replays; shipped database only. "
              "Ratios: cuBLAS time / ours (above 1: autotile is faster).")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows, seen = [], set()
    for name in models:
        for proj in projections(TABLE[name]):
            if (proj.n, proj.k, proj.bias) in seen:
                continue
            seen.add((proj.n, proj.k, proj.bias))
            for m in tokens:
                try:
                    row = shape_row(f"{name} {proj.name}", m, proj.n, proj.k, proj.bias, args.rounds, gen)
                except Exception as exc:  # noqa: BLE001 - the table says what failed
                    row = {"label": f"{name} {proj.name}", "m": m, "n": proj.n, "k": proj.k,
                           "errors": [f"{type(exc).__name__}: {str(exc)[:200]}"]}
                rows.append(row)
                done = (f"cuBLAS {row['cuBLAS_us']:.1f} us, served {row['served_us']:.1f}, generated "
                        f"{row['generated_us']:.1f}" if "cuBLAS_us" in row else "FAILED")
                print(f"{row['label']:28s} M={m:3d} N={proj.n:6d} K={proj.k:6d} x{row.get('weights', 0)}: {done} "
                      f"{'; '.join(row['errors'])}", flush=True)
                args.out.write_text(markdown(rows, copy, header))  # each row as it comes: a cut run keeps its rows
                # The rows as data, for benchmarks/drop_losers.py.
                args.out.with_suffix(".json").write_text(json.dumps(
                    {"gemm": [serve_row(r) for r in rows if "served_by" in r]}, indent=1))
    print(markdown(rows, copy, header))
    return 1 if any(r["errors"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
