"""Least-privilege roles: broker_application, broker_relay and broker_admin.

Revision ID: 0012
Revises: 0011
"""
from pathlib import Path

from alembic import op

from broker.migrate import run_sql_file

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None

_HERE = Path(__file__).parent


def upgrade() -> None:
    op.execute("SET LOCAL lock_timeout = '10s'")
    run_sql_file(_HERE / "0012_roles.upgrade.sql")


def downgrade() -> None:
    op.execute("SET LOCAL lock_timeout = '10s'")
    run_sql_file(_HERE / "0012_roles.downgrade.sql")
