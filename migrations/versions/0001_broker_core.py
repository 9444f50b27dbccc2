"""The broker core: catalog, conversations, queues and the SQL-level API.

Revision ID: 0001
Revises:
"""
from pathlib import Path

from alembic import op

from broker.migrate import run_sql_file

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

_HERE = Path(__file__).parent


def upgrade() -> None:
    op.execute("SET LOCAL lock_timeout = '10s'")
    run_sql_file(_HERE / "0001_broker_core.upgrade.sql")


def downgrade() -> None:
    op.execute("SET LOCAL lock_timeout = '10s'")
    run_sql_file(_HERE / "0001_broker_core.downgrade.sql")
