"""benchmarks/prototypes/gluon_flash_fwd.py, a FlashAttention forward in Gluon, compiles for sm90 with Triton's own
ptxas: causal and not, ping-pong and not, at head dims 64, 128 and 256, without spills, within the H200's shared memory.
The compile runs in a child process (this one runs Triton's interpreter, which does not take Gluon)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from autotile.device import planned_device

# (causal, head dim, BLOCK_N, stages, ping-pong)
CASES = [(False, 128, 128, 2, False), (True, 128, 128, 3, True), (True, 64, 128, 3, False), (False, 256, 64, 2, True)]


def _compile_cases() -> list:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks" / "prototypes"))
    import gluon_flash_fwd
    from test_gemm_compile import ptxas_report

    out = []
    for causal, head_d, block_n, stages, pingpong in CASES:
        signature = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "o_ptr": "*bf16"}
        signature.update({f"stride_{t}{d}": "i32" for t in "qkvo" for d in "bhs"})
        signature.update({"SQ": "i32", "SK": "i32", "H": "i32", "HKV": "i32", "qk_scale": "fp32"})
        constexprs = {"BLOCK_M": 128, "BLOCK_N": block_n, "HEAD_D": head_d, "STAGES": stages, "CAUSAL": causal,
                      "PINGPONG": pingpong, "num_warps": 4}
        signature.update({name: "constexpr" for name in constexprs})
        kernel = triton.compile(GluonASTSource(gluon_flash_fwd.flash_fwd_kernel, signature, constexprs),
                                target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        out.append({"shared": kernel.metadata.shared, "ptxas": ptxas_report(kernel, 90)})
    return out


def test_the_prototype_compiles_for_sm90_without_spills():
    from compile_child import run_compile_child

    limit = planned_device("h200").smem_per_block
    for case, result in zip(CASES, run_compile_child(__file__)):
        assert result["shared"] <= limit, case
        assert "0 bytes spill stores" in result["ptxas"], (case, result["ptxas"])
        assert "C7515" not in result["ptxas"] and "C7517" not in result["ptxas"], (case, "wgmma serialised")


if __name__ == "__main__":
    sys.stdout.write(json.dumps(_compile_cases()) + "\n")
