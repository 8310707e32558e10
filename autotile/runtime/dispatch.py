"""Problem -> config at run time: user database, then the shipped tuning_db/, exact problem then nearest, then default.

Nothing here benchmarks, migrates or imports Optuna/Alembic; every answer is
memoised, so the call path pays one dict lookup after the first call of a shape.
Configs read from a database are validated against the family's space before use.
"""
from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass

from autotile.device import DeviceInfo
from autotile.errors import AutotileError, ConfigOutsideSpaceError
from autotile.families.base import Family
from autotile.space import Config

log = logging.getLogger("autotile.runtime")


@dataclass(frozen=True)
class Resolution:
    config: Config
    source: str  # 'user-db' | 'shipped-db' | 'default'
    device_key: str
    problem_key: str
    tuned_for: str | None = None  # the problem key whose winner serves this one (None for default)
    match: str = "default"  # 'exact' | 'bucket' | 'nearest' | 'default'


_memo: dict[tuple, Resolution] = {}
_memo_lock = threading.Lock()
_winner_cache: dict[tuple[str, str, str], list] = {}


_clear_hooks: list = []


def on_clear(hook) -> None:
    """Register a function that `clear_cache` calls too: op modules that memoise what resolve() gave them."""
    _clear_hooks.append(hook)


def clear_cache() -> None:
    """Forget memoised resolutions and database reads (after tuning in the same process, or in tests)."""
    with _memo_lock:
        _memo.clear()
        _winner_cache.clear()
    for hook in _clear_hooks:
        hook()


def _sources() -> list[tuple[str, str]]:
    from autotile.resources import shipped_db_path
    from autotile.store.db import default_db_url, read_only_url, sqlite_path

    sources = []
    user = default_db_url()
    path = sqlite_path(user)
    if path is None or path.exists():
        sources.append(("user-db", user))
    shipped = shipped_db_path()
    if shipped.exists():
        sources.append(("shipped-db", read_only_url(shipped)))
    return sources


def _winners(url: str, family: str, device_key: str) -> list:
    key = (url, family, device_key)
    if key not in _winner_cache:
        from autotile.store.db import open_engine
        from autotile.store.repo import Store

        try:
            _winner_cache[key] = Store(open_engine(url, create=False)).winners(family, device_key)
        except AutotileError as exc:
            log.warning("autotile: not using %s: %s", url, exc)
            _winner_cache[key] = []
    return _winner_cache[key]


def _candidates(family: Family, problem, winners: list) -> list[tuple[str, object]]:
    """Stored winners that may serve `problem`, best first: exact, then same bucket, then nearest."""
    key = family.problem_key(problem)
    bucket = family.bucket(problem)
    exact = [("exact", w) for w in winners if w.problem_key == key]
    ranked = []
    for w in winners:
        if w.problem_key == key:
            continue
        try:
            other = family.problem_from_dict(w.params)
        except Exception:  # noqa: BLE001 - a row from another version of the family
            continue
        distance = family.distance(problem, other)
        if distance is None:
            continue
        ranked.append((0 if w.bucket == bucket else 1, distance, "bucket" if w.bucket == bucket else "nearest", w))
    ranked.sort(key=lambda r: (r[0], r[1]))
    return exact + [(match, w) for _, _, match, w in ranked]


def resolve(family: Family, problem, device: DeviceInfo) -> Resolution:
    """The config to run `problem` with on `device`, and where it came from."""
    # Problems are frozen dataclasses: hashing one is far cheaper than building its canonical key,
    # and this lookup is on every call of a tuned op.
    memo_key = (family.name, problem, device.key, os.environ.get("AUTOTILE_DB"))
    hit = _memo.get(memo_key)
    if hit is not None:
        return hit
    resolution = _resolve_uncached(family, problem, device)
    with _memo_lock:
        _memo[memo_key] = resolution
    return resolution


def _resolve_uncached(family: Family, problem, device: DeviceInfo) -> Resolution:
    space = family.space(problem, device)
    key = family.problem_key(problem)
    for source, url in _sources():
        for match, winner in _candidates(family, problem, _winners(url, family.name, device.key)):
            try:
                config = space.validate(Config.from_json(winner.config))
            except ConfigOutsideSpaceError as exc:
                if match == "exact":
                    log.warning("autotile: stored winner for %s in %s is outside the space (%s); ignoring it", key, source, exc)
                continue
            return Resolution(config, source, device.key, key, winner.problem_key, match)
    return Resolution(family.default_config(problem, device), "default", device.key, key)
