"""Reports: the model gathered from a real (interpreter) tuning database, every format, the CLI command,
the SVG plots, the JSON schema, and the HTML page in a real headless browser."""
from __future__ import annotations

import csv
import io
import json
import math
import re
import shutil
import struct
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from click.testing import CliRunner

from autotile.cli.report import report_command
from autotile.device import PROFILES, DeviceInfo, interpret_device
from autotile.families import get_family
from autotile.families.gemm import contiguous_problem
from autotile.reports import ReportFormat, build_report, render
from autotile.reports import svg
from autotile.reports.data import MIN_TRIALS_FOR_IMPORTANCE, ceilings_for, performance
from autotile.store.db import open_engine
from autotile.store.repo import Store
from autotile.tune.driver import tune_problem
from autotile.tune.storage import journal_path, optuna_storage, study_journal

SCHEMA = Path(__file__).resolve().parents[1] / "autotile" / "reports" / "report.schema.json"
TUNED_TRIALS = 6
# A problem recorded as if tuned on an H200 (made-up timings), so the roofline and the ceilings are exercised.
H200 = DeviceInfo("h200", "NVIDIA H200", (9, 0), 132, 150_000_000_000, 232448, "test")
H200_WINNER_MS = 0.25


@pytest.fixture(scope="module")
def db(tmp_path_factory) -> str:
    """One database: a real interpreter tuning of a small GEMM, a problem whose every trial failed, and an H200 winner."""
    url = f"sqlite:///{tmp_path_factory.mktemp('reports') / 'tuned.sqlite'}"
    gemm = get_family("gemm")
    tune_problem(gemm, contiguous_problem(24, 32, 64, "fp16", "fp16"), interpret_device(), trials=TUNED_TRIALS,
                 db_url=url)
    store = Store(open_engine(url))
    toolchain = store.ensure_toolchain()
    config = gemm.default_config(contiguous_problem(24, 32, 64, "fp16", "fp16"), interpret_device()).to_json()
    failed = store.ensure_problem(gemm, contiguous_problem(40, 8, 16, "fp16", "fp16"))
    device = store.ensure_device(interpret_device())
    for number, status in enumerate(("crash", "compile_error", "crash")):
        store.record_trial(problem_id=failed, device_id=device, toolchain_id=toolchain, study="failed-study",
                           number=number, config=config, config_hash=f"h{number}", status=status, error="boom")
    h200_problem = store.ensure_problem(gemm, contiguous_problem(4096, 4096, 4096, "bf16", "bf16"))
    h200_id = store.ensure_device(H200)
    for number, ms in enumerate((0.4, 0.3, H200_WINNER_MS)):
        store.record_trial(problem_id=h200_problem, device_id=h200_id, toolchain_id=toolchain, study="h200-study",
                           number=number, config=config, config_hash=f"g{number}", status="ok", median_ms=ms,
                           q20_ms=ms, q80_ms=ms)
    store.save_winner(problem_id=h200_problem, device=H200, device_id=h200_id, toolchain_id=toolchain, config=config,
                      config_hash="g2", median_ms=H200_WINNER_MS, q20_ms=0.24, q80_ms=0.27, baseline_name="cuBLAS",
                      baseline_ms=0.2, trials_run=3, provenance="recorded by the test")
    return url


@pytest.fixture(scope="module")
def report(db):
    return build_report(db)


def _problem(report, device_key: str, m: int):
    return next(p for p in report.problems if p.device_key == device_key and p.params["m"] == m)


def test_tuned_problem_matches_the_store(db, report):
    tuned = _problem(report, "interpret", 24)
    stored = next(w for w in Store(open_engine(db, create=False)).winners("gemm", "interpret"))
    assert tuned.winner.median_ms == stored.median_ms and tuned.winner.config == json.loads(stored.config)
    assert tuned.interpreted and tuned.performance.pct_roofline is None and tuned.performance.peak_tflops is None
    assert sum(tuned.statuses.values()) == tuned.trials_total == TUNED_TRIALS
    # Convergence: Optuna's numbers in order; best so far never rises and ends at the fastest passing trial.
    numbers = [c.number for c in tuned.convergence]
    assert numbers == sorted(numbers) and len(numbers) == TUNED_TRIALS
    best = [c.best_so_far_ms for c in tuned.convergence if c.best_so_far_ms is not None]
    assert all(b2 <= b1 for b1, b2 in zip(best, best[1:]))
    ok = [t["median_ms"] for t in Store(open_engine(db, create=False)).trials("gemm") if t["status"] == "ok"
          and t["problem_key"] == tuned.problem_key]
    assert best[-1] == min(ok)
    # The winner is listed first (the re-timing may have ranked it above a faster single trial); then by trial time.
    assert tuned.top_configs[0].winner and tuned.top_configs[0].config == tuned.winner.config
    assert max(c.pct_of_best for c in tuned.top_configs) == 100.0
    assert min(c.median_ms for c in tuned.top_configs) == min(ok)
    rest = [c.median_ms for c in tuned.top_configs[1:]]
    assert rest == sorted(rest) and not any(c.winner for c in tuned.top_configs[1:])
    assert tuned.statuses.get("ok", 0) < MIN_TRIALS_FOR_IMPORTANCE
    assert tuned.importance.note.startswith(f"hidden: {tuned.statuses['ok']} trials passed; below "
                                            f"{MIN_TRIALS_FOR_IMPORTANCE}") and not tuned.importance.params
    assert any("interpreter" in note for note in report.notes)


def test_failed_problem_and_missing_study(report):
    failed = _problem(report, "interpret", 40)
    assert failed.winner is None and failed.performance is None and failed.top_configs == []
    assert failed.statuses == {"compile_error": 1, "crash": 2} and failed.trials_total == 3
    assert [c.best_so_far_ms for c in failed.convergence] == [None, None, None]
    assert failed.importance.note.startswith("hidden: 0 trials passed") and not failed.importance.params
    recorded = _problem(report, "h200/sm90", 4096)
    assert recorded.importance.note.startswith("hidden: 3 trials passed")  # too few to look the study up at all


def test_h200_winner_against_its_ceilings(report):
    p = _problem(report, "h200/sm90", 4096).performance
    flops, moved = 2.0 * 4096 ** 3, 3 * 4096 * 4096 * 2
    tflops = flops / (H200_WINNER_MS * 1e-3) / 1e12
    assert math.isclose(p.tflops, tflops) and math.isclose(p.intensity, flops / moved)
    peak = PROFILES["h200"].peak_tflops["bf16"]
    assert p.peak_dtype == "bf16" and math.isclose(p.pct_peak_compute, 100 * tflops / peak)
    # Compute-bound at 1365 FLOP/byte: the roofline is the bf16 peak.
    assert math.isclose(p.pct_roofline, p.pct_peak_compute)
    assert math.isclose(_problem(report, "h200/sm90", 4096).baseline.speedup, 0.2 / H200_WINNER_MS)


def test_memory_bound_roofline_and_no_ceilings_for_the_interpreter():
    ceilings = ceilings_for("h200/sm90")
    p = performance(1e9, 1e9, 1.0, "fp16", ceilings)  # 1 FLOP/byte: far below the ridge
    assert math.isclose(p.attainable_tflops, ceilings.copy_tbps * 1.0)
    assert math.isclose(p.pct_roofline, p.pct_copy_bandwidth) and math.isclose(p.tbps, 1.0)
    no_dtype = performance(1e9, 1e9, 1.0, None, ceilings)  # elementwise problems carry no compute dtype
    assert no_dtype.pct_peak_compute is None and no_dtype.pct_roofline is not None
    assert ceilings_for("interpret") is None and ceilings_for("other:rtx-9090/sm120") is None


def test_json_report_follows_its_schema(report):
    data = json.loads(render(report, ReportFormat.JSON))
    schema = json.loads(SCHEMA.read_text())
    try:
        import jsonschema
    except ImportError:
        jsonschema = None
    if jsonschema is not None:
        jsonschema.Draft202012Validator.check_schema(schema)
        jsonschema.validate(data, schema, cls=jsonschema.Draft202012Validator)
        broken = json.loads(json.dumps(data))
        del broken["problems"][0]["winner"]
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(broken, schema, cls=jsonschema.Draft202012Validator)
    else:  # the structure the schema promises, checked by hand
        assert set(data) == set(schema["required"])
        problem_fields = set(schema["$defs"]["problem"]["required"])
        assert all(set(p) == problem_fields for p in data["problems"])
    assert data["format_version"] == 1 and len(data["problems"]) == 3


def test_csv_and_markdown(report):
    rows = list(csv.DictReader(io.StringIO(render(report, ReportFormat.CSV))))
    assert len(rows) == 3
    h200 = next(r for r in rows if r["device_key"] == "h200/sm90")
    assert float(h200["median_ms"]) == H200_WINNER_MS and float(h200["speedup"]) == pytest.approx(0.8)
    failed = next(r for r in rows if r["trials_crash"] == "2")
    assert failed["median_ms"] == "" and failed["trials_compile_error"] == "1"
    md = render(report, ReportFormat.MARKDOWN)
    assert "| family | device | problem |" in md and "no passing config" in md
    assert "(interpreter timings)" in md and "| 0.8x |" in md


def test_svg_charts_are_wellformed_and_place_points():
    chart = svg.roofline_chart([svg.RooflinePoint("a <b>", 1.0, 2.0, "paged"),
                                svg.RooflinePoint("c", 1000.0, 500.0, "gemm")], {"bf16": 717.0}, 4.3, "roof & line")
    root = ET.fromstring(chart)
    points = root.findall(".//{http://www.w3.org/2000/svg}circle[@class='point']")
    assert len(points) == 2
    # Log-log: the higher-intensity, faster point lies right of and above the other (SVG y grows downward).
    (xa, ya), (xb, yb) = [(float(c.get("cx")), float(c.get("cy"))) for c in points]
    assert xb > xa and yb < ya
    assert svg.log_ticks(0.3, 40)[0] == 0.1 and svg.linear_ticks(0, 1)[-1] == 1.0
    bars = ET.fromstring(svg.bar_chart([("x", 0.5), ("y", 2.0)], "s", "v", reference=1.0, log=True))
    assert len(bars.findall(".//{http://www.w3.org/2000/svg}rect[@class='bar']")) == 2
    conv = svg.convergence_chart([(0, "ok", 3.0, 3.0), (1, "crash", None, 3.0), (2, "ok", 1.0, 1.0)], "c")
    assert len(ET.fromstring(conv).findall(".//{http://www.w3.org/2000/svg}polyline")) == 1


def test_cli_command_writes_every_format(db, tmp_path):
    runner = CliRunner()
    for fmt in ("html", "md", "csv", "json"):
        out = tmp_path / f"report.{fmt}"
        result = runner.invoke(report_command, ["--db", db, "--format", fmt, "--out", str(out)],
                               catch_exceptions=False)
        assert result.exit_code == 0, result.output
        assert "3 problem(s)" in result.output and out.stat().st_size > 500
    only = runner.invoke(report_command, ["--db", db, "--device", "h200/sm90", "--format", "json", "--out",
                                          str(tmp_path / "h200.json")], catch_exceptions=False)
    assert only.exit_code == 0 and len(json.loads((tmp_path / "h200.json").read_text())["problems"]) == 1
    missing = runner.invoke(report_command, ["--db", str(tmp_path / "none.sqlite"), "--out", str(tmp_path / "x")])
    assert missing.exit_code == 1 and "no autotile database" in missing.output


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", data[16:24])


@pytest.mark.skipif(_chromium() is None, reason="no chromium binary: install Debian's chromium to run the "
                                                "headless browser check of the HTML report")
def test_html_report_in_headless_chromium(report, tmp_path):
    page = tmp_path / "report.html"
    html = render(report, ReportFormat.HTML)
    page.write_text(html, encoding="utf-8")
    assert "<script" not in html and not re.search(r'(src|href)="(https?:)?//', html)
    charts = html.count("<svg")
    assert charts >= 5  # roofline, speedup by shape, two convergence plots, importance or not, ...
    base = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
            "--enable-logging=stderr", "--v=0", "--window-size=1400,3000"]
    shot = tmp_path / "report.png"
    taken = subprocess.run(base + [f"--screenshot={shot}", page.as_uri()], capture_output=True, text=True,
                           timeout=120)
    dom = subprocess.run(base + ["--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120)
    for run in (taken, dom):
        assert run.returncode == 0, run.stderr[-2000:]
        problems = [line for line in run.stderr.splitlines()
                    if re.search(r"CONSOLE|Uncaught|Failed to load resource|net::ERR_|Refused to", line)]
        assert not problems, "\n".join(problems)
    assert dom.stdout.count("<svg") == charts and dom.stdout.count('class="point"') == 1
    assert _png_size(shot) == (1400, 3000)
    # A blank 1400x3000 page compresses to a few kB; text, tables and plots take far more.
    assert shot.stat().st_size > 50_000


# --- a database written row by row: what each report format must show ---------------------------------

VENDOR_PROBLEM = contiguous_problem(2048, 4096, 4096, "bf16", "bf16")
RANGED_PROBLEM = contiguous_problem(24, 4096, 4096, "bf16", "bf16")
MANY_PROBLEM = contiguous_problem(64, 64, 64, "bf16", "bf16")
HOSTILE_TEXT = "<script>alert('x')</script> & <b>"


@pytest.fixture(scope="module")
def crafted(tmp_path_factory) -> str:
    """H200 winners stored directly: one the vendor op won, one generated winner with a verified serving range
    (its winner is not its fastest trial, and its trial numbers have gaps as pruned proposals leave them),
    and a study of 24 passing trials with its Optuna study, so parameter importance is shown."""
    import optuna

    url = f"sqlite:///{tmp_path_factory.mktemp('crafted') / 'crafted.sqlite'}"
    gemm = get_family("gemm")
    store = Store(open_engine(url))
    toolchain, device = store.ensure_toolchain(), store.ensure_device(H200)
    configs = [dict(gemm.default_config(RANGED_PROBLEM, H200), BLOCK_N=n) for n in (64, 128, 256)]
    vendor_id = store.ensure_problem(gemm, VENDOR_PROBLEM)
    store.record_trial(problem_id=vendor_id, device_id=device, toolchain_id=toolchain, study="vendor-search",
                       number=0, config=json.dumps(configs[0]), config_hash="v0", status="ok", median_ms=0.9,
                       q20_ms=0.9, q80_ms=0.9)
    store.save_winner(problem_id=vendor_id, device=H200, device_id=device, toolchain_id=toolchain,
                      config='{"VENDOR":"cublas"}', config_hash="cublas", median_ms=0.8, q20_ms=0.79, q80_ms=0.81,
                      baseline_name="cuBLAS (torch.matmul)", baseline_ms=0.8, trials_run=2,
                      provenance=HOSTILE_TEXT, kernel_config=json.dumps(configs[0]), kernel_ms=0.9)
    ranged_id = store.ensure_problem(gemm, RANGED_PROBLEM)
    for number, (config, ms) in zip((0, 3, 7), zip(configs, (0.30, 0.20, 0.25))):
        store.record_trial(problem_id=ranged_id, device_id=device, toolchain_id=toolchain, study="ranged-search",
                           number=number, config=json.dumps(config), config_hash=f"r{number}", status="ok",
                           median_ms=ms, q20_ms=ms, q80_ms=ms)
    store.save_winner(problem_id=ranged_id, device=H200, device_id=device, toolchain_id=toolchain,
                      config=json.dumps(configs[2]), config_hash="r7", median_ms=0.19, q20_ms=0.18, q80_ms=0.2,
                      baseline_name="cuBLAS (torch.matmul)", baseline_ms=0.22, trials_run=3, provenance="re-timed",
                      verified_range={"m": [17, 32]})
    # The study in its journal beside the database, where the tuner keeps it (autotile.tune.storage).
    _craft_many_trials(store, device, toolchain, optuna_storage(study_journal(url, "many-search")))
    return url


def _craft_many_trials(store: Store, device: int, toolchain: int, storage) -> None:
    """MANY_PROBLEM's 24 passing trials as rows and as the Optuna study 'many-search' in `storage`."""
    import optuna

    many_id = store.ensure_problem(get_family("gemm"), MANY_PROBLEM)
    study = optuna.create_study(study_name="many-search", storage=storage)
    distributions = {"BLOCK_M": optuna.distributions.CategoricalDistribution([16, 32, 64]),
                     "num_warps": optuna.distributions.CategoricalDistribution([4, 8])}
    for number in range(24):
        params = {"BLOCK_M": (16, 32, 64)[number % 3], "num_warps": (4, 8)[number % 2]}
        ms = 0.1 * params["BLOCK_M"] / 16  # BLOCK_M decides the time here; num_warps does not
        study.add_trial(optuna.trial.create_trial(params=params, distributions=distributions, value=ms))
        store.record_trial(problem_id=many_id, device_id=device, toolchain_id=toolchain, study="many-search",
                           number=number, config=json.dumps(params), config_hash=f"m{number}", status="ok",
                           median_ms=ms, q20_ms=ms, q80_ms=ms)


def _crafted_problem(report, problem):
    key = get_family("gemm").problem_key(problem)
    return next(p for p in report.problems if p.problem_key == key)


def test_every_format_marks_the_vendor_winner_and_the_serving_range(crafted):
    report = build_report(crafted)
    vendor, ranged = _crafted_problem(report, VENDOR_PROBLEM), _crafted_problem(report, RANGED_PROBLEM)
    assert vendor.winner.vendor == "cuBLAS (torch.matmul)" and ranged.winner.vendor is None
    assert ranged.winner.verified_range == {"m": [17, 32]} and vendor.winner.verified_range is None
    md = render(report, ReportFormat.MARKDOWN)
    assert "(vendor op won: cuBLAS (torch.matmul))" in md and "- winner: the vendor op, cuBLAS (torch.matmul):" in md
    assert "| vendor op: cuBLAS (torch.matmul) |" in md and "| generated kernel |" in md
    assert "- verified to serve: m 17-32" in md
    rows = {r["problem_key"]: r for r in csv.DictReader(io.StringIO(render(report, ReportFormat.CSV)))}
    assert rows[vendor.problem_key]["vendor"] == "cuBLAS (torch.matmul)" and rows[ranged.problem_key]["vendor"] == ""
    assert json.loads(rows[ranged.problem_key]["verified_range"]) == {"m": [17, 32]}
    data = {p["problem_key"]: p for p in json.loads(render(report, ReportFormat.JSON))["problems"]}
    assert data[vendor.problem_key]["winner"]["vendor"] == "cuBLAS (torch.matmul)"
    assert data[ranged.problem_key]["winner"]["verified_range"] == {"m": [17, 32]}
    page = render(report, ReportFormat.HTML)
    assert "vendor op won: cuBLAS (torch.matmul)" in page and "verified to serve</dt><dd>m 17-32" in page


def test_every_format_says_what_db_verify_found_on_a_winner(crafted, tmp_path):
    """db verify's findings were never shown: a report said "generated kernel" for a winner the runtime no longer
    served, and nothing of one it timed slower."""
    import sqlite3

    copy = tmp_path / "verified.sqlite"
    with sqlite3.connect(crafted.removeprefix("sqlite:///")) as source, sqlite3.connect(copy) as target:
        source.backup(target)  # the write-ahead log's pages too
    ranged_key = get_family("gemm").problem_key(RANGED_PROBLEM)
    with sqlite3.connect(copy) as con:
        con.execute("update autotile_winners set verify_status = 'wrong_result' where problem_id = (select id from "
                    "autotile_problems where key = ?)", (ranged_key,))
        con.execute("update autotile_winners set verify_status = 'regression', regression = 0.3 where problem_id = "
                    "(select id from autotile_problems where key != ? and family = 'gemm' limit 1)", (ranged_key,))
    report = build_report(f"sqlite:///{copy}")
    marks = {p.problem_key: p.winner.mark for p in report.problems if p.winner}
    assert marks[ranged_key] == "db verify found wrong result; not served"
    assert "db verify timed it +30% slower; still served" in marks.values()
    md = render(report, ReportFormat.MARKDOWN)
    assert "| generated kernel (db verify found wrong result; not served) |" in md
    assert "- found since: db verify found wrong result; not served" in md
    rows = {r["problem_key"]: r for r in csv.DictReader(io.StringIO(render(report, ReportFormat.CSV)))}
    assert rows[ranged_key]["mark"] == "db verify found wrong result; not served"
    data = {p["problem_key"]: p for p in json.loads(render(report, ReportFormat.JSON))["problems"]}
    assert data[ranged_key]["winner"]["mark"] == "db verify found wrong result; not served"
    assert "db verify found wrong result; not served" in render(report, ReportFormat.HTML)


def test_the_html_is_escaped_by_its_template(crafted):
    page = render(build_report(crafted), ReportFormat.HTML)
    assert HOSTILE_TEXT not in page and "<script" not in page
    assert "&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt; &amp; &lt;b&gt;" in page
    ET.fromstring(re.search(r"<svg.*?</svg>", page, re.S).group(0))  # the plots are inserted as markup, intact


def test_top_configs_start_with_the_winner_and_convergence_counts_evaluated_trials(crafted):
    ranged = _crafted_problem(build_report(crafted), RANGED_PROBLEM)
    first = ranged.top_configs[0]
    assert first.winner and first.config == ranged.winner.config and first.median_ms == 0.25
    assert [c.median_ms for c in ranged.top_configs[1:]] == [0.20, 0.30]
    assert [(c.number, c.evaluated) for c in ranged.convergence] == [(0, 1), (3, 2), (7, 3)]
    chart = svg.convergence_chart([(c.evaluated, c.status, c.median_ms, c.best_so_far_ms) for c in ranged.convergence],
                                  "c")
    assert "evaluated trials" in chart
    ticks = [float(t.text) for t in ET.fromstring(chart).iter("{http://www.w3.org/2000/svg}text")
             if t.get("y") and t.text and t.text.replace(".", "").isdigit() and float(t.get("y")) > 200]
    assert max(ticks) <= 4  # three trials evaluated: no axis stretched to Optuna's number 7
    md = render(build_report(crafted), ReportFormat.MARKDOWN)
    assert "| 1 (winner) | 0.25 |" in md


def test_gemm_labels_name_m_n_and_k(crafted):
    labels = {p.problem_key: p.label for p in build_report(crafted).problems}
    for problem in (VENDOR_PROBLEM, RANGED_PROBLEM, MANY_PROBLEM):
        label = labels[get_family("gemm").problem_key(problem)]
        assert label.startswith(f"m={problem.m} n={problem.n} k={problem.k}"), label


def test_parameter_importance_only_from_enough_trials(crafted):
    report = build_report(crafted)
    many = _crafted_problem(report, MANY_PROBLEM)
    assert set(many.importance.params) == {"BLOCK_M", "num_warps"} and not many.importance.note
    assert math.isclose(sum(many.importance.params.values()), 1.0, rel_tol=1e-6)
    assert many.importance.params["BLOCK_M"] > many.importance.params["num_warps"]
    few = _crafted_problem(report, RANGED_PROBLEM)
    assert not few.importance.params and few.importance.note.startswith("hidden: 3 trials passed; below 20")
    assert "parameter importance hidden: 3 trials passed" in render(report, ReportFormat.MARKDOWN)


def test_parameter_importance_of_a_study_kept_in_the_database(tmp_path):
    """Studies an older autotile kept in the database's Optuna tables still give their importance; a database
    copied without its studies' journals says where they were looked for."""
    url = f"sqlite:///{tmp_path / 'older.sqlite'}"
    store = Store(open_engine(url))
    _craft_many_trials(store, store.ensure_device(H200), store.ensure_toolchain(), url)
    many = _crafted_problem(build_report(url), MANY_PROBLEM)
    assert many.importance.params["BLOCK_M"] > many.importance.params["num_warps"] and not many.importance.note

    bare = f"sqlite:///{tmp_path / 'bare.sqlite'}"
    store = Store(open_engine(bare))
    journal = study_journal(bare, "many-search")
    _craft_many_trials(store, store.ensure_device(H200), store.ensure_toolchain(), optuna_storage(journal))
    shutil.rmtree(journal_path(journal).parent)
    many = _crafted_problem(build_report(bare), MANY_PROBLEM)
    assert not many.importance.params and "neither in a journal beside this database" in many.importance.note


def test_report_format_follows_the_file_suffix_and_dash_is_stdout(crafted, tmp_path):
    runner = CliRunner()
    for name, first in (("r.md", "# autotile report"), ("r.json", "{"), ("r.csv", "family,"), ("r.html", "<!DOCTYPE")):
        result = runner.invoke(report_command, ["--db", crafted, "--out", str(tmp_path / name)], catch_exceptions=False)
        assert result.exit_code == 0 and (tmp_path / name).read_text().startswith(first), (name, result.output)
    forced = runner.invoke(report_command, ["--db", crafted, "--out", str(tmp_path / "x.md"), "--format", "csv"])
    assert (tmp_path / "x.md").read_text().startswith("family,") and forced.exit_code == 0
    with runner.isolated_filesystem(temp_dir=tmp_path):
        stdout = runner.invoke(report_command, ["--db", crafted, "--out", "-", "--format", "md"],
                               catch_exceptions=False)
        assert not Path("-").exists()  # was a file named '-'
    assert stdout.exit_code == 0 and stdout.stdout.startswith("# autotile report")
    assert "wrote md report of 3 problem(s) to stdout" in stdout.stderr
