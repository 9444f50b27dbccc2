-- Removes what revision 0006 added and puts back the functions of revisions 0001 and 0002 it replaced.
CREATE VIEW broker.transport_destinations AS
SELECT r.address, r.broker_instance, min(r.peer_secret) AS peer_secret, min(t.next_attempt_at) AS next_attempt_at,
       count(*) AS waiting
FROM broker.transmission_queue t
JOIN broker.routes r ON r.service_name = t.to_service
GROUP BY r.address, r.broker_instance;

DROP FUNCTION broker.record_transport_failure(text, uuid, uuid, text, interval);
CREATE FUNCTION broker.record_transport_failure(destination text, reason text, retry_after interval) RETURNS void
LANGUAGE sql AS $$
    UPDATE broker.transmission_queue t
    SET attempts = t.attempts + 1,
        next_attempt_at = now() + retry_after,
        transmission_status = format('%s (attempt %s, next at %s)', reason, t.attempts + 1,
                                     to_char(now() + retry_after, 'YYYY-MM-DD HH24:MI:SS TZ'))
    FROM broker.routes r
    WHERE r.service_name = t.to_service AND r.address = destination
$$;

DROP INDEX broker.queue_messages_waiting;
CREATE INDEX transmission_queue_due ON broker.transmission_queue (next_attempt_at);
ALTER TABLE broker.endpoints RESET (fillfactor);
ALTER TABLE broker.queue_messages RESET (autovacuum_vacuum_scale_factor, autovacuum_vacuum_threshold,
                                         autovacuum_vacuum_insert_threshold, autovacuum_vacuum_cost_delay);
ALTER TABLE broker.transmission_queue RESET (autovacuum_vacuum_scale_factor, autovacuum_vacuum_threshold,
                                             autovacuum_vacuum_insert_threshold, autovacuum_vacuum_cost_delay);

CREATE OR REPLACE FUNCTION broker.send(conversation_handle uuid, message_type text, body bytea DEFAULT NULL) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    sender broker.endpoints := broker._lock_endpoint(conversation_handle);
    mt broker.message_types := broker._message_type(message_type);
    far_queue broker.queues;
BEGIN
    IF sender.state <> 'conversing' THEN
        PERFORM broker._raise('BR020', format('cannot send on conversation %s: it is %s',
            conversation_handle, replace(sender.state, '_', ' ')));
    END IF;
    IF mt.name LIKE 'broker.%' THEN
        PERFORM broker._raise('BR010', format('message type %L is sent by the broker itself', message_type),
            'use broker.end_conversation to end a conversation or report an error');
    END IF;
    PERFORM broker._check_message(sender.contract_id, sender.is_initiator, mt, body);
    IF sender.far_is_local THEN
        SELECT q.* INTO far_queue FROM broker.queues q JOIN broker.endpoints e USING (queue_id)
        WHERE e.conversation_id = sender.conversation_id AND e.is_initiator <> sender.is_initiator;
        IF NOT far_queue.is_enabled THEN
            PERFORM broker._raise('BR030', format('queue %L of service %L is disabled', far_queue.name, sender.far_service));
        END IF;
    END IF;
    RETURN broker._transmit(sender, mt, body);
END $$;

CREATE OR REPLACE FUNCTION broker._accept_messages(e broker.endpoints, messages jsonb) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    message jsonb;
    sequence_number bigint;
    mt broker.message_types;
    body bytea;
BEGIN
    IF NOT (SELECT is_enabled FROM broker.queues WHERE queue_id = e.queue_id) THEN
        PERFORM broker._raise('BR030', 'the target queue is disabled');
    END IF;
    FOR message IN SELECT value FROM jsonb_array_elements(messages) ORDER BY (value ->> 'sequence_number')::bigint LOOP
        sequence_number := (message ->> 'sequence_number')::bigint;
        CONTINUE WHEN sequence_number <= e.receive_sequence;
        EXIT WHEN sequence_number > e.receive_sequence + 1;
        mt := broker._message_type(message ->> 'message_type');
        body := decode(message ->> 'body', 'base64');
        IF mt.name NOT LIKE 'broker.%' THEN
            PERFORM broker._check_message(e.contract_id, NOT e.is_initiator, mt, body);
        END IF;
        PERFORM broker._deliver(e, sequence_number, mt, body);
        SELECT * INTO e FROM broker.endpoints WHERE conversation_handle = e.conversation_handle;
    END LOOP;
    RETURN e.receive_sequence;
END $$;

CREATE OR REPLACE FUNCTION broker.apply_transport_results(answer jsonb) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    result jsonb;
    e broker.endpoints;
    delivered bigint := 0;
    removed bigint;
BEGIN
    FOR result IN SELECT value FROM jsonb_array_elements(answer -> 'results') LOOP
        SELECT * INTO e FROM broker.endpoints
        WHERE conversation_id = (result ->> 'conversation_id')::uuid
          AND is_initiator = (result ->> 'sender_is_initiator')::boolean
          AND NOT far_is_local;
        CONTINUE WHEN NOT FOUND;
        DELETE FROM broker.transmission_queue
        WHERE conversation_handle = e.conversation_handle
          AND message_sequence_number <= (result ->> 'acknowledged')::bigint;
        GET DIAGNOSTICS removed = ROW_COUNT;
        delivered := delivered + removed;
        IF result ? 'refused' THEN
            PERFORM broker._refused_by_far_side(broker._lock_endpoint(e.conversation_handle),
                                                result -> 'refused' ->> 'reason');
        ELSIF result ? 'waiting' THEN
            UPDATE broker.transmission_queue
            SET transmission_status = 'the far node holds it back: ' || (result ->> 'waiting'),
                attempts = attempts + 1, next_attempt_at = now() + interval '5 seconds'
            WHERE conversation_handle = e.conversation_handle;
        ELSE  -- the far node answered for it: earlier failures no longer apply
            UPDATE broker.transmission_queue
            SET attempts = 0, transmission_status = 'sent; waiting for the numbers before it to be acknowledged'
            WHERE conversation_handle = e.conversation_handle AND attempts > 0;
        END IF;
    END LOOP;
    RETURN delivered;
END $$;

DROP FUNCTION broker.accept_transport_batch(uuid);
CREATE FUNCTION broker.accept_transport_batch(from_instance uuid, batch jsonb) RETURNS jsonb
LANGUAGE plpgsql AS $$
DECLARE
    results jsonb := '[]';
    header jsonb;
BEGIN
    IF jsonb_typeof(batch -> 'conversations') IS DISTINCT FROM 'array' THEN
        PERFORM broker._raise('BR050', 'a transport batch is {"conversations": [...]}');
    END IF;
    FOR header IN SELECT value FROM jsonb_array_elements(batch -> 'conversations') LOOP
        results := results || broker._accept_conversation(from_instance, header);
    END LOOP;
    RETURN jsonb_build_object('broker_instance', (SELECT broker_instance FROM broker.node), 'results', results);
END $$;
COMMENT ON FUNCTION broker.accept_transport_batch(uuid, jsonb) IS
    'Stores what comes next of each conversation in a batch from another node; returns the acknowledgements.';

DROP FUNCTION broker.transport_batch(text, integer, uuid, uuid);
CREATE FUNCTION broker.transport_batch(destination text, max_messages integer) RETURNS jsonb
LANGUAGE sql STABLE AS $$
    WITH due AS (
        SELECT t.* FROM broker.transmission_queue t
        JOIN broker.routes r ON r.service_name = t.to_service
        WHERE r.address = destination AND t.next_attempt_at <= now()
        ORDER BY t.conversation_handle, t.message_sequence_number
        LIMIT max_messages
    ), conversations AS (
        SELECT jsonb_build_object(
                   'conversation_id', e.conversation_id,
                   'sender_is_initiator', e.is_initiator,
                   'from_service', s.name,
                   'to_service', e.far_service,
                   'contract', c.name,
                   'expires_at', e.expires_at,
                   'messages', jsonb_agg(jsonb_build_object(
                       'sequence_number', due.message_sequence_number,
                       'message_type', mt.name,
                       'body', encode(due.body, 'base64')) ORDER BY due.message_sequence_number)) AS conversation
        FROM due
        JOIN broker.endpoints e ON e.conversation_handle = due.conversation_handle
        JOIN broker.services s ON s.service_id = e.service_id
        JOIN broker.contracts c ON c.contract_id = e.contract_id
        JOIN broker.message_types mt ON mt.message_type_id = due.message_type_id
        GROUP BY e.conversation_handle, e.conversation_id, e.is_initiator, s.name, e.far_service, c.name, e.expires_at
    )
    SELECT jsonb_build_object('conversations', coalesce(jsonb_agg(conversation), '[]')) FROM conversations
$$;

CREATE OR REPLACE FUNCTION broker.receive(queue text, max_messages integer DEFAULT 1, conversation_group uuid DEFAULT NULL,
                               wait_ms integer DEFAULT 0)
RETURNS SETOF broker.received_message
LANGUAGE plpgsql AS $$
DECLARE
    q broker.queues := broker._enabled_queue(queue);
    locked_group uuid;
BEGIN
    IF max_messages IS NULL OR max_messages < 1 THEN
        PERFORM broker._raise('BR050', format('max_messages must be at least 1, got %s', max_messages));
    END IF;
    locked_group := broker._wait_for_group(q, conversation_group, broker._require('wait_ms', wait_ms));
    IF locked_group IS NULL THEN
        RETURN;
    END IF;
    RETURN QUERY
    WITH picked AS (
        SELECT m.queue_position FROM broker.queue_messages m
        WHERE m.conversation_group_id = locked_group AND m.queue_id = q.queue_id AND m.received_at IS NULL
        ORDER BY m.conversation_handle, m.message_sequence_number
        LIMIT max_messages
    ), consumed AS (
        DELETE FROM broker.queue_messages m USING picked
        WHERE NOT q.retention AND m.queue_id = q.queue_id AND m.queue_position = picked.queue_position
    ), retained AS (
        UPDATE broker.queue_messages m SET received_at = now() FROM picked
        WHERE q.retention AND m.queue_id = q.queue_id AND m.queue_position = picked.queue_position
    )
    SELECT m.queue_position, m.conversation_group_id, m.conversation_handle, m.conversation_id,
           m.message_sequence_number, s.name, c.name, mt.name, m.body, m.enqueued_at
    FROM picked
    JOIN broker.queue_messages m ON m.queue_id = q.queue_id AND m.queue_position = picked.queue_position
    JOIN broker.endpoints e ON e.conversation_handle = m.conversation_handle
    JOIN broker.services s ON s.service_id = e.service_id
    JOIN broker.contracts c ON c.contract_id = e.contract_id
    JOIN broker.message_types mt ON mt.message_type_id = m.message_type_id
    ORDER BY m.conversation_handle, m.message_sequence_number;
END $$;

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

CREATE OR REPLACE FUNCTION broker._wait_for_group(q broker.queues, requested_group uuid, wait_ms integer) RETURNS uuid
LANGUAGE plpgsql AS $$
DECLARE
    deadline timestamptz := clock_timestamp() + make_interval(secs => wait_ms / 1000.0);
    pause double precision := 0.005;
    locked_group uuid;
BEGIN
    IF wait_ms < 0 THEN
        PERFORM broker._raise('BR050', format('wait_ms must not be negative, got %s', wait_ms));
    END IF;
    -- Marks this transaction as a reader of the queue (see broker.queue_status).
    PERFORM pg_advisory_xact_lock_shared(1651663723, q.queue_id);
    LOOP
        PERFORM broker._fire_due_events(q.queue_id);
        locked_group := broker._lock_group(q, requested_group);
        IF locked_group IS NOT NULL AND EXISTS (
                SELECT 1 FROM broker.queue_messages
                WHERE conversation_group_id = locked_group AND queue_id = q.queue_id AND received_at IS NULL) THEN
            RETURN locked_group;
        END IF;
        EXIT WHEN clock_timestamp() >= deadline;
        PERFORM pg_sleep(least(pause, extract(epoch FROM deadline - clock_timestamp())));
        pause := least(pause * 2, 0.1);
    END LOOP;
    RETURN NULL;
END $$;

DROP FUNCTION broker._accept_in_bulk(uuid);
DROP FUNCTION broker._open_batch_conversations(uuid, integer);
DROP FUNCTION broker._lock_batch_conversations(uuid);
DROP TYPE broker._batch_conversation;
DROP TYPE broker.transport_message;
DROP FUNCTION broker.send_batch(uuid[], text, bytea[]);
DROP VIEW broker._plain_message_types;
DROP FUNCTION broker._next_queue_positions(integer);

CREATE OR REPLACE FUNCTION broker.forget_closed_endpoints(max_endpoints integer DEFAULT 1000) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    settings broker.node := (SELECT n FROM broker.node n);
    forgotten broker.endpoints[];
BEGIN
    WITH gone AS (
        DELETE FROM broker.endpoints e
        WHERE e.conversation_handle IN (
            SELECT c.conversation_handle FROM broker.endpoints c
            WHERE c.state = 'closed' AND c.closed_at <= now() - settings.closed_endpoint_retention
              AND NOT EXISTS (SELECT 1 FROM broker.transmission_queue t
                              WHERE t.conversation_handle = c.conversation_handle)
            ORDER BY c.closed_at
            LIMIT broker._require('max_endpoints', max_endpoints)
            FOR UPDATE SKIP LOCKED)
        RETURNING e.*
    )
    SELECT coalesce(array_agg(gone), '{}') INTO forgotten FROM gone;

    INSERT INTO broker.forgotten_conversations (conversation_id, is_initiator, far_broker_instance, receive_sequence)
    SELECT f.conversation_id, f.is_initiator, f.far_broker_instance, f.receive_sequence
    FROM unnest(forgotten) f WHERE NOT f.far_is_local
    ON CONFLICT DO NOTHING;
    DELETE FROM broker.queue_messages m
    USING unnest(forgotten) f
    WHERE m.conversation_group_id = f.conversation_group_id AND m.conversation_handle = f.conversation_handle;
    DELETE FROM broker.conversation_groups g
    WHERE g.conversation_group_id IN (
        SELECT candidate.conversation_group_id FROM broker.conversation_groups candidate
        WHERE candidate.conversation_group_id IN (SELECT f.conversation_group_id FROM unnest(forgotten) f)
          AND NOT EXISTS (SELECT 1 FROM broker.endpoints o
                          WHERE o.conversation_group_id = candidate.conversation_group_id)
          AND NOT EXISTS (SELECT 1 FROM broker.leases l
                          WHERE l.conversation_group_id = candidate.conversation_group_id)
        FOR UPDATE SKIP LOCKED);
    DELETE FROM broker.forgotten_conversations
    WHERE (conversation_id, is_initiator) IN (
        SELECT conversation_id, is_initiator FROM broker.forgotten_conversations
        WHERE forgotten_at < now() - settings.tombstone_retention
        ORDER BY forgotten_at LIMIT max_endpoints);
    RETURN cardinality(forgotten);
END $$;
