"""Each message sent to another node has an id of its own (broker.transmission_queue.message_id, kept in the resend
window), which wire version 4 carries (broker.wire_message), and each conversation side holds the id of the last
message it took from its far node (broker.endpoints.received_message_id): a receiver takes numbers past what it
holds only where the sender agrees on the message it holds last.  A conversation group whose receive failed is
passed over for a while (broker.conversation_groups.backed_off_until).  Only new columns, without a rewrite of any
table, each added in a transaction of its own, and a new type: it applies while nodes of the previous release serve.

Revision ID: 0035
Revises: 0034
"""
from alembic import op

from broker.migrate import alter_while_serving

revision = "0035"
down_revision = "0034"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # The node's tables, one at a time (broker.migrate.alter_while_serving).  A column added with a volatile default
    # would rewrite the table: the default is set after, for new rows.
    alter_while_serving(
        "ALTER TABLE broker.transmission_queue ADD COLUMN IF NOT EXISTS message_id uuid",
        "ALTER TABLE broker.transmission_queue ALTER COLUMN message_id SET DEFAULT gen_random_uuid()",
        "ALTER TABLE broker.acknowledged_messages ADD COLUMN IF NOT EXISTS message_id uuid",
        "ALTER TABLE broker.endpoints ADD COLUMN IF NOT EXISTS received_message_id uuid",
        "ALTER TABLE broker.conversation_groups ADD COLUMN IF NOT EXISTS backed_off_until timestamptz")
    op.execute("SET LOCAL lock_timeout = '10s'")
    op.execute("ALTER TYPE broker._batch_conversation ADD ATTRIBUTE received_message_id uuid")
    op.execute("""
        CREATE TYPE broker.wire_message AS (
            conversation_id      uuid,
            sender_is_initiator  boolean,
            from_service         text,
            to_service           text,
            contract             text,
            expires_at           timestamptz,
            sequence_number      bigint,
            message_id           uuid,
            message_type         text,
            body                 bytea,
            traceparent          text
        )""")


def downgrade() -> None:
    op.execute("SET LOCAL lock_timeout = '10s'")
    op.execute("DROP TYPE broker.wire_message CASCADE")  # and the functions that return it
    op.execute("DELETE FROM broker.function_files")  # so that the next upgrade applies every function file again
    op.execute("ALTER TYPE broker._batch_conversation DROP ATTRIBUTE received_message_id")
    op.execute("ALTER TABLE broker.conversation_groups DROP COLUMN backed_off_until")
    op.execute("ALTER TABLE broker.endpoints DROP COLUMN received_message_id")
    op.execute("ALTER TABLE broker.acknowledged_messages DROP COLUMN message_id")
    op.execute("ALTER TABLE broker.transmission_queue DROP COLUMN message_id")
