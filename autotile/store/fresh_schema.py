"""A new SQLite database in one transaction, from the schema the migrations build, without importing Alembic.

Importing Alembic costs 0.5-0.6 s (H200 machines, development CPU), and a tuner that starts on a new
database paid it before its first trial. `fresh_schema_sqlite.sql` holds what running every migration on an
empty SQLite file leaves there: each table's and index's `CREATE` statement as SQLite stores it, and the rows
of autotile_meta and of Alembic's version table. `create_fresh_sqlite` replays it. A database made this way is
the migrated one, statement for statement: tests/test_store.py migrates a new file through Alembic and
compares. After a new migration, write the file again:

    python -m autotile.store.fresh_schema --write

Older databases are still upgraded by Alembic (autotile.store.migrate), and other servers are always
created by it.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from sqlalchemy import Engine, text

from autotile.store.models import VERSION_TABLE

SCHEMA_FILE = Path(__file__).resolve().parent / "fresh_schema_sqlite.sql"
# The tables whose rows a migrated new database holds (everything else starts empty).
_SEEDED_TABLES = ("autotile_meta", VERSION_TABLE)
_STATEMENT_END = ";\n"


def dump_schema(engine: Engine) -> str:
    """The autotile part of a SQLite database as SQL: its tables' and indexes' CREATE statements, then the rows
    of autotile_meta and of the version table (in key order)."""
    with engine.connect() as conn:
        # Tables in the order SQLite made them; indexes by name (Alembic's batch mode, which rebuilds a table to
        # alter it, makes that table's indexes in an order that varies from run to run).
        statements = list(conn.execute(text(
            "SELECT sql FROM sqlite_master WHERE type = 'table' AND sql IS NOT NULL AND tbl_name LIKE 'autotile%' "
            "ORDER BY rowid")).scalars())
        statements += conn.execute(text(
            "SELECT sql FROM sqlite_master WHERE type = 'index' AND sql IS NOT NULL AND tbl_name LIKE 'autotile%' "
            "ORDER BY name")).scalars().all()
        for table in _SEEDED_TABLES:
            rows = conn.execute(text(f"SELECT * FROM {table} ORDER BY 1")).all()
            for row in rows:
                values = ", ".join(_literal(value) for value in row)
                statements.append(f"INSERT INTO {table} VALUES ({values})")
    return "".join(statement + _STATEMENT_END for statement in statements)


def _literal(value) -> str:
    if value is None:
        return "NULL"
    if isinstance(value, (int, float)):
        return repr(value)
    return "'" + str(value).replace("'", "''") + "'"


def create_fresh_sqlite(engine: Engine) -> None:
    """Build autotile's tables on an empty SQLite database (Optuna's tables may be there), in one transaction."""
    statements = [s for s in SCHEMA_FILE.read_text().split(_STATEMENT_END) if s.strip()]
    with engine.begin() as conn:
        for statement in statements:
            conn.exec_driver_sql(statement)


def migrated_dump(path: Path) -> str:
    """dump_schema of a new SQLite file at `path`, built by Alembic's migrations."""
    from autotile.store.db import _engine
    from autotile.store.migrate import upgrade_to_head

    engine = _engine(f"sqlite:///{path}")
    try:
        upgrade_to_head(engine)
        return dump_schema(engine)
    finally:
        engine.dispose()


def main(argv: list[str] | None = None) -> int:
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"write {SCHEMA_FILE.name} (else print it)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        dump = migrated_dump(Path(tmp) / "new.sqlite")
    if args.write:
        SCHEMA_FILE.write_text(dump)
        print(f"wrote {SCHEMA_FILE}")
    else:
        sys.stdout.write(dump)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
