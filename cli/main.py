"""The `autotile` command: parse, call the library, print."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import click

from autotile.cli.common import (
    FamilyGroup, db_option, family_options, friendly_errors, known_family, positive_seconds, what_is_stored,
)
from autotile.cli.tune_run import interpreter_defaults, suite_note, tune_each
from autotile.cli.tune_plan import model_options, take_model_options, tune_group, tune_model


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="autotile", message="autotile %(version)s")
def cli() -> None:
    """autotile: generate Triton kernels, tune them on your GPU, serve the winners."""


def main() -> None:
    if starts_a_gpu_search(sys.argv[1:]):
        from autotile.tune.early_worker import spawn_early_worker

        spawn_early_worker()  # its torch import runs beside this process's
    cli(prog_name="autotile")


# Options after which `tune` runs no trial worker on the default GPU (or only prints).
_NO_EARLY_WORKER = ("--dry-run", "--simulate", "--stale", "--gpus", "--help", "-h")


def starts_a_gpu_search(args: list[str]) -> bool:
    """Whether this command line tunes on the default CUDA GPU, judged before anything heavy is imported: a
    `tune` command on a machine with an NVIDIA driver, not on the interpreter, not a dry run or simulation.

    >>> starts_a_gpu_search(["tune", "gemm", "--gpu", "interpret"]), starts_a_gpu_search(["list"])
    (False, False)
    """
    import os

    if not args or args[0] != "tune" or not os.path.exists("/dev/nvidiactl"):
        return False
    if any(a in _NO_EARLY_WORKER or a.split("=")[0] in _NO_EARLY_WORKER for a in args):
        return False
    gpu = [args[i + 1] for i, a in enumerate(args[:-1]) if a == "--gpu"] + [a[6:] for a in args if a.startswith("--gpu=")]
    return not any(g == "interpret" for g in gpu) and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")


# --- tune / render: one subcommand per family, built from the family's problem options ----------


def _problems(family, preset: str | None, options: dict) -> list:
    if preset:
        presets = family.presets()
        if preset not in presets:
            raise click.BadParameter(f"unknown preset {preset!r}; {family.name} has {', '.join(presets)}",
                                     param_hint="--preset")
        mixed = _given_options(options)
        if mixed:
            flags = ", ".join("--" + name.replace("_", "-") for name in mixed)
            raise click.UsageError(f"--preset {preset} names its own problems, so {flags} would be ignored: "
                                   "give either --preset or the shape options, not both")
        return presets[preset]
    problems = family.problems_from_cli(**options)
    given = _given_options(options)
    if given and problems == family.default_suite():
        # The family took no shape from these options and fell back to its suite, which would ignore them.
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        raise click.UsageError(f"{flags} describe{'s' if len(given) == 1 else ''} a problem, but no shape was given, "
                               f"so the default {family.name} suite would run without "
                               f"{'it' if len(given) == 1 else 'them'}: give the shape too (see --help), or drop "
                               f"{'it' if len(given) == 1 else 'them'} for the suite")
    return problems


def _given_options(options: dict) -> list[str]:
    """The family options given on the command line (or by environment), not left at their defaults."""
    from click.core import ParameterSource

    ctx = click.get_current_context()
    return [name for name in options
            if ctx.get_parameter_source(name) not in (None, ParameterSource.DEFAULT, ParameterSource.DEFAULT_MAP)]


def _make_tune_command(name: str):
    from autotile.families import get_family

    family = get_family(name)

    @click.command(name=name, help=f"Tune the {name} family for one problem, a preset, or its default suite.")
    @family_options(family)
    @click.option("--preset", default=None, help="a named problem list: " + ", ".join(family.presets()))
    @click.option("--gpu", default="auto", show_default=True,
                  help="GPU profile to file results under (h200, h100, a100, ...), auto, or interpret (CPU interpreter).")
    @click.option("--trials", default=30, show_default=True, type=click.IntRange(1), help="evaluated trials per problem (a rerun resumes to this count)")
    @click.option("--timeout", default=None, type=float, callback=positive_seconds, help="seconds per problem")
    @click.option("--seed", default=0, show_default=True, type=int)
    @click.option("--storage", default=None, help="Optuna storage URL shared by several hosts (default: the --db database)")
    @click.option("--gpus", default=None, metavar="0,1,...",
                  help="CUDA devices to tune on at once, one worker each, on one shared study (default: the first)")
    @click.option("--trial-timeout", default=None, type=click.FloatRange(min=1),
                  help="seconds one trial may take before its worker is killed and the trial filed as timeout "
                       "(default: 120; on a GPU only: under the interpreter trials run in this process, and "
                       "--timeout bounds the problem)")
    @click.option("--compile-ahead/--no-compile-ahead", default=True, show_default=True,
                  help="compile the next asked configs in CPU processes while the GPU times the current one")
    @click.option("--stale", is_flag=True,
                  help="re-validate winners tuned with another toolchain or driver: re-time their stored top few configs, no new search")
    @click.option("--patience", default=None, type=click.IntRange(1),
                  help="stop a problem's search after this many evaluated trials without improvement, once the vendor "
                       "op is beaten or out of reach (default: run --trials)")
    @click.option("--simulate", default=None, metavar="DB",
                  help="replay the timings stored in DB (an autotile database, or a timing table or folder of them) "
                       "instead of running anything: nothing is compiled, run or stored")
    @click.option("--dry-run", is_flag=True,
                  help="print the search planned for --gpu (a profile's limits when that GPU is not here): the "
                       "space's size, what each constraint pruned, the first configs; nothing runs or is stored")
    @model_options(family)
    @db_option
    @friendly_errors
    def command(preset, gpu, trials, timeout, seed, storage, gpus, trial_timeout, compile_ahead, stale, patience,
                simulate, dry_run, db_url, **options):
        from autotile.cli.progress import tune_with_progress
        from autotile.device import resolve_gpu

        if dry_run:
            _dry_run(family, preset, gpu, db_url, options)
            return
        if simulate:
            if any(take_model_options(options).values()):
                raise click.UsageError("--simulate replays one problem's table: give its shape, not --model")
            _simulate(family, simulate, gpu, _problems(family, preset, options), trials, seed, patience)
            return
        if gpus is not None and not all(g.strip().isdigit() for g in gpus.split(",")):
            raise click.BadParameter(f"{gpus!r} is not a comma-separated list of GPU indices", param_hint="--gpus")
        gpu_list = [int(g) for g in gpus.split(",")] if gpus else None
        device = resolve_gpu(gpu, index=gpu_list[0] if gpu_list else 0)
        if stale:
            _revalidate_stale(db_url, device, family.name)
            return
        model_opts = take_model_options(options)
        if model_opts["model"] is not None and not model_opts["model"].strip():
            raise click.BadParameter("name a model (see autotile.models), or leave --model out", param_hint="--model")
        if not (model_opts["model"] or model_opts["dims"]):
            # These describe a model run: without --model or --dims they would be ignored, and the shape options tuned.
            given = [f"--{name}" for name in ("tokens", "budget", "policy") if model_opts[name]]
            if given:
                raise click.UsageError(f"{', '.join(given)} {'go' if len(given) > 1 else 'goes'} with --model or --dims (a model's projections or "
                                       "prefill); for one shape give its options alone, and --timeout for a time "
                                       "limit")
        if model_opts["model"] or model_opts["dims"]:
            tune_model(family, model_opts, options, _given_options(options), device, db_url, trials, seed,
                       storage_url=storage, gpus=gpu_list,
                       trial_timeout=trial_timeout, compile_ahead=compile_ahead, patience=patience)
            return
        problems = _problems(family, preset, options)
        if device.interpret and not preset and _given_options(options):
            # (a shape given, as _problems made sure: the options left out get interpreter-sized values; the
            # default suite keeps its own shapes)
            options = interpreter_defaults(family, options, _given_options(options))
            problems = _problems(family, preset, options)
        if device.interpret:
            click.echo("note: --gpu interpret runs on Triton's CPU interpreter; its timings are CPU timings.", err=True)
            if trial_timeout is not None:
                click.echo("note: --trial-timeout applies on a GPU only (each trial in a worker process that can be "
                           "killed); under the interpreter --timeout bounds a problem's search.", err=True)
            if not preset and not _given_options(options) and len(problems) > 1:
                click.echo(suite_note(family, problems, trials), err=True)
        tune_each(problems, lambda problem: tune_with_progress(
            family, problem, device, trials=trials, timeout=timeout, db_url=db_url, storage_url=storage, seed=seed,
            gpus=gpu_list, trial_timeout=trial_timeout, compile_ahead=compile_ahead, patience=patience))

    return command


def _dry_run(family, preset, gpu, db_url, options) -> None:
    """`tune ... --dry-run`: the planned search of each problem on the named GPU, which need not be present."""
    from autotile.device import resolve_gpu
    from autotile.tune.dry_run import dry_run

    if any(take_model_options(options).values()):
        raise click.UsageError("--dry-run plans the problems given by shape options or --preset, not --model")
    device = resolve_gpu(gpu, planned=True)
    if device.interpret and not preset:
        options = interpreter_defaults(family, options, _given_options(options))
    plans = dry_run(family, _problems(family, preset, options), device, db_url)
    for text, _ in plans:
        click.echo(text)
    refused = sum(not runnable for _, runnable in plans)
    if refused:
        raise click.ClickException(f"{refused} of {len(plans)} problem(s) cannot run on {device.key} (see above)")


def _simulate(family, source, gpu, problems, trials, seed, patience) -> None:
    """`tune ... --simulate DB`: the tuner's search on stored timings; prints what it reached against the table's best."""
    from autotile.tune.driver import tune_problem
    from autotile.tune.simulate import load_table

    wanted = None if gpu in ("auto", "interpret") else gpu
    for problem in problems:
        table = load_table(source, family, problem, wanted)
        click.echo(f"simulating {family.name} {family.problem_key(problem)} on {table.device.key}: {len(table)} "
                   f"measured configs ({table.note})")
        result = tune_problem(family, problem, table.device, trials=trials, seed=seed, patience=patience,
                              simulate=table)
        best = table.best_ms
        reached = f"{best / result.winner_ms:.1%} of the table's best ({best:.4g} ms)" if result.winner_ms else "nothing"
        vendor = f"; vendor op {table.best_vendor_ms:.4g} ms" if table.best_vendor_ms else ""
        click.echo(f"  {sum(result.statuses.values())} evaluations reached {reached}{vendor}; "
                   f"{result.never_measured} proposals were never measured (replaced by measured configs), "
                   f"{result.pruned} dropped by the roofline model")
        if result.winner is not None:
            click.echo(f"  best {result.winner_ms:.4g} ms: {result.winner.to_json()}")
        if result.warm_start:
            click.echo(f"  warm start: {result.warm_start}")
        if result.stopped_early:
            click.echo(f"  stopped early: {result.stopped_early}")


def _revalidate_stale(db_url, device, family_name: str) -> None:
    from autotile.tune.stale import revalidate_stale

    results = revalidate_stale(db_url, device, family_name)
    if not results:
        click.echo(f"no stale {family_name} winners for {device.key}")
    for r in results:
        timing = f"{r.previous_ms:.4f} -> {r.ms:.4f} ms" if r.ms is not None else r.detail
        click.echo(f"{r.status}: {r.family} {r.problem_key} ({'; '.join(r.reasons)}) {timing}")


cli.add_command(tune_group(_make_tune_command))


def _make_render_command(name: str):
    from autotile.families import get_family

    family = get_family(name)

    @click.command(name=name, help=f"Print the Triton source a {name} config renders to.")
    @family_options(family)
    @click.option("--config", "config_json", default=None,
                  help="config JSON; axes it leaves out take the default config's values (default: the default config)")
    @click.option("--gpu", default="interpret", show_default=True, help="device whose limits the config is checked against")
    @friendly_errors
    def command(config_json, gpu, **options):
        from autotile.device import resolve_gpu
        from autotile.render import render_source
        from autotile.space import Config

        device = resolve_gpu(gpu, planned=True)  # (nothing runs: a named GPU's limits serve where it is absent)
        problems = family.problems_from_cli(**options)
        problem = problems[0]
        space = family.space(problem, device)
        config = family.default_config(problem, device)
        if config_json:
            config = space.validate(space.filled(Config.from_json(config_json), config))
        click.echo(f"# problem: {family.problem_key(problem)}\n# config:  {config.to_json()}")
        click.echo(render_source(family.template, **family.render_switches(problem, config)))

    return command


cli.add_command(FamilyGroup(name="render", factory=_make_render_command,
                             help="Render a family's template for a config, without running it."))


def _make_bench_command(name: str):
    from autotile.families import get_family

    family = get_family(name)

    @click.command(name=name, help=f"Time the {name} config autotile serves beside its baseline (no tuning).")
    @family_options(family)
    @click.option("--preset", default=None, help="a named problem list: " + ", ".join(family.presets()))
    @click.option("--gpu", default="auto", show_default=True, help="GPU profile (h200, ...), auto, or interpret")
    @click.option("--rounds", default=5, show_default=True, type=click.IntRange(1), help="interleaved timing rounds")
    @db_option
    @friendly_errors
    def command(preset, gpu, rounds, db_url, **options):
        import os

        from rich.table import Table

        from autotile.benchmark import bench_problem
        from autotile.device import resolve_gpu
        from autotile.store.db import normalise_url

        if db_url:
            os.environ["AUTOTILE_DB"] = normalise_url(db_url)  # the database the runtime serves from
        device = resolve_gpu(gpu)
        label = " (interpreter timings)" if device.interpret else ""
        table = Table(title=f"autotile bench {name} on {device.name}{label}")
        for col in ("problem", "config from", "autotile ms", "spread", "TFLOP/s", "TB/s", "baseline", "baseline ms",
                    "speedup"):
            table.add_column(col)
        problems = _problems(family, preset, options)
        if device.interpret and not preset and not _given_options(options):  # the default suite (see _problems)
            click.echo(f"note: no shape given, so the default {family.name} suite runs: {len(problems)} GPU-sized "
                       "problems, minutes each on the CPU interpreter; give a small shape for a quick run "
                       "(see --help)", err=True)
        for problem in problems:
            row = bench_problem(family, problem, device, rounds=rounds)
            source = f"{row.resolution.source} ({row.resolution.match})"
            if row.ours is None:
                table.add_row(_short_key(vars(problem)), source, row.status.value, "", "", "", "",
                              "", row.error.splitlines()[0][:80] if row.error else "")
                continue
            ms = row.ours.median_ms
            table.add_row(_short_key(vars(problem)), source, f"{ms:.4f}", f"{row.ours.spread:.1%}",
                          f"{row.flops / ms / 1e9:.1f}", f"{row.bytes / ms / 1e9:.3f}", row.baseline_name or "-",
                          f"{row.baseline.median_ms:.4f}" if row.baseline else "-",
                          f"{row.speedup:.2f}x" if row.speedup else "-")
        _console(220).print(table)

    return command


cli.add_command(FamilyGroup(name="bench", factory=_make_bench_command,
                            help="Time the configs autotile serves beside their baselines on this device."))


# --- reading the database --------------------------------------------------------------------


def _read_store(db_url):
    """The Store of a database opened for reading only (a read-only file or folder works)."""
    from autotile.store.db import open_engine
    from autotile.store.repo import Store

    return Store(open_engine(db_url, create=False, read_only=True))


@cli.command("list")
@click.option("--family", default=None, callback=known_family, help="only this family's winners")
@click.option("--device", "device_key", default=None, help="device key, e.g. h200/sm90 or interpret")
@db_option
@friendly_errors
def list_command(family, device_key, db_url):
    """List the stored winners."""
    from rich.table import Table

    from autotile.families.base import is_vendor, vendor_label
    from autotile.space import Config
    from autotile.store.db import reading

    with reading(db_url):
        winners = _read_store(db_url).winners(family, device_key)
    if not winners:
        click.echo(what_is_stored(db_url, family, device_key) or "no winners stored yet: run `autotile tune FAMILY`")
        return
    table = Table(title="autotile winners")
    for col in ("family", "device", "problem", "median ms", "spread", "vs baseline", "trials"):
        table.add_column(col)
    for w in winners:
        speed = f"{w.baseline_ms / w.median_ms:.2f}x {w.baseline_name}" if w.baseline_ms else "-"
        spread = f"{(w.q80_ms - w.q20_ms) / w.median_ms:.1%}" if w.median_ms else "-"
        config = Config.from_json(w.config)
        served = f" [{vendor_label(config)}]" if is_vendor(config) else ""
        stale = _winner_mark(w)
        table.add_row(w.family, w.device_key + (" (interpret)" if w.interpreted else ""),
                      stale + _short_key(w.params) + served, f"{w.median_ms:.4f}", spread, speed, str(w.trials_run))
    _console(200).print(table)


def _margin(margin: float | None) -> str:
    """The winner's lead over the runner-up; below 0 where the stored winner was kept against a rival timed faster
    by less than the re-timing's noise (autotile.tune.driver's KEEP_STORED_MARGIN)."""
    if margin is None:
        return "-"
    return f"{margin:.1%}" + (" (kept: the faster rival was within timing noise)" if margin < 0 else "")


def _winner_mark(w) -> str:
    """What `autotile db verify`, `tune --stale` or a toolchain change found on a winner, as '(...) ', or ''."""
    from autotile.store.marks import winner_mark

    mark = winner_mark(w.stale, w.verify_status, w.regression)
    return f"({mark}) " if mark else ""


def _console(log_width: int):
    """A console as wide as the terminal; in a log or a pipe, `log_width` columns, so rows are not wrapped."""
    from rich.console import Console

    console = Console()
    if not console.is_terminal:
        console.width = log_width
    return console


def _short_key(params: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in params.items())


@cli.command("show")
@click.argument("family", callback=known_family)
@click.option("--match", "match", default="", help="only problems whose key contains this text")
@click.option("--errors/--no-errors", default=False, help="print the error text of failed trials")
@db_option
@friendly_errors
def show_command(family, match, errors, db_url):
    """Show a family's problems: the winner, its provenance, and every trial's status."""
    from collections import Counter

    from autotile.store.db import reading

    with reading(db_url):
        store = _read_store(db_url)
        winners = {(w.problem_key, w.device_key): w for w in store.winners(family) if match in w.problem_key}
        trials = [t for t in store.trials(family) if match in t["problem_key"]]
    if not trials and not winners:
        click.echo(f"no winners or trials stored for {family}" + (f" matching {match!r}" if match else ""))
        return
    # Problems with trials, and those with a winner alone (imported or merged: their trials stayed where they ran).
    by_problem: dict[str, list] = {key: [] for key, _ in winners}
    for t in trials:
        by_problem.setdefault(t["problem_key"], []).append(t)
    for key, rows in by_problem.items():
        click.echo(f"\n{family} {key}")
        for (pkey, dkey), w in winners.items():
            if pkey == key:
                click.echo(f"  winner on {dkey}: {w.median_ms:.4f} ms [{w.q20_ms:.4f}, {w.q80_ms:.4f}] "
                           f"margin {_margin(w.margin)}  {w.config}\n    {w.provenance}"
                           + (f"\n    {mark.strip()}" if (mark := _winner_mark(w)) else ""))
        click.echo(f"  trials: {dict(Counter(r['status'] for r in rows))}" if rows else
                   "  trials: none stored here (the winner was imported or merged)")
        ok = sorted((r for r in rows if r["status"] == "ok"), key=lambda r: r["median_ms"])[:5]
        for r in ok:
            click.echo(f"    {r['median_ms']:.4f} ms  {json.dumps(r['config'], sort_keys=True)}")
        if errors:
            for r in rows:
                if r["status"] != "ok":
                    click.echo(f"    [{r['status']}] {json.dumps(r['config'], sort_keys=True)}\n      {r['error'][:500]}")


@cli.command("env")
@db_option
def env_command(db_url):
    """Versions, the device, and where autotile keeps its database and kernel cache."""
    import platform

    import torch
    import triton

    import autotile
    from autotile.device import cuda_device, interpret_device
    from autotile.resources import shipped_db_path, templates_dir
    from autotile.store.db import default_db_url, normalise_url

    device = cuda_device(0) if torch.cuda.is_available() else interpret_device()
    database = normalise_url(db_url) if db_url else default_db_url()
    info = {
        "autotile": autotile.__version__, "python": platform.python_version(), "torch": torch.__version__,
        "triton": triton.__version__, "cuda": torch.version.cuda, "device": device.fingerprint(),
        "database": database, "database_file": _database_file_entry(database), "shipped_db": str(shipped_db_path()),
        "templates": str(templates_dir()), "kernel_cache": _kernel_cache_entry(),
        "triton_cache": str(Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")),
        **_switches_in_effect(),
    }
    click.echo(json.dumps(info, indent=2))


def _database_file_entry(url: str) -> str:
    """Whether the database's SQLite file is there (the runtime serves from it only then); 'server' for other URLs."""
    from autotile.store.db import sqlite_path

    path = sqlite_path(url)
    if path is None:
        return "server"
    return "present" if path.is_file() else "a folder, not a database file" if path.exists() else "not created yet"


def _switches_in_effect() -> dict:
    """The runtime's environment switches as the ops read them."""
    from autotile.families.base import vendor_enabled
    from autotile.runtime.trace import recording_path
    from autotile.switches import switch

    record = recording_path()
    return {"vendor_op": "candidate" if vendor_enabled() else "off (AUTOTILE_VENDOR=0: generated kernels only)",
            "log": switch("AUTOTILE_LOG", False, "prints one line per new shape"),
            "gpu_checks": switch("AUTOTILE_CHECKS", False, "checks paged runs on the GPU"),
            "record": str(record) if record is not None else None}


def _kernel_cache_entry() -> str:
    """The kernel cache folder, or what is wrong with it: env reports a broken setup instead of failing on it."""
    from autotile.errors import KernelCacheError
    from autotile.render import kernel_cache_dir

    try:
        return str(kernel_cache_dir())
    except KernelCacheError as exc:
        return f"unusable: {exc} (each process renders its kernels into a temporary folder of its own instead)"


def _register_command_modules() -> None:
    # The commands that live in modules of their own.
    from autotile.cli.db import db_group
    from autotile.cli.export_kernel import export_kernel_command
    from autotile.cli.report import report_command
    from autotile.cli.warmup import warmup_command

    for command in (db_group, export_kernel_command, report_command, warmup_command):
        cli.add_command(command)


_register_command_modules()

if __name__ == "__main__":
    sys.exit(main())
