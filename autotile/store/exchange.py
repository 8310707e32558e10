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
from autotile.store.db import normalise_url, open_engine
from autotile.store.fingerprint import device_fingerprint
from autotile.store.models import SCHEMA_VERSION, Device, Problem, Toolchain, Winner
from autotile.store.repo import Store

FORMAT = "autotile-db"
FORMAT_VERSION = 1
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
    """Exactly what an import kept and skipped, line by line."""

    source: str
    kept: list[Kept] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    truncated: str = ""  # why the file looks cut short ('' when it ended with its end record)
    dry_run: bool = False

    def counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for item in self.kept:
            counts[item.action] = counts.get(item.action, 0) + 1
        counts["skipped"] = len(self.skipped)
        return counts


# --- export -------------------------------------------------------------------------------------


def _iso(value: dt.datetime | None) -> str | None:
    return value.isoformat(timespec="seconds") if value else None


def export_records(engine: Engine, family: str | None = None, device_key: str | None = None) -> Iterator[dict]:
    """One export record per stored winner, in a stable order (family, problem key, device key)."""
    for w, p, d, t in Store(engine).winner_rows(family, device_key):
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
            "serving": {"verified_range": w.verified_range if isinstance(w.verified_range, dict) else None,
                        "kernel_config": json.loads(w.kernel_config) if w.kernel_config else None,
                        "kernel_ms": w.kernel_ms},
        }


def export_database(db_url: str | None, out: Path, family: str | None = None, device_key: str | None = None) -> int:
    """Write the winners of `db_url` to `out` as an autotile export; returns how many records were written.

    The file is written beside `out` and renamed into place, so a reader never sees half of it.

    >>> export_database("sqlite:////tmp/t.sqlite", Path("/tmp/winners.jsonl"))  # doctest: +SKIP
    3
    """
    engine = open_engine(db_url, create=False)
    header = {"format": FORMAT, "format_version": FORMAT_VERSION, "schema_version": SCHEMA_VERSION,
              "autotile": autotile.__version__,
              "exported_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}
    out = Path(out)
    partial = out.with_name(out.name + ".partial")
    count = 0
    with open(partial, "w", encoding="utf-8") as handle:
        handle.write(json.dumps(header, sort_keys=True) + "\n")
        for record in export_records(engine, family, device_key):
            handle.write(json.dumps(record, sort_keys=True) + "\n")
            count += 1
        handle.write(json.dumps({"record": "end", "count": count}, sort_keys=True) + "\n")
    partial.replace(out)
    return count


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


def read_export(path: Path) -> tuple[dict, list[tuple[int, dict | None, str]], str]:
    """(header, [(line number, record or None, parse error)], truncation note) of an export file.

    Raises ExportFormatError for a file that is not an autotile export or is newer than this autotile.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ExportFormatError(f"cannot read {path}: {exc.strerror}") from None
    lines = data.decode("utf-8", errors="replace").split("\n")
    try:
        header = json.loads(lines[0]) if lines[0].strip() else None
    except json.JSONDecodeError:
        header = None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise ExportFormatError(f"{path} is not an autotile export (its first line is not a "
                                f'{{"format": "{FORMAT}", ...}} header); nothing was imported')
    version = header.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise ExportFormatError(f"{path} has export format version {version!r}; this autotile reads version "
                                f"{FORMAT_VERSION}: upgrade autotile to import it. Nothing was imported")
    schema = header.get("schema_version")
    if not isinstance(schema, int) or schema > SCHEMA_VERSION:
        raise ExportFormatError(f"{path} was written with schema version {schema!r}, newer than this autotile's "
                                f"{SCHEMA_VERSION}: upgrade autotile to import it. Nothing was imported")
    records: list[tuple[int, dict | None, str]] = []
    end = None
    last_line = max(number for number, text in enumerate(lines, start=1) if text.strip())
    for number, text in enumerate(lines[1:], start=2):
        if not text.strip():
            continue
        if end is not None:
            records.append((number, None, "a line after the end record"))
            continue
        try:
            record = json.loads(text)
        except json.JSONDecodeError as exc:
            cut = " (the file looks truncated)" if number == last_line else ""
            records.append((number, None, f"not valid JSON{cut}: {exc.msg}"))
            continue
        if isinstance(record, dict) and record.get("record") == "end":
            end = record
            continue
        records.append((number, record, ""))
    if end is None:
        truncated = "the file has no end record: it was cut short, or is not a complete export"
    elif end.get("count") != sum(1 for _, _, error in records if error != "a line after the end record"):
        truncated = f"the end record counts {end.get('count')!r} records but the file holds {len(records)}"
    else:
        truncated = ""
    return header, records, truncated


def _finite(value, name: str, *, optional: bool = False, positive: bool = False) -> float | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _Bad(f"{name} must be a finite number, got {value!r}")
    if positive and value <= 0:
        raise _Bad(f"{name} must be positive, got {value!r}")
    return float(value)


def _text(value, name: str, width: int) -> str:
    if not isinstance(value, str) or len(value) > width:
        raise _Bad(f"{name} must be a string of at most {width} characters, got {value!r:.80}")
    return value


def _count(value, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _Bad(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


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
                      _count(data["memory_bytes"], "memory_bytes", 0),
                      _count(data["smem_per_block"], "smem_per_block", 1), _text(data["driver"], "driver", 64),
                      interpret=key == "interpret")


def _parse_time(value) -> dt.datetime:
    if value is None:
        return dt.datetime.now(dt.timezone.utc).replace(tzinfo=None)
    try:
        return dt.datetime.fromisoformat(_text(value, "timestamp", 64)).replace(tzinfo=None)
    except ValueError:
        raise _Bad(f"timestamp {value!r} is not ISO 8601") from None


def validate_record(record, line: int) -> _Valid:
    """Check one record against the schema and its family's space; raises _Bad with the reason."""
    if not isinstance(record, dict):
        raise _Bad("a record must be a JSON object")
    if record.get("record") != "winner":
        raise _Bad(f"unknown record type {record.get('record')!r} (expected 'winner')")
    schema = record.get("schema_version", SCHEMA_VERSION)
    if not isinstance(schema, int) or schema > SCHEMA_VERSION:
        raise _Bad(f"record from schema version {schema!r}, newer than this autotile's {SCHEMA_VERSION}")
    unknown = set(record) - _RECORD_FIELDS
    if unknown:
        raise _Bad(f"unknown fields {sorted(unknown)}")
    family_name = record.get("family")
    if family_name not in family_names():
        raise _Bad(f"unknown family {family_name!r} (known: {', '.join(family_names())})")
    family = get_family(family_name)
    try:
        problem = family.problem_from_dict(_object(record, "problem"))
    except _Bad:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever the family's constructor refuses is reported
        raise _Bad(f"{family_name} problem does not rebuild: {exc}") from None
    device = _device(_object(record, "device"))
    config_data = _object(record, "config")
    try:
        config = family.validate_config(problem, device, config_data)
    except AutotileError as exc:
        raise _Bad(f"config {json.dumps(config_data, sort_keys=True):.200} on {device.key}: {exc}") from None
    toolchain_data = _object(record, "toolchain")
    toolchain = {name: _text(toolchain_data.get(name), f"toolchain.{name}", width)
                 for name, width in _TOOLCHAIN_FIELDS.items()}
    timings = _object(record, "timings")
    interpreted = timings.get("interpreted")
    if interpreted is not device.interpret:
        raise _Bad(f"timings.interpreted is {interpreted!r} but the device is {device.key!r}")
    provenance = _object(record, "provenance")
    verification = record.get("verification") or {}
    if not isinstance(verification, dict):
        raise _Bad("verification must be a JSON object")
    values = {
        "median_ms": _finite(timings.get("median_ms"), "timings.median_ms", positive=True),
        "q20_ms": _finite(timings.get("q20_ms"), "timings.q20_ms", positive=True),
        "q80_ms": _finite(timings.get("q80_ms"), "timings.q80_ms", positive=True),
        "interpreted": int(device.interpret),
        "runner_up_ms": _finite(timings.get("runner_up_ms"), "timings.runner_up_ms", optional=True),
        "margin": _finite(timings.get("margin"), "timings.margin", optional=True),
        "baseline_name": _text(timings.get("baseline_name", ""), "timings.baseline_name", 128),
        "baseline_ms": _finite(timings.get("baseline_ms"), "timings.baseline_ms", optional=True),
        "trials_run": _count(provenance.get("trials_run", 0), "provenance.trials_run", 0),
        "provenance": _text(provenance.get("text", ""), "provenance.text", 100_000),
        "created_at": _parse_time(provenance.get("created_at")),
        "stale": int(bool(verification.get("stale", False))),
        "verified_at": _parse_time(verification["verified_at"]) if verification.get("verified_at") else None,
        "verified_ms": _finite(verification.get("verified_ms"), "verification.verified_ms", optional=True),
        "verify_status": _text(verification.get("verify_status", ""), "verification.verify_status", 32),
        "regression": _finite(verification.get("regression"), "verification.regression", optional=True),
        **_serving_values(record.get("serving") or {}, family, problem, device),
    }
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
            "kernel_ms": _finite(serving.get("kernel_ms"), "serving.kernel_ms", optional=True, positive=True)}


# --- writing -------------------------------------------------------------------------------------


def _get_or_create(session: Session, model, lookup: dict, values: dict) -> int:
    row = session.execute(select(model.id).filter_by(**lookup)).scalar_one_or_none()
    if row is None:
        obj = model(**lookup, **values)
        session.add(obj)
        session.flush()
        return obj.id
    return row


def _write(session: Session, item: _Valid, policy: ConflictPolicy) -> str:
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
        return "unchanged"  # the same winner is stored already; its own timings stay
    if policy is ConflictPolicy.KEEP or (policy is ConflictPolicy.FASTER
                                         and existing.median_ms <= values["median_ms"]):
        return "kept-existing"
    for name, value in values.items():
        setattr(existing, name, value)
    session.flush()
    return "replaced"


def import_records(target_url: str | None, records: Iterable[tuple[int, dict | None, str]], source: str, *,
                   policy: ConflictPolicy = ConflictPolicy.KEEP, dry_run: bool = False) -> ImportReport:
    """Validate `records` and write the valid ones into `target_url` in one transaction."""
    report = ImportReport(source, dry_run=dry_run)
    valid = []
    for line, record, error in records:
        if error:
            report.skipped.append(Skipped(line, error))
            continue
        try:
            valid.append(validate_record(record, line))
        except _Bad as exc:
            report.skipped.append(Skipped(line, str(exc)))
    engine = open_engine(target_url, create=not dry_run)
    with Session(engine) as session:
        try:
            for item in valid:
                action = _write(session, item, policy)
                report.kept.append(Kept(item.line, item.family, item.problem_key, item.device.key, action))
            if dry_run:
                session.rollback()
            else:
                session.commit()
        except SQLAlchemyError as exc:
            session.rollback()
            raise DatabaseError(f"import into {engine.url} failed and was rolled back, nothing was written: "
                                f"{exc.__class__.__name__}: {exc}") from None
    return report


def import_file(target_url: str | None, path: Path, *, policy: ConflictPolicy = ConflictPolicy.KEEP,
                dry_run: bool = False) -> ImportReport:
    """Import an export file into `target_url`; see ImportReport for what was kept and skipped.

    >>> report = import_file("sqlite:////tmp/t.sqlite", Path("winners.jsonl"))  # doctest: +SKIP
    >>> report.counts()  # doctest: +SKIP
    {'added': 3, 'skipped': 1}
    """
    _header, records, truncated = read_export(Path(path))
    report = import_records(target_url, records, str(path), policy=policy, dry_run=dry_run)
    report.truncated = truncated
    return report


def merge_databases(target_url: str | None, source_urls: Iterable[str], *,
                    policy: ConflictPolicy = ConflictPolicy.FASTER, dry_run: bool = False) -> list[ImportReport]:
    """Merge the winners of other autotile databases into `target_url`, validated exactly like an import."""
    target = normalise_url(target_url) if target_url else None
    reports = []
    for source in source_urls:
        url = normalise_url(source)
        if target is not None and url == target:
            raise DatabaseError(f"{source} is the target database itself; name another one to merge from")
        records = [(number, record, "") for number, record in enumerate(export_records(open_engine(url, create=False)),
                                                                            start=1)]
        reports.append(import_records(target_url, records, source, policy=policy, dry_run=dry_run))
    return reports
