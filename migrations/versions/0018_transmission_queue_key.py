"""The transmission queue is keyed by destination service first: one index fewer.

Revision ID: 0018
Revises: 0017
"""
from pathlib import Path

from alembic import op

from broker.migrate import run_sql_file

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None

_HERE = Path(__file__).parent


def upgrade() -> None:
    op.execute("SET LOCAL lock_timeout = '10s'")
    run_sql_file(_HERE / "0018_transmission_queue_key.upgrade.sql")


def downgrade() -> None:
    op.execute("SET LOCAL lock_timeout = '10s'")
    run_sql_file(_HERE / "0018_transmission_queue_key.downgrade.sql")
