"""A lock can be renewed, and a lost lock says why.

Revision ID: 0019
Revises: 0018
"""
from pathlib import Path

from alembic import op

from broker.migrate import run_sql_file

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None

_HERE = Path(__file__).parent


def upgrade() -> None:
    op.execute("SET LOCAL lock_timeout = '10s'")
    run_sql_file(_HERE / "0019_lock_renewal.upgrade.sql")


def downgrade() -> None:
    op.execute("SET LOCAL lock_timeout = '10s'")
    run_sql_file(_HERE / "0019_lock_renewal.downgrade.sql")
