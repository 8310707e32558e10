"""Alembic migrations of autotile's tables, run programmatically (no alembic.ini needed).

Imported by the tuner and the CLI only; the runtime never migrates.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from alembic import command
from alembic.config import Config as AlembicConfig
from sqlalchemy import Engine

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"


def alembic_config(engine: Engine | None) -> AlembicConfig:
    cfg = AlembicConfig()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.attributes["engine"] = engine
    return cfg


def upgrade_to_head(engine: Engine) -> None:
    command.upgrade(alembic_config(engine), "head")


def upgrade_to(engine: Engine, revision: str) -> None:
    command.upgrade(alembic_config(engine), revision)


def head_revision() -> str:
    """The newest Alembic revision this autotile ships."""
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(alembic_config(None)).get_current_head()


def current_revision(engine: Engine) -> str | None:
    """The Alembic revision a database is at (None before the first migration)."""
    from alembic.runtime.migration import MigrationContext

    from autotile.store.models import VERSION_TABLE

    with engine.connect() as conn:
        return MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE}).get_current_revision()


@dataclass(frozen=True)
class UpgradeReport:
    """What `upgrade_database` did: schema versions and revisions before and after, and the backup it wrote."""

    url: str
    from_version: int
    to_version: int
    from_revision: str | None
    to_revision: str | None
    backup: Path | None

    @property
    def changed(self) -> bool:
        return self.from_revision != self.to_revision


def upgrade_database(url: str | None = None, *, backup: bool = True) -> UpgradeReport:
    """Migrate an autotile database to this version's schema; SQLite files are first copied to `<file>.schema<N>.bak`.

    Refuses foreign, corrupt, empty and newer databases (DatabaseError); a current one is left as it is.

    >>> upgrade_database("sqlite:////tmp/old.sqlite")  # doctest: +SKIP
    UpgradeReport(url='sqlite:////tmp/old.sqlite', from_version=1, to_version=2, ...)
    """
    from autotile.errors import DatabaseError
    from autotile.store.db import default_db_url, inspect_database, normalise_url, sqlite_path, stored_schema_version

    url = normalise_url(url) if url else default_db_url()
    # Read first: a current database needs no write (so a read-only one is "nothing to do", not refused).
    engine, state = inspect_database(url, create=False, read_only=True)
    if state == "old":
        engine.dispose()
        engine, state = inspect_database(url, create=False)
    if state == "empty":
        raise DatabaseError(f"{url} holds no autotile tables: nothing to upgrade")
    before_version, before_revision = stored_schema_version(engine), current_revision(engine)
    copy = None
    if state == "old":
        path = sqlite_path(url)
        if backup and path is not None:
            copy = backup_sqlite(path, before_version)
        upgrade_to_head(engine)
    return UpgradeReport(url, before_version, stored_schema_version(engine), before_revision,
                         current_revision(engine), copy)


def backup_sqlite(path: Path, version: int | None) -> Path:
    """A consistent copy of a (possibly WAL-mode) SQLite file, through SQLite's own backup API."""
    import sqlite3

    target = path.with_name(f"{path.name}.schema{version}.bak")
    counter = 1
    while target.exists():
        target = path.with_name(f"{path.name}.schema{version}.{counter}.bak")
        counter += 1
    with sqlite3.connect(path) as src, sqlite3.connect(target) as dst:
        src.backup(dst)
    return target
