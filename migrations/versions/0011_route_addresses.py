"""Routes name plain http(s) URLs: no credentials, no query, no oddities.

Revision ID: 0011
Revises: 0010
"""
from pathlib import Path

from alembic import op

from broker.migrate import run_sql_file

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

_HERE = Path(__file__).parent


def upgrade() -> None:
    op.execute("SET LOCAL lock_timeout = '10s'")
    run_sql_file(_HERE / "0011_route_addresses.upgrade.sql")


def downgrade() -> None:
    op.execute("SET LOCAL lock_timeout = '10s'")
    run_sql_file(_HERE / "0011_route_addresses.downgrade.sql")
