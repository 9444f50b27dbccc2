"""For the REST API: API keys, peek-lock leases, numbered sends, arrival notifications.

Revision ID: 0003
Revises: 0002
"""
from pathlib import Path

from alembic import op

from broker.migrate import run_sql_file

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

_HERE = Path(__file__).parent


def upgrade() -> None:
    op.execute("SET LOCAL lock_timeout = '10s'")
    run_sql_file(_HERE / "0003_rest_api.upgrade.sql")


def downgrade() -> None:
    op.execute("SET LOCAL lock_timeout = '10s'")
    run_sql_file(_HERE / "0003_rest_api.downgrade.sql")
