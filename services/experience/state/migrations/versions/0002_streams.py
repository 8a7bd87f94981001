"""Resumable streams' records, and the stream each run's slot belongs to.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-25
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "streams",
        sa.Column("principal", sa.String(80), primary_key=True),
        sa.Column("stream_id", sa.String(128), primary_key=True),
        sa.Column("fingerprint", sa.String(80), nullable=False),
        sa.Column("start_version", sa.Integer, nullable=False),
        sa.Column("opens", sa.Integer, nullable=False),
        sa.Column("counted", sa.Text, nullable=False),
        sa.Column("used_at_unix_s", sa.Float, nullable=False),
    )
    op.create_index("ix_streams_used", "streams", ["used_at_unix_s"])
    op.add_column("stream_slots", sa.Column("stream_key", sa.String(256), nullable=True))


def downgrade() -> None:
    op.drop_column("stream_slots", "stream_key")
    op.drop_index("ix_streams_used", table_name="streams")
    op.drop_table("streams")
