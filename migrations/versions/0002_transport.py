"""Between nodes: accepting transport batches, and the relay's queries.

Revision ID: 0002
Revises: 0001
"""
from pathlib import Path

from alembic import op

from broker.migrate import run_sql_file

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

_HERE = Path(__file__).parent


def upgrade() -> None:
    op.execute("SET LOCAL lock_timeout = '10s'")
    run_sql_file(_HERE / "0002_transport.upgrade.sql")


def downgrade() -> None:
    op.execute("SET LOCAL lock_timeout = '10s'")
    run_sql_file(_HERE / "0002_transport.downgrade.sql")
