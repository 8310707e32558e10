"""A compile function for CompileAhead that records what it was given instead of compiling (CPU machines)."""
from __future__ import annotations

import hashlib
import os
import time


def record_compile(config_json: str) -> tuple[str, float, str]:
    time.sleep(0.2)  # long enough that a later wait_for finds it running or done, never just queued
    name = hashlib.sha256(config_json.encode()).hexdigest()[:16]
    with open(os.path.join(os.environ["AUTOTILE_TEST_COMPILE_LOG"], name), "w") as handle:
        handle.write(f"{os.getpid()} {config_json}")
    return config_json, 0.2, ""


def hang_compile(config_json: str) -> tuple[str, float, str]:
    """A compile that never ends (CompileAhead.close must not wait for it)."""
    time.sleep(3600)
    return config_json, 3600.0, ""
