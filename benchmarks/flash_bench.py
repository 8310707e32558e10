"""FlashAttention on the GPU: correctness first, then the anchor shapes side by side.

    PYTHONPATH=. python benchmarks/flash_bench.py --budget-s 300 --out OUT

1. Checks the family on the GPU against float64 torch with FlashAttention's rule: forward and
   dQ/dK/dV, bf16 and fp16, 1x1, 113x203, 799x3, GQA 8:2, MQA, causal with Sq != Sk both ways,
   head dims 64/96/128/256, the pointer and TMA (+ warp specialised) forward variants, the fp8
   forward; then the public op under autograd and under torch.compile.
2. Tunes each anchor shape of shared/anchors/README.md (forward at five shapes, backward at
   B=2, H=32, S=4096, D=128; causal and not; bf16) with autotile.tune.driver.tune_problem into
   OUT/flash.sqlite, the trials sized so the whole run ends inside --budget-s.
3. Times the winner beside SDPA's flash backend, SDPA's cuDNN backend and FlexAttention
   (torch.compile), interleaved, medians of triton.testing.do_bench on random data; prints a
   markdown table last and writes it to OUT/flash_bench.md. TFLOP/s count 4*B*H*S*S*D for the
   forward, half of it when causal, and 2.5 times the forward for the backward.
A failing check or shape is reported and the run goes on.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import statistics
import time
import traceback
from pathlib import Path

import torch
import triton
import triton.testing

from autotile.device import cuda_device
from autotile.families.flash import FAMILY, FlashProblem, attention_grads, attention_math, default_scale, fa_rule_check
from autotile.space import Config

# (B, H, S, D) of the attention rows of shared/anchors/README.md, each causal and not.
FORWARD_ANCHORS = ((4, 32, 1024, 128), (2, 32, 4096, 128), (1, 32, 16384, 128), (2, 32, 4096, 64), (1, 16, 8192, 256))
BACKWARD_ANCHORS = ((2, 32, 4096, 128),)
# Targets of issue 3: forward >= 1.0x SDPA flash everywhere and >= 0.9x cuDNN at D=128, S >= 4k;
# backward >= 1.0x SDPA flash.
FLASH_TARGET = 1.0
CUDNN_TARGET = 0.9
# Seconds kept per shape for the side-by-side timing (FlexAttention compiles once per shape).
TIMING_RESERVE_S = 20.0
# Rounds of the interleaved side-by-side timing.
ROUNDS = 5


def log(message: str) -> None:
    print(message, flush=True)


# --- 1. correctness ---------------------------------------------------------------------------------

def correctness_cases() -> list[tuple[str, FlashProblem, dict | None]]:
    tma = dict(LOADS="tma", BLOCK_M=128, BLOCK_N=64, WARP_SPECIALIZE=False, num_warps=8, num_stages=3)
    tma_ws = dict(LOADS="tma", BLOCK_M=128, BLOCK_N=128, WARP_SPECIALIZE=True, num_warps=8, num_stages=2)
    shapes = [
        ("1x1 D=64", (1, 1, 1, 1, 1, 64)),
        ("113x203 D=128", (2, 4, 4, 113, 203, 128)),
        ("799x3 D=96", (1, 2, 2, 799, 3, 96)),
        ("GQA 8:2 1000x1000 D=128", (2, 8, 2, 1000, 1000, 128)),
        ("MQA 8:1 257x511 D=256", (1, 8, 1, 257, 511, 256)),
        ("Sq>Sk 700x300 D=64", (2, 4, 2, 700, 300, 64)),
    ]
    cases = []
    for dtype, dtype_shapes in (("bf16", shapes), ("fp16", shapes[1:4])):  # fp16 on fewer shapes, to save time
        for label, shape in dtype_shapes:
            for direction in ("fwd", "bwd"):
                for causal in (False, True):
                    name = f"{dtype} {direction} {'causal ' if causal else ''}{label}"
                    cases.append((name, FlashProblem(direction, *shape, causal=causal, dtype=dtype), None))
    for causal in (False, True):
        anchor = FlashProblem("fwd", 2, 32, 32, 1000, 1000, 128, causal=causal)
        cases.append((f"bf16 fwd {'causal ' if causal else ''}TMA", anchor, tma))
        cases.append((f"bf16 fwd {'causal ' if causal else ''}TMA + warp specialised", anchor, tma_ws))
        cases.append((f"fp8 fwd {'causal ' if causal else ''}300x1030 GQA", FlashProblem("fwd", 2, 8, 2, 300, 1030, 128, causal, "fp8"), None))
        cases.append((f"fp8 fwd {'causal ' if causal else ''}TMA", dataclasses.replace(anchor, dtype="fp8"), tma))
    return cases


def check_family_case(name: str, problem: FlashProblem, config: dict | None, device) -> str | None:
    config = Config(config) if config is not None else FAMILY.default_config(problem, device)
    violations = FAMILY.space(problem, device).violations(config)
    if violations:
        return f"{name}: config outside the space: {violations}"
    inputs = FAMILY.make_inputs(problem, device, seed=11)
    outputs = FAMILY.allocate_outputs(problem, inputs)
    for t in outputs.values():
        t.fill_(float("nan"))
    FAMILY.launch(problem, config, inputs, outputs)
    torch.cuda.synchronize()
    result = FAMILY.check(problem, inputs, outputs, FAMILY.reference(problem, inputs))
    log(f"  {'ok  ' if result.ok else 'FAIL'} {name} {config.to_json()}: {result.message}")
    return None if result.ok else f"{name}: {result.message}"


def check_op(compiled: bool) -> str | None:
    """The public op on CUDA, bf16 GQA causal with Sq != Sk and (B, S, H, D) storage, through autograd."""
    import autotile

    gen = torch.Generator(device="cuda").manual_seed(7)

    def leaf(b, s, h, d):
        return torch.randn(b, s, h, d, device="cuda", generator=gen).bfloat16().transpose(1, 2).requires_grad_(True)

    q, k, v = leaf(2, 300, 8, 128), leaf(2, 555, 2, 128), leaf(2, 555, 2, 128)
    fn = torch.compile(autotile.flash_attention, fullgraph=True) if compiled else autotile.flash_attention
    out = fn(q, k, v, causal=True)
    do = torch.randn(out.shape, device="cuda", generator=gen).bfloat16()
    grads = torch.autograd.grad(out, (q, k, v), do)
    scale = default_scale(128)
    ref = attention_math(*(t.detach().double() for t in (q, k, v)), causal=True, scale=scale, dtype=torch.float64)
    plain = attention_math(q.detach(), k.detach(), v.detach(), causal=True, scale=scale, dtype=torch.bfloat16)
    ref_grads = attention_grads(*(t.detach().double() for t in (q, k, v)), do.double(), causal=True, scale=scale, dtype=torch.float64)
    plain_grads = attention_grads(q.detach(), k.detach(), v.detach(), do, causal=True, scale=scale, dtype=torch.bfloat16)
    failures = []
    label = "op under torch.compile" if compiled else "op"
    for name, got, want, base, reduction in [("o", out, ref, plain, 555)] + [
            (n, g, w, b, 555 if n == "dq" else 4 * 300) for n, g, w, b in zip(("dq", "dk", "dv"), grads, ref_grads, plain_grads)]:
        result = fa_rule_check(name, got, want, base, "bf16", reduction)
        log(f"  {'ok  ' if result.ok else 'FAIL'} {label}: {result.message}")
        if not result.ok:
            failures.append(f"{label}: {result.message}")
    return "; ".join(failures) or None


def run_checks(device) -> list[str]:
    failures = []
    checks = [(name, lambda n=name, p=problem, c=config: check_family_case(n, p, c, device))
              for name, problem, config in correctness_cases()]
    checks += [("op", lambda: check_op(False)), ("op under torch.compile", lambda: check_op(True))]
    for name, check in checks:
        try:
            failure = check()
        except Exception as exc:  # one failing case must not stop the others
            failure = f"{name}: {type(exc).__name__}: {str(exc)[:500]}"
            log(f"  FAIL {failure}\n{traceback.format_exc(limit=4)}")
        if failure:
            failures.append(failure)
        torch.cuda.empty_cache()
    return failures


# --- 2. tuning --------------------------------------------------------------------------------------

def time_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, quantiles=[0.5, 0.2, 0.8])[0]


def tune_shape(problem: FlashProblem, device, seconds: float, out: Path) -> tuple[Config, str]:
    """The winner config and how it was found (every candidate failing is an error for this shape)."""
    from autotile.tune.driver import tune_problem

    result = tune_problem(FAMILY, problem, device, trials=200, timeout=seconds,
                          db_url=f"sqlite:///{out}/flash.sqlite", seed=0)
    if result.winner is None:
        raise RuntimeError(f"no config passed the correctness check: {result.statuses}")
    return result.winner, f"tuned: {result.trials_this_run} trials, statuses {result.statuses}"


# --- 3. side by side --------------------------------------------------------------------------------

def competitors(problem: FlashProblem, inputs) -> dict:
    """SDPA flash, SDPA cuDNN and FlexAttention on the same tensors: forward, or backward only."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    p = problem
    f = torch.nn.functional
    scale = default_scale(p.head_dim)
    backward = p.direction == "bwd"
    q, k, v = (inputs[n].detach().clone().requires_grad_(backward) for n in "qkv")
    impls = {}
    for name, backend in (("SDPA flash", SDPBackend.FLASH_ATTENTION), ("SDPA cuDNN", SDPBackend.CUDNN_ATTENTION)):
        def forward(backend=backend):
            with sdpa_kernel([backend]):
                return f.scaled_dot_product_attention(q, k, v, is_causal=p.causal, scale=scale,
                                                      enable_gqa=p.heads_q != p.heads_kv)
        impls[name] = forward
    block_mask = None
    if p.causal:
        diag = p.seq_k - p.seq_q
        block_mask = create_block_mask(lambda b, h, i, j: j <= i + diag, None, None, p.seq_q, p.seq_k, device="cuda")
    flex = torch.compile(flex_attention)
    impls["FlexAttention"] = lambda: flex(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=p.heads_q != p.heads_kv)
    ready = {}
    for name, forward in impls.items():
        try:
            out = forward()
            if backward:
                do = inputs["do"]
                ready[name] = lambda out=out, do=do: torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
                ready[name]()
            else:
                ready[name] = forward
        except Exception as exc:  # a backend that refuses this shape is reported, not fatal
            log(f"  {name} unavailable: {type(exc).__name__}: {str(exc)[:200]}")
    return ready


def side_by_side(problem: FlashProblem, config: Config, device) -> dict[str, float]:
    inputs = FAMILY.make_inputs(problem, device, seed=21)
    outputs = FAMILY.allocate_outputs(problem, inputs)
    impls = {"autotile": lambda: FAMILY.launch(problem, config, inputs, outputs)}
    impls.update(competitors(problem, inputs))
    samples: dict[str, list[float]] = {name: [] for name in impls}
    for _ in range(ROUNDS):  # interleaved: drift on the lent GPU hits every implementation alike
        for name, fn in impls.items():
            samples[name].append(time_ms(fn))
    result = {name: statistics.median(ms) for name, ms in samples.items()}
    result["spread"] = max((max(ms) - min(ms)) / statistics.median(ms) for ms in samples.values())
    return result


def tflops(problem: FlashProblem, ms: float | None) -> float | None:
    return None if ms is None else FAMILY.cost(problem).flops / (ms * 1e-3) / 1e12


def targets(problem: FlashProblem) -> list[tuple[str, float]]:
    wanted = [("SDPA flash", FLASH_TARGET)]
    if problem.direction == "fwd" and problem.head_dim == 128 and problem.seq_q >= 4096:
        wanted.append(("SDPA cuDNN", CUDNN_TARGET))
    return wanted


def render_table(rows: list[dict], failures: list[str], device) -> str:
    def cell(x, fmt="{:.0f}"):
        return "n/a" if x is None else fmt.format(x)

    lines = [
        "# FlashAttention on the H200: autotile vs SDPA and FlexAttention",
        "",
        f"Device: {device.name} ({device.sm_count} SMs), {datetime.date.today().isoformat()}; "
        f"torch {torch.__version__}, triton {triton.__version__}. bf16, random normal data. TFLOP/s: forward "
        f"4*B*H*S*S*D (pairs under the diagonal when causal), backward 2.5x that; medians of {ROUNDS} interleaved "
        "triton.testing.do_bench runs. Backward columns time the backward pass alone.",
        "",
        "| pass | B, H, S, D | causal | autotile | SDPA flash | SDPA cuDNN | FlexAttention | / flash | / cuDNN "
        "| target | spread | winner config |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        p = row["problem"]
        shape = f"{p.batch}, {p.heads_q}, {p.seq_q}, {p.head_dim}"
        head = f"| {p.direction} | {shape} | {'yes' if p.causal else 'no'} "
        if "error" in row:
            lines.append(head + f"| error: {row['error']} | | | | | | | | |")
            continue
        ours = row.get("autotile")
        ratios = {name: (ours / row[name] if ours and row.get(name) else None) for name in ("SDPA flash", "SDPA cuDNN")}
        verdicts = []
        for name, ratio_wanted in targets(p):
            met = ratios[name] is not None and ratios[name] >= ratio_wanted
            verdicts.append(f">= {ratio_wanted}x {name.split()[1]}: {'met' if met else 'MISSED'}")
        lines.append(
            head + f"| {cell(ours)} | {cell(row.get('SDPA flash'))} | {cell(row.get('SDPA cuDNN'))} "
            f"| {cell(row.get('FlexAttention'))} | {cell(ratios['SDPA flash'], '{:.2f}x')} "
            f"| {cell(ratios['SDPA cuDNN'], '{:.2f}x')} | {'; '.join(verdicts)} | {cell(row.get('spread'), '{:.0%}')} "
            f"| `{row['config']}` ({row['how']}) |")
    lines += ["", f"Correctness on the GPU: {'all checks passed' if not failures else f'{len(failures)} FAILED'}."]
    lines += [f"- {f}" for f in failures]
    return "\n".join(lines) + "\n"


def anchor_problems() -> list[FlashProblem]:
    problems = []
    for direction, shapes in (("bwd", BACKWARD_ANCHORS), ("fwd", FORWARD_ANCHORS)):
        for b, h, s, d in shapes:
            for causal in (False, True):
                problems.append(FlashProblem(direction, b, h, h, s, s, d, causal, "bf16"))
    return problems


# --only groups: the shapes behind one target each.
GROUPS = {
    "bwd": lambda p: p.direction == "bwd",
    "cudnn": lambda p: p.direction == "fwd" and p.head_dim == 128 and p.seq_q >= 4096,
    "fwd": lambda p: p.direction == "fwd",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-s", type=float, default=300.0, help="wall-clock budget of the whole run")
    parser.add_argument("--out", type=Path, default=Path("."), help="folder for flash.sqlite and flash_bench.md")
    parser.add_argument("--skip-checks", action="store_true", help="go straight to tuning and timing")
    parser.add_argument("--only", default="", help=f"comma-separated groups of shapes to run, of {sorted(GROUPS)}")
    args = parser.parse_args()
    start = time.time()
    args.out.mkdir(parents=True, exist_ok=True)
    device = cuda_device()
    failures = []
    if not args.skip_checks:
        log(f"== {device.name}: correctness checks")
        failures = run_checks(device)
        log(f"  checks took {time.time() - start:.0f} s, {len(failures)} failed")

    rows = []
    problems = anchor_problems()
    if args.only:
        groups = [GROUPS[g] for g in args.only.split(",")]
        problems = [p for p in problems if any(g(p) for g in groups)]
    for index, problem in enumerate(problems):
        left = args.budget_s - (time.time() - start)
        shapes_left = len(problems) - index
        seconds = max(3.0, left / shapes_left - TIMING_RESERVE_S)
        log(f"== {problem}: tuning for {seconds:.0f} s")
        row: dict = {"problem": problem}
        try:
            config, how = tune_shape(problem, device, seconds, args.out)
            row.update(config=config.to_json(), how=how)
            log(f"  winner {config.to_json()} ({how})")
            timings = side_by_side(problem, config, device)
            for name, value in timings.items():
                row[name] = tflops(problem, value) if name != "spread" else value
            log("  " + ", ".join(f"{k}: {v:.3f} ms" for k, v in timings.items() if k != "spread")
                + f" (spread {timings['spread']:.1%})")
        except Exception as exc:  # one failing shape must not abort the rest
            row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            log(f"  FAILED: {row['error']}\n{traceback.format_exc(limit=5)}")
        rows.append(row)
        torch.cuda.empty_cache()
        # Written after every shape, so a run stopped at its time limit keeps what it measured.
        (args.out / "flash_bench.md").write_text(render_table(rows, failures, device))

    table = render_table(rows, failures, device)
    (args.out / "flash_bench.md").write_text(table)
    raw = [{k: (v if not isinstance(v, FlashProblem) else dataclasses.asdict(v)) for k, v in row.items()} for row in rows]
    (args.out / "flash_bench.json").write_text(json.dumps({"rows": raw, "failures": failures}, indent=1, default=str))
    log(f"== done in {time.time() - start:.0f} s\n")
    print(table)


if __name__ == "__main__":
    main()
