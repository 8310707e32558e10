"""Winner staleness and verification: stale, verified_at, verified_ms, verify_status, regression (schema_version 2).

Revision ID: 0002
Revises: 0001
"""
import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

_meta = sa.table("autotile_meta", sa.column("key", sa.String), sa.column("value", sa.String))


def upgrade() -> None:
    with op.batch_alter_table("autotile_winners") as batch:
        # 1 when the winner was tuned with another torch/triton/CUDA or GPU driver than the last check saw.
        batch.add_column(sa.Column("stale", sa.Integer, nullable=False, server_default="0"))
        batch.add_column(sa.Column("verified_at", sa.DateTime, nullable=True))
        batch.add_column(sa.Column("verified_ms", sa.Float, nullable=True))
        batch.add_column(sa.Column("verify_status", sa.String(32), nullable=False, server_default=""))
        # verified_ms / median_ms - 1 when a verification found the winner slower than stored, else NULL.
        batch.add_column(sa.Column("regression", sa.Float, nullable=True))
    op.execute(_meta.update().where(_meta.c.key == "schema_version").values(value="2"))


def downgrade() -> None:
    with op.batch_alter_table("autotile_winners") as batch:
        for name in ("regression", "verify_status", "verified_ms", "verified_at", "stale"):
            batch.drop_column(name)
    op.execute(_meta.update().where(_meta.c.key == "schema_version").values(value="1"))
