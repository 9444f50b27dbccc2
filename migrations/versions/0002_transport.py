"""Between nodes: accepting transport batches, and the relay's queries.

Revision ID: 0002
Revises: 0001
"""
from pathlib import Path

from alembic import op

revision = "0002"
down_revision = "0001"
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
    _run_sql_file("0002_transport.upgrade.sql")


def downgrade() -> None:
    op.execute("SET LOCAL lock_timeout = '10s'")
    _run_sql_file("0002_transport.downgrade.sql")
