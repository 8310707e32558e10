"""Fuzz the configs a GPU serves for shapes nobody tuned: run them under Triton's interpreter and check them.

On a GPU, a shape without a winner is served by its family's `default_config` (the policies of gemm_policy.py,
flash.py, paged.py, elementwise.py), which no correctness gate of the tuner ever ran. This script draws awkward
problems (odd sizes, K past the tile, column-major operands, epilogues, GQA, windows, odd contexts, small pages),
takes the configs an H200 would serve for them (and random feasible configs of the H200's space), runs each one the
interpreter can run through the family's `launch` on CPU tensors, and checks it against the family's float64
reference with the family's own check. Gluon kernels do not run under the interpreter: they are counted, not run.

Launch geometry follows the H200 where the host picks it from the GPU (GEMM's persistent and stream-K program
counts, the balanced paged kernel's SM count, the persistent elementwise grid), so the interpreter runs the grid the
GPU would.

    python benchmarks/prototypes/fuzz_configs.py --minutes 10 --families gemm,flash --out /tmp/fuzz.jsonl
    python benchmarks/prototypes/fuzz_configs.py --summary /tmp/fuzz.jsonl

Every result is one JSON line (family, problem, config, source, status, max error, message, seconds); failures are
the lines whose status is 'wrong_result' (or 'crash', an exception out of the launch).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[2])]
# NOTE: the interpreter must be chosen before triton is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("AUTOTILE_CACHE_DIR", "/tmp/autotile-fuzz-cache")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import signal  # noqa: E402
import time  # noqa: E402
from collections import Counter  # noqa: E402

import torch  # noqa: E402

from autotile import bench  # noqa: E402
from autotile.device import interpret_device, planned_device  # noqa: E402
from autotile.dtypes import torch_dtype  # noqa: E402
from autotile.expr import parse  # noqa: E402
from autotile.families import elementwise, flash, gemm, gemm_launch, paged  # noqa: E402
from autotile.families.gemm_space import GLUON_WS, programs_per_sm  # noqa: E402
from autotile.space import AxisKind  # noqa: E402

H200 = planned_device("h200")
CPU = interpret_device()
ODD_SIZES = (1, 3, 17, 33, 100, 257)
# Sizes whose rows are 16-byte aligned (TMA-able), and long dimensions of LLM projections.
ALIGNED_SIZES = (16, 64, 128, 136, 264)
LONG_SIZES = (1000, 1536, 4096)
# Multiply-adds of the largest GEMM the interpreter runs in a few seconds.
GEMM_MAX_WORK = 3 * 10**7
LAUNCH_TIMEOUT_S = 90


# --- problems ---------------------------------------------------------------------------------------

def gemm_problem(rng: random.Random) -> gemm.GemmProblem:
    """An awkward GEMM small enough for the interpreter: odd and aligned sizes, one of them up to 4096, any layout
    and epilogue."""
    m, n, k = (rng.choice(ODD_SIZES + ALIGNED_SIZES) for _ in range(3))
    big, size = rng.choice("mnk-"), rng.choice(LONG_SIZES)
    grown = [size if big == axis else old for axis, old in zip("mnk", (m, n, k))]
    if grown[0] * grown[1] * grown[2] <= GEMM_MAX_WORK:
        m, n, k = grown
    dtype = rng.choice(("fp32", "fp16", "bf16", "bf16", "fp8"))
    out = "bf16" if dtype == "fp8" else rng.choice((dtype, dtype, "fp32"))
    flags = dict(bias=rng.random() < 0.4, activation=rng.choice(gemm.ACTIVATIONS), residual=rng.random() < 0.3)
    if dtype == "fp32":
        flags["tf32"] = rng.random() < 0.3
    if dtype == "fp8":
        flags["scale_mode"] = rng.choice(gemm.SCALE_MODES)
        flags["fp8_fast_accum"] = flags["scale_mode"] != "block" and rng.random() < 0.4
    layouts = ("row", "row", "col", "strided")
    problem = gemm.contiguous_problem(m, n, k, dtype, out, rng.choice(layouts), rng.choice(layouts), **flags)
    if rng.random() < 0.1:  # storage offset by one element: no TMA
        problem = dataclasses.replace(problem, aligned=False)
    return problem


def flash_problem(rng: random.Random) -> flash.FlashProblem:
    direction = rng.choice(("fwd", "fwd", "bwd"))
    head_dim = rng.choice((64, 80, 96, 128, 256, 40))
    heads_kv = rng.choice((1, 2))
    heads_q = heads_kv * rng.choice((1, 2, 3))
    seq_q, seq_k = rng.choice((1, 3, 17, 33, 64, 100, 129, 200)), rng.choice((1, 5, 17, 64, 100, 129, 257))
    if rng.random() < 0.3:
        seq_k = seq_q
    # NOTE: no fp8: Triton 3.6's interpreter rounds fp32 -> e4m3 wrongly inside the kernel (the runtime refuses fp8
    # attention on the CPU for that reason), so its results say nothing about the GPU's.
    dtype = rng.choice(("fp16", "bf16", "bf16", "fp32"))
    fields = dict(causal=rng.random() < 0.5, dtype=dtype, aligned=rng.random() < 0.9)
    if rng.random() < 0.25:
        fields["window_left"] = rng.choice((0, 3, 16, 50))
    if rng.random() < 0.15:
        fields["window_right"] = rng.choice((0, 7, 40))
    if rng.random() < 0.2:
        fields["softcap"] = rng.choice((5.0, 30.0))
    fields["alibi"] = rng.random() < 0.2
    fields["varlen"] = rng.random() < 0.15
    batch = rng.choice((1, 2)) if not fields.get("varlen") else rng.choice((2, 3))
    return flash.FlashProblem(direction, batch, heads_q, heads_kv, seq_q, seq_k, head_dim, **fields)


def paged_problem(rng: random.Random) -> paged.PagedProblem:
    heads_kv = rng.choice((1, 2))
    group = rng.choice((1, 2, 4, 8, 16))
    num_queries = rng.choice((1, 1, 1, 2, 3, 5, 16, 20))
    max_context = rng.choice((1, 7, 17, 100, 257, 513, 1000, 1500))
    max_context = max(max_context, num_queries)
    mean_context = rng.randint(num_queries, max_context) if rng.random() < 0.5 else max_context
    dtype = rng.choice(("fp16", "bf16"))
    kv_dtype = "fp8" if rng.random() < 0.2 else dtype
    return paged.PagedProblem(rng.choice((1, 2, 3, 5)), heads_kv * group, heads_kv, rng.choice((64, 80, 96, 128, 256, 40)),
                              rng.choice((1, 4, 16, 64, 256)), max_context, mean_context, num_queries, dtype, kv_dtype)


ELEMENTWISE_EXPRS = ("sin(x)**2 + cos(x)**2", "x * y + 1", "maximum(x, y) - exp(-abs(x))", "where(x > y, x, y * 0.5)",
                     "sqrt(abs(x)) / (1 + y*y)", "x ** 3 - tanh(y)")


def elementwise_problem(rng: random.Random) -> elementwise.ElementwiseProblem:
    """Contiguous 1-D inputs of odd lengths, or strided ones: a transposed x and a broadcast row y."""
    expr = rng.choice(ELEMENTWISE_EXPRS)
    dtype = rng.choice(("fp32", "fp16", "bf16"))
    if rng.random() < 0.5:
        return elementwise.FAMILY.problem_for_expression(expr, dtype, rng.choice((1, 3, 17, 1000, 4097, 70001)))
    rows, cols = rng.choice((1, 3, 17, 100)), rng.choice((1, 5, 33, 257))
    dt = torch_dtype(dtype)
    x = torch.randn(cols, rows).to(dt).t()  # (rows, cols), column-major
    y = torch.randn(cols).to(dt) if rng.random() < 0.5 else torch.randn(rows, 2 * cols).to(dt)[:, ::2]
    return elementwise.FAMILY.problem_from_values(parse(expr), {"x": x, "y": y})


PROBLEMS = {"gemm": gemm_problem, "flash": flash_problem, "paged": paged_problem, "elementwise": elementwise_problem}
FAMILIES = {"gemm": gemm.FAMILY, "flash": flash.FAMILY, "paged": paged.FAMILY, "elementwise": elementwise.FAMILY}


# --- configs ------------------------------------------------------------------------------------------

def served_configs(family, problem) -> list[tuple[str, object]]:
    """(source, config) of what an H200 serves an untuned call with (and the interpreter, for CPU tensors)."""
    served = [("h200-default", family.default_config(problem, H200))]
    if family is flash.FAMILY and problem.direction == "bwd":
        # Served under torch.use_deterministic_algorithms(True) where the default is the Gluon backward.
        served.append(("h200-triton-bwd-default", family.triton_backward_default(problem, H200)))
    if family is paged.FAMILY and problem.num_queries > 1:
        served.append(("h200-prefill-default", family.prefill_config(problem, H200)))
    served.append(("interpret-default", family.default_config(problem, CPU)))
    return served


def structure(space, config) -> tuple:
    """What a config renders and how it loops: its render axes and its on/off axes."""
    return tuple(v for k, v in sorted(config.items()) if k in space.names(AxisKind.RENDER) or isinstance(v, bool))


def random_configs(family, problem, rng: random.Random, count: int) -> list[tuple[str, object]]:
    """`count` feasible configs of the H200's space (Gluon ones included: they are counted), each of a structure drawn
    uniformly first, so that rare kernels (TMA, a split C store, persistent loops) come up as often as common ones."""
    space = family.space(problem, H200)
    groups: dict[tuple, list] = {}
    for config in space.feasible():
        groups.setdefault(structure(space, config), []).append(config)
    keys = list(groups)
    return [("h200-random", rng.choice(groups[rng.choice(keys)])) for _ in range(count)] if keys else []


def interpretable(family, config) -> bool:
    """Gluon kernels do not run under Triton's interpreter."""
    return GLUON_WS not in (config.get("VARIANT"), config.get("LOADS"))


# --- launching as the H200 would -----------------------------------------------------------------------

def gemm_programs(problem, config) -> int:
    """Programs of a GEMM config an H200 runs at once (persistent grids and stream-K shares follow from it)."""
    return H200.sm_count * programs_per_sm(problem, config, H200)


def uses_program_count(family, config) -> bool:
    """A GEMM config whose launch depends on the programs a wave holds: stream-K, or a persistent tile loop."""
    return family is gemm.FAMILY and (config["SCHEDULE"] == "stream_k" or config["PERSISTENT"])


@contextlib.contextmanager
def h200_geometry(family, problem, config, programs: int | None = None):
    """Launch geometry the H200 would pick: GEMM programs per wave (or `programs`), the paged balanced grid, the
    elementwise grid.

    NOTE: the families read these module globals when they plan a launch on the CPU; they are swapped here for the
    H200's values (the interpreter has no SM count of its own) and restored after, with the plans built from them."""
    saved_programs, saved_sms, saved_ew = gemm_launch.INTERPRETER_PROGRAMS, paged.device_sm_count, elementwise._INTERPRET_SMS
    try:
        if family is gemm.FAMILY:
            gemm_launch.INTERPRETER_PROGRAMS = programs or gemm_programs(problem, config)
            gemm_launch.launch_plan.cache_clear()
        paged.device_sm_count = lambda device: H200.sm_count
        paged._launches.clear()
        elementwise._INTERPRET_SMS = H200.sm_count
        yield
    finally:
        gemm_launch.INTERPRETER_PROGRAMS, paged.device_sm_count = saved_programs, saved_sms
        elementwise._INTERPRET_SMS = saved_ew
        gemm_launch.launch_plan.cache_clear()
        paged._launches.clear()


class LaunchTimeout(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds: int):
    def expire(signum, frame):
        raise LaunchTimeout(f"over {seconds} s under the interpreter")
    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def run_one(family, problem, config, prepared, programs: int | None = None) -> dict:
    """Launch `config` on the prepared inputs and check it; a record of the outcome."""
    start = time.perf_counter()
    with h200_geometry(family, problem, config, programs), time_limit(LAUNCH_TIMEOUT_S):
        try:
            outcome, _ = bench.run_checked(family, problem, config, CPU, seed=0, prepared=prepared)
            status, error, max_err = outcome.status.value, outcome.error, outcome.max_abs_error
        except LaunchTimeout as exc:
            status, error, max_err = "timeout", str(exc), 0.0
    if "LaunchTimeout" in (error or ""):
        status = "timeout"
    return dict(status=status, max_err=max_err, message=(error or "")[-1500:],
                seconds=round(time.perf_counter() - start, 2))


def fuzz_problem(name: str, rng: random.Random, random_count: int, out) -> Counter:
    """Draw one problem of family `name`, run its served and random configs; write a line per config."""
    family = FAMILIES[name]
    counts: Counter = Counter()
    try:
        problem = PROBLEMS[name](rng)
        candidates = served_configs(family, problem) + random_configs(family, problem, rng, random_count)
    except Exception as exc:  # noqa: BLE001 - a problem the family refuses is not a config failure
        counts["problem_refused"] += 1
        print(f"{name}: problem refused: {type(exc).__name__}: {exc}", file=sys.stderr)
        return counts
    seen = set()
    prepared = None
    for source, config in candidates:
        if config in seen:
            continue
        seen.add(config)
        record = dict(family=name, problem=dataclasses.asdict(problem), config=dict(config), source=source)
        if not interpretable(family, config):
            record.update(status="skipped_gluon")
        else:
            if prepared is None:
                prepared = bench.prepare(family, problem, CPU, seed=0)
            record.update(run_one(family, problem, config, prepared))
        write(record, out, counts)
        if record["status"] != "skipped_gluon" and uses_program_count(family, config):
            # The same config on a small odd wave as well: persistent loops take turns, stream-K shares cut tiles.
            programs = rng.choice((3, 5, 7))
            again = dict(record, source=f"{source}@{programs}programs")
            again.update(run_one(family, problem, config, prepared, programs))
            write(again, out, counts)
    counts["problems"] += 1
    return counts


def write(record: dict, out, counts: Counter) -> None:
    counts[record["status"]] += 1
    out.write(json.dumps(record) + "\n")
    out.flush()
    if record["status"] not in ("ok", "skipped_gluon"):
        print(f"{record['status']}: {record['family']} {record['problem']} {json.dumps(record['config'])} "
              f"[{record['source']}]: {record.get('message', '')[:300]}", file=sys.stderr, flush=True)


# --- reports ----------------------------------------------------------------------------------------------

def summary(path: str) -> None:
    rows = [json.loads(line) for line in open(path)]
    by_family: dict[str, Counter] = {}
    problems: dict[str, set] = {}
    for r in rows:
        by_family.setdefault(r["family"], Counter())[r["status"]] += 1
        problems.setdefault(r["family"], set()).add(json.dumps(r["problem"], sort_keys=True))
    for fam, counts in by_family.items():
        print(f"{fam}: {len(problems[fam])} problems, {sum(counts.values())} configs: {dict(counts)}")
    for r in rows:
        if r["status"] not in ("ok", "skipped_gluon", "timeout"):
            print(f"\n{r['status']} [{r['source']}] {r['family']} {json.dumps(r['problem'])}\n  config {json.dumps(r['config'])}"
                  f"\n  max err {r.get('max_err')}: {r.get('message', '')[:400]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", default="gemm,flash,paged,elementwise")
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--random-configs", type=int, default=3, help="random feasible H200 configs per problem")
    parser.add_argument("--out", default="/tmp/fuzz_configs.jsonl")
    parser.add_argument("--summary", help="summarise a results file and exit")
    args = parser.parse_args()
    if args.summary:
        summary(args.summary)
        return
    rng = random.Random(args.seed)
    names = args.families.split(",")
    deadline = time.monotonic() + 60 * args.minutes
    totals: Counter = Counter()
    with open(args.out, "a") as out:
        while time.monotonic() < deadline:
            totals += fuzz_problem(rng.choice(names), rng, args.random_configs, out)
    print(dict(totals))


if __name__ == "__main__":
    main()
