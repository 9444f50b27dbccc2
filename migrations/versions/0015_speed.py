"""Plans that no longer grow with the tables: rows looked up by their keys.

Revision ID: 0015
Revises: 0014
"""
from pathlib import Path

from alembic import op

from broker.migrate import run_sql_file

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None

_HERE = Path(__file__).parent


def upgrade() -> None:
    op.execute("SET LOCAL lock_timeout = '10s'")
    run_sql_file(_HERE / "0015_speed.upgrade.sql")


def downgrade() -> None:
    op.execute("SET LOCAL lock_timeout = '10s'")
    run_sql_file(_HERE / "0015_speed.downgrade.sql")
