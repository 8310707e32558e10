"""Names for files set aside beside the ones they replace."""
from __future__ import annotations

from pathlib import Path


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
