"""benchmarks/prototypes/gluon_gemm_pingpong.py, a ping-pong Gluon GEMM (each consumer warpgroup its own tiles),
compiles for sm90 with Triton's own ptxas: every tile it times, within the H200's shared memory, without spills,
launch scratch or serialised wgmmas. The compile runs in a child process (this one runs Triton's interpreter, which
does not take Gluon)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from autotile.device import planned_device

PROTOTYPE = Path(__file__).resolve().parent.parent / "benchmarks" / "prototypes"


def _compile_cases() -> list:
    sys.path.insert(0, str(PROTOTYPE))
    import gluon_gemm_pingpong

    return gluon_gemm_pingpong.compile_all()


def test_the_pingpong_prototype_compiles_for_sm90_without_spills():
    from compile_child import run_compile_child

    limit = planned_device("h200").smem_per_block
    results = run_compile_child(__file__)
    assert len(results) >= 4
    for built in results:
        assert built["shared"] <= limit and built["scratch"] == 0, built
        assert built["spills"] == "spill stores ['0'], wgmma warnings none", built


if __name__ == "__main__":
    sys.stdout.write(json.dumps(_compile_cases()) + "\n")
