"""Loading a benchmark script (benchmarks/*.py, not a package) as a module for its tests."""
from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType


def loaded_script(path: Path, name: str) -> Iterator[ModuleType]:
    """The script at `path` imported as module `name` (registered in sys.modules while in use): a generator
    for a pytest fixture to yield from."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)
