"""benchmarks/prototypes/gluon_gemm_host_desc.py, the GEMM family's gluon_ws kernel with its TMA descriptors built on
the host: the source patch still applies to the rendered template, and the kernel compiles for sm90 with no global
scratch (nothing built on the device) within the H200's shared memory. The compile runs in a child process (this
one runs Triton's interpreter, which does not take Gluon)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from autotile.device import planned_device

SHAPES = ((512, 3584, 3584),)


def _compile_cases() -> list:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks" / "prototypes"))
    import gluon_gemm_host_desc

    return gluon_gemm_host_desc.compile_variants(SHAPES)


def test_the_host_descriptor_variant_compiles_for_sm90():
    from compile_child import run_compile_child

    results = run_compile_child(__file__)
    assert {r["tiles"] for r in results} == {"128x128 s5", "128x256 s3"}
    for result in results:
        assert result["scratch"] == 0, result  # no descriptor is built on the device
        assert 0 < result["shared"] <= planned_device("h200").smem_per_block, result


if __name__ == "__main__":
    sys.stdout.write(json.dumps(_compile_cases()) + "\n")
