"""How `autotile tune` runs its problems: interpreter-sized defaults, Ctrl-C, and the exit status."""
from __future__ import annotations

from collections.abc import Callable

import click

# Exit status after Ctrl-C, as shells report a process ended by SIGINT (128 + 2).
EXIT_INTERRUPTED = 130
# Under the interpreter a shape option left out takes this value instead of the GPU-sized default: an
# elementwise trial of 2^28 elements runs for many minutes on the CPU interpreter, one of 2^16 in seconds.
INTERPRETER_DEFAULTS = {("elementwise", "numel"): 1 << 16}
# Problems of a default suite named in the interpreter note.
_NAMED_PROBLEMS = 3


def interpreter_defaults(family, options: dict, given: list[str]) -> dict:
    """`options` with interpreter-sized values for the shape options the user left out."""
    small = {name: value for (fam, name), value in INTERPRETER_DEFAULTS.items()
             if fam == family.name and name in options and name not in given}
    if not small:
        return options
    click.echo("note: under the interpreter, " + ", ".join(f"--{n.replace('_', '-')} defaults to {v}"
                                                          for n, v in small.items())
               + " (a GPU-sized default would run for hours); give it to choose another", err=True)
    multiple = {o.name for o in family.cli_options if o.multiple}
    return {**options, **{n: (v,) if n in multiple else v for n, v in small.items()}}


def suite_note(family, problems: list, trials: int) -> str:
    """What a default suite under the interpreter will run, and that it is long."""
    from autotile.cli.progress import short_label

    named = "; ".join(short_label(family, p) for p in problems[:_NAMED_PROBLEMS])
    more = f"; and {len(problems) - _NAMED_PROBLEMS} more" if len(problems) > _NAMED_PROBLEMS else ""
    return (f"note: no shape given, so the default {family.name} suite runs: {len(problems)} problems "
            f"({named}{more}), up to {trials} trials each. Its GPU-sized shapes take minutes per trial on the "
            "CPU interpreter, hours in all: give a small shape for a quick run (see --help)")


def tune_each(problems: list, tune_one: Callable) -> None:
    """Tune every problem in turn and print each result.

    Ctrl-C stores the best of the trials so far (as --timeout does) and exits with status 130; when any
    problem ends with no config that passed the correctness check, the command exits with status 1.
    Several problems share one trial worker and compile-ahead pool per device (autotile.tune.session): a
    suite starts them once, not once per problem; one problem starts them before the tuner is imported.
    """
    from autotile.tune.session import session_scope

    with session_scope():
        _tune_each(problems, tune_one)


def _tune_each(problems: list, tune_one: Callable) -> None:
    without_winner = 0
    for problem in problems:
        try:
            result = tune_one(problem)
        except KeyboardInterrupt:
            click.echo("interrupted before a winner was stored; every finished trial is stored: run the same "
                       "command again to resume", err=True)
            raise SystemExit(EXIT_INTERRUPTED) from None
        print_result(result)
        if result.interrupted:
            done = "the best so far is stored" if result.winner is not None else "no trial had passed yet"
            click.echo(f"interrupted: {done}; run the same command again to resume", err=True)
            raise SystemExit(EXIT_INTERRUPTED)
        without_winner += result.winner is None
    if without_winner:
        raise click.ClickException(
            f"{without_winner} of {len(problems)} problem(s) got no winner: every trial failed; "
            "`autotile show FAMILY --errors` prints why")


def print_result(result) -> None:
    """A TuneResult in a few lines: the winner, its speed against the baseline, the trial statuses."""
    label = " (interpret)" if result.interpreted else ""
    if result.already_complete:
        click.echo("study already complete: it holds --trials evaluated trials, nothing left to run (raise --trials "
                   "to search further); the stored winner was re-timed beside the best configs")
    if result.winner is None:
        click.echo(f"{result.family}: no config passed the correctness check; statuses {result.statuses}")
        return
    speed = f", {result.speedup:.2f}x {result.baseline_name}" if result.speedup else ""
    click.echo(f"winner{label}: {result.winner_ms:.4f} ms{speed}; trials {result.statuses}; "
               f"{result.seconds:.1f} s\n  config {result.winner.to_json()}")
    if result.stopped_early:
        click.echo(f"  stopped early: {result.stopped_early}")
