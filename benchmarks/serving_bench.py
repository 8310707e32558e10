"""Serving decode with continuous batching: tokens/s with autotile's paged attention beside gather + SDPA.

    PYTHONPATH=. python benchmarks/serving_bench.py --out OUT/serving_bench.md            # ~3 min on an H200
    PYTHONPATH=. python benchmarks/serving_bench.py --quick --out OUT/serving_bench.md    # ~1-2 min
    PYTHONPATH=. python benchmarks/serving_bench.py --smoke --out /tmp/serving.md         # CPU: a tiny model

Runs examples/serving_decode.py: a Llama-shaped decoder (8 layers, hidden 4096, 32/8 heads, D 128, SwiGLU
14336, vocab 32000, bf16, random weights), requests arriving four a step, prompts prefilled over the paged
cache, decode steps replayed from one CUDA graph per padded batch size, forks and finishes. The two
attention backends run the same loop:
1. Correctness first: a teacher-forced run of both backends (the SDPA engine is fed the tokens the autotile
   engine chose) compares every decode step's logits.
2. Then the whole workload, twice per backend, interleaved: decode tokens/s (tokens over the wall time of
   the decode steps: input copies, graph replay, sampling), prefill tokens/s, and the speed-up.
The gather + SDPA backend gathers its table's fixed width (max_context) each step, as a CUDA graph of it
must. Prints a markdown table last and writes it to --out.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import torch

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "serving_decode.py"


def load_example():
    spec = importlib.util.spec_from_file_location("serving_decode_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def log(message: str) -> None:
    print(message, flush=True)


def compare_logits(example, model, plan, steps: int, max_batch: int, pages: int) -> dict:
    """Both backends on the same token stream: the relative logit error of each step and top-1 agreement."""
    chosen = []

    def record(logits, seq_ids):
        tokens = logits.argmax(dim=-1).tolist()
        chosen.append(tokens)
        return tokens

    paged = example.Engine(model, num_pages=pages, backend="autotile", max_batch=max_batch, record_logits=True)
    example.serve(paged, plan, steps=steps, sample=record, fork_every=3)
    replay = iter(chosen)
    gathered = example.Engine(model, num_pages=pages, backend="sdpa", max_batch=max_batch, record_logits=True)
    example.serve(gathered, plan, steps=steps, sample=lambda logits, seq_ids: next(replay), fork_every=3)
    worst, agree, total = 0.0, 0, 0
    steps = len(paged.stats.logits)
    for (_, got), (_, want) in zip(paged.stats.logits, gathered.stats.logits):
        worst = max(worst, float((got - want).abs().max() / want.abs().max()))
        agree += int((got.argmax(-1) == want.argmax(-1)).sum())
        total += got.shape[0]
    del paged, gathered
    return dict(steps=steps, relative_error=worst, top1_agreement=agree / max(total, 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True,
                        help="markdown file to write (JSON goes beside it), or a folder to write serving_bench.md in")
    parser.add_argument("--quick", action="store_true", help="fewer requests and steps (1-2 min)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="benchmarks/run_gpu.sh's time budget: below 240 s it implies --quick")
    parser.add_argument("--smoke", action="store_true", help="a tiny model on the CPU interpreter: checks the script")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--max-batch", type=int, default=64)
    args = parser.parse_args()
    if args.out.suffix != ".md":
        args.out = args.out / "serving_bench.md"
    if args.budget_s is not None and args.budget_s < 240:
        args.quick = True
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    elif not torch.cuda.is_available():
        sys.exit("serving_bench needs a CUDA GPU (use --smoke to run its code on the CPU interpreter)")
    example = load_example()
    start = time.time()
    if args.smoke:
        config, device, requests, steps, prompt, new = example.TINY, "cpu", 8, 8, (4, 20), (3, 12)
        max_batch = 8
    else:
        config = example.ModelConfig(layers=args.layers, max_context=2048)
        device, max_batch = "cuda", args.max_batch
        requests, steps = (96, 160) if args.quick else (256, 400)
        prompt, new = (64, 1024), (32, 512)
    model = example.Decoder(config, device)
    pages = max_batch * -(-config.max_context // config.page_size) + 8
    log(f"== correctness: both backends on one token stream ({config})")
    check_plan = example.workload(config, 12, seed=1, prompt=prompt, new=(8, 16))
    check = compare_logits(example, model, check_plan, steps=10, max_batch=max_batch, pages=pages)
    # bf16 through 8 random layers: the two attention paths round differently; 5% of the largest logit
    # and 90% top-1 agreement separate rounding from a wrong attention (which scrambles the logits).
    check["ok"] = check["relative_error"] <= 0.05 and check["top1_agreement"] >= 0.9
    log(f"  {'ok  ' if check['ok'] else 'FAIL'} {check}")

    plan = example.workload(config, requests, seed=0, prompt=prompt, new=new)
    runs: dict[str, list] = {"autotile": [], "sdpa": []}
    for _ in range(1 if args.smoke else 2):
        for backend in runs:
            engine = example.Engine(model, num_pages=pages, backend=backend, max_batch=max_batch)
            stats = example.serve(engine, plan, steps=steps, fork_every=7)
            runs[backend].append(dict(decode_tps=stats.decode_tokens_per_s, decode_tokens=stats.decode_tokens,
                                      steps=stats.decode_steps,
                                      prefill_tps=stats.prefill_tokens / stats.prefill_seconds,
                                      forks=stats.forks, finished=stats.finished,
                                      ms_per_step=1e3 * stats.decode_seconds / max(stats.decode_steps, 1)))
            log(f"  {backend}: {runs[backend][-1]}")
            del engine
            if device == "cuda":
                torch.cuda.empty_cache()
    best = {b: max(r, key=lambda x: x["decode_tps"]) for b, r in runs.items()}
    speedup = best["autotile"]["decode_tps"] / best["sdpa"]["decode_tps"]
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU (interpreter; smoke run, timings meaningless)"
    lines = ["# Serving decode: continuous batching, CUDA graphs per padded batch size", "",
             f"Device: {name}, {datetime.date.today().isoformat()}; torch {torch.__version__}. Model: "
             f"{config.layers} layers, hidden {config.hidden}, {config.heads}/{config.kv_heads} heads, D "
             f"{config.head_dim}, {str(config.dtype).replace('torch.', '')}; {requests} requests (prompts "
             f"{prompt[0]}-{prompt[1]}, {new[0]}-{new[1]} new tokens), batch up to {max_batch}, {steps} steps max; "
             "best of the interleaved runs.", "",
             f"Correctness (teacher-forced, {check['steps']} steps): largest logit difference "
             f"{check['relative_error']:.2%} of the largest logit, top-1 agreement {check['top1_agreement']:.1%}: "
             f"{'ok' if check['ok'] else 'FAILED'}.", "",
             "| attention | decode tokens/s | ms per decode step | prefill tokens/s | decode tokens | forks "
             "| finished |",
             "|---|---|---|---|---|---|---|"]
    for backend, row in best.items():
        label = "autotile (paged plan)" if backend == "autotile" else "gather + SDPA"
        lines.append(f"| {label} | {row['decode_tps']:,.0f} | {row['ms_per_step']:.2f} | {row['prefill_tps']:,.0f} "
                     f"| {row['decode_tokens']} | {row['forks']} | {row['finished']} |")
    lines += ["", f"Decode speed-up of autotile over gather + SDPA: {speedup:.2f}x."]
    table = "\n".join(lines) + "\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(table)
    args.out.with_suffix(".json").write_text(json.dumps(dict(check=check, runs=runs), indent=1))
    log(f"== done in {time.time() - start:.0f} s\n")
    print(table)


if __name__ == "__main__":
    main()
