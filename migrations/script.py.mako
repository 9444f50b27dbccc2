"""${message}

Revision ID: ${up_revision}
Revises: ${down_revision | comma,n}
"""
from alembic import op

revision = ${repr(up_revision)}
down_revision = ${repr(down_revision)}
branch_labels = ${repr(branch_labels)}
depends_on = ${repr(depends_on)}


def upgrade() -> None:
    op.execute("SET LOCAL lock_timeout = '10s'")
    ${upgrades if upgrades else "pass"}


def downgrade() -> None:
    op.execute("SET LOCAL lock_timeout = '10s'")
    ${downgrades if downgrades else "pass"}
