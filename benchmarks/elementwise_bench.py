"""Fused elementwise chains on the GPU: autotile's tuned kernel beside eager torch and torch.compile.

    PYTHONPATH=. python benchmarks/elementwise_bench.py --budget-s 150 --out OUT_DIR

1. Correctness on the GPU first (fp32, bf16, fp16, fp64, broadcasting, non-contiguous, several outputs):
   failures are reported and do not stop the run.
2. The device-to-device copy bandwidth, measured in the same run (the ceiling of these kernels).
3. Each anchor chain of shared/anchors/README.md (2^28 elements, fp32 and bf16) and a three-input
   chain is tuned with autotile.tune.driver.tune_problem into OUT_DIR/elementwise.sqlite (or, where
   that API is missing or fails, a few candidate configs are timed), inside --budget-s.
4. The winner is timed side by side with eager torch and torch.compile: interleaved rounds of
   triton.testing.do_bench on random non-zero data, medians. The markdown table is printed last and
   written to OUT_DIR/elementwise_bench.md; raw rows go to OUT_DIR/elementwise_bench.jsonl.
One failing chain never aborts the others.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import triton
import triton.testing

from autotile.device import cuda_device
from autotile.expr import evaluate, parse
from autotile.families.elementwise import ANCHOR_CHAINS, ANCHOR_NUMEL, FAMILY, THREE_INPUT_CHAIN
from autotile.space import Config

# do_bench settings: warm-up and measuring time per call (ms), and the quantiles kept.
WARMUP_MS, REP_MS = 25, 100
QUANTILES = (0.2, 0.5, 0.8)
# Interleaved rounds of the final comparison; the median of the rounds' medians is reported.
FINAL_ROUNDS = 5


def log(message: str) -> None:
    print(message, flush=True)


def bench_ms(fn) -> tuple[float, float, float]:
    q20, q50, q80 = triton.testing.do_bench(fn, warmup=WARMUP_MS, rep=REP_MS, quantiles=list(QUANTILES))
    return float(q20), float(q50), float(q80)


# --- 1. correctness ------------------------------------------------------------------------

def _check_call(expr: str, values: dict) -> str | None:
    """Run autotile.fuse on CUDA tensors and compare with the float64 reference; None when it matches."""
    import autotile

    fused = autotile.fuse(expr)(**values)
    expression = parse(expr)
    outputs = dict(zip(expression.output_names, fused if isinstance(fused, tuple) else (fused,)))
    problem = FAMILY.problem_from_values(expression, values)
    result = FAMILY.check(problem, values, outputs, FAMILY.reference(problem, values))
    return None if result.ok else result.message


def correctness(dev: torch.device) -> list[tuple[str, str]]:
    g = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=g, device=dev).to(dtype)

    specials = torch.tensor([math.nan, math.inf, -math.inf, 0.0, -0.0, 1.0, -1.0, 0.5, 2.0, -3.0, 20.0, -100.0],
                            device=dev)
    cases = []
    for chain in ANCHOR_CHAINS + (THREE_INPUT_CHAIN,):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            names = parse(chain).inputs
            cases.append((f"{chain} {dtype} 2^20+3", chain, {n: rnd(2**20 + 3, dtype=dtype) for n in names}))
    every_op = ("exp(x) + log(abs(x)) + sqrt(abs(x)) + rsqrt(abs(x) + 1) + tanh(x) + sigmoid(x) + relu(x) "
                "+ gelu(x) + gelu_tanh(x) + silu(x) + abs(x) ** 1.5 + maximum(x, -x * 0.5) + minimum(x, 0.25) "
                "+ where(x > 0.1, x, -x) / 3")
    cases += [
        ("every op fp32", every_op, {"x": rnd(4099)}),
        ("every op fp64", every_op, {"x": rnd(4099, dtype=torch.float64)}),
        ("nan/inf unary", "exp(x) + tanh(x) + sigmoid(x) + sqrt(x) + log(x) + relu(x) + silu(x) + gelu(x)", {"x": specials}),
        ("nan/inf binary", "maximum(x, y) + minimum(x, y) + x ** y + x / y",
         {"x": specials.repeat(12), "y": specials.repeat_interleave(12)}),
        ("broadcast row x column", "x * y + sin(x)", {"x": rnd(513, 1), "y": rnd(1, 1031)}),
        ("broadcast bf16 bias + scalar", "gelu(x + b) * a", {"x": rnd(64, 4096, dtype=torch.bfloat16), "b": rnd(4096, dtype=torch.bfloat16), "a": 0.5}),
        ("non-contiguous transpose", "x * sigmoid(y)", {"x": rnd(4096, 1000).t(), "y": rnd(1000, 4096)}),
        ("non-contiguous slice", "silu(x) * x", {"x": rnd(2048, 4096)[::2, 7:3000]}),
        ("mixed i32 + fp16 + bool", "where(m, i * h, i / 4)", {"i": torch.randint(-9, 10, (100003,), device=dev, dtype=torch.int32),
                                                             "h": rnd(100003, dtype=torch.float16), "m": rnd(100003) > 0}),
        ("several outputs", "a = x * y; b = a + z", {n: rnd(1 << 20) for n in "xyz"}),
        ("sizes 1 and 17", "sin(x) ** 2 + y", {"x": rnd(17), "y": rnd(1)}),
    ]
    failures = []
    for name, expr, values in cases:
        try:
            message = _check_call(expr, values)
        except Exception as exc:  # noqa: BLE001 - report every failure, keep going
            message = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
        log(f"  {'ok  ' if message is None else 'FAIL'} {name}" + ("" if message is None else f": {message[:400]}"))
        if message is not None:
            failures.append((name, message))
    torch.cuda.synchronize()
    return failures


# --- 2. copy bandwidth -----------------------------------------------------------------------

def copy_bandwidth(dev: torch.device) -> float:
    src = torch.randn(ANCHOR_NUMEL, device=dev)
    dst = torch.empty_like(src)
    _, ms, _ = bench_ms(lambda: dst.copy_(src))
    del src, dst
    return 2 * ANCHOR_NUMEL * 4 / (ms * 1e-3) / 1e12


# --- 3. tuning -----------------------------------------------------------------------------

def tune(problem, device, seconds: float, db_url: str, retime_rounds: int) -> tuple[Config, str]:
    """The tuned winner and how it was found (every candidate failing is an error for this chain)."""
    from autotile.tune.driver import tune_problem

    result = tune_problem(FAMILY, problem, device, trials=200, timeout=seconds, db_url=db_url, seed=0,
                          retime_rounds=retime_rounds)
    if result.winner is None:
        raise RuntimeError(f"no config passed the correctness check: {result.statuses}")
    return result.winner, "optuna"


# --- 4. side by side -------------------------------------------------------------------------

def side_by_side(problem, config: Config, device) -> dict:
    """Median ms of autotile, eager torch and torch.compile, interleaved over FINAL_ROUNDS rounds."""
    inputs = FAMILY.make_inputs(problem, device, seed=7)
    plan = FAMILY.plan(problem)
    values = {n: inputs[n].item() if plan.specs[n].kind == "scalar" else inputs[n] for n in plan.expression.inputs}
    outputs = FAMILY.allocate_outputs(problem, inputs)
    out_list = [outputs[n] for n in plan.expression.output_names]
    launch = FAMILY.launch_plan(problem, config, inputs)
    expression = plan.expression
    compiled_fn = torch.compile(lambda **kw: evaluate(expression, kw), dynamic=False)
    fns = {
        "autotile": lambda: FAMILY.run(plan, launch, values, out_list),
        "eager": lambda: evaluate(expression, values),
        "compile": lambda: compiled_fn(**values),
    }
    for fn in fns.values():  # compile, and check that every contender runs
        fn()
    torch.cuda.synchronize()
    check = FAMILY.check(problem, inputs, outputs, FAMILY.reference(problem, inputs))
    samples: dict[str, list[float]] = {k: [] for k in fns}
    spread: dict[str, list[tuple[float, float]]] = {k: [] for k in fns}
    for _ in range(FINAL_ROUNDS):
        for name, fn in fns.items():
            q20, q50, q80 = bench_ms(fn)
            samples[name].append(q50)
            spread[name].append((q20, q80))
    result = {k: statistics.median(v) for k, v in samples.items()}
    result["spread"] = {k: [min(a for a, _ in v), max(b for _, b in v)] for k, v in spread.items()}
    result["check"] = check.message
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget-s", type=float, default=150.0, help="wall-clock budget of the whole run")
    parser.add_argument("--out", type=Path, required=True, help="folder for the table, raw rows and the winners database")
    parser.add_argument("--retime-rounds", type=int, default=2, help="interleaved re-timing rounds of the tuner's finalists")
    parser.add_argument("--skip-correctness", action="store_true")
    parser.add_argument("--only", default="", help="time only the chains whose expression contains this text")
    parser.add_argument("--dtypes", default="fp32,bf16", help="input dtypes of the timed chains, comma-separated")
    args = parser.parse_args()
    started = time.monotonic()
    deadline = started + args.budget_s
    args.out.mkdir(parents=True, exist_ok=True)
    db_url = f"sqlite:///{args.out.resolve()}/elementwise.sqlite"
    if not torch.cuda.is_available():
        log("no CUDA GPU: this benchmark runs on the GPU only")
        return 2
    dev = torch.device("cuda")
    device = cuda_device(0)
    log(f"device {device.name} ({device.key}), torch {torch.__version__}, triton {triton.__version__}")

    failures = []
    if not args.skip_correctness:
        log("correctness on the GPU:")
        failures = correctness(dev)
    copy_tbps = copy_bandwidth(dev)
    log(f"copy bandwidth: {copy_tbps:.2f} TB/s (read + write, fp32, 2^28 elements)")

    chains = [(expr, dtype) for expr in ANCHOR_CHAINS + (THREE_INPUT_CHAIN,) if args.only in expr
              for dtype in args.dtypes.split(",")]
    problems = [FAMILY.problem_for_expression(expr, dtype) for expr, dtype in chains]
    # Each problem's final comparison (three compiles of a 2^28 chain and the interleaved rounds) takes
    # about 10 s; what is left before that is shared by the tuning of every problem.
    final_s = 10.0 * len(problems)
    per_problem = max(5.0, (deadline - time.monotonic() - final_s) / len(problems))
    rows = []
    for (expr, dtype), problem in zip(chains, problems):
        row = {"chain": expr, "dtype": dtype, "problem_key": FAMILY.problem_key(problem),
               "numel": problem.numel, "bytes": FAMILY.cost(problem).bytes}
        rows.append(row)
        label = f"{expr} [{dtype}]"
        try:
            remaining = deadline - time.monotonic() - 10.0 * (len(problems) - len(rows) + 1)
            seconds = min(per_problem, max(3.0, remaining))
            log(f"tuning {label} for up to {seconds:.0f} s")
            config, how = tune(problem, device, seconds, db_url, args.retime_rounds)
            row.update(config=dict(config), tuned_by=how)
            timing = side_by_side(problem, config, device)
            row.update(timing)
            for name in ("autotile", "eager", "compile"):
                row[f"{name}_tbps"] = row["bytes"] / (timing[name] * 1e-3) / 1e12
            row["pct_copy"] = 100.0 * row["autotile_tbps"] / copy_tbps
            row["vs_compile"] = timing["compile"] / timing["autotile"]
            log(f"  {label}: autotile {row['autotile_tbps']:.2f} TB/s ({row['pct_copy']:.0f}% of copy), "
                f"torch.compile {row['compile_tbps']:.2f}, eager {row['eager_tbps']:.2f}; {timing['check']}")
        except Exception as exc:  # noqa: BLE001 - one failing chain must not abort the rest
            row["error"] = f"{type(exc).__name__}: {exc}"
            log(f"  {label} FAILED: {row['error']}")
            traceback.print_exc()
        torch.cuda.empty_cache()

    with open(args.out / "elementwise_bench.jsonl", "w") as handle:
        for row in rows:
            handle.write(json.dumps({**row, "copy_tbps": copy_tbps}) + "\n")
    table = render_table(rows, copy_tbps, device, failures, time.monotonic() - started)
    (args.out / "elementwise_bench.md").write_text(table)
    log("")
    log(table)
    return 0


def render_table(rows: list[dict], copy_tbps: float, device, failures: list, elapsed: float) -> str:
    lines = [
        "# Fused elementwise chains: autotile vs eager torch vs torch.compile",
        "",
        f"{device.name} ({device.key}), {datetime.date.today().isoformat()}, torch {torch.__version__}, "
        f"triton {triton.__version__}. 2^28 elements, random N(0,1) data; median of {FINAL_ROUNDS} interleaved "
        f"rounds of triton.testing.do_bench (L2 flushed). TB/s counts each input read once and each output "
        f"written once. Copy bandwidth measured in the same run: {copy_tbps:.2f} TB/s. Run took {elapsed:.0f} s.",
        "",
        "| chain | dtype | eager TB/s | torch.compile TB/s | autotile TB/s | % of copy | vs torch.compile | config |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        if "error" in row:
            lines.append(f"| `{row['chain']}` | {row['dtype']} | | | failed: {row['error'][:120]} | | | |")
            continue
        config = row["config"]
        shown = (f"{config['BLOCK_SIZE']} w{config['num_warps']} s{config['num_stages']}"
                 + (f" persistent x{config['PROGRAMS_PER_SM']}" if config["PERSISTENT"] else "")
                 + (" streaming" if config["STREAMING"] else "") + f" ({row['tuned_by']})")
        lines.append(f"| `{row['chain']}` | {row['dtype']} | {row['eager_tbps']:.2f} | {row['compile_tbps']:.2f} | "
                      f"{row['autotile_tbps']:.2f} | {row['pct_copy']:.0f}% | {row['vs_compile']:.2f}x | {shown} |")
    lines.append("")
    if failures:
        lines.append(f"GPU correctness failures ({len(failures)}):")
        lines += [f"- {name}: {message[:300]}" for name, message in failures]
    else:
        lines.append("GPU correctness: every case matched the float64 reference.")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
