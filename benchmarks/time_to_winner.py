"""Time to a winner: autotile's tuner against Inductor max-autotune on the same GEMM shapes, in one run.

Target (issue 15): per shape, the time to a winner at least as fast as the vendor op (cuBLAS) is at most
Inductor max-autotune's time on the same shape. Judged twice: autotile's CLI from its launch (b), and autotile's
tuner called in a process that has started (c), each against Inductor's autotuning (a).

Run from the repository root on a CUDA machine:

    python benchmarks/time_to_winner.py --quick --out benchmarks/results/time_to_winner.md

For each GEMM shape of an LLM projection in nn.Linear layout (x (M, K) times weight (N, K), bf16):

(a) Inductor: a fresh Python process with fresh TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR compiles
    `F.linear(x, w)` with torch.compile(mode="max-autotune-no-cudagraphs"). Its autotuning time is the wall
    time of the first call, from its start to its completion (torch.cuda.synchronize): tracing, lowering,
    benchmarking its choices (Triton templates and cuBLAS) and code generation. The process's start-up (import
    torch, CUDA context, inputs) is measured apart. The compiled callable is then timed beside F.linear, and
    the choice Inductor printed ("AUTOTUNE ...") is read from its stderr.
(b) autotile: `python -m autotile.cli.main tune gemm --m M --n N --k K --dtype bf16 --layout-b col --trials T
    --patience P` in a fresh process, with a fresh SQLite database, Triton cache and kernel cache, so start-up
    counts (clock: from just before the process is launched). From the database's trial rows, each stamped
    when it was recorded (`created_at`):
      - time to vendor parity: the first search trial whose median time was at most the vendor op's (the
        vendor's median from the final interleaved re-timing, its rows under the study name + ':vendor').
        When no search trial got there, the vendor op itself (or a kernel that beat it only in the final
        re-timing) makes the winner at least as fast as the vendor op, and the time counts until the vendor
        config was timed: its rows are written right after the final re-timing, near the end of the run.
        The tuner also times the vendor op before its first search trial (for its early stop) and stores
        those rows too; they are not counted as parity: only the final re-timing decides the winner.
      - total: the CLI process's wall time.
    A third fresh process then serves the winner through `autotile.linear` (AUTOTILE_DB = that database),
    checks it against a float64 reference and times it beside F.linear.
(c) autotile in-process, measured as (a) is: a fresh process (fresh database, Triton cache and kernel cache)
    imports torch and autotile's tuner, makes its CUDA context and the inputs, as (a)'s does; that start-up is
    measured apart (the tuner's import shown within it). The clock then runs from just before
    `autotile.tune.driver.tune_problem(FAMILY, problem, device, trials=T, patience=P, seed=0, isolate=False)`
    (the problem the CLI builds from the same options; the trials run in this process, no trial worker; every
    other setting the CLI's, compile-ahead included) until it returns with the winner stored. Time to vendor
    parity and the trial counts come from the database as in (b), in seconds since the call; a fresh process
    serves the winner as in (b). This is the counterpart of (a): (b) also pays for its process start-up, and
    its trial worker is ready only ~12 s after launch on the H200 (spawn, import torch and triton, CUDA context).

Every output is checked against a float64 torch reference (autotile's GEMM tolerance) before it is timed.
Timings are medians of `triton.testing.do_bench` medians over interleaved rounds. The table is printed last;
markdown goes to --out (a .md file, or a folder that gets time_to_winner.md) and the raw numbers as JSON beside.

--quick: 3 shapes, --trials 12 --patience 4, about 5 minutes on an H200 (3-4 before (c) was added: its
process and its serving process add ~30 s a shape).
--smoke: the autotile halves only ((b) and (c)), on Triton's CPU interpreter, with a tiny fp16 shape (no GPU, no
Inductor): a check of the script end to end, not a measurement.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# (M, N, K): x (M, K) @ weight (N, K).T. 3000 x 5000 x 1536 is issue 15's shape; the others are Llama-3-8B
# projections: decode o_proj (16 tokens), gate_up-sized N at 128 tokens, down_proj at 2048 tokens.
SHAPES = [(3000, 5000, 1536), (16, 4096, 4096), (128, 14336, 4096), (2048, 4096, 14336)]
QUICK_SHAPES = SHAPES[:3]
# A tiny shape with no dimension a multiple of a block, for the interpreter.
SMOKE_SHAPE = (20, 24, 40)
# (trials, patience) of the tune command. --quick: measured budget below; full: issue 15's "--trials 40".
TUNE_SETTINGS = {"full": (40, 8), "quick": (12, 4), "smoke": (3, 2)}
# Seconds the whole run may take: a shape starts only while the time left holds the shapes' mean so far (the
# device machine stops a command at 600 s). --quick: a shape took ~68 s on the H200 before the in-process run
# (~30 s more: its process, then its serving process), so its 3 shapes fit in about 5 minutes.
BUDGET_S = {"full": 480.0, "quick": 330.0, "smoke": 300.0}
# Interleaved timing rounds of the served op / compiled callable beside F.linear.
TIMING_ROUNDS = 5
# A child process gets at least this many seconds even when the budget is nearly spent.
MIN_CHILD_S = 30.0
INDUCTOR_MODE = "max-autotune-no-cudagraphs"


# --- reading what the runs left ----------------------------------------------------------------------

def parse_inductor_autotune(text: str) -> list[dict]:
    """The autotuning tables Inductor prints to stderr under max-autotune, one dict per tuned op.

    Each: {"op": "mm(16x4096, 4096x4096)", "choices": [(name, ms), ...] fastest first, "picked": name,
    "benchmark_s": float | None, "precompile_s": float | None, "num_choices": int | None}.

    >>> parse_inductor_autotune("AUTOTUNE mm(16x64, 64x32)\\nstrides: [64, 1], [1, 64]\\n"
    ...     "  mm 0.0100 ms 100.0% \\n  triton_mm_1 0.0200 ms 50.0% BLOCK_M=16\\n"
    ...     "SingleProcess AUTOTUNE benchmarking takes 0.5000 seconds and 1.2500 seconds precompiling for 2 choices\\n"
    ...     )[0]["picked"]
    'mm'
    """
    blocks, current = [], None
    choice = re.compile(r"^\s+(\S+)\s+([0-9.eE+-]+|inf|nan)\s+ms\b")
    # Older releases end the summary at "precompiling"; newer ones add "for N choices" and more.
    summary = re.compile(r"AUTOTUNE benchmarking takes ([0-9.]+) seconds and ([0-9.]+) seconds precompiling"
                         r"(?: for (\d+) choices)?")
    for line in text.splitlines():
        if line.startswith("AUTOTUNE "):
            current = {"op": line[len("AUTOTUNE "):].strip(), "choices": [], "picked": None,
                       "benchmark_s": None, "precompile_s": None, "num_choices": None}
            blocks.append(current)
            continue
        if current is None:
            continue
        found = summary.search(line)
        if found:
            current["benchmark_s"], current["precompile_s"] = float(found[1]), float(found[2])
            current["num_choices"] = int(found[3]) if found[3] else len(current["choices"])
            current = None
            continue
        found = choice.match(line)
        if found:
            current["choices"].append((found[1], float(found[2])))
            if current["picked"] is None:
                current["picked"] = found[1]  # Inductor prints the choices fastest first
    return blocks


def _stamp(value) -> datetime.datetime:
    return value if isinstance(value, datetime.datetime) else datetime.datetime.fromisoformat(str(value))


def parity_from_db(db_url: str, launched_at: datetime.datetime) -> dict:
    """When a fresh tuning run first had a candidate at least as fast as the vendor op, from its trial rows.

    `launched_at` is the naive UTC time just before the tune process was launched (rows are stamped in naive
    UTC). Returns seconds since the launch: `first_trial_s`, `kernel_parity_s` (the first search trial with a
    median at most the vendor's, None if none), `parity_s` and `parity_by` (that trial, else the final
    re-timing in which the vendor op was timed; None without a vendor op), plus the vendor's and best trial's
    times, the winner and the trial counts.
    """
    from sqlalchemy import select
    from sqlalchemy.orm import Session

    from autotile.store.db import open_engine
    from autotile.store.models import Trial, Winner

    engine = open_engine(db_url, create=False, read_only=True)
    try:
        with Session(engine) as session:
            trials = session.execute(select(Trial).order_by(Trial.created_at, Trial.id)).scalars().all()
            winners = session.execute(select(Winner)).scalars().all()
            rows = [(t.study, t.number, t.status, t.median_ms, _stamp(t.created_at), t.config) for t in trials]
            winner = None
            if winners:
                if len(winners) > 1:
                    raise ValueError(f"{db_url}: {len(winners)} winners; expected the one problem of a fresh run")
                w = winners[0]
                winner = {"config": json.loads(w.config), "median_ms": w.median_ms, "baseline_name": w.baseline_name,
                          "baseline_ms": w.baseline_ms, "saved_s": (_stamp(w.created_at) - launched_at).total_seconds()}
    finally:
        engine.dispose()
    return parity_from_rows(rows, launched_at, winner)


def parity_from_rows(rows: list[tuple], launched_at: datetime.datetime, winner: dict | None) -> dict:
    """`parity_from_db` on rows (study, number, status, median_ms, created_at, config JSON) in recorded order."""
    vendor_rows = [r for r in rows if r[0].endswith(":vendor") and r[2] == "ok" and r[3] is not None]
    search_rows = [r for r in rows if not r[0].endswith(":vendor")]
    studies = {r[0] for r in search_rows}
    if len(studies) > 1:
        raise ValueError(f"trial rows of {len(studies)} studies; expected the one problem of a fresh run")

    def since(stamp: datetime.datetime) -> float:
        return (stamp - launched_at).total_seconds()

    ok = [r for r in search_rows if r[2] == "ok" and r[3] is not None]
    result = {
        "trials": len(search_rows), "trials_ok": len(ok),
        "first_trial_s": since(search_rows[0][4]) if search_rows else None,
        "last_trial_s": since(search_rows[-1][4]) if search_rows else None,
        "best_trial_ms": min((r[3] for r in ok), default=None),
        "vendor_ms": None, "vendor_timed_s": None, "vendor_first_s": None, "kernel_parity_s": None, "kernel_parity_trial": None,
        "parity_s": None, "parity_by": "no vendor op timed (none for this problem, or it failed its check)",
        "winner": winner, "vendor_won": bool(winner and "VENDOR" in winner["config"]),
    }
    if not vendor_rows:
        return result
    # The final re-timing's rows (after the last search trial); the rows timed before the first trial are shown apart.
    final = [r for r in vendor_rows if not search_rows or r[4] >= search_rows[-1][4]] or vendor_rows
    fastest = min(final, key=lambda r: r[3])
    result["vendor_ms"], result["vendor_timed_s"] = fastest[3], since(fastest[4])
    result["vendor_first_s"] = since(vendor_rows[0][4])
    first = next((r for r in ok if r[3] <= fastest[3]), None)
    if first is not None:
        result["kernel_parity_s"], result["kernel_parity_trial"] = since(first[4]), first[1]
        result["parity_s"] = result["kernel_parity_s"]
        result["parity_by"] = f"search trial {first[1]} ({first[3]:.4g} ms <= vendor {fastest[3]:.4g} ms)"
    else:
        result["parity_s"] = result["vendor_timed_s"]
        result["parity_by"] = ("vendor op, timed in the final re-timing" if result["vendor_won"] else
                               "a kernel that beat the vendor op in the final re-timing only")
    return result


def verdict(parity_s: float | None, inductor_s: float | None) -> str:
    """'met' when autotile's time to vendor parity is at most Inductor's autotuning time."""
    if parity_s is None or inductor_s is None:
        return "n/a"
    return "met" if parity_s <= inductor_s else "NOT met"


# --- the child processes ---------------------------------------------------------------------------

def _torch_dtype(name: str):
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def _inputs(m: int, n: int, k: int, dtype: str, device: str):
    """x (m, k) and an nn.Linear weight (n, k), N(0, 1) as autotile's GEMM tolerance assumes."""
    import torch

    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(m, k, generator=gen).to(device=device, dtype=_torch_dtype(dtype))
    w = torch.randn(n, k, generator=gen).to(device=device, dtype=_torch_dtype(dtype))
    return x, w


def check_linear(y, x, w, dtype: str) -> dict:
    """y against x @ w.T in float64, within autotile's GEMM tolerance for this shape (a justified bound)."""
    from autotile.families.checks import compare
    from autotile.families.gemm import FAMILY, contiguous_problem

    m, k = x.shape
    problem = contiguous_problem(m, w.shape[0], k, dtype, dtype, layout_b="col")
    want = x.double() @ w.double().t()
    result = compare("y", y, want, FAMILY.tolerance(problem))
    return {"ok": result.ok, "message": result.message, "max_abs_error": result.max_abs_error}


def interleaved_ms(fns: dict, rounds: int, cuda: bool) -> dict[str, float]:
    """Median over `rounds` of each callable's do_bench median, the callables timed in turns each round."""
    from autotile.bench import interleaved_medians

    def time_one(fn) -> float:
        if cuda:
            import triton.testing

            return float(triton.testing.do_bench(fn, return_mode="median"))
        fn()  # the interpreter: wall clock (CPU timings, labelled so in the report)
        samples = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - start) * 1e3)
        return statistics.median(samples)

    return interleaved_medians(fns, rounds, time_one)


def child_inductor(args) -> dict:
    """Compile F.linear with max-autotune in this (fresh) process; time the first call, then the callable."""
    import torch
    import torch.nn.functional as F

    x, w = _inputs(args.m, args.n, args.k, args.dtype, "cuda")

    def linear(x, w):
        return F.linear(x, w)

    compiled = torch.compile(linear, mode=INDUCTOR_MODE)
    torch.cuda.synchronize()
    call_started_wall = time.time()
    started = time.perf_counter()
    y = compiled(x, w)
    torch.cuda.synchronize()
    autotune_s = time.perf_counter() - started
    check = check_linear(y, x, w, args.dtype)
    times = interleaved_ms({"inductor": lambda: compiled(x, w), "F.linear": lambda: F.linear(x, w)},
                           args.rounds, cuda=True) if check["ok"] else {}
    return {"autotune_s": autotune_s, "startup_s": call_started_wall - args.launched_at, "check": check,
            "kernel_ms": times.get("inductor"), "flinear_ms": times.get("F.linear"),
            "torch": torch.__version__, "device": torch.cuda.get_device_name()}


def child_inprocess(args) -> dict:
    """Tune in this (fresh) process, measured as Inductor is: start-up apart, then the tuner's own call timed.

    Start-up: import torch and autotile's tuner, the CUDA context, the problem's inputs (as child_inductor
    makes them). The clock then runs from just before `tune_problem` (trials in this process: isolate=False;
    otherwise the CLI's settings) until it returns with the winner stored. The session the CLI opens around its
    problems is opened here too, outside the clock: the compile-ahead pool it keeps stops after the winner is
    stored, as the CLI's does.
    """
    import torch

    imported = time.perf_counter()
    from autotile.device import resolve_gpu
    from autotile.families.gemm import FAMILY
    from autotile.tune.driver import tune_problem
    from autotile.tune.session import TuneSession

    import_tuner_s = time.perf_counter() - imported
    cuda = not args.interpret
    _inputs(args.m, args.n, args.k, args.dtype, "cuda" if cuda else "cpu")  # the CUDA context, as Inductor's child
    if cuda:
        torch.cuda.synchronize()
    device = resolve_gpu("interpret" if args.interpret else "auto")
    # The problem exactly as `tune gemm --m M --n N --k K --dtype D --layout-b col` builds it.
    (problem,) = FAMILY.problems_from_cli(m=args.m, n=args.n, k=args.k, dtype=args.dtype, layout_b="col")
    db_url = os.environ["AUTOTILE_DB"]  # a fresh database the parent names, as for the CLI run

    def progress(p) -> None:
        print(f"  trial {p.evaluated}/{p.target}: {p.last_status}", file=sys.stderr, flush=True)

    with TuneSession() as session:
        tune_started_utc = _utc_now()
        tune_started_wall = time.time()
        started = time.perf_counter()
        result = tune_problem(FAMILY, problem, device, trials=args.trials, patience=args.patience, seed=0,
                              isolate=False, db_url=db_url, progress=progress)
        tune_s = time.perf_counter() - started
        stats = session.stats()
    return {"startup_s": tune_started_wall - args.launched_at, "import_tuner_s": import_tuner_s, "tune_s": tune_s,
            "tune_started_utc": tune_started_utc.isoformat(),
            "tuned_config": None if result.winner is None else dict(result.winner),
            "tuned_ms": result.winner_ms, "baseline_name": result.baseline_name, "baseline_ms": result.baseline_ms,
            "stopped_early": result.stopped_early, "statuses": result.statuses,
            "trials_this_run": result.trials_this_run, "compile_pools": stats.pool_starts,
            "device": torch.cuda.get_device_name() if cuda else "interpreter"}


def child_serve(args) -> dict:
    """Serve the tuned winner through autotile.linear (AUTOTILE_DB is the run's database); check; time."""
    import torch
    import torch.nn.functional as F

    import autotile

    cuda = torch.cuda.is_available() and not args.interpret
    x, w = _inputs(args.m, args.n, args.k, args.dtype, "cuda" if cuda else "cpu")
    info = autotile.explain("linear", x, w)
    check = check_linear(autotile.linear(x, w), x, w, args.dtype)
    times = interleaved_ms({"autotile": lambda: autotile.linear(x, w), "F.linear": lambda: F.linear(x, w)},
                           args.rounds, cuda=cuda) if check["ok"] else {}
    return {"source": info["source"], "match": info["match"], "vendor": info["vendor"], "config": info["config"],
            "check": check, "served_ms": times.get("autotile"), "flinear_ms": times.get("F.linear"),
            "interpreted": not cuda}


CHILDREN = {"inductor": child_inductor, "inprocess": child_inprocess, "serve": child_serve}


# --- the parent: one run over the shapes ---------------------------------------------------------

def _utc_now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc).replace(tzinfo=None)


def run_child(cmd: list[str], env: dict, timeout_s: float) -> dict:
    """Run a command in its own process group; on timeout kill the group (trial workers, compile pools too)."""
    started = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout_s)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        timed_out = True
    return {"rc": proc.returncode, "seconds": time.monotonic() - started, "timed_out": timed_out,
            "output": output or ""}


def _env(scratch: Path, **extra: str) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    env["TRITON_CACHE_DIR"] = str(scratch / "triton")
    env.update(extra)
    return env


def _child_json(kind: str, shape, args, out: Path, env: dict, timeout_s: float) -> tuple[dict, str]:
    m, n, k = shape
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", kind, "--child-out", str(out),
           "--m", str(m), "--n", str(n), "--k", str(k), "--dtype", args.dtype, "--rounds", str(args.rounds),
           "--trials", str(args.trials), "--patience", str(args.patience),
           "--launched-at", repr(time.time())] + (["--interpret"] if args.smoke else [])
    run = run_child(cmd, env, timeout_s)
    data = json.loads(out.read_text()) if out.exists() else {}
    data.update(rc=run["rc"], process_s=run["seconds"], timed_out=run["timed_out"], log_tail=run["output"][-3000:])
    return data, run["output"]


def run_inductor(shape, args, scratch: Path, timeout_s: float) -> dict:
    root = scratch / "inductor"
    root.mkdir(parents=True)
    env = _env(root, TORCHINDUCTOR_CACHE_DIR=str(root / "inductor"))
    data, output = _child_json("inductor", shape, args, root / "result.json", env, timeout_s)
    data["autotune_tables"] = parse_inductor_autotune(output)
    return data


def run_autotile(shape, args, scratch: Path, timeout_s: float) -> dict:
    m, n, k = shape
    root = scratch / "autotile"
    root.mkdir(parents=True)
    db_url = f"sqlite:///{root / 'tune.sqlite'}"
    env = _env(root, AUTOTILE_CACHE_DIR=str(root / "kernels"), AUTOTILE_DB=db_url)
    cmd = [sys.executable, "-m", "autotile.cli.main", "tune", "gemm", "--m", str(m), "--n", str(n), "--k", str(k),
           "--dtype", args.dtype, "--layout-b", "col", "--trials", str(args.trials), "--patience",
           str(args.patience), "--gpu", "interpret" if args.smoke else "auto", "--db", db_url, "--seed", "0"]
    launched_at = _utc_now()
    run = run_child(cmd, env, timeout_s)
    data = {"command": " ".join(cmd[2:]), "total_s": run["seconds"], "rc": run["rc"], "timed_out": run["timed_out"],
            "log_tail": run["output"][-3000:]}
    if (root / "tune.sqlite").exists():
        _parity_and_served(data, db_url, launched_at, run["rc"] == 0, shape, args, root, env)
    return data


def _parity_and_served(data: dict, db_url: str, launched_at: datetime.datetime, ok: bool, shape, args, root: Path,
                       env: dict) -> None:
    """Adds to `data` the parity times read from a tune's database (seconds since `launched_at`), and, when the
    tune succeeded with a winner, that winner served, checked and timed by a fresh process."""
    try:
        data.update(parity_from_db(db_url, launched_at))
    except Exception as exc:  # noqa: BLE001 - a damaged run is reported, the other shapes go on
        data["db_error"] = f"{type(exc).__name__}: {exc}"
    if ok and data.get("winner"):
        served, _ = _child_json("serve", shape, args, root / "served.json", env, MIN_CHILD_S * 4)
        data["served"] = served


def run_inprocess(shape, args, scratch: Path, timeout_s: float) -> dict:
    """autotile's tuner called in a fresh process that has started (child_inprocess), then the winner served."""
    root = scratch / "inprocess"
    root.mkdir(parents=True)
    db_url = f"sqlite:///{root / 'tune.sqlite'}"
    env = _env(root, AUTOTILE_CACHE_DIR=str(root / "kernels"), AUTOTILE_DB=db_url)
    data, _ = _child_json("inprocess", shape, args, root / "result.json", env, timeout_s)
    if data.get("tune_started_utc") and (root / "tune.sqlite").exists():
        # Seconds since the tuner was called: start-up is not counted, as Inductor's is not.
        _parity_and_served(data, db_url, datetime.datetime.fromisoformat(data["tune_started_utc"]), data["rc"] == 0,
                           shape, args, root, env)
    return data


def measure(args) -> list[dict]:
    """Each shape in turn: Inductor, autotile's CLI (tune, then serve), autotile in-process (tune, then serve). A
    shape starts only when the budget left holds as long as the shapes so far took on average."""
    shapes = [SMOKE_SHAPE] if args.smoke else args.shapes
    started = time.monotonic()
    rows, took = [], []
    with tempfile.TemporaryDirectory(prefix="autotile-ttw-") as scratch:
        for index, shape in enumerate(shapes):
            left = args.budget_s - (time.monotonic() - started)
            label = "x".join(map(str, shape))
            row = {"shape": list(shape), "label": label}
            rows.append(row)
            if left <= 0 or (took and statistics.mean(took) > left):
                row["skipped"] = f"budget of {args.budget_s:.0f} s too short for another shape"
                print(f"{label}: skipped, {row['skipped']}", file=sys.stderr, flush=True)
                continue
            begun = time.monotonic()
            shape_dir = Path(scratch) / f"shape{index}"
            if not args.smoke:
                print(f"{label}: Inductor {INDUCTOR_MODE} ...", file=sys.stderr, flush=True)
                row["inductor"] = run_inductor(shape, args, shape_dir, max(MIN_CHILD_S, left / 3))
                _say(label, "Inductor", row["inductor"])
            left = args.budget_s - (time.monotonic() - started)
            print(f"{label}: autotile tune ...", file=sys.stderr, flush=True)
            row["autotile"] = run_autotile(shape, args, shape_dir, max(MIN_CHILD_S, left / 2))
            _say(label, "autotile", row["autotile"])
            left = args.budget_s - (time.monotonic() - started)
            print(f"{label}: autotile in-process tune_problem ...", file=sys.stderr, flush=True)
            row["inprocess"] = run_inprocess(shape, args, shape_dir, max(MIN_CHILD_S, left))
            _say(label, "autotile in-process", row["inprocess"])
            took.append(time.monotonic() - begun)
    return rows


def _say(label: str, who: str, data: dict) -> None:
    failed = data.get("rc") != 0 or data.get("timed_out")
    if failed:
        print(f"{label}: {who} {'timed out' if data.get('timed_out') else 'failed'} (rc {data.get('rc')}):\n"
              + data.get("log_tail", "")[-1500:], file=sys.stderr, flush=True)
    else:
        keys = ("autotune_s", "kernel_ms", "parity_s", "total_s", "tune_s", "parity_by")
        print(f"{label}: {who} " + ", ".join(f"{k} {data[k]:.4g}" if isinstance(data.get(k), float)
                                             else f"{k} {data[k]}" for k in keys if k in data),
              file=sys.stderr, flush=True)


# --- the report --------------------------------------------------------------------------------------

def _num(value, fmt: str = ".1f") -> str:
    return "-" if value is None else format(value, fmt)


def _checked_ms(part: dict | None, key: str) -> str:
    if not part:
        return "-"
    check = part.get("check") or {}
    if check and not check.get("ok"):
        return "WRONG"
    return _num(part.get(key), ".4f")


def markdown(rows: list[dict], meta: dict) -> str:
    """The table (one row per shape) and the notes that say how each number came about."""
    lines = [
        f"# Time to a winner: autotile vs Inductor max-autotune ({meta['date']}, {meta['device']})", "",
        (f"GEMM x (M, K) @ weight (N, K).T, {meta['dtype']}, nn.Linear layout. autotile: `{meta['tune_command']}` "
         "in a fresh process with a fresh database and caches, from its launch (start-up counted). Inductor: "
         f"`torch.compile(F.linear, mode=\"{INDUCTOR_MODE}\")` in a fresh process with fresh caches, its first call "
         "(start-up not counted; shown apart). autotile in-process: `" + meta.get("inprocess_call", "tune_problem")
         + "` in a fresh process with a fresh database and caches, from the call (start-up not counted, as "
         "Inductor's is not; shown apart), its winner then served by another fresh process. Kernel times: medians "
         f"of do_bench medians over {meta['rounds']} interleaved rounds; every output checked against float64 "
         "first."), "",
        ("| M x N x K | Inductor autotune s | Inductor kernel ms | autotile to vendor parity s | autotile total s | "
         "served ms | F.linear ms | in-process to vendor parity s | in-process tune s | in-process served ms | "
         "in-process verdict | verdict |"),
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    notes, met, judged, met_in, judged_in = [], 0, 0, 0, 0
    for row in rows:
        if "skipped" in row:
            lines.append(f"| {row['label']} | skipped: {row['skipped']} | | | | | | | | | | |")
            continue
        ind, at, inp = row.get("inductor"), row.get("autotile") or {}, row.get("inprocess")
        served = at.get("served")
        ind_ok = bool(ind) and ind.get("rc") == 0 and (ind.get("check") or {}).get("ok")
        ind_s = ind.get("autotune_s") if ind_ok else None
        result = verdict(at.get("parity_s") if at.get("rc") == 0 else None, ind_s)
        judged += result != "n/a"
        met += result == "met"
        result_in = verdict((inp or {}).get("parity_s") if (inp or {}).get("rc") == 0 else None, ind_s)
        judged_in += result_in != "n/a"
        met_in += result_in == "met"
        in_cells = (f"{_num(inp.get('parity_s'))} | {_num(inp.get('tune_s'))} | "
                    f"{_checked_ms(inp.get('served'), 'served_ms')}" if inp else "not run | - | -")
        lines.append(f"| {row['label']} | {_num(ind_s) if ind else 'not run'} | {_checked_ms(ind, 'kernel_ms')} | "
                     f"{_num(at.get('parity_s'))} | {_num(at.get('total_s'))} | {_checked_ms(served, 'served_ms')} | "
                     f"{_checked_ms(served, 'flinear_ms')} | {in_cells} | {result_in} | {result} |")
        notes.append(_notes(row))
    lines += ["", f"Target met on {met} of {judged} shapes (autotile's time to vendor parity, start-up included, "
                  "at most Inductor's autotuning time)." if judged else "No shape could be judged (see the notes)."]
    if judged_in:
        lines.append(f"In-process: met on {met_in} of {judged_in} shapes (autotile's time to vendor parity from its "
                     "tune_problem call, at most Inductor's autotuning time from its first call: neither counts its "
                     "process start-up).")
    return "\n".join(lines + ["", "## Per shape", ""] + notes) + "\n"


def _notes(row: dict) -> str:
    ind, at = row.get("inductor"), row.get("autotile") or {}
    parts = [f"- **{row['label']}**"]
    if ind:
        if ind.get("rc") != 0:
            parts.append(f"  - Inductor {'timed out' if ind.get('timed_out') else 'failed'} (rc {ind.get('rc')})")
        else:
            tables = ind.get("autotune_tables") or []
            picked = "; ".join(f"{t['op']}: {t['picked']} of {t['num_choices'] or len(t['choices'])} choices"
                               + (f" (benchmarking {t['benchmark_s']:.1f} s, precompiling {t['precompile_s']:.1f} s)"
                                  if t["benchmark_s"] is not None else "") for t in tables) or "not printed"
            parts.append(f"  - Inductor: start-up {_num(ind.get('startup_s'))} s before the first call, which took "
                         f"{_num(ind.get('autotune_s'))} s; picked {picked}; F.linear beside it "
                         f"{_num(ind.get('flinear_ms'), '.4f')} ms; check: {(ind.get('check') or {}).get('message')}")
            if ind.get("startup_s") is not None and ind.get("autotune_s") is not None and at.get("rc") == 0:
                both = ind["startup_s"] + ind["autotune_s"]
                parts.append(f"  - with Inductor's process start-up counted too, as autotile's is: {both:.1f} s "
                             f"against {_num(at.get('parity_s'))} s: {verdict(at.get('parity_s'), both)}")
    parts += _tune_notes("autotile", at)
    inp = row.get("inprocess")
    if inp:
        if inp.get("rc") == 0 and inp.get("tune_s") is not None:
            parts.append(f"  - autotile in-process: start-up {_num(inp.get('startup_s'))} s (importing the tuner "
                         f"{_num(inp.get('import_tuner_s'))} s of it) before the tune_problem call, which returned "
                         f"after {_num(inp['tune_s'])} s with the winner stored; stopped early: "
                         f"{inp.get('stopped_early') or 'no'}; seconds below count from the call")
        parts += _tune_notes("autotile in-process", inp)
    return "\n".join(parts)


def _tune_notes(who: str, at: dict) -> list[str]:
    """A tuning run's lines of the notes: its trials, the vendor op, parity, the winner and how it served."""
    parts = []
    if at.get("rc") != 0:
        parts.append(f"  - {who} tune {'timed out' if at.get('timed_out') else 'failed'} (rc {at.get('rc')})")
    if "db_error" in at:
        parts.append(f"  - {who} database unreadable: {at['db_error']}")
    if "trials" in at:
        winner = at.get("winner") or {}
        config = winner.get("config") or {}
        name = f"vendor op ({config['VENDOR']})" if "VENDOR" in config else "generated kernel"
        parts.append(
            f"  - {who}: {at['trials']} trials ({at['trials_ok']} ok), first recorded at {_num(at['first_trial_s'])} s, "
            f"last at {_num(at['last_trial_s'])} s; best trial {_num(at['best_trial_ms'], '.4f')} ms, vendor op "
            f"{_num(at['vendor_ms'], '.4f')} ms (final re-timing, at {_num(at['vendor_timed_s'])} s; first timed at "
            f"{_num(at.get('vendor_first_s'))} s); winner stored at {_num(winner.get('saved_s'))} s; parity by "
            f"{at['parity_by']}; winner: {name}, {_num(winner.get('median_ms'), '.4f')} ms")
    served = at.get("served")
    if served:
        label = "served" if who == "autotile" else f"{who} winner served"
        parts.append(f"  - {label}: source {served.get('source')} ({served.get('match')}), vendor "
                     f"{served.get('vendor')}; check: {(served.get('check') or {}).get('message')}"
                     + (f", {_num(served.get('served_ms'), '.4f')} ms beside F.linear "
                        f"{_num(served.get('flinear_ms'), '.4f')} ms" if who != "autotile" else "")
                     + (" (CPU interpreter timings)" if served.get("interpreted") else ""))
    return parts


def write_report(out: Path, text: str, rows: list[dict], meta: dict) -> tuple[Path, Path]:
    """markdown to `out` (a .md file, or a folder that gets time_to_winner.md), JSON beside it."""
    md = out / "time_to_winner.md" if out.is_dir() or not out.suffix else out
    md.parent.mkdir(parents=True, exist_ok=True)
    md.write_text(text)
    raw = md.with_suffix(".json")
    raw.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2, default=str) + "\n")
    return md, raw


def _shape(text: str) -> tuple[int, int, int]:
    parts = text.lower().split("x")
    if len(parts) != 3 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"{text!r}: give a shape as MxNxK, e.g. 3000x5000x1536")
    return tuple(int(p) for p in parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="markdown file (or folder) to write; JSON goes beside it")
    parser.add_argument("--quick", action="store_true", help="3 shapes, --trials 12 --patience 4: ~5 minutes")
    parser.add_argument("--smoke", action="store_true", help="autotile halves only, CPU interpreter, a tiny shape")
    parser.add_argument("--shapes", type=lambda s: [_shape(p) for p in s.split(",")], default=None,
                        help="comma-separated MxNxK (default: the quick or full list)")
    parser.add_argument("--trials", type=int, default=None)
    parser.add_argument("--patience", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=TIMING_ROUNDS, help="interleaved timing rounds")
    parser.add_argument("--budget-s", type=float, default=None, help="no shape starts after this many seconds")
    parser.add_argument("--dtype", default=None, help="bf16 (default; fp16 under --smoke)")
    # The child processes (launched by this script itself).
    parser.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    parser.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--m", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--k", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--launched-at", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--interpret", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.child:
        result = CHILDREN[args.child](args)
        args.child_out.write_text(json.dumps(result, default=str))
        return 0

    if args.out is None:
        parser.error("--out is required: a markdown file or a folder for the report")
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    trials, patience = TUNE_SETTINGS[mode]
    args.trials, args.patience = args.trials or trials, args.patience or patience
    args.budget_s = args.budget_s or BUDGET_S[mode]
    args.dtype = args.dtype or ("fp16" if args.smoke else "bf16")  # NOTE: the interpreter's bf16 dot is unreliable
    args.shapes = args.shapes or (QUICK_SHAPES if args.quick else SHAPES)
    import torch

    if not args.smoke and not torch.cuda.is_available():
        print("no CUDA GPU here: run on a GPU machine, or pass --smoke to check the script on the CPU interpreter",
              file=sys.stderr)
        return 1
    meta = {"date": datetime.date.today().isoformat(), "mode": mode, "dtype": args.dtype, "rounds": args.rounds,
            "device": "Triton CPU interpreter (smoke: no Inductor, CPU timings)" if args.smoke else "CUDA GPU",
            "torch": torch.__version__, "trials": args.trials, "patience": args.patience,
            "tune_command": f"autotile tune gemm --m M --n N --k K --dtype {args.dtype} --layout-b col "
                            f"--trials {args.trials} --patience {args.patience}"
                            + (" --gpu interpret" if args.smoke else ""),
            "inprocess_call": f"tune_problem(gemm, problem, device, trials={args.trials}, patience={args.patience}, "
                              "seed=0, isolate=False)"}
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        pass
    rows = measure(args)
    # The device's name from a child: this process creates no CUDA context beside the measured ones.
    named = [r["inductor"]["device"] for r in rows if (r.get("inductor") or {}).get("device")]
    meta["device"] = named[0] if named else meta["device"]
    text = markdown(rows, meta)
    md, raw = write_report(args.out, text, rows, meta)
    print(text)
    print(f"wrote {md} and {raw}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
