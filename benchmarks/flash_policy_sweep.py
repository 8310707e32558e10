"""Which forward FlashAttention config wins where: model prefill shapes, a grid of untuned candidates timed.

Run from the repository root on a CUDA machine:
    python benchmarks/flash_policy_sweep.py --out OUT/flash_policy_sweep.md     # ~4 min on an H200
    python benchmarks/flash_policy_sweep.py --plan                              # list the work (no GPU)

flash_bench.py reports the family's default and its first seeds; this script times a grid of forward
configs (query and key tiles with their warps, pointer or TMA loads, warp specialisation, stages: those the
space holds) plus the
default and the seeds, so that the default policy (FlashFamily.default_config) can be set from measurements.
Shapes: causal prefill of Llama-3-8B (32/8 heads, D = 128), Qwen2.5-7B (28/4), Phi-3-mini (32/32, D = 96) and
Gemma-2-9B (16/8, D = 256) at 1 x 4096, 4 x 2048 and 16 x 512 tokens, and issue 14's anchors (D = 64, non-causal,
16k tokens, Sq != Sk). Each candidate is checked against the float64 reference, then all are timed interleaved with SDPA's
cuDNN backend: one screening round, then the best four, the default and cuDNN over --rounds rounds; medians
of do_bench medians. Kernels are compiled first by a pool of CPU processes. Markdown to --out, JSON beside it.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import math
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]

import gemm_kernels_bench as gkb  # noqa: E402  (compile pool, interleaved timing, geomean)
import gemm_policy_sweep as gps  # noqa: E402  (options, saving, a swept row's ratios)

from autotile.bench import poison  # noqa: E402
from autotile.device import HOPPER_SMEM_PER_BLOCK, DeviceInfo, resolve_gpu  # noqa: E402
from autotile.families import flash_vendor  # noqa: E402
from autotile.families.flash import FAMILY, GLUON_WS, FlashProblem, default_scale  # noqa: E402
from autotile.space import Config  # noqa: E402

# (label, heads_q, heads_kv, head_dim) and (batch, sequence) of the causal prefill shapes.
MODELS = (("llama3-8b", 32, 8, 128), ("qwen2.5-7b", 28, 4, 128), ("phi3-mini", 32, 32, 96), ("gemma2-9b", 16, 8, 256))
PREFILL = ((1, 4096), (4, 2048), (16, 512))
ANCHORS = (("D=64 3x12x2000", FlashProblem("fwd", 3, 12, 12, 2000, 2000, 64, True)),
           ("D=128 2x32x4096 non-causal", FlashProblem("fwd", 2, 32, 32, 4096, 4096, 128, False)),
           ("llama3-8b 1x16384", FlashProblem("fwd", 1, 32, 8, 16384, 16384, 128, True)),
           ("GQA 16/4 1000x3000 non-causal", FlashProblem("fwd", 1, 16, 4, 1000, 3000, 128, False)),
           ("D=64 4x16x4096 non-causal", FlashProblem("fwd", 4, 16, 16, 4096, 4096, 64, False)),
           ("gemma2-9b 1x8192 non-causal", FlashProblem("fwd", 1, 16, 8, 8192, 8192, 256, False)))
# The grid: (BLOCK_M, BLOCK_N, num_warps) tiles x loads x stages (Triton's tutorial pairs 128-row tiles with
# 8 warps, 64-row ones with 4).
# 128 x 32 on 8 warps: 128-row tiles (half the K/V reads of 64-row ones) at 115-128 registers a thread, two programs
# an SM (sm90 builds of 16 x 512 causal prefill, autotile.xcompile); measured 12-25% behind 64 x 64 tiles on short
# prefill all the same (results/flash_policy_sweep_2026-12-02b_short.md).
# 64 x 32 on 4 warps: three to four programs an SM at D = 128 (64 KB of shared memory at 3 stages, 114-128 registers),
# where ncu found the 64 x 64 tiles held two, limited by shared memory (results/ncu_flash_2026-12-02/).
TILES = ((64, 32, 4), (64, 64, 4), (64, 128, 4), (128, 32, 8), (128, 64, 4), (128, 64, 8), (128, 128, 8))
LOADS = (("pointer", False), ("tma", False), ("tma", True))
STAGES = (2, 3)
# Masked key blocks in loops of their own, or in the whole blocks' loop (masked problems only; not with WS).
MASKS = (False, True)
# The gluon_ws forward (templates/flash_gluon_ws.py.j2): its key blocks, K/V slots (one: head dim 256's split slot)
# and schedule (static rounds or the tile queue); the rest of its tile is fixed.
GLUON = tuple(itertools.product((64, 128), (1, 2, 3, 4), (False, True)))
FINALISTS = 4
H200_PLAN = DeviceInfo("h200", "NVIDIA H200", (9, 0), 132, 150_000_000_000, HOPPER_SMEM_PER_BLOCK, "plan")


def shapes() -> list[tuple[str, FlashProblem]]:
    found = [(f"{name} {batch}x{seq}", FlashProblem("fwd", batch, hq, hkv, seq, seq, d, True))
             for name, hq, hkv, d in MODELS for batch, seq in PREFILL]
    return found + list(ANCHORS)


def short(config: Config) -> str:
    c = config
    return (f"{c['LOADS']}{'+ws' if c['WARP_SPECIALIZE'] else ''}{'+mil' if c.get('MASKS_IN_LOOP') else ''}"
            f"{'+queue' if c.get('TILE_QUEUE') else ''} "
            f"{c['BLOCK_M']}x{c['BLOCK_N']} w{c['num_warps']} s{c['num_stages']}")


def candidates(problem: FlashProblem, device: DeviceInfo) -> dict[str, Config]:
    """name -> config: the default first, then the seeds, then every grid point the space holds."""
    space = FAMILY.space(problem, device)
    found: dict[Config, str] = {FAMILY.default_config(problem, device): "default"}
    for config in FAMILY.seed_configs(problem, device):
        found.setdefault(config, "seed")
    for (block_m, block_n, warps), (loads, ws), stages, in_loop in itertools.product(TILES, LOADS, STAGES, MASKS):
        wanted = dict(LOADS=loads, BLOCK_M=block_m, BLOCK_N=block_n, WARP_SPECIALIZE=ws, MASKS_IN_LOOP=in_loop,
                      num_warps=warps, num_stages=stages)
        if space.is_feasible(wanted):
            found.setdefault(space.validate(wanted), "grid")
    for block_n, stages, queue in GLUON:
        wanted = dict(LOADS=GLUON_WS, BLOCK_M=128, BLOCK_N=block_n, WARP_SPECIALIZE=False, MASKS_IN_LOOP=False,
                      TILE_QUEUE=queue, num_warps=4, num_stages=stages)
        if space.is_feasible(wanted):
            found.setdefault(space.validate(wanted), "grid")
    return {f"{kind} {short(config)}": config for config, kind in found.items()}


def sweep_shape(label: str, problem: FlashProblem, configs: dict[str, Config], device, rounds: int,
                failures: list[str]) -> dict:
    inputs = FAMILY.make_inputs(problem, device, seed=5)
    reference = FAMILY.reference(problem, inputs)
    fns = {}
    for name, config in configs.items():
        outputs = FAMILY.allocate_outputs(problem, inputs)
        poison(outputs)
        try:
            FAMILY.launch(problem, config, inputs, outputs)
            torch.cuda.synchronize()
            result = FAMILY.check(problem, inputs, outputs, reference)
        except Exception as exc:  # noqa: BLE001 - a failing candidate is reported, the others go on
            failures.append(f"{label} {config.to_json()}: {type(exc).__name__}: {str(exc)[:200]}")
            continue
        if not result.ok:
            failures.append(f"{label} {config.to_json()}: {result.message}")
            continue
        fns[name] = (lambda c=config, o=outputs: FAMILY.launch(problem, c, inputs, o))
    del reference
    scale = default_scale(problem.head_dim)
    vendor = {"cuDNN": lambda: flash_vendor.forward(flash_vendor.CUDNN, inputs["q"], inputs["k"], inputs["v"],
                                                   causal=problem.causal, scale=scale, need_lse=False)}
    screened = gkb.interleaved(dict(fns, **vendor), 1, 5, 25)
    ours = sorted((ms, name) for name, ms in screened.items() if name in fns)
    final = {name: fns[name] for _, name in ours[:FINALISTS]}
    default = next((name for name in fns if name.startswith("default")), None)
    if default:
        final[default] = fns[default]
    final.update(vendor)
    timed = gkb.interleaved(final, rounds, 10, 50)
    return {"label": label, "problem": dataclasses.asdict(problem), "vendor_ms": timed["cuDNN"],
            "screened": screened, "timed": {n: ms for n, ms in timed.items() if n != "cuDNN"},
            "configs": {name: configs[name].to_json() for name in fns}}


def render(rows: list[dict], device, seconds: float, failures: list[str]) -> str:
    lines = [f"# Flash forward policy sweep: untuned candidates beside cuDNN ({datetime.date.today().isoformat()}, "
             f"{device.name})", "",
             "bf16. `timed`: medians of do_bench medians over interleaved rounds (the best "
             f"{FINALISTS} of a screening round, the default and SDPA's cuDNN backend); ratios are cuDNN time / "
             f"ours. {seconds:.0f} s in all.", "",
             "| shape | candidates | cuDNN us | default / cuDNN | best | best / cuDNN | runner-up |",
             "|---|---|---|---|---|---|---|"]
    pairs = []
    for row in rows:
        default, best, second = gps.ranked(row)
        lines.append(f"| {row['label']} | {len(row['configs'])} | {row['vendor_ms'] * 1e3:.0f} | {default:.2f}x | "
                     f"{best[1]} | {best[0]:.2f}x | {second} |")
        if not math.isnan(default):
            pairs.append((default, best[0]))
    if pairs:
        lines += ["", f"Geometric mean over {len(pairs)} shapes: default {gkb.geomean([d for d, _ in pairs]):.3f}x, "
                      f"best {gkb.geomean([b for _, b in pairs]):.3f}x of cuDNN."]
    lines += ["", "## Failed checks", ""] + ([f"- {f}" for f in failures] or ["none"])
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    gps.add_sweep_arguments(parser, "flash_policy_sweep.md")
    parser.add_argument("--only", default="", help="comma-separated parts of shape labels to sweep (e.g. "
                        "'16x512,llama3-8b 4x2048'); all shapes when empty")
    args = parser.parse_args()
    work = shapes()
    if args.only:
        wanted = [part.strip() for part in args.only.split(",") if part.strip()]
        work = [(label, problem) for label, problem in work if any(part in label for part in wanted)]
        if not work:
            parser.error(f"--only {args.only!r} matches no shape; --plan lists the labels")
    if args.plan:
        for label, problem in work:
            configs = candidates(problem, H200_PLAN)
            print(f"{label:28s} {len(configs)} candidates")
            for name in configs:
                print(f"    {name}")
        return 0
    device = resolve_gpu("auto")
    if device.interpret:
        print("no CUDA GPU: this sweep runs on a GPU only (--plan lists its work without one)")
        return 2
    started = time.monotonic()
    plans = [(label, problem, candidates(problem, device)) for label, problem in work]
    gkb.compile_ahead([(problem, c) for _, problem, configs in plans for c in configs.values()], args.workers,
                      family=FAMILY)
    rows, failures = [], []
    for label, problem, configs in plans:
        if args.budget_s and time.monotonic() - started > args.budget_s:
            failures.append(f"budget of {args.budget_s:.0f} s spent: {len(plans) - len(rows)} shapes not timed")
            break
        rows.append(sweep_shape(label, problem, configs, device, args.rounds, failures))
        torch.cuda.empty_cache()
        gps.save(args.out, rows, failures)
        best = min(rows[-1]["timed"].items(), key=lambda kv: kv[1])
        print(f"  {label:28s} cuDNN {rows[-1]['vendor_ms'] * 1e3:7.1f} us, best {best[1] * 1e3:7.1f} us {best[0]} "
              f"({time.monotonic() - started:.0f} s)", flush=True)
    text = render(rows, device, time.monotonic() - started, failures)
    gps.save(args.out, rows, failures, text)
    print(text)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
