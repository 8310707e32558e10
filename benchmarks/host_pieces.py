"""Host time of the pieces of a served GEMM call: where a decode step's microseconds go (GPU).

    python benchmarks/host_pieces.py                              # the ops serve what they would for a user
    AUTOTILE_VENDOR=0 python benchmarks/host_pieces.py            # the ops serve their generated kernels

A decode GEMM runs 6-40 us on the GPU; called eagerly, a step is as long as its host work when that is longer.
This times, with 1000 calls queued each: the torch calls a served launch makes (device, strides, stream lookups,
the split-K buffers, the output allocation), then `F.linear` beside `autotile.linear` (with x 2-D and as a decode
step's (batch, 1, hidden)) and `torch.matmul` beside `autotile.matmul` on the weight's transpose, on decode
shapes of Llama-3-8B, Qwen3-8B and Gemma-3-12B. The calls of a shape take turns over 7 rounds (host time on a
shared machine drifts by tens of percent over seconds). Both ops are also timed without their short paths:
kernel-served calls through the full signature (no ops_gemm._FastLinear or _FastMatmul), vendor-served linear
calls through F.linear (no kept transpose of ops_gemm._VendorLinear). Then a cProfile of the op on the first two shapes. Prints to
stdout.
"""
from __future__ import annotations

import contextlib
import cProfile
import io
import pstats
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]

import launch_overhead  # noqa: E402  (the host-time loop)

import autotile  # noqa: E402
from autotile.families import gemm_launch  # noqa: E402

CALLS = 1000
ROUNDS = 7
SHAPES = ((1, 4096, 4096), (4, 1024, 4096), (16, 4096, 4096), (1, 14336, 4096), (8, 6144, 4096),
          (64, 1024, 4096), (64, 2048, 3840), (64, 4096, 4096))


def host_us(fn) -> float:
    return launch_overhead.host_us(fn, CALLS, warmup=20)


@contextlib.contextmanager
def without_short_paths():
    """Calls as before their short paths (the A/B of their gain): kernel-served linear and matmul calls take the
    full signature (no ops_gemm._FastLinear or _FastMatmul), vendor-served linear calls call F.linear (no kept
    transpose)."""
    from autotile.runtime import ops_gemm

    kept = {k: v for k, v in ops_gemm._linear_fast.items() if isinstance(v, ops_gemm._FastLinear)}
    for key in kept:
        del ops_gemm._linear_fast[key]
    kept_matmul = {k: v for k, v in ops_gemm._matmul_fast.items() if isinstance(v, ops_gemm._FastMatmul)}
    for key in kept_matmul:
        del ops_gemm._matmul_fast[key]
    views = {k: v.weight_t for k, v in ops_gemm._linear_fast.items() if isinstance(v, ops_gemm._VendorLinear)}
    for key in views:
        ops_gemm._linear_fast[key].weight_t = None
    keep, keep_matmul = ops_gemm._keep_fast_linear, ops_gemm._keep_fast_matmul
    ops_gemm._keep_fast_linear = ops_gemm._keep_fast_matmul = lambda *args: None
    try:
        yield
    finally:
        ops_gemm._keep_fast_linear, ops_gemm._keep_fast_matmul = keep, keep_matmul
        ops_gemm._linear_fast.update(kept)
        ops_gemm._matmul_fast.update(kept_matmul)
        for key, view in views.items():
            ops_gemm._linear_fast[key].weight_t = view


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA GPU: this measures a GPU launch path")
        return 2
    dev = torch.device("cuda", 0)
    x = torch.randn(1, 4096, device=dev, dtype=torch.bfloat16)
    pieces = {
        "x.device": lambda: x.device,
        "x.stride()": lambda: x.stride(),
        "x.data_ptr()": lambda: x.data_ptr(),
        "torch.cuda.is_current_stream_capturing": torch.cuda.is_current_stream_capturing,
        "gemm_launch._stream_key": lambda: gemm_launch._stream_key(dev),
        "gemm_launch.workspace": lambda: gemm_launch.workspace(dev, 4 * 64 * 16),
        "gemm_launch.tile_counters": lambda: gemm_launch.tile_counters(dev, 64),
        "gemm_launch.split_buffers": lambda: gemm_launch.split_buffers(dev, 4 * 64 * 16, 64),
        "torch.empty (1, 4096)": lambda: torch.empty((1, 4096), dtype=torch.bfloat16, device=dev),
        "x.new_empty (1, 4096)": lambda: x.new_empty((1, 4096)),
        "torch.empty_like(x)": lambda: torch.empty_like(x),
    }
    for name, fn in pieces.items():
        print(f"piece {name:40s} {host_us(fn):6.2f} us")
    data = {shape: (torch.randn(shape[0], shape[2], device=dev, dtype=torch.bfloat16),
                    torch.randn(shape[1], shape[2], device=dev, dtype=torch.bfloat16)) for shape in SHAPES}
    # Host time on a shared machine drifts by tens of percent over seconds: each shape's calls take turns over
    # ROUNDS rounds, and the medians are printed.
    for shape in SHAPES:
        a, w = data[shape]
        steps = a.view(a.shape[0], 1, a.shape[1])  # the same tokens as a decode step's (batch, 1, hidden)
        calls = {"F.linear": lambda: F.linear(a, w), "autotile.linear": lambda: autotile.linear(a, w),
                 "F.linear 3-D": lambda: F.linear(steps, w), "autotile.linear 3-D": lambda: autotile.linear(steps, w),
                 "torch.matmul": lambda: torch.matmul(a, w.t()), "autotile.matmul": lambda: autotile.matmul(a, w.t())}
        times = {name: [] for name in [*calls, "autotile.linear, no short path", "autotile.matmul, no short path"]}
        for _ in range(ROUNDS):
            for name, fn in calls.items():
                times[name].append(host_us(fn))
            with without_short_paths():
                times["autotile.linear, no short path"].append(host_us(lambda: autotile.linear(a, w)))
                times["autotile.matmul, no short path"].append(host_us(lambda: autotile.matmul(a, w.t())))
        served = autotile.explain("linear", a, w)
        print(f"{shape} served by {served['vendor'] or served['source']}: host us a call, median of {ROUNDS}: "
              + ", ".join(f"{name} {statistics.median(values):.2f}" for name, values in times.items()))
    for shape in SHAPES[:2]:
        a, w = data[shape]
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(CALLS):
            autotile.linear(a, w)
        profile.disable()
        torch.cuda.synchronize()
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(14)
        print(shape, "\n".join(text.getvalue().splitlines()[:40]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
