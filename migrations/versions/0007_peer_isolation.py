"""A conversation belongs to the peer it was opened with; answers apply only to the batch they answer.

Revision ID: 0007
Revises: 0006
"""
from pathlib import Path

from alembic import op

from broker.migrate import run_sql_file

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

_HERE = Path(__file__).parent


def upgrade() -> None:
    op.execute("SET LOCAL lock_timeout = '10s'")
    run_sql_file(_HERE / "0007_peer_isolation.upgrade.sql")


def downgrade() -> None:
    op.execute("SET LOCAL lock_timeout = '10s'")
    run_sql_file(_HERE / "0007_peer_isolation.downgrade.sql")
