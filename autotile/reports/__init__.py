"""Reports of a tuning database: HTML (with inline SVG plots), Markdown, CSV and JSON.

`build_report` gathers everything from the database into a `Report`;
`render` formats it; `write_report` does both and writes the file.

>>> from autotile.reports import ReportFormat, write_report
>>> write_report("sqlite:////tmp/tuning.sqlite", ReportFormat.HTML, "report.html")  # doctest: +SKIP
"""
from __future__ import annotations

import contextlib
import enum
from pathlib import Path

from autotile.errors import AutotileError
from autotile.reports.data import Report, build_report


class ReportFormat(str, enum.Enum):
    HTML = "html"
    MARKDOWN = "md"
    CSV = "csv"
    JSON = "json"


class ReportWriteError(AutotileError):
    """The report file (or its folder) cannot be written."""


def render(report: Report, fmt: ReportFormat) -> str:
    """The report as text in one format."""
    if fmt is ReportFormat.HTML:
        from autotile.reports.html import render_html

        return render_html(report)
    if fmt is ReportFormat.MARKDOWN:
        from autotile.reports.markdown import render_markdown

        return render_markdown(report)
    from autotile.reports.tabular import render_csv, render_json

    return render_csv(report) if fmt is ReportFormat.CSV else render_json(report)


def write_report(db_url: str | None, fmt: ReportFormat, out: str | Path, *, family: str | None = None,
                 device: str | None = None, storage_url: str | None = None) -> Report:
    """Build the report of a database and write it to `out` in `fmt`; returns the report written."""
    report = build_report(db_url, family=family, device=device, storage_url=storage_url)
    path = Path(out)
    text = render(report, fmt)
    partial = path.with_name(path.name + ".partial")
    if not path.parent.is_dir():  # as every other --out: a typo must not create folders
        what = "is a file" if path.parent.exists() else "does not exist"
        raise ReportWriteError(f"cannot write the report {path}: its folder {path.parent} {what}; create the folder "
                               "first, or pick another --out")
    try:
        partial.write_text(text, encoding="utf-8")
        partial.replace(path)  # a report is whole or not there: never half of one over the previous
    except OSError as exc:
        with contextlib.suppress(OSError):
            partial.unlink(missing_ok=True)
        raise ReportWriteError(f"cannot write the report {path}: {exc.strerror or exc}") from None
    return report


__all__ = ["Report", "ReportFormat", "ReportWriteError", "build_report", "render", "write_report"]
