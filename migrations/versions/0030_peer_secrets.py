"""A peer's secret rotated while traffic flows: the secrets being rotated in and out, and which secret each
peer signs with.  Only new tables: it applies while nodes of the previous release serve.

Revision ID: 0030
Revises: 0029
"""
from alembic import op

revision = "0030"
down_revision = "0029"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("SET LOCAL lock_timeout = '10s'")
    op.execute("""
        CREATE TABLE broker.peer_secrets (
            broker_instance  uuid NOT NULL,
            secret           text NOT NULL,
            role             text NOT NULL CHECK (role IN ('next', 'previous')),
            added_at         timestamptz NOT NULL DEFAULT now(),
            PRIMARY KEY (broker_instance, secret)
        )""")
    op.execute("CREATE UNIQUE INDEX peer_secrets_next ON broker.peer_secrets (broker_instance) WHERE role = 'next'")
    op.execute("""
        CREATE TABLE broker.peer_secret_use (
            broker_instance  uuid NOT NULL,
            secret_sha256    bytea NOT NULL,
            last_used_at     timestamptz NOT NULL,
            PRIMARY KEY (broker_instance, secret_sha256)
        )""")
    op.execute("GRANT SELECT ON broker.peer_secrets TO broker_relay")
    op.execute("GRANT SELECT, INSERT, UPDATE, DELETE ON broker.peer_secret_use TO broker_relay")
    op.execute("GRANT ALL ON broker.peer_secrets, broker.peer_secret_use TO broker_admin")


def downgrade() -> None:
    op.execute("SET LOCAL lock_timeout = '10s'")
    op.execute("DROP TABLE broker.peer_secret_use, broker.peer_secrets")
