"""Alembic migrations of autotile's tables, run programmatically (no alembic.ini needed).

Imported by the tuner and the CLI only; the runtime never migrates.
"""
from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config as AlembicConfig
from sqlalchemy import Engine

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"


def alembic_config(engine: Engine) -> AlembicConfig:
    cfg = AlembicConfig()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.attributes["engine"] = engine
    return cfg


def upgrade_to_head(engine: Engine) -> None:
    command.upgrade(alembic_config(engine), "head")


def upgrade_to(engine: Engine, revision: str) -> None:
    command.upgrade(alembic_config(engine), revision)
