"""`autotile db import` of hostile files: every bad record is refused with its reason, the rest imported,
and a file of any size is read in bounded memory."""
from __future__ import annotations

import json
import tracemalloc

import pytest
from click.testing import CliRunner

from autotile.cli.db import db_group as db
from autotile.device import interpret_device
from autotile.families.gemm import FAMILY, contiguous_problem
from autotile.store.db import open_engine
from autotile.store.exchange import MAX_LISTED, MAX_RECORD_BYTES, ConflictPolicy, import_file
from autotile.store.repo import Store
from autotile.tune.driver import tune_problem

CPU = interpret_device()
PROBLEM = contiguous_problem(24, 32, 64, "fp16", "fp16")


@pytest.fixture(scope="module")
def export(tmp_path_factory) -> tuple[str, dict, str]:
    """(header line, one valid record, end line) of an export of one interpreter-tuned gemm winner."""
    folder = tmp_path_factory.mktemp("export")
    url = f"sqlite:///{folder / 'tuned.sqlite'}"
    tune_problem(FAMILY, PROBLEM, CPU, trials=2, db_url=url, retime_rounds=1)
    out = folder / "winners.jsonl"
    result = CliRunner().invoke(db, ["export", "--out", str(out), "--db", url], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    header, record, end = out.read_text().splitlines()
    return header, json.loads(record), end


def _variant(record: dict, m: int, path: tuple, value) -> dict:
    """A copy of `record` for problem size m (a problem of its own) with one field set to `value`."""
    copy = json.loads(json.dumps(record))
    copy["problem"]["m"] = m
    target = copy
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return copy


HOSTILE = [  # (field path, value, words of the reason)
    (("device", "sm_count"), 10**30, "sm_count must be an integer in [1, 2147483647], got an integer of 31 digits"),
    (("provenance", "trials_run"), 10**30, "provenance.trials_run must be an integer in [0, 2147483647]"),
    (("device", "memory_bytes"), 2**64, "memory_bytes must be an integer in [0, 9223372036854775807]"),
    (("problem", "n"), 64.5, "problem.n must be an integer"),
    (("problem", "tf32"), "yes", "problem.tf32 must be true or false, got 'yes'"),
    (("problem", "bias"), 2, "problem.bias must be true or false, got 2"),
    (("problem", "k"), 0, "problem.k must be an integer in [1,"),
    (("problem", "activation"), "rm -rf", "problem.activation must be one of none, relu, gelu, silu"),
    (("problem", "dtype"), "float16", "not a dtype name autotile writes"),
    (("timings", "median_ms"), 1e308, "timings.median_ms must be within [0, 3.6e+06], got 1e+308"),
    (("timings", "baseline_ms"), -5.0, "timings.baseline_ms must be positive, got -5.0"),
    (("timings", "q80_ms"), 10**400, "timings.q80_ms must be a finite number, got an integer of 401 digits"),
    (("timings", "margin"), -3.0, "timings.margin must be within [-1, 1e+06]"),
    # A median below its own 20th percentile: list showed thousands of x over the baseline.
    (("timings", "median_ms"), 1e-6, "timings must keep q20_ms <= median_ms <= q80_ms"),
]


@pytest.mark.parametrize("dry_run", [False, True], ids=["import", "dry run"])
def test_each_hostile_record_is_refused_with_its_reason(export, tmp_path, dry_run):
    header, record, _end = export
    lines = [header, json.dumps(record)]
    lines += [json.dumps(_variant(record, 100 + i, path, value)) for i, (path, value, _) in enumerate(HOSTILE)]
    lines.append(json.dumps({"record": "end", "count": len(lines) - 1}))
    path = tmp_path / "hostile.jsonl"
    path.write_text("\n".join(lines) + "\n")
    target = f"sqlite:///{tmp_path / 'target.sqlite'}"
    if dry_run:
        open_engine(target)  # a dry run checks against an existing database
    result = CliRunner().invoke(db, ["import", str(path), "--db", target] + (["--dry-run"] if dry_run else []),
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert f"1 record(s) (1 added); skipped {len(HOSTILE)}" in result.output
    for line, (_path, _value, words) in enumerate(HOSTILE, start=3):
        assert f"line {line}: skipped: " in result.stderr and words in result.stderr, (words, result.stderr)
    winners = Store(open_engine(target, create=False)).winners()
    assert [w.params["m"] for w in winners] == ([] if dry_run else [24])


def test_a_file_is_checked_before_the_first_import_without_creating_the_database(export, tmp_path):
    """--dry-run against a database not made yet said "no autotile database": a file could not be checked first."""
    header, record, end = export
    path = tmp_path / "one.jsonl"
    path.write_text("\n".join([header, json.dumps(record), end]) + "\n")
    target = tmp_path / "new.sqlite"
    report = import_file(f"sqlite:///{target}", path, dry_run=True)
    assert [k.action for k in report.kept] == ["added"] and not target.exists()


def test_an_overlong_line_is_skipped_unread(export, tmp_path):
    header, record, _end = export
    huge = json.dumps(_variant(record, 200, ("provenance", "text"), "x" * (2 * MAX_RECORD_BYTES)))
    path = tmp_path / "long.jsonl"
    path.write_text("\n".join([header, huge, json.dumps(record), '{"count": 2, "record": "end"}']) + "\n")
    report = import_file(f"sqlite:///{tmp_path / 't.sqlite'}", path)
    too_long = f"a line longer than {MAX_RECORD_BYTES} bytes (not read)"
    assert [(s.line, s.reason) for s in report.skipped] == [(2, too_long)]
    assert [(k.line, k.action) for k in report.kept] == [(3, "added")] and report.truncated == ""


def test_a_large_file_is_read_in_bounded_memory(export, tmp_path):
    header, record, _end = export
    unknown = json.dumps({"record": "note", "text": "n" * 100})  # refused at once: the reading is what is measured
    count = 100_000
    path = tmp_path / "large.jsonl"
    with open(path, "w") as handle:
        handle.write(header + "\n" + json.dumps(record) + "\n")
        for _ in range(count):
            handle.write(unknown + "\n")
        handle.write(json.dumps({"record": "end", "count": count + 1}) + "\n")
    size = path.stat().st_size
    assert size > 10_000_000
    tracemalloc.start()
    try:
        report = import_file(f"sqlite:///{tmp_path / 't.sqlite'}", path, policy=ConflictPolicy.KEEP)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert report.counts() == {"added": 1, "skipped": count} and report.truncated == ""
    assert len(report.skipped) == MAX_LISTED and report.unlisted == count - MAX_LISTED
    assert peak < size / 4, f"peak {peak / 1e6:.1f} MB for a {size / 1e6:.1f} MB file"


def test_a_header_version_that_is_not_an_integer_is_named_as_such(export, tmp_path):
    header, record, end = export
    edited = json.loads(header)
    edited["format_version"] = str(edited["format_version"])
    path = tmp_path / "edited.jsonl"
    path.write_text("\n".join([json.dumps(edited), json.dumps(record), end]) + "\n")
    result = CliRunner().invoke(db, ["import", str(path), "--db", f"sqlite:///{tmp_path / 't.sqlite'}"])
    assert result.exit_code != 0 and "format_version must be an integer, got '1'" in result.output, result.output
    assert "upgrade autotile" not in result.output


def test_importing_a_file_cut_short_keeps_what_it_read_and_exits_non_zero(export, tmp_path):
    header, record, _end = export
    path = tmp_path / "cut.jsonl"
    path.write_text("\n".join([header, json.dumps(record)]) + "\n")  # no end record: the copy was cut short
    target = f"sqlite:///{tmp_path / 't.sqlite'}"
    result = CliRunner().invoke(db, ["import", str(path), "--db", target])
    assert result.exit_code == 1 and "the records read were kept" in result.output, result.output
    assert [w.params["m"] for w in Store(open_engine(target, create=False)).winners()] == [24]
