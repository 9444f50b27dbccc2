"""A receive with a lock takes a byte budget as well as a number of messages.

Revision ID: 0013
Revises: 0012
"""
from pathlib import Path

from alembic import op

from broker.migrate import run_sql_file

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

_HERE = Path(__file__).parent


def upgrade() -> None:
    op.execute("SET LOCAL lock_timeout = '10s'")
    run_sql_file(_HERE / "0013_receive_budget.upgrade.sql")


def downgrade() -> None:
    op.execute("SET LOCAL lock_timeout = '10s'")
    run_sql_file(_HERE / "0013_receive_budget.downgrade.sql")
