"""The HTML report: one self-contained file, plots inline as SVG, no script, nothing fetched from a network.

The page is a Jinja2 template rendered with autoescape on: every value from the database (problem keys,
configs, provenance, error-free but user-chosen text) is escaped by Jinja; only the SVG plots, which
autotile.reports.svg builds and escapes itself, are inserted as markup.
"""
from __future__ import annotations

import functools
import json

import jinja2
from markupsafe import Markup

from autotile.reports import svg
from autotile.reports.data import DeviceSummary, ProblemReport, Report
from autotile.reports.summary import (INTERPRETER_LABEL, NO_PROFILE_TEXT, SUMMARY_COLUMNS, anchor, ceilings_text,
                                      config_text, headline, param_columns, pct, range_text, served_by,
                                      statuses_text, summary_row)

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
.vendor { background: #e3eefc; padding: 1px 5px; border-radius: 3px; font-size: 12px; }
dl { display: grid; grid-template-columns: max-content 1fr; gap: 2px 14px; margin: 6px 0; }
dt { color: #555; } dd { margin: 0; }
svg.plot { border: 1px solid #e4e4e4; max-width: 100%; height: auto; }
"""
_NUMERIC = {"median ms", "spread", "TFLOP/s", "TB/s", "% roofline", "% peak compute", "% copy BW", "speedup", "trials"}

_TEMPLATE = """\
<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>{{ title }}</title><style>{{ css }}</style></head><body>
<h1>{{ title }}</h1>
<p class="muted">{% for line in headline %}{{ line }}{% if not loop.last %}<br>{% endif %}{% endfor %}</p>
{% if notes %}<ul>{% for note in notes %}<li class="note">{{ note }}</li>{% endfor %}</ul>{% endif %}
{% if not problems %}
<p>No trials or winners stored for this selection: run <code>autotile tune FAMILY</code>.</p>
{% else %}
<h2>Devices</h2>
<table><thead><tr><th>device</th><th>name</th><th>ceilings (profile)</th></tr></thead><tbody>
{% for d in devices %}<tr><td><code>{{ d.key }}</code></td><td>{{ d.name }}</td><td>
{%- if d.interpret %}<span class="interp">{{ interp }}s</span>: CPU timings, no ceilings apply
{%- elif d.ceilings is none %}{{ no_profile }}
{%- else %}{{ d.ceilings_text }}<br><span class="muted">{{ d.ceilings.note }}</span>{% endif %}</td></tr>
{% endfor %}</tbody></table>
<h2>Winners</h2>
<p class="muted">median of the winner's re-timing; spread = (q80 - q20) / median; speedup = baseline time / winner
time, both measured at tuning time; "served by" names the vendor op where it won over every generated kernel.</p>
<table><thead><tr>{% for c in columns %}<th>{{ c }}</th>{% endfor %}</tr></thead><tbody>
{% for row in summary %}<tr>{% for c in columns %}<td{% if c in numeric %} class="num"{% endif %}>
{%- if c == "problem" %}<a href="#{{ row.anchor }}">{{ row.cells[c] }}</a>
{%- elif c == "device" %}{{ row.device }}{% if row.interpreted %} <span class="interp">{{ interp }}</span>{% endif %}
{%- elif c == "served by" and row.vendor %}<span class="vendor">{{ row.cells[c] }}</span>
{%- else %}{{ row.cells[c] }}{% endif %}</td>{% endfor %}</tr>
{% endfor %}</tbody></table>
{% for plots in device_plots %}{% if plots.charts %}
<h2>{{ plots.key }}{% if plots.interpret %} <span class="interp">{{ interp }}s</span>{% endif %}</h2>
<div class="plots">{% for chart in plots.charts %}{{ chart }}{% endfor %}</div>
{% endif %}{% endfor %}
<h2>Problems</h2>
{% for p in sections %}<section>
<h3 id="{{ p.anchor }}">{{ p.family }} {{ p.label }} on {{ p.device_key }}
{%- if p.interpreted %} <span class="interp">{{ interp }}s</span>{% endif %}
{%- if p.vendor %} <span class="vendor">vendor op won: {{ p.vendor }}</span>{% endif %}</h3>
<p class="muted">problem <code>{{ p.problem_key }}</code></p>
<dl>{% for name, value, code in p.facts %}<dt>{{ name }}</dt><dd>{% if code %}<code>{{ value }}</code>
{%- else %}{{ value }}{% endif %}</dd>{% endfor %}</dl>
{% if p.top %}<p><b>top configs</b> (the winner first, then the others by their best trial median)</p>
<table><thead><tr><th>#</th><th>median ms</th><th>% of best</th>{% for n in p.top_names %}<th>{{ n }}</th>{% endfor %}
</tr></thead><tbody>{% for row in p.top %}<tr><td>{{ row.rank }}</td><td class="num">{{ row.ms }}</td>
<td class="num">{{ row.pct }}</td>{% for v in row.params %}<td>{{ v }}</td>{% endfor %}</tr>{% endfor %}
</tbody></table>{% endif %}
{% if p.charts %}<div class="plots">{% for chart in p.charts %}{{ chart }}{% endfor %}</div>{% endif %}
{% if p.importance_note %}<p class="note">parameter importance {{ p.importance_note }}</p>
{% elif p.importance_by %}<p class="muted">parameter importance by {{ p.importance_by }} over the study's completed
trials</p>{% endif %}
</section>
{% endfor %}
{% endif %}
</body></html>
"""


@functools.lru_cache(maxsize=1)
def _template() -> jinja2.Template:
    environment = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined, trim_blocks=True,
                                     lstrip_blocks=True)
    return environment.from_string(_TEMPLATE)


def render_html(report: Report) -> str:
    """The whole report as one HTML document.

    >>> from autotile.reports.data import build_report
    >>> page = render_html(build_report("sqlite:////tmp/tuning.sqlite"))  # doctest: +SKIP
    >>> page.count("<svg") > 0  # doctest: +SKIP
    True
    """
    title = "autotile report" + (f": {report.family_filter}" if report.family_filter else "")
    return _template().render(
        title=title, css=Markup(_CSS), headline=headline(report), notes=report.notes, problems=report.problems,
        interp=INTERPRETER_LABEL, no_profile=NO_PROFILE_TEXT, columns=SUMMARY_COLUMNS, numeric=_NUMERIC,
        devices=[_device(d) for d in report.devices],
        summary=[{"anchor": anchor(p), "cells": summary_row(p), "device": p.device_key, "interpreted": p.interpreted,
                  "vendor": bool(p.winner and p.winner.vendor)} for p in report.problems],
        device_plots=[_device_plots(d, [p for p in report.problems if p.device_key == d.key]) for d in report.devices],
        sections=[_section(p) for p in report.problems],
    )


def _device(d: DeviceSummary) -> dict:
    return {"key": d.key, "name": d.name, "interpret": d.interpret, "ceilings": d.ceilings,
            "ceilings_text": ceilings_text(d.ceilings) if d.ceilings else ""}


def _device_plots(device: DeviceSummary, problems: list[ProblemReport]) -> dict:
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
    # The plots are built by autotile.reports.svg, which escapes every text it places.
    return {"key": device.key, "interpret": device.interpret, "charts": [Markup(c) for c in charts]}


def _section(p: ProblemReport) -> dict:
    facts: list[tuple[str, str, bool]] = []  # (name, text, shown as code)
    if p.winner:
        w = p.winner
        facts += [("served by", served_by(p), False), ("winner config", config_text(w.config), True),
                  ("median", f"{w.median_ms:.4g} ms (q20 {w.q20_ms:.4g}, q80 {w.q80_ms:.4g}; spread "
                             f"{pct(w.spread_pct)})", False),
                  ("margin over runner-up", pct(w.margin_pct), False)]
        if w.verified_range:
            facts.append(("verified to serve", range_text(w.verified_range), False))
    else:
        facts.append(("winner", "none: no config passed the correctness check", False))
    if p.performance:
        perf = p.performance
        facts.append(("throughput", f"{perf.tflops:.3g} TFLOP/s, {perf.tbps:.3g} TB/s at {perf.intensity:.3g} "
                                    "FLOP/byte", False))
        if perf.attainable_tflops:
            shares = [f"{pct(perf.pct_roofline)} of the roofline ({perf.attainable_tflops:.3g} TFLOP/s attainable)"]
            if perf.peak_dtype:
                shares.append(f"{pct(perf.pct_peak_compute)} of {perf.peak_dtype} peak")
            if perf.copy_tbps:
                shares.append(f"{pct(perf.pct_copy_bandwidth)} of copy bandwidth")
            facts.append(("of the ceilings", "; ".join(shares), False))
    if p.baseline:
        facts.append(("baseline", f"{p.baseline.name}: {p.baseline.median_ms:.4g} ms; speedup "
                                  f"{p.baseline.speedup:.3g}x", False))
    facts.append(("trials", f"{p.trials_total}: {statuses_text(p.statuses)}", False))
    if p.winner:
        facts.append(("provenance", p.winner.provenance, False))
        tools = ", ".join(f"{k} {v}" for k, v in p.winner.toolchain.items())
        facts.append(("toolchain", f"{tools}; tuned {p.winner.created_at}", False))
    names = param_columns([c.config for c in p.top_configs])
    top = [{"rank": f"{i + 1} (winner)" if c.winner else str(i + 1), "ms": f"{c.median_ms:.4g}",
            "pct": f"{c.pct_of_best:.1f}%",
            "params": [json.dumps(c.config[n]) if n in c.config else "\u2013" for n in names]}
           for i, c in enumerate(p.top_configs)]
    charts = []
    if p.convergence:
        unit = "median time (ms, interpreter)" if p.interpreted else "median time (ms)"
        points = [(c.evaluated, c.status, c.median_ms, c.best_so_far_ms) for c in p.convergence]
        charts.append(svg.convergence_chart(points, "search convergence (best so far)", unit))
    if p.importance.params:
        charts.append(svg.bar_chart(list(p.importance.params.items()), "parameter importance", "share of importance",
                                    width=460, label_width=150))
    return {"anchor": anchor(p), "family": p.family, "label": p.label, "device_key": p.device_key,
            "interpreted": p.interpreted, "vendor": p.winner.vendor if p.winner else None,
            "problem_key": p.problem_key, "facts": facts, "top": top, "top_names": names,
            "charts": [Markup(c) for c in charts], "importance_note": p.importance.note,
            "importance_by": p.importance.evaluator if p.importance.params else ""}
