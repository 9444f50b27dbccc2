"""Hygiene: closed conversations are forgotten after a retention; counts that show a leak.

Revision ID: 0005
Revises: 0004
"""
from pathlib import Path

from alembic import op

from broker.migrate import run_sql_file

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

_HERE = Path(__file__).parent


def upgrade() -> None:
    op.execute("SET LOCAL lock_timeout = '10s'")
    run_sql_file(_HERE / "0005_hygiene.upgrade.sql")


def downgrade() -> None:
    op.execute("SET LOCAL lock_timeout = '10s'")
    run_sql_file(_HERE / "0005_hygiene.downgrade.sql")
