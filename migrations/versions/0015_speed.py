"""Speed: receive and the relay's answers find their rows through the primary key.

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
