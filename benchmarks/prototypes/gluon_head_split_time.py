"""Padded head dims (96, 80) in the Gluon forward, padded to the tile's width against split in two parts (GPU).

    PYTHONPATH=. python benchmarks/prototypes/gluon_head_split_time.py --out OUT/head_split.md

`flash_space.GLUON_HEAD_SPLIT` off: a 96-wide head runs in 128-wide tiles (TMA's zeros fill the rest); on: in a
64- and a 32-wide part (templates/flash_gluon_ws.py.j2, HEAD_SPLIT). For each model's causal prefill shape, each
Gluon key block's deepest pipeline the space offers (the default among them), both ways, launched through the family
as CUDA-graph replays of kept plans (as the op's), beside SDPA's backends, in interleaved rounds of `do_bench`
medians; every output is checked against a float32 reference first.
"""
from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

# (model, Hq, Hkv, D, shapes (batch, tokens)): causal prefill. Phi-3-mini and Phi-3.5-mini: 32 heads of 96 (MHA).
# Head dim 80 (GQA 32 / 8) stands for the 16-column tail.
CASES = (("phi-3-mini", 32, 32, 96, ((1, 4096), (4, 2048), (8, 1024), (16, 512))),
         ("head dim 80", 32, 8, 80, ((4, 2048), (16, 512))))


def sdpa_backends(q, k, v) -> dict:
    """SDPA's cuDNN, flash and efficient backends on the call, each where it runs."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    found = {}
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
                          ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        def call(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
        try:
            call()
        except RuntimeError:
            continue
        found[f"SDPA {name}"] = call
    return found


def gluon_launches(q, k, v, split: bool, want: torch.Tensor, errs: dict) -> dict:
    """Each Gluon key block's deepest pipeline and the default, with HEAD_SPLIT as asked: graph replays of kept plans,
    each output's error against `want` in `errs`."""
    from gluon_features_time import deepest_gluon, kept_replay

    from autotile.device import current_device
    from autotile.families import flash_space
    from autotile.families.flash import FAMILY, GLUON_WS

    flash_space.GLUON_HEAD_SPLIT = split
    flash_space.HEAD_SPLIT_TAILS = (16, 32)  # every tail the template takes
    problem = FAMILY.problem_from_tensors(q, k, v, causal=True)
    device = current_device(q.device)
    default = FAMILY.default_config(problem, device)
    configs = deepest_gluon(problem, device)
    if default["LOADS"] == GLUON_WS:
        configs[default["BLOCK_N"]] = default
    launches = {}
    for block_n, config in sorted(configs.items()):
        assert FAMILY.render_switches(problem, config)["HEAD_SPLIT"] == split, config.to_json()
        name = (f"{'split' if split else 'padded'} {block_n} keys x {config['num_stages']}"
                f"{' queue' if config['TILE_QUEUE'] else ''}{' (default)' if config == default else ''}")
        launches[name], outputs = kept_replay(problem, config, q, k, v)  # graph_of ran it once: O is in outputs
        errs[name] = ((outputs["o"].float() - want).abs().max() / want.abs().max()).item()
    return launches


def time_causal_cases(cases, launches, rounds: int) -> list[dict]:
    """For each (model, Hq, Hkv, D, shapes) case's causal prefill shapes: SDPA's backends and the kernels of
    `launches(q, k, v, want, errs)` (graph replays, each output's error against the float32 `want` in `errs`), in
    `rounds` interleaved rounds of do_bench medians; a row a shape, printed as it is timed."""
    import triton.testing
    from gluon_features_time import graph_of, reference

    from autotile.bench import interleaved_medians
    from autotile.families.flash_reference import seen_pairs

    rows = []
    for name, hq, hkv, dim, shapes in cases:
        for batch, seq in shapes:
            gen = torch.Generator(device="cuda").manual_seed(seq + dim)
            q, k, v = (torch.randn(batch, h, seq, dim, device="cuda", generator=gen, dtype=torch.bfloat16)
                       for h in (hq, hkv, hkv))
            want = reference(q, k, v, -1, 0.0)
            errs = {}
            impls = {label: graph_of(call) for label, call in sdpa_backends(q, k, v).items()}
            impls.update(launches(q, k, v, want, errs))
            ms = interleaved_medians(impls, rounds, lambda fn: triton.testing.do_bench(fn, warmup=10, rep=40))
            flops = 4 * batch * hq * seen_pairs(seq, seq, True, -1, -1) * dim
            row = dict(model=name, shape=f"{batch} x {seq}", ms=ms, errs=errs,
                       tflops={key: flops / (t * 1e-3) / 1e12 for key, t in ms.items()})
            rows.append(row)
            timings = ", ".join(f"{key} {t:.4f} ms ({row['tflops'][key]:.0f})" for key, t in ms.items())
            print(f"{name} {batch}x{seq}: {timings} | err {errs}", flush=True)
    return rows


def write_causal_table(out: Path, what: str, rows: list[dict], rounds: int) -> None:
    """time_causal_cases' rows as a table against SDPA's best, headed by `what`, the device and versions."""
    import triton
    from gluon_features_time import write_table

    lines = [f"# {what}, {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
             f"{datetime.date.today()}, bf16, CUDA-graph replays, medians of {rounds} interleaved rounds; TF/s "
             f"count the causal pairs", "",
             "| model | B x S | kernel | ms (TF/s) | x SDPA's best | rel err |", "|---|---|---|---|---|---|"]
    for r in rows:
        vendor = min((t for key, t in r["ms"].items() if key.startswith("SDPA")), default=float("nan"))
        for key, t in sorted(r["ms"].items(), key=lambda kv: kv[1]):
            err = f"{r['errs'][key]:.4f}" if key in r["errs"] else "-"
            lines.append(f"| {r['model']} | {r['shape']} | {key} | {t:.4f} ({r['tflops'][key]:.0f}) | "
                         f"{vendor / t:.3f}x | {err} |")
    write_table(out, lines, rows, "launch")


def run_causal_prototype(description: str, cases, launches, what: str) -> argparse.Namespace:
    """A prototype's command line (--out, --rounds), then time_causal_cases over `cases` with `launches`, written as
    write_causal_table's table headed by `what`; the parsed arguments, for what the caller adds."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    write_causal_table(args.out, what, time_causal_cases(cases, launches, args.rounds), args.rounds)
    return args


def main() -> None:
    def launches(q, k, v, want, errs) -> dict:
        return {**gluon_launches(q, k, v, False, want, errs), **gluon_launches(q, k, v, True, want, errs)}

    run_causal_prototype(__doc__.splitlines()[0], CASES, launches,
                         "Gluon forward, padded head dims padded and split, causal prefill")


if __name__ == "__main__":
    main()
