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
