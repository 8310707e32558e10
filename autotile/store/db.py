"""Opening autotile databases: URLs, engines, and the checks that refuse foreign or corrupt files.

The runtime opens databases read-only through `open_engine(url, create=False)`
and never imports Alembic; the tuner and the CLI create and migrate them
through `autotile.store.migrate`.
"""
from __future__ import annotations

import functools
import os
from pathlib import Path

from sqlalchemy import Engine, create_engine, event, inspect, select
from sqlalchemy.exc import DatabaseError as SADatabaseError
from sqlalchemy.exc import OperationalError

from autotile.errors import DatabaseError
from autotile.store.models import SCHEMA_VERSION, VERSION_TABLE, Meta

# Tables Optuna's RDB storage creates; they may share a database with ours.
OPTUNA_TABLES = {
    "studies", "study_directions", "study_user_attributes", "study_system_attributes", "trials",
    "trial_user_attributes", "trial_system_attributes", "trial_params", "trial_values",
    "trial_intermediate_values", "trial_heartbeats", "version_info", "alembic_version",
}
# Concurrent tuners wait this long for SQLite's write lock before giving up.
_SQLITE_BUSY_TIMEOUT_MS = 30_000


def default_db_url() -> str:
    """AUTOTILE_DB, else a SQLite file in the user's cache directory."""
    env = os.environ.get("AUTOTILE_DB")
    if env:
        return normalise_url(env)
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "autotile"
    return f"sqlite:///{base / 'tuning.sqlite'}"


def normalise_url(url_or_path: str) -> str:
    """A SQLAlchemy URL as given, or a plain file path turned into a SQLite URL."""
    if "://" in url_or_path:
        return url_or_path
    return f"sqlite:///{Path(url_or_path).expanduser().resolve()}"


def sqlite_path(url: str) -> Path | None:
    if not url.startswith("sqlite:///"):
        return None
    raw = url.removeprefix("sqlite:///").split("?")[0]
    return None if raw in ("", ":memory:") else Path(raw)


def _configure_sqlite(engine: Engine, read_only: bool) -> None:
    @event.listens_for(engine, "connect")
    def _pragmas(dbapi_conn, _record):
        cursor = dbapi_conn.cursor()
        if not read_only:
            # WAL: readers never block the writer, so tuners and the runtime can share one file.
            cursor.execute("PRAGMA journal_mode=WAL")
            # In WAL mode NORMAL syncs at checkpoints, not at every commit: a killed process loses nothing
            # committed (only a power cut can), and each of a trial's many small commits skips an fsync.
            cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute(f"PRAGMA busy_timeout={_SQLITE_BUSY_TIMEOUT_MS}")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()


@functools.lru_cache(maxsize=32)
def _engine(url: str) -> Engine:
    engine = create_engine(url, future=True)
    if url.startswith("sqlite"):
        _configure_sqlite(engine, read_only="mode=ro" in url)
    return engine


def check_schema(engine: Engine, url: str) -> str:
    """'empty', 'ok' or 'old'; raises DatabaseError for foreign, corrupt or newer databases."""
    try:
        tables = set(inspect(engine).get_table_names())
    except (SADatabaseError, OperationalError) as exc:
        # NOTE: SQLite itself tells a foreign file apart. Reading its header with open() here would, on
        # close(), drop every POSIX lock this process's SQLite connections hold on the file; another
        # process then takes itself for the last connection and resets the write-ahead log under them
        # ("database disk image is malformed", https://www.sqlite.org/howtocorrupt.html section 2.2).
        if "file is not a database" in str(exc.orig):
            raise DatabaseError(f"{url} is not a SQLite database; point --db/AUTOTILE_DB at another file") from None
        raise DatabaseError(f"{url} is not a readable database ({exc.orig}); point --db/AUTOTILE_DB at another file "
                            "or move this one away") from None
    ours = {t for t in tables if t.startswith("autotile_")}
    foreign = tables - ours - OPTUNA_TABLES
    if not ours:
        if foreign:
            raise DatabaseError(f"{url} is not an autotile database (it has tables {sorted(foreign)[:5]}); "
                                "use a new file or an empty database")
        return "empty"
    if Meta.__tablename__ not in ours:
        raise DatabaseError(f"{url} has autotile tables but no {Meta.__tablename__}: it is damaged; "
                            "export what you need with sqlite3 and start a new file")
    with engine.connect() as conn:
        row = conn.execute(select(Meta.value).where(Meta.key == "schema_version")).scalar_one_or_none()
    if row is None or not row.isdigit():
        raise DatabaseError(f"{url} has no schema version: it is damaged")
    version = int(row)
    if version > SCHEMA_VERSION:
        raise DatabaseError(f"{url} has schema version {version}, newer than this autotile's {SCHEMA_VERSION}; "
                            "upgrade autotile to read it")
    return "ok" if version == SCHEMA_VERSION else "old"


def inspect_database(url: str | None = None, *, create: bool = True) -> tuple[Engine, str]:
    """An engine on `url` and its state ('empty', 'ok' or 'old'), after refusing foreign, corrupt or newer files.

    Nothing is created or migrated here; `create` only allows a SQLite file that does not exist yet.
    """
    url = normalise_url(url) if url else default_db_url()
    path = sqlite_path(url)
    if path is not None and "mode=ro" not in url:
        if not path.exists() and not create:
            raise DatabaseError(f"no autotile database at {path}")
        if create:
            path.parent.mkdir(parents=True, exist_ok=True)
    engine = _engine(url)
    return engine, check_schema(engine, url)


def stored_schema_version(engine: Engine) -> int | None:
    """The schema_version an autotile database records, or None when it has none."""
    with engine.connect() as conn:
        row = conn.execute(select(Meta.value).where(Meta.key == "schema_version")).scalar_one_or_none()
    return int(row) if row is not None and row.isdigit() else None


def open_engine(url: str | None = None, *, create: bool = True) -> Engine:
    """An engine on a checked autotile database. `create` makes (and migrates) it when it is new."""
    url = normalise_url(url) if url else default_db_url()
    engine, state = inspect_database(url, create=create)
    if state == "empty" and create:
        from autotile.store.migrate import upgrade_to_head

        upgrade_to_head(engine)
    elif state == "old":
        if not create:
            raise DatabaseError(f"{url} has an older schema; run `autotile db upgrade --db {url}`")
        from autotile.store.migrate import upgrade_to_head

        upgrade_to_head(engine)
    elif state == "empty":
        raise DatabaseError(f"{url} holds no autotile tables")
    return engine


def read_only_url(path: Path) -> str:
    """SQLite URL that opens a file read-only (the shipped database may live in a read-only site-packages).

    A file shipped in rollback-journal mode is opened immutable, so SQLite needs no -wal/-shm files
    beside it (a read-only folder could not hold them); one with a write-ahead log still beside it is
    read through that log.
    """
    if Path(f"{path}-wal").exists():
        return f"sqlite:///file:{path}?mode=ro&uri=true"
    return f"sqlite:///file:{path}?mode=ro&immutable=1&uri=true"


__all__ = ["open_engine", "inspect_database", "stored_schema_version", "default_db_url", "normalise_url", "read_only_url", "check_schema", "VERSION_TABLE"]
