"""Long-K prefill tails on a GPU: the Gluon variant's 128 x 256 (and 128 x 128) tiles with the tiles past the last
whole wave split over K 2-16 ways (split_k: whole waves data-parallel, every tail tile split at the same K offsets, so
the programs of a split read the same K slices of shared panels together), beside the policy's default and cuBLAS,
as a prefill chunk runs them (CUDA-graph streams, decode_stream_candidates.time_shape).

    PYTHONPATH=. python benchmarks/prefill_tail_split.py OUT/tail_split.json [BUDGET_S]
"""
import json
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]

import torch  # noqa: E402
from decode_stream_candidates import summary, time_shape  # noqa: E402

from autotile.device import current_device  # noqa: E402
from autotile.families.gemm import FAMILY, contiguous_problem  # noqa: E402
from autotile.families.gemm_policy import gluon_config  # noqa: E402

out = Path(sys.argv[1])
budget = float(sys.argv[2]) if len(sys.argv) > 2 else 200.0
# Down projections and wide gate/up weights at prefill chunks (K 14336-18944: Llama-3-8B, Mistral-7B, Qwen2.5-7B),
# and a short-K row for contrast.
SHAPES = [(3000, 3584, 18944), (2048, 4096, 14336), (3000, 4096, 14336), (4096, 3584, 18944), (2048, 3584, 18944),
          (3000, 6144, 4096)]
device = current_device(torch.device("cuda"))
gen = torch.Generator(device="cuda").manual_seed(0)
rows, failures, started = [], [], time.monotonic()
for m, n, k in SHAPES:
    if time.monotonic() - started > budget:
        break
    p = contiguous_problem(m, n, k, "bf16", "bf16", layout_b="col")
    space = FAMILY.space(p, device)
    configs = {FAMILY.default_config(p, device): "default"}
    for tiles, splits in ((dict(BLOCK_N=256, BLOCK_K=64, num_stages=3), (2, 3, 4, 6, 8, 12)),
                          (dict(BLOCK_N=128, BLOCK_K=64, num_stages=5), (4, 8, 12, 16))):
        for s in splits:
            c = space.admit(gluon_config(p, **tiles, SCHEDULE="split_k", SPLIT_K=s))
            if c is None:
                failures.append(f"{m}x{n}x{k} {tiles} split {s}: not admitted")
            else:
                configs.setdefault(c, "tile")
    rows.append(time_shape(p, configs, 5, gen, failures))
    print(summary(rows[-1]), flush=True)
    for name, us in sorted(rows[-1]["us"].items(), key=lambda kv: kv[1]):
        print(f"   {name:55s} {us:8.1f} {rows[-1]['cuBLAS_us'] / us:.3f}x", flush=True)
    out.write_text(json.dumps({"rows": rows, "failures": failures}, indent=1))
for f in failures:
    print("FAILED", f)
