"""First calls of a model's shapes with an empty kernel cache, then in a new process after a warm-up (GPU).

    PYTHONPATH=. python benchmarks/warmup_bench.py --model llama3-8b --tokens 1,16,256,4096 --prefill 1x4096 \\
        --out OUT/warmup.md

Each run is a fresh Python process calling autotile.warmup (autotile/runtime/warmup.py: each call twice) with
TRITON_CACHE_DIR pointing at one new, empty folder: the first run compiles every kernel the ops serve; the second, a
new process, finds them in Triton's on-disk cache, as a server started after `autotile warmup` would. The table
gives each call's first-call seconds in both runs and the second call's (the steady cost), and what served it.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = """
import dataclasses, json, sys
import autotile
calls = autotile.warmup({model!r}, tokens={tokens!r}, prefill={prefill!r}, backward={backward!r})
print(json.dumps([dataclasses.asdict(c) for c in calls]))
"""


def run_once(args, cache: str) -> list[dict]:
    # (the repository first, then whatever the caller put there: benchmarks/gpu_env.sh's packages)
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "TRITON_CACHE_DIR": cache, "PYTHONPATH": path}
    code = CHILD.format(model=args.model, tokens=args.tokens, prefill=args.prefill, backward=args.backward)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=args.timeout)
    if done.returncode:
        raise SystemExit(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    import torch
    import triton

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--tokens", default="1,16,256,4096")
    parser.add_argument("--prefill", default="1x4096")
    parser.add_argument("--backward", action="store_true")
    parser.add_argument("--timeout", type=float, default=500)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as cache:
        cold = run_once(args, cache)
        warm = run_once(args, cache)
    lines = [f"# First calls, empty kernel cache and after a warm-up, {torch.cuda.get_device_name()}, torch "
             f"{torch.__version__}, triton {triton.__version__}, {datetime.date.today()}", "",
             f"`autotile.warmup({args.model!r}, tokens={args.tokens!r}, prefill={args.prefill!r}, "
             f"backward={args.backward})`, each run a new process on one TRITON_CACHE_DIR.", "",
             "| op | shape | served | first call, empty cache s | first call, new process after warm-up s | "
             "second call ms |", "|---|---|---|---|---|---|"]
    for c, w in zip(cold, warm):
        lines.append(f"| {c['op']} | {c['shape']} | {c['served']} | {c['first_s']:.2f} | {w['first_s']:.3f} | "
                     f"{w['again_s'] * 1e3:.2f} |")
    total_cold, total_warm = sum(c["first_s"] for c in cold), sum(w["first_s"] for w in warm)
    lines += ["", f"First calls in all: {total_cold:.1f} s with an empty cache, {total_warm:.1f} s after a warm-up."]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
