"""The SQL store: schema and migrations, round trips, refusing foreign/corrupt/newer databases, resume."""
from __future__ import annotations

import sqlite3
from pathlib import Path

import optuna
import pytest
from sqlalchemy import inspect, text

from autotile.device import interpret_device
from autotile.errors import DatabaseError
from autotile.families.gemm import FAMILY, contiguous_problem
from autotile.store.db import open_engine
from autotile.store.models import SCHEMA_VERSION
from autotile.store.repo import Store
from autotile.tune.driver import study_name, tune_problem
from autotile.tune.storage import optuna_storage, study_journal

CPU = interpret_device()
PROBLEM = contiguous_problem(20, 24, 40, "fp16", "fp16")


def test_new_database_is_migrated_and_versioned(tmp_path):
    engine = open_engine(f"sqlite:///{tmp_path / 'a.sqlite'}")
    tables = set(inspect(engine).get_table_names())
    assert {"autotile_meta", "autotile_devices", "autotile_toolchains", "autotile_problems", "autotile_trials",
            "autotile_winners", "autotile_alembic_version"} <= tables
    with engine.connect() as conn:
        assert conn.execute(text("select value from autotile_meta where key='schema_version'")).scalar() == str(SCHEMA_VERSION)
        from autotile.store.migrate import head_revision

        assert conn.execute(text("select version_num from autotile_alembic_version")).scalar() == head_revision()
        assert conn.execute(text("pragma journal_mode")).scalar() == "wal"


def test_new_sqlite_database_is_the_migrated_one_without_alembic(tmp_path):
    # A new SQLite file is built from fresh_schema_sqlite.sql: statement for statement what Alembic's migrations
    # build (after a new migration: python -m autotile.store.fresh_schema --write), and Alembic is not imported.
    import subprocess
    import sys

    from autotile.store.fresh_schema import dump_schema, migrated_dump

    made = tmp_path / "made.sqlite"
    code = ("import sys; from autotile.store.db import open_engine; "
            f"open_engine('sqlite:///{made}'); print(sorted(m for m in sys.modules if m.startswith('alembic')))")
    imported = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert imported.strip() == "[]"
    assert dump_schema(open_engine(f"sqlite:///{made}")) == migrated_dump(tmp_path / "migrated.sqlite")


def test_round_trip_of_trials_and_winners(tmp_path):
    store = Store(open_engine(f"sqlite:///{tmp_path / 'b.sqlite'}"))
    device_id = store.ensure_device(CPU)
    assert store.ensure_device(CPU) == device_id
    toolchain_id = store.ensure_toolchain()
    problem_id = store.ensure_problem(FAMILY, PROBLEM)
    config = FAMILY.default_config(PROBLEM, CPU)
    for number, ms in enumerate((3.0, 2.0)):
        store.record_trial(problem_id=problem_id, device_id=device_id, toolchain_id=toolchain_id, study="s",
                           number=number, config=config.to_json(), config_hash=config.hash, status="ok",
                           median_ms=ms, q20_ms=ms, q80_ms=ms, interpreted=1, max_abs_error=0.0, error="")
    store.record_trial(problem_id=problem_id, device_id=device_id, toolchain_id=toolchain_id, study="s", number=1,
                       config="{}", config_hash="x", status="crash", error="duplicate of trial 1 is ignored")
    assert store.best_configs(problem_id, device_id, 3) == [(config.to_json(), 2.0)]
    assert store.status_counts("s") == {"ok": 2} and store.status_counts("another") == {}
    store.save_winner(problem_id=problem_id, device=CPU, device_id=device_id, toolchain_id=toolchain_id,
                      config=config.to_json(), config_hash=config.hash, median_ms=2.0, q20_ms=1.9, q80_ms=2.1,
                      interpreted=1, trials_run=2, provenance="test")
    (winner,) = store.winners("gemm", "interpret")
    assert winner.problem_key == FAMILY.problem_key(PROBLEM) and winner.median_ms == 2.0
    assert winner.toolchain["triton"] == "3.6.0"


def test_a_winner_stored_by_another_tuner_between_read_and_insert_is_replaced(tmp_path, monkeypatch):
    """Two tuners of one study finishing together: the one whose insert meets the other's row updates it."""
    import sqlalchemy

    import autotile.store.repo as repo

    store = Store(open_engine(f"sqlite:///{tmp_path / 'race.sqlite'}"))
    ids = dict(device_id=store.ensure_device(CPU), toolchain_id=store.ensure_toolchain(),
               problem_id=store.ensure_problem(FAMILY, PROBLEM))
    config = FAMILY.default_config(PROBLEM, CPU)
    common = dict(config=config.to_json(), config_hash=config.hash, q20_ms=1.0, q80_ms=1.0, interpreted=1,
                  trials_run=2, provenance="test")
    store.save_winner(device=CPU, median_ms=3.0, **ids, **common)  # the other tuner's winner
    real_select, missed = repo.select, []

    def first_read_misses(*entities):  # this tuner read before the other one's insert
        query = real_select(*entities)
        if entities and entities[0] is repo.Winner and not missed:
            missed.append(True)
            return query.where(sqlalchemy.false())
        return query
    monkeypatch.setattr(repo, "select", first_read_misses)
    store.save_winner(device=CPU, median_ms=2.0, **ids, **common)
    assert missed and [w.median_ms for w in store.winners("gemm", "interpret")] == [2.0]


def test_opening_a_database_leaves_its_file_to_sqlite(tmp_path, monkeypatch):
    """No open()/close() of the file from Python: a close drops the SQLite locks of this process's connections."""
    import builtins

    from autotile.store import db

    path = tmp_path / "held.sqlite"
    open_engine(f"sqlite:///{path}")
    real_open = builtins.open

    def refuse_the_database(file, *args, **kwargs):
        assert not (isinstance(file, (str, Path)) and Path(file) == path), "opened the database file directly"
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", refuse_the_database)
    db._engine.cache_clear()
    open_engine(f"sqlite:///{path}")


def test_foreign_corrupt_and_newer_databases_are_refused(tmp_path):
    foreign = tmp_path / "foreign.sqlite"
    with sqlite3.connect(foreign) as conn:
        conn.execute("create table users (id integer)")
    with pytest.raises(DatabaseError, match="not an autotile database"):
        open_engine(f"sqlite:///{foreign}")
    with sqlite3.connect(foreign) as conn:  # nothing of the user's was touched
        assert conn.execute("select count(*) from sqlite_master where name='users'").fetchone() == (1,)

    corrupt = tmp_path / "corrupt.sqlite"
    corrupt.write_bytes(b"this is not a database at all" * 10)
    with pytest.raises(DatabaseError, match="not a SQLite database"):
        open_engine(f"sqlite:///{corrupt}")
    assert corrupt.read_bytes() == b"this is not a database at all" * 10

    newer = tmp_path / "newer.sqlite"
    engine = open_engine(f"sqlite:///{newer}")
    with engine.begin() as conn:
        conn.execute(text("update autotile_meta set value='99' where key='schema_version'"))
    from autotile.store import db

    db._engine.cache_clear()
    with pytest.raises(DatabaseError, match="newer than this autotile"):
        open_engine(f"sqlite:///{newer}")


def test_optuna_tables_share_the_database(tmp_path):
    url = f"sqlite:///{tmp_path / 'shared.sqlite'}"
    optuna.create_study(study_name="someone-elses", storage=url)
    open_engine(url)  # our tables join Optuna's
    assert "trials" in inspect(open_engine(url)).get_table_names()


def test_rerun_resumes_the_study(tmp_path):
    url = f"sqlite:///{tmp_path / 'resume.sqlite'}"
    first = tune_problem(FAMILY, PROBLEM, CPU, trials=2, db_url=url, retime_rounds=1)
    assert first.trials_this_run == 2 and sum(first.statuses.values()) == 2
    second = tune_problem(FAMILY, PROBLEM, CPU, trials=3, db_url=url, retime_rounds=1)
    assert second.trials_this_run == 1 and sum(second.statuses.values()) == 3
    again = tune_problem(FAMILY, PROBLEM, CPU, trials=3, db_url=url, retime_rounds=1)
    assert again.trials_this_run == 0
    name = study_name(FAMILY, PROBLEM, CPU)
    study = optuna.load_study(study_name=name, storage=optuna_storage(study_journal(url, name)))
    numbers = [t.number for t in study.trials if "status" in t.user_attrs]
    assert len(numbers) == len(set(numbers)) == 3
    trials = Store(open_engine(url)).trials("gemm")
    assert len(trials) == 3 and len({(t["study"], t["number"]) for t in trials}) == 3
    assert trials[0]["config"] == dict(FAMILY.default_config(PROBLEM, CPU))  # the default config goes first


def test_a_changed_template_starts_a_new_study(tmp_path, monkeypatch):
    from autotile import render

    url = f"sqlite:///{tmp_path / 'template.sqlite'}"
    first = tune_problem(FAMILY, PROBLEM, CPU, trials=2, db_url=url, retime_rounds=1)
    monkeypatch.setattr(render, "template_sha", lambda template: "0123456789ab")
    second = tune_problem(FAMILY, PROBLEM, CPU, trials=2, db_url=url, retime_rounds=1)
    assert second.study != first.study and second.study.endswith(":t0123456789ab")
    assert second.trials_this_run == 2  # the old kernels' timings are not reused
    assert len(Store(open_engine(url)).trials("gemm")) == 4  # and not lost either


def test_a_template_hash_covers_the_templates_it_includes(tmp_path, monkeypatch):
    """gemm.py.j2 renders gemm_gluon_ws.py.j2 and takes macros from gemm_common.j2: a change to either is a new
    version of the GEMM template, and so a new study (test above); flash_attention.py.j2 renders flash_gluon_ws.py.j2
    and flash_gluon_bwd.py.j2, and none of the GEMM's."""
    from autotile import render

    for name in ("gemm.py.j2", "gemm_gluon_ws.py.j2", "gemm_common.j2", "flash_attention.py.j2", "flash_gluon_ws.py.j2",
                 "flash_gluon_bwd.py.j2"):
        (tmp_path / name).write_text((render.templates_dir() / name).read_text())
    monkeypatch.setattr(render, "templates_dir", lambda: tmp_path)
    render.environment.cache_clear()
    render.template_sha.cache_clear()
    try:
        assert render.template_files("gemm.py.j2") == ["gemm.py.j2", "gemm_common.j2", "gemm_gluon_ws.py.j2"]
        assert render.template_files("flash_attention.py.j2") == ["flash_attention.py.j2", "flash_gluon_bwd.py.j2",
                                                                  "flash_gluon_ws.py.j2"]
        before = render.template_sha("gemm.py.j2")
        flash = render.template_sha("flash_attention.py.j2")
        (tmp_path / "gemm_common.j2").write_text((tmp_path / "gemm_common.j2").read_text() + "{# changed #}\n")
        render.template_sha.cache_clear()
        assert render.template_sha("gemm.py.j2") != before
        assert render.template_sha("flash_attention.py.j2") == flash
    finally:
        render.environment.cache_clear()
        render.template_sha.cache_clear()
