"""Tuning what a model runs: problems from a recorded trace or a model's dimensions, tuned within a time budget.

`autotile tune --from-trace trace.jsonl --budget 10m` groups the recorded problems by serving bucket (calls
of one layer whose tokens fall in one M bucket share a winner, verified over the bucket), then tunes the
groups with the most calls first; each gets an equal share of the budget that is left. What the budget does
not reach is reported, not dropped silently.

>>> parse_budget("10m"), parse_budget("90s"), parse_budget("1h30m"), parse_budget("45")
(600.0, 90.0, 5400.0, 45.0)
"""
from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from autotile.errors import BadInputError, DatabaseError
from autotile.families import family_names, get_family
from autotile.families.base import Family, problem_to_dict
from autotile.store.exchange import checked_problem
from autotile.tune.session import in_session

# Seconds a problem needs at the least to be worth starting: the vendor check, a few trials, the re-timing.
MIN_PROBLEM_S = 8.0
# Trials a problem may take when the budget allows more.
MAX_TRIALS = 40


@dataclass(frozen=True)
class PlannedProblem:
    family: Family
    problem: object
    calls: int  # calls recorded for the problems of this group (0 for a model table)
    covers: int = 1  # recorded problems this one stands for (one serving bucket)


@dataclass
class PlanOutcome:
    tuned: list = field(default_factory=list)  # TuneResult of each tuned problem, in order
    skipped: list[PlannedProblem] = field(default_factory=list)  # the budget ran out before these
    failed: list[tuple[PlannedProblem, str]] = field(default_factory=list)
    seconds: float = 0.0
    interrupted: bool = False  # Ctrl-C stopped the run: the last tuned problem holds the best so far


def parse_budget(text: str) -> float:
    """'10m', '90s', '1h30m' or plain seconds -> seconds."""
    text = str(text).strip().lower()
    if re.fullmatch(r"\d+(\.\d+)?", text):
        seconds = float(text)
    else:
        parts = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?", text)
        if not text or parts is None or not any(parts.groups()):
            raise BadInputError(f"--budget {text!r}: give a duration like 10m, 90s, 1h30m or seconds")
        h, m, s = (int(g) if g else 0 for g in parts.groups())
        seconds = float(3600 * h + 60 * m + s)
    if seconds <= 0:
        raise BadInputError("--budget must be positive")
    return seconds


def _group_key(family: Family, problem) -> tuple:
    """Problems that one winner serves once verified: every non-serving field equal, serving fields in one bucket."""
    data = problem_to_dict(problem)
    for name in family.serving_fields:
        data[name] = family.serving_bucket(name, data[name])
    for name in family.range_free_fields:
        data.pop(name, None)
    return family.name, tuple(sorted(data.items()))


def empty_shape_fields(family: Family, problem) -> list[str]:
    """`name=value` of each shape field of `problem` below 1: a call on empty tensors, which has nothing to time
    (and whose winner `autotile db import` refuses).

    >>> from autotile.families.elementwise import FAMILY, ElementwiseProblem
    >>> empty_shape_fields(FAMILY, ElementwiseProblem("add(1,x)", "x:fp32:tensor", "out:fp32", 0))
    ['numel=0']
    """
    data = problem_to_dict(problem)
    return [f"{name}={data[name]}" for name in family.shape_fields
            if isinstance(data.get(name), int) and data[name] < 1]


def plan_from_trace(entries: Sequence, families: Sequence[str] | None = None) -> tuple[list[PlannedProblem], list[str]]:
    """Planned problems (most calls first) and notes on entries that were left out, from trace entries."""
    notes: list[str] = []
    groups: dict[tuple, list[tuple[object, int]]] = {}
    family_of: dict[tuple, Family] = {}
    for entry in entries:
        if entry.family not in family_names():
            notes.append(f"unknown family {entry.family!r}: skipped")
            continue
        if families and entry.family not in families:
            continue
        family = get_family(entry.family)
        try:
            problem = family.problem_from_dict(entry.problem)
            empty = empty_shape_fields(family, problem)
            if not empty:  # each field of the type the family declares: a hand-edited m=5.0 is caught here
                problem = checked_problem(family, entry.problem)
        except Exception as exc:  # noqa: BLE001 - a problem from another version of the family
            notes.append(f"{entry.family} problem {entry.problem} does not rebuild ({exc}): skipped")
            continue
        if empty:
            notes.append(f"{entry.family} calls on empty tensors ({', '.join(empty)}): nothing to time, skipped")
            continue
        key = _group_key(family, problem)
        groups.setdefault(key, []).append((problem, entry.calls))
        family_of[key] = family
    planned = []
    for key, members in groups.items():
        members.sort(key=lambda pc: -pc[1])
        calls = sum(c for _, c in members)
        planned.append(PlannedProblem(family_of[key], members[0][0], calls, covers=len(members)))
    planned.sort(key=lambda p: -p.calls)
    return planned, notes


def parse_shard(text: str) -> tuple[int, int]:
    """'2/3' -> (2, 3): the second of three shards of a plan (see shard_of).

    >>> parse_shard("1/2")
    (1, 2)
    """
    parts = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", str(text))
    if parts is None or not 1 <= int(parts.group(1)) <= int(parts.group(2)):
        raise BadInputError(f"--shard {text!r}: give K/N with 1 <= K <= N, e.g. 1/2 for the first of two shards")
    return int(parts.group(1)), int(parts.group(2))


def shard_of(planned: Sequence[PlannedProblem], index: int, count: int) -> list[PlannedProblem]:
    """The index-th of `count` shards of a plan (1-based): every count-th problem from the index-th, so the shards
    together hold every problem once and each gets its share of the most called. One trace is tuned by several
    machines, or by several runs of one budget each (a device call that cannot hold the whole budget)."""
    return list(planned[index - 1::count])


@in_session
def tune_planned(planned: Sequence[PlannedProblem], device, *, budget_s: float | None, db_url: str | None,
                 trials: int = MAX_TRIALS, seed: int = 0, tune: Callable | None = None,
                 report: Callable[[str], None] = lambda line: None, **tune_kwargs) -> PlanOutcome:
    """Tune each planned problem in order, sharing what is left of the budget equally among those still to go.

    `tune(family, problem, device, trials=..., timeout=..., db_url=..., seed=..., **tune_kwargs)` defaults to
    autotile.tune.driver.tune_problem. The problems share one trial worker and compile-ahead pool per device
    (autotile.tune.session: the session open around the call, else one for the run). Ctrl-C stores the
    current problem's best so far and stops the run (`interrupted`).
    """
    if tune is None:
        from autotile.tune.driver import tune_problem as tune
    outcome = PlanOutcome()
    started = time.monotonic()
    overhead = 0.0  # seconds a problem took beyond its search (vendor check, re-timing, range verification)
    for index, item in enumerate(planned):
        timeout = None
        if budget_s is not None:
            left = budget_s - (time.monotonic() - started)
            # An equal share of what is left, but never less than a problem needs: a budget too small for
            # all of them tunes the first ones (the most called) and leaves the rest, rather than none.
            timeout = min(left, max(left / (len(planned) - index) - overhead, MIN_PROBLEM_S))
            if left < MIN_PROBLEM_S:
                outcome.skipped.extend(planned[index:])
                report(f"budget spent: {len(planned) - index} problem(s) not tuned")
                break
        label = f"[{index + 1}/{len(planned)}] {item.family.name} {item.family.problem_key(item.problem)}"
        # (calls counted by a trace; a model's table counts none)
        details = ([f"{item.calls} calls"] if item.calls else []) + ([f"{timeout:.0f} s"] if timeout is not None else [])
        report(label + (": " + ", ".join(details) if details else ""))
        begun = time.monotonic()
        try:
            result = tune(item.family, item.problem, device, trials=trials, timeout=timeout, db_url=db_url,
                          seed=seed, **tune_kwargs)
        except (KeyboardInterrupt, DatabaseError):
            raise  # a database that cannot be used fails every problem alike: said once, by the command
        except Exception as exc:  # noqa: BLE001 - one problem's failure does not stop the others
            outcome.failed.append((item, f"{type(exc).__name__}: {exc}"))
            report(f"{label}: failed: {exc}")
            continue
        took = time.monotonic() - begun
        if timeout is not None:
            overhead = max(overhead * 0.5, took - timeout) if took > timeout else overhead * 0.5
        outcome.tuned.append(result)
        if getattr(result, "interrupted", False):
            outcome.interrupted = True
            outcome.skipped.extend(planned[index + 1:])
            report(f"interrupted during problem {index + 1}: its best so far is stored and its search resumes on the "
                   f"next run; {len(planned) - index - 1} problem(s) after it not tuned")
            break
    outcome.seconds = time.monotonic() - started
    return outcome


def model_problems(family_name: str, models: Sequence, tokens: tuple[int, ...], dtype: str,
                   batch: int = 1, features: bool = True) -> list[PlannedProblem]:
    """Models' problems for `autotile tune FAMILY --model A,B`: gemm projections or flash prefill (`batch` sequences
    of each token count; with the models' soft-capping and windows unless `features` is False), each shape once
    (Mistral-7B runs Llama-3-8B's projections), fewest FLOPs first (decode steps are the calls a served model makes
    most often)."""
    from autotile.models import flash_problems, gemm_problems

    family = get_family(family_name)
    if family_name not in ("gemm", "flash"):
        raise BadInputError(f"--model applies to gemm and flash, not {family_name}")
    if batch < 1 or (batch != 1 and family_name != "flash"):
        raise BadInputError(f"--batch {batch}: flash prefill takes a batch of 1 or more sequences; gemm's tokens are "
                            "its M (give them with --tokens)")
    unique = {}
    for model in models:
        problems = gemm_problems(model, tokens, dtype) if family_name == "gemm" else flash_problems(
            model, tokens, dtype, batch=batch, features=features)
        for problem in problems:
            unique.setdefault(family.problem_key(problem), problem)
    problems = sorted(unique.values(), key=lambda p: family.cost(p).flops)
    return [PlannedProblem(family, p, 0) for p in problems]


__all__ = ["PlannedProblem", "PlanOutcome", "parse_budget", "parse_shard", "plan_from_trace", "shard_of",
           "tune_planned", "model_problems"]
