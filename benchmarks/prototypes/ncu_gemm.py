"""ncu driver for the GEMM family: gluon_ws configs of one bf16 GEMM and cuBLAS, one launch each inside the profiler
range (results/ncu_gemm_2026-12-04/). On a Hopper GPU:
    ncu --profile-from-start off --metrics ... python benchmarks/prototypes/ncu_gemm.py 2048 4096 4096 dp256 sk256
Presets: dp256, dp128 (whole tiles), sk256 (stream-K), split4 (split-K tail).
"""
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ["AUTOTILE_VENDOR"] = "0"

import torch  # noqa: E402

from autotile.device import cuda_device  # noqa: E402
from autotile.families.gemm import FAMILY, contiguous_problem  # noqa: E402
from autotile.families.gemm_policy import gluon_config  # noqa: E402
from ncu_window import profile_once  # noqa: E402

m, n, k = (int(x) for x in sys.argv[1:4])
presets = {"dp256": dict(BLOCK_N=256, BLOCK_K=64, num_stages=3), "dp128": dict(BLOCK_N=128, BLOCK_K=64, num_stages=5),
           "sk256": dict(BLOCK_N=256, BLOCK_K=64, num_stages=3, SCHEDULE="stream_k"),
           "split4": dict(BLOCK_N=256, BLOCK_K=64, num_stages=3, SCHEDULE="split_k", SPLIT_K=4)}
p = contiguous_problem(m, n, k, "bf16", "bf16", layout_b="col")
dev = cuda_device()
inputs = FAMILY.make_inputs(p, dev, seed=1)
outputs = FAMILY.allocate_outputs(p, inputs)
space = FAMILY.space(p, dev)
fns = []
for name in sys.argv[4:]:
    c = space.admit(gluon_config(p, **presets[name])) or space.admit(gluon_config(p, **presets[name], GROUP_M=1))
    print(name, c.to_json(), flush=True)
    fns.append(lambda c=c: FAMILY.launch(p, c, inputs, outputs))
a, w = inputs["a"], inputs["b"].t()
fns.append(lambda: torch.matmul(a, w.t()))
profile_once(fns)
