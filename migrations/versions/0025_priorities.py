"""Conversation priorities (Service Broker's BROKER PRIORITY), honoured by receive and by the relay.

Revision ID: 0025
Revises: 0024
"""
from pathlib import Path

from alembic import op

from broker.migrate import run_sql_file

revision = "0025"
down_revision = "0024"
branch_labels = None
depends_on = None

_HERE = Path(__file__).parent


def upgrade() -> None:
    op.execute("SET LOCAL lock_timeout = '10s'")
    run_sql_file(_HERE / "0025_priorities.upgrade.sql")


def downgrade() -> None:
    op.execute("SET LOCAL lock_timeout = '10s'")
    run_sql_file(_HERE / "0025_priorities.downgrade.sql")
