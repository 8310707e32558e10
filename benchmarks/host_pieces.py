"""Host time of the pieces of a served GEMM call: where a decode step's microseconds go (GPU).

    python benchmarks/host_pieces.py                              # the ops serve what they would for a user
    AUTOTILE_VENDOR=0 python benchmarks/host_pieces.py            # the ops serve their generated kernels

A decode GEMM runs 6-40 us on the GPU; called eagerly, a step is as long as its host work when that is longer.
This times, with 2000 calls queued each: the torch calls a served launch makes (device, strides, stream lookups,
the split-K buffers, the output allocation), then `F.linear` beside `autotile.linear` (and `torch.matmul` beside
`autotile.matmul` on the weight's transpose) on decode shapes of Llama-3-8B, Qwen3-8B and Gemma-3-12B, walking the
shapes forward and back (host time on a shared machine drifts by tens of percent over seconds). Each op call is
also timed without its short path: kernel-served calls through the full signature (no ops_gemm._FastLinear),
vendor-served ones through F.linear (no kept transpose of ops_gemm._VendorLinear). Then a cProfile of the op on
the first two shapes. Prints to stdout.
"""
from __future__ import annotations

import contextlib
import cProfile
import io
import pstats
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]

import launch_overhead  # noqa: E402  (the host-time loop)

import autotile  # noqa: E402
from autotile.families import gemm_launch  # noqa: E402

CALLS = 2000
SHAPES = ((1, 4096, 4096), (4, 1024, 4096), (16, 4096, 4096), (1, 14336, 4096), (8, 6144, 4096),
          (64, 1024, 4096), (64, 2048, 3840), (64, 4096, 4096))


def host_us(fn) -> float:
    return launch_overhead.host_us(fn, CALLS, warmup=20)


@contextlib.contextmanager
def without_short_paths():
    """Linear calls as before their short paths (the A/B of their gain): kernel-served ones take the full
    signature (no ops_gemm._FastLinear), vendor-served ones call F.linear (no kept transpose)."""
    from autotile.runtime import ops_gemm

    kept = {k: v for k, v in ops_gemm._linear_fast.items() if isinstance(v, ops_gemm._FastLinear)}
    for key in kept:
        del ops_gemm._linear_fast[key]
    views = {k: v.weight_t for k, v in ops_gemm._linear_fast.items() if isinstance(v, ops_gemm._VendorLinear)}
    for key in views:
        ops_gemm._linear_fast[key].weight_t = None
    keep = ops_gemm._keep_fast_linear
    ops_gemm._keep_fast_linear = lambda *args: None
    try:
        yield
    finally:
        ops_gemm._keep_fast_linear = keep
        ops_gemm._linear_fast.update(kept)
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
    for order in ("forward", "reversed", "forward", "reversed"):
        for shape in SHAPES if order == "forward" else SHAPES[::-1]:
            a, w = data[shape]
            vendor, ours = host_us(lambda: F.linear(a, w)), host_us(lambda: autotile.linear(a, w))
            with without_short_paths():
                before = host_us(lambda: autotile.linear(a, w))
            mm_vendor = host_us(lambda: torch.matmul(a, w.t()))
            mm_ours = host_us(lambda: autotile.matmul(a, w.t()))
            served = autotile.explain("linear", a, w)
            print(f"{order:8s} {shape}: F.linear {vendor:6.2f} us, autotile.linear {ours:6.2f} us of host time a "
                  f"call ({before:6.2f} us without its short path); torch.matmul {mm_vendor:6.2f} us, "
                  f"autotile.matmul {mm_ours:6.2f} us; served by {served['vendor'] or served['source']}")
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
