"""Speed: the message path in fewer statements; queue tables kept compact under steady traffic.

Revision ID: 0006
Revises: 0005
"""
from pathlib import Path

from alembic import op

from broker.migrate import run_sql_file

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

_HERE = Path(__file__).parent


def upgrade() -> None:
    op.execute("SET LOCAL lock_timeout = '10s'")
    run_sql_file(_HERE / "0006_speed.upgrade.sql")


def downgrade() -> None:
    op.execute("SET LOCAL lock_timeout = '10s'")
    run_sql_file(_HERE / "0006_speed.downgrade.sql")
