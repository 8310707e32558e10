"""ncu driver for the flash backward: the family's untuned Gluon backward (its preprocess, main kernel and dQ cast)
and, unless --ours-only, SDPA's cuDNN backward, causal 2 x 32 x 4096 bf16 (--shape B,HQ,HKV,S,D[,causal]: another),
one call each inside the profiler range (results/ncu_bwd_2026-12-04/family_*.txt). On a Hopper GPU:
    ncu --profile-from-start off --kernel-name regex:attn_bwd_gluon --section SourceCounters --page source \
        --print-source sass --csv python benchmarks/prototypes/ncu_flash_bwd.py --ours-only > src.csv
    ncu --profile-from-start off --section SpeedOfLight --section MemoryWorkloadAnalysis \
        python benchmarks/prototypes/ncu_flash_bwd.py
"""
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ["AUTOTILE_VENDOR"] = "0"

from autotile.device import cuda_device  # noqa: E402
from autotile.families.flash import FAMILY, FlashProblem  # noqa: E402
from flash_bench import kernel_call, sdpa_calls  # noqa: E402
from ncu_window import profile_once  # noqa: E402

device = cuda_device()
shape = sys.argv[sys.argv.index("--shape") + 1].split(",") if "--shape" in sys.argv else "2,32,32,4096,128,causal".split(",")
batch, heads_q, heads_kv, seq, head_dim = map(int, shape[:5])
problem = FlashProblem("bwd", batch, heads_q, heads_kv, seq, seq, head_dim, causal=shape[5:] == ["causal"])
inputs = FAMILY.make_inputs(problem, device, seed=0)
fns = [kernel_call(problem, FAMILY.default_config(problem, device), inputs)]
if "--ours-only" not in sys.argv:
    fns.append(sdpa_calls(problem, inputs)["SDPA cuDNN"])
profile_once(fns)
