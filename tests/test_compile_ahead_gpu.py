"""On a GPU: what compile-ahead's forked pool compiled from meta inputs is what a trial's real launch loads.

For a representative problem of every family (autotile.xcompile.representative_problems), a fresh process
with a fresh Triton cache makes its CUDA context and inputs, as the tuner does; a pool forked from it compiles
the default config; then the process launches that config on its real inputs. The launch must add no kernel
to the cache (it found every one under the pool's key), and its output must match the float64 reference.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parent.parent


def _cubins(cache: Path) -> set[str]:
    return {str(p.relative_to(cache)) for p in cache.rglob("*.cubin")}


def _check_every_family() -> list[dict]:
    from autotile.bench import prepare, run_checked
    from autotile.device import resolve_gpu
    from autotile.families import get_family
    from autotile.tune.compile_ahead import CompileAhead
    from autotile.xcompile import representative_problems

    device = resolve_gpu("auto")
    cache = Path(os.environ["TRITON_CACHE_DIR"])
    rows = []
    for name, problems in representative_problems().items():
        family = get_family(name)
        for index, problem in enumerate(problems):
            prepared = prepare(family, problem, device, 0)  # a CUDA context and inputs, as the tuner's process has
            config = family.default_config(problem, device)
            pool = CompileAhead(family, problem, device, 0, processes=2)
            try:
                started = time.monotonic()
                pool.submit([config])
                pool.wait_for(config, limit_s=600)
                pool_s = time.monotonic() - started
            finally:
                pool.close()
            after_pool = _cubins(cache)
            started = time.monotonic()
            outcome, _ = run_checked(family, problem, config, device, 0, prepared)
            rows.append({"family": name, "problem": index, "pool_compiled": pool.compiled, "pool_s": round(pool_s, 2),
                         "first_run_s": round(time.monotonic() - started, 3),
                         "compiled_by_launch": sorted(_cubins(cache) - after_pool),
                         "status": outcome.status.value, "error": outcome.error[:300]})
    return rows


def test_a_trial_loads_what_the_pool_compiled(tmp_path):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, __file__], env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    print(json.dumps(rows, indent=1))
    assert rows
    for row in rows:
        assert row["pool_compiled"] == 1, row
        assert row["compiled_by_launch"] == [], row
        assert row["status"] == "ok", row


if __name__ == "__main__":
    os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp())
    print(json.dumps(_check_every_family()))
