"""Every untuned candidate of few-token GEMMs timed as a decode step streams them, beside F.linear.

Run from the repository root on a CUDA machine:
    python benchmarks/decode_stream_candidates.py --out OUT/decode_candidates.json             # ~1 min on an H100
    python benchmarks/decode_stream_candidates.py --tokens 32,64 --shapes 4096x4096,1024x4096 --out ...
    python benchmarks/decode_stream_candidates.py --grid --out OUT/grid.json                    # the unseen grid
    python benchmarks/decode_stream_candidates.py --grid-tokens prefill --out OUT/prefill.json  # its prefill chunks
    python benchmarks/decode_stream_candidates.py --plan                                        # the work, no GPU

decode_stream_bench.py times the op as served; this script times each candidate config of the gemm family the
same way, so that the policy's few-token rules (gemm_policy.py: decode_config, streaming_config) can be set from
the timing a decode step sees. For each (N, K) weight shape and token count: enough distinct weights for 512 MB
are called once each in one captured CUDA graph, per candidate: the policy's default, its seeds, and tiles with
every token in one tile, 32-128 columns wide, 128-256 deep, split over K 1-6 times, and stream-K; above 64 tokens
also the mid rules' TMA tiles and the Gluon variant's, whole and split. Each candidate
is checked against F.linear first. Graphs are replayed in interleaved rounds (medians). Prints one line a shape
(the default and the best four) and writes every timing as JSON to --out.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]

import gemm_kernels_bench as gkb  # noqa: E402  (compile pool, config labels)
from decode_stream_bench import REL_TOLERANCE, graph_ms_per_call, weights_for  # noqa: E402

from autotile.families.base import next_pow2  # noqa: E402
from autotile.families.gemm import FAMILY, contiguous_problem  # noqa: E402
from autotile.families.gemm_policy import (  # noqa: E402
    MID_SWAPPED_MAX_EMPTY, ONE_WAVE_MID_TILES, gluon_config, gluon_swapped_config, tma_mid_tile)
from autotile.families.gemm_space import GLUON_SWAP_TOKEN_TILES, SWAP_ANY_TILE_M  # noqa: E402
from autotile.space import Config  # noqa: E402

# Llama-3-8B, Qwen2.5-7B, Phi-3-mini, Gemma-2-9B, Mistral-Nemo-12B and Qwen3-8B projections (N x K).
SHAPES = ((4608, 3584), (6144, 4096), (9216, 3072), (5120, 3072), (3584, 3584), (4096, 3584), (3584, 4096),
          (8192, 3072), (12288, 4096), (4096, 5120), (5120, 4096), (6144, 5120), (4096, 4096), (1024, 4096),
          (14336, 4096), (2048, 3584))
TOKENS = (1, 16)
# The unseen grid (--grid): 24 projections of Llama-3-8B, Qwen2.5-7B, Mistral-Nemo-12B, Phi-3-mini and Gemma-2-9B at
# prefill-chunk token counts, default alone; results/policy_grid_*_h100.json.
GRID_SHAPES = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (1024, 4096), (4608, 3584), (3584, 3584),
               (37888, 3584), (3584, 18944), (512, 3584), (6144, 5120), (5120, 4096), (28672, 5120), (5120, 14336),
               (1024, 5120), (9216, 3072), (3072, 3072), (16384, 3072), (3072, 8192), (8192, 3584), (3584, 4096),
               (28672, 3584), (3584, 14336), (2048, 3584))
GRID_TOKENS = (40, 100, 176, 300, 480)
# The same projections at other counts (--grid-tokens): mid-sized M off the grid's, and prefill chunks
# (results/policy_grid_tokens_2026-12-07c_h100.json, policy_grid_prefill_2026-12-07c_h100.json).
GRID_OTHER_TOKENS = {"mid": (72, 136, 232, 360, 448, 512), "prefill": (640, 1024, 1536, 2048, 4096)}
# Tiles tried beside the default and the seeds (BLOCK_M holds every token), each split 1-6 times.
TILES = (dict(BLOCK_N=32, BLOCK_K=256, SWAP_AB=False, num_stages=5),
         dict(BLOCK_N=64, BLOCK_K=128, SWAP_AB=True, num_stages=5),
         dict(BLOCK_N=64, BLOCK_K=256, SWAP_AB=True, num_stages=4),
         dict(BLOCK_N=128, BLOCK_K=128, SWAP_AB=True, num_stages=4),
         dict(BLOCK_N=128, BLOCK_K=128, SWAP_AB=True, num_stages=4, num_warps=8),
         dict(BLOCK_N=32, BLOCK_K=128, SWAP_AB=False, num_stages=6),
         dict(BLOCK_N=64, BLOCK_K=128, SWAP_AB=False, num_stages=5))
SPLITS = (1, 2, 3, 4, 6)
# Above 128 tokens: 64-deep tiles, so that 256 tokens (the swapped tile's widest) fit shared memory, and 256-row
# tiles unswapped (B is read once a 256-row panel of A: half the L2 traffic of 128-row tiles).
WIDE_TILES = (dict(BLOCK_N=64, BLOCK_K=64, SWAP_AB=True, num_stages=4),
              dict(BLOCK_N=64, BLOCK_K=64, SWAP_AB=True, num_stages=6),
              dict(BLOCK_N=128, BLOCK_K=64, SWAP_AB=True, num_stages=4, num_warps=8),
              dict(BLOCK_M=256, BLOCK_N=128, BLOCK_K=64, SWAP_AB=False, num_stages=3, num_warps=8),
              dict(BLOCK_M=256, BLOCK_N=128, BLOCK_K=64, SWAP_AB=False, num_stages=4, num_warps=8),
              dict(BLOCK_M=256, BLOCK_N=128, BLOCK_K=64, SWAP_AB=False, num_stages=4, num_warps=8, VARIANT="tma"),
              dict(BLOCK_M=256, BLOCK_N=64, BLOCK_K=64, SWAP_AB=False, num_stages=4, num_warps=8))
WIDE_FROM_M = 129
# Above SWAP_ANY_TILE_M tokens, the Gluon variant's tiles whole and split over K (every tile, where they are fewer than
# the SMs); 64 columns wide as cuBLAS's 128 x 64 tiles of narrow weights at 1024 tokens are (ncu on an H100,
# 2026-12-06).
GLUON_SPLIT_TILES = (dict(BLOCK_N=128, BLOCK_K=64, num_stages=5),
                     dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_stages=6),
                     dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=64, num_stages=6),
                     dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_stages=6))
# Swapped tiles holding fewer tokens than M, where M > 64 (--token-tiles): cuBLAS's pick for narrow weights at
# 160-512 tokens is 64 weight rows x 16-32 tokens over the whole K, 96 CTAs (ncu on an H100, 2026-12-06). Above 64
# tokens the space admits such tiles for narrow weights only (gemm_space.token_tiles_fit); elsewhere these are timed
# unadmitted.
TOKEN_TILES = tuple(dict(tiles, SWAP_AB=True) for tiles in (
    dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_stages=5),
    dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, num_stages=4),
    dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, num_stages=4),
    dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, num_stages=5),
    dict(BLOCK_M=32, BLOCK_N=128, BLOCK_K=128, num_stages=4),
    dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, num_stages=5, VARIANT="tma"),
    dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_stages=4),
    dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_stages=4, num_warps=8)))
TOKEN_TILE_SPLITS = (1, 2)
STREAM_K_TILES = (dict(BLOCK_N=64, BLOCK_K=128, SWAP_AB=True, num_stages=5),
                  dict(BLOCK_N=32, BLOCK_K=256, SWAP_AB=False, num_stages=5))
# Swapped Gluon tiles (--gluon-swap): the token tiles of GLUON_SWAP_TOKEN_TILES that leave at most the policy's
# MID_SWAPPED_MAX_EMPTY of their last tile's columns empty (and the least wasteful one, and the smallest that holds
# every token: the weight read once), over 64 and 128 weight rows, whole and, where the tiles are fewer than the SMs,
# split 2 or 3 ways, and in as many parts (up to GLUON_SWAP_MAX_SPLIT) as one wave of the SMs holds.
GLUON_SWAP_SPLITS = (2, 3)
GLUON_SWAP_MAX_SPLIT = 8


def gluon_swapped_candidates(problem, device) -> list[dict]:
    """The swapped Gluon tiles --gluon-swap times on `problem` (unadmitted; candidates() admits them)."""
    m, n = problem.m, problem.n
    waste = {t: math.ceil(m / t) * t / m - 1 for t in GLUON_SWAP_TOKEN_TILES if t <= max(16, next_pow2(m))}
    least = min(waste.values())
    whole = min((t for t in waste if t >= m), default=None)
    wanted = []
    for t, empty in waste.items():
        if empty > MID_SWAPPED_MAX_EMPTY and empty > least and t != whole:
            continue
        for rows in (64, 128):
            tiles = math.ceil(m / t) * math.ceil(n / rows)
            filling = min(GLUON_SWAP_MAX_SPLIT, device.sm_count // tiles)
            splits = (1,) + (tuple(sorted(set(GLUON_SWAP_SPLITS) | {filling} - {1})) if tiles < device.sm_count else ())
            wanted += [gluon_swapped_config(problem, device, BLOCK_M=t, BLOCK_N=rows, SPLIT_K=split,
                                            SCHEDULE="split_k" if split > 1 else "data_parallel")
                       for split in splits]
    return wanted


def candidates(problem, device, token_tiles: bool = False, gluon_swap: bool = False) -> dict:
    """config -> origin ("default", "seed", "tile", "token tile", "gluon swap"): the points of the space around the
    few-token kernels, with `token_tiles` the swapped TOKEN_TILES above SWAP_ANY_TILE_M tokens (admitted or not), and
    with `gluon_swap` the swapped Gluon tiles the space admits."""
    space = FAMILY.space(problem, device)
    found = {FAMILY.default_config(problem, device): "default"}
    for config in FAMILY.seed_configs(problem, device):
        found.setdefault(config, "seed")
    base = dict(next(iter(found)), VARIANT="blocked", PERSISTENT=False, WARP_SPECIALIZE=False, FLATTEN=False,
                BLOCK_M=min(256, max(16, next_pow2(problem.m))), num_warps=4, GROUP_M=1, EPILOGUE_SUBTILE=False)
    tiles_tried = TILES + (WIDE_TILES if problem.m >= WIDE_FROM_M else ())
    wanted = [dict(base, **tiles, SCHEDULE="split_k" if split > 1 else "data_parallel", SPLIT_K=split)
              for tiles in tiles_tried for split in SPLITS]
    wanted += [dict(base, **tiles, SCHEDULE="stream_k", SPLIT_K=1) for tiles in STREAM_K_TILES]
    if problem.m > SWAP_ANY_TILE_M:
        # The mid rules' TMA tiles, whatever share of the SMs they fill (the policy takes them from FILL_SMS).
        wanted += [tma_mid_tile(problem, tiles, device) for tiles in ONE_WAVE_MID_TILES]
        wanted += [gluon_config(problem, **tiles, SCHEDULE="split_k" if split > 1 else "data_parallel", SPLIT_K=split)
                   for tiles in GLUON_SPLIT_TILES for split in SPLITS + (8,)]
    for config in wanted:
        admitted = space.admit(config)
        if admitted is not None:
            found.setdefault(admitted, "tile")
    if gluon_swap:
        for config in gluon_swapped_candidates(problem, device):
            admitted = space.admit(config)
            if admitted is not None:
                found.setdefault(admitted, "gluon swap")
    if token_tiles and problem.m > SWAP_ANY_TILE_M:
        for tiles in TOKEN_TILES:
            for split in TOKEN_TILE_SPLITS:
                found.setdefault(Config(dict(base, **tiles, SCHEDULE="split_k" if split > 1 else "data_parallel",
                                             SPLIT_K=split)), "token tile")
    return found


def streamed_operands(problem, gen) -> tuple:
    """(weights, F.linear(x, weights[0]) in fp32, the family's inputs per weight, cuBLAS's graph over them): enough
    distinct bf16 weights that one graph streams 512 MB (weights_for), as a decode step or prefill chunk does."""
    import torch
    import torch.nn.functional as F

    from autotile.bench import cuda_graph_of

    m, n, k = problem.m, problem.n, problem.k
    weights = [torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) / math.sqrt(k)
               for _ in range(weights_for(n, k))]
    x = torch.randn(m, k, device="cuda", generator=gen, dtype=torch.bfloat16)
    inputs = [{"a": x, "b": w.t()} for w in weights]
    return weights, F.linear(x, weights[0]).float(), inputs, cuda_graph_of(lambda: [F.linear(x, w) for w in weights])


def checked_graph(problem, config, inputs: list, want, c, name: str, failures: list[str]):
    """A CUDA graph of `config` launched on each of `inputs` into `c`, after one launch checked against `want`; None
    (the reason in `failures`) where it fails or is wrong."""
    import torch

    from autotile.bench import cuda_graph_of

    label = f"{problem.m}x{problem.n}x{problem.k} {name}"
    try:
        FAMILY.launch(problem, config, inputs[0], {"c": c})
        torch.cuda.synchronize()
        error = (c.float() - want).abs().max().item() / want.abs().max().item()
        if error > REL_TOLERANCE:
            failures.append(f"{label}: relative error {error:.3g}")
            return None
        return cuda_graph_of(lambda: [FAMILY.launch(problem, config, i, {"c": c}) for i in inputs])
    except Exception as exc:  # noqa: BLE001 - a candidate that fails is reported, the others timed
        failures.append(f"{label}: {type(exc).__name__}: {str(exc)[:150]}")
        return None


def time_shape(problem, configs: dict, rounds: int, gen, failures: list[str]) -> dict:
    import torch

    from autotile.bench import interleaved_medians

    n, k, m = problem.n, problem.k, problem.m
    weights, want, inputs, vendor_graph = streamed_operands(problem, gen)
    count = len(weights)
    c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    graphs = {"cuBLAS": vendor_graph}
    names = {}
    for config, origin in configs.items():
        name = gkb.short(config) + (" [default]" if origin == "default" else "")
        graph = checked_graph(problem, config, inputs, want, c, name, failures)
        if graph is not None:
            graphs[name] = graph
            names[name] = config.to_json()
    torch.cuda.synchronize()
    ms = interleaved_medians(graphs, rounds, lambda g: graph_ms_per_call(g, count))
    vendor = ms.pop("cuBLAS")
    del graphs, weights
    torch.cuda.empty_cache()
    return {"m": m, "n": n, "k": k, "cuBLAS_us": vendor * 1e3, "us": {name: v * 1e3 for name, v in ms.items()},
            "configs": names}


def time_rows(items: list, time_one, line, budget_s: float, out: Path, started: float, **meta) -> int:
    """time_one(item, failures) for each of `items` until `budget_s` have passed since `started`, printing line(row)
    and writing `meta`, every row so far and the failures to `out` as JSON after each; 1 where anything failed."""
    rows, failures = [], []
    for item in items:
        if time.monotonic() - started > budget_s:
            failures.append(f"budget of {budget_s:.0f} s spent: {len(items) - len(rows)} rows not timed")
            break
        rows.append(time_one(item, failures))
        print(line(rows[-1]), flush=True)
        out.write_text(json.dumps({**meta, "rows": rows, "failures": failures}, indent=1))
    for failure in failures:
        print("FAILED", failure)
    print(f"done in {time.monotonic() - started:.0f} s")
    return 1 if failures else 0


def defaults_verdict(rows: list[dict]) -> str:
    """The geometric mean of cuBLAS / the default by token count and over `rows` (each timing the default alone),
    and the lowest row."""
    ratios = [(row["m"], row["cuBLAS_us"] / min(row["us"].values()), f"{row['m']}x{row['n']}x{row['k']}")
              for row in rows if row["us"]]
    if not ratios:
        return "no row timed"
    geomean = lambda xs: math.exp(sum(map(math.log, xs)) / len(xs))  # noqa: E731
    by_tokens = ", ".join(f"{m}: {geomean([r for t, r, _ in ratios if t == m]):.3f}x"
                          for m in sorted({t for t, _, _ in ratios}))
    lowest = min(ratios, key=lambda item: item[1])
    return (f"default / cuBLAS over {len(ratios)} rows: {geomean([r for _, r, _ in ratios]):.3f}x ({by_tokens}); "
            f"lowest {lowest[2]} {lowest[1]:.3f}x")


def summary(row: dict) -> str:
    vendor = row["cuBLAS_us"]
    ranked = sorted(row["us"].items(), key=lambda kv: kv[1])
    default = next((v for name, v in row["us"].items() if name.endswith("[default]")), float("nan"))
    best = "; ".join(f"{name} {us:.1f} ({vendor / us:.3f}x)" for name, us in ranked[:4])
    return (f"{row['m']:3d}x{row['n']}x{row['k']}: cuBLAS {vendor:6.1f} default {default:6.1f} "
            f"({vendor / default:.3f}x) | best {best}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("decode_candidates.json"))
    parser.add_argument("--shapes", type=lambda t: tuple(tuple(int(v) for v in s.split("x")) for s in t.split(",")),
                        default=SHAPES, help="comma-separated NxK weight shapes (default: 16 LLM projections)")
    parser.add_argument("--tokens", type=lambda t: tuple(int(v) for v in t.split(",")), default=TOKENS,
                        help="comma-separated token counts (default 1,16)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--budget-s", type=float, default=480, help="no shape starts after this many seconds")
    parser.add_argument("--workers", type=int, default=14, help="processes compiling kernels ahead")
    parser.add_argument("--plan", action="store_true", help="list shapes and candidates (H200 policy) and exit")
    parser.add_argument("--token-tiles", action="store_true",
                        help="also time swapped tiles of fewer tokens than M (TOKEN_TILES), beyond the space's")
    parser.add_argument("--gluon-swap", action="store_true",
                        help="also time swapped Gluon tiles (tokens on wgmma's N side: gluon_swapped_candidates)")
    parser.add_argument("--default-only", action="store_true", help="time the policy's default beside F.linear only")
    parser.add_argument("--grid", action="store_true",
                        help="the unseen grid: GRID_SHAPES at GRID_TOKENS, the default alone (~1 min on an H100)")
    parser.add_argument("--grid-tokens", choices=sorted(GRID_OTHER_TOKENS),
                        help="the grid's projections at GRID_OTHER_TOKENS of this kind instead (implies --grid)")
    parser.add_argument("--only", type=lambda t: set(t.split(",")),
                        help="time the candidates of these origins only (comma-separated: default, seed, tile, "
                             "token tile, gluon swap)")
    args = parser.parse_args()
    if args.grid or args.grid_tokens:
        tokens = GRID_OTHER_TOKENS[args.grid_tokens] if args.grid_tokens else GRID_TOKENS
        args.shapes, args.tokens, args.default_only = GRID_SHAPES, tokens, True
    problems = [contiguous_problem(m, n, k, "bf16", "bf16", layout_b="col")
                for n, k in args.shapes for m in args.tokens]
    if args.plan:
        for problem in problems:
            configs = ({FAMILY.default_config(problem, gkb.H200_PLAN): "default"} if args.default_only
                       else candidates(problem, gkb.H200_PLAN, args.token_tiles, args.gluon_swap))
            print(f"{problem.m}x{problem.n}x{problem.k}: {len(configs)} candidates, default "
                  f"{gkb.short(next(iter(configs)))}")
        return 0

    device = cuda_device()
    if device is None:
        return 2
    started = time.monotonic()
    plans = [(problem, {FAMILY.default_config(problem, device): "default"} if args.default_only
              else candidates(problem, device, args.token_tiles, args.gluon_swap)) for problem in problems]
    if args.only:
        plans = [(problem, {c: o for c, o in configs.items() if o in args.only}) for problem, configs in plans]
    status = time_plans(plans, args.rounds, args.budget_s, args.out, args.workers, started)
    if args.default_only and plans and args.out.exists():
        print(defaults_verdict(json.loads(args.out.read_text())["rows"]))
    return status


def cuda_device():
    """The CUDA GPU's description; None, saying so, where there is none."""
    from autotile.device import resolve_gpu

    device = resolve_gpu("auto")
    if device.interpret:
        print("no CUDA GPU: this benchmark runs on a GPU only (--plan lists its work without one)")
        return None
    return device


def time_plans(plans: list, rounds: int, budget_s: float, out: Path, workers: int, started: float, **meta) -> int:
    """Each (problem, {config: origin}) of `plans` compiled ahead, then timed (time_shape) and written as time_rows
    does, with `meta`."""
    import torch

    gkb.compile_ahead([(p, c) for p, configs in plans for c in configs], workers)
    gen = torch.Generator(device="cuda").manual_seed(0)
    return time_rows(plans, lambda plan, failures: time_shape(*plan, rounds, gen, failures), summary, budget_s, out,
                     started, device=torch.cuda.get_device_name(), **meta)


if __name__ == "__main__":
    sys.exit(main())
