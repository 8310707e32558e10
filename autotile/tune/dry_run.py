"""A tune planned without running it (`autotile tune FAMILY ... --gpu a100 --dry-run`), on any machine.

For each problem: the device the space is built for (the GPU at hand, or a profile's limits when that GPU is
not present), its architecture, the size of the space, how many configs each named constraint removed, and
the configs the search would try first, in its order: the default, the warm start (read from the
database, never written), the seeds. The vendor configs the tuner would time beside them are listed too.
Nothing is compiled, timed or stored.

>>> from autotile.device import planned_device
>>> from autotile.families.flash import FAMILY, FlashProblem
>>> plan = plan_tune(FAMILY, FlashProblem("fwd", 1, 8, 8, 1024, 1024, 128), planned_device("a100"), db_url=None)
>>> plan.removed["needs_tma"] > 0, plan.first[0][0]
(True, 'default')
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence

from autotile.arch import Arch, arch_of
from autotile.device import DeviceInfo
from autotile.families.base import Family
from autotile.space import Config, Space

# Configs of each kind printed (the search tries every one of them, in this order).
SHOWN = {"default": 1, "warm start": 8, "seed": 12}


@dataclasses.dataclass
class TunePlan:
    family: str
    problem_key: str
    device: DeviceInfo
    arch: Arch
    grid: int  # configs of the axes' full product
    feasible: int
    removed: dict[str, int]  # constraint name -> grid configs it is the first to rule out
    first: list[tuple[str, Config]]  # (role, config) in the order the search enqueues them
    vendor: list[Config]
    warm_note: str = ""


def removed_by(space: Space) -> tuple[int, int, dict[str, int]]:
    """(grid size, feasible count, {constraint: configs it rules out first}); the removals add up to
    grid - feasible. A space that prunes while binding its axes (gemm's StagedSpace) says so itself
    (`pruned_by`); any other space is enumerated, constraints checked in their order."""
    grid = math.prod(len(a.choices) for a in space.axes)
    if hasattr(space, "pruned_by"):
        removed = space.pruned_by()
        return grid, grid - sum(removed.values()), removed
    removed = {c.name: 0 for c in space.constraints}
    feasible = 0
    names = space.names()
    for values in itertools.product(*(a.choices for a in space.axes)):
        config = dict(zip(names, values))
        broken = next((c.name for c in space.constraints if not c.holds(config)), None)
        if broken is None:
            feasible += 1
        else:
            removed[broken] += 1
    return grid, feasible, removed


def _warm_configs(family: Family, problem, device: DeviceInfo, space: Space, db_url: str | None
                  ) -> tuple[list[Config], str]:
    """The warm-start configs from the database opened read-only (nothing is created or written there)."""
    from autotile.store.db import default_db_url, normalise_url, open_engine
    from autotile.tune.warmstart import warm_start

    url = normalise_url(db_url) if db_url else default_db_url()
    try:
        engine = open_engine(url, create=False, read_only=True)
        warm = warm_start(engine, family, problem, device, space)
    except Exception as exc:  # noqa: BLE001 - a missing or unreadable database means no warm start, nothing more
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return [], f"no warm start: the database cannot be read ({first})"
    if not warm.configs:
        return [], f"no warm start: nothing near this problem is tuned on {device.key} in {url}"
    return list(warm.configs), f"warm start: {warm.describe(family)}"


def plan_tune(family: Family, problem, device: DeviceInfo, db_url: str | None = None, warm_start: bool = True
              ) -> TunePlan:
    """What `tune_problem(family, problem, device)` would search and try first, worked out without running it.

    Raises UnsupportedOnDevice (autotile.arch) for a problem the device cannot run at all.
    """
    space = family.space(problem, device)
    grid, feasible, removed = removed_by(space)
    default = family.default_config(problem, device)
    first: list[tuple[str, Config]] = [("default", default)]
    note = "no warm start (turned off)"
    if warm_start:
        warm, note = _warm_configs(family, problem, device, space, db_url)
        first += [("warm start", c) for c in warm]
    first += [("seed", c) for c in family.seed_configs(problem, device)]
    seen: set[Config] = set()
    unique = []
    for role, config in first:  # the study skips a config already enqueued
        if config not in seen:
            seen.add(config)
            unique.append((role, config))
    return TunePlan(family.name, family.problem_key(problem), device, arch_of(device), grid, feasible, removed,
                    unique, family.vendor_configs(problem, device), note)


def format_plan(plan: TunePlan, shown: dict[str, int] | None = None) -> str:
    """The plan as the CLI prints it."""
    from autotile.families.base import vendor_label

    shown = SHOWN if shown is None else shown
    device = plan.device
    where = "Triton's CPU interpreter (Hopper's space)" if device.interpret else (
        f"{device.name}: {device.sm_count} SMs, {device.smem_per_block} B shared memory a block")
    lines = [f"{plan.family} {plan.problem_key}",
             f"  device {device.key} -- {where}; {plan.arch.describe()}",
             f"  space: {plan.grid} configs on the axes' grid, {plan.feasible} feasible"]
    removed = [(name, n) for name, n in plan.removed.items()]
    if removed:
        width = max(len(name) for name, _ in removed)
        lines.append("  pruned by (the first constraint each config breaks):")
        lines += [f"    {name:<{width}}  {n:>9}" for name, n in sorted(removed, key=lambda item: -item[1])]
    lines.append(f"  {plan.warm_note}")
    lines.append(f"  first configs the search tries ({len(plan.first)} in all):")
    for role, limit in shown.items():
        configs = [c for r, c in plan.first if r == role]
        for config in configs[:limit]:
            lines.append(f"    {role:<10}  {config.to_json()}")
        if len(configs) > limit:
            lines.append(f"    {role:<10}  ... and {len(configs) - limit} more")
    vendor = ", ".join(vendor_label(c) for c in plan.vendor) or "none"
    if device.planned:
        # NOTE: SDPA's backends are asked about on the GPU itself (torch.backends.cuda); without it only those
        # this machine can vouch for are listed.
        vendor += " (as far as this machine can tell: the GPU itself decides which vendor calls it takes)"
    lines.append(f"  timed beside them: {vendor}")
    return "\n".join(lines)


def dry_run(family: Family, problems: Sequence, device: DeviceInfo, db_url: str | None = None
            ) -> list[tuple[str, bool]]:
    """(printed plan, runnable) of each problem; a problem the device cannot run says why in its place."""
    from autotile.arch import UnsupportedOnDevice

    out = []
    for problem in problems:
        try:
            out.append((format_plan(plan_tune(family, problem, device, db_url)), True))
        except UnsupportedOnDevice as exc:
            out.append((f"{family.name} {family.problem_key(problem)}\n  cannot run on {device.key}: {exc}", False))
    return out
