"""`autotile db export|import|merge|verify|upgrade` and stale re-validation, on small interpreter-tuned databases."""
from __future__ import annotations

import json
import re
import sqlite3
from pathlib import Path

import pytest
from click.testing import CliRunner
from sqlalchemy import create_engine, inspect, text

from autotile.cli.db import db_group as db
from autotile.device import interpret_device
from autotile.families.gemm import FAMILY, contiguous_problem
from autotile.runtime import dispatch
from autotile.store import db as store_db
from autotile.store.db import open_engine
from autotile.store.exchange import ConflictPolicy, import_file
from autotile.store.migrate import upgrade_to
from autotile.store.repo import Store
from autotile.store.ship import dump_winners
from autotile.tune.driver import tune_problem
from autotile.tune.stale import revalidate_stale

CPU = interpret_device()
PROBLEM = contiguous_problem(24, 32, 64, "fp16", "fp16")


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """A database with one interpreter-tuned gemm winner and its three trials (tuned once per module)."""
    path = tmp_path_factory.mktemp("tuned") / "tuned.sqlite"
    tune_problem(FAMILY, PROBLEM, CPU, trials=3, db_url=f"sqlite:///{path}", retime_rounds=1)
    return path


@pytest.fixture
def tuned_copy(tuned, tmp_path):
    path = tmp_path / "copy.sqlite"
    with sqlite3.connect(tuned) as src, sqlite3.connect(path) as dst:
        src.backup(dst)
    return f"sqlite:///{path}"


def run(*args):
    return CliRunner().invoke(db, [str(a) for a in args], catch_exceptions=False)


def sql(url: str, statement: str):
    with open_engine(url, create=False).begin() as conn:
        return conn.execute(text(statement)).all() if statement.lstrip().lower().startswith("select") else \
            conn.execute(text(statement))


def test_upgrade_keeps_the_rows_of_a_first_schema_database(tmp_path):
    path = tmp_path / "v1.sqlite"
    url = f"sqlite:///{path}"
    upgrade_to(create_engine(url), "0001")
    with sqlite3.connect(path) as conn:
        conn.execute("insert into autotile_devices values (1, 'fp', 'h200/sm90', 'h200', 'NVIDIA H200', '9.0', 132, "
                     "150000000000, 232448, '580.1')")
        conn.execute("insert into autotile_toolchains values (1, '2.11.0', '3.6.0', '13.0', '3.12.3', '0.1.0')")
        conn.execute("insert into autotile_problems values (1, 'gemm', '{\"m\":1}', '{\"m\":1}', '{\"m\": 1}')")
        conn.execute("insert into autotile_winners (id, problem_id, device_key, device_id, toolchain_id, config, "
                     "config_hash, median_ms, q20_ms, q80_ms, interpreted, baseline_name, trials_run, provenance, "
                     "created_at) values (1, 1, 'h200/sm90', 1, 1, '{}', 'h', 0.5, 0.4, 0.6, 0, 'cuBLAS', 7, "
                     "'first schema', '2026-11-01 00:00:00')")
    store_db._engine.cache_clear()
    with pytest.raises(Exception, match="autotile db upgrade"):
        open_engine(url, create=False)

    result = run("upgrade", "--db", url)
    assert result.exit_code == 0, result.output + result.stderr
    assert "schema version 1 -> 3" in result.output and "revision 0001 -> 0003" in result.output
    assert (tmp_path / "v1.sqlite.schema1.bak").exists()
    columns = {c["name"] for c in inspect(open_engine(url, create=False)).get_columns("autotile_winners")}
    assert {"stale", "verified_at", "verified_ms", "verify_status", "regression", "verified_range", "kernel_config",
            "kernel_ms"} <= columns
    (winner,) = Store(open_engine(url, create=False)).winners()
    assert (winner.median_ms, winner.trials_run, winner.provenance, winner.driver) == (0.5, 7, "first schema", "580.1")
    assert winner.stale is False and winner.verify_status == "" and winner.regression is None
    assert winner.verified_range is None and winner.kernel_config is None
    again = run("upgrade", "--db", url)
    assert again.exit_code == 0 and "nothing to do" in again.output


def test_a_writer_that_migrates_an_older_schema_keeps_a_copy_and_says_so(tmp_path, caplog):
    """`autotile tune` on an older file migrated it in place, silently, with no copy (db upgrade keeps one)."""
    path = tmp_path / "v1.sqlite"
    url = f"sqlite:///{path}"
    upgrade_to(create_engine(url), "0001")
    store_db._engine.cache_clear()
    with caplog.at_level("WARNING", logger="autotile"):
        open_engine(url, create=True)
    assert (tmp_path / "v1.sqlite.schema1.bak").exists()
    assert "had an older schema: migrated" in caplog.text and "v1.sqlite.schema1.bak" in caplog.text


def test_upgrade_refuses_a_foreign_database(tmp_path):
    foreign = tmp_path / "foreign.sqlite"
    with sqlite3.connect(foreign) as conn:
        conn.execute("create table users (id integer)")
    result = run("upgrade", "--db", foreign)
    assert result.exit_code == 1 and "not an autotile database" in result.stderr


def test_upgrade_of_a_current_database_writes_nothing(tuned_copy, monkeypatch):
    # A read-only copy of a current database was refused ("cannot be written") instead of "nothing to do".
    opened = []
    real = store_db.inspect_database

    def recording(url=None, **kwargs):
        opened.append(kwargs.get("read_only", False))
        return real(url, **kwargs)

    monkeypatch.setattr(store_db, "inspect_database", recording)
    result = run("upgrade", "--db", tuned_copy)
    assert result.exit_code == 0 and "nothing to do" in result.output
    assert opened == [True], "opened for reading only"


def test_export_then_import_reproduces_the_winners(tuned_copy, tmp_path):
    out = tmp_path / "winners.jsonl"
    result = run("export", "--out", out, "--db", tuned_copy)
    assert result.exit_code == 0 and "exported 1 winner" in result.output
    lines = out.read_text().splitlines()
    header, record, end = (json.loads(line) for line in lines)
    assert header["format"] == "autotile-db" and header["format_version"] == 1 and header["schema_version"] == 3
    assert record["family"] == "gemm" and record["device"]["key"] == "interpret" and end == {"count": 1, "record": "end"}
    assert FAMILY.problem_key(FAMILY.problem_from_dict(record["problem"])) == FAMILY.problem_key(PROBLEM)

    target = f"sqlite:///{tmp_path / 'target.sqlite'}"
    first = run("import", out, "--db", target)
    assert first.exit_code == 0 and "kept 1 record(s) (1 added); skipped 0" in first.output
    assert dump_winners(open_engine(target, create=False)) == dump_winners(open_engine(tuned_copy, create=False))
    again = run("import", out, "--db", target)
    assert "1 unchanged" in again.output


def _write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_import_skips_bad_records_and_keeps_what_exists(tuned_copy, tmp_path):
    out = tmp_path / "good.jsonl"
    run("export", "--out", out, "--db", tuned_copy)
    header, good, _end = out.read_text().splitlines()
    record = json.loads(good)
    other = json.loads(json.dumps(record))
    other["problem"]["m"] = 40  # a second, valid problem
    outside = json.loads(json.dumps(record))
    outside["problem"]["m"] = 41
    outside["config"]["BLOCK_M"] = 48
    no_such_gpu = json.loads(json.dumps(record))
    no_such_gpu["device"].update(key="h900/sm90", profile="h900", compute_capability="9.0")
    newer = dict(record, schema_version=99)
    foreign = {"record": "winner", "family": "gemm", "problem": {"m": 1}, "exec": "import os"}
    lines = [header, json.dumps(other), json.dumps(outside), json.dumps(no_such_gpu), json.dumps(newer),
             json.dumps(foreign), json.dumps(record)[:80]]  # the last line is cut mid-record and no end follows
    bad = _write_lines(tmp_path / "bad.jsonl", lines)

    target = f"sqlite:///{tmp_path / 'target.sqlite'}"
    store = Store(open_engine(target))
    store.save_winner(problem_id=store.ensure_problem(FAMILY, PROBLEM), device=CPU, device_id=store.ensure_device(CPU),
                      toolchain_id=store.ensure_toolchain(), config=json.dumps(record["config"], sort_keys=True,
                                                                               separators=(",", ":")),
                      config_hash="x", median_ms=123.0, q20_ms=123.0, q80_ms=123.0, interpreted=1, provenance="mine")
    report = import_file(target, bad, policy=ConflictPolicy.KEEP)
    assert [(k.line, k.action) for k in report.kept] == [(2, "added")]
    reasons = {s.line: s.reason for s in report.skipped}
    assert sorted(reasons) == [3, 4, 5, 6, 7]
    assert "BLOCK_M=48 is not one of" in reasons[3]
    assert "unknown GPU profile 'h900'" in reasons[4]
    assert "schema version 99" in reasons[5]
    assert "unknown fields ['exec']" in reasons[6]
    assert "truncated" in reasons[7] and "no end record" in report.truncated
    winners = {w.params["m"]: w for w in Store(open_engine(target, create=False)).winners()}
    assert sorted(winners) == [24, 40] and winners[24].median_ms == 123.0 and winners[24].provenance == "mine"

    result = run("import", bad, "--db", target)
    assert result.exit_code == 1 and "line 4: skipped: device 'h900/sm90'" in result.stderr
    assert "no end record" in result.stderr and "the records read were kept" in result.stderr  # a cut file fails
    # A dry run keeps nothing, and says what an import would keep (it said "were kept").
    result = run("import", bad, "--db", target, "--dry-run")
    assert result.exit_code == 1 and "a real import would keep the records read" in result.stderr
    # Nothing but bad records: the command says so and exits non-zero (it exited 0 having imported nothing).
    only_bad = _write_lines(tmp_path / "only_bad.jsonl", [header, json.dumps(outside), json.dumps(foreign)])
    result = run("import", only_bad, "--db", target)
    assert result.exit_code == 1 and "every record was skipped" in result.stderr


def test_replace_takes_the_imported_serving_range_of_the_same_config(tuned_copy, tmp_path):
    """--on-conflict replace of a record whose config is the stored one but whose verified range differs: the range
    is the import's (it was reported 'unchanged' and dropped); keep leaves the stored one."""
    out = tmp_path / "w.jsonl"
    run("export", "--out", out, "--db", tuned_copy)
    header, record, end = out.read_text().splitlines()
    ranged = json.loads(record)
    m = ranged["problem"]["m"]
    ranged.setdefault("serving", {})["verified_range"] = {"m": [m - 7, m + 8]}
    path = _write_lines(tmp_path / "ranged.jsonl", [header, json.dumps(ranged), end])
    kept = run("import", path, "--db", tuned_copy)
    assert kept.exit_code == 0 and "1 unchanged" in kept.output
    (winner,) = Store(open_engine(tuned_copy, create=False)).winners()
    assert winner.verified_range is None
    replaced = run("import", path, "--on-conflict", "replace", "--db", tuned_copy)
    assert replaced.exit_code == 0 and "1 replaced" in replaced.output, replaced.output
    (winner,) = Store(open_engine(tuned_copy, create=False)).winners()
    assert winner.verified_range == {"m": [m - 7, m + 8]}
    again = run("import", path, "--on-conflict", "replace", "--db", tuned_copy)
    assert "1 unchanged" in again.output


def test_foreign_and_newer_files_are_refused_whole(tmp_path):
    target = tmp_path / "target.sqlite"
    foreign = _write_lines(tmp_path / "foreign.jsonl", ['{"name": "not an export"}'])
    result = run("import", foreign, "--db", target)
    assert result.exit_code == 1 and "is not an autotile export" in result.stderr
    newer = _write_lines(tmp_path / "newer.jsonl", [json.dumps({"format": "autotile-db", "format_version": 1,
                                                                "schema_version": 99})])
    result = run("import", newer, "--db", target)
    assert result.exit_code == 1 and "schema version 99, newer than this autotile's 3" in result.stderr
    assert not target.exists() or Store(open_engine(f"sqlite:///{target}", create=False)).winners() == []


def test_merge_keeps_the_faster_winner(tuned_copy, tmp_path):
    out = tmp_path / "w.jsonl"
    run("export", "--out", out, "--db", tuned_copy)
    header, record, end = out.read_text().splitlines()
    faster = json.loads(record)
    faster["timings"].update(median_ms=1e-3, q20_ms=1e-3, q80_ms=1e-3)
    faster["config"]["num_stages"] = 2 if faster["config"]["num_stages"] != 2 else 3
    other = f"sqlite:///{tmp_path / 'other.sqlite'}"
    import_file(other, _write_lines(tmp_path / "f.jsonl", [header, json.dumps(faster), end]))

    result = run("merge", other, "--db", tuned_copy)
    assert result.exit_code == 0 and "1 replaced" in result.output, result.output
    (winner,) = Store(open_engine(tuned_copy, create=False)).winners()
    assert winner.median_ms == 1e-3 and json.loads(winner.config)["num_stages"] == faster["config"]["num_stages"]
    same = run("merge", tuned_copy, "--db", tuned_copy)
    assert same.exit_code == 1 and "is the target database itself" in same.stderr
    # A source that cannot be read, named after one that can: nothing is merged (the first used to be written, then
    # the command failed on the second).
    (tmp_path / "junk.sqlite").write_bytes(b"not a database" * 100)
    fresh = f"sqlite:///{tmp_path / 'fresh.sqlite'}"
    import_file(fresh, _write_lines(tmp_path / "empty.jsonl", [header, json.dumps({**json.loads(end), "count": 0})]))
    partial = run("merge", tuned_copy, tmp_path / "junk.sqlite", "--db", fresh)
    assert partial.exit_code == 1 and "junk.sqlite" in partial.stderr
    assert Store(open_engine(fresh, create=False)).winners() == []


def test_verify_marks_regressions_staleness_and_configs_outside_the_space(tuned_copy):
    sql(tuned_copy, "update autotile_winners set median_ms = 1e-6")
    sql(tuned_copy, "insert into autotile_toolchains (torch, triton, cuda, python, autotile) "
                    "values ('1.0.0', '3.6.0', 'none', '3.11', '0.0.1')")
    sql(tuned_copy, "update autotile_winners set toolchain_id = (select max(id) from autotile_toolchains)")
    result = run("verify", "--gpu", "interpret", "--rounds", "1", "--db", tuned_copy)
    assert result.exit_code == 0, result.output + result.stderr
    assert result.output.startswith("regression") and "stale: torch 1.0.0 ->" in result.output
    (winner,) = Store(open_engine(tuned_copy, create=False)).winners()
    assert winner.verify_status == "regression" and winner.regression > 1.0 and winner.stale
    assert winner.verified_ms > 1e-6 and winner.verified_at

    sql(tuned_copy, "update autotile_winners set median_ms = 1e6")
    result = run("verify", "--gpu", "interpret", "--rounds", "1", "--db", tuned_copy)
    assert result.output.startswith("ok"), result.output
    (winner,) = Store(open_engine(tuned_copy, create=False)).winners()
    assert winner.verify_status == "ok" and winner.regression is None

    config = json.loads(winner.config)
    config["BLOCK_M"] = 48
    sql(tuned_copy, f"update autotile_winners set config = '{json.dumps(config)}'")
    result = run("verify", "--gpu", "interpret", "--db", tuned_copy)
    assert result.output.startswith("outside_space") and "BLOCK_M=48" in result.output
    # A winner found failing fails the check (it exited 0, as for a regression, which is still served).
    assert result.exit_code == 1 and "1 winner(s) failed on this GPU and are no longer served" in result.output


def test_tuning_any_family_marks_every_familys_winners_of_another_toolchain_stale(tuned_copy):
    """The README says winners of another toolchain are marked stale when their device next tunes; only the tuned
    family's were: a gemm winner stayed unmarked while the device tuned elementwise."""
    from autotile.families import get_family

    sql(tuned_copy, "insert into autotile_toolchains (torch, triton, cuda, python, autotile) "
                    "values ('2.0.0', '3.0.0', 'none', '3.11', '0.0.1')")
    sql(tuned_copy, "update autotile_winners set toolchain_id = (select max(id) from autotile_toolchains), stale = 0")
    elementwise = get_family("elementwise")
    tune_problem(elementwise, elementwise.problem_for_expression("x + 1", "fp32", 64), CPU, trials=1, db_url=tuned_copy,
                 retime_rounds=1)
    winners = {w.family: w for w in Store(open_engine(tuned_copy, create=False)).winners()}
    assert winners["gemm"].stale and not winners["elementwise"].stale


def test_stale_winners_are_served_then_revalidated_from_their_top_configs(tuned_copy, monkeypatch):
    sql(tuned_copy, "insert into autotile_toolchains (torch, triton, cuda, python, autotile) "
                    "values ('2.0.0', '3.0.0', 'none', '3.11', '0.0.1')")
    sql(tuned_copy, "update autotile_winners set toolchain_id = (select max(id) from autotile_toolchains), "
                    "median_ms = 5.0, stale = 1")
    monkeypatch.setenv("AUTOTILE_DB", tuned_copy)
    dispatch.clear_cache()
    try:
        assert dispatch.resolve(FAMILY, PROBLEM, CPU).source == "user-db"  # a stale winner is still used
    finally:
        dispatch.clear_cache()
    trial_configs = {json.dumps(t["config"], sort_keys=True, separators=(",", ":"))
                     for t in Store(open_engine(tuned_copy, create=False)).trials("gemm") if t["status"] == "ok"}

    (result,) = revalidate_stale(tuned_copy, CPU, "gemm", top_k=2, rounds=1)
    assert result.status == "revalidated" and result.candidates == 2
    assert "torch 2.0.0 ->" in result.reasons[0] and "triton 3.0.0 -> 3.6.0" in result.reasons[1]
    (winner,) = Store(open_engine(tuned_copy, create=False)).winners()
    assert winner.config in trial_configs and winner.median_ms == result.ms != 5.0
    assert winner.toolchain["triton"] == "3.6.0" and not winner.stale and winner.verify_status == "ok"
    assert winner.provenance.startswith("revalidated (torch 2.0.0") and winner.trials_run == 3
    assert revalidate_stale(tuned_copy, CPU, "gemm") == []  # fresh now: nothing to re-time


def _copy_db(source_url: str, path) -> str:
    with sqlite3.connect(source_url.removeprefix("sqlite:///")) as src, sqlite3.connect(path) as dst:
        src.backup(dst)
    return f"sqlite:///{path}"


def _set_winner(url: str, config: dict | None = None, verified_range: dict | None = None, delete: bool = False):
    with sqlite3.connect(url.removeprefix("sqlite:///")) as conn:
        if delete:
            conn.execute("DELETE FROM autotile_winners")
            return
        if config is not None:
            conn.execute("UPDATE autotile_winners SET config = ?", (json.dumps(config),))
        conn.execute("UPDATE autotile_winners SET verified_range = ?",
                     (json.dumps(verified_range) if verified_range else None,))


def _winner_config(url: str) -> dict | None:
    winners = Store(open_engine(url, create=False)).winners()
    return json.loads(winners[0].config) if winners else None


def test_shipping_with_keep_generated_only_fills_gaps(tuned_copy, tmp_path):
    """copy_winners(keep_generated=True), as `ship_winners.py --keep-generated` ships a model's trace tuning: a
    generated winner verified over its bucket replaces a vendor verdict or fills a missing one; it never replaces a
    generated winner, and a vendor winner or an unverified kernel replaces nothing."""
    from autotile.store.ship import copy_winners

    generated = _winner_config(tuned_copy)
    vendor = {"VENDOR": "cublas"}
    bucket = {"m": [17, 32]}
    source = _copy_db(tuned_copy, tmp_path / "source.sqlite")
    _set_winner(source, dict(generated, GROUP_M=16 if generated["GROUP_M"] != 16 else 8), bucket)
    cases = [  # (target's winner: config or None for none, source verified over its bucket?, copied?)
        (generated, True, False), (vendor, True, True), (vendor, False, False), (None, True, True), (None, False, False)]
    for index, (target_config, verified, copied) in enumerate(cases):
        target = _copy_db(tuned_copy, tmp_path / f"target{index}.sqlite")
        if target_config is None:
            _set_winner(target, delete=True)
        else:
            _set_winner(target, target_config)
        _set_winner(source, verified_range=bucket if verified else None)
        before = _winner_config(target)
        assert copy_winners(source, target, keep_generated=True) == int(copied), (target_config, verified)
        assert _winner_config(target) == (_winner_config(source) if copied else before)
    # A vendor winner goes only where there is none; without keep_generated everything is copied.
    _set_winner(source, vendor, bucket)
    target = _copy_db(tuned_copy, tmp_path / "target_last.sqlite")
    assert copy_winners(source, target, keep_generated=True) == 0 and _winner_config(target) == generated
    assert copy_winners(source, target) == 1 and _winner_config(target) == vendor
    _set_winner(target, delete=True)
    assert copy_winners(source, target, keep_generated=True) == 1 and _winner_config(target) == vendor


def test_policy_records_that_would_serve_wrongly_are_refused():
    """A policy without its dtype would serve calls of every dtype; one whose smallest ratio is below 1 loses to the
    vendor op it replaces (such records were imported before). The shipped policies all pass."""
    from autotile.store.db import read_only_url
    from autotile.store.exchange import _Bad, export_records, validate_policy_record

    shipped = Path(__file__).resolve().parent.parent / "tuning_db" / "winners.sqlite"
    policies = [r for r in export_records(open_engine(read_only_url(shipped), create=False, read_only=True))
                if r["record"] == "policy"]
    assert policies
    for line, record in enumerate(policies, start=1):
        validate_policy_record(record, line)
    record = policies[0]
    no_dtype = json.loads(json.dumps(record))
    del no_dtype["fixed"]["dtype"]
    for bad, words in ((no_dtype, "missing ['dtype']"), ({**record, "min_ratio": 0.5}, "at least 1"),
                       ({**record, "min_ratio": record["geomean_ratio"] + 0.5}, "at most geomean_ratio")):
        with pytest.raises(_Bad, match=re.escape(words)):
            validate_policy_record(bad, 1)


def test_a_winner_stored_by_another_tune_meanwhile_is_compared_not_overwritten(tuned_copy, monkeypatch):
    """Two tunes of one problem at once: the one that finished last replaced the other's winner without timing
    beside it (its comparison had read the database before the other stored). save_winner now writes only over the
    winner a comparison was made against; otherwise the tuner compares again, beside the new one."""
    store = Store(open_engine(tuned_copy, create=False))
    (before,) = store.winners()
    calls = []
    original = Store.save_winner

    def racing_save(self, **values):
        calls.append(values.get("replaces"))
        if len(calls) == 1:  # another process stores its winner just before this one's first write
            original(self, **dict(values, config_hash="theirs", replaces=values["replaces"]))
        return original(self, **values)

    monkeypatch.setattr(Store, "save_winner", racing_save)
    tune_problem(FAMILY, PROBLEM, CPU, trials=4, db_url=tuned_copy, retime_rounds=1)
    assert calls[0] == before.config_hash and calls[1] == "theirs" and len(calls) == 2
    (after,) = Store(open_engine(tuned_copy, create=False)).winners()
    assert after.config_hash != "theirs"  # the second comparison's winner, written over the one it was timed beside


def test_save_winner_writes_only_over_the_winner_it_was_compared_against(tuned_copy):
    """The guarded write read the row, then wrote it: on SQLite (no row locks) two tuners could both pass the check
    and the last one overwrote the other. It is one conditional UPDATE now; re-validation and its failure marks are
    guarded the same way."""
    store = Store(open_engine(tuned_copy, create=False))
    ((row, *_),) = store.winner_rows(FAMILY.name, CPU.key)
    (before,) = store.winners()
    ids = dict(problem_id=row.problem_id, device=CPU, device_id=store.ensure_device(CPU),
               toolchain_id=store.ensure_toolchain())
    fields = dict(config=before.config, median_ms=1.0, q20_ms=1.0, q80_ms=1.0, provenance="test")
    assert store.save_winner(**ids, **fields, config_hash="first", replaces=before.config_hash)
    assert not store.save_winner(**ids, **fields, config_hash="second", replaces=before.config_hash)  # read too early
    assert not store.save_winner(**ids, **fields, config_hash="third", replaces=None)  # one is there now
    (after,) = store.winners()
    assert after.config_hash == "first"
    store.update_winner(row.id, config_hash=before.config_hash, verify_status="failed")  # an old winner's mark
    (after,) = store.winners()
    assert after.verify_status == ""
