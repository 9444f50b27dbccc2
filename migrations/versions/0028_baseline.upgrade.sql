-- Revision 0028 as a baseline: the tables, types and views of every revision
-- up to 0028, as broker/sql/schema/ defined them then, frozen.  A database
-- that earlier releases took to 0028 holds exactly this, and is carried on
-- from here; the functions come from broker/sql/functions/ at the head.

-- The broker's tables, types and views, in file order; its functions are in
-- broker/sql/functions/.  A new database is built from both (broker/schema.py).
-- An existing one is upgraded by the revisions in migrations/versions, which
-- change only what is here; then the function files that changed are applied
-- again.  tests/migrations/test_schema_definition.py checks that both ways
-- build the same.
--
-- This file: the schema and the catalog (the node, message types, contracts,
-- queues, services, routes).

CREATE SCHEMA broker;

------------------------------------------------------------------------------
-- Catalog
------------------------------------------------------------------------------

-- The local node: one row.  Closed conversation endpoints are forgotten after
-- closed_endpoint_retention; the tombstones of remote ones after
-- tombstone_retention (see functions/14_forgetting.sql).  Messages another node
-- acknowledged are kept for resend_window, to send again to a peer whose
-- database went back to an earlier point (see broker.acknowledged_messages).
CREATE TABLE broker.node (
    singleton                  boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    broker_instance            uuid NOT NULL DEFAULT gen_random_uuid(),
    max_message_bytes          integer NOT NULL DEFAULT 16777216 CHECK (max_message_bytes > 0),
    closed_endpoint_retention  interval NOT NULL DEFAULT '30 minutes'
                                   CHECK (closed_endpoint_retention >= interval '0'),
    tombstone_retention        interval NOT NULL DEFAULT '90 days'
                                   CHECK (tombstone_retention >= interval '1 day'),
    resend_window              interval NOT NULL DEFAULT '24 hours' CHECK (resend_window >= interval '0')
);
INSERT INTO broker.node DEFAULT VALUES;

CREATE TABLE broker.message_types (
    message_type_id  serial PRIMARY KEY,
    name             text NOT NULL UNIQUE,
    validation       text NOT NULL CHECK (validation IN ('none', 'empty', 'json'))
);
INSERT INTO broker.message_types (name, validation) VALUES
    ('broker.end_dialog', 'empty'),
    ('broker.error', 'json'),
    ('broker.dialog_timer', 'empty'),
    ('broker.renumbered', 'json');  -- see broker._number_past

CREATE TABLE broker.contracts (
    contract_id  serial PRIMARY KEY,
    name         text NOT NULL UNIQUE
);

CREATE TABLE broker.contract_message_types (
    contract_id      integer NOT NULL REFERENCES broker.contracts ON DELETE CASCADE,
    message_type_id  integer NOT NULL REFERENCES broker.message_types,
    sent_by          text NOT NULL CHECK (sent_by IN ('initiator', 'target', 'any')),
    PRIMARY KEY (contract_id, message_type_id)
);

-- The message types each side of each contract may send that are stored
-- without a second look: application types without validation.  A message
-- of such a type within the size limit is "plain": broker.send_batch and
-- broker.accept_transport_batch take plain messages in bulk.
CREATE VIEW broker._plain_message_types AS
SELECT cmt.contract_id, side.sent_by_initiator, t.name, t.message_type_id
FROM broker.contract_message_types cmt
JOIN broker.message_types t USING (message_type_id)
CROSS JOIN (VALUES (true), (false)) AS side(sent_by_initiator)
WHERE t.validation = 'none' AND t.name NOT LIKE 'broker.%'
  AND cmt.sent_by IN ('any', CASE WHEN side.sent_by_initiator THEN 'initiator' ELSE 'target' END);

CREATE TABLE broker.queues (
    queue_id          serial PRIMARY KEY,
    name              text NOT NULL UNIQUE,
    is_enabled        boolean NOT NULL DEFAULT true,
    retention         boolean NOT NULL DEFAULT false,
    poison_threshold  integer NOT NULL DEFAULT 5 CHECK (poison_threshold > 0),
    created_at        timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE broker.services (
    service_id  serial PRIMARY KEY,
    name        text NOT NULL UNIQUE,
    queue_id    integer NOT NULL REFERENCES broker.queues
);

-- Contracts a service accepts as a target.
CREATE TABLE broker.service_contracts (
    service_id   integer NOT NULL REFERENCES broker.services ON DELETE CASCADE,
    contract_id  integer NOT NULL REFERENCES broker.contracts,
    PRIMARY KEY (service_id, contract_id)
);

-- peer_secret is shared with the peer node: requests and answers are signed
-- with HMAC-SHA256 under it, so it cannot be kept as a hash.
CREATE TABLE broker.routes (
    route_id         serial PRIMARY KEY,
    service_name     text NOT NULL UNIQUE,
    address          text NOT NULL,
    broker_instance  uuid NOT NULL,
    peer_secret      text NOT NULL,
    created_at       timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX routes_address ON broker.routes (address);
CREATE INDEX routes_broker_instance ON broker.routes (broker_instance);

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
    queue_id               integer NOT NULL REFERENCES broker.queues
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

-- Between nodes: the transmission queue and what each side records of the
-- other (progress, the resend window, lost messages, the peer's retention).

-- What waits to be sent to another node, vacuumed as the queue tables are
-- (see broker.queue_messages).
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
    -- A destination's messages of each priority in the order they are sent
    -- (broker.transport_batch): a batch reads its own destination's messages
    -- and no others.  to_service and priority are the sending endpoint's
    -- far_service and priority, which every lookup by conversation gives.
    PRIMARY KEY (to_service, priority, conversation_handle, message_sequence_number)
) WITH (autovacuum_vacuum_scale_factor = 0.01, autovacuum_vacuum_threshold = 1000,
        autovacuum_vacuum_insert_threshold = -1, autovacuum_vacuum_cost_delay = 0);
-- The few messages whose transmission has failed: an answer from their
-- destination resets them (broker.apply_transport_results) without a look at
-- the others.
CREATE INDEX transmission_queue_failed ON broker.transmission_queue (conversation_handle) WHERE attempts > 0;
-- The messages held until a delivery time to come (broker._transmit): due
-- later than they were queued, which no other message is until it fails.
CREATE INDEX transmission_queue_held ON broker.transmission_queue (to_service, next_attempt_at)
    WHERE next_attempt_at > enqueued_at;

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

-- What a far node acknowledged, kept for broker.node.resend_window: a peer
-- whose database went back to an earlier point lost messages it had
-- acknowledged, and gets exactly those again, in order (see
-- broker._send_again).  Rows older than the window are forgotten by
-- broker.forget_acknowledged_messages, which a running relay calls every
-- minute.
CREATE TABLE broker.acknowledged_messages (
    conversation_handle      uuid NOT NULL,
    message_sequence_number  bigint NOT NULL,
    message_type_id          integer NOT NULL,
    body                     bytea,
    enqueued_at              timestamptz NOT NULL,
    traceparent              text,
    acknowledged_at          timestamptz NOT NULL DEFAULT now(),
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

-- A message's attempts and status are those of the latest failure that covers
-- it, or else its own (the far node held its conversation back).
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

-- One message of a transport batch, as it travels between nodes: a batch is
-- PostgreSQL's binary COPY format of these rows, written by the sending
-- node's COPY (SELECT * FROM broker.transport_batch(...)) TO STDOUT and read
-- by the receiving node's COPY into a temporary table of this type.  Every
-- row carries its conversation's header; a new conversation is opened with
-- the header of its lowest-numbered message.
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

-- A conversation of a batch whose endpoint here is locked for the batch.
CREATE TYPE broker._batch_conversation AS (
    conversation_handle uuid, conversation_id uuid, is_initiator boolean, receive_sequence bigint,
    queue_id integer, conversation_group_id uuid, contract_id integer, priority smallint
);

-- Peek-lock leases on conversation groups, for the REST API.

------------------------------------------------------------------------------
-- Leases (peek-lock)
------------------------------------------------------------------------------

-- A REST reader holds a conversation group by a lease instead of an open
-- transaction: the messages it was handed stay in the queue until it completes
-- the lease.  While the lease is live no other reader, REST or SQL, gets the
-- group (invariant 5); once it has expired the next reader ends it and the
-- expiry counts toward the poison threshold like an abandon.
CREATE TABLE broker.leases (
    lock_token             uuid PRIMARY KEY,
    queue_id               integer NOT NULL REFERENCES broker.queues,
    conversation_group_id  uuid NOT NULL UNIQUE REFERENCES broker.conversation_groups,
    queue_positions        bigint[] NOT NULL,
    expires_at             timestamptz NOT NULL,
    created_at             timestamptz NOT NULL DEFAULT now()
);

-- How each lease ended, kept for an hour after it was recorded, so that a late
-- call with its token is told why the lock is lost: a client that retries a
-- complete whose answer it lost learns that the messages were consumed.  For
-- an expiry, ended_at is when the lease ran out, which may be long before a
-- reader found it expired.
CREATE TABLE broker.ended_leases (
    lock_token   uuid PRIMARY KEY,
    queue_id     integer NOT NULL REFERENCES broker.queues ON DELETE CASCADE,
    how          text NOT NULL CHECK (how IN ('expired', 'completed', 'abandoned', 'purged', 'dead_lettered')),
    ended_at     timestamptz NOT NULL,
    recorded_at  timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX ended_leases_recorded ON broker.ended_leases (recorded_at);

CREATE TYPE broker.locked_message AS (
    lock_token               uuid,
    lock_expires_at          timestamptz,
    delivery_count           integer,
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

-- API keys of the REST API.

------------------------------------------------------------------------------
-- API keys
------------------------------------------------------------------------------

-- A key is "bk_<key_id>_<secret>"; only the secret's SHA-256 is kept.  The
-- secret is 256 random bits, so a fast hash is enough: there is nothing to
-- guess by brute force.
CREATE TABLE broker.api_keys (
    key_id         text PRIMARY KEY,
    name           text NOT NULL,
    secret_sha256  bytea NOT NULL,
    scopes         text[] NOT NULL CHECK (cardinality(scopes) > 0),
    created_at     timestamptz NOT NULL DEFAULT now(),
    revoked_at     timestamptz
);

-- For the Spark ingest: a checkpoint per (queue, output dataset).
--
-- A run reads the positions in (checkpoint, high-water mark], where the
-- high-water mark lies below broker.committed_position_horizon(): every row in
-- that range was written by a finished transaction, so none can appear in it
-- later (invariant 6).  The run writes its output, and only then advances the
-- checkpoint, which is what makes each message land in the output exactly once.
--
-- A run's lock on (queue, output) is a session advisory lock: it ends with the
-- session that took it (killed, cut, or ended by idle_session_timeout), and the
-- run is not told.  A run that went on without it could commit beside the run
-- that took the lock next, and put the same messages in the dataset twice.  So
-- a run asks broker.holds_ingest_lock on its session before it renames its
-- output into the dataset, and advance_ingest_checkpoint refuses (BR060) in the
-- transaction that advances unless the calling session holds the lock.

-- What a bulk reader (the Spark ingest) reads: the committed destination queue.
CREATE VIEW broker.destination_queue AS
SELECT q.name AS queue_name, m.queue_position, m.conversation_id, m.conversation_handle,
       m.conversation_group_id, m.message_sequence_number, s.name AS service_name,
       c.name AS contract_name, mt.name AS message_type, mt.validation, m.body, m.enqueued_at, m.received_at
FROM broker.queue_messages m
JOIN broker.queues q ON q.queue_id = m.queue_id
JOIN broker.endpoints e ON e.conversation_handle = m.conversation_handle
JOIN broker.services s ON s.service_id = e.service_id
JOIN broker.contracts c ON c.contract_id = e.contract_id
JOIN broker.message_types mt ON mt.message_type_id = m.message_type_id;

CREATE TABLE broker.ingest_checkpoints (
    queue_id        integer NOT NULL REFERENCES broker.queues ON DELETE CASCADE,
    output          text NOT NULL CHECK (output <> ''),
    -- Every row of the queue at or below this position is in the output.
    queue_position  bigint NOT NULL DEFAULT 0,
    last_run        text,
    rows_ingested   bigint NOT NULL DEFAULT 0,
    runs            bigint NOT NULL DEFAULT 0,
    updated_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (queue_id, output)
);

CREATE VIEW broker.ingests AS
SELECT q.name AS queue_name, c.output, c.queue_position, c.last_run, c.rows_ingested, c.runs, c.updated_at
FROM broker.ingest_checkpoints c
JOIN broker.queues q USING (queue_id);

-- Least-privilege roles.
--
--   broker_application  the conversation functions an application calls and
--                       three status views: no tables, no catalog, no transport
--   broker_relay        what the relay and the transport endpoint use: the
--                       transport functions and the tables they work on
--   broker_admin        everything in the schema (what `broker serve` needs)
--
-- A login gets one of them: GRANT broker_application TO my_app_login;
--
-- What each role may execute is granted where each function is defined
-- (broker/sql/functions/); the table privileges are here.
-- tests/integration/test_roles.py checks both.

-- Roles belong to the cluster, and every broker database makes them: each
-- is made only when missing (another database may be making it right now).
DO $$
DECLARE
    role_name text;
BEGIN
    FOREACH role_name IN ARRAY ARRAY['broker_application', 'broker_relay', 'broker_admin'] LOOP
        IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = role_name) THEN
            BEGIN
                EXECUTE format('CREATE ROLE %I NOLOGIN', role_name);
            EXCEPTION WHEN duplicate_object OR unique_violation THEN
                NULL;
            END;
        END IF;
    END LOOP;
END $$;

GRANT USAGE ON SCHEMA broker TO broker_application, broker_relay, broker_admin;

------------------------------------------------------------------------------
-- broker_application
------------------------------------------------------------------------------

GRANT SELECT ON broker.queue_status, broker.conversation_endpoints, broker.transmission_queue_status
    TO broker_application;

------------------------------------------------------------------------------
-- broker_relay
------------------------------------------------------------------------------

-- The transport functions run as their caller, because they read the
-- caller's temporary batch tables; so the role holds the table privileges
-- they use.
GRANT SELECT ON broker.node, broker.routes, broker.message_types, broker.contracts, broker.contract_message_types,
                broker.queues, broker.services, broker.service_contracts, broker.leases, broker.broker_priorities
    TO broker_relay;
-- A tracing node reports each new dead letter in its message's trace
-- (broker.tracing): what it reads of them, their bodies left out.
GRANT SELECT (dead_letter_id, queue_name, conversation_handle, message_sequence_number, reason, dead_lettered_at,
              traceparent) ON broker.dead_letters TO broker_relay;
GRANT SELECT, INSERT, UPDATE, DELETE ON broker.endpoints, broker.conversation_groups, broker.queue_messages,
                                        broker.transmission_queue, broker.transmission_failures,
                                        broker.forgotten_conversations, broker.transmission_progress,
                                        broker.acknowledged_messages, broker.lost_messages, broker.peer_retention
    TO broker_relay;

------------------------------------------------------------------------------
-- broker_admin
------------------------------------------------------------------------------

GRANT ALL ON ALL TABLES IN SCHEMA broker TO broker_admin;
GRANT ALL ON ALL SEQUENCES IN SCHEMA broker TO broker_admin;

-- What later revisions create reaches broker_admin by itself.  Not
-- broker_relay: a new table reaches the relay only when a revision grants it.
ALTER DEFAULT PRIVILEGES IN SCHEMA broker GRANT ALL ON TABLES TO broker_admin;
ALTER DEFAULT PRIVILEGES IN SCHEMA broker GRANT ALL ON SEQUENCES TO broker_admin;
ALTER DEFAULT PRIVILEGES IN SCHEMA broker GRANT EXECUTE ON FUNCTIONS TO broker_admin;

-- What the database holds of this definition.

-- /readyz compares the database's revision with the node's.  Alembic makes its
-- version table at its first stamp; a database built from broker/sql/ gets it
-- here, as Alembic would make it, so that there is something to grant.
CREATE TABLE IF NOT EXISTS public.broker_alembic_version (
    version_num  varchar(32) NOT NULL,
    CONSTRAINT broker_alembic_version_pkc PRIMARY KEY (version_num)
);
GRANT SELECT ON public.broker_alembic_version TO broker_admin;
