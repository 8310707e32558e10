"""`autotile db`: export, import, merge, verify and upgrade the tuning database."""
from __future__ import annotations

from pathlib import Path

import click

from autotile.cli.common import (
    db_option, friendly_errors, known_family, named_file, refuse_overwriting_database, what_is_stored,
)

_POLICIES = ("keep", "faster", "replace")


def _conflict_options(default: str):
    """--on-conflict (with its default) and --dry-run, shared by import and merge."""
    def decorate(command):
        command = click.option("--dry-run", is_flag=True, help="validate and report, write nothing")(command)
        return click.option("--on-conflict", type=click.Choice(_POLICIES), default=default, show_default=True,
                            help="a stored winner of the same problem and device: keep it, keep the faster, "
                                 "or replace it")(command)
    return decorate


@click.group("db")
def db_group() -> None:
    """Move, check and migrate the tuning database."""


@db_group.command("export")
@click.option("--out", "out", required=True, type=click.Path(dir_okay=False, path_type=Path), callback=named_file,
              help="the JSON-lines file to write (format: autotile/store/EXPORT.md)")
@click.option("--family", default=None, callback=known_family, help="only this family's winners")
@click.option("--device", "device_key", default=None, help="only winners of this device key, e.g. h200/sm90")
@db_option
@friendly_errors
def export_command(out, family, device_key, db_url):
    """Write the stored winners to a portable JSON-lines file."""
    from autotile.store.exchange import export_database

    if str(out) == "-":
        raise click.BadParameter("db export writes a file (renamed into place when whole): give it a name, e.g. "
                                 "winners.jsonl", param_hint="--out")
    refuse_overwriting_database(out, db_url)
    counts = export_database(db_url, out, family, device_key)
    policies = counts["policy"]
    also = f" and {policies} polic{'ies' if policies != 1 else 'y'}" if policies else ""
    click.echo(f"exported {counts['winner']} winner{'s' if counts['winner'] != 1 else ''}{also} to {out}")
    if not counts["winner"] and not policies and (note := what_is_stored(db_url, family, device_key)):
        click.echo(note, err=True)


def _print_import(report) -> None:
    verb = "would keep" if report.dry_run else "kept"
    counts = ", ".join(f"{n} {action}" for action, n in report.counts().items() if action != "skipped" and n)
    click.echo(f"{report.source}: {verb} {report.kept_count} record(s) ({counts or 'none'}); "
               f"skipped {report.skipped_count}")
    for item in report.kept:
        click.echo(f"  line {item.line}: {item.action}  {item.family} {item.device_key} {item.problem_key}")
    for item in report.skipped:
        click.echo(f"  line {item.line}: skipped: {item.reason}", err=True)
    if report.unlisted:
        click.echo(f"  ... and {report.unlisted} more record(s), counted above but not listed", err=True)
    if report.truncated:
        click.echo(f"  warning: {report.truncated}; every complete record before that point was checked as above",
                   err=True)


def _fail_if_nothing_kept(reports, dry_run: bool = False) -> None:
    """An import or merge that skipped every record it read, or read a file cut short, did not do what was asked: a
    non-zero exit for scripts (a file of no records, or records all unchanged, is not a failure)."""
    if any(r.skipped_count for r in reports) and not any(r.kept_count for r in reports):
        raise click.ClickException("every record was skipped (above): nothing " + ("would be" if dry_run else "was")
                                   + " imported")
    cut = [r for r in reports if r.truncated]
    if cut:
        kept = ("a real import would keep the records read (above)" if dry_run
                else "the records read were kept (above)")
        raise click.ClickException(f"{cut[0].truncated}: {kept}; export the file again and import it once more for "
                                   "the rest")


@db_group.command("import")
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@_conflict_options(default="keep")
@db_option
@friendly_errors
def import_command(file, on_conflict, dry_run, db_url):
    """Import winners from an export file; every record is validated, nothing in it is executed."""
    from autotile.store.exchange import ConflictPolicy, import_file

    report = import_file(db_url, file, policy=ConflictPolicy(on_conflict), dry_run=dry_run)
    _print_import(report)
    _fail_if_nothing_kept([report], dry_run)


@db_group.command("merge")
@click.argument("sources", nargs=-1, required=True)
@_conflict_options(default="faster")
@db_option
@friendly_errors
def merge_command(sources, on_conflict, dry_run, db_url):
    """Merge the winners of other autotile databases (files or URLs) into --db."""
    from autotile.store.exchange import ConflictPolicy, merge_databases

    reports = merge_databases(db_url, sources, policy=ConflictPolicy(on_conflict), dry_run=dry_run)
    for report in reports:
        _print_import(report)
    _fail_if_nothing_kept(reports, dry_run)


@db_group.command("verify")
@click.option("--family", default=None, callback=known_family, help="only this family's winners")
@click.option("--gpu", default="auto", show_default=True,
              help="GPU profile whose winners to re-check (must be the GPU present), auto, or interpret")
@click.option("--threshold", default=None, type=click.FloatRange(0.0), help="slowdown marked as a regression "
              "(fraction of the stored median; default 0.15)")
@click.option("--rounds", default=None, type=click.IntRange(1), help="interleaved timing rounds (default 3)")
@db_option
@friendly_errors
def verify_command(family, gpu, threshold, rounds, db_url):
    """Re-check stored winners on this GPU for correctness and time; mark regressions and stale winners."""
    from autotile.device import resolve_gpu
    from autotile.store.marks import servable
    from autotile.store.verify import DEFAULT_REGRESSION_THRESHOLD, DEFAULT_VERIFY_ROUNDS, VerifyStatus, verify_winners

    device = resolve_gpu(gpu)
    results = verify_winners(db_url, device, family=family,
                             threshold=DEFAULT_REGRESSION_THRESHOLD if threshold is None else threshold,
                             rounds=rounds or DEFAULT_VERIFY_ROUNDS)
    if not results:
        click.echo(f"no winners stored for {device.key}" + (f" in family {family}" if family else ""))
        return
    label = " (interpret: CPU timings)" if device.interpret else ""
    for r in results:
        now = f"{r.verified_ms:.4f} ms" if r.verified_ms is not None else "-"
        stale = f"  stale: {'; '.join(r.stale_reasons)}" if r.stale_reasons else ""
        click.echo(f"{r.status.value:<14} {r.family} {r.device_key} {r.problem_key}\n"
                   f"  stored {r.stored_ms:.4f} ms, now {now}{label}{stale}" + (f"\n  {r.detail}" if r.detail else ""))
    bad = [r for r in results if r.status is not VerifyStatus.OK]
    stale = [r for r in results if r.stale_reasons]
    failing = [r for r in bad if not servable(r.status.value)]
    click.echo(f"verified {len(results)}: {len(results) - len(bad)} ok, {len(bad)} marked"
               + (f"; {len(stale)} stale (re-time them with `autotile tune --stale`)" if stale else ""))
    if failing:
        # A check that found winners failing fails (a script or CI job runs it after a driver or toolchain change).
        raise click.ClickException(f"{len(failing)} winner(s) failed on this GPU and are no longer served: "
                                   "tune their problems again (`autotile tune FAMILY ...`)")


@db_group.command("upgrade")
@click.option("--no-backup", is_flag=True, help="do not copy a SQLite file aside before migrating it")
@db_option
@friendly_errors
def upgrade_command(no_backup, db_url):
    """Migrate the database to this autotile's schema (Alembic); SQLite files are backed up first."""
    from autotile.store.migrate import upgrade_database

    report = upgrade_database(db_url, backup=not no_backup)
    if not report.changed:
        click.echo(f"{report.url} is at schema version {report.to_version} (revision {report.to_revision}): "
                   "nothing to do")
        return
    click.echo(f"{report.url}: schema version {report.from_version} -> {report.to_version} "
               f"(revision {report.from_revision} -> {report.to_revision})")
    if report.backup:
        click.echo(f"  the file before the upgrade is kept at {report.backup}")
