"""`autotile report`: write a report of the tuning database (HTML, Markdown, CSV or JSON)."""
from __future__ import annotations

from pathlib import Path

import click

from autotile.cli.common import db_option, friendly_errors

# The format a file name asks for, by its suffix (--format overrides it).
SUFFIX_FORMATS = {".html": "html", ".htm": "html", ".md": "md", ".markdown": "md", ".csv": "csv", ".json": "json"}
DEFAULT_FORMAT = "html"


def report_format(fmt: str | None, out: str) -> str:
    """The format to write: --format when given, else the one the file's suffix names, else HTML.

    >>> report_format(None, "r.md"), report_format("csv", "r.md"), report_format(None, "-")
    ('md', 'csv', 'html')
    """
    if fmt:
        return fmt
    return SUFFIX_FORMATS.get(Path(out).suffix.lower(), DEFAULT_FORMAT) if out != "-" else DEFAULT_FORMAT


@click.command("report")
@click.option("--family", default=None, help="only this kernel family (gemm, flash, paged, elementwise)")
@click.option("--device", "device_key", default=None, help="only this device key, e.g. h200/sm90 or interpret")
@click.option("--format", "fmt", type=click.Choice(["html", "md", "csv", "json"]), default=None,
              help="html: one self-contained page with plots; md: for pull requests; csv/json: for tools "
                   "(default: from the --out suffix, else html)")
@click.option("--out", "out", required=True, help="file to write (its suffix picks the format), or - for stdout")
@click.option("--storage", default=None,
              help="Optuna storage URL the studies were tuned with, if not the --db database (for parameter importance)")
@db_option
@friendly_errors
def report_command(family, device_key, fmt, out, storage, db_url):
    """Write a report of the stored winners and trials; reads the database only."""
    from autotile.reports import ReportFormat, build_report, render, write_report

    chosen = ReportFormat(report_format(fmt, out))
    if out == "-":
        report = build_report(db_url, family=family, device=device_key, storage_url=storage)
        click.echo(render(report, chosen), nl=False)
        where = "stdout"
    else:
        report = write_report(db_url, chosen, out, family=family, device=device_key, storage_url=storage)
        where = out
    if not report.problems:
        click.echo("no trials or winners stored for this selection: run `autotile tune FAMILY`", err=True)
    click.echo(f"wrote {chosen.value} report of {len(report.problems)} problem(s) to {where}",
               err=out == "-")
    for note in report.notes:
        click.echo(f"note: {note}", err=True)
