"""Traces: a message carries a W3C traceparent from its send to its receive, between nodes too (wire version 3).

Revision ID: 0027
Revises: 0026
"""
from pathlib import Path

from alembic import op

from broker.migrate import run_sql_file

revision = "0027"
down_revision = "0026"
branch_labels = None
depends_on = None

_HERE = Path(__file__).parent


def upgrade() -> None:
    op.execute("SET LOCAL lock_timeout = '10s'")
    run_sql_file(_HERE / "0027_traces.upgrade.sql")


def downgrade() -> None:
    op.execute("SET LOCAL lock_timeout = '10s'")
    run_sql_file(_HERE / "0027_traces.downgrade.sql")
