"""Where a long sequence's paged decode time goes: device time per kernel (torch.profiler) and CUDA-graph replay.

    PYTHONPATH=. python benchmarks/paged_profile.py > OUT.txt      # GPU, about a minute

First, what a single replay's time counts (flush_effect). Then, for one 32k sequence (Llama-3-8B heads) and a
16-sequence Gemma-2 mix: the balanced variant at several tiles and split constants, and the split variant at
several partition sizes. Each line: the graph time per run (20 runs
replayed back to back from one graph, so L2 may hold part of the K/V between runs) and the device time of each
kernel (the main kernel, then the combine or reduce kernel that merges the chunks).
"""
from __future__ import annotations

import collections
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parent))
import paged_bench as pb  # noqa: E402  (the decode data builder)

import autotile  # noqa: E402
from autotile.bench import cuda_graph_of  # noqa: E402

RUNS = 20


def kernel_us(fn, runs: int) -> dict[str, float]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            fn()
        torch.cuda.synchronize()
    per = collections.defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            per[event.name[:32]] += event.device_time_total / runs
    return dict(per)


def profile(name: str, lengths: list[int], heads: tuple[int, int, int], configs: list[dict],
            constants=(None,)) -> None:
    data = pb.make_decode(lengths, *heads, page_size=16, device=torch.device("cuda"), seed=1)
    out = torch.empty_like(data.q[:, 0])
    for config in configs:
        for knobs in constants:
            try:
                plan = autotile.plan_paged_attention(
                    batch=len(lengths), num_q_heads=heads[0], num_kv_heads=heads[1], head_dim=heads[2], page_size=16,
                    max_context=max(lengths), device="cuda", config=config, split_constants=knobs)

                def fn(plan=plan):
                    plan.run(data.q[:, 0], data.k_cache, data.v_cache, data.block_table, data.context_lens, out=out)
                fn()
                graph = cuda_graph_of(fn, RUNS)
                us = min(do_bench(graph.replay, warmup=10, rep=60) for _ in range(3)) / RUNS * 1e3
                tbps = data.kv_bytes / (us * 1e-6) / 1e12
                tile = (config["VARIANT"], config["BLOCK_N"], config["PARTITION_SIZE"], config["num_stages"],
                        config["num_warps"])
                kernels = ", ".join(f"{k} {v:.1f}us" for k, v in kernel_us(fn, RUNS).items())
                print(f"{name} {tile} {knobs}: graph {us:.1f} us {tbps:.2f} TB/s | {kernels}", flush=True)
                del graph
            except Exception as exc:  # noqa: BLE001 - one failing config must not stop the rest
                print(f"{name} {config} {knobs}: FAILED {type(exc).__name__}: {exc}"[:300], flush=True)


def flush_effect(name: str, lengths: list[int], heads: tuple[int, int, int], rounds: int = 60) -> None:
    """One planned run (the default config) timed four ways, to see what a single replay's time counts:
    do_bench (it zeroes 256 MB before each call: L2 is left full of dirty lines that must be written back
    while the run reads); a 512 MB read before each call instead (L2 left clean); a 512 MB write before each
    call, timed the same way as the read; and back to back, RUNS runs from one graph."""
    data = pb.make_decode(lengths, *heads, page_size=16, device=torch.device("cuda"), seed=1)
    out = torch.empty_like(data.q[:, 0])
    plan = autotile.plan_paged_attention(batch=len(lengths), num_q_heads=heads[0], num_kv_heads=heads[1],
                                         head_dim=heads[2], page_size=16, max_context=max(lengths), device="cuda")

    def fn():
        plan.run(data.q[:, 0], data.k_cache, data.v_cache, data.block_table, data.context_lens, out=out)
    fn()
    one, many = cuda_graph_of(fn, 1), cuda_graph_of(fn, RUNS)
    flush = torch.empty(2**27, dtype=torch.float32, device="cuda").normal_()

    def before_each(prepare) -> float:
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(rounds)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(rounds)]
        for start, end in zip(starts, ends):
            prepare()
            start.record()
            one.replay()
            end.record()
        torch.cuda.synchronize()
        return sorted(s.elapsed_time(e) for s, e in zip(starts, ends))[rounds // 2] * 1e3

    us = {"do_bench": min(do_bench(one.replay, warmup=10, rep=60) for _ in range(3)) * 1e3,
          "read flush": before_each(lambda: flush.sum()),
          "write flush": before_each(lambda: flush.zero_()),
          "back to back": min(do_bench(many.replay, warmup=10, rep=60) for _ in range(3)) / RUNS * 1e3}
    cells = ", ".join(f"{k} {v:.1f} us ({data.kv_bytes / (v * 1e-6) / 1e12:.2f} TB/s)" for k, v in us.items())
    print(f"{name} {plan.config.to_json()}: {cells}", flush=True)


def main() -> None:
    def balanced(**kw):
        return dict(dict(VARIANT="balanced", BLOCK_N=64, PARTITION_SIZE=256, BLOCK_M=16, num_warps=4, num_stages=2), **kw)

    def split(partition, **kw):
        return dict(dict(VARIANT="split", BLOCK_N=64, PARTITION_SIZE=partition, BLOCK_M=16, num_warps=4,
                         num_stages=2), **kw)

    configs = ([balanced(), balanced(BLOCK_N=32), balanced(BLOCK_N=32, num_stages=3), balanced(num_stages=3),
                balanced(num_stages=4), balanced(BLOCK_N=128)]
               + [split(p) for p in (512, 1024, 2048)] + [split(1024, num_stages=3), split(2048, num_stages=3)])
    flush_effect("32k", [32768], (32, 8, 128))
    flush_effect("32k+7x500", [32768] + [500] * 7, (32, 8, 128))
    flush_effect("256x100-4000", [100 + (i * 3881) % 3900 for i in range(256)], (32, 8, 128))
    profile("32k", [32768], (32, 8, 128), configs)
    profile("32k", [32768], (32, 8, 128), [balanced()], [{"items_per_sm": n} for n in (2, 4, 16, 32)])
    profile("32k", [32768], (32, 8, 128), [balanced(PARTITION_SIZE=512)])
    profile("16x1k-32k", [1000 + (i * 1661) % 31000 for i in range(16)], (16, 8, 256), [balanced(), split(1024)])


if __name__ == "__main__":
    main()
