-- Conversations inside one database: endpoints, groups, the destination
-- queues, dead letters, and the views an application reads.

------------------------------------------------------------------------------
-- Traces
------------------------------------------------------------------------------

-- A W3C trace context (https://www.w3.org/TR/trace-context/), version 00: the
-- trace a message belongs to and the span it was last handed on from.  It is
-- checked where it comes in, once per trace: the setting of a sending
-- transaction (broker._traceparent) and an arriving batch
-- (broker.accept_transport_batch).  The tables keep it as text: checked for
-- every message stored, it cost a tenth of a transfer's speed.
CREATE DOMAIN broker.traceparent AS text
    CONSTRAINT traceparent_is_w3c_version_00 CHECK (
        VALUE ~ '^00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$'
        AND substr(VALUE, 4, 32) <> repeat('0', 32) AND substr(VALUE, 37, 16) <> repeat('0', 16));

------------------------------------------------------------------------------
-- Conversations
------------------------------------------------------------------------------

-- A receive locks one group row; every message of the group waits for it.
CREATE TABLE broker.conversation_groups (
    conversation_group_id  uuid PRIMARY KEY,
    queue_id               integer NOT NULL REFERENCES broker.queues,
    -- A reader's processing of the group failed: readers that look for a
    -- group pass it over until then (see broker._back_off).
    backed_off_until       timestamptz
);

-- Service Broker's BROKER PRIORITY: a conversation side created for a contract
-- between a local and a far service takes the priority (1 to 10) of the most
-- specific match, the contract first, then the local service, then the far
-- one; a name left NULL matches any.  Without a match it is 5.  A side keeps
-- the priority it was created with.
CREATE TABLE broker.broker_priorities (
    name                 text PRIMARY KEY,
    priority             smallint NOT NULL CHECK (priority BETWEEN 1 AND 10),
    contract_name        text,
    local_service_name   text,
    remote_service_name  text,
    UNIQUE NULLS NOT DISTINCT (contract_name, local_service_name, remote_service_name)
);

-- One side of a conversation.  A local conversation has both endpoints here.
-- send_sequence is the last number this side sent; receive_sequence the last
-- number it stored without a gap from the far side.  Endpoints are updated
-- with every message sent or accepted: free space on each page lets those
-- updates stay on the page (HOT), without index writes.
CREATE TABLE broker.endpoints (
    conversation_handle    uuid PRIMARY KEY,
    conversation_id        uuid NOT NULL,
    is_initiator           boolean NOT NULL,
    conversation_group_id  uuid NOT NULL REFERENCES broker.conversation_groups,
    service_id             integer NOT NULL REFERENCES broker.services,
    queue_id               integer NOT NULL REFERENCES broker.queues,
    far_service            text NOT NULL,
    far_is_local           boolean NOT NULL,
    far_broker_instance    uuid,
    contract_id            integer NOT NULL REFERENCES broker.contracts,
    state                  text NOT NULL DEFAULT 'conversing' CHECK (state IN
                               ('conversing', 'disconnected_inbound', 'disconnected_outbound', 'error', 'closed')),
    send_sequence          bigint NOT NULL DEFAULT 0,
    receive_sequence       bigint NOT NULL DEFAULT 0,
    expires_at             timestamptz,
    timer_at               timestamptz,
    created_at             timestamptz NOT NULL DEFAULT now(),
    closed_at              timestamptz,
    -- The latest delivery time of a message this side holds (broker._transmit).
    held_until             timestamptz,
    -- Its messages are received, and sent to another node, before those of a
    -- lower priority (see broker.broker_priorities).
    priority               smallint NOT NULL DEFAULT 5,
    -- The id of the message numbered receive_sequence, as its far node gave it
    -- (broker.wire_message): NULL when it gave none.
    received_message_id    uuid,
    UNIQUE (conversation_id, is_initiator)
) WITH (fillfactor = 70);
CREATE INDEX endpoints_group ON broker.endpoints (conversation_group_id);
CREATE INDEX endpoints_timer_due ON broker.endpoints (timer_at) WHERE timer_at IS NOT NULL;
CREATE INDEX endpoints_lifetime_due ON broker.endpoints (expires_at)
    WHERE expires_at IS NOT NULL AND state IN ('conversing', 'disconnected_inbound', 'disconnected_outbound');

-- The tombstone of a forgotten endpoint whose far side is remote (see
-- functions/14_forgetting.sql): its messages, sent again, are acknowledged, not delivered.
CREATE TABLE broker.forgotten_conversations (
    conversation_id      uuid NOT NULL,
    is_initiator         boolean NOT NULL,
    far_broker_instance  uuid NOT NULL,
    receive_sequence     bigint NOT NULL,
    forgotten_at         timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (conversation_id, is_initiator)
);
CREATE INDEX forgotten_conversations_age ON broker.forgotten_conversations (forgotten_at);

------------------------------------------------------------------------------
-- Destination queue, dead letters
------------------------------------------------------------------------------

-- What is added to a transaction id to make a queue position (see
-- broker._next_queue_position): raised by broker.continue_queue_positions when
-- the database is restored into a cluster whose transaction ids are behind
-- those it was made with.  One row.
CREATE TABLE broker.queue_position_base (
    xid_offset  bigint NOT NULL DEFAULT 0 CHECK (xid_offset >= 0),
    only_row    boolean PRIMARY KEY DEFAULT true CHECK (only_row)
);
INSERT INTO broker.queue_position_base DEFAULT VALUES;

-- queue_position is commit-ordered (see broker._next_queue_position).
-- message_sequence_number 0 marks a notice raised by this node itself (a
-- dialog timer, an expired lifetime, a quarantine, a refusal); far-side
-- messages count from 1.  delivery_count is how often a message was handed
-- out under a lease.
--
-- A notice is received after the far side's messages that were waiting when
-- it was raised: notice_after holds the number of the last of them.  Within a
-- conversation messages come in the order of coalesce(notice_after,
-- message_sequence_number), a notice after the far side's message of the same
-- number, notices among themselves in the order they were raised; the index
-- queue_messages_in_order is that order.
--
-- Queue tables are written and emptied all day: vacuum them after a small
-- share of dead rows rather than the default fifth of the table, and without
-- the cost-based pauses, so a steady stream reuses the same pages.  Rows
-- inserted are soon deleted: insertions alone never call for a vacuum.
CREATE TABLE broker.queue_messages (
    queue_id                 integer NOT NULL,
    queue_position           bigint NOT NULL,
    conversation_group_id    uuid NOT NULL,
    conversation_handle      uuid NOT NULL,
    conversation_id          uuid NOT NULL,
    message_sequence_number  bigint NOT NULL,
    message_type_id          integer NOT NULL,
    body                     bytea,
    enqueued_at              timestamptz NOT NULL DEFAULT now(),
    received_at              timestamptz,
    failed_attempts          integer NOT NULL DEFAULT 0,
    delivery_count           integer NOT NULL DEFAULT 0,
    notice_after             bigint,
    priority                 smallint NOT NULL DEFAULT 5,  -- the receiving endpoint's
    traceparent              text,  -- a broker.traceparent
    PRIMARY KEY (queue_id, queue_position)
) WITH (autovacuum_vacuum_scale_factor = 0.01, autovacuum_vacuum_threshold = 1000,
        autovacuum_vacuum_insert_threshold = -1, autovacuum_vacuum_cost_delay = 0);
CREATE INDEX queue_messages_in_order ON broker.queue_messages
    (conversation_group_id, conversation_handle, (coalesce(notice_after, message_sequence_number)),
     (notice_after IS NOT NULL), queue_position);
-- A receive starts from the oldest waiting messages of the highest priority in
-- its queue: an index of exactly those keeps that a short walk, however many
-- received messages a retention queue keeps and whatever the planner's
-- statistics say of them.
CREATE INDEX queue_messages_waiting ON broker.queue_messages (queue_id, priority DESC, queue_position)
    WHERE received_at IS NULL;

CREATE TABLE broker.dead_letters (
    dead_letter_id           bigserial PRIMARY KEY,
    queue_name               text NOT NULL,
    queue_position           bigint NOT NULL,
    conversation_handle      uuid NOT NULL,
    conversation_id          uuid NOT NULL,
    message_sequence_number  bigint NOT NULL,
    message_type             text NOT NULL,
    body                     bytea,
    enqueued_at              timestamptz NOT NULL,
    failed_attempts          integer NOT NULL,
    reason                   text NOT NULL,
    dead_lettered_at         timestamptz NOT NULL DEFAULT now(),
    traceparent              text
);

-- What each numbered send carried, to recognise a retry.
CREATE TABLE broker.numbered_sends (
    conversation_handle  uuid NOT NULL REFERENCES broker.endpoints ON DELETE CASCADE,
    sequence_number      bigint NOT NULL,
    content_sha256       bytea NOT NULL,
    PRIMARY KEY (conversation_handle, sequence_number)
);

CREATE TYPE broker.received_message AS (
    queue_position           bigint,
    conversation_group_id    uuid,
    conversation_handle      uuid,
    conversation_id          uuid,
    message_sequence_number  bigint,
    service_name             text,
    contract_name            text,
    message_type             text,
    body                     bytea,
    enqueued_at              timestamptz,
    traceparent              text
);

CREATE VIEW broker.conversation_endpoints AS
SELECT e.conversation_handle, e.conversation_id, e.conversation_group_id, e.is_initiator,
       s.name AS service_name, q.name AS queue_name, e.far_service, e.far_is_local, e.far_broker_instance,
       c.name AS contract_name, e.state, e.send_sequence, e.receive_sequence,
       e.expires_at, e.timer_at, e.created_at, e.closed_at, e.priority
FROM broker.endpoints e
JOIN broker.services s USING (service_id)
JOIN broker.queues q ON q.queue_id = e.queue_id
JOIN broker.contracts c USING (contract_id);

CREATE VIEW broker.queue_status AS
SELECT q.name AS queue_name,
       CASE WHEN q.is_enabled THEN 'enabled' ELSE 'disabled' END AS status,
       q.retention, q.poison_threshold,
       coalesce(m.depth, 0) AS depth,
       now() - m.oldest_enqueued_at AS oldest_message_age,
       (SELECT count(DISTINCT l.pid) FROM pg_locks l
        WHERE l.locktype = 'advisory' AND l.classid = 1651663723 AND l.objid = q.queue_id
          AND l.objsubid = 2 AND l.granted) AS readers,
       (SELECT count(*) FROM broker.dead_letters d WHERE d.queue_name = q.name) AS dead_letters
FROM broker.queues q
LEFT JOIN LATERAL (
    SELECT count(*) AS depth, min(enqueued_at) AS oldest_enqueued_at
    FROM broker.queue_messages qm WHERE qm.queue_id = q.queue_id AND qm.received_at IS NULL
) m ON true;

-- A message of broker.send_numbered_batch as it is judged: repeat_of is the
-- position of the first message of the batch with the same conversation and
-- number; fresh, whether it is sent now; expected, the number that comes next
-- on its conversation when it is judged.
CREATE TYPE broker._judged_send AS (
    k bigint, conversation_handle uuid, sequence_number bigint, message_type text, body bytea, digest bytea,
    repeat_of bigint, fresh boolean, expected bigint
);

------------------------------------------------------------------------------
-- Dead letters
------------------------------------------------------------------------------

CREATE INDEX dead_letters_by_conversation ON broker.dead_letters (queue_name, conversation_handle,
                                                                  message_sequence_number);

-- A reader that receives in SQL and rolls back without calling
-- broker.report_processing_failure would be handed the same message forever.
-- Its transaction leaves a trace that outlives it: the message's row keeps, as
-- its xmax, the id of the last transaction that deleted it (or marked it
-- received).  While that row version lives on (the same xmin) and waits, a
-- different xmax, or the same one now rolled back, means that the transaction
-- seen before ended without taking the message: nothing else writes a
-- waiting message's row without making a new version of it.
--
-- broker.count_unreported_rollbacks, which a running node calls every second,
-- watches the head messages of the groups at the front of each queue (the
-- first max_messages that a receive would walk) that a receive has touched.
-- Once it has seen such an end, and grace later no failure was reported (the
-- same version, the same failed_attempts), it counts a failure for the message
-- as its reader would have: after waiting for the group, as a reader does.
-- Counting makes a new version, so an end is counted once; a reader that
-- reports within grace of its rollback is never counted twice.  Several
-- rollbacks within one grace count as one.  A rollback of anything else that
-- deletes or moves a waiting message (end_conversation, move_conversation,
-- purge_queue) counts as a failure too.
CREATE TABLE broker.watched_heads (
    queue_id         integer NOT NULL,
    queue_position   bigint NOT NULL,
    row_version      xid NOT NULL,  -- the xmin of the row seen
    failed_attempts  integer NOT NULL,
    last_taken_by    xid NOT NULL,  -- the xmax seen last
    ended_seen_at    timestamptz,   -- when a transaction that took it was first seen to have ended without it
    PRIMARY KEY (queue_id, queue_position)
);

------------------------------------------------------------------------------
-- Conversation group state
------------------------------------------------------------------------------

-- What a reader keeps for a conversation group between receives (Service
-- Bus's session state; a Service Broker application's state table keyed by
-- the group): read and written only by the reader that holds the group, so
-- it changes with the messages it goes with, in one transaction.  It goes
-- when the group goes.
CREATE TABLE broker.conversation_group_state (
    conversation_group_id  uuid PRIMARY KEY REFERENCES broker.conversation_groups ON DELETE CASCADE,
    state                  jsonb NOT NULL,
    updated_at             timestamptz NOT NULL DEFAULT now()
);
-- Closed endpoints, for broker.forget_closed_endpoints.
CREATE INDEX endpoints_closed ON broker.endpoints (closed_at) WHERE state = 'closed';

-- Counts per service and state: a number that only grows is a leak.
CREATE VIEW broker.endpoint_counts AS
SELECT s.name AS service_name, e.state, count(*) AS endpoints, min(e.created_at) AS oldest_created_at,
       count(*) FILTER (WHERE e.expires_at IS NULL) AS without_lifetime
FROM broker.endpoints e
JOIN broker.services s USING (service_id)
GROUP BY s.name, e.state;
