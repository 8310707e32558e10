"""Test-wide set-up: a private database and kernel cache, and the interpreter where there is no GPU."""
from __future__ import annotations

import os
import tempfile

import pytest
import torch

if not torch.cuda.is_available():
    # The CPU machines (and CI) run every kernel under Triton's interpreter.
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # NOTE: Gluon wraps triton.language's @jit helpers when it is first imported, and asserts they are compiled
    # functions unless the interpreter is on. Under the interpreter they are interpreted ones, so a first import
    # inside a compiled kernel module's import (render.interpreter_mode(False)) failed: it is imported here instead.
    import triton.experimental.gluon.language  # noqa: F401,E402

_scratch = tempfile.mkdtemp(prefix="autotile-tests-")
os.environ.setdefault("AUTOTILE_CACHE_DIR", os.path.join(_scratch, "cache"))
# The user database of the tests is a file nobody else writes; tests that need their own pass --db.
os.environ["AUTOTILE_DB"] = f"sqlite:///{os.path.join(_scratch, 'user.sqlite')}"


@pytest.fixture
def user_db(tmp_path, monkeypatch):
    """An empty user database of the test's own, no shipped winners, and the runtime's caches cleared around it."""
    from autotile.runtime import dispatch

    url = f"sqlite:///{tmp_path / 'user.sqlite'}"
    monkeypatch.setenv("AUTOTILE_DB", url)
    monkeypatch.setattr("autotile.resources.shipped_db_path", lambda: tmp_path / "no-shipped.sqlite")
    dispatch.clear_cache()
    yield url
    dispatch.clear_cache()
