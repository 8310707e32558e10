"""Where autotile keeps its files by default, and names for files set aside beside the ones they replace."""
from __future__ import annotations

import os
from pathlib import Path


def user_cache_dir() -> Path:
    """$XDG_CACHE_HOME/autotile, else ~/.cache/autotile: the default home of the user database and the kernel cache.
    A blank or relative XDG_CACHE_HOME is ignored, as the XDG base directory specification says."""
    xdg = (os.environ.get("XDG_CACHE_HOME") or "").strip()
    return (Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".cache") / "autotile"


def unused_name(path: Path) -> Path:
    """`path`, or `path.1`, `path.2`, ...: the first that does not exist (an earlier one is never overwritten).

    >>> import tempfile
    >>> unused_name(Path(tempfile.mkdtemp()) / "t.jsonl.unreadable").name
    't.jsonl.unreadable'
    """
    candidate, number = path, 0
    while candidate.exists():
        number += 1
        candidate = path.with_name(f"{path.name}.{number}")
    return candidate
