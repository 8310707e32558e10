"""benchmarks/time_to_winner.py: reading Inductor's autotuning tables and a fresh run's trial rows, and the report.

The script's measurement needs a GPU (Inductor, cuBLAS); what it concludes comes from these functions, checked
here on hand-made inputs: trial rows written through autotile's own store, Inductor's printed format.
"""
from __future__ import annotations

import datetime
import json
from pathlib import Path

import pytest
from scripts import loaded_script

from autotile.device import interpret_device
from autotile.families.gemm import FAMILY, contiguous_problem
from autotile.store.db import open_engine
from autotile.store.repo import Store

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "time_to_winner.py"
LAUNCH = datetime.datetime(2026, 1, 2, 3, 4, 5)
STUDY = "autotile:gemm:interpret:abc:t1"
KERNEL = {"BLOCK_M": 16, "BLOCK_N": 32}
VENDOR = {"VENDOR": "cublas"}


@pytest.fixture(scope="module")
def ttw():
    yield from loaded_script(SCRIPT, "time_to_winner")


# In the format of torch._inductor.select_algorithm (AlgorithmSelectorCache.log_results), with the lines it
# prints around the tables.
INDUCTOR_STDERR = """\
W0101 12:00:00.000 torch/_inductor/utils.py:1 some warning
AUTOTUNE mm(3000x1536, 1536x5000)
strides: [1536, 1], [1, 1536]
dtypes: torch.bfloat16, torch.bfloat16
  triton_mm_7 0.0712 ms 100.0% ACC_TYPE='tl.float32', ALLOW_TF32=False, BLOCK_K=64, BLOCK_M=128, num_warps=8
  mm 0.0745 ms 95.6% \n  triton_mm_3 0.1020 ms 69.8% ACC_TYPE='tl.float32', BLOCK_K=32
SingleProcess AUTOTUNE benchmarking takes 0.8123 seconds and 6.5000 seconds precompiling for 21 choices
Autotune Choices Stats:
{"num_choices": 21}
AUTOTUNE addmm(16x4096, 16x4096, 4096x4096)
  bias_addmm 0.0300 ms 100.0% \n  addmm 0.0310 ms 96.8% \nSingleProcess AUTOTUNE benchmarking takes 0.2000 seconds and 1.0000 seconds precompiling
"""


def test_parse_inductor_autotune_reads_each_table_and_its_pick(ttw):
    tables = ttw.parse_inductor_autotune(INDUCTOR_STDERR)
    assert [t["op"] for t in tables] == ["mm(3000x1536, 1536x5000)", "addmm(16x4096, 16x4096, 4096x4096)"]
    mm, addmm = tables
    assert mm["picked"] == "triton_mm_7" and mm["choices"][1] == ("mm", 0.0745) and len(mm["choices"]) == 3
    assert (mm["benchmark_s"], mm["precompile_s"], mm["num_choices"]) == (0.8123, 6.5, 21)
    # An older summary line without "for N choices": the count is the choices printed.
    assert addmm["picked"] == "bias_addmm" and addmm["num_choices"] == 2 and addmm["precompile_s"] == 1.0
    assert ttw.parse_inductor_autotune("no tables here\n  mm 0.1 ms\n") == []


def _db(tmp_path, trials: list[tuple], vendor: list[tuple], winner: dict | None) -> str:
    """A database written through autotile's store: trials (number, status, ms, seconds after LAUNCH)."""
    url = f"sqlite:///{tmp_path / 'tune.sqlite'}"
    store = Store(open_engine(url, create=True))
    device = interpret_device()
    problem = contiguous_problem(20, 24, 40, "fp16", "fp16", layout_b="col")
    ids = {"problem_id": store.ensure_problem(FAMILY, problem), "device_id": store.ensure_device(device),
           "toolchain_id": store.ensure_toolchain()}
    for study, rows, config in ((STUDY, trials, KERNEL), (STUDY + ":vendor", vendor, VENDOR)):
        for number, status, ms, after in rows:
            store.record_trial(**ids, study=study, number=number, config=json.dumps(config), config_hash=str(number),
                               status=status, median_ms=ms, created_at=LAUNCH + datetime.timedelta(seconds=after))
    if winner is not None:
        store.save_winner(problem_id=ids["problem_id"], device=device, device_id=ids["device_id"],
                          toolchain_id=ids["toolchain_id"], config=json.dumps(winner["config"]), config_hash="w",
                          median_ms=winner["ms"], q20_ms=winner["ms"], q80_ms=winner["ms"])
    store.engine.dispose()
    return url


def test_parity_is_the_first_search_trial_at_most_the_vendor_time(ttw, tmp_path):
    # Recorded out of number order on purpose: the time stamp decides. A tie with the vendor counts.
    url = _db(tmp_path, [(0, "ok", 0.50, 6.0), (1, "compile_error", None, 7.5), (3, "ok", 0.40, 9.0),
                         (2, "ok", 0.30, 11.0), (4, "ok", 0.20, 12.0)],
              [(0, "ok", 0.40, 14.0), (1, "wrong_result", None, 13.0)], {"config": KERNEL, "ms": 0.2})
    got = ttw.parity_from_db(url, LAUNCH)
    assert got["vendor_ms"] == 0.40 and got["vendor_timed_s"] == pytest.approx(14.0)
    assert got["kernel_parity_trial"] == 3 and got["parity_s"] == pytest.approx(9.0)
    assert got["kernel_parity_s"] == got["parity_s"] and "search trial 3" in got["parity_by"]
    assert (got["trials"], got["trials_ok"], got["best_trial_ms"]) == (5, 4, 0.20)
    assert got["first_trial_s"] == pytest.approx(6.0) and got["last_trial_s"] == pytest.approx(12.0)
    assert not got["vendor_won"] and got["winner"]["median_ms"] == 0.2


def test_parity_falls_back_to_the_final_retiming_when_only_the_vendor_gets_there(ttw, tmp_path):
    url = _db(tmp_path, [(0, "ok", 0.50, 6.0), (1, "ok", 0.45, 7.0)], [(0, "ok", 0.40, 20.0)],
              {"config": VENDOR, "ms": 0.40})
    got = ttw.parity_from_db(url, LAUNCH)
    assert got["kernel_parity_s"] is None and got["vendor_won"]
    assert got["parity_s"] == pytest.approx(20.0) and got["parity_by"].startswith("vendor op")
    # A kernel that won only the final re-timing is named so.
    rows = [(STUDY, 0, "ok", 0.5, LAUNCH + datetime.timedelta(seconds=3), "{}"),
            (STUDY + ":vendor", 0, "ok", 0.4, LAUNCH + datetime.timedelta(seconds=8), "{}")]
    kernel = ttw.parity_from_rows(rows, LAUNCH, {"config": KERNEL})
    assert kernel["parity_s"] == pytest.approx(8.0) and "final re-timing only" in kernel["parity_by"]


def test_without_a_vendor_op_there_is_no_parity(ttw, tmp_path):
    url = _db(tmp_path, [(0, "ok", 0.5, 6.0)], [(0, "wrong_result", None, 9.0)], {"config": KERNEL, "ms": 0.5})
    got = ttw.parity_from_db(url, LAUNCH)
    assert got["parity_s"] is None and got["vendor_ms"] is None and "no vendor op" in got["parity_by"]
    with pytest.raises(ValueError, match="2 studies"):
        ttw.parity_from_rows([("a", 0, "ok", 1.0, LAUNCH, "{}"), ("b", 0, "ok", 1.0, LAUNCH, "{}")], LAUNCH, None)


def test_verdict_compares_parity_with_inductor(ttw):
    assert ttw.verdict(5.0, 8.0) == "met" and ttw.verdict(8.0, 8.0) == "met"
    assert ttw.verdict(9.0, 8.0) == "NOT met"
    assert ttw.verdict(None, 8.0) == "n/a" and ttw.verdict(5.0, None) == "n/a"


def _row(label, parity_s, inductor_s, inductor_ok=True, served_ok=True):
    check = {"ok": True, "message": "y: ok"}
    return {
        "label": label, "shape": [1, 2, 3],
        "inductor": {"rc": 0, "autotune_s": inductor_s, "startup_s": 4.0, "kernel_ms": 0.07, "flinear_ms": 0.075,
                     "check": {"ok": inductor_ok, "message": "y: ok" if inductor_ok else "y: 3 of 6 outside"},
                     "autotune_tables": ttw_tables()},
        "autotile": {"rc": 0, "total_s": 30.0, "parity_s": parity_s, "parity_by": "search trial 3 (...)",
                     "trials": 12, "trials_ok": 11, "first_trial_s": 9.0, "last_trial_s": 25.0,
                     "best_trial_ms": 0.069, "vendor_ms": 0.074, "vendor_timed_s": 28.0,
                     "winner": {"config": KERNEL, "median_ms": 0.069},
                     "served": {"source": "user-db", "match": "exact", "vendor": None, "served_ms": 0.0695,
                                "flinear_ms": 0.0741, "check": {**check, "ok": served_ok}}},
    }


def ttw_tables():
    return [{"op": "mm(3000x1536, 1536x5000)", "picked": "triton_mm_7", "choices": [], "num_choices": 21,
             "benchmark_s": 0.8, "precompile_s": 6.5}]


def test_markdown_table_verdicts_and_refusals(ttw):
    rows = [_row("3000x5000x1536", 7.0, 8.0), _row("16x4096x4096", 12.0, 8.0),
            _row("128x14336x4096", 5.0, 8.0, inductor_ok=False, served_ok=False),
            {"label": "2048x4096x14336", "shape": [2048, 4096, 14336], "skipped": "budget of 225 s spent"}]
    meta = {"date": "2026-01-02", "device": "NVIDIA H200", "dtype": "bf16", "rounds": 5,
            "tune_command": "autotile tune gemm ... --trials 12 --patience 4"}
    text = ttw.markdown(rows, meta)
    lines = {line.split(" | ")[0]: line for line in text.splitlines() if line.startswith("| ")}
    assert lines["| 3000x5000x1536"].endswith("| met |") and "| 0.0695 | 0.0741 |" in lines["| 3000x5000x1536"]
    assert lines["| 16x4096x4096"].endswith("| NOT met |")
    # A wrong result is never timed or judged.
    assert "| WRONG |" in lines["| 128x14336x4096"] and lines["| 128x14336x4096"].endswith("| n/a |")
    assert "skipped: budget" in lines["| 2048x4096x14336"]
    assert "Target met on 1 of 2 shapes" in text
    assert "triton_mm_7 of 21 choices" in text and "parity by search trial 3" in text
    # The second comparison counts Inductor's process start-up (4 s) as autotile's is counted.
    assert "12.0 s against 7.0 s: met" in text and "12.0 s against 12.0 s: met" in text


def _inprocess(parity_s, served_ok=True, rc=0):
    return {"rc": rc, "startup_s": 11.0, "import_tuner_s": 1.5, "tune_s": 6.5, "parity_s": parity_s,
            "parity_by": "search trial 2 (...)", "stopped_early": "no improvement in 4 trials", "trials": 9,
            "trials_ok": 9, "first_trial_s": 1.2, "last_trial_s": 5.0, "best_trial_ms": 0.0171, "vendor_ms": 0.019,
            "vendor_timed_s": 6.0, "vendor_first_s": 0.9, "winner": {"config": KERNEL, "median_ms": 0.0171, "saved_s": 6.4},
            "served": {"source": "user-db", "match": "exact", "vendor": None, "served_ms": 0.0172,
                       "flinear_ms": 0.0190, "check": {"ok": served_ok, "message": "y: ok"}}}


def test_markdown_in_process_columns_and_verdict(ttw):
    # In-process parity (from the tune_problem call) against Inductor's autotuning, neither counting start-up.
    rows = [{**_row("3000x5000x1536", 19.9, 8.0), "inprocess": _inprocess(7.5)},
            {**_row("16x4096x4096", 13.7, 4.1), "inprocess": _inprocess(4.2)},
            {**_row("128x14336x4096", 20.5, 4.9), "inprocess": _inprocess(3.0, served_ok=False)},
            {**_row("4096x4096x4096", 9.0, 9.5), "inprocess": _inprocess(2.0, rc=1)},
            _row("64x64x64", 1.0, 2.0)]
    meta = {"date": "2026-01-02", "device": "NVIDIA H200", "dtype": "bf16", "rounds": 5,
            "tune_command": "autotile tune gemm ...", "inprocess_call": "tune_problem(gemm, ..., isolate=False)"}
    text = ttw.markdown(rows, meta)
    lines = {line.split(" | ")[0]: line for line in text.splitlines() if line.startswith("| ")}
    cells = {label: [c.strip() for c in line.strip("|").split("|")] for label, line in lines.items()}
    header = cells["| M x N x K"]
    assert len(header) == 12 and header[-1] == "verdict" and header[-2] == "in-process verdict"
    assert all(len(c) == 12 for c in cells.values())  # every row fills the table, the rows without a run too
    # The in-process columns, then the two verdicts: in-process against Inductor, the CLI's (unchanged) last.
    assert cells["| 3000x5000x1536"][7:] == ["7.5", "6.5", "0.0172", "met", "NOT met"]
    assert cells["| 16x4096x4096"][-2:] == ["NOT met", "NOT met"]
    # A wrong served result shows WRONG; a failed in-process run is not judged; a row without one says so.
    assert cells["| 128x14336x4096"][9] == "WRONG"
    assert cells["| 4096x4096x4096"][-2:] == ["n/a", "met"]
    assert cells["| 64x64x64"][7:] == ["not run", "-", "-", "n/a", "met"]
    assert "Target met on 2 of 5 shapes" in text
    assert "In-process: met on 2 of 3 shapes" in text and "tune_problem(gemm, ..., isolate=False)" in text
    assert ("autotile in-process: start-up 11.0 s (importing the tuner 1.5 s of it) before the tune_problem call, "
            "which returned after 6.5 s") in text
    assert "autotile in-process: 9 trials (9 ok), first recorded at 1.2 s" in text
    assert "autotile in-process winner served: source user-db (exact)" in text
    assert "autotile in-process tune failed (rc 1)" in text
    # The CLI's notes read as before.
    assert "  - autotile: 12 trials (11 ok)" in text and "  - served: source user-db (exact)" in text


def test_in_process_child_tunes_in_its_process_and_times_from_the_call(ttw, tmp_path, monkeypatch):
    """The in-process child on the interpreter, end to end: tune_problem with isolate=False and the CLI run's
    settings, start-up apart, then parity read from its database with the call as time zero (as run_inprocess
    does)."""
    import time

    from autotile.tune import driver

    calls, original = [], driver.tune_problem

    def tune_problem(*args, **kwargs):
        calls.append(kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(driver, "tune_problem", tune_problem)
    url = f"sqlite:///{tmp_path / 'tune.sqlite'}"
    monkeypatch.setenv("AUTOTILE_DB", url)
    out = tmp_path / "result.json"
    launched = time.time()
    assert ttw.main(["--child", "inprocess", "--child-out", str(out), "--m", "20", "--n", "24", "--k", "40",
                     "--dtype", "fp16", "--trials", "3", "--patience", "2", "--rounds", "1",
                     "--launched-at", repr(launched), "--interpret"]) == 0
    got = json.loads(out.read_text())
    assert [(c["isolate"], c["trials"], c["patience"], c["seed"], c["db_url"]) for c in calls] == [(False, 3, 2, 0, url)]
    assert got["device"] == "interpreter" and got["startup_s"] >= 0 and got["import_tuner_s"] >= 0
    assert got["tune_s"] > 0 and got["trials_this_run"] == 3 and got["statuses"] == {"ok": 3}
    parity = ttw.parity_from_db(url, datetime.datetime.fromisoformat(got["tune_started_utc"]))
    # The trials ran after the call began and the winner was stored before it returned.
    assert parity["trials"] == 3 and 0 < parity["first_trial_s"] <= parity["last_trial_s"]
    assert parity["winner"]["saved_s"] <= got["tune_s"] + 0.5  # wall-clock stamps against a perf_counter span
    assert parity["winner"]["config"] == got["tuned_config"]


def test_report_paths_and_shape_option(ttw, tmp_path):
    md, raw = ttw.write_report(tmp_path / "out", "# t\n", [{"label": "x"}], {"date": "d"})
    assert md == tmp_path / "out" / "time_to_winner.md" and raw.suffix == ".json"
    md, raw = ttw.write_report(tmp_path / "r.md", "# t\n", [], {})
    assert md.read_text() == "# t\n" and json.loads(raw.read_text()) == {"meta": {}, "rows": []}
    assert ttw._shape("16x4096x4096") == (16, 4096, 4096)
    with pytest.raises(Exception, match="MxNxK"):
        ttw._shape("16x4096")


def test_without_a_gpu_the_script_says_to_use_smoke(ttw, tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert ttw.main(["--quick", "--out", str(tmp_path / "r.md")]) == 1
    assert "--smoke" in capsys.readouterr().err


def test_interleaved_timings_take_turns_and_give_each_callable_its_median():
    from autotile.bench import interleaved_medians, interleaved_samples

    order, times = [], {"a": iter([3.0, 1.0, 2.0]), "b": iter([10.0, 30.0, 20.0])}
    fns = {name: (lambda name=name: name) for name in times}

    def time_one(fn):
        name = fn()
        order.append(name)
        return next(times[name])

    assert interleaved_medians(fns, 3, time_one) == {"a": 2.0, "b": 20.0}
    assert order == ["a", "b"] * 3  # each round times every callable once, in turn
    assert interleaved_samples({"x": lambda: None}, 2, lambda fn: 1.5) == {"x": [1.5, 1.5]}
