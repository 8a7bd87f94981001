"""The experience tier's state: runs, scoped statistics, the deployment's models, replicas and stream slots.

Revision ID: 0001
Revises:
Create Date: 2026-11-25
"""

import time

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "runs",
        sa.Column("run_id", sa.String(256), primary_key=True),
        sa.Column("owner", sa.String(80), nullable=False),
        sa.Column("created_at_unix_s", sa.Float, nullable=False),
        sa.Column("lora_rank", sa.Integer, nullable=True),
        sa.Column("lora_alpha", sa.Float, nullable=True),
        sa.Column("lora_target_modules", sa.Text, nullable=True),
        sa.Column("max_streams", sa.Integer, nullable=False),
        sa.Column("max_groups_ahead", sa.Integer, nullable=False),
        sa.Column("max_tokens_per_request", sa.BigInteger, nullable=False),
        sa.Column("weight", sa.Integer, nullable=False),
        sa.Column("policy_version", sa.Integer, nullable=False),
        sa.Column("weights_digest", sa.String(80), nullable=True),
        sa.Column("update_claim", sa.String(64), nullable=True),
        sa.Column("update_claim_until_unix_s", sa.Float, nullable=True),
        sa.Column("reward_count", sa.BigInteger, nullable=False),
        sa.Column("reward_mean", sa.Float, nullable=False),
        sa.Column("reward_m2", sa.Float, nullable=False),
        sa.Column("kl_coef", sa.Float, nullable=True),
        sa.Column("revision", sa.BigInteger, nullable=False),
    )
    op.create_table(
        "scoped_statistics",
        sa.Column("principal", sa.String(80), primary_key=True),
        sa.Column("run_id", sa.String(256), primary_key=True),
        sa.Column("reward_count", sa.BigInteger, nullable=False),
        sa.Column("reward_mean", sa.Float, nullable=False),
        sa.Column("reward_m2", sa.Float, nullable=False),
        sa.Column("kl_coef", sa.Float, nullable=True),
        sa.Column("updated_at_unix_s", sa.Float, nullable=False),
    )
    op.create_index("ix_scoped_statistics_updated", "scoped_statistics", ["updated_at_unix_s"])
    models = op.create_table(
        "models",
        sa.Column("target", sa.String(16), primary_key=True),
        sa.Column("version", sa.Integer, nullable=False),
        sa.Column("weights_digest", sa.String(80), nullable=True),
        sa.Column("update_claim", sa.String(64), nullable=True),
        sa.Column("update_claim_until_unix_s", sa.Float, nullable=True),
        sa.Column("updated_at_unix_s", sa.Float, nullable=False),
    )
    now = time.time()
    op.bulk_insert(models, [{"target": target, "version": 0, "updated_at_unix_s": now}
                            for target in ("policy", "critic")])
    op.create_table(
        "replicas",
        sa.Column("replica_id", sa.String(64), primary_key=True),
        sa.Column("address", sa.String(256), nullable=False),
        sa.Column("heartbeat_unix_s", sa.Float, nullable=False),
    )
    op.create_table(
        "stream_slots",
        sa.Column("slot_id", sa.String(64), primary_key=True),
        sa.Column("run_id", sa.String(256), nullable=False),
        sa.Column("replica_id", sa.String(64), nullable=False),
        sa.Column("opened_at_unix_s", sa.Float, nullable=False),
    )
    op.create_index("ix_stream_slots_run", "stream_slots", ["run_id"])


def downgrade() -> None:
    for table in ("stream_slots", "replicas", "models", "scoped_statistics", "runs"):
        op.drop_table(table)
