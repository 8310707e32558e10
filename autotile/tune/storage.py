"""Optuna's storage for a study: any SQL URL, with SQLite made safe for several searches at once."""
from __future__ import annotations

import optuna
from sqlalchemy import event


def optuna_storage(url: str) -> optuna.storages.RDBStorage:
    """Optuna's RDB storage on `url` (SQLite: a 30 s busy wait and serialised transactions; others: pre-ping)."""
    engine_kwargs = {"connect_args": {"timeout": 30}} if url.startswith("sqlite") else {"pool_pre_ping": True}
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
