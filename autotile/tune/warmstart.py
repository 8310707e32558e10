"""Warm starts: a new problem's search begins with what won on its nearest tuned neighbours.

The store holds every trial of every problem. For a new problem, the tuned
problems of the same family and device key whose other fields match (dtypes,
layouts, epilogue) are ranked by the family's shape distance (the sum of
|log2| ratios of the shape fields: M=32 is 1 from M=16 and M=64). The
winner and the best few configs of each of the nearest ones are enqueued
into the study, after the family's default config and before its seed
configs and TPE's own proposals. On request (`shipped=True`) the winners of
the shipped tuning_db/ are neighbours as well (they have no trials there, so
only each one's winner counts).

Only configs on the new space's grid are kept (every axis present with one of
its values); one that breaks a constraint of the new problem (a 64-row tile
for M=32) is still enqueued: the search replaces it by the feasible config
sharing the most values with it, as it does for any infeasible proposal, so
the neighbour's choice of the other axes carries over.

When no neighbour has the same layout, neighbours that differ only in layout
fields (`LAYOUT_FIELDS`) are used instead: tile shapes carry over between
layouts better than nothing does.

>>> from autotile.families.gemm import FAMILY, contiguous_problem
>>> new = contiguous_problem(32, 4096, 4096)
>>> tuned = [(contiguous_problem(4096, 4096, 4096), []), (contiguous_problem(16, 4096, 4096), []),
...          (contiguous_problem(64, 4096, 4096, layout_b="col"), [])]
>>> [(n.problem.m, n.distance, n.tier) for n in rank_neighbours(FAMILY, new, tuned)]
[(16, 1.0, 0), (4096, 7.0, 0)]
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from autotile.device import DeviceInfo
from autotile.families.base import Family, is_vendor, log2_distance, problem_to_dict
from autotile.space import Config, Space

# Neighbours whose configs are enqueued, nearest first.
DEFAULT_NEIGHBOURS = 3
# Configs taken from each neighbour: its winner, then its best trials.
DEFAULT_PER_NEIGHBOUR = 3
# At most this many warm-start configs are enqueued in all.
DEFAULT_WARM_CONFIGS = 8
# Neighbours farther than this (sum of |log2| ratios of the shape fields) are not used: M=1 and M=8192 of one
# weight are 13 apart and want different tiles altogether.
MAX_DISTANCE = 8.0
# Fields that may differ in the second tier of neighbours (used only when no neighbour shares them).
LAYOUT_FIELDS = ("layout_a", "layout_b", "layout", "aligned")


@dataclass(frozen=True)
class Neighbour:
    problem: object
    distance: float
    tier: int  # 0: every non-shape field matches; 1: only layout fields differ
    configs: tuple[Config, ...] | object  # best first (what the caller paired the problem with)


@dataclass(frozen=True)
class WarmStart:
    configs: tuple[Config, ...]  # to enqueue, in order; each on the new space's grid
    neighbours: tuple[Neighbour, ...]
    off_grid: int = 0  # neighbour configs dropped: an axis or value the new space does not have

    def describe(self, family: Family) -> str:
        if not self.neighbours:
            return "no tuned neighbour"
        names = "; ".join(f"{_shape_text(family, n.problem)} (distance {n.distance:.2g}"
                          + (", other layout" if n.tier else "") + ")" for n in self.neighbours)
        return f"{len(self.configs)} configs from {names}"


def _shape_text(family: Family, problem) -> str:
    data = problem_to_dict(problem)
    return "x".join(str(data[f]) for f in family.shape_fields)


def neighbour_distance(family: Family, problem, other) -> tuple[int, float] | None:
    """(tier, distance) of a tuned problem from `problem`, or None when it is no neighbour at all."""
    distance = family.distance(problem, other)
    if distance is not None:
        return 0, distance
    a, b = problem_to_dict(problem), problem_to_dict(other)
    if a.keys() != b.keys():
        return None
    differing = [k for k in a if k not in family.shape_fields and a[k] != b[k]]
    if not differing or any(k not in LAYOUT_FIELDS for k in differing):
        return None
    return 1, sum(log2_distance(a[k], b[k]) for k in family.shape_fields)


def rank_neighbours(family: Family, problem, tuned: Iterable[tuple[object, object]],
                    max_neighbours: int = DEFAULT_NEIGHBOURS, max_distance: float = MAX_DISTANCE) -> list[Neighbour]:
    """The nearest tuned problems, best tier first; the problem itself excluded.

    `tuned` pairs each problem with its configs (best first), which land in `Neighbour.configs` as given.
    """
    key = family.problem_key(problem)
    ranked = []
    for other, configs in tuned:
        if family.problem_key(other) == key:
            continue
        where = neighbour_distance(family, problem, other)
        if where is None or where[1] > max_distance:
            continue
        ranked.append(Neighbour(other, where[1], where[0], configs))
    if any(n.tier == 0 for n in ranked):
        ranked = [n for n in ranked if n.tier == 0]
    ranked.sort(key=lambda n: (n.tier, n.distance, family.problem_key(n.problem)))
    return ranked[:max_neighbours]


def on_grid(space: Space, config) -> Config | None:
    """`config` as a point of `space`'s grid (constraints aside), or None when it has other axes or values.

    A feasible config comes back as the space validates it (a space may fill in axes added since the config was
    stored); an infeasible one only when it names exactly the space's axes, each with one of its values.
    """
    problems = space.violations(config)
    if not problems:
        return space.validate(config)
    constraint_names = tuple(c.name + ":" for c in space.constraints)
    if set(config) != set(space.names()) or not all(p.startswith(constraint_names) for p in problems):
        return None
    return Config(config)


def warm_configs(space: Space, neighbours: Sequence[Neighbour], per_neighbour: int = DEFAULT_PER_NEIGHBOUR,
                 limit: int = DEFAULT_WARM_CONFIGS, exclude: Iterable[Config] = ()) -> WarmStart:
    """The configs to enqueue from `neighbours`: each neighbour's best first, round-robin, on the grid, distinct."""
    seen = {Config(c).hash for c in exclude}
    chosen: list[Config] = []
    off_grid = 0
    lists = [[c for c in n.configs if not is_vendor(c)][:per_neighbour] for n in neighbours]
    for rank in range(per_neighbour):
        for configs in lists:
            if rank >= len(configs) or len(chosen) >= limit:
                continue
            config = on_grid(space, configs[rank])
            if config is None:
                off_grid += 1
                continue
            if config.hash not in seen:
                seen.add(config.hash)
                chosen.append(config)
    return WarmStart(tuple(chosen), tuple(neighbours), off_grid)


def tuned_problems(engine, family: Family, device_key: str) -> list[tuple[object, int]]:
    """Every problem of `family` with ok trials or a winner on `device_key`: (problem, its row id)."""
    from autotile.store.models import Device, Problem, Trial, Winner

    with Session(engine) as session:
        tried = session.execute(
            select(Problem.id).join(Trial, Trial.problem_id == Problem.id).join(Device, Trial.device_id == Device.id)
            .where(Problem.family == family.name, Device.key == device_key, Trial.status == "ok").distinct()
        ).scalars().all()
        won = session.execute(select(Winner.problem_id).where(Winner.device_key == device_key)).scalars().all()
        rows = session.execute(select(Problem.id, Problem.params).where(
            Problem.family == family.name, Problem.id.in_(set(tried) | set(won)))).all()
    out = []
    for pid, params in rows:
        try:
            out.append((family.problem_from_dict(params), pid))
        except Exception:  # noqa: BLE001 - a problem of another autotile version: not a neighbour
            continue
    return out


def best_configs(engine, problem_id: int, device_key: str, per_problem: int = DEFAULT_PER_NEIGHBOUR) -> list[Config]:
    """A tuned problem's configs, best first: its winner's (the best kernel's when the vendor op won), then its
    best distinct ok trials on `device_key`."""
    from autotile.store.models import Winner
    from autotile.store.repo import Store

    with Session(engine) as session:
        winner = session.execute(select(Winner.config, Winner.kernel_config).where(
            Winner.problem_id == problem_id, Winner.device_key == device_key)).first()
    texts = [t for t in (winner or ()) if t]
    texts += [text for text, _ in Store(engine).best_configs_on_key(problem_id, device_key, per_problem)]
    return list(dict.fromkeys(Config.from_json(text) for text in texts))


def shipped_engine():
    """The shipped tuning_db/ opened read-only, or None where it is absent (a trimmed install)."""
    from autotile.resources import shipped_db_path
    from autotile.store.db import open_engine, read_only_url

    path = shipped_db_path()
    return open_engine(read_only_url(path), create=False) if path.exists() else None


def warm_start(engine, family: Family, problem, device: DeviceInfo, space: Space | None = None, *,
               neighbours: int = DEFAULT_NEIGHBOURS, per_neighbour: int = DEFAULT_PER_NEIGHBOUR,
               limit: int = DEFAULT_WARM_CONFIGS, exclude: Iterable[Config] = (), shipped: bool = False) -> WarmStart:
    """The warm-start configs of `problem` from the database on `engine` (see the module's docstring).

    With `shipped`, the winners of the shipped tuning_db/ count as tuned neighbours too, so a user's first
    problem on a device the shipped tables cover starts from them; a problem tuned in both is read from
    `engine` (the user's own trials). Off by default: replayed on the H200 flash table of issue 15 (GQA 32/8),
    the shipped winners of the MHA shapes (128 x 128 tiles, 8 warps) steered TPE away from the table's best
    (64 x 32 tiles, 4 warps): 74 evaluations to 98% of the best against 11 without them
    (benchmarks/results/search_efficiency_2026-12-01b_shipped.md).

    >>> import tempfile
    >>> from autotile.device import interpret_device
    >>> from autotile.families.gemm import FAMILY, contiguous_problem
    >>> from autotile.store.db import open_engine
    >>> engine = open_engine(f"sqlite:///{tempfile.mkdtemp()}/tuning.sqlite")
    >>> warm_start(engine, FAMILY, contiguous_problem(32, 64, 64), interpret_device()).configs  # nothing tuned yet
    ()
    """
    space = space if space is not None else family.space(problem, device)
    engines = [engine]
    extra = shipped_engine() if shipped else None
    if extra is not None and str(extra.url) != str(engine.url):
        engines.append(extra)
    tuned, keys = [], set()
    for source in engines:
        for other, row_id in tuned_problems(source, family, device.key):
            key = family.problem_key(other)
            if key not in keys:  # the user's database first
                keys.add(key)
                tuned.append((other, (source, row_id)))
    ranked = rank_neighbours(family, problem, tuned, max_neighbours=neighbours)
    # Ranked on row ids (cheap); configs are read for the chosen few only.
    ranked = [dataclasses.replace(n, configs=tuple(best_configs(n.configs[0], n.configs[1], device.key,
                                                                per_neighbour)))
              for n in ranked]
    return warm_configs(space, ranked, per_neighbour=per_neighbour, limit=limit, exclude=exclude)
