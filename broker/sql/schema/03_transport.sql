-- Between nodes: the transmission log and what each side records of the
-- other (progress, lost messages, the peer's retention).

-- What a node of the release before revision 0037 queued for another node,
-- while it serves a database migrated ahead of it: the relay moves it to the
-- transmission log (broker._drain_transmission_queue).  A later release drops
-- the table.
CREATE TABLE broker.transmission_queue (
    conversation_handle      uuid NOT NULL,
    message_sequence_number  bigint NOT NULL,
    conversation_id          uuid NOT NULL,
    to_service               text NOT NULL,
    message_type_id          integer NOT NULL,
    body                     bytea,
    enqueued_at              timestamptz NOT NULL DEFAULT now(),
    attempts                 integer NOT NULL DEFAULT 0,
    next_attempt_at          timestamptz NOT NULL DEFAULT now(),
    transmission_status      text NOT NULL DEFAULT 'waiting for its first transmission',
    priority                 smallint NOT NULL DEFAULT 5,  -- the sending endpoint's
    traceparent              text,  -- the sending transaction's broker._traceparent()
    message_id               uuid DEFAULT gen_random_uuid(),  -- NULL before revision 0035
    PRIMARY KEY (to_service, priority, conversation_handle, message_sequence_number)
) WITH (autovacuum_vacuum_scale_factor = 0.01, autovacuum_vacuum_threshold = 1000,
        autovacuum_vacuum_insert_threshold = -1, autovacuum_vacuum_cost_delay = 0);
CREATE INDEX transmission_queue_failed ON broker.transmission_queue (conversation_handle) WHERE attempts > 0;
CREATE INDEX transmission_queue_held ON broker.transmission_queue (to_service, next_attempt_at)
    WHERE next_attempt_at > enqueued_at;

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
    -- Its own: with its number, it tells the far node whether the message it
    -- holds under that number is this one (see broker._anchored).
    message_id               uuid NOT NULL DEFAULT gen_random_uuid(),
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
-- only to where the log stood at an earlier batch (seen_position) once every
-- transaction that may have taken a position up to it has ended (their ids
-- are at most seen_xmax, the id of the transaction that read that batch).  The
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

-- A destination that could not be reached, per relay lane (the conversations
-- whose handles fall in [first_handle, last_handle]; a single conversation when
-- its message alone is too large for the far node): one row, however many
-- messages wait, so that a peer down for days with a long queue costs each
-- retry one row.  The next answer from the destination for one of these
-- conversations removes it (broker.apply_transport_results).
CREATE TABLE broker.transmission_failures (
    address          text NOT NULL,
    first_handle     uuid NOT NULL,
    last_handle      uuid NOT NULL,
    attempts         integer NOT NULL,
    failed_at        timestamptz NOT NULL,
    next_attempt_at  timestamptz NOT NULL,
    reason           text NOT NULL,
    PRIMARY KEY (address, first_handle, last_handle)
);

-- How far each conversation side with a remote far side has got in sending:
-- the highest number it put in a batch before the latest batch
-- (previously_transmitted) and since (transmitted_sequence), the highest it
-- had put in a batch when the latest answer applied (answered_sequence), and
-- the highest number the far node acknowledged.  The relay commits a batch's
-- numbers here before the batch leaves (broker.transport_batch), so the far
-- node never holds a number above transmitted_sequence, and never held one
-- above previously_transmitted before the batch came: an answer that says
-- otherwise shows this database went back to an earlier point (a restore, a
-- failover to a standby that lagged), and the numbers after
-- answered_sequence are those its attempts since may have sent in vain.  An
-- answer that acknowledges less than the far node did before shows that the
-- far node's database went back.  See broker.apply_transport_results.
CREATE TABLE broker.transmission_progress (
    conversation_handle     uuid PRIMARY KEY,
    previously_transmitted  bigint NOT NULL DEFAULT 0,
    transmitted_sequence    bigint NOT NULL,
    answered_sequence       bigint NOT NULL DEFAULT 0,
    acknowledged_sequence   bigint NOT NULL DEFAULT 0
) WITH (fillfactor = 70, autovacuum_vacuum_scale_factor = 0.01, autovacuum_vacuum_threshold = 1000);

-- What a far node acknowledged, as the release before revision 0037 kept it
-- for broker.node.resend_window: sent again from here while it is younger
-- than the window (broker._restore_kept), and forgotten by
-- broker.forget_acknowledged_messages.  A later release drops the table.
CREATE TABLE broker.acknowledged_messages (
    conversation_handle      uuid NOT NULL,
    message_sequence_number  bigint NOT NULL,
    message_type_id          integer NOT NULL,
    body                     bytea,
    enqueued_at              timestamptz NOT NULL,
    traceparent              text,
    acknowledged_at          timestamptz NOT NULL DEFAULT now(),
    message_id               uuid,
    PRIMARY KEY (conversation_handle, message_sequence_number)
) WITH (autovacuum_vacuum_scale_factor = 0.01, autovacuum_vacuum_threshold = 1000,
        autovacuum_vacuum_insert_threshold = -1, autovacuum_vacuum_cost_delay = 0);
-- Rows come in the order they are acknowledged: a block range index finds the
-- old ones for next to nothing per insert.
CREATE INDEX acknowledged_messages_age ON broker.acknowledged_messages USING brin (acknowledged_at);

-- Numbers of a conversation that one of its sides lost because its database
-- went back to an earlier point, as this side found them: messages from the
-- far node missing here (missing, until the far node sends them again:
-- resent; or lost), messages this side had sent that the far node lost
-- (resent from the resend window, or lost), or numbers this side used again
-- that the far node already held (renumbered: this side's messages from
-- first_number on were numbered past them).  A lost conversation ends with
-- broker.error code -4 on both sides.  Rows go with their conversation when
-- it is forgotten.  Messages that waited longer than the far node remembers
-- are withheld (see broker.withhold_what_peers_forgot).  broker diagnose
-- reports the missing, the lost and the withheld.
CREATE TABLE broker.lost_messages (
    conversation_id      uuid NOT NULL,
    is_initiator         boolean NOT NULL,  -- this side's
    far_broker_instance  uuid NOT NULL,
    direction            text NOT NULL CHECK (direction IN ('received', 'sent')),
    first_number         bigint NOT NULL,
    last_number          bigint NOT NULL,
    outcome              text NOT NULL CHECK (outcome IN ('missing', 'resent', 'renumbered', 'lost', 'withheld')),
    found_at             timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (conversation_id, is_initiator, direction, first_number)
);
CREATE INDEX lost_messages_missing ON broker.lost_messages (conversation_id) WHERE outcome = 'missing';

-- How long each peer remembers a conversation it ended and forgot (its
-- broker.node.tombstone_retention), as every answer of its says.
CREATE TABLE broker.peer_retention (
    broker_instance      uuid PRIMARY KEY,
    tombstone_retention  interval NOT NULL,
    learned_at           timestamptz NOT NULL DEFAULT now()
);

-- When this node last asked a far node that had lost numbers it acknowledged
-- (its database went back to an earlier point) about each of their
-- conversations (broker._probe_far_node): at most once a minute.
CREATE TABLE broker.far_node_checks (
    broker_instance  uuid PRIMARY KEY,
    checked_at       timestamptz NOT NULL DEFAULT now()
);

-- The messages of the log that wait: those its far node has not acknowledged
-- (and a local one held until its delivery time).  A message's attempts and
-- status are those of the latest failure that covers it, or else of its
-- conversation's retry (its far node held the conversation back), or its own.
CREATE VIEW broker.transmission_queue_status AS
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

-- One message of a transport batch of wire version 3, as nodes of the
-- release before revision 0035 write and read it (broker.transport_batch,
-- broker.accept_transport_batch): kept for them while they serve a database
-- migrated ahead of them.
CREATE TYPE broker.transport_message AS (
    conversation_id      uuid,
    sender_is_initiator  boolean,
    from_service         text,
    to_service           text,
    contract             text,
    expires_at           timestamptz,
    sequence_number      bigint,
    message_type         text,
    body                 bytea,
    traceparent          text  -- the span that handed it on (see broker.tracing)
);

-- One message of a transport batch, as it travels between nodes: a batch is
-- PostgreSQL's binary COPY format of these rows, written by the sending
-- node's COPY (SELECT * FROM broker.next_batch(...)) TO STDOUT and read by the
-- receiving node's COPY into a temporary table of this type.  Every row
-- carries its conversation's header; a new conversation is opened with the
-- header of its lowest-numbered message.  A batch of wire version 3 has these
-- rows without message_id, which stays NULL.
CREATE TYPE broker.wire_message AS (
    conversation_id      uuid,
    sender_is_initiator  boolean,
    from_service         text,
    to_service           text,
    contract             text,
    expires_at           timestamptz,
    sequence_number      bigint,
    message_id           uuid,  -- broker.transmission_queue.message_id
    message_type         text,
    body                 bytea,
    traceparent          text   -- the span that handed it on (see broker.tracing)
);

-- A conversation of a batch whose endpoint here is locked for the batch.
CREATE TYPE broker._batch_conversation AS (
    conversation_handle uuid, conversation_id uuid, is_initiator boolean, receive_sequence bigint,
    queue_id integer, conversation_group_id uuid, contract_id integer, priority smallint, received_message_id uuid
);
