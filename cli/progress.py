"""Progress of a tuning run: a rich bar with the best result so far on a terminal, one line per trial elsewhere."""
from __future__ import annotations

import dataclasses

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Column

# Characters of the bar's problem label; the full problem is printed on its own line above the bar, so
# the bar fits an 80-column terminal (label + bar + count + best/last + elapsed).
_BAR_LABEL_CHARS = 22
_BAR_WIDTH = 12


def tune_with_progress(family, problem, device, **kwargs):
    """`tune_problem` with its progress drawn on stderr; returns its TuneResult.

    On a terminal: the problem on one line, then a bar. Otherwise (a pipe, a CI log): the problem, then one
    line per finished trial, so long runs show that they are alive.
    """
    from autotile.tune.session import prestart_search

    prestart_search(family, problem, device, **kwargs)  # the worker starts while the tuner is imported
    from autotile.tune.driver import tune_problem

    console = Console(stderr=True)
    click.echo(f"tuning {family.name} {describe(problem)}", err=True)
    if not console.is_terminal:
        return tune_problem(family, problem, device, progress=_trial_lines(), **kwargs)
    columns = (TextColumn("[bold]{task.description}", table_column=Column(no_wrap=True, max_width=_BAR_LABEL_CHARS)),
               BarColumn(bar_width=_BAR_WIDTH), MofNCompleteColumn(),
               TextColumn("best {task.fields[best]}  last {task.fields[last]}", table_column=Column(no_wrap=True)),
               TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as bar:
        task = bar.add_task(short_label(family, problem), total=kwargs.get("trials", 1), best="-", last="-")

        def update(p):
            bar.update(task, completed=p.evaluated, total=p.target, best=_ms(p.best_ms), last=p.last_status)

        return tune_problem(family, problem, device, progress=update, **kwargs)


def _trial_lines():
    def update(p) -> None:
        click.echo(f"  trial {p.evaluated}/{p.target}: {p.last_status}; best so far {_ms(p.best_ms)}", err=True)

    return update


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g} ms"


def describe(problem) -> str:
    """Every field of a problem, as `name=value` pairs."""
    return " ".join(f"{k}={v}" for k, v in dataclasses.asdict(problem).items())


def short_label(family, problem) -> str:
    """The family and its shape fields (m n k, seq lengths...), cut to fit the bar's label column.

    >>> from autotile.families.gemm import FAMILY, contiguous_problem
    >>> short_label(FAMILY, contiguous_problem(4096, 4096, 4096, "bf16", "bf16"))
    'gemm 4096x4096x4096'
    """
    fields = dataclasses.asdict(problem)
    shape = "x".join(str(fields[name]) for name in family.shape_fields if fields.get(name) is not None)
    label = f"{family.name} {shape}".strip()
    return label if len(label) <= _BAR_LABEL_CHARS else label[: _BAR_LABEL_CHARS - 1] + "\u2026"
