"""SQLAlchemy models of autotile's tables.

Every table is prefixed `autotile_` so the same database can also hold
Optuna's study storage (whose tables are named `trials`, `studies`, ...).
"""
from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from sqlalchemy import (
    JSON, BigInteger, DateTime, Float, ForeignKey, Integer, String, Text, TypeDecorator, UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

# Bump with every Alembic revision that changes these tables.
SCHEMA_VERSION = 3
VERSION_TABLE = "autotile_alembic_version"


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc).replace(tzinfo=None)


@dataclass(frozen=True)
class DamagedJSON:
    """What a TolerantJSON column holds when its stored text is not JSON: the start of that text."""

    text: str

    def __bool__(self) -> bool:
        return False  # reads as "no value" wherever a range is tested for, and is never served as one


def _tolerant(parse, damaged):
    """A column's result processor that reads a value `parse` cannot as damaged(value), not an exception."""
    if parse is None:
        return None

    def process(value):
        try:
            return parse(value)
        except (ValueError, TypeError):
            return damaged(value)

    return process


class TolerantJSON(TypeDecorator):
    """A JSON column whose damaged value (edited by hand, cut short) reads back as DamagedJSON, not an exception.

    With plain JSON one damaged value fails the whole query that reads it, so every other row of the result is
    lost with it (the runtime then stopped serving from the database). The DDL is JSON's.
    """

    impl = JSON
    cache_ok = True

    def process_bind_param(self, value, dialect):
        return None if isinstance(value, DamagedJSON) else value  # a copied row carries no damaged text along

    def result_processor(self, dialect, coltype):
        return _tolerant(super().result_processor(dialect, coltype), lambda value: DamagedJSON(str(value)[:200]))


class TolerantDateTime(TypeDecorator):
    """A DateTime column whose damaged value (edited by hand) reads back as None, not an exception: as with
    TolerantJSON, one unparsable time failed every query that read the column, and the runtime stopped serving from
    the whole database. The DDL is DateTime's."""

    impl = DateTime
    cache_ok = True

    def result_processor(self, dialect, coltype):
        return _tolerant(super().result_processor(dialect, coltype), lambda value: None)


class Base(DeclarativeBase):
    pass


class Meta(Base):
    """Key/value facts about the database itself: schema_version, created_by."""

    __tablename__ = "autotile_meta"
    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[str] = mapped_column(String(256))


class Device(Base):
    __tablename__ = "autotile_devices"
    __table_args__ = (UniqueConstraint("fingerprint", name="uq_device_fingerprint"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    fingerprint: Mapped[str] = mapped_column(String(64))  # hash of every field below
    key: Mapped[str] = mapped_column(String(64), index=True)  # profile/arch, what winners are keyed by
    profile: Mapped[str] = mapped_column(String(64))
    name: Mapped[str] = mapped_column(String(128))
    compute_capability: Mapped[str] = mapped_column(String(16))
    sm_count: Mapped[int] = mapped_column(Integer)
    memory_bytes: Mapped[int] = mapped_column(BigInteger)
    smem_per_block: Mapped[int] = mapped_column(Integer)
    driver: Mapped[str] = mapped_column(String(64))


class Toolchain(Base):
    __tablename__ = "autotile_toolchains"
    __table_args__ = (UniqueConstraint("torch", "triton", "cuda", "python", "autotile", name="uq_toolchain"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    torch: Mapped[str] = mapped_column(String(64))
    triton: Mapped[str] = mapped_column(String(64))
    cuda: Mapped[str] = mapped_column(String(64))
    python: Mapped[str] = mapped_column(String(32))
    autotile: Mapped[str] = mapped_column(String(32))


class Problem(Base):
    __tablename__ = "autotile_problems"
    __table_args__ = (UniqueConstraint("family", "key", name="uq_problem"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    family: Mapped[str] = mapped_column(String(32), index=True)
    key: Mapped[str] = mapped_column(Text)  # canonical JSON of the problem
    bucket: Mapped[str] = mapped_column(Text)
    params: Mapped[dict] = mapped_column(JSON)


class Trial(Base):
    __tablename__ = "autotile_trials"
    __table_args__ = (UniqueConstraint("study", "number", name="uq_trial_in_study"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    problem_id: Mapped[int] = mapped_column(ForeignKey("autotile_problems.id"), index=True)
    device_id: Mapped[int] = mapped_column(ForeignKey("autotile_devices.id"))
    toolchain_id: Mapped[int] = mapped_column(ForeignKey("autotile_toolchains.id"))
    study: Mapped[str] = mapped_column(String(200))
    number: Mapped[int] = mapped_column(Integer)  # Optuna's trial number within the study
    config: Mapped[str] = mapped_column(Text)  # canonical JSON
    config_hash: Mapped[str] = mapped_column(String(32), index=True)
    status: Mapped[str] = mapped_column(String(32))
    median_ms: Mapped[float | None] = mapped_column(Float, nullable=True)
    q20_ms: Mapped[float | None] = mapped_column(Float, nullable=True)
    q80_ms: Mapped[float | None] = mapped_column(Float, nullable=True)
    interpreted: Mapped[int] = mapped_column(Integer, default=0)
    max_abs_error: Mapped[float | None] = mapped_column(Float, nullable=True)
    error: Mapped[str] = mapped_column(Text, default="")
    created_at: Mapped[dt.datetime] = mapped_column(TolerantDateTime, default=_now)


class Winner(Base):
    __tablename__ = "autotile_winners"
    __table_args__ = (UniqueConstraint("problem_id", "device_key", name="uq_winner"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    problem_id: Mapped[int] = mapped_column(ForeignKey("autotile_problems.id"), index=True)
    device_key: Mapped[str] = mapped_column(String(64), index=True)
    device_id: Mapped[int] = mapped_column(ForeignKey("autotile_devices.id"))
    toolchain_id: Mapped[int] = mapped_column(ForeignKey("autotile_toolchains.id"))
    config: Mapped[str] = mapped_column(Text)
    config_hash: Mapped[str] = mapped_column(String(32))
    median_ms: Mapped[float] = mapped_column(Float)
    q20_ms: Mapped[float] = mapped_column(Float)
    q80_ms: Mapped[float] = mapped_column(Float)
    interpreted: Mapped[int] = mapped_column(Integer, default=0)
    runner_up_ms: Mapped[float | None] = mapped_column(Float, nullable=True)
    margin: Mapped[float | None] = mapped_column(Float, nullable=True)  # runner_up / winner - 1
    baseline_name: Mapped[str] = mapped_column(String(128), default="")
    baseline_ms: Mapped[float | None] = mapped_column(Float, nullable=True)
    trials_run: Mapped[int] = mapped_column(Integer, default=0)
    provenance: Mapped[str] = mapped_column(Text, default="")
    created_at: Mapped[dt.datetime] = mapped_column(TolerantDateTime, default=_now)
    # Schema 2 (revision 0002): staleness and verification on this GPU. A stale winner is still served.
    stale: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    verified_at: Mapped[dt.datetime | None] = mapped_column(TolerantDateTime, nullable=True)
    verified_ms: Mapped[float | None] = mapped_column(Float, nullable=True)
    verify_status: Mapped[str] = mapped_column(String(32), default="", server_default="")  # VerifyStatus value
    regression: Mapped[float | None] = mapped_column(Float, nullable=True)  # verified_ms / median_ms - 1 when slower
    # Schema 3 (revision 0003): where the winner may serve, and the best generated kernel when the vendor op won.
    verified_range: Mapped[dict | None] = mapped_column(TolerantJSON, nullable=True)  # {serving field: [lo, hi]}
    kernel_config: Mapped[str | None] = mapped_column(Text, nullable=True)
    kernel_ms: Mapped[float | None] = mapped_column(Float, nullable=True)


class Policy(Base):
    """A tuned policy (schema 3): across a verified range of shapes the family's own choice beats the vendor op.

    `key` is the canonical JSON of the problem fields the policy holds fixed (dtype, layouts, epilogue);
    `verified_range` is {shape field: [lo, hi]} over which every sampled shape was re-timed beside the vendor
    op and won by at least the stored `min_ratio`. `config` is {"POLICY": "default"} (the family's
    default_config for each call) or a fixed config of the space.
    """

    __tablename__ = "autotile_policies"
    __table_args__ = (UniqueConstraint("family", "device_key", "key", "range_key", name="uq_policy"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    family: Mapped[str] = mapped_column(String(32), index=True)
    device_key: Mapped[str] = mapped_column(String(64), index=True)
    device_id: Mapped[int] = mapped_column(ForeignKey("autotile_devices.id"))
    toolchain_id: Mapped[int] = mapped_column(ForeignKey("autotile_toolchains.id"))
    key: Mapped[str] = mapped_column(Text)  # canonical JSON of the fixed problem fields
    range_key: Mapped[str] = mapped_column(String(256))  # canonical JSON of verified_range (part of the identity)
    params: Mapped[dict] = mapped_column(JSON)  # the fixed fields
    verified_range: Mapped[dict] = mapped_column(TolerantJSON)
    config: Mapped[str] = mapped_column(Text)
    samples: Mapped[int] = mapped_column(Integer)  # shapes re-timed beside the vendor op
    min_ratio: Mapped[float] = mapped_column(Float)  # smallest vendor_ms / ours over the samples
    geomean_ratio: Mapped[float] = mapped_column(Float)
    provenance: Mapped[str] = mapped_column(Text, default="")
    created_at: Mapped[dt.datetime] = mapped_column(TolerantDateTime, default=_now)

