"""Host time per call of short kernels: Triton's own launch, autotile's kept-kernel launch, the public op, cuBLAS.

    PYTHONPATH=. python benchmarks/launch_overhead.py --out OUT_DIR

A kernel shorter than the host work of its launch leaves the GPU idle between
calls, and the timing of such a kernel measures the host. For each shape the
script reports, per way of calling: host µs per call (200 calls queued without
synchronising), the GPU time per call from `triton.testing.do_bench`, and the
GPU time inside a CUDA graph (no host work at all: the kernel alone). Run it a second time with
AUTOTILE_VENDOR=0 to time the public ops serving their generated kernels (the ops read it when they first serve a shape).
Writes OUT_DIR/launch_overhead.md (OUT_DIR/launch_overhead_generated.md with AUTOTILE_VENDOR=0).
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import autotile  # noqa: E402
from autotile.device import cuda_device  # noqa: E402
from autotile.families.gemm import FAMILY, contiguous_problem  # noqa: E402
from autotile.families.gemm_launch import launch_plan  # noqa: E402
from autotile.families.base import is_vendor  # noqa: E402
from autotile.runtime.dispatch import resolve  # noqa: E402

# Llama-3-8B's q/o projection at 1, 16 and 2048 tokens, its kv projection at 4, Qwen2.5-7B's qkv at 768 (the gluon_ws
# kernel with host-built descriptors, untuned), and an irregular shape.
SHAPES = ((1, 4096, 4096), (4, 1024, 4096), (16, 4096, 4096), (768, 4608, 3584), (2048, 4096, 4096), (1000, 3000, 777))
HOST_CALLS = 200


def resolve_generated(problem, device):
    """What resolve serves with AUTOTILE_VENDOR=0 (the switch is part of its memo key)."""
    before = os.environ.get("AUTOTILE_VENDOR")
    os.environ["AUTOTILE_VENDOR"] = "0"
    try:
        return resolve(FAMILY, problem, device).config
    finally:
        if before is None:
            del os.environ["AUTOTILE_VENDOR"]
        else:
            os.environ["AUTOTILE_VENDOR"] = before


def host_us(fn, calls: int = HOST_CALLS, warmup: int = 1) -> float:
    """Host microseconds a call of `fn`, `calls` calls queued without synchronising (after `warmup` calls)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def row(name: str, fn) -> str:
    host = host_us(fn)
    gpu = triton.testing.do_bench(fn, warmup=25, rep=100) * 1e3
    graph = triton.testing.do_bench_cudagraph(fn, rep=100) * 1e3
    return f"| {name} | {host:.1f} | {gpu:.1f} | {graph:.1f} |"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    device = cuda_device(0)
    vendor = "on" if os.environ.get("AUTOTILE_VENDOR", "1") != "0" else "off (AUTOTILE_VENDOR=0: the ops serve generated kernels)"
    lines = [f"# Launch overhead, {device.name}, {datetime.date.today().isoformat()}, torch {torch.__version__}, "
             f"triton {triton.__version__}; vendor op {vendor}", "",
             "bf16 GEMMs, weights in nn.Linear layout, with the served config and with the generated kernel. host: µs of host time per call, 200 calls queued; do_bench: µs per "
             "call as the benchmarks time it (L2 flushed between calls); graph: µs per call replayed in a CUDA graph.", ""]
    for m, n, k in SHAPES:
        # nn.Linear layout: the weight (N, K) row-major, so matmul's B = weight.t() is column-major.
        problem = contiguous_problem(m, n, k, layout_b="col")
        inputs = FAMILY.make_inputs(problem, device, seed=1)
        outputs = FAMILY.allocate_outputs(problem, inputs)
        a, b, c = inputs["a"], inputs["b"], outputs["c"]
        weight = b.t()
        served = resolve(FAMILY, problem, device).config
        # The generated kernel: the one served, or the one the op would serve with the vendor op off.
        config = served if not is_vendor(served) else resolve_generated(problem, device)
        plan = launch_plan(FAMILY, problem, config, a.device)
        launch_args = plan.kernel_args(a, b, c, None, None, None, None, None, None, plan.stream_k, plan.tiles)

        def triton_launch():
            plan.kernel[plan.grid](*launch_args, **plan.constexprs)

        lines += [f"## {m} x {n} x {k}", "", f"served: `{served.to_json()}`; generated kernel: `{config.to_json()}`", "",
                  "| call | host µs/call | do_bench µs | graph µs |", "|---|---|---|---|"]
        ways = [("torch.matmul (cuBLAS)", lambda: torch.matmul(a, b)),
                ("autotile.matmul (public op, as served)", lambda: autotile.matmul(a, b)),
                ("F.linear (cuBLAS)", lambda: F.linear(a, weight)),
                ("autotile.linear (public op, as served)", lambda: autotile.linear(a, weight)),
                ("family launch (launch plan)", lambda: FAMILY.launch(problem, config, inputs, outputs))]
        if not plan.workspace:  # split tiles need a workspace and tile counters
            ways.append(("Triton kernel[grid](...)", triton_launch))
        for name, fn in ways:
            lines.append(row(name, fn))
            print(lines[-1], flush=True)
        lines.append("")
    args.out.mkdir(parents=True, exist_ok=True)
    name = "launch_overhead.md" if os.environ.get("AUTOTILE_VENDOR", "1") != "0" else "launch_overhead_generated.md"
    (args.out / name).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
