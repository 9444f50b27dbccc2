"""The node counts the rollbacks that SQL readers did not report: a reader that keeps rolling back ends in the dead
letters.

Revision ID: 0026
Revises: 0025
"""
from pathlib import Path

from alembic import op

from broker.migrate import run_sql_file

revision = "0026"
down_revision = "0025"
branch_labels = None
depends_on = None

_HERE = Path(__file__).parent


def upgrade() -> None:
    op.execute("SET LOCAL lock_timeout = '10s'")
    run_sql_file(_HERE / "0026_unreported_rollbacks.upgrade.sql")


def downgrade() -> None:
    op.execute("SET LOCAL lock_timeout = '10s'")
    run_sql_file(_HERE / "0026_unreported_rollbacks.downgrade.sql")
