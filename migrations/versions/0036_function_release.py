"""The release whose function files the database holds (broker.function_release), outside the revisions: a release
that changes only function files needs no revision of its own.  A new table: it applies while nodes of the
previous release serve.

Revision ID: 0036
Revises: 0035
"""
from alembic import op

revision = "0036"
down_revision = "0035"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("""
        CREATE TABLE broker.function_release (
            only_row     boolean PRIMARY KEY DEFAULT true CHECK (only_row),
            release      text NOT NULL,
            serves_from  text NOT NULL
        )""")


def downgrade() -> None:
    op.execute("DROP TABLE broker.function_release")
