"""The Spark ingest's lock, checked where a run commits.

Revision ID: 0010
Revises: 0009
"""
from pathlib import Path

from alembic import op

from broker.migrate import run_sql_file

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

_HERE = Path(__file__).parent


def upgrade() -> None:
    op.execute("SET LOCAL lock_timeout = '10s'")
    run_sql_file(_HERE / "0010_ingest_lock.upgrade.sql")


def downgrade() -> None:
    op.execute("SET LOCAL lock_timeout = '10s'")
    run_sql_file(_HERE / "0010_ingest_lock.downgrade.sql")
