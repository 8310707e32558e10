"""Bad input at the edges of the CLI, the store and the trace recorder: a clear one-line error, and no tuning data
lost (damaged trace files, damaged verified ranges, unknown formats and families, empty problems)."""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import sqlite3

import pytest
import torch
from click.testing import CliRunner

import autotile
from autotile.cli.main import cli
from autotile.device import interpret_device
from autotile.errors import AutotileError, NoFeasibleConfigError, ShapeMismatchError
from autotile.families import gemm as gemm_module
from autotile.families.elementwise import FAMILY as ELEMENTWISE
from autotile.families.gemm import FAMILY as GEMM, contiguous_problem
from autotile.families.gemm_space import StagedSpace, rule
from autotile.runtime import dispatch, trace
from autotile.runtime.trace import TraceEntry, TraceFormatError, read_trace, write_trace
from autotile.space import Axis
from autotile.store.db import open_engine
from autotile.store.exchange import export_database, import_file
from autotile.store.repo import Store
from autotile.tune.driver import tune_problem
from autotile.tune.plan import plan_from_trace

CPU = interpret_device()
GEMM_PROBLEM = contiguous_problem(20, 24, 40, "fp32", "fp32")
# A range that holds calls of 17 to 32 rows: the tuner stores such a range where the winner beat the vendor op.
GOOD_RANGE = '{"m": [17, 32]}'


def invoke(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def one_line_error(result, exit_code: int = 1) -> str:
    """The single `Error:` line of a failed command (no traceback)."""
    assert result.exit_code == exit_code, result.output
    assert "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1, result.output
    return errors[0]


@pytest.fixture(scope="module")
def tuned_gemm(tmp_path_factory):
    """A database holding one interpreter-tuned gemm winner (tuned once for the module)."""
    path = tmp_path_factory.mktemp("tuned") / "gemm.sqlite"
    tune_problem(GEMM, GEMM_PROBLEM, CPU, trials=2, db_url=f"sqlite:///{path}", retime_rounds=1)
    return path


@pytest.fixture
def gemm_db(tuned_gemm, tmp_path):
    """A copy of the tuned database the test may damage; returns (path, url)."""
    path = tmp_path / "gemm.sqlite"
    with sqlite3.connect(tuned_gemm) as src, sqlite3.connect(path) as dst:
        src.backup(dst)
    return path, f"sqlite:///{path}"


def set_range(path, text: str | None) -> None:
    """Write `text` as it stands into the winner's verified_range column (what a hand edit or a cut write leaves)."""
    with sqlite3.connect(path) as conn:
        conn.execute("update autotile_winners set verified_range = ?", (text,))


@pytest.fixture
def planned(monkeypatch):
    """The problems `autotile tune FAMILY` would run, recorded instead of tuned."""
    import autotile.cli.main as main

    seen = []
    monkeypatch.setattr(main, "tune_each", lambda problems, tune_one: seen.extend(problems))
    return seen


# --- item 1: the report's format -----------------------------------------------------------------------


def test_report_format_comes_from_the_suffix_and_an_unknown_suffix_is_refused(tmp_path):
    url = f"sqlite:///{tmp_path / 'empty.sqlite'}"
    open_engine(url, create=True)
    refused = invoke("report", "--out", tmp_path / "r.txt", "--db", url)
    line = one_line_error(refused, exit_code=2)
    assert "'.txt' names no report format" in line and all(s in line for s in (".html", ".md", ".csv", ".json"))
    assert not (tmp_path / "r.txt").exists()
    bare = invoke("report", "--out", tmp_path / "r", "--db", url)  # no suffix: the documented default, HTML
    assert bare.exit_code == 0 and (tmp_path / "r").read_text().startswith("<!DOCTYPE")
    forced = invoke("report", "--out", tmp_path / "r.txt", "--format", "md", "--db", url)
    assert forced.exit_code == 0 and (tmp_path / "r.txt").read_text().startswith("# autotile report")
    upper = invoke("report", "--out", tmp_path / "r.JSON", "--db", url)
    assert upper.exit_code == 0 and json.loads((tmp_path / "r.JSON").read_text())["problems"] == []


def test_an_empty_database_reports_in_every_format(tmp_path):
    url = f"sqlite:///{tmp_path / 'empty.sqlite'}"
    open_engine(url, create=True)
    for suffix, start in ((".html", "<!DOCTYPE"), (".md", "# autotile"), (".csv", "family,"), (".json", "{")):
        result = invoke("report", "--out", tmp_path / f"r{suffix}", "--db", url)
        assert result.exit_code == 0 and "no trials or winners stored" in result.output, result.output
        assert (tmp_path / f"r{suffix}").read_text().startswith(start)


def test_a_report_that_cannot_be_written_gets_one_line_and_leaves_nothing(tmp_path):
    url = f"sqlite:///{tmp_path / 'empty.sqlite'}"
    open_engine(url, create=True)
    (tmp_path / "folder.html").mkdir()
    (tmp_path / "file").write_text("")
    for out in (tmp_path / "folder.html", tmp_path / "file" / "r.md"):
        assert f"cannot write the report {out}" in one_line_error(invoke("report", "--out", out, "--db", url))
    assert not list(tmp_path.rglob("*.partial")) and not list((tmp_path / "folder.html").iterdir())


# --- item 2: no feasible config ------------------------------------------------------------------------


def test_no_feasible_config_is_an_error_class_the_cli_catches(monkeypatch, tmp_path):
    assert issubclass(NoFeasibleConfigError, RuntimeError) and issubclass(NoFeasibleConfigError, AutotileError)
    never = StagedSpace([Axis("BLOCK_M", (16,))], [rule("never", ("BLOCK_M",), lambda c: False, "never holds")])
    monkeypatch.setattr(gemm_module, "gemm_space", lambda problem, device: never)
    with pytest.raises(NoFeasibleConfigError, match="has no feasible config"):
        GEMM.default_config(GEMM_PROBLEM, CPU)
    shape = ("--m", "4", "--n", "16", "--k", "16", "--dtype", "fp16", "--gpu", "interpret", "--db", tmp_path / "f.db")
    assert "try another shape, dtype or --gpu" in one_line_error(invoke("tune", "gemm", *shape, "--trials", "1"))
    # The class is what the CLI recognises, not the words of the message.
    monkeypatch.setattr(type(GEMM), "default_config", lambda self, problem, device: (_ for _ in ()).throw(
        NoFeasibleConfigError("gemm: nothing fits")))
    line = one_line_error(invoke("tune", "gemm", *shape, "--dry-run"))
    assert "gemm: nothing fits" in line and "try another shape" in line


# --- item 3: --mean-context ----------------------------------------------------------------------------


def test_mean_context_zero_is_refused_and_leaving_it_out_means_not_given(planned):
    paged = ("tune", "paged", "--batch", "2", "--context", "64", "--gpu", "interpret")
    for value in ("0", "-4"):
        line = one_line_error(invoke(*paged, "--mean-context", value), exit_code=2)
        assert f"must be >= 1, got {value}" in line and "mean context" in line
    assert not planned
    assert invoke(*paged).exit_code == 0 and [p.mean_context for p in planned] == [64]
    planned.clear()
    assert invoke(*paged, "--mean-context", "32").exit_code == 0 and [p.mean_context for p in planned] == [32]


# --- item 4: empty problems ----------------------------------------------------------------------------


def test_an_empty_elementwise_problem_is_refused_before_anything_is_stored(tmp_path):
    with pytest.raises(ShapeMismatchError, match="numel must be >= 1"):
        ELEMENTWISE.problem_for_expression("x + 1", "fp32", 0)
    empty = dataclasses.replace(ELEMENTWISE.problem_for_expression("x + 1", "fp32", 64), numel=0)
    url = f"sqlite:///{tmp_path / 'e.sqlite'}"
    with pytest.raises(ShapeMismatchError, match="numel=0: nothing to time"):
        tune_problem(ELEMENTWISE, empty, CPU, trials=1, db_url=url)
    assert not (tmp_path / "e.sqlite").exists()  # no study, no problem row, no winner
    assert autotile.fuse("x + 1")(x=torch.empty(0, 3)).shape == (0, 3)  # calls on empty tensors still run


def test_a_trace_of_empty_tensor_calls_plans_nothing_and_says_why(tmp_path):
    problem = dataclasses.asdict(ELEMENTWISE.problem_for_expression("x + 1", "fp32", 64))
    entries = [TraceEntry("elementwise", "interpret", {**problem, "numel": 0}, 5),
               TraceEntry("elementwise", "interpret", {**problem, "numel": 64}, 2)]
    planned, notes = plan_from_trace(entries)
    assert [p.problem.numel for p in planned] == [64] and "empty tensors (numel=0)" in notes[0]
    path = tmp_path / "t.jsonl"
    write_trace(path, entries[:1])
    line = one_line_error(invoke("tune", "--from-trace", path, "--gpu", "interpret"))
    assert "none of the 1 recorded problem(s)" in line


# --- trace files -------------------------------------------------------------------------------------


def trace_file(tmp_path, name: str, content: bytes):
    path = tmp_path / name
    path.write_bytes(content)
    return path


HEADER = b'{"format": "autotile-trace", "version": 1}\n'
GEMM_LINE = json.dumps({"family": "gemm", "device": "interpret", "calls": 3,
                        "problem": dataclasses.asdict(GEMM_PROBLEM)}).encode() + b"\n"


@pytest.mark.parametrize("content, words", [
    (b"\xff\xfe\x00\x01binary\n", "is not UTF-8 text"),
    (b"", "is empty"),
    (HEADER, "has no end record: it was cut short"),
    (HEADER + b'{"family": "gemm"', "not JSON"),
    (b'{"format": "autotile-trace", "version": 9}\n', "format version 9, newer than this autotile reads"),
    (b'{"format": "autotile-trace", "version": 0}\n', "format version 0; this autotile reads version 1"),
    (b'{"format": "autotile-trace"}\n', "has no format version"),
    (b'{"format": "something-else"}\n', "is not an autotile trace"),
])
def test_a_bad_trace_file_gets_one_line(tmp_path, content, words):
    path = trace_file(tmp_path, "t.jsonl", content)
    with pytest.raises(TraceFormatError, match=words):
        read_trace(path)
    assert words in one_line_error(invoke("tune", "--from-trace", path, "--gpu", "interpret"))


def test_blank_lines_before_the_header_are_skipped(tmp_path):
    path = trace_file(tmp_path, "t.jsonl", b"\n" + HEADER + GEMM_LINE + b'{"record": "end", "count": 1}\n')
    assert [e.calls for e in read_trace(path)] == [3]


def test_a_trace_with_nothing_to_tune_is_an_error_not_a_silent_success(tmp_path):
    end = b'{"record": "end", "count": 1}\n'
    unknown = trace_file(tmp_path, "unknown.jsonl", HEADER + b'{"family": "conv2d", "device": "interpret", '
                                                            b'"problem": {"c": 3}, "calls": 7}\n' + end)
    result = invoke("tune", "--from-trace", unknown, "--gpu", "interpret")
    assert "unknown family 'conv2d': skipped" in result.output
    assert "can be tuned" in one_line_error(result)
    nothing = trace_file(tmp_path, "none.jsonl", HEADER + b'{"record": "end", "count": 0}\n')
    assert "holds no problems" in one_line_error(invoke("tune", "--from-trace", nothing, "--gpu", "interpret"))
    gemm = trace_file(tmp_path, "gemm.jsonl", HEADER + GEMM_LINE + end)
    filtered = invoke("tune", "--from-trace", gemm, "--gpu", "interpret", "--family", "flash")
    assert "holds no flash problems (it holds gemm)" in one_line_error(filtered)
    typo = invoke("tune", "--from-trace", gemm, "--gpu", "interpret", "--family", "gem")
    assert "unknown family 'gem'" in one_line_error(typo, exit_code=2)


def test_a_trace_run_where_a_problem_fails_exits_non_zero_and_keeps_the_others(tmp_path, monkeypatch):
    """A script running `tune --from-trace` sees that part of it did not happen; the problems that did are stored."""
    from autotile.tune import driver

    real = driver.tune_problem
    second = dataclasses.asdict(dataclasses.replace(GEMM_PROBLEM, n=GEMM_PROBLEM.n + 8))  # a problem of its own
    path = trace_file(tmp_path, "t.jsonl", HEADER + GEMM_LINE + json.dumps(
        {"family": "gemm", "device": "interpret", "calls": 1, "problem": second}).encode() + b"\n"
        + b'{"record": "end", "count": 2}\n')

    def tune_or_fail(family, problem, *args, **kwargs):
        if problem.n == second["n"]:
            raise RuntimeError("this problem could not be tuned")
        return real(family, problem, *args, **kwargs)

    monkeypatch.setattr(driver, "tune_problem", tune_or_fail)
    db = tmp_path / "d.sqlite"
    result = invoke("tune", "--from-trace", path, "--gpu", "interpret", "--trials", "1", "--db", f"sqlite:///{db}")
    assert "1 of 2 problem(s) failed" in one_line_error(result)
    assert len(Store(open_engine(f"sqlite:///{db}", create=False)).winners()) == 1


@pytest.mark.parametrize("budget, words", [("0s", "must be positive"), ("garbage", "give a duration"),
                                           ("-5", "give a duration")])
def test_from_trace_budgets_that_are_not_durations(tmp_path, budget, words):
    gemm = trace_file(tmp_path, "gemm.jsonl", HEADER + GEMM_LINE + b'{"record": "end", "count": 1}\n')
    # A usage error, as the parser's own (--trials 0) are: exit 2.
    assert words in one_line_error(invoke("tune", "--from-trace", gemm, "--gpu", "interpret", "--budget", budget), 2)


@pytest.fixture
def fresh_counters(monkeypatch):
    """The trace recorder with no counters of earlier tests; returns one counter of GEMM_PROBLEM, counted 4 times."""
    monkeypatch.setattr(trace, "_counters", {})
    count = trace.counter(GEMM, GEMM_PROBLEM, CPU)
    count[0] += 4
    return count


def test_flushing_into_a_damaged_trace_keeps_both_the_counts_and_the_file(tmp_path, fresh_counters, caplog):
    path = trace_file(tmp_path, "t.jsonl", HEADER + b'{"family": "gemm"')
    with caplog.at_level(logging.WARNING, logger="autotile.runtime"):
        trace.flush(path)
    assert [e.calls for e in read_trace(path)] == [4]
    assert (tmp_path / "t.jsonl.unreadable").read_bytes() == HEADER + b'{"family": "gemm"'
    assert "moved to" in caplog.text and "t.jsonl.unreadable" in caplog.text
    assert fresh_counters[0] == 0
    fresh_counters[0] += 2
    trace.flush(path)  # the new trace merges as usual
    assert [e.calls for e in read_trace(path)] == [6]


@pytest.mark.parametrize("what", ["folder", "notes"])
def test_flushing_never_moves_what_is_not_a_trace(tmp_path, fresh_counters, what):
    target = tmp_path / "traces"
    if what == "folder":
        target.mkdir()
        (target / "notes.txt").write_text("data")
    else:
        target.write_text("# my notes\n")
    with pytest.raises(trace.TraceFormatError, match="nothing was recorded"):
        trace.flush(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["traces"]  # nothing moved aside, no lock file left
    assert (target / "notes.txt").read_text() == "data" if what == "folder" else target.read_text() == "# my notes\n"
    assert fresh_counters[0] == 4  # the counts stay for a flush to a trace


def test_flushing_into_an_empty_file_starts_a_trace(tmp_path, fresh_counters):
    path = tmp_path / "t.jsonl"
    path.write_text("")
    trace.flush(path)
    assert [e.calls for e in read_trace(path)] == [4]


def test_a_failed_trace_write_keeps_the_counts_for_the_next_flush(tmp_path, fresh_counters, monkeypatch):
    path = tmp_path / "t.jsonl"

    def full_disk(*args):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(trace, "write_trace", full_disk)
        with pytest.raises(OSError):
            trace.flush(path)
    assert fresh_counters[0] == 4
    trace.flush(path)
    assert [e.calls for e in read_trace(path)] == [4]


# --- models --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("args, words", [
    (("--model", "llama-9000"), "unknown model 'llama-9000'; known: llama3-8b"),
    (("--dims", "hidden=64,heads"), "is not NAME=INTEGER"),
    (("--dims", "hidden=64"), "--dims needs heads, intermediate"),
    (("--model", "llama3-8b", "--tokens", "0"), "--tokens: '0' is not a token count"),
])
def test_tune_gemm_model_input_errors(args, words):
    assert words in one_line_error(invoke("tune", "gemm", *args, "--gpu", "interpret"))


def test_a_budget_that_is_no_duration_is_a_usage_error():
    result = invoke("tune", "gemm", "--model", "llama3-8b", "--budget", "soon", "--gpu", "interpret")
    assert "--budget 'soon'" in one_line_error(result, 2)


def test_tune_timeouts_must_be_positive(planned):
    for value in ("0", "-1", "nan"):
        line = one_line_error(invoke("tune", "elementwise", "--expr", "x + 1", "--numel", "64", "--gpu", "interpret",
                                     "--timeout", value), exit_code=2)
        assert "is not a number of seconds above 0" in line
    assert not planned


# --- damaged verified ranges ----------------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["{not json", '{"m": [32, 17]}', '{"m": [17, 32, 64]}', '{"m": "17..32"}', '"m"'])
def test_a_damaged_verified_range_falls_back_and_says_so_once(gemm_db, damage, user_db, monkeypatch, caplog):
    path, url = gemm_db
    set_range(path, damage)
    winners = Store(open_engine(url, create=False, read_only=True)).winners("gemm")
    assert len(winners) == 1 and winners[0].verified_range is None  # the winner stays, without its range
    monkeypatch.setenv("AUTOTILE_DB", url)
    dispatch.clear_cache()
    a, b = torch.randn(18, 40), torch.randn(40, 24)
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            torch.testing.assert_close(autotile.matmul(a, b), a @ b, rtol=1e-4, atol=1e-4)
        explained = autotile.explain("matmul", a, b)
    assert explained["source"] == "user-db" and explained["match"] != "range"
    assert caplog.text.count("is damaged") == 1 and "not using the tuning database" not in caplog.text
    set_range(path, GOOD_RANGE)  # the same winner with a whole range serves the call through it
    dispatch.clear_cache()
    assert autotile.explain("matmul", a, b)["match"] == "range"


def test_the_damaged_range_warning_names_the_winner_and_what_to_do(gemm_db, caplog):
    path, url = gemm_db
    set_range(path, "{not json")
    store = Store(open_engine(url, create=False, read_only=True))
    with caplog.at_level(logging.WARNING, logger="autotile.store"):
        store.winners("gemm")
        store.winners("gemm")
    assert caplog.text.count("is damaged") == 1
    assert str(path) in caplog.text and '"m":20' in caplog.text and "tune that shape again" in caplog.text


@pytest.mark.parametrize("damage", ["{not json", '{"m": [17, 32, 64]}', '{"m": [1, 4]}', '{"k": [1, 64]}'])
def test_export_and_import_keep_a_winner_whose_range_is_damaged(gemm_db, damage, tmp_path):
    path, url = gemm_db
    set_range(path, damage)
    out = tmp_path / "winners.jsonl"
    assert export_database(url, out) == {"winner": 1, "policy": 0}
    report = import_file(f"sqlite:///{tmp_path / 'copy.sqlite'}", out)
    assert report.kept_count == 1 and report.skipped_count == 0, report.skipped
    (copied,) = Store(open_engine(f"sqlite:///{tmp_path / 'copy.sqlite'}", create=False)).winners("gemm")
    assert copied.verified_range is None and copied.problem_key == GEMM.problem_key(GEMM_PROBLEM)


def test_copying_winners_carries_a_damaged_range_as_none(gemm_db, tmp_path):
    from autotile.store.ship import copy_winners

    path, url = gemm_db
    set_range(path, "{not json")
    target = f"sqlite:///{tmp_path / 'shipped.sqlite'}"
    assert copy_winners(url, target) == 1
    (copied,) = Store(open_engine(target, create=False)).winners("gemm")
    assert copied.verified_range is None


def test_export_round_trip_keeps_a_whole_range(gemm_db, tmp_path):
    path, url = gemm_db
    set_range(path, GOOD_RANGE)
    out = tmp_path / "winners.jsonl"
    export_database(url, out)
    copy = f"sqlite:///{tmp_path / 'copy.sqlite'}"
    import_file(copy, out)
    (copied,) = Store(open_engine(copy, create=False)).winners("gemm")
    assert copied.verified_range == json.loads(GOOD_RANGE)


# --- db import / merge / export with the wrong kind of file, unknown families ------------------------------


def test_import_and_merge_name_the_command_that_reads_the_file(gemm_db, tmp_path):
    path, url = gemm_db
    target = tmp_path / "target.sqlite"
    line = one_line_error(invoke("db", "import", path, "--db", target))
    assert "it is a SQLite database; merge its winners with `autotile db merge" in line
    export = tmp_path / "winners.jsonl"
    export_database(url, export)
    line = one_line_error(invoke("db", "merge", export, "--db", target))
    assert "is an autotile export, not a database: import it with `autotile db import" in line
    garbage = tmp_path / "garbage.sqlite"
    garbage.write_bytes(b"not a database at all" * 50)
    line = one_line_error(invoke("db", "merge", garbage, "--db", target))  # advice about the source, not --db
    assert f"cannot merge from {garbage}" in line and "nothing was merged" in line and "--db" not in line


@pytest.mark.parametrize("command", [("report", "--out", "r.md"), ("db", "export", "--out", "w.jsonl"),
                                     ("db", "verify", "--gpu", "interpret")])
def test_an_unknown_family_filter_is_refused_not_an_empty_result(command, tmp_path):
    result = invoke(*command, "--family", "gemmm", "--db", tmp_path / "x.sqlite")
    assert "unknown family 'gemmm'; autotile has gemm" in one_line_error(result, exit_code=2)


def _flush_many(path: str, calls: int, rounds: int) -> None:
    trace._counters.clear()
    count = trace.counter(GEMM, GEMM_PROBLEM, CPU)
    for _ in range(rounds):
        count[0] += calls
        trace.flush(path)


def test_ranks_flushing_into_one_trace_all_count(tmp_path):
    """Ranks of one job flush into one file (at exit, at once): each read, merged and wrote the file with no lock
    between them, so one rank's counts could be written over by another's."""
    import multiprocessing

    path = str(tmp_path / "t.jsonl")
    context = multiprocessing.get_context("fork")
    ranks = [context.Process(target=_flush_many, args=(path, 1 + rank, 25)) for rank in range(4)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(60)
        assert process.exitcode == 0
    assert [e.calls for e in read_trace(path)] == [25 * (1 + 2 + 3 + 4)]


@pytest.mark.parametrize("command", [["db", "export"], ["report"],
                                     ["export-kernel", "gemm", "--m", "17", "--n", "9", "--k", "33"]],
                         ids=["db-export", "report", "export-kernel"])
def test_an_out_path_that_cannot_be_written_gets_one_line(command, tmp_path):
    """Tracebacks before (pathlib's 'has an empty name', NotADirectoryError on the partial file)."""
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    env = {"AUTOTILE_DB": f"sqlite:///{tmp_path / 'd.sqlite'}"}
    gpu = ["--gpu", "interpret"] if command[0] == "export-kernel" else []
    empty = CliRunner(env=env).invoke(cli, [*command, *gpu, "--out", ""])
    assert empty.exit_code == 2 and "names no file" in empty.output
    under_a_file = CliRunner(env=env).invoke(cli, [*command, *gpu, "--out", str(blocker / "x.md")])
    assert under_a_file.exit_code == 1 and "Traceback" not in under_a_file.output, under_a_file.output
    assert "Error:" in under_a_file.output


@pytest.mark.parametrize("args, words", [
    (["tune", "gemm", "--m", "17", "--n", "9", "--k", "33", "--tokens", "1"], "--tokens goes with --model"),
    (["tune", "gemm", "--m", "17", "--n", "9", "--k", "33", "--policy"], "--policy goes with --model"),
    (["tune", "gemm", "--model", ""], "name a model"),
    (["tune", "--shard", "1/2", "gemm", "--m", "17", "--n", "9", "--k", "33"], "--shard before a family goes with"),
    (["tune", "--budget", "5s", "gemm", "--m", "17", "--n", "9", "--k", "33"], "--budget before a family goes with"),
    (["tune", "--trials", "1", "--db", "elsewhere.sqlite", "gemm", "--m", "17", "--n", "9", "--k", "33"],
     "--trials, --db before a family go with"),
    (["tune", "--seed", "3"], "--gpu, --trials, --seed go with --from-trace FILE"),
    (["tune", "elementwise", "--numel", "100"], "--numel describes a problem, but no shape was given"),
    (["tune", "gemm", "--dtype", "fp16", "--bias"], "--dtype, --bias describe a problem, but no shape was given"),
    (["tune", "paged", "--page-size", "8", "--dry-run"], "so the default paged suite would run without it"),
], ids=["tokens", "policy", "empty-model", "shard", "budget", "db-trials", "seed-alone", "suite-numel",
        "suite-dtype", "suite-paged"])
def test_options_that_would_be_ignored_are_usage_errors(args, words, tmp_path):
    """Each of these tuned the shape options as if the option were not there."""
    result = CliRunner(env={"AUTOTILE_DB": f"sqlite:///{tmp_path / 'd.sqlite'}"}).invoke(
        cli, [*args, "--gpu", "interpret", "--trials", "1"])
    assert result.exit_code == 2 and words in result.output, result.output
    assert not (tmp_path / "d.sqlite").exists()


def test_fp8_flash_is_refused_where_it_cannot_run_not_skipped_or_tuned(tmp_path):
    """The backward has no fp8 path (render crashed on an empty problem list; tune exited 0 having tuned nothing), and
    the interpreter rounds to e4m3 wrongly (tune stored a winner whose configs all failed their check)."""
    env = {"AUTOTILE_DB": f"sqlite:///{tmp_path / 'd.sqlite'}"}
    shape = ["--batch", "1", "--heads", "1", "--seq", "16", "--head-dim", "16", "--dtype", "fp8"]
    for command in (["render", "flash"], ["tune", "flash", "--gpu", "interpret", "--trials", "1"]):
        result = CliRunner(env=env).invoke(cli, [*command, *shape, "--direction", "bwd"])
        assert "the fp8 path is forward only" in one_line_error(result), command
    result = CliRunner(env=env).invoke(cli, ["tune", "flash", *shape, "--direction", "fwd", "--gpu", "interpret",
                                             "--trials", "1"])
    assert result.exit_code == 1 and "fp8 flash attention runs on CUDA GPUs only" in result.output, result.output


def test_render_and_export_kernel_take_a_named_gpu_that_is_absent_and_refuse_an_unknown_one(tmp_path):
    """Neither runs a kernel: a named GPU's limits (render) and its winner (export-kernel) serve on any machine."""
    shape = ["--m", "64", "--n", "64", "--k", "64"]
    rendered = invoke("render", "gemm", *shape, "--gpu", "h200")
    assert rendered.exit_code == 0 and "def gemm_kernel(" in rendered.output, rendered.output
    empty = tmp_path / "d.sqlite"
    open_engine(f"sqlite:///{empty}", create=True).dispose()  # a database with nothing tuned in it
    exported = invoke("export-kernel", "gemm", *shape, "--gpu", "h200", "--out", tmp_path / "k.py", "--db", empty)
    assert exported.exit_code == 0 and (tmp_path / "k.py").exists(), exported.output
    # A --db that is no database (a folder, a file of something else) is an error: it shipped the default config
    # quietly; a path with no file is said.
    (tmp_path / "junk.sqlite").write_bytes(b"not a database" * 100)
    for bad in (tmp_path / "junk.sqlite", tmp_path):
        line = one_line_error(invoke("export-kernel", "gemm", *shape, "--gpu", "h200", "--out", tmp_path / "k2.py",
                                     "--db", bad))
        assert "database" in line and not (tmp_path / "k2.py").exists(), line
    with pytest.warns(UserWarning, match="no database at"):
        typo = invoke("export-kernel", "gemm", *shape, "--gpu", "h200", "--out", tmp_path / "k3.py",
                      "--db", tmp_path / "typo.sqlite")
    assert typo.exit_code == 0, typo.output
    for command in (["render", "gemm"], ["tune", "gemm", "--db", tmp_path / "d.sqlite"]):
        line = one_line_error(invoke(*command, *shape, "--gpu", "h900"))
        assert "--gpu h900: unknown GPU profile; known: a100, h100, h200, l40s, auto or interpret" in line


@pytest.mark.parametrize("storage", ["bogus://", "postgresql://u:p@127.0.0.1:1/x"])
def test_a_bad_storage_url_is_named_as_the_storage_not_the_database(storage, tmp_path):
    db = tmp_path / "d.sqlite"
    line = one_line_error(invoke("tune", "gemm", "--m", "16", "--n", "16", "--k", "16", "--trials", "1", "--gpu",
                                 "interpret", "--storage", storage, "--db", db))
    assert "cannot open the study storage" in line and "check the --storage URL" in line and str(db) not in line
    assert ":p@" not in line  # the password is hidden


def test_db_export_refuses_stdout_rather_than_writing_a_file_named_dash(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = invoke("db", "export", "--out", "-", "--db", tmp_path / "d.sqlite")
    assert result.exit_code == 2 and "db export writes a file" in result.output
    assert not (tmp_path / "-").exists()


@pytest.mark.parametrize("command, out", [
    (("db", "export"), "gemm.sqlite"), (("db", "export"), "gemm.sqlite-wal"),
    (("report", "--format", "json"), "gemm.sqlite"), (("report", "--format", "json"), "gemm.sqlite-shm"),
    (("export-kernel", "gemm", "--m", "20", "--n", "24", "--k", "40", "--dtype", "fp32", "--gpu", "interpret"),
     "gemm.sqlite")])
def test_writing_over_the_database_being_read_is_refused(gemm_db, command, out):
    path, url = gemm_db
    before = path.read_bytes()
    result = invoke(*command, "--out", path.parent / out, "--db", url)
    assert result.exit_code == 2 and "would destroy every trial" in result.output, result.output
    assert path.read_bytes() == before


def test_a_policy_run_on_the_interpreter_is_refused_with_the_reason(tmp_path):
    result = invoke("tune", "gemm", "--model", "llama3-8b", "--tokens", "1", "--policy", "--gpu", "interpret",
                    "--db", tmp_path / "d.sqlite")
    assert result.exit_code == 2 and "no vendor op to time it against" in result.output, result.output


@pytest.mark.parametrize("ending", ["sigterm", "os._exit"])
def test_a_recording_process_stopped_without_atexit_keeps_its_trace(tmp_path, ending):
    """Servers are stopped by SIGTERM, whose default handler skips atexit; os._exit and SIGKILL skip it too. The
    trace is written on SIGTERM, and every FLUSH_EVERY_S otherwise."""
    import subprocess
    import sys

    path = tmp_path / "t.jsonl"
    stop = "os.kill(os.getpid(), signal.SIGTERM)" if ending == "sigterm" else "time.sleep(1.0); os._exit(0)"
    code = ("import os, signal, time, torch, autotile\n"
            "from autotile.runtime import trace\n"
            "trace.FLUSH_EVERY_S = 0.2\n"
            "autotile.fuse('x * 2')(x=torch.ones(8))\n"
            f"{stop}\n"
            "time.sleep(30)\n")
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, "AUTOTILE_RECORD": str(path)},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == (-15 if ending == "sigterm" else 0), done.stderr
    assert [(e.family, e.calls) for e in read_trace(path)] == [("elementwise", 1)]


def test_winners_of_another_toolchain_are_marked_stale_when_their_device_next_tunes(tmp_path):
    db = tmp_path / "d.sqlite"
    args = ("--numel", "4096", "--trials", "1", "--gpu", "interpret", "--db", db)
    assert invoke("tune", "elementwise", "--expr", "x*2", *args).exit_code == 0
    with sqlite3.connect(db) as conn:
        conn.execute("update autotile_toolchains set triton = '3.5.0'")  # as imported from an older install
    assert "stale" not in invoke("list", "--db", db).output
    assert invoke("tune", "elementwise", "--expr", "x*3", *args).exit_code == 0
    rows = [line for line in invoke("list", "--db", db).output.splitlines() if "mul(" in line]
    assert [("stale" in line, "mul(2" in line) for line in rows] in ([(True, True), (False, False)],
                                                                     [(False, False), (True, True)])


def test_show_names_imported_winners_that_have_no_trials_here(gemm_db, tmp_path):
    path, url = gemm_db
    export = tmp_path / "w.jsonl"
    assert invoke("db", "export", "--db", url, "--out", export).exit_code == 0
    fresh = tmp_path / "fresh.sqlite"
    assert invoke("db", "import", export, "--db", fresh).exit_code == 0
    result = invoke("show", "gemm", "--db", fresh)
    assert result.exit_code == 0 and "winner on interpret" in result.output, result.output
    assert "none stored here (the winner was imported or merged)" in result.output


def test_report_and_export_of_a_selection_that_matches_nothing_name_what_is_stored(gemm_db, tmp_path):
    path, url = gemm_db
    for command in (("report", "--out", tmp_path / "r.md"), ("db", "export", "--out", tmp_path / "e.jsonl")):
        result = invoke(*command, "--device", "bogus", "--db", url)
        assert result.exit_code == 0 and "no winners stored for device 'bogus'; the database holds winners of " \
            "families gemm on devices interpret" in result.output, result.output


def test_setup_mistakes_get_one_line_each(tmp_path, monkeypatch):
    """A folder as the database read as a full disk; a database under a file, and env with an unusable kernel cache,
    gave tracebacks; a blank AUTOTILE_DB became a file named by spaces; --tf32 on fp16 was dropped silently; a
    report's missing folder was created (at /, as root)."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert "is a folder, not a database file" in one_line_error(invoke("list", "--db", tmp_path))
    line = one_line_error(invoke("tune", "gemm", "--m", "32", "--n", "32", "--k", "32", "--trials", "1", "--gpu",
                                 "interpret", "--db", blocker / "x.sqlite"))
    assert "a part of the path is a file, not a folder" in line
    monkeypatch.setenv("AUTOTILE_CACHE_DIR", str(blocker))
    env = invoke("env")
    assert env.exit_code == 0 and "unusable: cannot write rendered kernels" in env.output, env.output
    monkeypatch.delenv("AUTOTILE_CACHE_DIR")
    monkeypatch.setenv("AUTOTILE_DB", "   ")
    assert '"database": "sqlite:///   "' not in invoke("env").output and "/   " not in invoke("env").output
    monkeypatch.delenv("AUTOTILE_DB")
    line = one_line_error(invoke("tune", "gemm", "--m", "32", "--n", "32", "--k", "32", "--dtype", "fp16", "--tf32",
                                 "--gpu", "interpret", "--db", tmp_path / "t.sqlite"))
    assert "drop --tf32" in line
    open_engine(f"sqlite:///{tmp_path / 't.sqlite'}", create=True).dispose()
    line = one_line_error(invoke("report", "--db", tmp_path / "t.sqlite", "--out", tmp_path / "missing" / "r.html"))
    assert "does not exist" in line and not (tmp_path / "missing").exists()


def test_an_unwritable_kernel_cache_is_replaced_by_a_process_folder_and_said_once(tmp_path, monkeypatch):
    """Every config was filed as a crash (NotADirectoryError), and never tried again once the cache was fixed; then
    the tune stopped, and served calls with no vendor op (fuse, any call on the CPU) raised, telling the user to
    report a bug. The process now renders into a temporary folder of its own and says so once."""
    import warnings

    import torch

    import autotile
    from autotile import render

    blocker = tmp_path / "file"
    blocker.write_text("")
    db = tmp_path / "t.sqlite"
    shape = ["--m", "32", "--n", "32", "--k", "32", "--trials", "1", "--gpu", "interpret", "--db", db]
    monkeypatch.setattr("autotile.render._loaded", {})  # kernels this process loaded before would need no cache
    monkeypatch.setattr("autotile.render._warned", set())
    monkeypatch.setenv("AUTOTILE_CACHE_DIR", str(blocker))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        done = invoke("tune", "gemm", *shape)
        a = torch.randn(8, 8)
        assert torch.equal(autotile.fuse("x * 2 + 1")(x=a), a * 2 + 1)
    assert done.exit_code == 0 and "trials {'ok': 1}" in done.output, done.output
    said = [str(w.message) for w in caught if "cannot write rendered kernels" in str(w.message)]
    assert len(said) == 1 and "AUTOTILE_CACHE_DIR" in said[0] and "renders its kernels into" in said[0], said
    assert render._process_cache and render._process_cache[0].is_dir()


def test_a_damaged_kernel_cache_file_is_written_again_not_imported(tmp_path, monkeypatch):
    """A cached kernel file was imported as it was: cut short (a crash between write and rename is enough), every
    call raised SyntaxError or AttributeError from then on; edited, it returned wrong numbers silently."""
    import warnings

    import torch

    import autotile
    from autotile import render
    from autotile.runtime.dispatch import clear_cache

    monkeypatch.setenv("AUTOTILE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr("autotile.render._warned", set())
    monkeypatch.setattr("autotile.render._loaded", {})
    a = torch.randn(8, 8)
    def as_a_new_process():
        clear_cache()
        render._loaded.clear()
        render._import_path.cache_clear()

    for damage in ("", "junk %%% not python", None):
        as_a_new_process()
        autotile.fuse("x * 3 - 1")(x=a)
        (path,) = (tmp_path / "cache" / "kernels").glob("*.py")
        text = path.read_text()
        edited = text.replace("3.0", "4.0")
        assert damage is not None or edited != text
        path.write_text(damage if damage is not None else edited)
        as_a_new_process()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert torch.equal(autotile.fuse("x * 3 - 1")(x=a), a * 3 - 1), damage
        assert path.read_text() == text
        assert any("did not hold the kernel its name stands for" in str(w.message) for w in caught)
        render._warned.clear()


def test_trial_timeout_under_the_interpreter_says_it_does_not_apply(tmp_path):
    """Its help gave it an interpreter default, but interpreter trials run in the tuner's process: a --trial-timeout
    of 1 s let 5 s trials finish as 'ok', silently."""
    result = invoke("tune", "gemm", "--m", 16, "--n", 16, "--k", 16, "--trials", 1, "--gpu", "interpret",
                    "--trial-timeout", 1, "--db", f"sqlite:///{tmp_path / 't.sqlite'}")
    assert result.exit_code == 0, result.output
    assert "--trial-timeout applies on a GPU only" in " ".join(result.output.split())


def test_tune_into_a_folder_names_it_as_every_other_command_does(tmp_path):
    # tune said "not a readable database ... move this one away" of a folder.
    line = one_line_error(invoke("tune", "gemm", "--m", 16, "--n", 16, "--k", 16, "--trials", 1, "--gpu", "interpret",
                                 "--db", tmp_path))
    assert "is a folder, not a database file" in line and "tuning.sqlite" in line


def test_a_mean_context_above_the_context_is_refused_not_clamped(tmp_path):
    # It tuned max_context = mean_context = 32 instead: another problem, silently.
    line = one_line_error(invoke("tune", "paged", "--batch", 1, "--context", 32, "--mean-context", 64, "--trials", 1,
                                 "--gpu", "interpret", "--db", tmp_path / "t.sqlite"))
    assert "mean_context <= max_context" in line


def test_from_trace_stops_at_a_database_it_cannot_use(tmp_path, monkeypatch):
    # Each problem repeated the same database error; the command now says it once.
    from autotile.errors import DatabaseError
    from autotile.tune import driver

    calls = []

    def unusable(*args, **kwargs):
        calls.append(1)
        raise DatabaseError("sqlite:///x.sqlite cannot be written (a read-only file)")

    monkeypatch.setattr(driver, "tune_problem", unusable)
    two = trace_file(tmp_path, "two.jsonl", HEADER + GEMM_LINE + GEMM_LINE.replace(b'"m": ', b'"m": 1') +
                     b'{"record": "end", "count": 2}\n')
    line = one_line_error(invoke("tune", "--from-trace", two, "--gpu", "interpret", "--db", tmp_path / "t.sqlite"))
    assert "cannot be written" in line and len(calls) == 1
