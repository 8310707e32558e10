"""Reports for tools: JSON (documented by report.schema.json) and CSV (one row per problem)."""
from __future__ import annotations

import csv
import io
import json

from autotile.reports.data import ProblemReport, Report

# Trial statuses the tuner records (autotile.bench.Status); each gets a CSV column, in this order.
KNOWN_STATUSES = ("ok", "compile_error", "out_of_resources", "wrong_result", "timeout", "crash")
_PERFORMANCE_FIELDS = ("flops", "bytes", "intensity", "tflops", "tbps", "peak_dtype", "pct_roofline",
                       "pct_peak_compute", "pct_copy_bandwidth")


def render_json(report: Report) -> str:
    """The report as JSON, in the format autotile/reports/report.schema.json describes.

    >>> from autotile.reports.data import build_report
    >>> json.loads(render_json(build_report("sqlite:////tmp/tuning.sqlite")))["format_version"]  # doctest: +SKIP
    1
    """
    return json.dumps(report.to_dict(), indent=2, sort_keys=False) + "\n"


def csv_columns(report: Report) -> list[str]:
    """The CSV header: fixed columns, then one `trials_<status>` column per status seen (known ones first)."""
    seen = {s for p in report.problems for s in p.statuses}
    statuses = list(KNOWN_STATUSES) + sorted(seen - set(KNOWN_STATUSES))
    return (["family", "device_key", "interpreted", "problem", "problem_key", "vendor", "winner_config", "median_ms",
             "q20_ms", "q80_ms", "spread_pct", "margin_pct", "verified_range", "mark", *_PERFORMANCE_FIELDS, "baseline_name",
             "baseline_ms", "speedup", "trials_total"] + [f"trials_{s}" for s in statuses])


def csv_row(problem: ProblemReport, columns: list[str]) -> dict:
    w, perf, base = problem.winner, problem.performance, problem.baseline
    row = {"family": problem.family, "device_key": problem.device_key, "interpreted": int(problem.interpreted),
           "problem": problem.label, "problem_key": problem.problem_key, "trials_total": problem.trials_total}
    if w:
        row.update(winner_config=json.dumps(w.config, sort_keys=True), median_ms=w.median_ms, q20_ms=w.q20_ms,
                   q80_ms=w.q80_ms, spread_pct=w.spread_pct, margin_pct=w.margin_pct, vendor=w.vendor,
                   verified_range=json.dumps(w.verified_range, sort_keys=True) if w.verified_range else None,
                   mark=w.mark)
    if perf:
        row.update({name: getattr(perf, name) for name in _PERFORMANCE_FIELDS})
    if base:
        row.update(baseline_name=base.name, baseline_ms=base.median_ms, speedup=base.speedup)
    for column in columns:
        if column.startswith("trials_") and column != "trials_total":
            row[column] = problem.statuses.get(column.removeprefix("trials_"), 0)
    return {c: ("" if row.get(c) is None else row.get(c)) for c in columns}


def render_csv(report: Report) -> str:
    """One row per (problem, device); empty cells where a value does not apply.

    >>> from autotile.reports.data import build_report
    >>> render_csv(build_report("sqlite:////tmp/tuning.sqlite")).splitlines()[0][:30]  # doctest: +SKIP
    'family,device_key,interpreted,'
    """
    columns = csv_columns(report)
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    for problem in report.problems:
        writer.writerow(csv_row(problem, columns))
    return buffer.getvalue()
