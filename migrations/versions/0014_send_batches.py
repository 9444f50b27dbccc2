"""Batches of sends in one statement: send_batch to local far sides set-based, and send_numbered_batch.

Revision ID: 0014
Revises: 0013
"""
from pathlib import Path

from alembic import op

from broker.migrate import run_sql_file

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None

_HERE = Path(__file__).parent


def upgrade() -> None:
    op.execute("SET LOCAL lock_timeout = '10s'")
    run_sql_file(_HERE / "0014_send_batches.upgrade.sql")


def downgrade() -> None:
    op.execute("SET LOCAL lock_timeout = '10s'")
    run_sql_file(_HERE / "0014_send_batches.downgrade.sql")
