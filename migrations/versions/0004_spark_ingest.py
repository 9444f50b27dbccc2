"""For the Spark ingest: a checkpoint per queue and output dataset, and the functions that plan and commit a run.

Revision ID: 0004
Revises: 0003
"""
from pathlib import Path

from alembic import op

from broker.migrate import run_sql_file

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

_HERE = Path(__file__).parent


def upgrade() -> None:
    op.execute("SET LOCAL lock_timeout = '10s'")
    run_sql_file(_HERE / "0004_spark_ingest.upgrade.sql")


def downgrade() -> None:
    op.execute("SET LOCAL lock_timeout = '10s'")
    run_sql_file(_HERE / "0004_spark_ingest.downgrade.sql")
