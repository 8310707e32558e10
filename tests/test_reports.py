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
    assert tuned.top_configs[0].median_ms == min(ok) and tuned.top_configs[0].pct_of_best == 100.0
    assert [c.pct_of_best for c in tuned.top_configs] == sorted((c.pct_of_best for c in tuned.top_configs), reverse=True)
    if tuned.statuses.get("ok", 0) >= MIN_TRIALS_FOR_IMPORTANCE:
        assert tuned.importance.params and math.isclose(sum(tuned.importance.params.values()), 1.0, rel_tol=1e-6)
    else:
        assert "skipped" in tuned.importance.note
    assert any("interpreter" in note for note in report.notes)


def test_failed_problem_and_missing_study(report):
    failed = _problem(report, "interpret", 40)
    assert failed.winner is None and failed.performance is None and failed.top_configs == []
    assert failed.statuses == {"compile_error": 1, "crash": 2} and failed.trials_total == 3
    assert [c.best_so_far_ms for c in failed.convergence] == [None, None, None]
    assert "skipped" in failed.importance.note and not failed.importance.params
    recorded = _problem(report, "h200/sm90", 4096)
    assert "not in this database" in recorded.importance.note or "skipped" in recorded.importance.note


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
