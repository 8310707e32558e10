"""Test-wide set-up: a private database and kernel cache, and the interpreter where there is no GPU."""
from __future__ import annotations

import os
import tempfile

import torch

if not torch.cuda.is_available():
    # The CPU machines (and CI) run every kernel under Triton's interpreter.
    os.environ.setdefault("TRITON_INTERPRET", "1")

_scratch = tempfile.mkdtemp(prefix="autotile-tests-")
os.environ.setdefault("AUTOTILE_CACHE_DIR", os.path.join(_scratch, "cache"))
# The user database of the tests is a file nobody else writes; tests that need their own pass --db.
os.environ["AUTOTILE_DB"] = f"sqlite:///{os.path.join(_scratch, 'user.sqlite')}"
