"""Whole waves of 128 x 256 tiles, then the rest in 128 x 128 tiles: two launches over a split of C (GPU).

    PYTHONPATH=. python benchmarks/prototypes/gemm_tail_tiles.py --out OUT/gemm_tail_tiles.md [--rounds 5]
    PYTHONPATH=. python benchmarks/prototypes/gemm_tail_tiles.py --plan      # the shapes and splits, no GPU

Where a problem's 128 x 256 tiles fill 3.4 waves, the fourth wave runs 40% of the SMs. Stream-K fills it by
splitting tiles over K, and lost here (its fp32 partials go through L2: results/gemm_stream_k_2026-12-02.txt);
128 x 128 tiles fill the waves but keep less of the tensor pipe busy. This tries the split CUTLASS calls a
data-parallel / tail hybrid, without partial sums: the widest block of whole 128 x 256 tiles that fills whole waves
(a block of columns, or of rows), then the rest of C in 128 x 128 tiles, one launch each on the same stream (each part
its own slice of A or B, and its own C, as a split C would get the same bytes). Timed in CUDA graphs (no host time)
with L2 flushed, interleaved with the family's default config, whole 128 x 256 tiles and cuBLAS
(`torch.matmul(x, w.t())`); medians of rounds of do_bench medians. Each part is checked against float64 first.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from autotile.device import HOPPER_SMEM_PER_BLOCK, DeviceInfo  # noqa: E402
from autotile.families.gemm import FAMILY, contiguous_problem  # noqa: E402
from autotile.families.gemm_policy import _GLUON_HALF, _GLUON_WIDE, gluon_config  # noqa: E402
from autotile.space import Config  # noqa: E402

# (label, M, N, K): projections whose 128 x 256 tiles leave the last wave part-empty and whose rest fits one wave of
# 128 x 128 tiles (Llama-3-8B, Qwen2.5-7B, Mistral-Nemo-12B, Phi-3-mini at 512-4096 tokens).
SHAPES = (("llama3-8b gate_up", 512, 28672, 4096), ("qwen2.5-7b gate_up", 512, 37888, 3584),
          ("qwen2.5-7b qkv", 2048, 4608, 3584), ("qwen2.5-7b qkv", 4096, 4608, 3584),
          ("llama3-8b qkv", 1024, 6144, 4096), ("mistral-nemo-12b o", 2048, 5120, 4096),
          ("phi3-mini qkv", 2048, 9216, 3072))
H200_PLAN = DeviceInfo("h200", "NVIDIA H200", (9, 0), 132, 150_000_000_000, HOPPER_SMEM_PER_BLOCK, "plan")
BIG, SMALL = (128, 256), (128, 128)


@dataclasses.dataclass(frozen=True)
class Split:
    """C cut along `axis` ('n': columns, 'm': rows) at `at`: [0, at) in whole big tiles, the rest in small ones."""
    axis: str
    at: int
    big_tiles: int
    small_tiles: int

    def describe(self, sms: int) -> str:
        return (f"{self.axis} < {self.at}: {self.big_tiles} tiles of 128 x 256 ({self.big_tiles / sms:.2f} waves), "
                f"then {self.small_tiles} of 128 x 128 ({self.small_tiles / sms:.2f})")


def splits(m: int, n: int, sms: int) -> list[Split]:
    """The column and row splits whose big-tile block fills whole waves at most (the widest such block) and whose
    small tiles fit one wave (more would take as long as the big tiles' last wave did)."""
    m_blocks, n_blocks = math.ceil(m / BIG[0]), math.ceil(n / BIG[1])
    waves = m_blocks * n_blocks // sms
    out = []
    if waves == 0:
        return out
    cols = waves * sms // m_blocks  # whole 256-column blocks of all rows
    if 0 < cols < n_blocks:
        at = cols * BIG[1]
        out.append(Split("n", at, m_blocks * cols, m_blocks * math.ceil((n - at) / SMALL[1])))
    rows = waves * sms // n_blocks  # whole 128-row blocks of all columns
    if 0 < rows < m_blocks:
        at = rows * BIG[0]
        out.append(Split("m", at, rows * n_blocks, math.ceil((m - at) / SMALL[0]) * math.ceil(n / SMALL[1])))
    return [split for split in out if split.small_tiles <= sms]


def parts(split: Split, m: int, n: int, k: int, a, w):
    """((problem, config, inputs, rows or columns of C), ...) of the two launches: a slice of B (columns) or of A
    (rows) each."""
    out = []
    for lo, hi, tiles in ((0, split.at, _GLUON_WIDE), (split.at, n if split.axis == "n" else m, _GLUON_HALF)):
        if split.axis == "n":
            problem, inputs = contiguous_problem(m, hi - lo, k, "bf16", "bf16", layout_b="col"), {"a": a, "b": w[lo:hi].t()}
        else:
            problem, inputs = contiguous_problem(hi - lo, n, k, "bf16", "bf16", layout_b="col"), {"a": a[lo:hi], "b": w.t()}
        out.append((problem, Config(gluon_config(problem, **tiles)), inputs, slice(lo, hi)))
    return out


def plan() -> int:
    for label, m, n, k in SHAPES:
        problem = contiguous_problem(m, n, k, "bf16", "bf16", layout_b="col")
        default = FAMILY.default_config(problem, H200_PLAN)
        print(f"{label:20s} {m}x{n}x{k}: default {default['VARIANT']} {default['BLOCK_M']}x{default['BLOCK_N']}; "
              f"128 x 256 whole: {math.ceil(m / 128) * math.ceil(n / 256) / 132:.2f} waves")
        for split in splits(m, n, 132):
            print(f"    {split.describe(132)}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--plan", action="store_true")
    args = parser.parse_args()
    if args.plan:
        return plan()
    import torch
    import triton
    import triton.testing

    from autotile.bench import cuda_graph_of, interleaved_medians
    from autotile.device import resolve_gpu
    from autotile.families.checks import compare

    device = resolve_gpu("auto")
    sms = device.sm_count
    lines = [f"# Whole waves of 128 x 256 tiles, then 128 x 128 tiles ({torch.cuda.get_device_name()}, {sms} SMs, "
             f"{datetime.date.today()}, torch {torch.__version__}, triton {triton.__version__})", "",
             "Times in us (CUDA graphs, L2 flushed, medians of interleaved rounds); ratios cuBLAS / ours.", "",
             "| shape | cuBLAS | default | 128 x 256 whole | split | split us | split / cuBLAS | default / cuBLAS |",
             "|---|---|---|---|---|---|---|---|"]
    failed = 0
    gen = torch.Generator(device="cuda").manual_seed(0)
    for label, m, n, k in SHAPES:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) / math.sqrt(k)
        want = (a.double() @ w.double().t())
        whole = contiguous_problem(m, n, k, "bf16", "bf16", layout_b="col")
        c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        fns = {"cuBLAS": lambda: torch.matmul(a, w.t())}
        for name, config in (("default", FAMILY.default_config(whole, device)),
                             ("128 x 256 whole", Config(gluon_config(whole, **_GLUON_WIDE)))):
            fns[name] = lambda config=config: FAMILY.launch(whole, config, {"a": a, "b": w.t()}, {"c": c})
        described = {}
        for split in splits(m, n, sms):
            launches = []
            for problem, config, inputs, part in parts(split, m, n, k, a, w):
                out = {"c": torch.empty(problem.m, problem.n, device="cuda", dtype=torch.bfloat16)}
                FAMILY.launch(problem, config, inputs, out)
                torch.cuda.synchronize()
                ref = want[:, part] if split.axis == "n" else want[part]
                result = compare("c", out["c"], ref, FAMILY.tolerance(problem))
                if not result.ok:
                    failed += 1
                    print(f"WRONG {label} {split}: {result.message}", flush=True)
                launches.append((problem, config, inputs, out))
            name = f"split {split.axis}"
            described[name] = split.describe(sms)
            fns[name] = lambda launches=launches: [FAMILY.launch(p, cfg, i, o) for p, cfg, i, o in launches]
        graphs = {name: cuda_graph_of(fn) for name, fn in fns.items()}
        ms = interleaved_medians(graphs, args.rounds,
                                 lambda g: triton.testing.do_bench(g.replay, warmup=10, rep=50, return_mode="median"))
        us = {name: value * 1e3 for name, value in ms.items()}
        for name, text in described.items() or {"-": "no split fills a whole wave"}.items():
            split_us = us.get(name, float("nan"))
            lines.append(f"| {label} {m}x{n}x{k} | {us['cuBLAS']:.1f} | {us['default']:.1f} | {us['128 x 256 whole']:.1f} "
                         f"| {text} | {split_us:.1f} | {us['cuBLAS'] / split_us:.3f}x | {us['cuBLAS'] / us['default']:.3f}x |")
        print("\n".join(lines[-max(1, len(described)):]), flush=True)
    text = "\n".join(lines) + "\n"
    if args.out:
        args.out.write_text(text)
    print(text)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
