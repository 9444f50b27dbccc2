"""The transmission log (broker.transmission_log): a message is appended once and never deleted or copied when its
far node acknowledges it, the acknowledgement moves its conversation's watermark on, and what the log keeps of the
numbers acknowledged is the resend window.  The relay reads it by position from a cursor per lane
(broker.transmission_cursors); conversations it passed over wait in broker.transmission_retries.  New tables only,
and the view over them: it applies while nodes of the previous release serve.  What they leave in
broker.transmission_queue goes to the log when a relay of this release reads a batch, and their resend window
(broker.acknowledged_messages) stays readable until it ages out.

Revision ID: 0037
Revises: 0036
"""
from alembic import op

from broker.migrate import alter_while_serving

revision = "0037"
down_revision = "0036"
branch_labels = None
depends_on = None

LOG = """
-- The transmission log: every message for another node (and a local one held
-- until its delivery time), appended once and never changed.  A far node's
-- acknowledgement moves its conversation's watermark on
-- (broker.transmission_progress.acknowledged_sequence) and deletes nothing:
-- what the log still holds of the numbers acknowledged is the resend window,
-- and broker.forget_acknowledged_messages deletes those older than it.  The
-- relay reads a destination's messages by position, from where its lane's
-- cursor stands (broker.transmission_cursors); a conversation whose messages
-- the reading passed over (held back by its far node, held until a delivery
-- time, asked again) waits in broker.transmission_retries and is read by its
-- numbers.  Positions follow the numbering of each conversation: a writer
-- holds its endpoint locked from before it takes a position until it commits.
-- Every writer changes the endpoint before it appends, so its transaction has
-- an id before it takes a position (broker.next_batch relies on that).
CREATE SEQUENCE broker.transmission_log_position AS bigint;
CREATE TABLE broker.transmission_log (
    position                 bigint NOT NULL DEFAULT nextval('broker.transmission_log_position'),
    conversation_handle      uuid NOT NULL,
    message_sequence_number  bigint NOT NULL,
    conversation_id          uuid NOT NULL,
    to_service               text NOT NULL,  -- the sending endpoint's far_service
    priority                 smallint NOT NULL,  -- the sending endpoint's
    message_type_id          integer NOT NULL,
    body                     bytea,
    enqueued_at              timestamptz NOT NULL DEFAULT now(),
    -- Later than enqueued_at: held until its delivery time (broker._transmit).
    next_attempt_at          timestamptz NOT NULL DEFAULT now(),
    -- Why the message was put in the log again: sent again to a far node that
    -- lost it, or numbered again (NULL: appended when it was sent).
    transmission_status      text,
    traceparent              text,  -- the sending transaction's broker._traceparent()
    message_id               uuid NOT NULL DEFAULT gen_random_uuid(),  -- see broker.transmission_queue
    PRIMARY KEY (conversation_handle, message_sequence_number)
) WITH (autovacuum_vacuum_scale_factor = 0.01, autovacuum_vacuum_threshold = 1000, autovacuum_vacuum_cost_delay = 0);
-- A destination's messages of each priority in the order they were appended.
CREATE INDEX transmission_log_reading ON broker.transmission_log (to_service, priority, position);
-- The messages held until a delivery time to come.
CREATE INDEX transmission_log_held ON broker.transmission_log (to_service, next_attempt_at)
    WHERE next_attempt_at > enqueued_at;
-- Rows come in the order they are appended: the old ones are found for next
-- to nothing per insert (each block range is summarized once it is full, so
-- that broker.forget_acknowledged_messages reads only the old ones).
CREATE INDEX transmission_log_age ON broker.transmission_log USING brin (enqueued_at) WITH (autosummarize = on);

-- Where each relay lane (the conversations whose handles fall in
-- [first_handle, last_handle]) stands in reading the log for a destination:
-- every message of the lane for it at or below read_position has been
-- acknowledged, waits in broker.transmission_retries, or is gone.  The
-- positions above it are read again, and what was acknowledged is passed
-- over.  A batch read at a position the transactions still open then may
-- write below (they take positions before they commit) moves read_position
-- only to where the log stood at an earlier batch (seen_position) whose open
-- transactions have all ended since (their ids are below seen_xmax).  The
-- answer to a batch moves the cursor (broker.apply_transport_results).
CREATE TABLE broker.transmission_cursors (
    address        text NOT NULL,
    first_handle   uuid NOT NULL,
    last_handle    uuid NOT NULL,
    read_position  bigint NOT NULL DEFAULT 0,
    seen_position  bigint NOT NULL DEFAULT 0,
    seen_xmax      xid8 NOT NULL DEFAULT '0',
    -- Where the batch read last takes them once its answer is applied.
    pending_read_position  bigint,
    pending_seen_position  bigint,
    pending_seen_xmax      xid8,
    PRIMARY KEY (address, first_handle, last_handle)
);

-- Conversation sides whose messages the relay sends by number rather than by
-- position, when next_attempt_at comes: from first_number (NULL: the first
-- number the far node has not acknowledged).  A row is made when the far node
-- holds a conversation back (attempts count the tries, reason says why), when
-- the reading passes over messages held until a delivery time or behind a
-- failure, when a far node lost numbers it had acknowledged (they are sent
-- again from the log), and to ask a far node whether it still holds the last
-- number it acknowledged.  It goes once the far node acknowledged everything
-- of the side that the log holds.
CREATE TABLE broker.transmission_retries (
    conversation_handle  uuid PRIMARY KEY,
    to_service           text NOT NULL,
    priority             smallint NOT NULL,
    first_number         bigint,
    next_attempt_at      timestamptz NOT NULL DEFAULT now(),
    attempts             integer NOT NULL DEFAULT 0,
    reason               text
);
CREATE INDEX transmission_retries_due ON broker.transmission_retries (to_service, next_attempt_at);
"""

VIEW = """
-- The messages of the log that wait: those its far node has not acknowledged
-- (and a local one held until its delivery time).  A message's attempts and
-- status are those of the latest failure that covers it, or else of its
-- conversation's retry (its far node held the conversation back), or its own.
CREATE OR REPLACE VIEW broker.transmission_queue_status AS
SELECT t.conversation_handle, t.conversation_id, t.to_service, t.message_sequence_number,
       mt.name AS message_type, octet_length(t.body) AS body_bytes, t.enqueued_at,
       coalesce(f.attempts, r.attempts, 0) AS attempts,
       coalesce(f.next_attempt_at, r.next_attempt_at, t.next_attempt_at) AS next_attempt_at,
       CASE WHEN t.next_attempt_at > now()
                 THEN format('held until its delivery time, %s',
                             to_char(t.next_attempt_at, 'YYYY-MM-DD HH24:MI:SS TZ'))
            WHEN f.reason IS NOT NULL
                 THEN format('%s (attempt %s, next at %s)', f.reason, f.attempts,
                             to_char(f.next_attempt_at, 'YYYY-MM-DD HH24:MI:SS TZ'))
            WHEN r.reason IS NOT NULL THEN r.reason
            WHEN t.message_sequence_number <= p.transmitted_sequence THEN 'sent; no acknowledgement yet'
            ELSE coalesce(t.transmission_status, 'waiting for its first transmission') END AS transmission_status,
       t.traceparent
FROM broker.endpoints e
LEFT JOIN broker.transmission_progress p ON p.conversation_handle = e.conversation_handle
JOIN broker.transmission_log t ON t.conversation_handle = e.conversation_handle
                              AND t.message_sequence_number > coalesce(p.acknowledged_sequence, 0)
JOIN broker.message_types mt ON mt.message_type_id = t.message_type_id
LEFT JOIN broker.transmission_retries r ON r.conversation_handle = t.conversation_handle
LEFT JOIN LATERAL (SELECT f.* FROM broker.routes rt
                   JOIN broker.transmission_failures f ON f.address = rt.address
                   WHERE rt.service_name = t.to_service
                     AND t.conversation_handle BETWEEN f.first_handle AND f.last_handle
                   ORDER BY f.failed_at DESC
                   LIMIT 1) f ON true
WHERE e.send_sequence > coalesce(p.acknowledged_sequence, 0);
"""

PREVIOUS_VIEW = """
CREATE VIEW broker.transmission_queue_status AS
SELECT t.conversation_handle, t.conversation_id, t.to_service, t.message_sequence_number,
       mt.name AS message_type, octet_length(t.body) AS body_bytes, t.enqueued_at,
       coalesce(f.attempts, t.attempts) AS attempts,
       coalesce(f.next_attempt_at, t.next_attempt_at) AS next_attempt_at,
       CASE WHEN t.attempts = 0 AND t.next_attempt_at > now()
                 THEN format('held until its delivery time, %s',
                             to_char(t.next_attempt_at, 'YYYY-MM-DD HH24:MI:SS TZ'))
            WHEN f.reason IS NOT NULL
                 THEN format('%s (attempt %s, next at %s)', f.reason, f.attempts,
                             to_char(f.next_attempt_at, 'YYYY-MM-DD HH24:MI:SS TZ'))
            WHEN t.transmission_status = 'waiting for its first transmission'
                 AND t.message_sequence_number <= p.transmitted_sequence
                 THEN 'sent; no acknowledgement yet'
            ELSE t.transmission_status END AS transmission_status,
       t.traceparent
FROM broker.transmission_queue t
JOIN broker.message_types mt USING (message_type_id)
LEFT JOIN broker.transmission_progress p USING (conversation_handle)
LEFT JOIN LATERAL (SELECT f.* FROM broker.routes r
                   JOIN broker.transmission_failures f ON f.address = r.address
                   WHERE r.service_name = t.to_service
                     AND t.conversation_handle BETWEEN f.first_handle AND f.last_handle
                   ORDER BY f.failed_at DESC
                   LIMIT 1) f ON true;
GRANT SELECT ON broker.transmission_queue_status TO broker_application;
"""


def upgrade() -> None:
    op.execute(LOG)
    op.execute("""
        GRANT SELECT, INSERT, UPDATE, DELETE ON broker.transmission_log, broker.transmission_cursors,
                                                broker.transmission_retries TO broker_relay;
        GRANT USAGE, SELECT ON broker.transmission_log_position TO broker_relay""")
    op.execute("SET LOCAL lock_timeout = '10s'")
    op.execute("DROP VIEW broker.transmission_queue_status")
    op.execute(VIEW)
    op.execute("GRANT SELECT ON broker.transmission_queue_status TO broker_application")
    # Acknowledgements delete nothing now: the trigger that forgot closed endpoints on each goes (the relay
    # forgets them as it applies an answer).
    alter_while_serving("DROP TRIGGER IF EXISTS forget_on_acknowledgement ON broker.transmission_queue")


def downgrade() -> None:
    op.execute("SET LOCAL lock_timeout = '10s'")
    op.execute("DELETE FROM broker.function_files")  # so that the next upgrade applies every function file again
    op.execute("DROP TRIGGER IF EXISTS read_the_log_again ON broker.routes")
    op.execute("DROP VIEW broker.transmission_queue_status")
    op.execute(PREVIOUS_VIEW)
    op.execute("CREATE TRIGGER forget_on_acknowledgement AFTER DELETE ON broker.transmission_queue "
               "FOR EACH STATEMENT EXECUTE FUNCTION broker._forget_on_close()")
    op.execute("DROP TABLE broker.transmission_retries, broker.transmission_cursors, broker.transmission_log CASCADE")
    op.execute("DROP SEQUENCE broker.transmission_log_position")
