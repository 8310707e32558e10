"""The Markdown report, for pull requests: the winners table, then each problem's winner and top configs.

Plots are not inlined (code hosts strip inline SVG); the HTML report has them.
"""
from __future__ import annotations

from autotile.reports.data import ProblemReport, Report
from autotile.reports.summary import (INTERPRETER_LABEL, NO_PROFILE_TEXT, SUMMARY_COLUMNS, ceilings_text,
                                      config_text, headline, param_columns, range_text, statuses_text, summary_row)

# Parameters named in a problem's importance line.
_IMPORTANCE_SHOWN = 4


def cell(text: str) -> str:
    """Text safe inside a Markdown table cell.

    >>> cell("a|b\\nc")
    'a\\\\|b c'
    """
    return text.replace("|", "\\|").replace("\n", " ")


def table(header: list[str], rows: list[list[str]]) -> str:
    """A GitHub-flavoured Markdown table.

    >>> print(table(["a", "b"], [["1", "2"]]))
    | a | b |
    |---|---|
    | 1 | 2 |
    """
    lines = ["| " + " | ".join(cell(h) for h in header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def render_markdown(report: Report) -> str:
    """The report as Markdown.

    >>> from autotile.reports.data import build_report
    >>> print(render_markdown(build_report("sqlite:////tmp/tuning.sqlite"))[:20])  # doctest: +SKIP
    # autotile report
    """
    title = "autotile report" + (f": {report.family_filter}" if report.family_filter else "")
    out = [f"# {title}", "", *(f"- {line}" for line in headline(report))]
    out += [f"- note: {n}" for n in report.notes]
    if not report.problems:
        out += ["", "No trials or winners stored for this selection: run `autotile tune FAMILY`."]
        return "\n".join(out) + "\n"
    out += ["", "## Devices", ""]
    rows = []
    for d in report.devices:
        if d.interpret:
            ceilings = f"{INTERPRETER_LABEL}s (CPU): no ceilings"
        elif d.ceilings is None:
            ceilings = NO_PROFILE_TEXT
        else:
            ceilings = f"{ceilings_text(d.ceilings)} ({d.ceilings.note})"
        rows.append([f"`{d.key}`", d.name, ceilings])
    out += [table(["device", "name", "ceilings"], rows), "", "## Winners", ""]
    out.append(table(list(SUMMARY_COLUMNS), [list(summary_row(p).values()) for p in report.problems]))
    out += ["", "Spread is (q80 - q20) / median; speedup is baseline time / winner time, both measured at tuning "
                "time; \"served by\" names the vendor op where it won over every generated kernel. Plots "
                "(convergence, roofline, importance, speedup by shape) are in the HTML report.", ""]
    for problem in report.problems:
        out += _problem(problem)
    return "\n".join(out) + "\n"


def _problem(p: ProblemReport) -> list[str]:
    tag = f" ({INTERPRETER_LABEL}s)" if p.interpreted else ""
    tag += f" (vendor op won: {p.winner.vendor})" if p.winner and p.winner.vendor else ""
    out = [f"### {p.family} {p.label} on {p.device_key}{tag}", ""]
    if p.winner:
        served = f"the vendor op, {p.winner.vendor}: " if p.winner.vendor else ""
        out.append(f"- winner: {served}`{config_text(p.winner.config)}`")
        if p.winner.verified_range:
            out.append(f"- verified to serve: {range_text(p.winner.verified_range)}")
        if p.winner.mark:
            out.append(f"- found since: {p.winner.mark}")
        out.append(f"- {p.winner.provenance}")
    else:
        out.append("- no config passed the correctness check")
    out.append(f"- trials: {p.trials_total} ({statuses_text(p.statuses)})")
    if p.importance.params:
        top = list(p.importance.params.items())[:_IMPORTANCE_SHOWN]
        out.append("- most important parameters: " + ", ".join(f"{k} {v:.2f}" for k, v in top))
    elif p.importance.note:
        out.append(f"- parameter importance {p.importance.note}")
    if p.top_configs:
        names = param_columns([c.config for c in p.top_configs])
        rows = [[f"{i + 1} (winner)" if c.winner else str(i + 1), f"{c.median_ms:.4g}", f"{c.pct_of_best:.1f}%"]
                + [str(c.config.get(n, "")) for n in names] for i, c in enumerate(p.top_configs)]
        out += ["", table(["#", "median ms", "% of best", *names], rows)]
    return out + [""]
