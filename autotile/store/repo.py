"""Reads and writes of autotile's tables, each in its own short transaction.

Short transactions let several tuners write one SQLite file (WAL) and leave
no half-written row behind when a process is killed.
"""
from __future__ import annotations

import json
import logging
import threading
import urllib.parse
from dataclasses import dataclass

from sqlalchemy import Engine, func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from autotile.device import DeviceInfo
from autotile.store.fingerprint import device_fingerprint, toolchain_versions
from autotile.store.models import DamagedJSON, Device, Policy, Problem, Toolchain, Trial, Winner

log = logging.getLogger("autotile.store")


@dataclass(frozen=True)
class WinnerView:
    family: str
    problem_key: str
    bucket: str
    params: dict
    device_key: str
    config: str
    config_hash: str
    median_ms: float
    q20_ms: float
    q80_ms: float
    interpreted: bool
    margin: float | None
    baseline_name: str
    baseline_ms: float | None
    trials_run: int
    provenance: str
    toolchain: dict
    created_at: str
    driver: str = ""  # the GPU driver of the device row the winner was measured on
    stale: bool = False  # tuned with another torch/triton/CUDA/driver than the last staleness check saw
    verify_status: str = ""  # '' (never verified) or an autotile.store.verify.VerifyStatus value
    verified_ms: float | None = None
    regression: float | None = None  # verified_ms / median_ms - 1 when the last verification found it slower
    verified_at: str | None = None
    verified_range: dict | None = None  # {serving field: [lo, hi]}: calls in it may be served by this winner
    kernel_config: str | None = None  # the fastest generated kernel when the vendor op won
    kernel_ms: float | None = None


@dataclass(frozen=True)
class PolicyView:
    family: str
    device_key: str
    params: dict  # the problem fields the policy holds fixed
    verified_range: dict  # {shape field: [lo, hi]}
    config: str
    samples: int
    min_ratio: float
    geomean_ratio: float
    provenance: str
    toolchain: dict
    created_at: str


def range_fault(value) -> str | None:
    """Why a stored verified range cannot be read as {field: [lo, hi]} with 1 <= lo <= hi; None when it can (or
    when there is none).

    >>> range_fault({"m": [1, 16]}), range_fault(None), range_fault({"m": [16, 1]})
    (None, None, 'm: [16, 1] is not [lo, hi] with 1 <= lo <= hi')
    """
    if value is None:
        return None
    if isinstance(value, DamagedJSON):
        return f"not JSON: {value.text[:60]!r}"
    if not isinstance(value, dict) or not value:
        return f"not a map of field to [lo, hi]: {json.dumps(value)[:80]}"
    for name, bounds in value.items():
        whole = isinstance(bounds, list) and len(bounds) == 2 and all(
            isinstance(x, int) and not isinstance(x, bool) for x in bounds)
        if not whole or not 1 <= bounds[0] <= bounds[1]:
            return f"{name}: {json.dumps(bounds)[:60]} is not [lo, hi] with 1 <= lo <= hi"
    return None


def winner_fault(winner) -> str | None:
    """Why a stored winner's row cannot be read; None when it can.

    >>> from types import SimpleNamespace as Row
    >>> winner_fault(Row(median_ms=1.5, q20_ms=1.0, q80_ms=2.0, config='{"BLOCK_M": 64}'))
    >>> winner_fault(Row(median_ms="abc", q20_ms=1.0, q80_ms=2.0, config="{}"))
    "median_ms is 'abc', not a number"
    """
    for name in ("median_ms", "q20_ms", "q80_ms"):
        value = getattr(winner, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"{name} is {value!r}, not a number"
    try:
        config = json.loads(winner.config)
    except (TypeError, ValueError):
        return f"its config is not JSON: {str(winner.config)[:60]!r}"
    if not isinstance(config, dict):
        return f"its config is not a JSON object: {str(winner.config)[:60]!r}"
    return None


def warn_damaged_row(where: str, what: str, fault: str,
                     consequence: str = "it is left out, and the other winners are read") -> None:
    """One warning per damaged winner row (or field) and process."""
    with _reported_lock:
        if (where, what, "row") in _reported_ranges:
            return
        _reported_ranges.add((where, what, "row"))
    log.warning("autotile: %s in %s is damaged (%s): %s. Fix: tune that shape again, or import it again from an "
                "export (`autotile db import --on-conflict replace`).", what, where, fault, consequence)


_reported_ranges: set[tuple] = set()
_reported_lock = threading.Lock()


def warn_damaged_range(where: str, what: str, fault: str, consequence: str) -> None:
    """One warning per damaged range and process: a model asks for its shapes on every new signature."""
    with _reported_lock:
        if (where, what) in _reported_ranges:
            return
        _reported_ranges.add((where, what))
    log.warning("autotile: the verified range stored with %s in %s is damaged (%s); %s", what, where, fault,
                consequence)


def _policy_identity(params: dict, verified_range: dict) -> tuple[str, str]:
    """(key, range_key) of a policy: the canonical JSON of its fixed fields and of its range."""
    canonical = lambda data: json.dumps(data, sort_keys=True, separators=(",", ":"))  # noqa: E731
    return canonical(params), canonical(verified_range)


# Store.save_winner's default: replace whatever winner is stored.
ANY_WINNER = object()


class Store:
    """autotile's tables on one engine."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def _get_or_create(self, model, lookup: dict, values: dict) -> int:
        with Session(self.engine) as session:
            row = session.execute(select(model.id).filter_by(**lookup)).scalar_one_or_none()
            if row is not None:
                return row
            session.add(model(**lookup, **values))
            try:
                session.commit()
            except IntegrityError:  # another tuner inserted it first
                session.rollback()
            return session.execute(select(model.id).filter_by(**lookup)).scalar_one()

    def ensure_device(self, device: DeviceInfo) -> int:
        digest, fields = device_fingerprint(device)
        return self._get_or_create(Device, {"fingerprint": digest}, fields)

    def ensure_toolchain(self) -> int:
        return self._get_or_create(Toolchain, toolchain_versions(), {})

    def ensure_problem(self, family, problem) -> int:
        import dataclasses

        return self._get_or_create(
            Problem, {"family": family.name, "key": family.problem_key(problem)},
            {"bucket": family.bucket(problem), "params": dataclasses.asdict(problem)},
        )

    def record_trial(self, **values) -> None:
        with Session(self.engine) as session:
            session.add(Trial(**values))
            try:
                session.commit()
            except IntegrityError:
                # The same (study, trial number) was recorded before a crash; keep the first record.
                session.rollback()
                kept = session.execute(select(Trial.config_hash).where(
                    Trial.study == values.get("study"), Trial.number == values.get("number"))).scalar_one_or_none()
                if kept is not None and kept != values.get("config_hash"):
                    log.warning("autotile: trial %s of study %s was recorded before with another config; this "
                                "one's outcome (%s) is not kept", values.get("number"), values.get("study"),
                                values.get("status"))

    def recorded_trial_numbers(self, study: str) -> set[int]:
        with Session(self.engine) as session:
            return set(session.execute(select(Trial.number).where(Trial.study == study)).scalars())

    def best_configs(self, problem_id: int, device_id: int | None, top_k: int,
                     study: str | None = None) -> list[tuple[str, float]]:
        """The top_k distinct ok configs by their best median on this exact device: (config JSON, ms).

        `study` keeps only that study's trials (the current template version's). A study is one device key's, of
        any driver: `device_id` None takes all of them (the device rows of a key differ by driver).
        """
        query = select(Trial.config, func.min(Trial.median_ms).label("best")).where(Trial.problem_id == problem_id,
                                                                                   Trial.status == "ok")
        if device_id is not None:
            query = query.where(Trial.device_id == device_id)
        if study is not None:
            query = query.where(Trial.study == study)
        with Session(self.engine) as session:
            rows = session.execute(query.group_by(Trial.config).order_by("best").limit(top_k)).all()
        return [(r[0], float(r[1])) for r in rows]

    def status_counts(self, study: str) -> dict[str, int]:
        """Trials of `study` by status (a search study's own: the vendor op's rows are another study's)."""
        with Session(self.engine) as session:
            rows = session.execute(
                select(Trial.status, func.count()).where(Trial.study == study).group_by(Trial.status)
            ).all()
        return {status: int(n) for status, n in rows}

    def winner_hash(self, problem_id: int, device_key: str) -> str | None:
        """The config hash of the winner stored for (problem, device key), or None."""
        with Session(self.engine) as session:
            return session.execute(select(Winner.config_hash).where(
                Winner.problem_id == problem_id, Winner.device_key == device_key)).scalar_one_or_none()

    def save_winner(self, *, problem_id: int, device: DeviceInfo, device_id: int, toolchain_id: int,
                    replaces: str | None | object = ANY_WINNER, **values) -> bool:
        """Insert or replace the winner of (problem, device key); True when written.

        `replaces`: the config hash of the winner the caller compared its own against (None: there was none). If
        another process stored a different winner since (two tunes of one problem at once), nothing is written
        and the result is False: the caller compares again, beside that winner. By default any row is replaced.
        A winner measured now is fresh: unless `values` say otherwise it is not stale and carries no
        earlier verification.
        """
        values = {"stale": 0, "verified_at": None, "verified_ms": None, "verify_status": "", "regression": None,
                  "verified_range": None, "kernel_config": None, "kernel_ms": None, **values}
        if replaces is not ANY_WINNER and replaces is not None:
            # One conditional UPDATE: atomic on every backend (SQLite takes no row lock for a SELECT ... FOR UPDATE).
            with Session(self.engine) as session:
                written = session.execute(
                    update(Winner).where(Winner.problem_id == problem_id, Winner.device_key == device.key,
                                         Winner.config_hash == replaces)
                    .values(device_id=device_id, toolchain_id=toolchain_id, **values)).rowcount
                session.commit()
            return written == 1
        for attempt in range(2):
            try:
                with Session(self.engine) as session:
                    row = session.execute(
                        select(Winner).where(Winner.problem_id == problem_id, Winner.device_key == device.key)
                    ).scalar_one_or_none()
                    if replaces is None and row is not None:
                        return False  # there was no winner to compare against; now there is one
                    if row is None:
                        row = Winner(problem_id=problem_id, device_key=device.key)
                        session.add(row)
                    row.device_id, row.toolchain_id = device_id, toolchain_id
                    for name, value in values.items():
                        setattr(row, name, value)
                    session.commit()
                return True
            except IntegrityError:
                # Another tuner of the same study stored this problem's winner between the read and the
                # insert: the second attempt finds that row and replaces it (or, compared against none, leaves it).
                if attempt:
                    raise

    def winners(self, family: str | None = None, device_key: str | None = None) -> list[WinnerView]:
        query = (select(Winner, Problem, Toolchain, Device.driver).join(Problem, Winner.problem_id == Problem.id)
                 .join(Toolchain, Winner.toolchain_id == Toolchain.id).join(Device, Winner.device_id == Device.id))
        if family:
            query = query.where(Problem.family == family)
        if device_key:
            query = query.where(Winner.device_key == device_key)
        with Session(self.engine) as session:
            rows = session.execute(query.order_by(Problem.family, Problem.key, Winner.device_key)).all()
        rows = [row for row in rows if self.readable(row[0], row[1])]
        return [
            WinnerView(
                family=p.family, problem_key=p.key, bucket=p.bucket, params=dict(p.params), device_key=w.device_key,
                config=w.config, config_hash=w.config_hash, median_ms=w.median_ms, q20_ms=w.q20_ms, q80_ms=w.q80_ms,
                interpreted=bool(w.interpreted), margin=w.margin, baseline_name=w.baseline_name,
                baseline_ms=w.baseline_ms, trials_run=w.trials_run, provenance=w.provenance,
                toolchain={"torch": t.torch, "triton": t.triton, "cuda": t.cuda, "python": t.python, "autotile": t.autotile},
                created_at=w.created_at.isoformat(timespec="seconds") if w.created_at else "", driver=driver,
                stale=bool(w.stale),
                verify_status=w.verify_status or "", verified_ms=w.verified_ms, regression=w.regression,
                verified_at=w.verified_at.isoformat(timespec="seconds") if w.verified_at else None,
                verified_range=self._usable_range(w.verified_range, p, w.device_key),
                kernel_config=w.kernel_config, kernel_ms=w.kernel_ms,
            )
            for w, p, t, driver in rows
        ]

    def readable(self, winner: Winner, problem: Problem) -> bool:
        """Whether a stored winner's row can be read (its timings numbers, its config a JSON object); a damaged one
        is left out, said once, so that the other rows still list, report and serve."""
        fault = winner_fault(winner)
        if fault is None:
            return True
        warn_damaged_row(self.location(), f"the {problem.family} winner for {problem.key} on {winner.device_key}",
                         fault)
        return False

    def _usable_range(self, value, problem: Problem, device_key: str) -> dict | None:
        """A winner's verified range, or None (said once) when it is damaged: the winner still serves its own shape."""
        fault = range_fault(value)
        if fault is None:
            return value
        warn_damaged_range(self.location(), f"the {problem.family} winner for {problem.key} on {device_key}", fault,
                           "it is ignored, so that winner serves its own shape only. Fix: tune that shape again, or "
                           "import it again from an export (`autotile db import`).")
        return None

    def location(self) -> str:
        """The database for a message: a SQLite file's path, else its URL without the password."""
        url = self.engine.url
        if url.get_backend_name() == "sqlite" and url.database:
            # A read-only file is opened as a `file:` URI whose path is quoted once more (store.db.read_only_url).
            return urllib.parse.unquote(url.database[5:]) if url.database.startswith("file:") else url.database
        return url.render_as_string(hide_password=True)

    def winner_rows(self, family: str | None = None, device_key: str | None = None) -> list[tuple]:
        """(Winner, Problem, Device, Toolchain) rows, detached, for tools that rewrite winners."""
        query = (select(Winner, Problem, Device, Toolchain).join(Problem, Winner.problem_id == Problem.id)
                 .join(Device, Winner.device_id == Device.id).join(Toolchain, Winner.toolchain_id == Toolchain.id))
        if family:
            query = query.where(Problem.family == family)
        if device_key:
            query = query.where(Winner.device_key == device_key)
        with Session(self.engine, expire_on_commit=False) as session:
            rows = session.execute(query.order_by(Problem.family, Problem.key, Winner.device_key)).all()
            session.expunge_all()
        return [tuple(r) for r in rows]

    def update_winner(self, winner_id: int, *, config_hash: str | None = None, **values) -> None:
        """Set columns of one winner row (staleness, verification results); with `config_hash`, only while the row
        still holds that config (a tune may have stored another winner in the row meanwhile)."""
        query = update(Winner).where(Winner.id == winner_id)
        if config_hash is not None:
            query = query.where(Winner.config_hash == config_hash)
        with Session(self.engine) as session:
            session.execute(query.values(**values))
            session.commit()

    def best_configs_on_key(self, problem_id: int, device_key: str, top_k: int) -> list[tuple[str, float]]:
        """The top_k distinct ok configs by best median over every device row with this key (any driver)."""
        with Session(self.engine) as session:
            rows = session.execute(
                select(Trial.config, func.min(Trial.median_ms).label("best"))
                .join(Device, Trial.device_id == Device.id)
                .where(Trial.problem_id == problem_id, Device.key == device_key, Trial.status == "ok")
                .group_by(Trial.config).order_by("best").limit(top_k)
            ).all()
        return [(r[0], float(r[1])) for r in rows]

    def trials(self, family: str | None = None, problem_key: str | None = None) -> list[dict]:
        query = select(Trial, Problem.family, Problem.key).join(Problem, Trial.problem_id == Problem.id)
        if family:
            query = query.where(Problem.family == family)
        if problem_key:
            query = query.where(Problem.key == problem_key)
        with Session(self.engine) as session:
            rows = session.execute(query.order_by(Trial.id)).all()
        return [
            {"family": fam, "problem_key": key, "study": t.study, "number": t.number, "config": json.loads(t.config),
             "status": t.status, "median_ms": t.median_ms, "q20_ms": t.q20_ms, "q80_ms": t.q80_ms,
             "interpreted": bool(t.interpreted), "error": t.error}
            for t, fam, key in rows
        ]

    def save_policy(self, *, family: str, device, device_id: int, toolchain_id: int, params: dict,
                    verified_range: dict, config: str, samples: int, min_ratio: float, geomean_ratio: float,
                    provenance: str) -> None:
        """Insert or replace the policy of (family, device key, fixed fields, range)."""
        key, range_key = _policy_identity(params, verified_range)
        with Session(self.engine) as session:
            row = session.execute(select(Policy).where(
                Policy.family == family, Policy.device_key == device.key, Policy.key == key,
                Policy.range_key == range_key)).scalar_one_or_none()
            if row is None:
                row = Policy(family=family, device_key=device.key, key=key, range_key=range_key)
                session.add(row)
            row.device_id, row.toolchain_id, row.params, row.verified_range = device_id, toolchain_id, params, verified_range
            row.config, row.samples, row.min_ratio, row.geomean_ratio = config, samples, min_ratio, geomean_ratio
            row.provenance = provenance
            session.commit()

    def delete_policy(self, *, family: str, device_key: str, params: dict, verified_range: dict) -> bool:
        """Remove a policy that no longer wins (a re-tune found the vendor op faster somewhere in its range)."""
        key, range_key = _policy_identity(params, verified_range)
        with Session(self.engine) as session:
            row = session.execute(select(Policy).where(
                Policy.family == family, Policy.device_key == device_key, Policy.key == key,
                Policy.range_key == range_key)).scalar_one_or_none()
            if row is None:
                return False
            session.delete(row)
            session.commit()
            return True

    def policies(self, family: str | None = None, device_key: str | None = None) -> list[PolicyView]:
        query = select(Policy, Toolchain).join(Toolchain, Policy.toolchain_id == Toolchain.id)
        if family:
            query = query.where(Policy.family == family)
        if device_key:
            query = query.where(Policy.device_key == device_key)
        with Session(self.engine) as session:
            rows = session.execute(query.order_by(Policy.family, Policy.key, Policy.range_key)).all()
        rows = [(p, t) for p, t in rows if self.policy_range_usable(p)]
        return [
            PolicyView(family=p.family, device_key=p.device_key, params=dict(p.params),
                       verified_range=dict(p.verified_range),
                       config=p.config, samples=p.samples, min_ratio=p.min_ratio, geomean_ratio=p.geomean_ratio,
                       provenance=p.provenance,
                       toolchain={"torch": t.torch, "triton": t.triton, "cuda": t.cuda, "python": t.python,
                                  "autotile": t.autotile},
                       created_at=p.created_at.isoformat(timespec="seconds") if p.created_at else "")
            for p, t in rows
        ]

    def policy_range_usable(self, policy: Policy, consequence: str = "") -> bool:
        """Whether a policy's range can be read; a damaged one is said once (a policy is nothing without its range)."""
        fault = range_fault(policy.verified_range) if policy.verified_range is not None else "missing"
        if fault is None:
            return True
        warn_damaged_range(self.location(), f"the {policy.family} policy {policy.key} on {policy.device_key}", fault,
                           consequence or f"the policy is not used. Fix: run `autotile tune {policy.family} --model "
                                          "... --policy` again.")
        return False
