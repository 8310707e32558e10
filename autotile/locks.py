"""An exclusive lock between processes on a file of its own beside a path (POSIX advisory locks)."""
from __future__ import annotations

import contextlib
from pathlib import Path


@contextlib.contextmanager
def beside_lock(path: Path):
    """Hold an exclusive flock on `<path>.lock`. NOTE: where there are no POSIX locks (Windows), no lock: callers
    say what that costs them."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(path.with_name(path.name + ".lock"), "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
