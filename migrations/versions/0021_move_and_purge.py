"""A conversation moves to another group, and a queue can be purged.

Revision ID: 0021
Revises: 0020
"""
from pathlib import Path

from alembic import op

from broker.migrate import run_sql_file

revision = "0021"
down_revision = "0020"
branch_labels = None
depends_on = None

_HERE = Path(__file__).parent


def upgrade() -> None:
    op.execute("SET LOCAL lock_timeout = '10s'")
    run_sql_file(_HERE / "0021_move_and_purge.upgrade.sql")


def downgrade() -> None:
    op.execute("SET LOCAL lock_timeout = '10s'")
    run_sql_file(_HERE / "0021_move_and_purge.downgrade.sql")
