"""receive looks up the names that go with its messages once per endpoint.

Revision ID: 0017
Revises: 0016
"""
from pathlib import Path

from alembic import op

from broker.migrate import run_sql_file

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None

_HERE = Path(__file__).parent


def upgrade() -> None:
    op.execute("SET LOCAL lock_timeout = '10s'")
    run_sql_file(_HERE / "0017_receive_names.upgrade.sql")


def downgrade() -> None:
    op.execute("SET LOCAL lock_timeout = '10s'")
    run_sql_file(_HERE / "0017_receive_names.downgrade.sql")
