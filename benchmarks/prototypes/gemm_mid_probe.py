"""Why the Gluon GEMM loses at mid-sized M: its configs timed cold (L2 flushed before each call, as do_bench and
every benchmark here time) and warm (50 calls replayed in one CUDA graph, the weight left in L2), beside cuBLAS, in a fresh
process; GROUP_M 8 against 1, and one wave against two. Each config is checked against float64 first.

    python benchmarks/prototypes/gemm_mid_probe.py            # on a Hopper GPU, ~2 min
"""
from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path

os.environ["AUTOTILE_VENDOR"] = "0"
sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[1])]

import torch  # noqa: E402
import triton.testing  # noqa: E402

from gemm_gluon_bench import checked_launches  # noqa: E402

from autotile.device import cuda_device  # noqa: E402
from autotile.families.gemm import FAMILY, contiguous_problem  # noqa: E402
from autotile.families.gemm_policy import gluon_config  # noqa: E402

SHAPES = ((512, 4608, 3584), (1024, 4608, 3584), (256, 6144, 4096), (512, 3584, 3584))
TILES = {"g128x128": dict(BLOCK_N=128, BLOCK_K=64, num_stages=5),
         "g128x128 gm1": dict(BLOCK_N=128, BLOCK_K=64, num_stages=5, GROUP_M=1),
         "g128x144": dict(BLOCK_N=144, BLOCK_K=64, num_stages=5),
         "g128x256": dict(BLOCK_N=256, BLOCK_K=64, num_stages=3),
         "g64x192": dict(BLOCK_M=64, BLOCK_N=192, BLOCK_K=64, num_stages=6),
         "g64x128": dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_stages=6)}
WARM_CALLS = 50


def warm_ms(fn) -> float:
    """Mean ms of a call replayed WARM_CALLS times in one CUDA graph (no flush: the operands stay in L2; no host
    time: queued back to back from Python, a Gluon launch's host path outlasted its kernel)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(WARM_CALLS):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / WARM_CALLS


def timed_beside_cublas(problem, inputs: dict, fns: dict, rounds: int, note: str = "") -> None:
    """Time `fns` and cuBLAS on `inputs` cold and warm in `rounds` interleaved rounds; print each x cuBLAS."""
    a, w = inputs["a"], inputs["b"].t()
    fns = {**fns, "cuBLAS": lambda: torch.matmul(a, w.t())}
    cold, warm = {name: [] for name in fns}, {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            cold[name].append(triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median"))
            warm[name].append(warm_ms(fn))
    cold = {name: statistics.median(t) for name, t in cold.items()}
    warm = {name: statistics.median(t) for name, t in warm.items()}
    print(f"{problem.m}x{problem.n}x{problem.k}: cuBLAS cold {cold['cuBLAS'] * 1e3:.1f} us, "
          f"warm {warm['cuBLAS'] * 1e3:.1f} us" + (f"; {note}" if note else ""), flush=True)
    for name in fns:
        if name != "cuBLAS":
            print(f"  {name:18s} cold {cold['cuBLAS'] / cold[name]:.3f}x ({cold[name] * 1e3:6.1f} us)  "
                  f"warm {warm['cuBLAS'] / warm[name]:.3f}x ({warm[name] * 1e3:6.1f} us)", flush=True)


def main() -> int:
    device = cuda_device(0)
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, triton {triton.__version__}; "
          f"x cuBLAS, cold (L2 flushed) / warm (a CUDA graph of {WARM_CALLS} calls), medians of 3 interleaved rounds",
          flush=True)
    failures = 0
    for m, n, k in SHAPES:
        p = contiguous_problem(m, n, k, "bf16", "bf16", layout_b="col")
        inputs, space = FAMILY.make_inputs(p, device, seed=3), FAMILY.space(p, device)
        reference = FAMILY.reference(p, inputs)
        outputs = FAMILY.allocate_outputs(p, inputs)
        configs = {"default": FAMILY.default_config(p, device)}
        for name, tiles in TILES.items():
            config = space.admit(gluon_config(p, **tiles))
            if config is not None:
                configs[name] = config
        fns, failed = checked_launches(p, configs, inputs, reference, outputs, f"{m}x{n}x{k}")
        failures += failed
        default = configs["default"]
        timed_beside_cublas(p, inputs, fns, 3, f"default = {default['VARIANT']} {default['BLOCK_M']}x{default['BLOCK_N']}")
    print(f"{failures} failed checks")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
