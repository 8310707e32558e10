"""Two tuner processes on one study: together they stop at --trials, and no trial is lost or run twice.

The PostgreSQL case needs a server: AUTOTILE_TEST_POSTGRES_URL names one
(`.ci/run` starts Debian's package and sets it); each run works in a fresh
database created there and dropped after. The SQLite case (one WAL file)
always runs.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import uuid

import optuna
import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from autotile.device import interpret_device
from autotile.families.gemm import GemmFamily, contiguous_problem
from autotile.store.db import open_engine
from autotile.store.repo import Store
from autotile.tune.cluster import CLAIM_ATTR, OWNER_ATTR, census, recorded_trials
from autotile.tune.driver import study_name

CPU = interpret_device()
PROBLEM = contiguous_problem(24, 32, 64, "fp16", "fp16")
TRIALS = 8
_WORKER = textwrap.dedent("""
    import json, os, pathlib, sys, time
    from autotile.device import interpret_device
    from autotile.families.gemm import FAMILY, contiguous_problem
    from autotile.tune.driver import tune_problem
    db_url, storage_url, start = sys.argv[1], sys.argv[2], pathlib.Path(sys.argv[3])
    # Both workers start tuning together: on a loaded CI machine one process's imports could otherwise take
    # longer than the other's whole study, and "both ran trials" would test start-up order.
    (start / str(os.getpid())).touch()
    deadline = time.monotonic() + 120
    while len(list(start.iterdir())) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    result = tune_problem(FAMILY, contiguous_problem(24, 32, 64, "fp16", "fp16"), interpret_device(),
                          trials={trials}, db_url=db_url, storage_url=storage_url, retime_rounds=0, lookahead=1)
    print("RESULT " + json.dumps({{"this_run": result.trials_this_run}}))
""").format(trials=TRIALS)


@pytest.fixture
def postgres_url():
    server = os.environ.get("AUTOTILE_TEST_POSTGRES_URL")
    if not server:
        pytest.skip("AUTOTILE_TEST_POSTGRES_URL is not set: no PostgreSQL server to test against "
                    "(.ci/run starts one)")
    name = f"autotile_{uuid.uuid4().hex[:12]}"
    admin = create_engine(server, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield make_url(server).set(database=name).render_as_string(hide_password=False)
    finally:
        from autotile.store.db import _engine

        _engine.cache_clear()  # drop pooled connections, or DROP DATABASE waits for them
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture
def sqlite_url(tmp_path):
    return f"sqlite:///{tmp_path / 'shared.sqlite'}"


@pytest.mark.parametrize("backend", ["sqlite_url", "postgres_url"])
def test_two_workers_share_one_study(backend, request):
    url = request.getfixturevalue(backend)
    # Both tuners find the schema in place: created once, as the README tells a cluster to do first.
    open_engine(url)
    optuna.storages.RDBStorage(url)
    this_run = _run_two_workers([(url, url), (url, url)])

    name = study_name(GemmFamily(), PROBLEM, CPU)
    rows = recorded_trials(open_engine(url), name)
    assert len(rows) == TRIALS and len(set(rows.values())) == TRIALS  # distinct trial numbers and configs
    study = optuna.load_study(study_name=name, storage=url)
    assert not study.get_trials(states=(optuna.trial.TrialState.RUNNING,))
    by_number = {t.number: t for t in study.trials}
    assert all(by_number[n].state.is_finished() and by_number[n].user_attrs.get("status") for n in rows)
    owners = {by_number[n].user_attrs[OWNER_ATTR].split(":")[1] for n in rows}
    assert len(owners) == 2 and min(this_run) >= 1  # both processes ran trials
    assert sum(Store(open_engine(url)).status_counts(name).values()) == TRIALS


def test_two_tuners_share_a_study_in_a_journal_file(tmp_path):
    """Optuna's JournalFileBackend, which its FAQ recommends for several processes of one host."""
    from autotile.tune.storage import is_journal, journal_path, optuna_storage

    url = f"sqlite:///{tmp_path / 'rows.sqlite'}"
    journal = f"journal:{tmp_path / 'study.journal'}"
    assert is_journal(journal) and is_journal(str(tmp_path / "x.journal")) and not is_journal(url)
    open_engine(url)
    this_run = _run_two_workers([(url, journal), (url, journal)])
    name = study_name(GemmFamily(), PROBLEM, CPU)
    rows = recorded_trials(open_engine(url), name)
    assert len(rows) == TRIALS and len(set(rows.values())) == TRIALS and min(this_run) >= 1
    assert journal_path(journal).stat().st_size > 0
    study = optuna.load_study(study_name=name, storage=optuna_storage(journal))
    assert not study.get_trials(states=(optuna.trial.TrialState.RUNNING,))
    told = {t.number for t in study.trials if "status" in t.user_attrs}
    assert told == set(rows)


def test_hosts_sharing_only_the_optuna_storage_split_the_trials(tmp_path):
    storage = f"sqlite:///{tmp_path / 'optuna.sqlite'}"
    own_dbs = [f"sqlite:///{tmp_path / f'host{i}.sqlite'}" for i in range(2)]
    optuna.storages.RDBStorage(storage)
    this_run = _run_two_workers([(db, storage) for db in own_dbs])
    name = study_name(GemmFamily(), PROBLEM, CPU)
    rows = [recorded_trials(open_engine(db), name) for db in own_dbs]
    assert [len(r) for r in rows] == this_run
    numbers = set(rows[0]) | set(rows[1])
    hashes = set(rows[0].values()) | set(rows[1].values())
    assert len(numbers) == len(hashes) == TRIALS  # each host ran its own trials: none twice, none lost


def test_census_counts_a_trial_that_finishes_between_its_reads(tmp_path):
    """A trial another search finishes while the count is being read is counted once, never missed."""
    url = f"sqlite:///{tmp_path / 'one.sqlite'}"
    engine = open_engine(url)
    study = optuna.create_study(study_name="race", storage=url)
    theirs = study.ask()
    theirs.set_user_attr(OWNER_ATTR, "elsewhere:1:other")
    theirs.set_user_attr(CLAIM_ATTR, "cfg-a")
    read_trials = study.get_trials
    reads = []

    def read_then_they_finish(*args, **kwargs):
        snapshot = read_trials(*args, **kwargs)
        if not reads:  # the other search records and tells its trial right after our first read
            theirs.set_user_attr("status", "ok")
            theirs.set_user_attr("config_hash", "cfg-a")
            study.tell(theirs, 1.0)
        reads.append(kwargs.get("states"))
        return snapshot

    study.get_trials = read_then_they_finish
    evaluated, claims = census(engine, study, "race", owner="here:2:mine")
    assert len(reads) == 2
    assert {**evaluated, **claims} == {theirs.number: "cfg-a"} and len(evaluated) + len(claims) == 1


def _run_two_workers(urls: list[tuple[str, str]]) -> list[int]:
    """Two tuner processes, each with its (db URL, storage URL), started together; returns the trials each ran."""
    import tempfile

    env = {**os.environ, "TRITON_INTERPRET": "1"}
    start = tempfile.mkdtemp(prefix="autotile-start-")
    workers = [subprocess.Popen([sys.executable, "-c", _WORKER, db, storage, start], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True) for db, storage in urls]
    outputs = [w.communicate(timeout=300) for w in workers]
    shutil.rmtree(start, ignore_errors=True)
    for worker, (out, err) in zip(workers, outputs):
        assert worker.returncode == 0, err[-3000:]
    this_run = [json.loads(out.split("RESULT ", 1)[1])["this_run"] for out, _ in outputs]
    assert sum(this_run) == TRIALS  # together they stop at the target
    return this_run


def test_a_journal_lock_dies_with_its_holder(tmp_path):
    """A tuner killed while it appends to a study's journal (SIGKILL, a second Ctrl-C) leaves no lock to wait
    out: the next writer gets it at once (Optuna's own lock files waited 30 s)."""
    import signal
    import subprocess
    import sys
    import time

    from autotile.tune.storage import FlockLock

    journal = str(tmp_path / "s.journal")
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time\n"
        "from autotile.tune.storage import FlockLock\n"
        f"FlockLock({journal!r}).acquire()\n"
        "print('held', flush=True)\n"
        "time.sleep(600)\n")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        holder.send_signal(signal.SIGKILL)
        holder.wait(30)
        lock = FlockLock(journal)
        started = time.monotonic()
        assert lock.acquire()
        lock.release()
        assert time.monotonic() - started < 2.0
    finally:
        holder.kill()
        holder.wait()


def test_a_journal_lock_excludes_threads_and_processes(tmp_path):
    import subprocess
    import sys
    import threading

    from autotile.tune.storage import FlockLock

    journal = str(tmp_path / "s.journal")
    lock = FlockLock(journal)
    assert lock.acquire()
    other = subprocess.run([sys.executable, "-c", (
        "import fcntl, os\n"
        f"fd = os.open({journal + '.lock'!r}, os.O_RDWR)\n"
        "try:\n"
        "    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\n"
        "    print('taken')\n"
        "except BlockingIOError:\n"
        "    print('held')\n")], capture_output=True, text=True, timeout=60)
    assert other.stdout.strip() == "held"  # another process cannot take it meanwhile
    got = threading.Event()
    thread = threading.Thread(target=lambda: (lock.acquire(), got.set(), lock.release()))
    thread.start()
    assert not got.wait(0.3)  # another thread of this process waits too
    lock.release()
    thread.join(10)
    assert got.is_set()


def test_a_journal_cut_by_a_dying_writer_still_takes_trials(tmp_path):
    """A record cut short (its writer killed mid-append, or a full disk) is dropped by the next writer, instead of
    having the next record glued to it and every later read of the study failing."""
    from autotile.tune.storage import journal_storage

    url = f"journal:{tmp_path / 's.journal'}"
    study = optuna.create_study(storage=journal_storage(url), study_name="cut")
    study.optimize(lambda trial: trial.suggest_float("x", 0, 1), n_trials=2)
    with open(tmp_path / "s.journal", "ab") as journal:
        journal.write(b'{"op_code": 4, "worker_id": "dead')
    study = optuna.load_study(storage=journal_storage(url), study_name="cut")
    study.optimize(lambda trial: trial.suggest_float("x", 0, 1), n_trials=1)
    again = optuna.load_study(storage=journal_storage(url), study_name="cut")
    assert len(again.trials) == 3 and all(t.state.is_finished() for t in again.trials)
    assert (tmp_path / "s.journal").read_bytes().endswith(b"\n")


@pytest.mark.parametrize("damage", [b"garbage{{{\n", b"\x00\x01\xffgarbage\n"])
def test_a_damaged_study_journal_beside_the_database_is_set_aside_and_a_new_one_started(tmp_path, damage, caplog):
    """A journal autotile keeps beside its database that cannot be replayed (not JSON, not UTF-8) raised Optuna's
    JSONDecodeError / UnicodeDecodeError as a traceback at every rerun of the problem."""
    from autotile.tune.storage import optuna_storage, own_storage

    url = f"journal:{tmp_path / 'db.sqlite.studies' / 's.journal'}"
    study = optuna.create_study(storage=own_storage(url), study_name="s")
    study.optimize(lambda trial: trial.suggest_float("x", 0, 1), n_trials=2)
    path = tmp_path / "db.sqlite.studies" / "s.journal"
    # Damage before a whole record: Optuna replays past a bad last line (a writer that died), not past this.
    damage += path.read_bytes().splitlines(keepends=True)[-1]
    with open(path, "ab") as journal:
        journal.write(damage)
    with pytest.raises(ValueError):
        optuna_storage(url)  # Optuna's own replay
    with caplog.at_level("WARNING", logger="autotile.tune"):
        storage = own_storage(url)
    assert "could not be replayed" in caplog.text and "s.journal.damaged" in caplog.text
    study = optuna.create_study(storage=storage, study_name="s", load_if_exists=True)
    study.optimize(lambda trial: trial.suggest_float("x", 0, 1), n_trials=1)
    assert len(study.trials) == 1
    assert (tmp_path / "db.sqlite.studies" / "s.journal.damaged").read_bytes().endswith(damage)
