"""A rich progress bar around a tuning run, with the best result so far."""
from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


def tune_with_progress(family, problem, device, **kwargs):
    from autotile.tune.driver import tune_problem

    console = Console(stderr=True)
    label = f"{family.name} {_describe(family, problem)}"
    columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("best {task.fields[best]}  last {task.fields[last]}"), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False, disable=not console.is_terminal) as bar:
        task = bar.add_task(label, total=kwargs.get("trials", 1), best="-", last="-")

        def update(p):
            best = "-" if p.best_ms is None else f"{p.best_ms:.4f} ms" + (" (interpret)" if device.interpret else "")
            bar.update(task, completed=p.evaluated, total=p.target, best=best, last=p.last_status)

        if not console.is_terminal:
            console.print(f"tuning {label}")
        return tune_problem(family, problem, device, progress=update, **kwargs)


def _describe(family, problem) -> str:
    import dataclasses

    return " ".join(f"{k}={v}" for k, v in dataclasses.asdict(problem).items())
