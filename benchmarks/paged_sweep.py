"""Balanced split-KV paged decode: tile configs and the scheduler's split constants, measured on ragged mixes.

    PYTHONPATH=. python benchmarks/paged_sweep.py --quick --out OUT/paged_sweep.md   # <= 150 s on an H200
    PYTHONPATH=. python benchmarks/paged_sweep.py --out OUT/paged_sweep.md           # ~5-8 min
    PYTHONPATH=. python benchmarks/paged_sweep.py --smoke --out /tmp/sweep.md        # CPU interpreter: checks the script

The six mixes of issue 12 (paged_bench's quick mixes: one 32k sequence; one 32k + 7 x 500; 128 log-uniform
100-16k; 256 x 100-4000; 16 x 1k-32k at Gemma-2-9B heads; 64 x 500-4000 at Phi-3-mini heads), built by
paged_bench's builders.

A. Per mix, the balanced variant over tile configs (BLOCK_N x num_warps x num_stages, those the family's space
   finds feasible) at the default split constants, beside the config a plan serves today.
B. Per mix, the best tiles of A over a grid of split constants (items_per_sm x overhead_tokens x margin_pct x
   PARTITION_SIZE). Constant sets that give a mix the same chunk counts and the same grid (the host mirror,
   balanced_schedule) do the same work, so they share one measurement, taken with one of them (its kernel
   compiled with its own constants; the default set always measures itself). The chunk counts the device
   chose are checked against the mirror.
Every config's output is checked against a float32 de-paged reference before it is timed; a config that fails
is reported and skipped. Timings: the planned run replayed in a CUDA graph, medians of interleaved
triton.testing.do_bench runs; % of copy bandwidth against a copy measured in this run (as paged_bench does).
Kernels are compiled ahead in worker processes (Triton's on-disk cache), so the timed process only loads them.
Report: per mix the best tile and constants; the one constant set that maximises the mean over mixes, with the
default constants beside it. Markdown to --out, JSON beside it; the table is printed last.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import math
import multiprocessing
import os
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

if "--smoke" in sys.argv:
    # NOTE: Triton decides at import whether its helpers run interpreted: set before anything imports it.
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]

import torch  # noqa: E402

import paged_bench as pb  # noqa: E402  (the mixes, data builder, reference, tolerance, copy bandwidth)

# The grid of split constants (stage B); the defaults (autotile/families/paged.py) are always in it.
ITEMS_PER_SM = (4, 8, 16, 32)
OVERHEAD_TOKENS = (32, 64, 128, 256)
MARGIN_PCT = (100, 110, 125)
PARTITIONS = (256, 512)
# Tile axes (stage A); --quick keeps the first two warps and three stages choices. n stages keep n - 1 K/V
# tiles in flight (autotile.families.paged.decode_kv_buffers).
BLOCK_NS, WARPS, STAGES = (32, 64, 128), (4, 8, 2), (2, 3, 4, 5)
PAGE_SIZE = 16


def log(message: str) -> None:
    print(message, flush=True)


class Knobs(NamedTuple):
    """One set of split constants, PARTITION_SIZE (the smallest chunk) included."""

    items_per_sm: int
    overhead_tokens: int
    margin_pct: int
    partition_size: int

    def split(self):
        from autotile.families.paged import SplitConstants

        return SplitConstants(items_per_sm=self.items_per_sm, overhead_tokens=self.overhead_tokens,
                              margin_pct=self.margin_pct)

    @property
    def label(self) -> str:
        return (f"items/SM {self.items_per_sm}, overhead {self.overhead_tokens}, margin {self.margin_pct}%, "
                f"partition {self.partition_size}")


def default_knobs() -> Knobs:
    from autotile.families import paged

    return Knobs(paged.SPLIT_ITEMS_PER_SM, paged.SPLIT_OVERHEAD_TOKENS, paged.SPLIT_MARGIN_PCT,
                 paged.PARTITION_CHOICES[0])


@dataclass
class Sweep:
    device: str
    smoke: bool
    quick: bool
    rounds: int
    warmup_ms: float
    rep_ms: float
    top_tiles: int
    workers: int
    deadline: float
    num_sms: int | None = None  # None: the device's SM count
    grid: list = field(default_factory=list)

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    def bench_setting(self):
        return pb.Setting(self.device, self.smoke, self.quick, self.rounds)


class Mix(NamedTuple):
    name: str
    model: str
    heads: tuple  # (Hq, Hkv, D)
    lengths: list


def mixes(sweep: Sweep) -> list[Mix]:
    if sweep.smoke:  # small enough for the interpreter: one split sequence, a ragged batch
        return [Mix("one long", "toy 8/2 D64", (8, 2, 64), [700]),
                Mix("ragged", "toy 4/1 D64", (4, 1, 64), [10, 300, 45, 129, 260])]
    # paged_bench's quick mixes are the six of issue 12, in both modes here.
    return [Mix(name, model, pb.HEADS[model], lengths)
            for name, model, lengths in pb.ragged_mixes(pb.Setting(sweep.device, False, True, 1))]


def knob_grid(sweep: Sweep) -> list[Knobs]:
    if sweep.smoke:
        grid = [Knobs(i, o, 110, 256) for i in (4, 8) for o in (64, 128)]
    else:
        grid = [Knobs(i, o, m, p) for p in PARTITIONS for i in ITEMS_PER_SM for o in OVERHEAD_TOKENS for m in MARGIN_PCT]
    default = default_knobs()
    return grid if default in grid else [default] + grid


def problem_of(mix: Mix):
    from autotile.families.paged import PagedProblem, context_bucket

    bound = context_bucket(max(mix.lengths))  # as PagedAttentionPlan files a step (mean_context not given)
    return PagedProblem(len(mix.lengths), *mix.heads, PAGE_SIZE, bound, bound, 1, "bf16", "bf16")


def device_info(sweep: Sweep):
    from autotile.device import cuda_device, interpret_device

    return cuda_device(torch.cuda.current_device()) if sweep.cuda else interpret_device()


def tile_configs(sweep: Sweep, mix: Mix) -> list[dict]:
    from autotile.families.paged import FAMILY

    space = FAMILY.space(problem_of(mix), device_info(sweep))
    if sweep.smoke:
        axes = ((32, 64), (4,), (2,))
    elif sweep.quick:
        axes = (BLOCK_NS, WARPS[:2], STAGES[:3])
    else:
        axes = (BLOCK_NS, WARPS, STAGES)
    found = []
    for block_n in axes[0]:
        for warps in axes[1]:
            for stages in axes[2]:
                config = dict(VARIANT="balanced", BLOCK_N=block_n, PARTITION_SIZE=PARTITIONS[0], BLOCK_M=16,
                              num_warps=warps, num_stages=stages)
                if space.is_feasible(config):
                    found.append(config)
    return found


def tile_label(config: dict | None) -> str:
    if config is None:
        return "served"
    return f"N{config['BLOCK_N']} w{config['num_warps']} s{config['num_stages']}"


def with_partition(config: dict, knobs: Knobs) -> dict:
    return dict(config, PARTITION_SIZE=knobs.partition_size)


def make_plan(sweep: Sweep, mix: Mix, config: dict | None, knobs: Knobs | None):
    import autotile

    hq, hkv, dim = mix.heads
    return autotile.plan_paged_attention(
        batch=len(mix.lengths), num_q_heads=hq, num_kv_heads=hkv, head_dim=dim, page_size=PAGE_SIZE,
        max_context=max(mix.lengths), device=sweep.device, num_sms=sweep.num_sms,
        config=None if config is None else with_partition(config, knobs),
        split_constants=None if knobs is None else knobs.split())


def make_data(sweep: Sweep, mix: Mix):
    return pb.make_decode(mix.lengths, *mix.heads, page_size=PAGE_SIZE, device=sweep.device, seed=len(mix.name))


# --- compiling ahead, in worker processes -------------------------------------------------------------

_worker_data: dict = {}


def _warm_jobs(sweep: Sweep, mix: Mix, jobs: list) -> list[str]:
    """Runs each (config, knobs) once (a worker process): Triton compiles and keeps the kernels on disk."""
    if _worker_data.get("mix") != mix.name:
        _worker_data.clear()
        _worker_data.update(mix=mix.name, data=make_data(sweep, mix))
    data = _worker_data["data"]
    out = torch.empty_like(data.q[:, 0])
    errors = []
    for config, knobs in jobs:
        try:
            plan = make_plan(sweep, mix, config, knobs)
            plan.run(data.q[:, 0], data.k_cache, data.v_cache, data.block_table, data.context_lens, out=out)
            if sweep.cuda:
                torch.cuda.synchronize()
        except Exception as exc:  # reported again (with the check) when the timed process runs it
            errors.append(f"{mix.name} {tile_label(config)} {knobs}: {type(exc).__name__}: {exc}")
    return errors


class Compiler:
    """A pool of spawned processes that compile (config, knobs) pairs before they are timed."""

    def __init__(self, sweep: Sweep):
        self.sweep, self.pool = sweep, None
        if sweep.cuda and sweep.workers > 0:
            self.pool = concurrent.futures.ProcessPoolExecutor(
                max_workers=sweep.workers, mp_context=multiprocessing.get_context("spawn"))

    def warm(self, work: list[tuple[Mix, list]], what: str) -> None:
        if self.pool is None:
            return
        start = time.time()
        total = sum(len(jobs) for _, jobs in work)
        per_task = max(1, math.ceil(total / (3 * self.sweep.workers)))
        futures = [self.pool.submit(_warm_jobs, self.sweep, mix, jobs[i:i + per_task])
                   for mix, jobs in work for i in range(0, len(jobs), per_task)]
        errors = []
        for future in concurrent.futures.as_completed(futures):
            try:
                errors += future.result()
            except Exception as exc:  # a dead worker: the timed process compiles what it did not
                errors.append(f"{type(exc).__name__}: {exc}")
        log(f"  compiled {what} ahead: {total} configs in {time.time() - start:.0f} s on {self.sweep.workers} "
            f"processes" + (f"; {len(errors)} failed there: {errors[:3]}" if errors else ""))

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(cancel_futures=True)


# --- checking and timing --------------------------------------------------------------------------------

@dataclass
class Prepared:
    fn: Replay  # the planned run, replayed from a CUDA graph on the GPU
    config: dict
    chunks: list | None


class Replay:
    """A captured run that keeps alive what its graph reads and writes.

    NOTE: a CUDA graph holds raw addresses, not tensors. The plan (its workspace and schedule buffer) and
    `out` must outlive the graph, and torch.cuda.graph empties the allocator's cache at every capture: a
    plan dropped after its capture has its memory handed back to the driver (or to another plan's
    workspace of another size) by the next capture, and replaying its graph then writes there (stage B's
    "illegal memory access": its constant sets give workspaces of different sizes).
    """

    def __init__(self, replay, run):
        self.replay, self.run = replay, run  # run's closure holds the plan, the inputs and out

    def __call__(self) -> None:
        self.replay()


def prepare(sweep: Sweep, mix: Mix, data, want: torch.Tensor, config: dict | None, knobs: Knobs | None):
    """Plan, run once, check against the float32 reference and the host schedule, capture: Prepared or a failure."""
    from autotile.families.paged import balanced_schedule

    try:
        plan = make_plan(sweep, mix, config, knobs)
        args = (data.q[:, 0], data.k_cache, data.v_cache, data.block_table, data.context_lens)
        out = torch.empty_like(data.q[:, 0])
        plan.run(*args, out=out)
        ok, err = pb.within(out, want, *pb.tolerance(torch.bfloat16))
        if not ok:
            return f"max |err| {err:.3g} against the float32 reference"
        chunks = None
        if plan.config["VARIANT"] == "balanced":
            split = plan.launch.split_constants
            chunks = balanced_schedule(mix.lengths, mix.heads[1], plan.launch.num_sms,
                                       plan.config["PARTITION_SIZE"], split)
            shift = int(plan.launch.schedule[0])
            device_chunks = [1 if shift < 0 else max(-(-n // (1 << shift)), 1) for n in mix.lengths]
            if device_chunks != chunks:
                return f"the device cut {sum(device_chunks)} chunks, the host mirror {sum(chunks)}"
        def run():
            plan.run(*args, out=out)

        return Prepared(Replay(pb.capture(sweep.bench_setting(), run), run), dict(plan.config), chunks)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


def time_ms(sweep: Sweep, fn) -> float:
    if sweep.cuda:
        import triton.testing

        return triton.testing.do_bench(fn, warmup=sweep.warmup_ms, rep=sweep.rep_ms, return_mode="median")
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def interleaved(sweep: Sweep, fns: dict) -> dict:
    """Medians of `rounds` interleaved timings of every function."""
    from autotile.bench import interleaved_medians

    return interleaved_medians(fns, sweep.rounds, lambda fn: time_ms(sweep, fn))


def reference(mix: Mix, data) -> torch.Tensor:
    return pb.decode_reference(data, 1 / math.sqrt(mix.heads[2]))[0][:, 0]


def share(ms: float, kv_bytes: int, copy_tbps: float) -> float:
    return kv_bytes / (ms * 1e-3) / 1e12 / copy_tbps


# --- stage A: tiles at the default constants --------------------------------------------------------

def stage_a(sweep: Sweep, mix: Mix, copy_tbps: float) -> dict:
    data = make_data(sweep, mix)
    want = reference(mix, data)
    row: dict = dict(mix=mix.name, model=mix.model, batch=len(mix.lengths), longest=max(mix.lengths),
                     kv_mb=data.kv_bytes / 2**20, kv_bytes=data.kv_bytes, tiles={}, failures={})
    defaults = default_knobs()
    fns = {}
    for config in [None] + tile_configs(sweep, mix):
        got = prepare(sweep, mix, data, want, config, None if config is None else defaults)
        label = tile_label(config)
        if isinstance(got, str):
            row["failures"][label] = got
            log(f"  FAIL {mix.name} {label}: {got}")
            continue
        fns[label] = got.fn
        row["tiles"][label] = dict(config=got.config, chunks=None if got.chunks is None else sum(got.chunks))
    for label, ms in interleaved(sweep, fns).items():
        row["tiles"][label].update(ms=ms, share=share(ms, data.kv_bytes, copy_tbps))
    ranked = sorted((t for t in row["tiles"] if t != "served"), key=lambda t: row["tiles"][t]["ms"])
    row["ranked"] = ranked
    best = ranked[0] if ranked else None
    log(f"  {mix.name}: served {row['tiles'].get('served', {}).get('share', float('nan')):.0%}, best tile "
        f"{best} {row['tiles'][best]['share']:.0%} of copy" if best else f"  {mix.name}: no tile passed")
    return row


# --- stage B: split constants on the best tiles -------------------------------------------------------

def schedule_groups(sweep: Sweep, mix: Mix, grid: list[Knobs], num_sms: int) -> list[list[Knobs]]:
    """The grid's sets grouped by the work they give this mix: (chunks per sequence, grid size); the group of the
    default set first, each group's representative first (the default set, or a set whose kernel constants
    an earlier group already uses)."""
    from autotile.families.paged import balanced_max_chunks, balanced_schedule

    hkv, batch = mix.heads[1], len(mix.lengths)
    groups: dict = {}
    for knobs in grid:
        split = knobs.split()
        key = (tuple(balanced_schedule(mix.lengths, hkv, num_sms, knobs.partition_size, split)),
               balanced_max_chunks(batch, hkv, num_sms, split))
        groups.setdefault(key, []).append(knobs)
    default = default_knobs()
    ordered = sorted(groups.values(), key=lambda members: default not in members)
    compiled = set()  # (overhead, margin, partition): the kernel's constants, one compile per tile each
    result = []
    for members in ordered:
        constants = lambda k: (k.overhead_tokens, k.margin_pct, k.partition_size)  # noqa: E731
        pick = default if default in members else next(
            (k for k in members if constants(k) in compiled), members[0])
        compiled.add(constants(pick))
        result.append([pick] + [k for k in members if k != pick])
    return result


def stage_b_plan(sweep: Sweep, mix: Mix, row_a: dict, num_sms: int) -> dict:
    tiles = row_a.get("ranked", [])[:sweep.top_tiles]
    groups = schedule_groups(sweep, mix, sweep.grid, num_sms)
    return dict(tiles=tiles, groups=groups)


def stage_b(sweep: Sweep, mix: Mix, row_a: dict, planned: dict, copy_tbps: float) -> dict:
    data = make_data(sweep, mix)
    want = reference(mix, data)
    fns, failures, chunks = {}, {}, {}
    for tile in planned["tiles"]:
        config = row_a["tiles"][tile]["config"]
        for index, members in enumerate(planned["groups"]):
            got = prepare(sweep, mix, data, want, config, members[0])
            if isinstance(got, str):
                failures[f"{tile} | {members[0].label}"] = got
                log(f"  FAIL {mix.name} {tile} {members[0].label}: {got}")
                continue
            fns[(tile, index)] = got.fn
            chunks[index] = sum(got.chunks)
    ms = interleaved(sweep, fns)
    return dict(mix=mix.name, tiles=planned["tiles"], groups=[[k._asdict() for k in g] for g in planned["groups"]],
                chunks=chunks, failures=failures,
                ms={f"{tile} | {index}": t for (tile, index), t in ms.items()},
                _ms=ms, _groups=planned["groups"], kv_bytes=data.kv_bytes)


def knob_times(row_b: dict) -> dict:
    """{knobs: (best ms over the tiles, that tile)} for every set of the grid this mix measured."""
    found = {}
    for index, members in enumerate(row_b["_groups"]):
        timed = [(ms, tile) for (tile, i), ms in row_b["_ms"].items() if i == index]
        if timed:
            for knobs in members:
                found[knobs] = min(timed)
    return found


def summarise(rows_b: list[dict], copy_tbps: float, grid: list[Knobs]) -> dict:
    """The constant sets ranked by their mean share over the mixes (each mix at its best measured tile)."""
    per_mix = {row["mix"]: knob_times(row) for row in rows_b}
    kv = {row["mix"]: row["kv_bytes"] for row in rows_b}
    complete = [k for k in grid if all(k in times for times in per_mix.values())]
    ranking = []
    for knobs in complete:
        shares = {mix: share(per_mix[mix][knobs][0], kv[mix], copy_tbps) for mix in per_mix}
        ranking.append(dict(knobs=knobs, mean=statistics.mean(shares.values()), min=min(shares.values()),
                            shares=shares, tiles={mix: per_mix[mix][knobs][1] for mix in per_mix}))
    ranking.sort(key=lambda r: -r["mean"])
    return dict(ranking=ranking, per_mix=per_mix, kv=kv)


# --- report ---------------------------------------------------------------------------------------------

def verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def render(sweep: Sweep, copy_tbps: float, rows_a: list[dict], rows_b: list[dict], summary: dict | None,
           notes: list[str], elapsed: float) -> str:
    import triton

    name = torch.cuda.get_device_name() if sweep.cuda else "CPU (Triton interpreter; smoke run, timings meaningless)"
    default = default_knobs()
    lines = ["# Paged decode: balanced split-KV sweep (issue 12)", "",
             f"Device: {name}, {datetime.date.today().isoformat()}; torch {torch.__version__}, triton "
             f"{triton.__version__}; {elapsed:.0f} s{' (quick mode)' if sweep.quick else ''}. Copy bandwidth measured "
             f"in this run: {copy_tbps:.2f} TB/s (read + write). % of copy counts the K and V bytes the contexts hold; "
             f"planned runs replayed in a CUDA graph, medians of {sweep.rounds} interleaved triton.testing.do_bench "
             f"runs; every config checked against a float32 de-paged reference first.", "",
             f"Default split constants: {default.label}.", ""]
    lines += [f"- {n}" for n in notes]
    lines += ["", "## A. Tile configs at the default split constants", "",
              "| mix | heads | B | K/V MB | served config | served % | best tile | best % | 2nd | 3rd | failed |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows_a:
        tiles, ranked = row["tiles"], row.get("ranked", [])
        served = tiles.get("served")
        cell = lambda i: (f"{ranked[i]} {tiles[ranked[i]]['share']:.0%}" if len(ranked) > i else "")  # noqa: E731
        served_cells = (f"`{json.dumps(served['config'], sort_keys=True)}` | {served['share']:.0%}" if served
                        else "failed | ")
        best_cells = f"{cell(0)} | {cell(1)} | {cell(2)}" if ranked else "none passed | | | "
        lines.append(f"| {row['mix']} | {row['model']} | {row['batch']} | {row['kv_mb']:.0f} | {served_cells} "
                     f"| {best_cells} | {len(row['failures'])} |")
    if rows_a:
        served = [r["tiles"]["served"]["share"] for r in rows_a if "served" in r["tiles"]]
        best = [r["tiles"][r["ranked"][0]]["share"] for r in rows_a if r.get("ranked")]
        if served:
            lines.append(f"\nMean over mixes: served {statistics.mean(served):.0%}, best tile at default constants "
                         f"{statistics.mean(best):.0%}.")
    if summary and summary["ranking"]:
        ranking = summary["ranking"]
        top = ranking[0]
        default_row = next((r for r in ranking if r["knobs"] == default), None)
        mix_names = list(summary["per_mix"])
        lines += ["", "## B. Split constants (each mix at its best measured tile)", "",
                  f"Tiles per mix: the {sweep.top_tiles} best of A. {len(sweep.grid)} constant sets; sets giving a mix "
                  "the same chunk counts and grid share one measurement.", "",
                  "| constant set | mean % | min % | " + " | ".join(mix_names) + " |",
                  "|---|---|---|" + "---|" * len(mix_names)]
        shown = ranking[:8] + ([default_row] if default_row and default_row not in ranking[:8] else [])
        for r in shown:
            mark = " (default)" if r["knobs"] == default else ""
            lines.append(f"| {r['knobs'].label}{mark} | {r['mean']:.1%} | {r['min']:.0%} | "
                         + " | ".join(f"{r['shares'][m]:.0%} ({r['tiles'][m]})" for m in mix_names) + " |")
        near = [r for r in ranking if r["mean"] >= top["mean"] - 0.005]
        single = [m for m in mix_names if m.startswith("one 32k sequence")]
        lines += ["", f"**Best single set: {top['knobs'].label}**: mean {top['mean']:.1%} of copy over "
                  f"{len(mix_names)} mixes (target >= {pb.RAGGED_MEAN_TARGET:.0%}): {verdict(top['mean'] >= pb.RAGGED_MEAN_TARGET)}"
                  + (f"; one 32k sequence {top['shares'][single[0]]:.0%} (target >= {pb.SINGLE_32K_TARGET:.0%}): "
                     f"{verdict(top['shares'][single[0]] >= pb.SINGLE_32K_TARGET)}" if single else "") + ".",
                  f"- default set: mean {default_row['mean']:.1%}" if default_row else "- default set: not measured",
                  f"- {len(near)} sets within 0.5 points of the best mean (timing noise is about that): "
                  + "; ".join(r["knobs"].label for r in near[:6])]
        lines += ["", "### Per mix: the best measured tile and constants", "",
                  "| mix | best tile | best constants | ms | % of copy | default constants % | chunks |",
                  "|---|---|---|---|---|---|---|"]
        for row in rows_b:
            times = summary["per_mix"][row["mix"]]
            if not times:
                continue
            knobs, (ms, tile) = min(times.items(), key=lambda kv: kv[1][0])
            index = next(i for i, g in enumerate(row["_groups"]) if knobs in g)
            default_ms = times.get(default, (math.nan, ""))[0]
            lines.append(f"| {row['mix']} | {tile} | {knobs.label} | {ms:.4f} | "
                         f"{share(ms, row['kv_bytes'], copy_tbps):.0%} | {share(default_ms, row['kv_bytes'], copy_tbps):.0%} "
                         f"| {row['chunks'].get(index, '')} |")
    failures = [(r["mix"], k, v) for r in rows_a + rows_b for k, v in r["failures"].items()]
    lines += ["", f"## Failed configs: {len(failures)}", ""] + [f"- {m} {k}: {v}" for m, k, v in failures[:40]]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True,
                        help="markdown file to write (JSON goes beside it), or a folder to write paged_sweep.md in")
    parser.add_argument("--quick", action="store_true", help="fewer tiles, shorter timings (<= 150 s on an H200)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU interpreter: checks the script")
    parser.add_argument("--workers", type=int, default=None, help="compile processes (default: CPUs - 2, at most 12)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="wall-clock budget; stage B drops mixes it cannot finish (default 140 quick, 560 full)")
    args = parser.parse_args()
    if args.out.suffix != ".md":
        args.out = args.out / "paged_sweep.md"
    if not args.smoke and not torch.cuda.is_available():
        sys.exit("paged_sweep needs a CUDA GPU (use --smoke to run its code on the CPU interpreter)")
    start = time.time()
    quick = args.quick or args.smoke
    budget = args.budget_s or (140.0 if quick else 560.0)
    workers = args.workers if args.workers is not None else min(12, max(1, (os.cpu_count() or 2) - 2))
    sweep = Sweep("cpu" if args.smoke else "cuda", args.smoke, quick, rounds=1 if args.smoke else (3 if quick else 5),
                  warmup_ms=5 if quick else 10, rep_ms=20 if quick else 50, top_tiles=1 if args.smoke else 3,
                  workers=0 if args.smoke else workers, deadline=start + budget, num_sms=16 if args.smoke else None)
    sweep.grid = knob_grid(sweep)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    notes: list[str] = []
    compiler = Compiler(sweep)
    rows_a, rows_b, summary = [], [], None
    copy_tbps = pb.H200_COPY_TBPS
    try:
        all_mixes = mixes(sweep)
        log(f"== A. tiles at the default constants ({len(all_mixes)} mixes)")
        defaults = default_knobs()
        compiler.warm([(m, [(None, None)] + [(c, defaults) for c in tile_configs(sweep, m)]) for m in all_mixes],
                      "stage A")
        copy_tbps = pb.copy_bandwidth_tbps(sweep.bench_setting())
        log(f"  copy bandwidth {copy_tbps:.2f} TB/s")
        for mix in all_mixes:
            if time.time() > start + 0.55 * budget:  # leave stage B its share of the budget
                notes.append(f"stage A skipped {mix.name} to stay within the {budget:.0f} s budget")
                log(f"  {notes[-1]}")
                continue
            rows_a.append(stage_a(sweep, mix, copy_tbps))
            if sweep.cuda:
                torch.cuda.empty_cache()
        log(f"== B. split constants on the best {sweep.top_tiles} tiles ({len(sweep.grid)} sets)")
        from autotile.families.paged import device_sm_count

        num_sms = sweep.num_sms or device_sm_count(torch.device(sweep.device))
        done_a = {row["mix"] for row in rows_a}
        plans = [(mix, row, stage_b_plan(sweep, mix, row, num_sms))
                 for mix, row in zip([m for m in all_mixes if m.name in done_a], rows_a)]
        compiler.warm([(mix, [(row["tiles"][t]["config"], g[0]) for t in p["tiles"] for g in p["groups"]])
                       for mix, row, p in plans], "stage B")
        for mix, row, planned in plans:
            runs = len(planned["tiles"]) * len(planned["groups"])
            # About 2 s a mix to check and capture plus the timings themselves.
            needed = 2 + runs * sweep.rounds * (sweep.warmup_ms + sweep.rep_ms + 10) / 1e3
            if time.time() + needed > sweep.deadline:
                notes.append(f"stage B skipped {mix.name} ({runs} runs) to stay within the {budget:.0f} s budget")
                log(f"  {notes[-1]}")
                continue
            log(f"  {mix.name}: {len(planned['groups'])} distinct schedules x {len(planned['tiles'])} tiles")
            rows_b.append(stage_b(sweep, mix, row, planned, copy_tbps))
            if sweep.cuda:
                torch.cuda.empty_cache()
        summary = summarise(rows_b, copy_tbps, sweep.grid)
        if len(rows_b) < len(all_mixes):
            notes.append(f"the constant ranking covers {len(rows_b)} of {len(all_mixes)} mixes")
    except Exception as exc:
        notes.append(f"the sweep stopped early: {type(exc).__name__}: {exc}")
        log(f"  FAILED\n{traceback.format_exc(limit=8)}")
    finally:
        compiler.close()
    elapsed = time.time() - start
    table = render(sweep, copy_tbps, rows_a, rows_b, summary, notes, elapsed)
    args.out.write_text(table)
    ranking = [dict(r, knobs=r["knobs"]._asdict()) for r in (summary or {}).get("ranking", [])]
    args.out.with_suffix(".json").write_text(json.dumps(dict(
        copy_tbps=copy_tbps, default_knobs=default_knobs()._asdict(), stage_a=rows_a,
        stage_b=[{k: v for k, v in r.items() if not k.startswith("_")} for r in rows_b],
        ranking=ranking, notes=notes, elapsed_s=elapsed), indent=1, default=str))
    log(f"== done in {elapsed:.0f} s\n")
    print(table)


if __name__ == "__main__":
    main()
