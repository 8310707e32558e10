"""Moving winners between databases: `autotile db export`, `db import`, `db merge`.

The export is JSON lines (autotile/store/EXPORT.md describes it): a header,
one record per winner, and an end record with the count, so a truncated file
is recognised. Importing never executes anything from the file: every line is
parsed as JSON; each record's problem is rebuilt by its family, its device key
checked against the known GPU profiles, and its config validated against the
family's space on that device. Bad records are skipped with the reason; the
good ones are written in one transaction, and an existing winner is only
replaced when the conflict policy says so.
"""
from __future__ import annotations

import dataclasses
import datetime as dt
import enum
import json
import math
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy import Engine, select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

import autotile
from autotile.device import PROFILES, DeviceInfo
from autotile.errors import AutotileError, DatabaseError
from autotile.families import family_names, get_family
from autotile.space import Config
from autotile.store.db import database_failure, normalise_url, open_engine, reading, sqlite_path
from autotile.store.fingerprint import device_fingerprint
from autotile.store.models import SCHEMA_VERSION, Device, Policy, Problem, Toolchain, Winner
from autotile.store.repo import Store, range_fault, warn_damaged_range, warn_damaged_row

FORMAT = "autotile-db"
FORMAT_VERSION = 1
# A winner record is a few KB: a longer line is skipped unread, so one huge line cannot fill memory.
MAX_RECORD_BYTES = 1 << 20
# The first bytes of every SQLite database file.
SQLITE_MAGIC = b"SQLite format 3\x00"
# Kept and skipped lines an ImportReport lists one by one; past these only its counts grow (bounded memory).
MAX_LISTED = 10_000
# Records written between two clearings of the import session (its one transaction stays open).
_RECORDS_PER_FLUSH = 500
# Column limits: Integer columns hold int32 in PostgreSQL, BigInteger int64 (SQLite: int64 for both).
_INT32_MAX = 2**31 - 1
_INT64_MAX = 2**63 - 1
# No kernel timing is an hour (interpreter timings included): a larger median is not a measurement.
MAX_TIMING_MS = 3_600_000.0
# Text fields of a problem (expressions, shapes, strides) are short; elementwise expressions are at most 4000.
_MAX_PROBLEM_TEXT = 8192
_RECORD_FIELDS = {"record", "schema_version", "family", "problem", "problem_key", "device", "toolchain", "config",
                  "timings", "provenance", "verification", "serving"}
_DEVICE_FIELDS = ("key", "profile", "name", "compute_capability", "sm_count", "memory_bytes", "smem_per_block", "driver")
_TOOLCHAIN_FIELDS = {"torch": 64, "triton": 64, "cuda": 64, "python": 32, "autotile": 32}  # field -> column width


class ExportFormatError(AutotileError):
    """A file that is not an autotile export, or one written by a newer autotile."""


class ConflictPolicy(str, enum.Enum):
    """What an imported winner does to a stored winner of the same (problem, device key)."""

    KEEP = "keep"  # the stored winner stays
    FASTER = "faster"  # the one with the smaller median stays
    REPLACE = "replace"  # the imported winner replaces it


@dataclass(frozen=True)
class Kept:
    line: int
    family: str
    problem_key: str
    device_key: str
    action: str  # 'added', 'replaced', 'unchanged' (same config already stored) or 'kept-existing'


@dataclass(frozen=True)
class Skipped:
    line: int
    reason: str


@dataclass
class ImportReport:
    """What an import kept and skipped, line by line (the first MAX_LISTED of each; the counts are complete)."""

    source: str
    kept: list[Kept] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    truncated: str = ""  # why the file looks cut short ('' when it ended with its end record)
    dry_run: bool = False
    actions: dict[str, int] = field(default_factory=dict)  # action -> records kept with it
    skipped_count: int = 0

    def keep(self, item: Kept) -> None:
        self.actions[item.action] = self.actions.get(item.action, 0) + 1
        if len(self.kept) < MAX_LISTED:
            self.kept.append(item)

    def skip(self, item: Skipped) -> None:
        self.skipped_count += 1
        if len(self.skipped) < MAX_LISTED:
            self.skipped.append(item)

    @property
    def kept_count(self) -> int:
        return sum(self.actions.values())

    @property
    def unlisted(self) -> int:
        """Records kept or skipped beyond those listed one by one."""
        return self.kept_count - len(self.kept) + self.skipped_count - len(self.skipped)

    def counts(self) -> dict[str, int]:
        return {**self.actions, "skipped": self.skipped_count}


# --- export -------------------------------------------------------------------------------------


def _iso(value: dt.datetime | None) -> str | None:
    return value.isoformat(timespec="seconds") if value else None


def export_records(engine: Engine, family: str | None = None, device_key: str | None = None) -> Iterator[dict]:
    """One export record per stored winner, then one per tuned policy, in a stable order.

    A damaged verified range is left out of its winner's record (said once), as the runtime ignores it: the
    winner is exported and imported whole, serving its own shape; so is a damaged kernel_config (the generated
    kernel a vendor winner was timed beside); a policy with a damaged range, and a winner whose timings or config
    cannot be read, are left out (said once), so that the rest can still be saved.
    """
    store = Store(engine)
    for w, p, d, t in store.winner_rows(family, device_key):
        if not store.readable(w, p):
            continue
        yield {
            "record": "winner", "schema_version": SCHEMA_VERSION, "family": p.family, "problem": dict(p.params),
            "problem_key": p.key,
            "device": {name: getattr(d, name) for name in _DEVICE_FIELDS} | {"key": w.device_key},
            "toolchain": {name: getattr(t, name) for name in _TOOLCHAIN_FIELDS},
            "config": json.loads(w.config),
            "timings": {"median_ms": w.median_ms, "q20_ms": w.q20_ms, "q80_ms": w.q80_ms,
                        "interpreted": bool(w.interpreted), "runner_up_ms": w.runner_up_ms, "margin": w.margin,
                        "baseline_name": w.baseline_name, "baseline_ms": w.baseline_ms},
            "provenance": {"trials_run": w.trials_run, "text": w.provenance, "created_at": _iso(w.created_at)},
            "verification": {"stale": bool(w.stale), "verified_at": _iso(w.verified_at),
                             "verified_ms": w.verified_ms, "verify_status": w.verify_status or "",
                             "regression": w.regression},
            "serving": {"verified_range": _exported_range(store, p, w),
                        "kernel_config": _exported_kernel_config(store, p, w),
                        "kernel_ms": w.kernel_ms},
        }
    with Session(engine) as session:
        query = (select(Policy, Device, Toolchain).join(Device, Policy.device_id == Device.id)
                 .join(Toolchain, Policy.toolchain_id == Toolchain.id))
        if family:
            query = query.where(Policy.family == family)
        if device_key:
            query = query.where(Policy.device_key == device_key)
        rows = session.execute(query.order_by(Policy.family, Policy.key, Policy.range_key)).all()
    for pol, d, t in rows:
        if not store.policy_range_usable(pol, "the policy is not exported."):
            continue
        yield {
            "record": "policy", "schema_version": SCHEMA_VERSION, "family": pol.family, "fixed": dict(pol.params),
            "verified_range": dict(pol.verified_range),
            "device": {name: getattr(d, name) for name in _DEVICE_FIELDS} | {"key": pol.device_key},
            "toolchain": {name: getattr(t, name) for name in _TOOLCHAIN_FIELDS},
            "config": json.loads(pol.config), "samples": pol.samples, "min_ratio": pol.min_ratio,
            "geomean_ratio": pol.geomean_ratio,
            "provenance": {"text": pol.provenance, "created_at": _iso(pol.created_at)},
        }


def _exported_kernel_config(store: Store, problem: Problem, winner: Winner) -> dict | None:
    """A vendor winner's kernel_config as a JSON object, or None when there is none or it is damaged (said once)."""
    if not winner.kernel_config:
        return None
    try:
        config = json.loads(winner.kernel_config)
    except (TypeError, ValueError):
        config = None
    if isinstance(config, dict):
        return config
    warn_damaged_row(store.location(), f"the kernel_config of the {problem.family} winner for {problem.key} on "
                     f"{winner.device_key}", f"not a JSON object: {str(winner.kernel_config)[:60]!r}",
                     "the winner is exported without it")
    return None


def _exported_range(store: Store, problem: Problem, winner: Winner) -> dict | None:
    """A winner's verified range as `db import` takes it back, or None when it is damaged."""
    value = winner.verified_range
    if value is None:
        return None
    fault = range_fault(value) or _serving_range_fault(problem, value)
    if fault is None:
        return value
    warn_damaged_range(store.location(), f"the {problem.family} winner for {problem.key} on {winner.device_key}",
                       fault, "the winner is exported without it, to serve its own shape only.")
    return None


def _serving_range_fault(problem: Problem, value: dict) -> str | None:
    """Why a well-formed range does not fit its family (the check `db import` makes); None when it does."""
    if problem.family not in family_names():
        return None  # another version's family: its record is refused on import anyway, with the reason
    family = get_family(problem.family)
    try:
        rebuilt = family.problem_from_dict(problem.params)
    except Exception:  # noqa: BLE001 - a problem import refuses with its own reason
        return None
    if set(value) != set(family.serving_fields) or not family.in_range(rebuilt, rebuilt, value):
        return (f"{json.dumps(value, sort_keys=True)[:120]} is not a range of {list(family.serving_fields)} "
                "that holds its own shape")
    return None


def export_database(db_url: str | None, out: Path, family: str | None = None,
                    device_key: str | None = None) -> dict[str, int]:
    """Write the winners and policies of `db_url` to `out` as an autotile export; returns how many records of each
    kind ("winner", "policy") were written.

    The file is written beside `out` and renamed into place, so a reader never sees half of it.

    >>> export_database("sqlite:////tmp/t.sqlite", Path("/tmp/winners.jsonl"))  # doctest: +SKIP
    {'winner': 3, 'policy': 1}
    """
    engine = open_engine(db_url, create=False, read_only=True)
    header = {"format": FORMAT, "format_version": FORMAT_VERSION, "schema_version": SCHEMA_VERSION,
              "autotile": autotile.__version__,
              "exported_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}
    out = Path(out)
    partial = out.with_name(out.name + ".partial")
    counts = {"winner": 0, "policy": 0}
    try:
        with reading(db_url), open(partial, "w", encoding="utf-8") as handle:
            handle.write(json.dumps(header, sort_keys=True) + "\n")
            for record in export_records(engine, family, device_key):
                handle.write(json.dumps(record, sort_keys=True) + "\n")
                counts[record["record"]] += 1
            handle.write(json.dumps({"record": "end", "count": sum(counts.values())}, sort_keys=True) + "\n")
            handle.flush()
            os.fsync(handle.fileno())  # a full disk shows here, before the rename, not after it
        partial.replace(out)
    except BaseException as exc:
        partial.unlink(missing_ok=True)  # no half-written export is left behind, whatever stopped it
        if isinstance(exc, OSError):
            raise ExportFormatError(f"cannot write {out}: {exc.strerror or exc}; nothing was written") from None
        raise
    return counts


# --- reading and validating ----------------------------------------------------------------------


class _Bad(Exception):
    """One record is unusable; the message is the reason reported for its line."""


@dataclass(frozen=True)
class _Valid:
    line: int
    family: str
    problem_key: str
    bucket: str
    params: dict
    device: DeviceInfo
    toolchain: dict
    config: Config
    winner_values: dict


class ExportReader:
    """An export file read one line at a time (memory bounded by MAX_RECORD_BYTES, whatever the file's size).

    Opening it reads and checks the header (ExportFormatError for a file that is not an autotile export or
    is newer than this autotile); iterating yields (line number, record or None, parse error); after the
    last record `truncated` says why the file looks cut short ('' when it ended with its end record).

    >>> reader = ExportReader(Path("winners.jsonl"))  # doctest: +SKIP
    >>> bad = [(line, error) for line, record, error in reader if error]  # doctest: +SKIP
    >>> reader.truncated  # doctest: +SKIP
    ''
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        self.truncated = ""
        try:
            self._handle = open(self.path, "rb")  # noqa: SIM115 - closed when iteration ends
        except OSError as exc:
            raise ExportFormatError(f"cannot read {path}: {exc.strerror}") from None
        first, _ = self._line()
        try:
            self.header = json.loads(first) if first and first.strip() else None
        except (json.JSONDecodeError, UnicodeDecodeError):
            self.header = None
        if not isinstance(self.header, dict) or self.header.get("format") != FORMAT:
            self._handle.close()
            hint = (f": it is a SQLite database; merge its winners with `autotile db merge {path}`"
                    if (first or b"").startswith(SQLITE_MAGIC) else "")
            raise ExportFormatError(f"{path} is not an autotile export (its first line is not a "
                                    f'{{"format": "{FORMAT}", ...}} header){hint}; nothing was imported')
        version = self.header.get("format_version")
        schema = self.header.get("schema_version")
        for name, value in (("format_version", version), ("schema_version", schema)):
            if not _is_int(value):
                self._handle.close()
                raise ExportFormatError(f"{path}: the header's {name} must be an integer, got {value!r:.40}: the "
                                        "file was edited or damaged; export it again. Nothing was imported")
        if version > FORMAT_VERSION:
            self._handle.close()
            raise ExportFormatError(f"{path} has export format version {version!r:.40}; this autotile reads version "
                                    f"{FORMAT_VERSION}: upgrade autotile to import it. Nothing was imported")
        if schema > SCHEMA_VERSION:
            self._handle.close()
            raise ExportFormatError(f"{path} was written with schema version {schema!r:.40}, newer than this "
                                    f"autotile's {SCHEMA_VERSION}: upgrade autotile to import it. Nothing was imported")

    def _line(self) -> tuple[bytes | None, bool]:
        """The next line (None at the end of the file) and whether it was too long to read (then b'')."""
        data = self._handle.readline(MAX_RECORD_BYTES + 1)
        if not data:
            return None, False
        if len(data) > MAX_RECORD_BYTES and not data.endswith(b"\n"):
            while data and not data.endswith(b"\n"):  # skip the rest of the line, a block at a time
                data = self._handle.readline(MAX_RECORD_BYTES)
            return b"", True
        return data, False

    def __iter__(self) -> Iterator[tuple[int, dict | None, str]]:
        end = None
        records = 0
        pending: tuple[int, str] | None = None  # a line that did not parse: truncated, if nothing follows it
        number = 1
        with self._handle:
            while True:
                data, too_long = self._line()
                if data is None:
                    break
                number += 1
                if too_long:
                    item = (number, None, f"a line longer than {MAX_RECORD_BYTES} bytes (not read)")
                elif not data.strip():
                    continue
                elif end is not None:
                    item = (number, None, "a line after the end record")
                else:
                    try:
                        record = json.loads(data)
                    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                        if pending is not None:
                            yield pending[0], None, pending[1]
                        pending = (number, f"not valid JSON: {getattr(exc, 'msg', exc)}")
                        records += 1
                        continue
                    if isinstance(record, dict) and record.get("record") == "end":
                        end = record
                        if pending is not None:
                            yield pending[0], None, pending[1]
                            pending = None
                        continue
                    item = (number, record, "")
                if pending is not None:
                    yield pending[0], None, pending[1]
                    pending = None
                if item[2] != "a line after the end record":
                    records += 1
                yield item
        if pending is not None:
            cut = " (the file looks truncated)" if end is None else ""
            yield pending[0], None, pending[1].replace("not valid JSON", f"not valid JSON{cut}", 1)
        if end is None:
            self.truncated = "the file has no end record: it was cut short, or is not a complete export"
        elif end.get("count") != records:
            self.truncated = f"the end record counts {end.get('count')!r:.40} records but the file holds {records}"


def read_export(path: Path) -> tuple[dict, list[tuple[int, dict | None, str]], str]:
    """(header, [(line number, record or None, parse error)], truncation note) of an export file, all in memory.

    For small files and tests; imports stream through ExportReader. Raises ExportFormatError for a file that
    is not an autotile export or is newer than this autotile.
    """
    reader = ExportReader(path)
    records = list(reader)
    return reader.header, records, reader.truncated


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _finite(value, name: str, *, optional: bool = False, positive: bool = False,
            bounds: tuple[float, float] | None = None) -> float | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _Bad(f"{name} must be a finite number, got {value!r:.80}")
    try:
        number = float(value)
    except OverflowError:  # an integer past a float's range
        raise _Bad(f"{name} must be a finite number, got an integer of {len(str(value))} digits") from None
    if not math.isfinite(number):
        raise _Bad(f"{name} must be a finite number, got {value!r:.80}")
    if positive and number <= 0:
        raise _Bad(f"{name} must be positive, got {value!r:.80}")
    if bounds is not None and not bounds[0] <= number <= bounds[1]:
        raise _Bad(f"{name} must be within [{bounds[0]:g}, {bounds[1]:g}], got {value!r:.80}")
    return number


def _ms(value, name: str, *, optional: bool = False) -> float | None:
    """A timing: positive and at most MAX_TIMING_MS."""
    return _finite(value, name, optional=optional, positive=True, bounds=(0.0, MAX_TIMING_MS))


def _text(value, name: str, width: int) -> str:
    if not isinstance(value, str) or len(value) > width:
        raise _Bad(f"{name} must be a string of at most {width} characters, got {value!r:.80}")
    return value


# Integers up to this many digits (any int64) are shown in messages; longer ones by their length only.
_SHOWN_DIGITS = 20


def _count(value, name: str, minimum: int, maximum: int = _INT32_MAX) -> int:
    if not _is_int(value) or not minimum <= value <= maximum:
        digits = len(str(abs(value))) if _is_int(value) else 0
        shown = f"an integer of {digits} digits" if digits > _SHOWN_DIGITS else f"{value!r:.80}"
        raise _Bad(f"{name} must be an integer in [{minimum}, {maximum}], got {shown}")
    return value


def checked_problem(family, data: dict):
    """The family's problem rebuilt from `data`, every field of the type the problem declares.

    The families' constructors take what they are given (m=64.5, tf32="yes", bias=2 would rebuild); a
    record's problem must be exactly what autotile writes: ints (shape fields positive), bools, known
    choices and dtype names, finite floats, short text.
    """
    import typing

    hints = typing.get_type_hints(family.problem_type)
    choices = {o.name: o.choices for o in family.cli_options if o.choices}
    for name, value in data.items():
        kind = hints.get(name)
        if kind is bool and not isinstance(value, bool):
            raise _Bad(f"problem.{name} must be true or false, got {value!r:.80}")
        if kind is int:
            lowest = 1 if name in family.shape_fields else -_INT64_MAX
            _count(value, f"problem.{name}", lowest, _INT64_MAX)
        if kind is float:
            _finite(value, f"problem.{name}")
        if kind is str:
            _text(value, f"problem.{name}", _MAX_PROBLEM_TEXT)
            if name in choices and value not in choices[name]:
                raise _Bad(f"problem.{name} must be one of {', '.join(choices[name])}, got {value!r:.80}")
            if name.endswith("dtype") and not _canonical_dtype(value):
                raise _Bad(f"problem.{name} {value!r:.80} is not a dtype name autotile writes (fp32, fp16, bf16, ...)")
    try:
        return family.problem_from_dict(data)
    except Exception as exc:  # noqa: BLE001 - whatever the family's constructor refuses is reported
        raise _Bad(f"{family.name} problem does not rebuild: {exc}") from None


def _canonical_dtype(name: str) -> bool:
    from autotile.dtypes import canonical_dtype_name

    try:
        return canonical_dtype_name(name) == name
    except AutotileError:
        return False


def _object(record: dict, name: str) -> dict:
    value = record.get(name)
    if not isinstance(value, dict):
        raise _Bad(f"{name} must be a JSON object, got {value!r:.80}")
    return value


def _device(data: dict) -> DeviceInfo:
    """The device a record names, checked against the known GPU profiles (or the interpreter)."""
    missing = [name for name in _DEVICE_FIELDS if name not in data]
    if missing:
        raise _Bad(f"device lacks {missing}")
    key, profile = _text(data["key"], "device key", 64), _text(data["profile"], "device profile", 64)
    cc_text = _text(data["compute_capability"], "compute_capability", 16)
    known = ", ".join(sorted(p for p in PROFILES if p != "interpret"))
    if key == "interpret":
        if profile != "interpret":
            raise _Bad(f"device key 'interpret' with profile {profile!r}")
        cc = (0, 0)
    else:
        if profile not in PROFILES or profile == "interpret":
            raise _Bad(f"device {key!r}: unknown GPU profile {profile!r} (known: {known}, or interpret)")
        cc = PROFILES[profile].compute_capability
        if cc_text != f"{cc[0]}.{cc[1]}" or key != f"{profile}/sm{cc[0]}{cc[1]}":
            raise _Bad(f"device {key!r} with compute capability {cc_text!r} does not exist: "
                       f"{profile} is {profile}/sm{cc[0]}{cc[1]} (compute capability {cc[0]}.{cc[1]})")
    return DeviceInfo(profile, _text(data["name"], "device name", 128), cc, _count(data["sm_count"], "sm_count", 1),
                      _count(data["memory_bytes"], "memory_bytes", 0, _INT64_MAX),
                      _count(data["smem_per_block"], "smem_per_block", 1), _text(data["driver"], "driver", 64),
                      interpret=key == "interpret")


def _parse_time(value) -> dt.datetime:
    if value is None:
        return dt.datetime.now(dt.timezone.utc).replace(tzinfo=None)
    try:
        return dt.datetime.fromisoformat(_text(value, "timestamp", 64)).replace(tzinfo=None)
    except ValueError:
        raise _Bad(f"timestamp {value!r} is not ISO 8601") from None


def _family_of(record: dict):
    """(name, family) a record names; _Bad for a family this autotile does not have."""
    family_name = record.get("family")
    if family_name not in family_names():
        raise _Bad(f"unknown family {family_name!r} (known: {', '.join(family_names())})")
    return family_name, get_family(family_name)


def _toolchain(record: dict) -> dict:
    toolchain_data = _object(record, "toolchain")
    return {name: _text(toolchain_data.get(name), f"toolchain.{name}", width)
            for name, width in _TOOLCHAIN_FIELDS.items()}


_POLICY_FIELDS = {"record", "schema_version", "family", "fixed", "verified_range", "device", "toolchain", "config",
                  "samples", "min_ratio", "geomean_ratio", "provenance"}


@dataclass(frozen=True)
class _ValidPolicy:
    line: int
    family: str
    device: DeviceInfo
    toolchain: dict
    values: dict  # the Policy row's columns but the ids

    @property
    def problem_key(self) -> str:
        return f"policy {self.values['key']} {self.values['range_key']}"


def validate_policy_record(record: dict, line: int) -> _ValidPolicy:
    """Check one tuned-policy record: its family, device and toolchain, a range that names only shape fields
    (all the family's serving fields among them) and holds its own lowest corner, a config that is the policy
    or a point of the space there, and ratios that are finite and positive."""
    unknown = set(record) - _POLICY_FIELDS
    if unknown:
        raise _Bad(f"unknown fields {sorted(unknown)}")
    family_name, family = _family_of(record)
    fixed, verified_range = _object(record, "fixed"), _object(record, "verified_range")
    ranged = set(family.serving_fields) | set(family.shape_fields)
    if not set(family.serving_fields) <= set(verified_range) <= ranged or set(fixed) & set(verified_range):
        raise _Bad(f"verified_range must name the serving fields {list(family.serving_fields)} and only shape "
                   f"fields, none of which may also be fixed")
    try:
        corner = {name: bounds[0] for name, bounds in verified_range.items()}
    except (TypeError, KeyError, IndexError):
        raise _Bad("verified_range must map each field to [lo, hi]") from None
    # Every field the range leaves is fixed (but those later autotile versions added, which take their defaults):
    # a policy without its dtype would serve calls of every dtype.
    missing = ({f.name for f in dataclasses.fields(family.problem_type)} - set(fixed) - set(verified_range)
               - set(getattr(family, "later_fields", {}) or {}))
    if missing:
        raise _Bad(f"fixed must hold every problem field the range does not; missing {sorted(missing)}")
    problem = checked_problem(family, {**fixed, **corner})
    if not family.in_range(problem, problem, verified_range):
        raise _Bad(f"verified_range {json.dumps(verified_range, sort_keys=True):.200} is not a range of integers "
                   "that holds its own lowest corner")
    device = _device(_object(record, "device"))
    config_data = _object(record, "config")
    try:
        family.validate_config(problem, device, config_data)
    except AutotileError as exc:
        raise _Bad(f"config {json.dumps(config_data, sort_keys=True):.200} on {device.key}: {exc}") from None
    toolchain = _toolchain(record)
    provenance = _object(record, "provenance")
    canonical = lambda data: json.dumps(data, sort_keys=True, separators=(",", ":"))  # noqa: E731
    values = {
        "family": family_name, "device_key": device.key, "key": canonical(fixed),
        "range_key": canonical(verified_range), "params": fixed, "verified_range": verified_range,
        "config": canonical(config_data), "samples": _count(record.get("samples"), "samples", 1),
        "min_ratio": _finite(record.get("min_ratio"), "min_ratio", positive=True, bounds=(0.0, 1e6)),
        "geomean_ratio": _finite(record.get("geomean_ratio"), "geomean_ratio", positive=True, bounds=(0.0, 1e6)),
        "provenance": _text(provenance.get("text", ""), "provenance.text", 100_000),
        "created_at": _parse_time(provenance.get("created_at")),
    }
    # A policy serves untuned shapes in place of the vendor op: it is stored only where it won on every sample.
    if values["min_ratio"] < 1.0 or values["min_ratio"] > values["geomean_ratio"]:
        raise _Bad(f"min_ratio {values['min_ratio']} must be at least 1 (a policy that loses to the vendor op is never "
                   f"stored) and at most geomean_ratio {values['geomean_ratio']}")
    return _ValidPolicy(line, family_name, device, toolchain, values)


def validate_record(record, line: int) -> _Valid | _ValidPolicy:
    """Check one record against the schema and its family's space; raises _Bad with the reason."""
    if not isinstance(record, dict):
        raise _Bad("a record must be a JSON object")
    if record.get("record") not in ("winner", "policy"):
        raise _Bad(f"unknown record type {record.get('record')!r} (expected 'winner' or 'policy')")
    schema = record.get("schema_version", SCHEMA_VERSION)
    if not isinstance(schema, int) or schema > SCHEMA_VERSION:
        raise _Bad(f"record from schema version {schema!r}, newer than this autotile's {SCHEMA_VERSION}")
    if record["record"] == "policy":
        return validate_policy_record(record, line)
    unknown = set(record) - _RECORD_FIELDS
    if unknown:
        raise _Bad(f"unknown fields {sorted(unknown)}")
    family_name, family = _family_of(record)
    problem = checked_problem(family, _object(record, "problem"))
    device = _device(_object(record, "device"))
    config_data = _object(record, "config")
    try:
        config = family.validate_config(problem, device, config_data)
    except AutotileError as exc:
        raise _Bad(f"config {json.dumps(config_data, sort_keys=True):.200} on {device.key}: {exc}") from None
    toolchain = _toolchain(record)
    timings = _object(record, "timings")
    interpreted = timings.get("interpreted")
    if interpreted is not device.interpret:
        raise _Bad(f"timings.interpreted is {interpreted!r} but the device is {device.key!r}")
    provenance = _object(record, "provenance")
    verification = record.get("verification") or {}
    if not isinstance(verification, dict):
        raise _Bad("verification must be a JSON object")
    values = {
        "median_ms": _ms(timings.get("median_ms"), "timings.median_ms"),
        "q20_ms": _ms(timings.get("q20_ms"), "timings.q20_ms"),
        "q80_ms": _ms(timings.get("q80_ms"), "timings.q80_ms"),
        "interpreted": int(device.interpret),
        "runner_up_ms": _ms(timings.get("runner_up_ms"), "timings.runner_up_ms", optional=True),
        # margin = runner-up / winner - 1, regression = verified / stored - 1: both above -1
        "margin": _finite(timings.get("margin"), "timings.margin", optional=True, bounds=(-1.0, 1e6)),
        "baseline_name": _text(timings.get("baseline_name", ""), "timings.baseline_name", 128),
        "baseline_ms": _ms(timings.get("baseline_ms"), "timings.baseline_ms", optional=True),
        "trials_run": _count(provenance.get("trials_run", 0), "provenance.trials_run", 0),
        "provenance": _text(provenance.get("text", ""), "provenance.text", 100_000),
        "created_at": _parse_time(provenance.get("created_at")),
        "stale": int(bool(verification.get("stale", False))),
        "verified_at": _parse_time(verification["verified_at"]) if verification.get("verified_at") else None,
        "verified_ms": _ms(verification.get("verified_ms"), "verification.verified_ms", optional=True),
        "verify_status": _text(verification.get("verify_status", ""), "verification.verify_status", 32),
        "regression": _finite(verification.get("regression"), "verification.regression", optional=True,
                              bounds=(-1.0, 1e6)),
        **_serving_values(record.get("serving") or {}, family, problem, device),
    }
    if not values["q20_ms"] <= values["median_ms"] <= values["q80_ms"]:
        raise _Bad(f"timings must keep q20_ms <= median_ms <= q80_ms, got {values['q20_ms']}, {values['median_ms']}, "
                   f"{values['q80_ms']}")
    return _Valid(line, family_name, family.problem_key(problem), family.bucket(problem),
                  dataclasses.asdict(problem), device, toolchain, config, values)


def _serving_values(serving, family, problem, device: DeviceInfo) -> dict:
    """The record's serving range and kept generated kernel, checked: ranges hold the problem, configs are in its space."""
    if not isinstance(serving, dict):
        raise _Bad("serving must be a JSON object")
    unknown = set(serving) - {"verified_range", "kernel_config", "kernel_ms"}
    if unknown:
        raise _Bad(f"serving has unknown fields {sorted(unknown)}")
    verified_range = serving.get("verified_range")
    if verified_range is not None:
        if not isinstance(verified_range, dict) or set(verified_range) != set(family.serving_fields):
            raise _Bad(f"serving.verified_range must name exactly {list(family.serving_fields)}")
        if not family.in_range(problem, problem, verified_range):
            raise _Bad(f"serving.verified_range {json.dumps(verified_range, sort_keys=True):.200} is not a range of "
                       "integers that holds the record's own problem")
    kernel_config = serving.get("kernel_config")
    if kernel_config is not None:
        if not isinstance(kernel_config, dict):
            raise _Bad("serving.kernel_config must be a JSON object")
        try:
            kernel_config = family.space(problem, device).validate(kernel_config).to_json()
        except AutotileError as exc:
            raise _Bad(f"serving.kernel_config: {exc}") from None
    return {"verified_range": verified_range, "kernel_config": kernel_config,
            "kernel_ms": _ms(serving.get("kernel_ms"), "serving.kernel_ms", optional=True)}


# --- writing -------------------------------------------------------------------------------------


def _get_or_create(session: Session, model, lookup: dict, values: dict) -> int:
    row = session.execute(select(model.id).filter_by(**lookup)).scalar_one_or_none()
    if row is None:
        obj = model(**lookup, **values)
        session.add(obj)
        session.flush()
        return obj.id
    return row


def _write_policy(session: Session, item: _ValidPolicy, policy: ConflictPolicy) -> str:
    digest, fields = device_fingerprint(item.device)
    device_id = _get_or_create(session, Device, {"fingerprint": digest}, fields)
    toolchain_id = _get_or_create(session, Toolchain, item.toolchain, {})
    v = item.values
    existing = session.execute(select(Policy).where(
        Policy.family == v["family"], Policy.device_key == v["device_key"], Policy.key == v["key"],
        Policy.range_key == v["range_key"])).scalar_one_or_none()
    values = dict(v, device_id=device_id, toolchain_id=toolchain_id)
    if existing is None:
        session.add(Policy(**values))
        session.flush()
        return "added"
    if existing.config == values["config"] and existing.min_ratio == values["min_ratio"]:
        return "unchanged"
    # 'faster' keeps the policy with the larger smallest margin over the vendor op.
    if policy is ConflictPolicy.KEEP or (policy is ConflictPolicy.FASTER and existing.min_ratio >= values["min_ratio"]):
        return "kept-existing"
    for name, value in values.items():
        setattr(existing, name, value)
    session.flush()
    return "replaced"


def _write(session: Session, item: _Valid | _ValidPolicy, policy: ConflictPolicy) -> str:
    if isinstance(item, _ValidPolicy):
        return _write_policy(session, item, policy)
    problem_id = _get_or_create(session, Problem, {"family": item.family, "key": item.problem_key},
                                {"bucket": item.bucket, "params": item.params})
    digest, fields = device_fingerprint(item.device)
    device_id = _get_or_create(session, Device, {"fingerprint": digest}, fields)
    toolchain_id = _get_or_create(session, Toolchain, item.toolchain, {})
    existing = session.execute(select(Winner).where(Winner.problem_id == problem_id,
                                                    Winner.device_key == item.device.key)).scalar_one_or_none()
    values = dict(item.winner_values, device_id=device_id, toolchain_id=toolchain_id, config=item.config.to_json(),
                  config_hash=item.config.hash)
    if existing is None:
        session.add(Winner(problem_id=problem_id, device_key=item.device.key, **values))
        session.flush()
        return "added"
    if existing.config == values["config"]:
        serving = {name: values[name] for name in ("verified_range", "kernel_config", "kernel_ms") if name in values}
        if policy is not ConflictPolicy.REPLACE or all(getattr(existing, k) == v for k, v in serving.items()):
            return "unchanged"  # the same winner is stored already; its own timings stay
        # --on-conflict replace of the same config with another serving range (or kept kernel): the import's, as
        # asked (reported 'unchanged' before, and the range dropped).
        for name, value in serving.items():
            setattr(existing, name, value)
        session.flush()
        return "replaced"
    if policy is ConflictPolicy.KEEP or (policy is ConflictPolicy.FASTER
                                         and existing.median_ms <= values["median_ms"]):
        return "kept-existing"
    for name, value in values.items():
        setattr(existing, name, value)
    session.flush()
    return "replaced"


def import_records(target_url: str | None, records: Iterable[tuple[int, dict | None, str]], source: str, *,
                   policy: ConflictPolicy = ConflictPolicy.KEEP, dry_run: bool = False) -> ImportReport:
    """Validate `records` one at a time and write the valid ones into `target_url` in one transaction.

    Records stream through: memory stays bounded however many there are. A record that fails validation is
    skipped with its reason; the others are all written, or (a database error) none.
    """
    report = ImportReport(source, dry_run=dry_run)
    path = sqlite_path(normalise_url(target_url)) if target_url else None
    if dry_run and path is not None and not path.exists():
        # Checking a file before the first import: against an empty database (in memory), where every record is new.
        engine = open_engine("sqlite://", create=True)
    else:
        engine = open_engine(target_url, create=not dry_run)
    with Session(engine) as session:
        try:
            written = 0
            for line, record, error in records:
                if error:
                    report.skip(Skipped(line, error))
                    continue
                try:
                    item = validate_record(record, line)
                except _Bad as exc:
                    report.skip(Skipped(line, str(exc)))
                    continue
                report.keep(Kept(item.line, item.family, item.problem_key, item.device.key,
                                 _write(session, item, policy)))
                written += 1
                if written % _RECORDS_PER_FLUSH == 0:
                    session.flush()
                    session.expunge_all()  # written in the transaction; the session need not hold them
            if dry_run:
                session.rollback()
            else:
                session.commit()
        except SQLAlchemyError as exc:
            session.rollback()
            reason = database_failure(exc, target_url) or f"{exc.__class__.__name__}: {exc}"
            raise DatabaseError(f"import into {engine.url} failed and was rolled back, nothing was written: "
                                f"{reason}") from None
    return report


def import_file(target_url: str | None, path: Path, *, policy: ConflictPolicy = ConflictPolicy.KEEP,
                dry_run: bool = False) -> ImportReport:
    """Import an export file into `target_url`, reading it one line at a time; see ImportReport for what was
    kept and skipped.

    >>> report = import_file("sqlite:////tmp/t.sqlite", Path("winners.jsonl"))  # doctest: +SKIP
    >>> report.counts()  # doctest: +SKIP
    {'added': 3, 'skipped': 1}
    """
    reader = ExportReader(Path(path))
    report = import_records(target_url, reader, str(path), policy=policy, dry_run=dry_run)
    report.truncated = reader.truncated
    return report


def _refuse_an_export(source: str) -> None:
    """An export file named as a database to merge gets the command that reads it, not 'not a SQLite database'."""
    if "://" in source:
        return
    try:
        with open(source, "rb") as handle:
            first = handle.readline(4096)
        header = json.loads(first)
    except (OSError, ValueError):
        return
    if isinstance(header, dict) and header.get("format") == FORMAT:
        raise DatabaseError(f"{source} is an autotile export, not a database: import it with "
                            f"`autotile db import {source}`")


def merge_databases(target_url: str | None, source_urls: Iterable[str], *,
                    policy: ConflictPolicy = ConflictPolicy.FASTER, dry_run: bool = False) -> list[ImportReport]:
    """Merge the winners of other autotile databases into `target_url`, validated exactly like an import. Every
    source is read before anything is written: a source that cannot be read leaves the target as it was, not merged
    from the sources named before it."""
    target = normalise_url(target_url) if target_url else None
    read = []
    for source in source_urls:
        url = normalise_url(source)
        if target is not None and url == target:
            raise DatabaseError(f"{source} is the target database itself; name another one to merge from")
        _refuse_an_export(source)
        try:
            with reading(url):
                records = [(number, record, "") for number, record in
                           enumerate(export_records(open_engine(url, create=False, read_only=True)), start=1)]
        except DatabaseError as exc:  # its advice is about --db, which names the target here
            reason = str(exc).split("; point --db/AUTOTILE_DB")[0]
            raise DatabaseError(f"cannot merge from {source}: {reason}; nothing was merged (name autotile "
                                "databases as sources)") from None
        read.append((source, records))
    return [import_records(target_url, records, source, policy=policy, dry_run=dry_run) for source, records in read]
