"""A failed transmission costs one row, however many messages wait.

Revision ID: 0016
Revises: 0015
"""
from pathlib import Path

from alembic import op

from broker.migrate import run_sql_file

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None

_HERE = Path(__file__).parent


def upgrade() -> None:
    op.execute("SET LOCAL lock_timeout = '10s'")
    run_sql_file(_HERE / "0016_transmission_failures.upgrade.sql")


def downgrade() -> None:
    op.execute("SET LOCAL lock_timeout = '10s'")
    run_sql_file(_HERE / "0016_transmission_failures.downgrade.sql")
