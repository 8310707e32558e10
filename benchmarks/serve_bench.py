"""Real model shapes through the public ops, beside the vendor op, in one run (GPU).

What a user who imports autotile into a model gets: `autotile.linear(x, w)` beside `F.linear(x, w)` on the
projection GEMMs of Llama, Qwen, Mistral, Phi and Gemma at token counts 1..8192, and
`autotile.flash_attention(q, k, v, causal=True)` beside SDPA's fastest backend for the call on their prefill
attention. Every shape is checked against the vendor's result first, then both are timed in turns
(interleaved rounds of do_bench medians, L2 flushed). Also: host microseconds per call with 2000 calls
queued, and CUDA-graph capture of each op under torch.cuda.set_sync_debug_mode("error"). `--only train`
times a training step of the same attention shapes (forward and backward through autograd) beside plain
SDPA's, and names what served each half.

    python benchmarks/serve_bench.py --out OUT [--db URL] [--quick] [--record trace.jsonl]

With no --db the user database is a new empty file, so only the shipped tuning_db/ serves (a fresh install).
--record runs every shape once with AUTOTILE_RECORD (a trace for `autotile tune --from-trace`) and exits.
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
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

GEMM_MODELS = ("llama3-8b", "qwen2.5-7b", "mistral-nemo-12b", "phi3-mini", "gemma2-9b", "llama3-70b")
GEMM_TOKENS = (1, 4, 16, 64, 256, 1024, 2048, 8192)
QUICK_GEMM_MODELS = ("llama3-8b", "qwen2.5-7b", "phi3-mini")
QUICK_GEMM_TOKENS = (1, 16, 128, 2048)
# (batch, sequence) of causal prefill.
PREFILL = ((1, 4096), (4, 2048), (16, 512), (1, 1000))
FLASH_MODELS = ("llama3-8b", "qwen2.5-7b", "phi3-mini", "gemma2-9b", "mistral-nemo-12b")


def _timed_pair(ours, theirs, rounds: int) -> tuple[float, float]:
    import triton.testing

    from autotile.bench import interleaved_medians

    ms = interleaved_medians({"ours": ours, "theirs": theirs}, rounds,
                             lambda fn: triton.testing.do_bench(fn, warmup=10, rep=40))
    return ms["ours"], ms["theirs"]


def gemm_rows(models, tokens, rounds: int, op: str = "linear") -> list[dict]:
    import torch

    from autotile.models import MODELS, projections

    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name in models:
        model = MODELS[name]
        for proj in projections(model):
            w = torch.randn(proj.n, proj.k, device="cuda", generator=gen, dtype=torch.bfloat16) / math.sqrt(proj.k)
            bias = torch.randn(proj.n, device="cuda", generator=gen, dtype=torch.bfloat16) if proj.bias else None
            for m in tokens:
                x = torch.randn(m, proj.k, device="cuda", generator=gen, dtype=torch.bfloat16)
                try:
                    rows.append(_gemm_row(name, proj, m, x, w, bias, rounds, op))
                except Exception as exc:  # noqa: BLE001 - the table says what failed
                    rows.append({"model": name, "proj": proj.name, "m": m, "n": proj.n, "k": proj.k,
                                 "error": f"{type(exc).__name__}: {exc}"[:300]})
                print(f"gemm {name:16s} {proj.name:8s} M={m:5d} N={proj.n:6d} K={proj.k:6d} {_describe(rows[-1])}",
                      flush=True)
            del w
    return rows


def _describe(row: dict) -> str:
    if "error" in row:
        return f"FAILED {row['error']}"
    return (f"ours {row['ours_ms'] * 1e3:8.1f} us  vendor {row['vendor_ms'] * 1e3:8.1f} us  {row['ratio']:5.2f}x  "
            f"{row['served']}" + ("  WRONG RESULT" if row.get("wrong") else ""))


def _gemm_row(name, proj, m, x, w, bias, rounds, op: str = "linear") -> dict:
    import torch
    import torch.nn.functional as F

    import autotile

    if op == "matmul":  # as a user with nn.Linear weights calls it: b = weight.t(), beside torch.matmul / addmm
        ours_fn = lambda: autotile.matmul(x, w.t(), bias=bias)  # noqa: E731
        theirs_fn = (lambda: torch.matmul(x, w.t())) if bias is None else (lambda: torch.addmm(bias, x, w.t()))
        info = autotile.explain("matmul", x, w.t(), bias=bias)
    else:
        ours_fn, theirs_fn = (lambda: autotile.linear(x, w, bias)), (lambda: F.linear(x, w, bias))
        info = autotile.explain("linear", x, w, bias)
    want = theirs_fn()
    got = ours_fn()
    err = (got.float() - want.float()).abs().max().item()
    scale = want.float().abs().max().item() + 1e-6
    ours, theirs = _timed_pair(ours_fn, theirs_fn, rounds)
    # bf16 outputs of two different summation orders: a few units of bf16 roundoff of the largest value.
    row = {"model": name, "proj": proj.name, "m": m, "n": proj.n, "k": proj.k, "ours_ms": ours,
           "vendor_ms": theirs, "ratio": theirs / ours, "rel_err": err / scale, "wrong": err / scale > 2e-2,
           "served": info["vendor"] or f"{info['source']}/{info['match']}",
           "tuned_for": info["tuned_for"], "device": info["device"],
           "weight_tbps": proj.n * proj.k * 2 / (ours * 1e-3) / 1e12}
    if row["ratio"] < SLOW_ROW:
        row["diagnosis"] = {"ours": _where_time_goes(ours_fn), "vendor": _where_time_goes(theirs_fn),
                            "retimed": _timed_pair(ours_fn, theirs_fn, rounds)}
    return row


SLOW_ROW = 0.97  # rows below this ratio are diagnosed: host time, GPU-only time, and a second timing


def _host_us_per_call(fn, calls: int) -> float:
    """Host microseconds per call of fn with `calls` calls queued (after one call and a sync)."""
    import torch

    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host_us = (time.perf_counter() - start) / calls * 1e6
    torch.cuda.synchronize()
    return host_us


def _where_time_goes(fn) -> dict:
    """Host us per call (500 calls queued, no sync) and GPU us per call (20 calls replayed from one CUDA graph, no
    host work): an eager timing far above the second is host-bound, or the call does something per call."""
    import triton.testing

    from autotile.bench import cuda_graph_of

    for _ in range(10):
        fn()
    host_us = _host_us_per_call(fn, 500)
    graph = cuda_graph_of(fn, 20)
    graph_us = triton.testing.do_bench(graph.replay, warmup=10, rep=40) / 20 * 1e3
    return {"host_us": host_us, "graph_us": graph_us}


def _sdpa_best(q, k, v, rounds: int) -> tuple[str, float, object]:
    """SDPA's fastest backend for this call (each backend that accepts it, timed)."""
    import torch
    import triton.testing
    from torch.nn.attention import SDPBackend, sdpa_kernel

    best = None
    gqa = q.shape[1] != k.shape[1]
    for backend in (None, SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        def fn(backend=backend):
            if backend is None:  # SDPA's own choice, without the cost of the context manager
                out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
            else:
                with sdpa_kernel([backend]):
                    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
            return _merged(out)
        try:
            fn()
            ms = triton.testing.do_bench(fn, warmup=10, rep=40)
        except RuntimeError:
            continue
        if best is None or ms < best[1]:
            best = (backend.name.lower() if backend is not None else "default", ms, fn)
    return best


# How the attention rows lay out q, k and v (--layout): "bhsd" heads-major tensors, or "bshd" a model's (B, S, H, D)
# projections seen as (B, H, S, D), each call's O then merged back to (B, S, H * D) for the output projection.
ATTENTION_LAYOUT = "bhsd"


def _attention_inputs(model, batch, seq, gen=None) -> tuple:
    """bf16 q, k and v of an attention row, laid out as ATTENTION_LAYOUT says."""
    import torch

    def one(heads):
        if ATTENTION_LAYOUT == "bhsd":
            return torch.randn(batch, heads, seq, model.head_dim, device="cuda", generator=gen, dtype=torch.bfloat16)
        return torch.randn(batch, seq, heads, model.head_dim, device="cuda", generator=gen,
                           dtype=torch.bfloat16).transpose(1, 2)
    return one(model.heads), one(model.kv_heads), one(model.kv_heads)


def _merged(o):
    """O as the next layer takes it: itself (bhsd), or (B, S, H * D), a view only where O is laid out so (bshd)."""
    return o if ATTENTION_LAYOUT == "bhsd" else o.transpose(1, 2).reshape(o.shape[0], o.shape[2], -1)


def _attention_shape(name, model, batch, seq) -> dict:
    """The fields that name an attention row's shape."""
    return {"model": name, "batch": batch, "seq": seq, "heads": f"{model.heads}/{model.kv_heads}", "d": model.head_dim}


def flash_rows(models, shapes, rounds: int) -> list[dict]:
    from autotile.models import MODELS

    rows = []
    for name in models:
        model = MODELS[name]
        for batch, seq in shapes:
            q, k, v = _attention_inputs(model, batch, seq)
            best = _sdpa_best(q, k, v, rounds)
            if best is None:
                print(f"flash {name} {batch}x{seq}: no SDPA backend takes it", flush=True)
                continue
            try:
                rows.append(_flash_row(name, model, batch, seq, q, k, v, best, rounds))
            except Exception as exc:  # noqa: BLE001 - the table says what failed
                rows.append({**_attention_shape(name, model, batch, seq), "error": f"{type(exc).__name__}: {exc}"[:300]})
            print(f"flash {name:16s} {batch:3d}x{seq:5d} D={model.head_dim:3d} {_describe(rows[-1])}", flush=True)
    return rows


def _flash_row(name, model, batch, seq, q, k, v, best, rounds) -> dict:
    import autotile

    backend, _, sdpa = best
    want = sdpa()
    got = _merged(autotile.flash_attention(q, k, v, causal=True))
    err = (got.float() - want.float()).abs().max().item()
    info = autotile.explain("flash_attention", q, k, v, causal=True)
    ours, theirs = _timed_pair(lambda: _merged(autotile.flash_attention(q, k, v, causal=True)), sdpa, rounds)
    flops = 4 * batch * model.heads * seq * seq * model.head_dim / 2
    # bf16 attention outputs (|o| < ~1 for N(0, 1) inputs): differences above 2e-2 mean a wrong result.
    return {**_attention_shape(name, model, batch, seq), "ours_ms": ours, "vendor_ms": theirs, "ratio": theirs / ours,
            "backend": backend, "abs_err": err, "wrong": err > 2e-2, "tflops": flops / (ours * 1e-3) / 1e12,
            "served": info.get("vendor") or f"{info['source']}/{info['match']}"}


def train_rows(models, shapes, rounds: int) -> list[dict]:
    """A training step of each prefill shape: autotile.flash_attention's forward and backward through autograd
    beside plain SDPA's (its own backend choice, as a model calls it), gradients checked against SDPA's first."""
    import torch

    from autotile.models import MODELS

    rows = []
    gen = torch.Generator(device="cuda").manual_seed(1)
    for name in models:
        model = MODELS[name]
        for batch, seq in shapes:
            q, k, v = (t.requires_grad_(True) for t in _attention_inputs(model, batch, seq, gen))
            try:
                rows.append(_train_row(name, model, batch, seq, q, k, v, rounds))
            except Exception as exc:  # noqa: BLE001 - the table says what failed
                rows.append({**_attention_shape(name, model, batch, seq), "error": f"{type(exc).__name__}: {exc}"[:300]})
            print(f"train {name:16s} {batch:3d}x{seq:5d} D={model.head_dim:3d} {_describe(rows[-1])}", flush=True)
    return rows


def _train_row(name, model, batch, seq, q, k, v, rounds) -> dict:
    import torch

    import autotile

    gqa = q.shape[1] != k.shape[1]
    do = _merged(torch.randn(q.shape, device="cuda", dtype=torch.bfloat16))  # the gradient the next layer hands back
    leaves = (q, k, v)

    def ours():
        return torch.autograd.grad(_merged(autotile.flash_attention(q, k, v, causal=True)), leaves, do)

    def sdpa():
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        return torch.autograd.grad(_merged(out), leaves, do)

    # bf16 gradients: a relative error past 2% of the largest gradient is a wrong result, as flash_bwd_bench says.
    err = max(((g.float() - w.float()).abs().max() / w.float().abs().max()).item() for g, w in zip(ours(), sdpa()))
    mine, theirs = _timed_pair(ours, sdpa, rounds)
    flops = 3.5 * 4 * batch * model.heads * seq * seq * model.head_dim / 2  # forward 1, backward 2.5
    return {**_attention_shape(name, model, batch, seq), "ours_ms": mine, "vendor_ms": theirs, "ratio": theirs / mine,
            "rel_err": err,
            "wrong": err > 2e-2, "tflops": flops / (mine * 1e-3) / 1e12, "served": _step_served(q, k, v)}


def _step_served(q, k, v) -> str:
    """What serves a training step's forward, and its backward: SDPA's own autograd where SDPA serves the forward
    (or the pair: ops_flash.sdpa_training_pair), else the backward problem's resolution as the op takes it
    (ops_flash._backward_runner)."""
    import autotile
    from autotile.device import current_device
    from autotile.families.flash import FAMILY
    from autotile.runtime import fallback, ops_flash

    info = autotile.explain("flash_attention", q, k, v, causal=True)
    forward = info["vendor"] or f"{info['source']}/{info['match']}"
    if info["vendor"]:
        return f"{forward}; backward: SDPA's autograd"
    if ops_flash.sdpa_training_pair(q, k, v, True, q.shape[-1] ** -0.5) is not None:
        short = FAMILY.cost(FAMILY.problem_from_tensors(q, k, v, causal=True)).flops < ops_flash.HOST_BOUND_STEP_FLOPS
        return f"SDPA's forward and backward{' (a host-bound step)' if short else ''} (the forward alone: {forward})"
    problem = FAMILY.problem_from_tensors(q, k, v, causal=True, direction="bwd")
    device = current_device(q.device)
    resolution = fallback.usable(FAMILY, problem, device)
    if resolution.vendor and not ops_flash.gluon_before_vendor(problem, device, resolution):
        from autotile.families import flash_vendor
        from autotile.families.base import VENDOR_KEY

        backend = resolution.config[VENDOR_KEY]
        given = flash_vendor.backward_takes_given_lse(backend, q.device)
        backward = f"{backend} ({'on the given O and LSE' if given else 'recomputes its forward'})"
    elif resolution.vendor:
        backward = "default (the Gluon backward, before the vendor op)"
    else:
        backward = f"{resolution.source}/{resolution.match}"
    return f"{forward}; backward: {backward}"


def host_overhead(calls: int = 2000) -> list[dict]:
    """Host us per call with `calls` calls queued (GPU work far shorter than the host's), ours and the vendor's."""
    import torch
    import torch.nn.functional as F

    import autotile

    a, b = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16), torch.randn(64, 64, device="cuda",
                                                                                dtype=torch.bfloat16)
    w = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(1, 4, 64, 64, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(4096, device="cuda")
    sincos = autotile.fuse("sin(x)**2 + cos(x)**2")
    cases = {
        "matmul": (lambda: autotile.matmul(a, b), lambda: torch.matmul(a, b)),
        "linear": (lambda: autotile.linear(a, w), lambda: F.linear(a, w)),
        "flash_attention": (lambda: autotile.flash_attention(q, q, q, causal=True),
                            lambda: F.scaled_dot_product_attention(q, q, q, is_causal=True)),
        "fuse": (lambda: sincos(x=x), lambda: torch.sin(x)),
    }
    rows = []
    for name, (ours, theirs) in cases.items():
        per = {}
        for label, fn in (("ours", ours), ("vendor", theirs)):
            per[label] = statistics.median(_host_us_per_call(fn, calls) for _ in range(5))
        rows.append({"op": name, "ours_us": per["ours"], "vendor_us": per["vendor"],
                     "extra_us": per["ours"] - per["vendor"]})
        print(f"host {name:16s} ours {per['ours']:6.1f} us  vendor {per['vendor']:6.1f} us  "
              f"+{per['ours'] - per['vendor']:5.1f} us", flush=True)
    return rows


def graph_capture() -> list[dict]:
    """Each op captured in a CUDA graph with sync debugging on, replayed on new inputs, compared with eager."""
    import torch

    import autotile

    rows = []
    a = torch.randn(16, 512, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1024, 512, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(2, 8, 256, 64, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(2, 2, 256, 64, device="cuda", dtype=torch.bfloat16)
    # Llama-3-8B's heads at 2048 tokens: a shipped H200 policy serves the generated kernel there.
    q_policy = torch.randn(1, 32, 2048, 128, device="cuda", dtype=torch.bfloat16)
    kv_policy = torch.randn(1, 8, 2048, 128, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(10000, device="cuda")
    sincos = autotile.fuse("sin(x)*2 + x")
    cases = {
        "linear": (lambda: autotile.linear(a, w), [a]),
        "matmul": (lambda: autotile.matmul(a, w.t()), [a]),
        "flash_attention": (lambda: autotile.flash_attention(q, kv, kv, causal=True), [q]),
        "flash_attention 1x2048 (policy)": (lambda: autotile.flash_attention(q_policy, kv_policy, kv_policy, causal=True),
                                            [q_policy]),
        "fuse": (lambda: sincos(x=x), [x]),
    }
    for name, (fn, inputs) in cases.items():
        try:
            fn()  # first call of the signature: resolution, compilation (outside the graph, as engines warm up)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            torch.cuda.set_sync_debug_mode("error")
            try:
                with torch.cuda.graph(graph):
                    out = fn()
            finally:
                torch.cuda.set_sync_debug_mode("default")
            for t in inputs:
                t.copy_(torch.randn_like(t))
            graph.replay()
            torch.cuda.synchronize()
            want = fn()
            same = torch.allclose(out.float(), want.float(), atol=1e-2, rtol=1e-2)
            rows.append({"op": name, "captured": True, "replay_matches_eager": bool(same), "error": ""})
        except Exception as exc:  # noqa: BLE001 - the table says what failed
            rows.append({"op": name, "captured": False, "replay_matches_eager": False,
                         "error": f"{type(exc).__name__}: {exc}"[:200]})
        print(f"graph {name}: {rows[-1]}", flush=True)
    return rows


def geomean(values) -> float:
    values = [v for v in values if v > 0]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def _attention_table(title: str, columns: tuple, rows: list, cells) -> list[str]:
    """A markdown section of attention rows: model, B x S, heads, D, then `columns` from `cells(row)`; failed rows
    say what failed; the ratios' geometric mean and minimum below."""
    lines = ["", f"## {title}", "", "| model | B x S | heads | D | " + " | ".join(columns) + " |",
             "|---" * (4 + len(columns)) + "|"]
    for r in rows:
        shape = f"| {r['model']} | {r['batch']} x {r['seq']} | {r['heads']} | {r['d']} | "
        lines.append(shape + (f"failed: {r['error']} |" if "error" in r else " | ".join(cells(r)) + " |"))
    sel = [r["ratio"] for r in rows if "error" not in r] or [float("nan")]
    lines.append(f"\ngeometric mean {geomean(sel):.3f}x, min {min(sel):.3f}x over {len(sel)} shapes")
    return lines


def markdown(gemm, flash, host, graphs, header: str, gemm_op: str = "linear", train=()) -> str:
    lines = [header, ""]
    train = list(train)
    wrong = [r for r in gemm + flash + train if r.get("wrong")]
    failed = [r for r in gemm + flash + train if "error" in r]
    lines.append(f"Checked against the vendor's output first: {len(wrong)} wrong result(s), {len(failed)} failure(s).")
    if gemm:
        ours, theirs = (("autotile.matmul(x, w.t())", "torch.matmul") if gemm_op == "matmul"
                        else ("autotile.linear", "F.linear"))
        lines += [f"## Projection GEMMs: {ours} vs {theirs} (bf16)", "",
                  f"| model | proj | M | N | K | autotile us | {theirs} us | ratio | served by | weight TB/s |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in gemm:
            if "error" in r:
                lines.append(f"| {r['model']} | {r['proj']} | {r['m']} | {r['n']} | {r['k']} | failed: {r['error']} |")
                continue
            lines.append(f"| {r['model']} | {r['proj']} | {r['m']} | {r['n']} | {r['k']} | {r['ours_ms'] * 1e3:.1f} | "
                         f"{r['vendor_ms'] * 1e3:.1f} | {r['ratio']:.3f} | {r['served']} | {r['weight_tbps']:.2f} |")
        slow = [r for r in gemm if "diagnosis" in r]
        if slow:
            lines += ["", f"Rows below {SLOW_ROW}x, diagnosed: host us per call (500 queued), GPU us per call "
                      "(CUDA-graph replay), and the pair timed again.", "",
                      "| model | proj | M | host us ours / vendor | graph us ours / vendor | timed again: ratio |",
                      "|---|---|---|---|---|---|"]
            for r in slow:
                d = r["diagnosis"]
                lines.append(f"| {r['model']} | {r['proj']} | {r['m']} | {d['ours']['host_us']:.1f} / "
                             f"{d['vendor']['host_us']:.1f} | {d['ours']['graph_us']:.1f} / {d['vendor']['graph_us']:.1f}"
                             f" | {d['retimed'][1] / d['retimed'][0]:.3f} |")
        for label, pick in (("all", lambda r: True), ("M <= 16", lambda r: r["m"] <= 16),
                            ("32 <= M <= 512", lambda r: 32 <= r["m"] <= 512), ("M >= 1024", lambda r: r["m"] >= 1024)):
            sel = [r["ratio"] for r in gemm if "error" not in r and pick(r)]
            if sel:
                lines.append(f"\n{label}: geometric mean {geomean(sel):.3f}x, min {min(sel):.3f}x over {len(sel)} shapes")
    if flash:
        lines += _attention_table(
            "Prefill attention: autotile.flash_attention vs SDPA's best backend (bf16, causal)",
            ("autotile ms", "SDPA ms", "SDPA backend", "ratio", "served by", "TFLOP/s"), flash,
            lambda r: (f"{r['ours_ms']:.3f}", f"{r['vendor_ms']:.3f}", r["backend"], f"{r['ratio']:.3f}", r["served"],
                       f"{r['tflops']:.0f}"))
    if train:
        lines += _attention_table(
            "Training step: forward and backward through autograd, autotile.flash_attention vs SDPA (bf16, causal)",
            ("autotile ms", "SDPA ms", "ratio", "served by", "grad rel err", "TFLOP/s"), train,
            lambda r: (f"{r['ours_ms']:.3f}", f"{r['vendor_ms']:.3f}", f"{r['ratio']:.3f}", r["served"],
                       f"{r['rel_err']:.4f}", f"{r['tflops']:.0f}"))
    if host:
        lines += ["", "## Host overhead (us per call, 2000 calls queued)", "",
                  "| op | autotile | vendor | extra |", "|---|---|---|---|"]
        lines += [f"| {r['op']} | {r['ours_us']:.1f} | {r['vendor_us']:.1f} | {r['extra_us']:+.1f} |" for r in host]
    if graphs:
        lines += ["", "## CUDA-graph capture (sync debug mode 'error')", "", "| op | captured | replay = eager | error |",
                  "|---|---|---|---|"]
        lines += [f"| {r['op']} | {r['captured']} | {r['replay_matches_eager']} | {r['error']} |" for r in graphs]
    return "\n".join(lines) + "\n"


def withhold_forward_vendor() -> None:
    """The flash family lists no vendor config for a forward problem from now on (the backward keeps its own)."""
    from autotile.families.flash import FAMILY

    listed = FAMILY.vendor_configs
    FAMILY.vendor_configs = lambda problem, device: [] if problem.direction == "fwd" else listed(problem, device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--db", default=None, help="user database (default: a new empty one: shipped winners only)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", default="gemm,flash,host,graph",
                        help="comma-separated parts: gemm, flash, host, graph, train (a training step; not run unless "
                             "named)")
    parser.add_argument("--tokens", default=None,
                        help="comma-separated token counts (M) of the GEMM part, e.g. off-bucket ones: 3,12,200,3000")
    parser.add_argument("--models", default=None, help="comma-separated gemm models (default: a spread)")
    parser.add_argument("--flash-models", default=None,
                        help="comma-separated models of the prefill attention rows (default: a spread)")
    parser.add_argument("--record", default=None, help="write an AUTOTILE_RECORD trace of the shapes and exit")
    parser.add_argument("--name", default="serve_bench")
    parser.add_argument("--gemm-op", choices=("linear", "matmul"), default="linear",
                        help="the GEMM rows' op: autotile.linear beside F.linear, or autotile.matmul(x, w.t()) "
                             "beside torch.matmul")
    parser.add_argument("--generated-forward", action="store_true",
                        help="withhold the forward's vendor configs, so that a generated forward serves every call "
                             "(as where a shipped policy or winner does) and the training step's backward is the "
                             "family's untuned one")
    parser.add_argument("--prefill", default=None,
                        help="the attention rows' batch x tokens, e.g. 1x1000,2x1000,16x512 (default: "
                             + ",".join(f"{b}x{s}" for b, s in PREFILL) + ")")
    parser.add_argument("--host-bound-gflop", type=float, default=None,
                        help="set ops_flash.HOST_BOUND_STEP_FLOPS (GFLOP of forward work below which a training "
                             "step runs SDPA's own pair); 0 turns the rule off, to time the family's step itself")
    parser.add_argument("--layout", choices=("bhsd", "bshd"), default="bhsd",
                        help="the attention rows' q, k and v: heads-major (bhsd), or a model's (B, S, H, D) "
                             "projections seen as (B, H, S, D), each O merged back to (B, S, H * D) as the output "
                             "projection takes it (bshd)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    global ATTENTION_LAYOUT
    ATTENTION_LAYOUT = args.layout
    if args.generated_forward:
        withhold_forward_vendor()
    os.environ["AUTOTILE_DB"] = args.db or f"sqlite:///{tempfile.mkdtemp()}/empty.sqlite"
    if args.record:
        os.environ["AUTOTILE_RECORD"] = args.record
    import torch
    import triton

    models = args.models.split(",") if args.models else (QUICK_GEMM_MODELS if args.quick else GEMM_MODELS)
    tokens = (tuple(int(t) for t in args.tokens.split(",")) if args.tokens
              else QUICK_GEMM_TOKENS if args.quick else GEMM_TOKENS)
    parts = set(args.only.split(","))
    if args.record:
        from autotile.runtime import trace

        gemm_rows(models, tokens, rounds=1)
        print(f"trace written to {trace.flush()}")
        return
    gemm = gemm_rows(models, tokens, args.rounds, args.gemm_op) if "gemm" in parts else []
    flash_models = (args.flash_models.split(",") if args.flash_models
                    else FLASH_MODELS[:3] if args.quick else FLASH_MODELS)
    prefill = (tuple(tuple(int(x) for x in shape.split("x")) for shape in args.prefill.split(","))
               if args.prefill else PREFILL)
    if args.host_bound_gflop is not None:
        from autotile.runtime import ops_flash

        ops_flash.HOST_BOUND_STEP_FLOPS = args.host_bound_gflop * 1e9
    flash = flash_rows(flash_models, prefill, args.rounds) if "flash" in parts else []
    train = train_rows(flash_models, prefill, args.rounds) if "train" in parts else []
    host = host_overhead() if "host" in parts else []
    graphs = graph_capture() if "graph" in parts else []
    props = torch.cuda.get_device_properties(0)
    header = (f"# {args.name}: public ops vs the vendor op\n\n{props.name} ({props.multi_processor_count} SMs), "
              f"torch {torch.__version__}, triton {triton.__version__}, {datetime.date.today()}; user database: "
              f"{'given' if args.db else 'empty (shipped winners only)'}; attention layout {args.layout}; medians of "
              f"{args.rounds} interleaved rounds. "
              "Ratio = vendor time / autotile time (above 1: autotile is faster).")
    text = markdown(gemm, flash, host, graphs, header, args.gemm_op, train)
    (args.out / f"{args.name}.md").write_text(text)
    # The rows as data, for benchmarks/drop_losers.py.
    (args.out / f"{args.name}.json").write_text(json.dumps({"gemm": gemm, "flash": flash, "host": host,
                                                            "train": train}, indent=1))
    print(text)


if __name__ == "__main__":
    main()
