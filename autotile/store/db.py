"""Opening autotile databases: URLs, engines, and the checks that refuse foreign or corrupt files.

The runtime opens databases read-only through `open_engine(url, create=False)`
and never imports Alembic; the tuner and the CLI create and migrate them
through `autotile.store.migrate`.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import sqlite3
import time
import urllib.parse
import zlib
from collections.abc import Iterator
from pathlib import Path

from sqlalchemy import Engine, create_engine, event, inspect, make_url, select, text
from sqlalchemy.exc import ArgumentError, NoSuchModuleError, SQLAlchemyError
from sqlalchemy.exc import DatabaseError as SADatabaseError
from sqlalchemy.exc import OperationalError

from autotile.errors import DatabaseError
from autotile.locks import beside_lock
from autotile.paths import user_cache_dir
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
    env = os.environ.get("AUTOTILE_DB", "").strip()  # as AUTOTILE_RECORD: blank means unset, not a file named "  "
    if env:
        return normalise_url(env)
    return f"sqlite:///{user_cache_dir() / 'tuning.sqlite'}"


def normalise_url(url_or_path: str) -> str:
    """A SQLAlchemy URL as given, or a plain file path turned into a SQLite URL."""
    if "://" in url_or_path:
        return url_or_path
    return f"sqlite:///{Path(url_or_path).expanduser().resolve()}"


def sqlite_path(url: str) -> Path | None:
    """The file a SQLite URL names (also one written as a `file:` URI); None for servers and memory."""
    if not url.startswith("sqlite:///"):
        return None
    raw = url.removeprefix("sqlite:///").split("?")[0]
    if raw.startswith("file:"):  # sqlite:///file:<percent-encoded path>?mode=ro&uri=true
        raw = urllib.parse.unquote(urllib.parse.unquote(make_url(url).database.removeprefix("file:")))
    return None if raw in ("", ":memory:") else Path(raw)


def _configure_sqlite(engine: Engine, read_only: bool) -> None:
    @event.listens_for(engine, "connect")
    def _pragmas(dbapi_conn, _record):
        cursor = dbapi_conn.cursor()
        # First: the WAL switch below takes a lock too, and with Python's default busy timeout (5 s) a process
        # opening a new file while another creates its schema gave up with "database is locked" (seen on a
        # loaded 2-core machine, tests/test_robustness_db.py::test_many_processes_create_one_new_database).
        cursor.execute(f"PRAGMA busy_timeout={_SQLITE_BUSY_TIMEOUT_MS}")
        if not read_only:
            # WAL: readers never block the writer, so tuners and the runtime can share one file.
            switch_to_wal(cursor)
            # In WAL mode NORMAL syncs at checkpoints, not at every commit: a killed process loses nothing
            # committed (only a power cut can), and each of a trial's many small commits skips an fsync.
            cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()


def switch_to_wal(cursor) -> None:
    """`PRAGMA journal_mode=WAL` on a DB-API cursor or connection, tried again while another process holds the
    lock, up to the busy timeout.

    NOTE: SQLite answers this pragma "database is locked" at once, without calling the busy handler, when
    waiting could deadlock: on a new file, a connection reading the header while another begins to write it.
    8 processes opening one new file failed so in 9 of 40 rounds; none with these retries in 60.
    """
    deadline = time.monotonic() + _SQLITE_BUSY_TIMEOUT_MS / 1000
    delay = 0.001
    while True:
        try:
            cursor.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(delay)
            delay = min(2 * delay, 0.1)


@functools.lru_cache(maxsize=32)
def _engine(url: str) -> Engine:
    try:
        engine = create_engine(url, future=True)
    except (ModuleNotFoundError, NoSuchModuleError) as exc:
        raise DatabaseError(f"{safe_url(url)} needs a database driver that is not installed ({exc}); for "
                            "PostgreSQL run `pip install 'autotile[postgres]'` and write the URL as "
                            "postgresql+psycopg://...") from None
    except ArgumentError as exc:
        raise DatabaseError(f"{safe_url(url)} is not a database URL SQLAlchemy understands ({exc}); give a SQLite file "
                            "path or a URL such as postgresql+psycopg://user@host/db") from None
    if url.startswith("sqlite"):
        _configure_sqlite(engine, read_only="mode=ro" in url)
    return engine


def driver_message(exc: BaseException) -> str:
    """The first line (at most 300 characters) of what the database driver said (SQLAlchemy's `orig`), or of `exc`
    itself; its type's name where it said nothing."""
    said = getattr(exc, "orig", None) or exc
    lines = str(said).strip().splitlines()
    return lines[0][:300] if lines else type(said).__name__


def safe_url(url: str) -> str:
    """A URL fit for messages: its password hidden."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # noqa: BLE001 - not even a URL: say it as given
        return url


class IncompleteSchemaError(DatabaseError):
    """Autotile tables without their schema version: damaged, or being created by another process right now
    (open_engine judges it again under the schema lock, which the creating process holds)."""


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
        reason = driver_message(exc)
        if sqlite_path(url) is None:
            raise DatabaseError(f"cannot read the database {safe_url(url)} ({reason}); check that the server is up and "
                                "the URL right, or point --db/AUTOTILE_DB elsewhere") from None
        path = sqlite_path(url)
        if path.exists() and not (os.access(path, os.W_OK) and os.access(path.parent, os.W_OK)):
            # SQLite's WAL needs its -wal and -shm files beside the database: a read-only file, folder or file
            # system says "unable to open database file" for a file that is whole.
            raise DatabaseError(f"{url} cannot be written ({reason}: a read-only file, folder or file system); this "
                                "command writes to it: point --db/AUTOTILE_DB at a writable copy (autotile list, "
                                "report and db export read it as it is)") from None
        lowered = reason.lower()
        if path.is_dir() or any(needle in lowered for needle in ("disk i/o error", "database or disk is full",
                                                                 "no space left", "malformed")):
            # A folder, a full disk, a damaged file: said as every other command says it.
            raise DatabaseError(database_failure(exc, url) or reason) from None
        raise DatabaseError(f"{url} is not a readable database ({reason}); point --db/AUTOTILE_DB at another file "
                            "or move this one away") from None
    ours = {t for t in tables if t.startswith("autotile_")}
    foreign = tables - ours - OPTUNA_TABLES
    if not ours:
        if foreign:
            raise DatabaseError(f"{url} is not an autotile database (it has tables {sorted(foreign)[:5]}); "
                                "use a new file or an empty database")
        return "empty"
    if Meta.__tablename__ not in ours:
        raise IncompleteSchemaError(f"{url} has autotile tables but no {Meta.__tablename__}: it is damaged; "
                                    "export what you need with sqlite3 and start a new file")
    with engine.connect() as conn:
        row = conn.execute(select(Meta.value).where(Meta.key == "schema_version")).scalar_one_or_none()
    if row is None or not row.isdigit():
        raise IncompleteSchemaError(f"{url} has no schema version: it is damaged")
    version = int(row)
    if version > SCHEMA_VERSION:
        raise DatabaseError(f"{url} has schema version {version}, newer than this autotile's {SCHEMA_VERSION}; "
                            "upgrade autotile to read it")
    return "ok" if version == SCHEMA_VERSION else "old"


def inspect_database(url: str | None = None, *, create: bool = True, read_only: bool = False) -> tuple[Engine, str]:
    """An engine on `url` and its state ('empty', 'ok' or 'old'), after refusing foreign, corrupt or newer files.

    Nothing is created or migrated here; `create` only allows a SQLite file that does not exist yet.
    `read_only` opens a SQLite file so that nothing is written to it or beside it where that cannot be done
    (a read-only file, folder or file system); see `read_only_url`.
    """
    url = normalise_url(url) if url else default_db_url()
    path = sqlite_path(url)
    engine_url = url
    if path is not None and "mode=ro" not in url:
        if not path.exists() and (read_only or not create):
            raise DatabaseError(f"no autotile database at {path}: `autotile tune ...` makes one there, or point "
                                "--db/AUTOTILE_DB at an existing one")
        if read_only:
            engine_url = read_only_url(path)
        elif create:
            path.parent.mkdir(parents=True, exist_ok=True)
    engine = _engine(engine_url)
    return engine, check_schema(engine, url)


def stored_schema_version(engine: Engine) -> int | None:
    """The schema_version an autotile database records, or None when it has none."""
    with engine.connect() as conn:
        row = conn.execute(select(Meta.value).where(Meta.key == "schema_version")).scalar_one_or_none()
    return int(row) if row is not None and row.isdigit() else None


def open_engine(url: str | None = None, *, create: bool = True, read_only: bool = False) -> Engine:
    """An engine on a checked autotile database.

    `create` makes (and migrates) it when it is new or older, one process at a time (`schema_lock`).
    `read_only` is for readers (list, show, report, export, the runtime): nothing is created, migrated or
    written, and a file on a read-only folder or file system can be read.

    >>> engine = open_engine("sqlite:////tmp/tuning.sqlite", create=False, read_only=True)  # doctest: +SKIP
    """
    url = normalise_url(url) if url else default_db_url()
    create = create and not read_only
    try:
        engine, state = inspect_database(url, create=create, read_only=read_only)
    except IncompleteSchemaError:
        if not create:
            raise
        # Another process may be creating the tables at this moment: judged again under the schema lock below.
        engine, state = _engine(url), "incomplete"
    if state == "old" and not create:
        raise DatabaseError(f"{url} has an older schema; run `autotile db upgrade --db {url}`")
    if state == "empty" and not create:
        raise DatabaseError(f"{url} holds no autotile tables")
    if state != "ok":
        with schema_lock(url):
            state = check_schema(engine, url)  # another process may have made it meanwhile
            if state == "empty" and sqlite_path(url) is not None:
                from autotile.store.fresh_schema import create_fresh_sqlite

                create_fresh_sqlite(engine)  # the migrated schema, without importing Alembic
            elif state != "ok":
                from autotile.store.migrate import backup_sqlite, upgrade_to_head

                path = sqlite_path(url)
                if state == "old" and path is not None:  # as `autotile db upgrade` does: a copy first, and said
                    copy = backup_sqlite(path, stored_schema_version(engine))
                    logging.getLogger("autotile").warning(
                        "autotile: %s had an older schema: migrated to this autotile's; its copy before is %s", url, copy)
                upgrade_to_head(engine)
    return engine


def read_only_url(path: Path) -> str:
    """SQLite URL that opens a file read-only, without the WAL pragma or any other write.

    In a folder this process may write, SQLite's own read-only mode (it takes read locks and sees every
    commit of a tuner writing the file at the time). In a read-only folder (the shipped database in
    site-packages, a container image, a shared mount) a file with its -wal and -shm beside it is read
    through them; otherwise it is opened immutable, as SQLite could not create them.
    """
    wal, shm = Path(f"{path}-wal"), Path(f"{path}-shm")
    if os.access(path.parent, os.W_OK) or (wal.exists() and shm.exists()):
        return _file_uri(path, "mode=ro")
    # NOTE: immutable: SQLite takes no locks and reads no -wal. Right for a read-only folder, where no
    # process with our rights writes; commits still in a -wal there without its -shm are not seen.
    return _file_uri(path, "mode=ro&immutable=1")


def _file_uri(path: Path, params: str) -> str:
    # Quoted twice: SQLAlchemy unquotes the database part of a URL once, and SQLite decodes its URI once.
    quoted = urllib.parse.quote(urllib.parse.quote(str(path), safe="/"), safe="/")
    return f"sqlite:///file:{quoted}?{params}&uri=true"


# pg_advisory_xact_lock key of autotile's schema work (any 64-bit number other programs are unlikely to use).
_PG_SCHEMA_LOCK_KEY = zlib.crc32(b"autotile schema") << 16


@contextlib.contextmanager
def schema_lock(url: str) -> Iterator[None]:
    """Hold a lock that serialises creating and migrating tables on the database `url`, across processes.

    Several tuners starting on a new database at once (one search process per GPU, several hosts) would
    race in `CREATE TABLE` and Alembic's version row. SQLite: an exclusive flock on `<file>.lock` beside the
    file. PostgreSQL: a transaction-scoped advisory lock, held by a transaction open for the block. Other
    servers: no lock. Used for autotile's migrations and for Optuna's table creation (autotile.tune.storage).

    >>> with schema_lock("sqlite:////tmp/autotile-doctest.sqlite"):
    ...     pass  # create tables here; another process waits at the `with` meanwhile
    """
    path = sqlite_path(url)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        # NOTE: a lock on a file of its own: a lock taken (or a file closed) on the database itself would
        # drop SQLite's POSIX locks on it (see check_schema). Not POSIX (Windows): no lock; start the first tuner
        # alone there.
        with beside_lock(path):
            yield
        return
    if make_url(url).get_backend_name() == "postgresql":
        with _engine(url).begin() as conn:
            conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _PG_SCHEMA_LOCK_KEY})
            yield
        return
    yield


# What a database failure's text says is wrong, and what to do about it (first match wins).
_FAILURES = (
    (("malformed", "not a database", "disk image"), "the file is damaged",
     "move it away (tuning starts a new one), or recover what is left with `sqlite3 FILE .recover | sqlite3 NEW`"),
    (("database or disk is full", "disk i/o error", "no space left"), "the disk is full (or failed)",
     "free some space and run the command again; everything committed before is kept"),
    (("readonly database", "read-only"), "the database is read-only",
     "this command writes to it: point --db/AUTOTILE_DB at a writable copy"),
    (("database is locked",), "another process held the database's write lock too long",
     "run the command again when the other tuner is done or idle"),
    (("unable to open database file",), "the file cannot be opened",
     "check the path, and that its folder exists and may be read"),
)


def database_failure(exc: BaseException, url: str | None = None) -> str | None:
    """One line naming the database, what is wrong with it and what to do, when `exc` is a failure of the
    database (damaged, full, read-only, busy, a row it cannot read); None when `exc` is something else.

    >>> from sqlalchemy.exc import OperationalError
    >>> database_failure(OperationalError("SELECT 1", {}, Exception("database disk image is malformed")),
    ...                  "sqlite:////tmp/a.sqlite")[:53]
    'database sqlite:////tmp/a.sqlite: the file is damaged'
    """
    cause = _database_cause(exc)
    if cause is None:
        return None
    detail_line = driver_message(cause)
    full_url = normalise_url(url) if url else default_db_url()
    where, path = safe_url(full_url), sqlite_path(full_url)
    if path is not None and path.is_dir():  # SQLite calls a folder a "disk I/O error"
        return (f"database {where} is a folder, not a database file ({detail_line}); point --db/AUTOTILE_DB at a file "
                f"in it, e.g. --db {path / 'tuning.sqlite'}")
    for needles, what, fix in _FAILURES:
        if any(n in detail_line.lower() for n in needles):
            return f"database {where}: {what} ({detail_line}); {fix}"
    if not isinstance(cause, (SQLAlchemyError, _sqlite3_error())):
        return (f"database {where} holds a row autotile cannot read ({type(cause).__name__}: {detail_line}): it was "
                "edited by hand or damaged; re-import the winners from an export, or move the file away")
    return f"database {where}: {type(cause).__name__}: {detail_line}"


def _sqlite3_error() -> type:
    import sqlite3

    return sqlite3.Error


def _database_cause(exc: BaseException) -> BaseException | None:
    """The database error behind `exc` (Optuna wraps SQLAlchemy's), or an error raised while reading a row."""
    seen = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, (SQLAlchemyError, _sqlite3_error())):
            return current
        current = current.__cause__ or current.__context__
    if isinstance(exc, (ValueError, TypeError, KeyError, OverflowError)) and _raised_in_sqlalchemy(exc):
        return exc  # e.g. a JSON column holding text that is not JSON
    return None


def _raised_in_sqlalchemy(exc: BaseException) -> bool:
    tb = exc.__traceback__
    while tb is not None:
        if f"{os.sep}sqlalchemy{os.sep}" in tb.tb_frame.f_code.co_filename:
            return True
        tb = tb.tb_next
    return False


@contextlib.contextmanager
def reading(url: str | None) -> Iterator[None]:
    """Within this block, a database that fails to be read (damaged pages, a hand-edited row) raises
    DatabaseError with one line naming the file and the fix, never a raw driver or JSON error.

    >>> import json
    >>> try:
    ...     with reading("sqlite:////tmp/t.sqlite"):
    ...         json.loads("{not json")  # as a JSON column holding a hand-edited value does
    ... except DatabaseError as exc:
    ...     print(str(exc)[:65])
    database sqlite:////tmp/t.sqlite holds a row autotile cannot read
    """
    try:
        yield
    except DatabaseError:
        raise
    except (SQLAlchemyError, _sqlite3_error(), ValueError, TypeError, KeyError, OverflowError) as exc:
        line = database_failure(exc, url)
        if line is None:
            where = safe_url(normalise_url(url) if url else default_db_url())
            line = (f"database {where} holds a row autotile cannot read ({type(exc).__name__}: {exc}): it was edited "
                    "by hand or damaged; re-import the winners from an export, or move the file away")
        raise DatabaseError(line) from None


__all__ = ["open_engine", "inspect_database", "stored_schema_version", "default_db_url", "normalise_url", "read_only_url",
           "safe_url", "check_schema", "schema_lock", "database_failure", "reading", "VERSION_TABLE"]
