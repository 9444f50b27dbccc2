"""Delayed and scheduled delivery, in each conversation's order.

Revision ID: 0023
Revises: 0022
"""
from pathlib import Path

from alembic import op

from broker.migrate import run_sql_file

revision = "0023"
down_revision = "0022"
branch_labels = None
depends_on = None

_HERE = Path(__file__).parent


def upgrade() -> None:
    op.execute("SET LOCAL lock_timeout = '10s'")
    run_sql_file(_HERE / "0023_delayed_delivery.upgrade.sql")


def downgrade() -> None:
    op.execute("SET LOCAL lock_timeout = '10s'")
    run_sql_file(_HERE / "0023_delayed_delivery.downgrade.sql")
