"""GEMM calls under Nsight Compute, cuBLAS's beside the family's: kernel-only durations and the kernels cuBLAS picks.

Run from the repository root on a CUDA machine (each call launches 4 times; the fourth sits in an NVTX range
named after the call):
    ncu --clock-control none --nvtx -k "regex:gemm|nvjet|sm90|xmma|cutlass|splitK|reduce" \
        --metrics gpu__time_duration.sum,launch__grid_size,dram__bytes_read.sum python3 benchmarks/ncu_gemm_calls.py
`--cases FILE` replaces CASES with a JSON list of [M, N, K, [call, ...]], each call null, "default" or a config
dict (a row's "configs" entry of a decode_stream_candidates.py JSON).
"""
import argparse
import json
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent.parent)]
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from autotile.device import resolve_gpu  # noqa: E402
from autotile.families.gemm import FAMILY, contiguous_problem  # noqa: E402
from autotile.space import Config  # noqa: E402

# (M, N, K, calls): None is cuBLAS (F.linear), "default" the policy's config, a dict that config changed.
CASES = [
    (160, 1024, 4096, [None, "default",
                       dict(VARIANT="gluon_ws", SCHEDULE="data_parallel", SPLIT_K=1),
                       dict(VARIANT="blocked", SCHEDULE="split_k", SPLIT_K=4, BLOCK_K=64, num_stages=4, GROUP_M=8)]),
    (192, 512, 3584, [None, "default", dict(VARIANT="gluon_ws", SCHEDULE="data_parallel", SPLIT_K=1)]),
    (384, 1024, 4096, [None, "default"]),
    (16, 1024, 4096, [None, "default"]),
    (1024, 1024, 4096, [None, "default"]),
    (256, 4096, 4096, [None, "default"]),
]
parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--cases", help="a JSON file of [M, N, K, [call, ...]] (default: CASES)")
args = parser.parse_args()
cases = json.loads(Path(args.cases).read_text()) if args.cases else CASES
device = resolve_gpu("auto")
labels = []
for m, n, k, configs in cases:
    problem = contiguous_problem(m, n, k, "bf16", "bf16", layout_b="col")
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    default = FAMILY.default_config(problem, device)
    for spec in configs:
        if spec is None:
            run, label = (lambda: F.linear(x, w)), "cuBLAS"
        else:
            config = default if spec == "default" else Config(dict(dict(default), **spec))
            run = (lambda config=config: FAMILY.launch(problem, config, {"a": x, "b": w.t()}, {"c": c}))
            label = str(dict(config))
        for _ in range(3):
            run()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push(f"{m}x{n}x{k} {label}")
        run()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
        labels.append(f"{m}x{n}x{k} {label[:200]}")
print(json.dumps(labels, indent=0))
