"""The A100's and the L40S's search spaces run on the H200: their defaults and seeds compiled for sm80 / sm89.

    PYTHONPATH=. python benchmarks/arch_check.py --quick --out OUT/arch_check.md   # ~1 minute on an H200
    PYTHONPATH=. python benchmarks/arch_check.py --out OUT/arch_check.md           # every seed, ~5 minutes

No A100 or L40S is lent, so `autotile tune ... --gpu a100` has only been planned (`--dry-run`) and
cross-compiled (tests/test_xcompile.py). Here each family's default config, and a few seeds, of the spaces
`autotile.device.planned_device("a100")` and `("l40s")` give a few representative problems
(autotile.xcompile.representative_problems) are compiled for sm80 / sm89 from the launch's real arguments and
run on this GPU through their PTX (autotile.xcompile.run_as: the driver compiles that PTX for the H200, so
the code is the older GPU's: mma.sync tiles and cp.async pipelines, no TMA or wgmma). Every output is first
filled with NaN, then compared with the family's float32/float64 torch reference and tolerance. A config
that fails is also run as compiled for the H200 itself, to tell a wrong config from a wrong older-GPU path.

Then the defaults are timed (triton.testing.do_bench medians, interleaved rounds) as sm80/sm89 code and as the
same config compiled for sm90, both through the same launch path: what the older GPUs' code gives up on Hopper.
The table is printed last and written as markdown to --out. Exit status 1 when any check fails.
"""
from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

PLANNED = ("a100", "l40s")


def log(message: str) -> None:
    print(message, flush=True)


def _poisoned(family, problem, inputs) -> dict:
    outputs = family.allocate_outputs(problem, inputs)
    for t in outputs.values():
        if t.is_floating_point():
            t.fill_(float("nan"))
    return outputs


def _short(family, problem) -> str:
    text = family.problem_key(problem)
    return text if len(text) <= 90 else text[:87] + "..."


def check_config(family, problem, config, cc, inputs, expected):
    """(ok, message, max abs error, kernels launched) of `config` run as sm`cc` code on this GPU."""
    from autotile.xcompile import run_as

    outputs = _poisoned(family, problem, inputs)
    with run_as(cc) as hook:
        family.launch(problem, config, inputs, outputs)
    torch.cuda.synchronize()
    result = family.check(problem, inputs, outputs, expected)
    return result.ok, result.message, result.max_abs_error, sorted(set(hook.launched))


def run_checks(families, seeds: int | None, device) -> list[dict]:
    from autotile.arch import UnsupportedOnDevice
    from autotile.device import planned_device
    from autotile.families import get_family
    from autotile.xcompile import configs_to_check, representative_problems

    rows = []
    problems = representative_problems()
    for gpu in PLANNED:
        planned = planned_device(gpu)
        for name in families:
            family = get_family(name)
            for problem in problems[name]:
                try:
                    configs = configs_to_check(family, problem, planned, sample=0)
                except UnsupportedOnDevice as exc:
                    rows.append(dict(gpu=gpu, family=name, problem=_short(family, problem), role="-", config="-",
                                     status="refused", detail=str(exc).split(";")[0], error=0.0, kernels=""))
                    continue
                chosen = configs if seeds is None else configs[:1 + seeds]
                inputs = family.make_inputs(problem, device, seed=0)
                expected = family.reference(problem, inputs)
                for role, config in chosen:
                    row = dict(gpu=gpu, family=name, problem=_short(family, problem), role=role,
                               config=config.to_json(), kernels="", error=0.0)
                    started = time.monotonic()
                    try:
                        ok, message, error, kernels = check_config(family, problem, config,
                                                                   planned.compute_capability, inputs, expected)
                        row.update(status="ok" if ok else "WRONG", detail=message[:160], error=error,
                                   kernels=",".join(kernels))
                    except Exception as exc:  # noqa: BLE001 - reported per config; the run goes on
                        row.update(status="ERROR", detail=f"{type(exc).__name__}: {str(exc)[-300:]}")
                        traceback.print_exc()
                    if row["status"] != "ok":
                        row["native"] = native_result(family, problem, config, inputs, expected)
                    row["seconds"] = time.monotonic() - started
                    log(f"{row['status']:>7} {gpu} {name} {role} {row['problem'][:60]} {row['config']} "
                        f"({row['seconds']:.1f} s) {row['detail'][:120]}")
                    rows.append(row)
    return rows


def native_result(family, problem, config, inputs, expected) -> str:
    """The same config compiled for this GPU itself: tells a wrong config from a wrong older-GPU code path."""
    try:
        outputs = _poisoned(family, problem, inputs)
        family.launch(problem, config, inputs, outputs)
        torch.cuda.synchronize()
        result = family.check(problem, inputs, outputs, expected)
        return "ok" if result.ok else f"wrong too: {result.message[:100]}"
    except Exception as exc:  # noqa: BLE001
        return f"error too: {type(exc).__name__}: {str(exc)[:100]}"


def time_defaults(families, device, rounds: int) -> list[dict]:
    """Each family's first problem's default on each planned GPU: as that GPU's code and as sm90 code."""
    import triton

    from autotile.arch import UnsupportedOnDevice
    from autotile.device import planned_device
    from autotile.families import get_family
    from autotile.xcompile import representative_problems, run_as

    rows = []
    for gpu in PLANNED:
        planned = planned_device(gpu)
        for name in families:
            family = get_family(name)
            problem = representative_problems()[name][0]
            try:
                config = family.default_config(problem, planned)
            except UnsupportedOnDevice:
                continue
            inputs = family.make_inputs(problem, device, seed=1)
            outputs = family.allocate_outputs(problem, inputs)
            hooks = {"old": run_as(planned.compute_capability), "sm90": run_as((9, 0))}
            times: dict[str, list[float]] = {k: [] for k in hooks}

            def call(hook):
                with hook:
                    family.launch(problem, config, inputs, outputs)
            for _ in range(rounds):
                for key, hook in hooks.items():
                    times[key].append(triton.testing.do_bench(lambda h=hook: call(h), warmup=10, rep=40))
            old, new = statistics.median(times["old"]), statistics.median(times["sm90"])
            rows.append(dict(gpu=gpu, family=name, problem=_short(family, problem), config=config.to_json(),
                             old_ms=old, sm90_ms=new))
            log(f"timed {gpu} {name}: {planned.compute_capability} code {old:.4f} ms, sm90 code {new:.4f} ms")
    return rows


def markdown(checks: list[dict], timings: list[dict], quick: bool, seconds: float) -> str:
    import triton

    props = torch.cuda.get_device_properties(0)
    failed = [r for r in checks if r["status"] not in ("ok", "refused")]
    lines = [f"# The A100's and L40S's spaces run on {props.name} ({datetime.date.today()})", "",
             f"torch {torch.__version__}, triton {triton.__version__}{', --quick' if quick else ''}; "
             f"{len(checks)} checks, {len(failed)} failed, {seconds:.0f} s. Each config compiled for sm80 (A100) "
             "or sm89 (L40S) and run on this GPU through its PTX; outputs NaN-filled first, then compared with "
             "the family's torch reference.", "",
             "| planned GPU | family | problem | config | kernels | result | max abs err |",
             "|---|---|---|---|---|---|---|"]
    for r in checks:
        result = r["status"] if r["status"] in ("ok", "refused") else f"**{r['status']}** {r['detail'][:80]}"
        if r.get("native"):
            result += f" (as sm90 code: {r['native']})"
        if r["status"] == "refused":
            result += f": {r['detail'][:80]}"
        lines.append(f"| {r['gpu']} | {r['family']} | `{r['problem']}` | {r['role']} `{r['config']}` | "
                     f"{r['kernels']} | {result} | {r['error']:.2e} |")
    if timings:
        lines += ["", "Defaults timed (median ms of interleaved do_bench rounds, same launch path):", "",
                  "| planned GPU | family | problem | config | its own code ms | as sm90 code ms | ratio |",
                  "|---|---|---|---|---|---|---|"]
        for t in timings:
            lines.append(f"| {t['gpu']} | {t['family']} | `{t['problem']}` | `{t['config']}` | {t['old_ms']:.4f} | "
                         f"{t['sm90_ms']:.4f} | {t['old_ms'] / t['sm90_ms']:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("arch_check.md"),
                        help="markdown file to write (a folder: arch_check.md inside it)")
    parser.add_argument("--quick", action="store_true", help="the default and one seed per problem: ~1 minute")
    parser.add_argument("--family", action="append", default=None, help="only this family (repeatable)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        log("arch_check needs a CUDA GPU (sm90 or newer runs the sm80 and sm89 code); none is present")
        return 2
    from autotile.device import cuda_device

    device = cuda_device(0)
    if device.compute_capability < (8, 9):
        log(f"{device.name} is sm{device.compute_capability[0]}{device.compute_capability[1]}: sm89 PTX needs "
            "sm89 or newer")
        return 2
    families = args.family or ["gemm", "flash", "paged", "elementwise"]
    started = time.monotonic()
    checks = run_checks(families, 1 if args.quick else None, device)
    timings = time_defaults(families, device, 1 if args.quick else args.rounds)
    text = markdown(checks, timings, args.quick, time.monotonic() - started)
    out = args.out / "arch_check.md" if args.out.is_dir() else args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)
    return 1 if any(r["status"] not in ("ok", "refused") for r in checks) else 0


if __name__ == "__main__":
    sys.exit(main())
