"""Copy the winners and tuned policies of GPU tuning runs into tuning_db/ and rewrite its text dump.

    python benchmarks/ship_winners.py results/gemm/gemm.sqlite results/flash/flash.sqlite ...
    python benchmarks/ship_winners.py --keep-generated trace_tuned.sqlite   # fill gaps only (store.ship.copy_winners)
"""
from __future__ import annotations

import sqlite3
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from autotile.resources import shipped_db_path, shipped_dump_path  # noqa: E402
from autotile.store.db import open_engine  # noqa: E402
from autotile.store.ship import copy_policies, copy_winners, write_dump  # noqa: E402


def main(args: list[str]) -> int:
    keep_generated = "--keep-generated" in args
    paths = [a for a in args if a != "--keep-generated"]
    target = shipped_db_path()
    for path in paths:
        n = copy_winners(f"sqlite:///{Path(path).resolve()}", f"sqlite:///{target}", keep_generated=keep_generated)
        policies = copy_policies(f"sqlite:///{Path(path).resolve()}", f"sqlite:///{target}")
        print(f"{path}: {n} winners, {policies} policies")
    # The shipped file is opened read-only and immutable: keep it in rollback-journal mode, one file
    # (which needs the pooled connections of the copy closed first).
    open_engine(f"sqlite:///{target}", create=False).dispose()
    with sqlite3.connect(target) as conn:
        conn.execute("PRAGMA journal_mode=DELETE")
    write_dump(target, shipped_dump_path())
    print(f"wrote {target} and {shipped_dump_path()}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
