-- For the REST API: hashed API keys, peek-lock leases on conversation groups,
-- idempotent numbered sends, and a notification when a queue gets a message.
-- Frozen with revision 0003.
--
-- SQLSTATEs added here (class BR, documented in README.md):
--   BR021 sequence number out of turn, or reused with another content
--   BR060 lock lost: expired, completed, abandoned, or never issued

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

-- How often a message was handed out under a lease.
ALTER TABLE broker.queue_messages ADD COLUMN delivery_count integer NOT NULL DEFAULT 0;

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
    enqueued_at              timestamptz
);

CREATE FUNCTION broker._lock_lost(lock_token uuid) RETURNS void
LANGUAGE sql AS $$
    SELECT broker._raise('BR060', format('lock %s is lost: it expired, was completed or abandoned, or never existed',
        lock_token), 'receive again: messages not completed come back with a higher delivery_count')
$$;

-- With the group's row locked: true when no live lease holds the group.  An
-- expired lease is ended here and counted as a processing failure.
CREATE FUNCTION broker._free_of_lease(q broker.queues, group_id uuid) RETURNS boolean
LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM broker.leases WHERE conversation_group_id = group_id AND expires_at <= clock_timestamp();
    IF FOUND THEN
        PERFORM broker.report_processing_failure(q.name, group_id, 'the lock expired before it was completed');
        RETURN true;
    END IF;
    RETURN NOT EXISTS (SELECT 1 FROM broker.leases WHERE conversation_group_id = group_id);
END $$;

CREATE FUNCTION broker._leased(group_id uuid) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT EXISTS (SELECT 1 FROM broker.leases
                   WHERE conversation_group_id = group_id AND expires_at > clock_timestamp())
$$;

-- As in revision 0001, and groups under a live lease are passed over.
CREATE OR REPLACE FUNCTION broker._lock_group(q broker.queues, requested_group uuid) RETURNS uuid
LANGUAGE plpgsql AS $$
DECLARE
    candidate uuid;
    tried uuid[] := '{}';
BEGIN
    IF requested_group IS NOT NULL THEN
        PERFORM 1 FROM broker.conversation_groups
        WHERE conversation_group_id = requested_group AND queue_id = q.queue_id
        FOR NO KEY UPDATE SKIP LOCKED;
        RETURN CASE WHEN FOUND AND broker._free_of_lease(q, requested_group) THEN requested_group END;
    END IF;
    -- Fast path: groups of the messages at the head of the queue.
    FOR candidate IN
        SELECT conversation_group_id FROM broker.queue_messages
        WHERE queue_id = q.queue_id AND received_at IS NULL
        ORDER BY queue_position LIMIT 200
    LOOP
        CONTINUE WHEN candidate = ANY (tried);
        tried := tried || candidate;
        CONTINUE WHEN broker._leased(candidate);  -- checked before locking, so a lease holder never waits on us
        PERFORM 1 FROM broker.conversation_groups WHERE conversation_group_id = candidate
        FOR NO KEY UPDATE SKIP LOCKED;
        IF FOUND AND broker._free_of_lease(q, candidate) AND EXISTS (
                SELECT 1 FROM broker.queue_messages
                WHERE conversation_group_id = candidate AND queue_id = q.queue_id AND received_at IS NULL) THEN
            RETURN candidate;
        END IF;
    END LOOP;
    -- The head belongs to groups held by others: look at every group of the queue.
    FOR candidate IN
        SELECT g.conversation_group_id
        FROM broker.conversation_groups g
        WHERE g.queue_id = q.queue_id
          AND g.conversation_group_id <> ALL (tried)
          AND NOT broker._leased(g.conversation_group_id)
          AND EXISTS (SELECT 1 FROM broker.queue_messages m
                      WHERE m.conversation_group_id = g.conversation_group_id AND m.queue_id = q.queue_id
                        AND m.received_at IS NULL)
        LIMIT 1
        FOR NO KEY UPDATE OF g SKIP LOCKED
    LOOP
        IF broker._free_of_lease(q, candidate) THEN
            RETURN candidate;
        END IF;
    END LOOP;
    RETURN NULL;
END $$;

-- Locks the next conversation group of a queue by a lease of lock_duration
-- and returns up to max_messages of its messages in order, each with the
-- lease's token.  Nothing is consumed until broker.complete_lock.
CREATE FUNCTION broker.receive_with_lock(queue text, max_messages integer, lock_duration interval)
RETURNS SETOF broker.locked_message
LANGUAGE plpgsql AS $$
DECLARE
    q broker.queues := broker._enabled_queue(queue);
    locked_group uuid;
    token uuid := gen_random_uuid();
    expires timestamptz;
BEGIN
    IF max_messages IS NULL OR max_messages < 1 THEN
        PERFORM broker._raise('BR050', format('max_messages must be at least 1, got %s', max_messages));
    END IF;
    IF lock_duration IS NULL OR lock_duration <= interval '0' OR lock_duration > interval '1 day' THEN
        PERFORM broker._raise('BR050', format('lock_duration must be positive and at most a day, got %s',
            quote_nullable(lock_duration)));
    END IF;
    locked_group := broker._wait_for_group(q, NULL, 0);
    IF locked_group IS NULL THEN
        RETURN;
    END IF;
    expires := clock_timestamp() + lock_duration;
    WITH picked AS (
        SELECT m.queue_position FROM broker.queue_messages m
        WHERE m.conversation_group_id = locked_group AND m.queue_id = q.queue_id AND m.received_at IS NULL
        ORDER BY m.conversation_handle, m.message_sequence_number
        LIMIT max_messages
    ), handed_out AS (
        UPDATE broker.queue_messages m SET delivery_count = m.delivery_count + 1
        FROM picked WHERE m.queue_id = q.queue_id AND m.queue_position = picked.queue_position
        RETURNING m.queue_position
    )
    INSERT INTO broker.leases (lock_token, queue_id, conversation_group_id, queue_positions, expires_at)
    SELECT token, q.queue_id, locked_group, array_agg(queue_position), expires FROM handed_out;

    RETURN QUERY
    SELECT token, expires, m.delivery_count, m.queue_position, m.conversation_group_id, m.conversation_handle,
           m.conversation_id, m.message_sequence_number, s.name, c.name, mt.name, m.body, m.enqueued_at
    FROM broker.leases l
    JOIN broker.queue_messages m ON m.queue_id = l.queue_id AND m.queue_position = ANY (l.queue_positions)
    JOIN broker.endpoints e ON e.conversation_handle = m.conversation_handle
    JOIN broker.services s ON s.service_id = e.service_id
    JOIN broker.contracts c ON c.contract_id = e.contract_id
    JOIN broker.message_types mt ON mt.message_type_id = m.message_type_id
    WHERE l.lock_token = token
    ORDER BY m.conversation_handle, m.message_sequence_number;
END $$;
COMMENT ON FUNCTION broker.receive_with_lock(text, integer, interval) IS
    'Peek-lock: leases one conversation group and returns its next messages; complete_lock consumes them.';

-- Consumes the messages handed out under a live lease and ends it.  Returns
-- how many were consumed (fewer than were handed out when the conversation
-- was ended or quarantined meanwhile).
CREATE FUNCTION broker.complete_lock(lock_token uuid) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    lease broker.leases;
    keep boolean;
    consumed integer;
BEGIN
    SELECT * INTO lease FROM broker.leases l WHERE l.lock_token = broker._require('lock_token', complete_lock.lock_token)
    FOR UPDATE;
    IF NOT FOUND OR lease.expires_at <= clock_timestamp() THEN
        PERFORM broker._lock_lost(lock_token);
    END IF;
    SELECT retention INTO keep FROM broker.queues WHERE queue_id = lease.queue_id;
    IF keep THEN
        UPDATE broker.queue_messages SET received_at = now()
        WHERE queue_id = lease.queue_id AND queue_position = ANY (lease.queue_positions) AND received_at IS NULL;
    ELSE
        DELETE FROM broker.queue_messages
        WHERE queue_id = lease.queue_id AND queue_position = ANY (lease.queue_positions);
    END IF;
    GET DIAGNOSTICS consumed = ROW_COUNT;
    DELETE FROM broker.leases l WHERE l.lock_token = lease.lock_token;
    RETURN consumed;
END $$;
COMMENT ON FUNCTION broker.complete_lock(uuid) IS
    'Consumes the messages of a live lease; BR060 when the lease expired or is unknown.';

-- Returns a lease's messages to the queue at once.  Counts as a processing
-- failure; returns true when that quarantined the conversation.
CREATE FUNCTION broker.abandon_lock(lock_token uuid) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    lease broker.leases;
BEGIN
    DELETE FROM broker.leases l WHERE l.lock_token = broker._require('lock_token', abandon_lock.lock_token)
    RETURNING * INTO lease;
    IF NOT FOUND THEN
        PERFORM broker._lock_lost(lock_token);
    END IF;
    PERFORM pg_notify('broker_queue', lease.queue_id::text);
    RETURN broker.report_processing_failure((SELECT name FROM broker.queues WHERE queue_id = lease.queue_id),
                                            lease.conversation_group_id, 'the lock was abandoned');
END $$;
COMMENT ON FUNCTION broker.abandon_lock(uuid) IS
    'Returns the messages of a lease to the queue now; counts toward the poison threshold.';

------------------------------------------------------------------------------
-- Notification of arrivals
------------------------------------------------------------------------------

-- As in revision 0001, and a notification on channel broker_queue with the
-- queue's id, which wakes REST readers that wait for it.  PostgreSQL sends
-- one per queue per transaction, however many messages it enqueued.
CREATE OR REPLACE FUNCTION broker._enqueue(receiver broker.endpoints, sequence_number bigint, message_type_id integer,
                                           body bytea)
RETURNS void
LANGUAGE sql AS $$
    INSERT INTO broker.queue_messages (queue_id, queue_position, conversation_group_id, conversation_handle,
                                       conversation_id, message_sequence_number, message_type_id, body)
    VALUES (receiver.queue_id, broker._next_queue_position(), receiver.conversation_group_id,
            receiver.conversation_handle, receiver.conversation_id, sequence_number, message_type_id, body);
    SELECT pg_notify('broker_queue', receiver.queue_id::text);
$$;

------------------------------------------------------------------------------
-- Idempotent numbered sends
------------------------------------------------------------------------------

-- What each numbered send carried, to recognise a retry.
CREATE TABLE broker.numbered_sends (
    conversation_handle  uuid NOT NULL REFERENCES broker.endpoints ON DELETE CASCADE,
    sequence_number      bigint NOT NULL,
    content_sha256       bytea NOT NULL,
    PRIMARY KEY (conversation_handle, sequence_number)
);

CREATE FUNCTION broker._content_sha256(message_type text, body bytea) RETURNS bytea
LANGUAGE sql IMMUTABLE AS $$
    SELECT sha256(convert_to(message_type, 'UTF8') || CASE WHEN body IS NULL THEN '\x00'::bytea
                                                             ELSE '\x01'::bytea || body END)
$$;

-- Sends message number sequence_number, chosen by the client, so that a
-- client can retry a send whose outcome it does not know: the same number
-- with the same content again is a no-op that returns false; the next number
-- sends and returns true.  Anything else raises BR021 with the number that
-- comes next in its DETAIL.
CREATE FUNCTION broker.send_numbered(conversation_handle uuid, sequence_number bigint, message_type text,
                                     body bytea DEFAULT NULL)
RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    sender broker.endpoints := broker._lock_endpoint(conversation_handle);
    expected bigint := sender.send_sequence + 1;
    digest bytea := broker._content_sha256(message_type, body);
    stored bytea;
BEGIN
    IF broker._require('sequence_number', sequence_number) = expected THEN
        PERFORM broker.send(conversation_handle, message_type, body);
        INSERT INTO broker.numbered_sends VALUES (conversation_handle, sequence_number, digest);
        RETURN true;
    END IF;
    SELECT content_sha256 INTO stored FROM broker.numbered_sends n
    WHERE n.conversation_handle = send_numbered.conversation_handle AND n.sequence_number = send_numbered.sequence_number;
    IF stored = digest THEN
        RETURN false;
    END IF;
    RAISE EXCEPTION USING ERRCODE = 'BR021', DETAIL = expected::text,
        MESSAGE = CASE WHEN stored IS NULL
            THEN format('message %s is out of turn on conversation %s: the next number is %s',
                        sequence_number, conversation_handle, expected)
            ELSE format('message %s of conversation %s was already sent with another content; the next number is %s',
                        sequence_number, conversation_handle, expected) END;
END $$;
COMMENT ON FUNCTION broker.send_numbered(uuid, bigint, text, bytea) IS
    'Idempotent send: the client numbers the message; a retry with the same number and content is a no-op.';
