"""Host time of the flash backward as a training step calls it, beside its kernels and SDPA's cuDNN backward.

    PYTHONPATH=. python benchmarks/flash_bwd_host.py [--profile OUT_DIR] > OUT.txt

For short prefill shapes (where a call's host work can outrun its kernels), in one run: the Gluon backward's plan
alone, the op's backward body called directly, `torch.autograd.grad` through `autotile.flash_attention` (what a
training step runs; AUTOTILE_VENDOR=0, no tuned winners), the backward custom op through the dispatcher, and SDPA's
FlashAttention-2 and cuDNN backwards through autograd. Timed: interleaved rounds of triton.testing.do_bench medians
(L2 flushed). Host us a call: 50 calls queued without a sync (and with the GPU's wait). Then what any
`torch.autograd.grad` costs on CUDA tensors here, a trivial Python Function beside a C++ node. --profile writes a
torch.profiler table and Chrome trace of ten op calls of the first shape.
Results: results/flash_bwd_op_gap_2026-12-04.txt.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from autotile.families.flash import FAMILY, FlashProblem, default_scale  # noqa: E402
from autotile.runtime import ops_flash  # noqa: E402
from flash_bench import interleaved, kernel_call, sdpa_calls  # noqa: E402
from flash_bwd_bench import op_call, start_run  # noqa: E402

# (label, batch, heads_q, heads_kv, tokens, head_dim): causal prefill.
SHAPES = (("Qwen2.5-0.5B 16x512", 16, 14, 2, 512, 64), ("Qwen2.5-0.5B 1x4096", 1, 14, 2, 4096, 64),
          ("Qwen2.5-1.5B 16x512", 16, 12, 2, 512, 128))


class _Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g


def host_us(fn, calls: int = 50) -> tuple[float, float]:
    """(us a call to queue, us a call until the GPU is done)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    queued = time.perf_counter()
    torch.cuda.synchronize()
    return (queued - start) / calls * 1e6, (time.perf_counter() - start) / calls * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="", help="directory for a profile of the first shape's op calls")
    args = parser.parse_args()
    device = start_run("flash backward host time")
    for label, batch, hq, hkv, seq, dim in SHAPES:
        problem = FlashProblem("bwd", batch, hq, hkv, seq, seq, dim, causal=True)
        inputs = FAMILY.make_inputs(problem, device, seed=0)
        q, k, v, do = (inputs[n] for n in ("q", "k", "v", "do"))
        scale = default_scale(dim)
        o, lse = torch.ops.autotile.flash_attention_fwd(q, k, v, True, scale)
        fns = {"plan": kernel_call(problem, FAMILY.default_config(problem, device), inputs),
               "op": op_call(problem, inputs),
               "body": lambda: ops_flash._flash_attention_bwd(do, q, k, v, o, lse, True, scale),
               "op custom": lambda: torch.ops.autotile.flash_attention_bwd(do, q, k, v, o, lse, True, scale)}
        fns.update(sdpa_calls(problem, inputs))
        for fn in fns.values():
            fn()
        times = interleaved(fns, 3)
        spread = times.pop("spread")
        print(f"{label}: " + ", ".join(f"{n} {ms * 1e3:.1f} us" for n, ms in times.items()) + f"; spread {spread:.0%}",
              flush=True)
        host = {name: host_us(fn) for name, fn in fns.items()}
        print("  host us a call (queued / with GPU): " + ", ".join(f"{n} {h:.0f}/{g:.0f}" for n, (h, g) in host.items()),
              flush=True)
        if args.profile and label == SHAPES[0][0]:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    fns["op"]()
                torch.cuda.synchronize()
            Path(args.profile, "op_bwd_profile.txt").write_text(
                prof.key_averages().table(sort_by="cpu_time_total", row_limit=30))
            prof.export_chrome_trace(str(Path(args.profile, "op_bwd_trace.json")))
    x = torch.randn(1024, device="cuda", requires_grad=True)
    g = torch.randn(1024, device="cuda")
    for name, y in (("python Function", _Identity.apply(x)), ("C++ node (x * 2)", x * 2)):
        queued, _ = host_us(lambda y=y: torch.autograd.grad(y, (x,), g, retain_graph=True), calls=2000)
        print(f"autograd.grad through a {name}: {queued:.1f} us a call (host)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
