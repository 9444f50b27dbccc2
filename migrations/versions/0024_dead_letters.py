"""Dead letters to manage: dead-lettered by a reader, resubmitted in order, purged.

Revision ID: 0024
Revises: 0023
"""
from pathlib import Path

from alembic import op

from broker.migrate import run_sql_file

revision = "0024"
down_revision = "0023"
branch_labels = None
depends_on = None

_HERE = Path(__file__).parent


def upgrade() -> None:
    op.execute("SET LOCAL lock_timeout = '10s'")
    run_sql_file(_HERE / "0024_dead_letters.upgrade.sql")


def downgrade() -> None:
    op.execute("SET LOCAL lock_timeout = '10s'")
    run_sql_file(_HERE / "0024_dead_letters.downgrade.sql")
