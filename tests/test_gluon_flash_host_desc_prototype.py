"""benchmarks/prototypes/gluon_flash_host_desc.py, the flash family's gluon_ws forward with its TMA descriptors built
on the host: the source patch still applies to the rendered template, and the kernel compiles for sm90 with no global
scratch (nothing built on the device) within the H200's shared memory. The compile runs in a child process (this one
runs Triton's interpreter, which does not take Gluon)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from autotile.device import planned_device

# Llama-3's short prefill (128-key blocks) and Gemma-2's head dim 256 (64-key blocks).
SHAPES = (("llama 16x512 causal", 16, 32, 8, 512, 128, True), ("gemma 16x512 causal", 16, 16, 8, 512, 256, True))


def _compile_cases() -> list:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks" / "prototypes"))
    import gluon_flash_host_desc

    return gluon_flash_host_desc.compile_variants(SHAPES)


def test_the_host_descriptor_forward_compiles_for_sm90():
    from compile_child import run_compile_child

    results = run_compile_child(__file__)
    assert [r["label"] for r in results] == [label for label, *_ in SHAPES]
    for result in results:
        assert result.get("scratch") == 0, result  # no descriptor is built on the device
        assert 0 < result["shared"] <= planned_device("h200").smem_per_block, result


if __name__ == "__main__":
    sys.stdout.write(json.dumps(_compile_cases()) + "\n")
