"""Optuna's storage for a study: a journal file per study beside a SQLite database, or any SQL URL.

Optuna's FAQ advises against SQLite for parallel workers and recommends its
JournalFileBackend on one host: an append-only file of operations under a
file lock, which each process replays. It is also much cheaper for one
search: TPE reads every trial of the study for each parameter it suggests,
and Optuna's RDB storage answers each read with SQL queries and commits each
suggested parameter. Measured on the development CPU (the tuner's own loop
replaying a stored H200 table, 30 trials of a 13-axis GEMM space): 263 ms of
search a trial with the study in SQLite, 65 ms in a journal file; Optuna alone
(ask, 13 suggestions, tell, 5 trials queued) 170 ms against 21. Two searches at once on a 2-core CPU: 150-190 ms a trial in SQLite, 30-44 in
a journal.

So a study whose database is a SQLite file lives in its own journal file
beside it (`study_journal`: `tuning.sqlite.studies/<study>.journal`), whatever
the number of searches: one file per study, because a journal is replayed in
full whenever it is opened and a database gathers hundreds of studies. A
study an older autotile kept in the database itself stays there
(autotile.tune.driver). A server URL (PostgreSQL) keeps its studies, for
several hosts; `--storage journal:PATH` names a journal for tuners started
separately.

A journal is named `journal:PATH` (or a path ending in `.journal`) wherever a
storage URL is taken (`--storage`).
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import threading
from pathlib import Path

import optuna
from sqlalchemy import event
from sqlalchemy.exc import SQLAlchemyError

from autotile.errors import DatabaseError
from autotile.paths import unused_name
from autotile.store.db import driver_message, safe_url, schema_lock, switch_to_wal

log = logging.getLogger("autotile.tune")

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


# Folder beside a SQLite database that holds its studies' journals: `<database file>` + this suffix.
STUDIES_SUFFIX = ".studies"


def study_journal(db_url: str, study: str) -> str | None:
    """`journal:<database file>.studies/<study>.journal` for a SQLite file URL; None for a server or an in-memory
    database.

    >>> study_journal("sqlite:////data/tuning.sqlite", "autotile:gemm:h200/sm90:0a1b:t2c3")
    'journal:/data/tuning.sqlite.studies/autotile_gemm_h200_sm90_0a1b_t2c3.journal'
    """
    from autotile.store.db import sqlite_path

    path = sqlite_path(db_url)
    if path is None:
        return None
    return f"{JOURNAL_PREFIX}{path}{STUDIES_SUFFIX}/{_file_name(study)}{JOURNAL_SUFFIX}"


def _file_name(study: str) -> str:
    # Study names hold ':' and the device key's '/'.
    return re.sub(r"[^A-Za-z0-9._-]", "_", study)


def journal_storage(url: str) -> optuna.storages.JournalStorage:
    """Optuna's journal storage on the file `url` names (the file and its folder are created when missing)."""
    from optuna.storages.journal import JournalFileBackend

    path = journal_path(url)
    path.parent.mkdir(parents=True, exist_ok=True)
    # NOTE: not Optuna's symlink or open-file locks: a process killed while it holds one (a SIGKILL, a second
    # Ctrl-C) leaves the lock file behind, and the next tuner of the study waited out Optuna's 30 s grace
    # period before it could write. An flock is released by the kernel when its holder dies (as the database's
    # schema lock, autotile.store.db.schema_lock).
    return optuna.storages.JournalStorage(JournalFileBackend(str(path), lock_obj=FlockLock(str(path))))


class FlockLock:
    """The lock of a journal file's appends: an exclusive flock on `<journal>.lock`, for the processes of a host,
    and a mutex for the threads of this process (flocks of one process on separate opens also exclude each other,
    but the descriptor is kept on the object).

    Optuna's JournalFileBackend calls `acquire()` and `release()` around each append (its lock classes'
    interface, duck-typed: their base class is private to Optuna). With the lock held no writer is mid-append, so
    a journal that does not end in a newline ends in the cut record of a writer that died writing it (killed, or
    a full disk): `acquire` drops that tail. Left there, the next append would be glued to it, and every later
    read of the study failed.
    """

    def __init__(self, journal: str):
        self._journal = journal
        self._path = journal + ".lock"
        self._threads = threading.Lock()
        self._fd: int | None = None

    def acquire(self) -> bool:
        self._threads.acquire()
        try:
            fd = os.open(self._path, os.O_CREAT | os.O_RDWR, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except BaseException:
                os.close(fd)
                raise
        except BaseException:
            self._threads.release()
            raise
        self._fd = fd
        try:
            _drop_cut_tail(self._journal)
        except BaseException:
            self.release()
            raise
        return True

    def release(self) -> None:
        fd, self._fd = self._fd, None
        try:
            if fd is not None:
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)
        finally:
            self._threads.release()


def _drop_cut_tail(journal: str) -> None:
    """Truncate `journal` after its last newline when it does not end in one (call with its lock held)."""
    try:
        handle = open(journal, "rb+")
    except FileNotFoundError:
        return
    with handle:
        size = handle.seek(0, os.SEEK_END)
        if size == 0:
            return
        handle.seek(size - 1)
        if handle.read(1) == b"\n":
            return
        end = size
        while end > 0:  # back to the last newline, a block at a time
            start = max(0, end - 65536)
            handle.seek(start)
            block = handle.read(end - start)
            newline = block.rfind(b"\n")
            if newline >= 0:
                end = start + newline + 1
                break
            end = start
        handle.truncate(end)
        handle.flush()
        os.fsync(handle.fileno())
    log.warning("autotile: %s ended in a cut record (a writer died while appending it): %d bytes dropped",
                journal, size - end)


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


# What replaying a damaged journal raises: a line that is not JSON, bytes that are not UTF-8.
JOURNAL_DAMAGE = (json.JSONDecodeError, UnicodeDecodeError)


def own_storage(url: str) -> optuna.storages.BaseStorage:
    """optuna_storage of a study's storage that autotile chose (its journal beside the database, or the database):
    a journal that cannot be replayed (damaged: a line that is not JSON, bytes that are not UTF-8) is moved aside to
    `<journal>.damaged` (said once) and the study starts a new one; the database keeps every trial it recorded."""
    try:
        return optuna_storage(url)
    except JOURNAL_DAMAGE as exc:
        if not is_journal(url):
            raise
        return set_damaged_journal_aside(url, exc)


def open_study(storage, name: str) -> optuna.Study:
    """The study `name` in `storage`, created where it is not there yet (every study autotile runs minimises)."""
    return optuna.create_study(study_name=name, storage=storage, direction="minimize", load_if_exists=True)


def create_own_study(storage, url: str, name: str) -> tuple[optuna.Study, optuna.storages.BaseStorage]:
    """open_study of `name` in the storage own_storage(url) opened, and the storage it lives in. NOTE: Optuna
    replays a journal whose last line is cut short, and fails once a record follows it: such a journal is set aside
    as own_storage sets aside one it cannot replay, and the study starts in a new one."""
    try:
        return open_study(storage, name), storage
    except JOURNAL_DAMAGE as exc:
        if not is_journal(url):
            raise
        storage = set_damaged_journal_aside(url, exc)
        return open_study(storage, name), storage


def set_damaged_journal_aside(url: str, exc: Exception) -> optuna.storages.BaseStorage:
    """Move the journal `url` names to `<journal>.damaged` (said once); a new, empty journal's storage."""
    path = journal_path(url)
    aside = unused_name(path.with_name(path.name + ".damaged"))
    path.replace(aside)
    log.warning("autotile: the study journal %s could not be replayed (%s: %s); it was moved to %s and the "
                "search starts a new study (the database keeps the trials it recorded)", path,
                type(exc).__name__, str(exc)[:120], aside)
    return optuna_storage(url)


def given_storage(url: str) -> optuna.storages.BaseStorage:
    """optuna_storage of the URL a user gave as --storage: one that cannot be opened is named as that, not as the
    database of winners (--db), whose own failures keep their messages."""
    try:
        return optuna_storage(url)
    except (SQLAlchemyError, ImportError, ValueError) as exc:
        raise DatabaseError(f"cannot open the study storage {safe_url(url)} ({type(exc).__name__}: "
                            f"{driver_message(exc)}); check the --storage URL (a database URL SQLAlchemy knows, or "
                            "journal:FILE) and that its server is up") from None


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
        switch_to_wal(dbapi_conn)
        dbapi_conn.execute("PRAGMA synchronous=NORMAL")

    @event.listens_for(engine, "begin")
    def _begin_immediate(conn):
        conn.exec_driver_sql("BEGIN IMMEDIATE")

    engine.dispose()  # connections opened before the listeners would keep pysqlite's own handling
