"""The first schema: devices, toolchains, problems, trials, winners, meta (schema_version 1).

Revision ID: 0001
Revises:
"""
import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "autotile_meta",
        sa.Column("key", sa.String(64), primary_key=True),
        sa.Column("value", sa.String(256), nullable=False),
    )
    op.create_table(
        "autotile_devices",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("fingerprint", sa.String(64), nullable=False),
        sa.Column("key", sa.String(64), nullable=False, index=True),
        sa.Column("profile", sa.String(64), nullable=False),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("compute_capability", sa.String(16), nullable=False),
        sa.Column("sm_count", sa.Integer, nullable=False),
        sa.Column("memory_bytes", sa.BigInteger, nullable=False),
        sa.Column("smem_per_block", sa.Integer, nullable=False),
        sa.Column("driver", sa.String(64), nullable=False),
        sa.UniqueConstraint("fingerprint", name="uq_device_fingerprint"),
    )
    op.create_table(
        "autotile_toolchains",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("torch", sa.String(64), nullable=False),
        sa.Column("triton", sa.String(64), nullable=False),
        sa.Column("cuda", sa.String(64), nullable=False),
        sa.Column("python", sa.String(32), nullable=False),
        sa.Column("autotile", sa.String(32), nullable=False),
        sa.UniqueConstraint("torch", "triton", "cuda", "python", "autotile", name="uq_toolchain"),
    )
    op.create_table(
        "autotile_problems",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("family", sa.String(32), nullable=False, index=True),
        sa.Column("key", sa.Text, nullable=False),
        sa.Column("bucket", sa.Text, nullable=False),
        sa.Column("params", sa.JSON, nullable=False),
        sa.UniqueConstraint("family", "key", name="uq_problem"),
    )
    op.create_table(
        "autotile_trials",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("problem_id", sa.Integer, sa.ForeignKey("autotile_problems.id"), nullable=False, index=True),
        sa.Column("device_id", sa.Integer, sa.ForeignKey("autotile_devices.id"), nullable=False),
        sa.Column("toolchain_id", sa.Integer, sa.ForeignKey("autotile_toolchains.id"), nullable=False),
        sa.Column("study", sa.String(200), nullable=False),
        sa.Column("number", sa.Integer, nullable=False),
        sa.Column("config", sa.Text, nullable=False),
        sa.Column("config_hash", sa.String(32), nullable=False, index=True),
        sa.Column("status", sa.String(32), nullable=False),
        sa.Column("median_ms", sa.Float),
        sa.Column("q20_ms", sa.Float),
        sa.Column("q80_ms", sa.Float),
        sa.Column("interpreted", sa.Integer, nullable=False),
        sa.Column("max_abs_error", sa.Float),
        sa.Column("error", sa.Text, nullable=False),
        sa.Column("created_at", sa.DateTime, nullable=False),
        sa.UniqueConstraint("study", "number", name="uq_trial_in_study"),
    )
    op.create_table(
        "autotile_winners",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("problem_id", sa.Integer, sa.ForeignKey("autotile_problems.id"), nullable=False, index=True),
        sa.Column("device_key", sa.String(64), nullable=False, index=True),
        sa.Column("device_id", sa.Integer, sa.ForeignKey("autotile_devices.id"), nullable=False),
        sa.Column("toolchain_id", sa.Integer, sa.ForeignKey("autotile_toolchains.id"), nullable=False),
        sa.Column("config", sa.Text, nullable=False),
        sa.Column("config_hash", sa.String(32), nullable=False),
        sa.Column("median_ms", sa.Float, nullable=False),
        sa.Column("q20_ms", sa.Float, nullable=False),
        sa.Column("q80_ms", sa.Float, nullable=False),
        sa.Column("interpreted", sa.Integer, nullable=False),
        sa.Column("runner_up_ms", sa.Float),
        sa.Column("margin", sa.Float),
        sa.Column("baseline_name", sa.String(128), nullable=False),
        sa.Column("baseline_ms", sa.Float),
        sa.Column("trials_run", sa.Integer, nullable=False),
        sa.Column("provenance", sa.Text, nullable=False),
        sa.Column("created_at", sa.DateTime, nullable=False),
        sa.UniqueConstraint("problem_id", "device_key", name="uq_winner"),
    )
    op.bulk_insert(
        sa.table("autotile_meta", sa.column("key", sa.String), sa.column("value", sa.String)),
        [{"key": "schema_version", "value": "1"}, {"key": "created_by", "value": "autotile"}],
    )


def downgrade() -> None:
    for table in ("autotile_winners", "autotile_trials", "autotile_problems", "autotile_toolchains",
                  "autotile_devices", "autotile_meta"):
        op.drop_table(table)
