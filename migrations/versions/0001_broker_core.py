"""The broker core: catalog, conversations, queues and the SQL-level API.

Revision ID: 0001
Revises:
"""
from pathlib import Path

from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

_HERE = Path(__file__).parent


def _run_sql_file(name: str) -> None:
    # Straight to the driver's cursor, with no parameters: the plpgsql holds
    # ":" and "%" that SQLAlchemy and psycopg2 would take for placeholders.
    with op.get_bind().connection.dbapi_connection.cursor() as cursor:
        cursor.execute((_HERE / name).read_text())


def upgrade() -> None:
    op.execute("SET LOCAL lock_timeout = '10s'")
    _run_sql_file("0001_broker_core.upgrade.sql")


def downgrade() -> None:
    op.execute("SET LOCAL lock_timeout = '10s'")
    _run_sql_file("0001_broker_core.downgrade.sql")
