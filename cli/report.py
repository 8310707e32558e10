"""`autotile report`: write a report of the tuning database (HTML, Markdown, CSV or JSON)."""
from __future__ import annotations

from pathlib import Path

import click

from autotile.cli.common import (
    db_option, friendly_errors, known_family, named_file, refuse_overwriting_database, what_is_stored,
)

# The format a file name asks for, by its suffix (--format overrides it).
SUFFIX_FORMATS = {".html": "html", ".htm": "html", ".md": "md", ".markdown": "md", ".csv": "csv", ".json": "json"}
DEFAULT_FORMAT = "html"


def report_format(fmt: str | None, out: str) -> str:
    """The format to write: --format when given, else the one the file's suffix names; HTML for stdout and for a
    name without a suffix. A suffix that names no format is refused rather than guessed: `r.txt` holding HTML
    would surprise.

    >>> report_format(None, "r.md"), report_format("csv", "r.txt"), report_format(None, "-"), report_format(None, "r")
    ('md', 'csv', 'html', 'html')
    """
    if fmt:
        return fmt
    suffix = Path(out).suffix.lower() if out != "-" else ""
    if not suffix:
        return DEFAULT_FORMAT
    if suffix not in SUFFIX_FORMATS:
        raise click.BadParameter(f"{out!r}: the suffix {suffix!r} names no report format; end the name in "
                                 f"{', '.join(SUFFIX_FORMATS)}, or give --format html|md|csv|json", param_hint="--out")
    return SUFFIX_FORMATS[suffix]


@click.command("report")
@click.option("--family", default=None, callback=known_family,
              help="only this kernel family (gemm, flash, paged, elementwise)")
@click.option("--device", "device_key", default=None, help="only this device key, e.g. h200/sm90 or interpret")
@click.option("--format", "fmt", type=click.Choice(["html", "md", "csv", "json"]), default=None,
              help="html: one self-contained page with plots; md: for pull requests; csv/json: for tools "
                   "(default: from the --out suffix; html on stdout or for a name without one)")
@click.option("--out", "out", required=True, callback=named_file,
              help="file to write (its suffix picks the format), or - for stdout")
@click.option("--storage", default=None,
              help="Optuna storage URL the studies were tuned with, if not the --db database (for parameter importance)")
@db_option
@friendly_errors
def report_command(family, device_key, fmt, out, storage, db_url):
    """Write a report of the stored winners and trials; reads the database only."""
    from autotile.reports import ReportFormat, build_report, render, write_report

    refuse_overwriting_database(out, db_url, storage)
    chosen = ReportFormat(report_format(fmt, out))
    if out == "-":
        report = build_report(db_url, family=family, device=device_key, storage_url=storage)
        click.echo(render(report, chosen), nl=False)
        where = "stdout"
    else:
        report = write_report(db_url, chosen, out, family=family, device=device_key, storage_url=storage)
        where = out
    if not report.problems:
        click.echo(what_is_stored(db_url, family, device_key)
                   or "no trials or winners stored for this selection: run `autotile tune FAMILY`", err=True)
    click.echo(f"wrote {chosen.value} report of {len(report.problems)} problem(s) to {where}",
               err=out == "-")
    for note in report.notes:
        click.echo(f"note: {note}", err=True)
