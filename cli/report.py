"""`autotile report`: write a report of the tuning database (HTML, Markdown, CSV or JSON)."""
from __future__ import annotations

import click

from autotile.cli.common import db_option, friendly_errors


@click.command("report")
@click.option("--family", default=None, help="only this kernel family (gemm, flash, paged, elementwise)")
@click.option("--device", "device_key", default=None, help="only this device key, e.g. h200/sm90 or interpret")
@click.option("--format", "fmt", type=click.Choice(["html", "md", "csv", "json"]), default="html", show_default=True,
              help="html: one self-contained page with plots; md: for pull requests; csv/json: for tools")
@click.option("--out", "out", required=True, type=click.Path(dir_okay=False, writable=True),
              help="file to write")
@click.option("--storage", default=None,
              help="Optuna storage URL the studies were tuned with, if not the --db database (for parameter importance)")
@db_option
@friendly_errors
def report_command(family, device_key, fmt, out, storage, db_url):
    """Write a report of the stored winners and trials; reads the database only."""
    from autotile.reports import ReportFormat, write_report

    report = write_report(db_url, ReportFormat(fmt), out, family=family, device=device_key, storage_url=storage)
    if not report.problems:
        click.echo("no trials or winners stored for this selection: run `autotile tune FAMILY`", err=True)
    click.echo(f"wrote {fmt} report of {len(report.problems)} problem(s) to {out}")
    for note in report.notes:
        click.echo(f"note: {note}", err=True)
