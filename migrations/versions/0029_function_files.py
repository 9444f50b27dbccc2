"""Function files applied again when they change: the SHA-256 of each as last applied.

Revision ID: 0029
Revises: 0028
"""
from alembic import op

revision = "0029"
down_revision = "0028"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("SET LOCAL lock_timeout = '10s'")
    op.execute("""
        CREATE TABLE broker.function_files (
            file_name  text PRIMARY KEY,
            sha256     bytea NOT NULL
        )""")


def downgrade() -> None:
    op.execute("SET LOCAL lock_timeout = '10s'")
    op.execute("DROP TABLE broker.function_files")
