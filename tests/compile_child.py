"""Running a test module's compile step in a child process, where Triton compiles for real.

The test process runs with TRITON_INTERPRET=1 (conftest.py), and Triton fixes at import whether its
language helpers compile, so cross-compiling for a GPU target happens in a fresh interpreter. The
module runs itself as a script and prints its results as JSON on its last line.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def run_compile_child(module_file: str, timeout: float = 600):
    """Run `module_file` as a script without TRITON_INTERPRET and return the JSON of its last output line."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parent.parent
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, module_file], env=env, cwd=root, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


# Scalar parameters that are floats (the others are integers).
FLOAT_SCALARS = ("scale", "softcap_log2")


def launch_signature(kernel, pointers: dict[str, str]) -> tuple[dict, dict]:
    """A Triton kernel's (signature, attrs) for ASTSource, specialised as real launches are.

    Pointer parameters (`*_ptr`) get the dtype named in `pointers` (fp32 otherwise) and 16-byte alignment;
    `scale` and `softcap_log2` are fp32; other integers are i32, strides divisible by 16 (16-element rows).
    """
    signature, attrs = {}, {}
    for index, param in enumerate(kernel.params):
        if param.is_constexpr:
            signature[param.name] = "constexpr"
        elif param.name.endswith("_ptr"):
            signature[param.name] = "*" + pointers.get(param.name, "fp32")
            attrs[(index,)] = [["tt.divisibility", 16]]
        else:
            signature[param.name] = "fp32" if param.name in FLOAT_SCALARS else "i32"
            if param.name.startswith("stride"):
                attrs[(index,)] = [["tt.divisibility", 16]]
    return signature, attrs


def map_in_processes(fn, items: list, processes: int = 2) -> list:
    """[fn(item) for item in items], in `processes` forked processes: compiling is CPU-bound and CI has two
    cores. Forked, not spawned: the processes start with what this one imported (no second torch import),
    so with a warm Triton cache the pool costs next to nothing. Call it from the child process only."""
    import multiprocessing

    if processes <= 1 or len(items) <= 1:
        return [fn(item) for item in items]
    with multiprocessing.get_context("fork").Pool(processes) as pool:
        return pool.map(fn, items, chunksize=1)
