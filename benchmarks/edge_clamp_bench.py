"""Whole GEMM tiles with their last row / column tile clamped to the operands' edges (gemm_space.CLAMP_ROW_TILES,
CLAMP_COL_TILES) beside the same tiles unclamped, in one run, as a prefill chunk streams them (CUDA graphs, beside
F.linear).

Run from the repository root on a CUDA machine:
    python benchmarks/edge_clamp_bench.py --out OUT/clamp_ab.json                       # ~1.5 min on an H100
    python benchmarks/edge_clamp_bench.py --rows 392x4096x14336,296x5120x4096 --edges rows --out ...

For each M x N x K row: the policy's default and EDGE_TILES (Gluon and tma tiles, swapped Gluon tiles), each rendered
clamped and unclamped. Every variant is checked against F.linear first, and the clamped result against the unclamped
one bit for bit (the rows and columns a clamped tile writes twice must get the same values). Graphs are replayed in
interleaved rounds (medians). Prints one line a row and writes every timing as JSON to --out: "<config> plain" and
"<config> clamp" beside cuBLAS_us.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]

import gemm_kernels_bench as gkb  # noqa: E402  (config labels)
from decode_stream_bench import graph_ms_per_call  # noqa: E402
from decode_stream_candidates import checked_graph, streamed_operands, time_rows  # noqa: E402  (shared)

from autotile.families import gemm_space  # noqa: E402
from autotile.families.gemm import FAMILY, contiguous_problem  # noqa: E402
from autotile.families.gemm_launch import launch_plan  # noqa: E402
from autotile.families.gemm_policy import gluon_config, gluon_swapped_config  # noqa: E402
from autotile.space import Config  # noqa: E402

# Rows whose last row or column tile is mostly past the edge for some tile here: 176 tokens in 64-row tiles, 392 in
# 128-row ones, N = 4096 and 28672 in 192-column tiles, 296 / 300 tokens in 144-token swapped tiles; and two prefill
# chunks (3000 x 5000 x 1536 from issue 13, 2000 tokens on Llama-3-8B's gate projection).
ROWS = ((176, 4096, 4096), (176, 3584, 3584), (392, 28672, 4096), (296, 5120, 4096), (300, 6144, 4096),
        (392, 4096, 14336), (392, 37888, 3584), (3000, 5000, 1536), (2000, 14336, 4096))
EDGE_TILES = (dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_stages=6, EPILOGUE_SUBTILE=True),
              dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_stages=5),
              dict(BLOCK_M=64, BLOCK_N=192, BLOCK_K=64, num_stages=6),
              dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_stages=4, EPILOGUE_SUBTILE=True),
              dict(BLOCK_M=128, BLOCK_N=144, BLOCK_K=64, num_stages=5),
              dict(VARIANT="tma", BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_stages=4, num_warps=8, PERSISTENT=False),
              dict(VARIANT="tma", BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, num_stages=4, num_warps=4, PERSISTENT=False))
SWAPPED_TILES = (dict(BLOCK_M=144, BLOCK_N=128), dict(BLOCK_M=96, BLOCK_N=64))


def set_clamps(edges: str, on: bool) -> None:
    """Turn the clamps of `edges` ("rows", "cols" or "both") on or off, and drop the launch plans made before."""
    gemm_space.CLAMP_ROW_TILES = on and edges in ("rows", "both")
    gemm_space.CLAMP_COL_TILES = on and edges in ("cols", "both")
    launch_plan.cache_clear()


def configs_for(problem, device) -> list[tuple[str, Config]]:
    """(label, config): the policy's default, then EDGE_TILES and SWAPPED_TILES where the space admits them."""
    space = FAMILY.space(problem, device)
    default = FAMILY.default_config(problem, device)
    found = [("default " + gkb.short(default), default)]
    wanted = [gluon_config(problem, **t) for t in EDGE_TILES]
    wanted += [gluon_swapped_config(problem, device, **t) for t in SWAPPED_TILES]
    for config in wanted:
        admitted = space.admit(config)
        if admitted is not None:
            found.append((gkb.short(admitted), admitted))
    return found


def time_row(problem, device, edges: str, rounds: int, gen, failures: list[str]) -> dict:
    import torch

    from autotile.bench import interleaved_medians

    m, n, k = problem.m, problem.n, problem.k
    weights, want, inputs, vendor_graph = streamed_operands(problem, gen)
    count = len(weights)
    graphs = {"cuBLAS": vendor_graph}
    outputs = []  # each graph writes its own C, alive until the row is timed
    kept = gemm_space.CLAMP_ROW_TILES, gemm_space.CLAMP_COL_TILES
    for label, config in configs_for(problem, device):
        results = {}
        for clamp in (False, True):
            set_clamps(edges, clamp)
            if clamp and not (gemm_space.clamps_row_tiles(config) or gemm_space.clamps_col_tiles(config)):
                continue  # nothing to clamp: a split schedule or the blocked variant
            c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            outputs.append(c)
            name = f"{label} {'clamp' if clamp else 'plain'}"
            graph = checked_graph(problem, config, inputs, want, c, name, failures)
            if graph is not None:
                graphs[name] = graph
                results[clamp] = c.clone()  # C of the warm-up launches: the same weights clamped or not
        if len(results) == 2 and not torch.equal(results[False], results[True]):
            failures.append(f"{m}x{n}x{k} {label}: clamped C differs from unclamped")
    gemm_space.CLAMP_ROW_TILES, gemm_space.CLAMP_COL_TILES = kept  # the switches as they were
    launch_plan.cache_clear()
    torch.cuda.synchronize()
    ms = interleaved_medians(graphs, rounds, lambda g: graph_ms_per_call(g, count))
    vendor = ms.pop("cuBLAS")
    del graphs, weights, outputs
    torch.cuda.empty_cache()
    return {"m": m, "n": n, "k": k, "cuBLAS_us": vendor * 1e3, "us": {name: v * 1e3 for name, v in ms.items()}}


def summary(row: dict) -> str:
    vendor = row["cuBLAS_us"]
    return (f"{row['m']}x{row['n']}x{row['k']} cuBLAS {vendor:.1f} us: "
            + "; ".join(f"{name} {vendor / us:.3f}" for name, us in row["us"].items()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("clamp_ab.json"))
    parser.add_argument("--rows", type=lambda t: tuple(tuple(int(v) for v in s.split("x")) for s in t.split(",")),
                        default=ROWS, help="comma-separated MxNxK rows (default: ROWS)")
    parser.add_argument("--edges", choices=("rows", "cols", "both"), default="both",
                        help="the clamps compared against none (the others stay off in both variants)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--budget-s", type=float, default=240, help="no row starts after this many seconds")
    args = parser.parse_args()

    import torch

    from autotile.device import resolve_gpu

    device = resolve_gpu("auto")
    if device.interpret:
        print("no CUDA GPU: this benchmark runs on a GPU only")
        return 2
    started = time.monotonic()
    gen = torch.Generator(device="cuda").manual_seed(0)
    problems = [contiguous_problem(m, n, k, "bf16", "bf16", layout_b="col") for m, n, k in args.rows]

    def time_one(problem, failures):
        return time_row(problem, device, args.edges, args.rounds, gen, failures)

    return time_rows(problems, time_one, summary, args.budget_s, args.out, started,
                     device=torch.cuda.get_device_name(), edges=args.edges)


if __name__ == "__main__":
    sys.exit(main())
