"""Problem -> config at run time.

Order, for families with a vendor op (gemm: cuBLAS, flash: SDPA) on a GPU:
1. the user database, then the shipped tuning_db/: the exact problem's winner, then a winner whose
   verified range holds the call (re-timed beside the vendor op at its bucket's edges when it was
   stored, so it does not lose there);
2. a tuned policy whose verified range holds the call (the family's default config beat the vendor op on
   every shape it was re-timed on across that range: autotile.tune.policy);
3. the vendor op itself: a shape nobody tuned gets what PyTorch gives for free, never a guess;
   a generated winner whose own record does not beat the vendor op by VENDOR_TIE_MARGIN is passed
   over for it too (a tie within timing noise goes to the vendor);
4. the family's default config (no vendor op for this problem, e.g. under the interpreter).
Families without a vendor op (paged, elementwise), and problems the vendor cannot compute, also take
a winner of the same bucket, then the nearest tuned problem, before the default.
A winner may be the vendor op itself ({"VENDOR": ...}). `AUTOTILE_VENDOR=0` serves generated kernels
only: a vendor winner is replaced by the fastest generated kernel stored with it, else the next source.

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
from autotile.errors import AutotileError
from autotile.families.base import Family, is_vendor, vendor_enabled
from autotile.space import Config
from autotile.store.marks import UNSERVABLE_VERIFY_STATUSES
from autotile.switches import switch

log = logging.getLogger("autotile.runtime")

# A generated winner serves over the vendor op only where its own record (the tuner's interleaved re-timing,
# winner beside the vendor) beats the vendor by this much. Within it the two are a tie, and a tie goes to
# the vendor: on the H200 such winners measured 0.94-1.02x of cuBLAS from one process to the next
# (benchmarks/results/serve_2026-12-01_second.md), while the vendor op is what PyTorch gives for free.
VENDOR_TIE_MARGIN = 0.02


@dataclass(frozen=True)
class Resolution:
    config: Config
    source: str  # 'user-db' | 'shipped-db' | 'vendor' | 'default'
    device_key: str
    problem_key: str
    tuned_for: str | None = None  # the problem key whose winner serves this one (None for vendor and default)
    # 'exact' | 'range' | 'bucket' | 'nearest' | 'policy' | 'vendor' | 'default'; 'fallback': the next choice after a
    # config that failed to build or launch here (autotile.runtime.fallback)
    match: str = "default"

    @property
    def vendor(self) -> bool:
        """True when the call runs the vendor library (cuBLAS, SDPA) rather than a generated kernel."""
        return is_vendor(self.config)


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
    elif (os.environ.get("AUTOTILE_DB") or "").strip() and f"missing:{path}" not in _warned:
        # The default file not there yet is a fresh install; one named by AUTOTILE_DB is a mistake to say.
        _warned.add(f"missing:{path}")
        log.warning("autotile: AUTOTILE_DB names %s, which does not exist: no user database serves this process "
                    "(shipped winners and the vendor op do). Fix the path, or tune into it first (autotile tune ... "
                    "--db %s)", path, path)
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
            winners = Store(open_engine(url, create=False, read_only=True)).winners(family, device_key)
        except Exception as exc:  # noqa: BLE001 - a cache problem never takes a model down: serve from the next source
            _warn_once(url, exc)
            winners = []
        # A winner `autotile db verify` found failing here (a wrong result, a crash, no longer a config) is never
        # served; one it found slower than stored still computes right, and serves until it is tuned again.
        _winner_cache[key] = [w for w in winners if w.verify_status not in UNSERVABLE_VERIFY_STATUSES]
    return _winner_cache[key]




_warned: set[str] = set()


def _warn_once(url: str, exc: BaseException) -> None:
    """One warning per database and process, naming the file and what to do; the runtime goes on without it."""
    if url in _warned:
        return
    _warned.add(url)
    from autotile.store.db import database_failure, safe_url

    shown = safe_url(url)  # never a password in a log
    reason = str(exc) if isinstance(exc, AutotileError) else database_failure(exc, url) or f"{type(exc).__name__}: {exc}"
    if "db upgrade" in reason:
        fix = f"run `autotile db upgrade --db {shown}` (it keeps a copy of the file first)"
    elif "newer than this autotile" in reason:
        fix = "upgrade autotile (pip install -U autotile), or point AUTOTILE_DB at another file"
    elif url.rstrip("/") in ("sqlite:", "sqlite://") or url.endswith(":memory:"):
        fix = "an in-memory database holds no winners: point AUTOTILE_DB at a file, or unset it"
    elif any(part in reason for part in ("not a SQLite database", "damaged", "not an autotile database",
                                          "holds no autotile tables", "not a readable database")):
        fix = "move the file away (or unset AUTOTILE_DB); the next tune starts a new one"
    elif "is a folder" in reason:
        fix = "point AUTOTILE_DB at a database file (e.g. <folder>/tuning.sqlite), or unset it"
    elif url.startswith("sqlite:") or "://" not in url:
        fix = f"run `autotile db verify --db {shown}`, or move the file away (or unset AUTOTILE_DB) to start a new one"
    else:
        fix = ("check AUTOTILE_DB: a SQLite file, or a SQLAlchemy URL of a reachable server whose driver is "
               "installed (or unset it)")
    log.warning("autotile: not using the tuning database %s (%s); serving from the next source. Fix: %s.",
                shown, reason.splitlines()[0][:300] if reason else "unreadable", fix)


def _candidates(family: Family, problem, winners: list, strict: bool) -> list[tuple[str, object]]:
    """Stored winners that may serve `problem`, best first: exact, then those whose verified range holds it.

    Unless `strict` (a vendor op stands behind them), also a winner of the same bucket, then the nearest.
    """
    key = family.problem_key(problem)
    exact = [("exact", w) for w in winners if w.problem_key == key]
    ranked = []
    bucket = None if strict else family.bucket(problem)
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
        if family.in_range(problem, other, w.verified_range):
            ranked.append((0, distance, "range", w))
        elif not strict:
            same_bucket = w.bucket == bucket
            ranked.append((1 if same_bucket else 2, distance, "bucket" if same_bucket else "nearest", w))
    ranked.sort(key=lambda r: (r[0], r[1]))
    return exact + [(match, w) for _, _, match, w in ranked]


def resolve(family: Family, problem, device: DeviceInfo) -> Resolution:
    """The config to run `problem` with on `device`, and where it came from."""
    # Problems are frozen dataclasses: hashing one is far cheaper than building its canonical key,
    # and this lookup is on every call of a tuned op.
    memo_key = (family.name, problem, device.key, os.environ.get("AUTOTILE_DB"), os.environ.get("AUTOTILE_VENDOR"))
    hit = _memo.get(memo_key)
    if hit is not None:
        return hit
    resolution = _resolve_uncached(family, problem, device)
    with _memo_lock:
        _memo[memo_key] = resolution
    log_resolution(family, problem, resolution)
    return resolution


def _served_config(winner, use_vendor: bool) -> str | None:
    """The config JSON a stored winner serves: its own, or with the vendor off, the generated kernel kept with it."""
    if not use_vendor and is_vendor(Config.from_json(winner.config)):
        return winner.kernel_config
    return winner.config


def _ties_the_vendor(winner) -> bool:
    """Whether a generated winner's record shows it no faster than the vendor op beyond VENDOR_TIE_MARGIN."""
    base, ms = winner.baseline_ms, winner.median_ms
    if not base or not ms or base <= 0 or ms <= 0 or is_vendor(Config.from_json(winner.config)):
        return False
    return base < ms * (1.0 + VENDOR_TIE_MARGIN)


def _policies(url: str, family: str, device_key: str) -> list:
    key = ("policies", url, family, device_key)
    if key not in _winner_cache:
        from autotile.store.db import open_engine
        from autotile.store.repo import Store

        try:
            _winner_cache[key] = Store(open_engine(url, create=False, read_only=True)).policies(family, device_key)
        except Exception as exc:  # noqa: BLE001 - as for winners: the next source serves
            _warn_once(url, exc)
            _winner_cache[key] = []
    return _winner_cache[key]


def _policy_config(family: Family, problem, device: DeviceInfo, policy) -> Config | None:
    """The config a tuned policy gives `problem`, or None when the call is outside what the policy was verified on."""
    try:
        bounds = policy.verified_range
        tuned = family.problem_from_dict({**policy.params, **{name: lo for name, (lo, _) in bounds.items()}})
        if not family.in_range(problem, tuned, bounds):
            return None
        return family.validate_config(problem, device, Config.from_json(policy.config))
    except Exception:  # noqa: BLE001 - a policy row this version cannot read never serves
        return None


def _resolve_uncached(family: Family, problem, device: DeviceInfo) -> Resolution:
    key = family.problem_key(problem)
    use_vendor = vendor_enabled()
    vendor = family.vendor_configs(problem, device)
    sources = _sources()
    for source, url in sources:
        for match, winner in _candidates(family, problem, _winners(url, family.name, device.key), strict=bool(vendor)):
            try:
                text = _served_config(winner, use_vendor)
                if text is None or (vendor and use_vendor and _ties_the_vendor(winner)):
                    continue
                config = family.validate_config(problem, device, Config.from_json(text))
            except Exception as exc:  # noqa: BLE001 - a stored config this version cannot run is skipped
                if match == "exact":
                    log.warning("autotile: stored winner for %s in %s cannot serve it (%s); ignoring it", key, source, exc)
                continue
            return Resolution(config, source, device.key, key, winner.problem_key, match)
    if vendor and use_vendor:
        # A tuned policy: across the shapes it was verified on, the family's own choice beat the vendor op.
        for source, url in sources:
            for policy in _policies(url, family.name, device.key):
                config = _policy_config(family, problem, device, policy)
                if config is not None:
                    return Resolution(config, source, device.key, key, None, "policy")
    if vendor and use_vendor:
        return Resolution(vendor[0], "vendor", device.key, key, None, "vendor")
    return Resolution(family.default_config(problem, device), "default", device.key, key)


def log_resolution(family: Family, problem, resolution: Resolution) -> None:
    """`AUTOTILE_LOG=1`: one line per new shape, naming what serves it (as TRITON_PRINT_AUTOTUNING does)."""
    if switch("AUTOTILE_LOG", False, "prints one line per new shape, naming what serves it"):
        import sys

        tuned = f" (tuned for {resolution.tuned_for})" if resolution.tuned_for and resolution.match != "exact" else ""
        print(f"autotile: {family.name} {resolution.problem_key} -> {resolution.config.to_json()} "
              f"[{resolution.source}, {resolution.match}{tuned}]", file=sys.stderr)
