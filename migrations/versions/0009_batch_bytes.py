"""Batches bounded by bytes as well as by count, so that any backlog drains.

Revision ID: 0009
Revises: 0008
"""
from pathlib import Path

from alembic import op

from broker.migrate import run_sql_file

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

_HERE = Path(__file__).parent


def upgrade() -> None:
    op.execute("SET LOCAL lock_timeout = '10s'")
    run_sql_file(_HERE / "0009_batch_bytes.upgrade.sql")


def downgrade() -> None:
    op.execute("SET LOCAL lock_timeout = '10s'")
    run_sql_file(_HERE / "0009_batch_bytes.downgrade.sql")
