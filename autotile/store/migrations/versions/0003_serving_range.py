"""Serving ranges and the vendor op as a candidate: verified_range, kernel_config, kernel_ms (schema_version 3).

Revision ID: 0003
Revises: 0002
"""
import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

_meta = sa.table("autotile_meta", sa.column("key", sa.String), sa.column("value", sa.String))


def upgrade() -> None:
    with op.batch_alter_table("autotile_winners") as batch:
        # {serving field: [lo, hi]} the winner was re-timed over beside the vendor op; NULL: its own shape only.
        batch.add_column(sa.Column("verified_range", sa.JSON, nullable=True))
        # The fastest generated kernel's config and time, kept when the vendor op won (AUTOTILE_VENDOR=0 serves it).
        batch.add_column(sa.Column("kernel_config", sa.Text, nullable=True))
        batch.add_column(sa.Column("kernel_ms", sa.Float, nullable=True))
    op.execute(_meta.update().where(_meta.c.key == "schema_version").values(value="3"))


def downgrade() -> None:
    with op.batch_alter_table("autotile_winners") as batch:
        for name in ("kernel_ms", "kernel_config", "verified_range"):
            batch.drop_column(name)
    op.execute(_meta.update().where(_meta.c.key == "schema_version").values(value="2"))
