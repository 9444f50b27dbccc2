"""Receive by conversation handle, the whole group, or waiting until a message comes.

Revision ID: 0020
Revises: 0019
"""
from pathlib import Path

from alembic import op

from broker.migrate import run_sql_file

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None

_HERE = Path(__file__).parent


def upgrade() -> None:
    op.execute("SET LOCAL lock_timeout = '10s'")
    run_sql_file(_HERE / "0020_receive_by_conversation.upgrade.sql")


def downgrade() -> None:
    op.execute("SET LOCAL lock_timeout = '10s'")
    run_sql_file(_HERE / "0020_receive_by_conversation.downgrade.sql")
