"""The shipped tuning database: winners copied out of tuning runs, and a sorted text dump of them.

`tuning_db/winners.sqlite` holds winners and tuned policies only (no trials);
`tuning_db/winners.txt` is its sorted, line-per-record dump, so a pull request
shows what changed and CI can check that the two agree.
"""
from __future__ import annotations

import json
from pathlib import Path

from sqlalchemy import Engine, select
from sqlalchemy.orm import Session

from autotile.families.base import VENDOR_KEY
from autotile.store.db import open_engine, read_only_url
from autotile.store.models import Device, Policy, Problem, Toolchain, Winner


def dump_winners(engine: Engine) -> str:
    """One line per winner, sorted: family, device, problem key, config, timings, toolchain."""
    lines = []
    with Session(engine) as session:
        rows = session.execute(
            select(Winner, Problem, Toolchain).join(Problem, Winner.problem_id == Problem.id)
            .join(Toolchain, Winner.toolchain_id == Toolchain.id)
        ).all()
        for w, p, t in rows:
            record = {
                "family": p.family, "device": w.device_key, "problem": json.loads(p.key), "config": json.loads(w.config),
                "median_ms": round(w.median_ms, 6), "baseline": w.baseline_name,
                "baseline_ms": round(w.baseline_ms, 6) if w.baseline_ms else None, "trials": w.trials_run,
                "toolchain": f"torch {t.torch}, triton {t.triton}, cuda {t.cuda}",
            }
            if w.verified_range:
                record["verified_range"] = w.verified_range
            if w.kernel_config:
                record["kernel_config"], record["kernel_ms"] = json.loads(w.kernel_config), w.kernel_ms
            lines.append(json.dumps(record, sort_keys=True, separators=(",", ":")))
        for p, t in session.execute(select(Policy, Toolchain).join(Toolchain, Policy.toolchain_id == Toolchain.id)).all():
            record = {"policy": p.family, "device": p.device_key, "fixed": p.params, "verified_range": p.verified_range,
                      "config": json.loads(p.config), "samples": p.samples, "min_ratio": round(p.min_ratio, 4),
                      "geomean_ratio": round(p.geomean_ratio, 4),
                      "toolchain": f"torch {t.torch}, triton {t.triton}, cuda {t.cuda}"}
            lines.append(json.dumps(record, sort_keys=True, separators=(",", ":")))
    return "\n".join(sorted(lines)) + "\n"


def _copy(session: Session, model, row, **overrides):
    values = {c.name: getattr(row, c.name) for c in model.__table__.columns if c.name != "id"}
    values.update(overrides)
    return values


def _device_and_toolchain(src: Session, target, device_row, toolchain_row) -> tuple[int, int]:
    """The target's ids of a source row's device and toolchain (created there when missing)."""
    device_values = _copy(src, Device, device_row)
    device_values.pop("fingerprint")
    device_id = target._get_or_create(Device, {"fingerprint": device_row.fingerprint}, device_values)
    toolchain_id = target._get_or_create(
        Toolchain, {c: getattr(toolchain_row, c) for c in ("torch", "triton", "cuda", "python", "autotile")}, {})
    return device_id, toolchain_id


def _is_vendor(config_text: str) -> bool:
    return VENDOR_KEY in json.loads(config_text)


def _fills_a_gap(source: Winner, existing: Winner | None) -> bool:
    """copy_winners(keep_generated=True): a generated winner verified over its bucket goes where the target has no
    winner or the vendor op's; a vendor winner only where it has none; a generated winner is never replaced."""
    if _is_vendor(source.config):
        return existing is None
    return bool(source.verified_range) and (existing is None or _is_vendor(existing.config))


def copy_winners(source_url: str, target_url: str, *, keep_generated: bool = False) -> int:
    """Copy the winners of `source_url` (with their problem, device and toolchain) into `target_url`.

    A winner for the same (problem, device) in the target is replaced. With `keep_generated`, only what fills a
    gap is copied (_fills_a_gap): a short tuning run (a model's trace) adds the kernels it found where the target
    serves the vendor op or nothing, and never undoes the generated winners of a longer one. Returns how many
    were copied.
    """
    from autotile.store.repo import Store

    source = open_engine(source_url, create=False)
    target = Store(open_engine(target_url, create=True))
    copied = 0
    with Session(source) as src:
        rows = src.execute(
            select(Winner, Problem, Device, Toolchain).join(Problem, Winner.problem_id == Problem.id)
            .join(Device, Winner.device_id == Device.id).join(Toolchain, Winner.toolchain_id == Toolchain.id)
        ).all()
        for w, p, d, t in rows:
            problem_id = target._get_or_create(Problem, {"family": p.family, "key": p.key},
                                               {"bucket": p.bucket, "params": p.params})
            device_id, toolchain_id = _device_and_toolchain(src, target, d, t)
            with Session(target.engine) as dst:
                existing = dst.execute(select(Winner).where(Winner.problem_id == problem_id,
                                                            Winner.device_key == w.device_key)).scalar_one_or_none()
                if keep_generated and not _fills_a_gap(w, existing):
                    continue
                if existing is not None:
                    dst.delete(existing)
                    dst.flush()
                dst.add(Winner(**_copy(src, Winner, w, problem_id=problem_id, device_id=device_id,
                                       toolchain_id=toolchain_id)))
                dst.commit()
            copied += 1
    return copied


def copy_policies(source_url: str, target_url: str) -> int:
    """Copy every tuned policy of `source_url` into `target_url` (replacing one of the same identity)."""
    from autotile.store.repo import Store

    source = open_engine(source_url, create=False)
    target = Store(open_engine(target_url, create=True))
    copied = 0
    with Session(source) as src:
        for p, d, t in src.execute(select(Policy, Device, Toolchain).join(Device, Policy.device_id == Device.id)
                                   .join(Toolchain, Policy.toolchain_id == Toolchain.id)).all():
            device_id, toolchain_id = _device_and_toolchain(src, target, d, t)
            with Session(target.engine) as dst:
                existing = dst.execute(select(Policy).where(
                    Policy.family == p.family, Policy.device_key == p.device_key, Policy.key == p.key,
                    Policy.range_key == p.range_key)).scalar_one_or_none()
                if existing is not None:
                    dst.delete(existing)
                    dst.flush()
                dst.add(Policy(**_copy(src, Policy, p, device_id=device_id, toolchain_id=toolchain_id)))
                dst.commit()
            copied += 1
    return copied


def write_dump(db_path: Path, dump_path: Path) -> None:
    # Read-only: a writable engine would switch the file to WAL mode, and the shipped file must stay one file.
    dump_path.write_text(dump_winners(open_engine(read_only_url(db_path), create=False)))
