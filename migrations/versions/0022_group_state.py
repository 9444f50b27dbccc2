"""State kept per conversation group, with the group.

Revision ID: 0022
Revises: 0021
"""
from pathlib import Path

from alembic import op

from broker.migrate import run_sql_file

revision = "0022"
down_revision = "0021"
branch_labels = None
depends_on = None

_HERE = Path(__file__).parent


def upgrade() -> None:
    op.execute("SET LOCAL lock_timeout = '10s'")
    run_sql_file(_HERE / "0022_group_state.upgrade.sql")


def downgrade() -> None:
    op.execute("SET LOCAL lock_timeout = '10s'")
    run_sql_file(_HERE / "0022_group_state.downgrade.sql")
