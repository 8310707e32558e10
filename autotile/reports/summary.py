"""Display formatting shared by the HTML and Markdown reports: one summary row per problem, as text."""
from __future__ import annotations

import json

from autotile.reports.data import ProblemReport, Report

INTERPRETER_LABEL = "interpreter timing"
SUMMARY_COLUMNS = ("family", "device", "problem", "served by", "median ms", "spread", "TFLOP/s", "TB/s", "% roofline",
                   "% peak compute", "% copy BW", "speedup", "baseline", "trials", "statuses")
GENERATED = "generated kernel"


def fmt(value: float | None, digits: int = 3, suffix: str = "") -> str:
    """A number to `digits` significant digits, or an en dash for no value.

    >>> fmt(0.123456), fmt(None), fmt(93.84, 3, "%")
    ('0.123', '–', '93.8%')
    """
    return "\u2013" if value is None else f"{value:.{digits}g}{suffix}"


def pct(value: float | None) -> str:
    """A percentage with one decimal, or an en dash.

    >>> pct(93.8412), pct(123.0), pct(None)
    ('93.8%', '123.0%', '–')
    """
    return "\u2013" if value is None else f"{value:.1f}%"


def statuses_text(statuses: dict[str, int]) -> str:
    """Trial statuses and their counts, in one line.

    >>> statuses_text({"ok": 5, "crash": 1})
    'ok 5, crash 1'
    """
    return ", ".join(f"{status} {count}" for status, count in statuses.items()) or "no trials"


NO_PROFILE_TEXT = "no GPU profile: no ceilings"


def ceilings_text(ceilings) -> str:
    """A device profile's roofline ceilings in one line: peak TFLOP/s per dtype and the copy bandwidth."""
    peaks = ", ".join(f"{k} {v:g} TFLOP/s" for k, v in ceilings.peak_tflops.items())
    return f"{peaks}; copy {ceilings.copy_tbps:g} TB/s"


def config_text(config: dict) -> str:
    return json.dumps(config, sort_keys=True, separators=(", ", ": "))


def summary_row(problem: ProblemReport) -> dict[str, str]:
    """The problem as the summary table shows it: column name -> text."""
    perf, win, base = problem.performance, problem.winner, problem.baseline
    device = problem.device_key + (f" ({INTERPRETER_LABEL})" if problem.interpreted else "")
    return {
        "family": problem.family,
        "device": device,
        "problem": problem.label,
        "served by": served_by(problem),
        "median ms": fmt(win.median_ms, 4) if win else "no passing config",
        "spread": pct(win.spread_pct) if win else "\u2013",
        "TFLOP/s": fmt(perf.tflops if perf else None),
        "TB/s": fmt(perf.tbps if perf else None),
        "% roofline": pct(perf.pct_roofline if perf else None),
        "% peak compute": pct(perf.pct_peak_compute if perf else None),
        "% copy BW": pct(perf.pct_copy_bandwidth if perf else None),
        "speedup": fmt(base.speedup, 3, "x") if base else "\u2013",
        "baseline": f"{base.name} {base.median_ms:.4g} ms" if base else "\u2013",
        "trials": str(problem.trials_total),
        "statuses": statuses_text(problem.statuses),
    }


def served_by(problem: ProblemReport) -> str:
    """What runs the problem: the vendor op that won (by its library call), a generated kernel, or nothing; with what
    db verify, tune --stale or a toolchain change found on the winner (whether it is still served)."""
    if problem.winner is None:
        return "\u2013"
    served = f"vendor op: {problem.winner.vendor}" if problem.winner.vendor else GENERATED
    return f"{served} ({problem.winner.mark})" if problem.winner.mark else served


def range_text(verified_range: dict | None) -> str:
    """The serving range a winner was verified over, in one line ('' when it serves its own shape only).

    >>> range_text({"m": [17, 32], "n": [4096, 4096]})
    'm 17-32, n 4096'
    """
    if not verified_range:
        return ""
    parts = []
    for name, bounds in verified_range.items():
        lo, hi = (bounds + [None, None])[:2] if isinstance(bounds, list) else (bounds, bounds)
        parts.append(f"{name} {lo}" if lo == hi else f"{name} {lo}-{hi}")
    return ", ".join(parts)


def anchor(problem: ProblemReport) -> str:
    """A stable HTML id for a problem's section."""
    import hashlib

    digest = hashlib.sha256(f"{problem.problem_key}|{problem.device_key}".encode()).hexdigest()[:10]
    return f"{problem.family}-{digest}"


def param_columns(configs: list[dict]) -> list[str]:
    """Every parameter name in the configs, in first-seen order."""
    names: list[str] = []
    for config in configs:
        names.extend(k for k in config if k not in names)
    return names


def headline(report: Report) -> list[str]:
    """Where the data came from, as short lines."""
    lines = [f"database: {report.database}", f"generated: {report.generated_at}"]
    if report.family_filter or report.device_filter:
        lines.append(f"filter: family {report.family_filter or 'any'}, device {report.device_filter or 'any'}")
    return lines
