"""The baseline: every revision up to 0028, squashed into the tables, types and views they built.

A database that an earlier release took to 0028 carries on from here unchanged; one at an earlier revision is
upgraded to 0028 by the release named in broker/migrate.py first.

Revision ID: 0028
Revises:
"""
from pathlib import Path

from alembic import op

from broker.migrate import run_sql_file

revision = "0028"
down_revision = None
branch_labels = None
depends_on = None

_HERE = Path(__file__).parent


def upgrade() -> None:
    run_sql_file(_HERE / "0028_baseline.upgrade.sql")


def downgrade() -> None:
    op.execute("DROP SCHEMA broker CASCADE")
