"""Host time per call of short kernels: Triton's own launch, autotile's kept-kernel launch, the public op, cuBLAS.

    PYTHONPATH=. python benchmarks/launch_overhead.py --out OUT_DIR

A kernel shorter than the host work of its launch leaves the GPU idle between
calls, and the timing of such a kernel measures the host. For each shape the
script reports, per way of calling: host µs per call (200 calls queued without
synchronising), the GPU time per call from `triton.testing.do_bench`, and the
GPU time inside a CUDA graph (no host work at all: the kernel alone).
Writes OUT_DIR/launch_overhead.md.
"""
from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path

import torch
import triton
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import autotile  # noqa: E402
from autotile.device import cuda_device  # noqa: E402
from autotile.families.gemm import FAMILY, contiguous_problem  # noqa: E402
from autotile.families.gemm_launch import launch_plan  # noqa: E402
from autotile.runtime.dispatch import resolve  # noqa: E402

SHAPES = ((2048, 2048, 2048), (16, 8192, 8192), (1000, 3000, 777), (256, 256, 256))
HOST_CALLS = 200


def host_us(fn) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(HOST_CALLS):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / HOST_CALLS * 1e6


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
    lines = [f"# Launch overhead, {device.name}, {datetime.date.today().isoformat()}, torch {torch.__version__}, "
             f"triton {triton.__version__}", "",
             "bf16 GEMMs with the served config. host: µs of host time per call, 200 calls queued; do_bench: µs per "
             "call as the benchmarks time it (L2 flushed between calls); graph: µs per call replayed in a CUDA graph.", ""]
    for m, n, k in SHAPES:
        problem = contiguous_problem(m, n, k)
        inputs = FAMILY.make_inputs(problem, device, seed=1)
        outputs = FAMILY.allocate_outputs(problem, inputs)
        a, b, c = inputs["a"], inputs["b"], outputs["c"]
        config = resolve(FAMILY, problem, device).config
        plan = launch_plan(FAMILY, problem, config, a.device)
        launch_args = plan.kernel_args(a, b, c, None, None, None, None, None, None, plan.stream_k)

        def triton_launch():
            plan.kernel[plan.grid](*launch_args, **plan.constexprs)

        lines += [f"## {m} x {n} x {k}", "", f"config: `{config.to_json()}`", "",
                  "| call | host µs/call | do_bench µs | graph µs |", "|---|---|---|---|"]
        ways = [("torch.matmul (cuBLAS)", lambda: torch.matmul(a, b)),
                ("autotile.matmul (public op)", lambda: autotile.matmul(a, b)),
                ("family launch (kept kernel)", lambda: FAMILY.launch(problem, config, inputs, outputs))]
        if not plan.workspace:  # split tiles need a workspace and tile counters
            ways.append(("Triton kernel[grid](...)", triton_launch))
        for name, fn in ways:
            lines.append(row(name, fn))
            print(lines[-1], flush=True)
        lines.append("")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "launch_overhead.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
