"""Serving ranges, the vendor op as a candidate, tuned policies (schema_version 3).

Winners gain verified_range, kernel_config and kernel_ms; the new table autotile_policies holds tuned policies.

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
    op.create_table(
        "autotile_policies",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("family", sa.String(32), nullable=False, index=True),
        sa.Column("device_key", sa.String(64), nullable=False, index=True),
        sa.Column("device_id", sa.Integer, sa.ForeignKey("autotile_devices.id"), nullable=False),
        sa.Column("toolchain_id", sa.Integer, sa.ForeignKey("autotile_toolchains.id"), nullable=False),
        sa.Column("key", sa.Text, nullable=False),
        sa.Column("range_key", sa.String(256), nullable=False),
        sa.Column("params", sa.JSON, nullable=False),
        sa.Column("verified_range", sa.JSON, nullable=False),
        sa.Column("config", sa.Text, nullable=False),
        sa.Column("samples", sa.Integer, nullable=False),
        sa.Column("min_ratio", sa.Float, nullable=False),
        sa.Column("geomean_ratio", sa.Float, nullable=False),
        sa.Column("provenance", sa.Text, nullable=False, server_default=""),
        sa.Column("created_at", sa.DateTime),
        sa.UniqueConstraint("family", "device_key", "key", "range_key", name="uq_policy"),
    )
    op.execute(_meta.update().where(_meta.c.key == "schema_version").values(value="3"))


def downgrade() -> None:
    op.drop_table("autotile_policies")
    with op.batch_alter_table("autotile_winners") as batch:
        for name in ("kernel_ms", "kernel_config", "verified_range"):
            batch.drop_column(name)
    op.execute(_meta.update().where(_meta.c.key == "schema_version").values(value="2"))
