"""Conversation edges: leases that never wedge a queue, cancelled work dropped, lifetimes and timers on time,
notices after the messages they follow.

Revision ID: 0008
Revises: 0007
"""
from pathlib import Path

from alembic import op

from broker.migrate import run_sql_file

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

_HERE = Path(__file__).parent


def upgrade() -> None:
    op.execute("SET LOCAL lock_timeout = '10s'")
    run_sql_file(_HERE / "0008_conversation_edges.upgrade.sql")


def downgrade() -> None:
    op.execute("SET LOCAL lock_timeout = '10s'")
    run_sql_file(_HERE / "0008_conversation_edges.downgrade.sql")
