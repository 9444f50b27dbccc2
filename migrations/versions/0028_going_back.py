"""A database that goes back to an earlier point is found, healed from a resend window where it can be, and never silent.

Revision ID: 0028
Revises: 0027
"""
from pathlib import Path

from alembic import op

from broker.migrate import run_sql_file

revision = "0028"
down_revision = "0027"
branch_labels = None
depends_on = None

_HERE = Path(__file__).parent


def upgrade() -> None:
    op.execute("SET LOCAL lock_timeout = '10s'")
    run_sql_file(_HERE / "0028_going_back.upgrade.sql")


def downgrade() -> None:
    op.execute("SET LOCAL lock_timeout = '10s'")
    run_sql_file(_HERE / "0028_going_back.downgrade.sql")
