"""A far node that lost numbers it had acknowledged is asked about each of its conversations, at most once a minute
(broker.far_node_checks), so that what it lost of conversations with nothing more to send is found too; and queue
positions are made with an offset (broker.queue_position_base), raised when the database is restored into a cluster
whose transaction ids are behind its own.  Only new tables and function files: it applies while nodes of the previous
release serve (their positions, made by the function files, take the offset too).

Revision ID: 0034
Revises: 0033
"""
from alembic import op

revision = "0034"
down_revision = "0033"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("SET LOCAL lock_timeout = '10s'")
    op.execute("""
        CREATE TABLE broker.far_node_checks (
            broker_instance  uuid PRIMARY KEY,
            checked_at       timestamptz NOT NULL DEFAULT now()
        )""")
    op.execute("GRANT SELECT, INSERT, UPDATE, DELETE ON broker.far_node_checks TO broker_relay")
    op.execute("""
        CREATE TABLE broker.queue_position_base (
            xid_offset  bigint NOT NULL DEFAULT 0 CHECK (xid_offset >= 0),
            only_row    boolean PRIMARY KEY DEFAULT true CHECK (only_row)
        )""")
    op.execute("INSERT INTO broker.queue_position_base DEFAULT VALUES")
    op.execute("GRANT SELECT ON broker.queue_position_base TO broker_relay")


def downgrade() -> None:
    op.execute("SET LOCAL lock_timeout = '10s'")
    op.execute("DROP TABLE broker.queue_position_base, broker.far_node_checks")
