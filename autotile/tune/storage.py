"""Optuna's storage for a study: any SQL URL (SQLite made safe for several searches), or a journal file.

Optuna's FAQ advises against SQLite for parallel workers and recommends its
JournalFileBackend on one host: an append-only file of operations under a
file lock, which each process replays. Measured on a 2-core CPU (Optuna 5.0,
one search's storage calls per trial: ask, 11 suggestions, 4 user attributes,
a read of the running trials, tell): one process 50 ms a trial on SQLite, 33
on a journal; two processes at once 150-190 ms on SQLite (each transaction
takes the write lock), 30-44 ms on a journal. So several searches of one host
(`--gpus 0,1,...`) keep their study in a journal file beside a SQLite
database (`journal_beside`); one search keeps it in the database itself, where
the reports read it, and a server URL (PostgreSQL) serves several hosts.

A journal is named `journal:PATH` (or a path ending in `.journal`) wherever a
storage URL is taken (`--storage`).
"""
from __future__ import annotations

from pathlib import Path

import optuna
from sqlalchemy import event

from autotile.store.db import schema_lock

JOURNAL_PREFIX = "journal:"
JOURNAL_SUFFIX = ".journal"


def is_journal(url: str) -> bool:
    """Whether a storage URL names a journal file (`journal:PATH` or a path ending in `.journal`)."""
    return url.startswith(JOURNAL_PREFIX) or ("://" not in url and url.endswith(JOURNAL_SUFFIX))


def journal_path(url: str) -> Path:
    """The file a journal storage URL names (`journal:///abs/path`, `journal:rel/path` or a bare path)."""
    raw = url.removeprefix(JOURNAL_PREFIX)
    raw = raw.removeprefix("//")  # journal:///abs/path, as SQLAlchemy spells file URLs
    if not raw:
        raise ValueError(f"{url!r} names no journal file: give journal:PATH")
    return Path(raw).expanduser().resolve()


def journal_beside(db_url: str) -> str | None:
    """`journal:<database file>.journal` for a SQLite file URL; None for a server or an in-memory database."""
    from autotile.store.db import sqlite_path

    path = sqlite_path(db_url)
    return None if path is None else f"{JOURNAL_PREFIX}{path}{JOURNAL_SUFFIX}"


def journal_storage(url: str) -> optuna.storages.JournalStorage:
    """Optuna's journal storage on the file `url` names (the file and its folder are created when missing)."""
    from optuna.storages.journal import JournalFileBackend, JournalFileOpenLock

    path = journal_path(url)
    path.parent.mkdir(parents=True, exist_ok=True)
    # NOTE: the open-lock (O_CREAT | O_EXCL on a lock file) rather than the default symlink lock: it also
    # works on file systems without symlinks. A lock file left by a killed process is broken after Optuna's
    # grace period (30 s).
    return optuna.storages.JournalStorage(JournalFileBackend(str(path), lock_obj=JournalFileOpenLock(str(path))))


def optuna_storage(url: str) -> optuna.storages.BaseStorage:
    """Optuna's storage on `url`: a journal file (see `is_journal`), or the RDB storage (SQLite: a 30 s busy wait
    and serialised transactions; others: pre-ping)."""
    if is_journal(url):
        return journal_storage(url)
    engine_kwargs = {"connect_args": {"timeout": 30}} if url.startswith("sqlite") else {"pool_pre_ping": True}
    with schema_lock(url):  # Optuna creates its tables on first use: one process at a time, as autotile's
        storage = optuna.storages.RDBStorage(url, engine_kwargs=engine_kwargs)
    if url.startswith("sqlite"):
        _serialise_sqlite_transactions(storage.engine)
    return storage


def _serialise_sqlite_transactions(engine) -> None:
    """Make every transaction on `engine` take SQLite's write lock when it begins.

    NOTE: Optuna hands out a waiting (enqueued) trial by reading it `FOR UPDATE` and then marking it
    running. SQLite ignores FOR UPDATE and pysqlite begins transactions only at the first write, so two
    searches (threads or processes) could both read the trial as waiting and both run it. BEGIN
    IMMEDIATE (SQLAlchemy's recipe for SQLite transactions) makes the read and the write one step.
    PostgreSQL honours FOR UPDATE and needs nothing.
    """

    @event.listens_for(engine, "connect")
    def _driver_leaves_transactions_to_us(dbapi_conn, _record):
        dbapi_conn.isolation_level = None
        # Optuna commits once per suggested parameter: without an fsync each (see autotile.store.db).
        dbapi_conn.execute("PRAGMA journal_mode=WAL")
        dbapi_conn.execute("PRAGMA synchronous=NORMAL")

    @event.listens_for(engine, "begin")
    def _begin_immediate(conn):
        conn.exec_driver_sql("BEGIN IMMEDIATE")

    engine.dispose()  # connections opened before the listeners would keep pysqlite's own handling
