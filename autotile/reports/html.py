"""The HTML report: one self-contained file, plots inline as SVG, no script, nothing fetched from a network."""
from __future__ import annotations

import json
from html import escape

from autotile.reports import svg
from autotile.reports.data import DeviceSummary, ProblemReport, Report
from autotile.reports.summary import (INTERPRETER_LABEL, NO_PROFILE_TEXT, SUMMARY_COLUMNS, anchor, ceilings_text,
                                      config_text, headline, param_columns, pct, statuses_text, summary_row)

# Speedup bars switch to a log scale when the largest speedup is this many times the smallest.
_LOG_SPEEDUP_RATIO = 4.0

_CSS = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 24px auto; max-width: 1300px; color: #222; padding: 0 16px; }
h1 { font-size: 22px; } h2 { font-size: 18px; margin-top: 32px; border-bottom: 1px solid #ccc; }
h3 { font-size: 15px; margin-top: 28px; }
table { border-collapse: collapse; margin: 8px 0 16px; font-size: 12.5px; }
th, td { border: 1px solid #d6d6d6; padding: 3px 7px; text-align: left; vertical-align: top; }
th { background: #f3f3f3; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
code { font-size: 12px; background: #f6f6f6; padding: 1px 3px; word-break: break-all; }
.note { color: #7a4a00; } .muted { color: #666; } .plots { display: flex; flex-wrap: wrap; gap: 12px; }
.interp { background: #fff3cd; padding: 1px 5px; border-radius: 3px; font-size: 12px; }
dl { display: grid; grid-template-columns: max-content 1fr; gap: 2px 14px; margin: 6px 0; }
dt { color: #555; } dd { margin: 0; }
svg.plot { border: 1px solid #e4e4e4; max-width: 100%; height: auto; }
"""
_NUMERIC = {"median ms", "spread", "TFLOP/s", "TB/s", "% roofline", "% peak compute", "% copy BW", "speedup", "trials"}


def render_html(report: Report) -> str:
    """The whole report as one HTML document.

    >>> from autotile.reports.data import build_report
    >>> page = render_html(build_report("sqlite:////tmp/tuning.sqlite"))  # doctest: +SKIP
    >>> page.count("<svg") > 0  # doctest: +SKIP
    True
    """
    title = "autotile report" + (f": {report.family_filter}" if report.family_filter else "")
    parts = [f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
             f'<meta name="viewport" content="width=device-width, initial-scale=1">'
             f"<title>{escape(title)}</title><style>{_CSS}</style></head><body>",
             f"<h1>{escape(title)}</h1>",
             "<p class=\"muted\">" + "<br>".join(escape(line) for line in headline(report)) + "</p>"]
    if report.notes:
        parts.append("<ul>" + "".join(f'<li class="note">{escape(n)}</li>' for n in report.notes) + "</ul>")
    if not report.problems:
        parts.append("<p>No trials or winners stored for this selection: run <code>autotile tune FAMILY</code>.</p>")
    else:
        parts += [_devices(report.devices), _summary(report.problems)]
        for device in report.devices:
            parts.append(_device_plots(device, [p for p in report.problems if p.device_key == device.key]))
        parts.append("<h2>Problems</h2>")
        parts += [_problem_section(p) for p in report.problems]
    parts.append("</body></html>\n")
    return "\n".join(parts)


def _table(header: list[str], rows: list[list[str]], numeric: set[str] | frozenset = frozenset()) -> str:
    """A table of already-escaped cell HTML."""
    head = "".join(f"<th>{escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f'<td class="num">{c}</td>' if h in numeric else f"<td>{c}</td>"
                                    for h, c in zip(header, row)) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _devices(devices: list[DeviceSummary]) -> str:
    rows = []
    for d in devices:
        if d.interpret:
            ceilings = f'<span class="interp">{INTERPRETER_LABEL}s</span>: CPU timings, no ceilings apply'
        elif d.ceilings is None:
            ceilings = NO_PROFILE_TEXT
        else:
            ceilings = escape(ceilings_text(d.ceilings)) + f'<br><span class="muted">{escape(d.ceilings.note)}</span>'
        rows.append([f"<code>{escape(d.key)}</code>", escape(d.name), ceilings])
    return "<h2>Devices</h2>" + _table(["device", "name", "ceilings (profile)"], rows)


def _summary(problems: list[ProblemReport]) -> str:
    rows = []
    for p in problems:
        row = summary_row(p)
        cells = [escape(row[c]) for c in SUMMARY_COLUMNS]
        cells[2] = f'<a href="#{anchor(p)}">{cells[2]}</a>'
        if p.interpreted:
            cells[1] = escape(p.device_key) + f' <span class="interp">{INTERPRETER_LABEL}</span>'
        rows.append(cells)
    return ("<h2>Winners</h2><p class=\"muted\">median of the winner's re-timing; spread = (q80 - q20) / median; "
            "speedup = baseline time / winner time, both measured at tuning time.</p>"
            + _table(list(SUMMARY_COLUMNS), rows, _NUMERIC))


def _device_plots(device: DeviceSummary, problems: list[ProblemReport]) -> str:
    charts = []
    ceilings = device.ceilings
    placed = [p for p in problems if p.performance and not p.interpreted]
    if ceilings and placed:
        points = [svg.RooflinePoint(p.label, p.performance.intensity, p.performance.tflops, p.family)
                  for p in placed]
        peaks = {dtype: peak for dtype, peak in ceilings.peak_tflops.items()
                 if any(p.performance.peak_dtype == dtype for p in placed)}
        charts.append(svg.roofline_chart(points, peaks, ceilings.copy_tbps, f"roofline on {device.key}"))
    timed = [p for p in problems if p.baseline]
    if timed:
        bars = [(f"{p.family} {p.label}", p.baseline.speedup) for p in timed]
        speedups = [v for _, v in bars]
        charts.append(svg.bar_chart(bars, f"speedup over the baseline by shape on {device.key}",
                                    "baseline time / winner time", reference=1.0,
                                    log=max(speedups) / min(speedups) > _LOG_SPEEDUP_RATIO))
    if not charts:
        return ""
    label = f' <span class="interp">{INTERPRETER_LABEL}s</span>' if device.interpret else ""
    return f"<h2>{escape(device.key)}{label}</h2>" + '<div class="plots">' + "".join(charts) + "</div>"


def _problem_section(p: ProblemReport) -> str:
    head = f'<h3 id="{anchor(p)}">{escape(p.family)} {escape(p.label)} on {escape(p.device_key)}'
    if p.interpreted:
        head += f' <span class="interp">{INTERPRETER_LABEL}s</span>'
    parts = [head + "</h3>", f"<p class=\"muted\">problem <code>{escape(p.problem_key)}</code></p>"]
    facts = []
    if p.winner:
        w = p.winner
        facts += [("winner config", f"<code>{escape(config_text(w.config))}</code>"),
                  ("median", escape(f"{w.median_ms:.4g} ms (q20 {w.q20_ms:.4g}, q80 {w.q80_ms:.4g}; "
                                    f"spread {pct(w.spread_pct)})")),
                  ("margin over runner-up", escape(pct(w.margin_pct)))]
    else:
        facts.append(("winner", "none: no config passed the correctness check"))
    if p.performance:
        perf = p.performance
        facts.append(("throughput", escape(f"{perf.tflops:.3g} TFLOP/s, {perf.tbps:.3g} TB/s at "
                                           f"{perf.intensity:.3g} FLOP/byte")))
        if perf.attainable_tflops:
            shares = [f"{pct(perf.pct_roofline)} of the roofline ({perf.attainable_tflops:.3g} TFLOP/s attainable)"]
            if perf.peak_dtype:
                shares.append(f"{pct(perf.pct_peak_compute)} of {perf.peak_dtype} peak")
            if perf.copy_tbps:
                shares.append(f"{pct(perf.pct_copy_bandwidth)} of copy bandwidth")
            facts.append(("of the ceilings", escape("; ".join(shares))))
    if p.baseline:
        facts.append(("baseline", escape(f"{p.baseline.name}: {p.baseline.median_ms:.4g} ms; "
                                         f"speedup {p.baseline.speedup:.3g}x")))
    facts.append(("trials", escape(f"{p.trials_total}: {statuses_text(p.statuses)}")))
    if p.winner:
        facts.append(("provenance", escape(p.winner.provenance)))
        tools = ", ".join(f"{k} {v}" for k, v in p.winner.toolchain.items())
        facts.append(("toolchain", escape(f"{tools}; tuned {p.winner.created_at}")))
    parts.append("<dl>" + "".join(f"<dt>{k}</dt><dd>{v}</dd>" for k, v in facts) + "</dl>")
    if p.top_configs:
        names = param_columns([c.config for c in p.top_configs])
        rows = [[str(i + 1), f"{c.median_ms:.4g}", f"{c.pct_of_best:.1f}%"]
                + [escape(json.dumps(c.config[n]) if n in c.config else "\u2013") for n in names] for i, c in enumerate(p.top_configs)]
        parts.append("<p><b>top configs</b> (each by its best trial median)</p>"
                     + _table(["#", "median ms", "% of best"] + names, rows, {"median ms", "% of best"}))
    charts = []
    if p.convergence:
        unit = "median time (ms, interpreter)" if p.interpreted else "median time (ms)"
        points = [(c.number, c.status, c.median_ms, c.best_so_far_ms) for c in p.convergence]
        charts.append(svg.convergence_chart(points, "search convergence (best so far)", unit))
    if p.importance.params:
        bars = list(p.importance.params.items())
        charts.append(svg.bar_chart(bars, "parameter importance", "share of importance",
                                    width=460, label_width=150))
    if charts:
        parts.append('<div class="plots">' + "".join(charts) + "</div>")
    if p.importance.note:
        parts.append(f'<p class="note">parameter importance {escape(p.importance.note)}</p>')
    elif p.importance.params:
        parts.append(f'<p class="muted">parameter importance by {escape(p.importance.evaluator)} over the study\'s '
                     "completed trials</p>")
    return "<section>" + "\n".join(parts) + "</section>"
