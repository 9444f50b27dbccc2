-- Speed: the message path in fewer statements, and tables kept compact under
-- steady traffic.  Frozen with revision 0006.  Behaviour is unchanged: every
-- check and error of revisions 0001-0005 still applies, in the same order.

------------------------------------------------------------------------------
-- Storage
------------------------------------------------------------------------------

-- Endpoints are updated with every message sent or accepted: free space on
-- each page lets those updates stay on the page (HOT), without index writes.
ALTER TABLE broker.endpoints SET (fillfactor = 70);

-- Queue tables are written and emptied all day: vacuum them after a small
-- share of dead rows rather than the default fifth of the table, so a steady
-- stream reuses the same pages.
ALTER TABLE broker.queue_messages SET (autovacuum_vacuum_scale_factor = 0.01, autovacuum_vacuum_threshold = 1000,
                                       autovacuum_vacuum_insert_scale_factor = 0.01);
ALTER TABLE broker.transmission_queue SET (autovacuum_vacuum_scale_factor = 0.01, autovacuum_vacuum_threshold = 1000,
                                           autovacuum_vacuum_insert_scale_factor = 0.01);

-- A receive starts from the oldest waiting messages of its queue: an index
-- of exactly those keeps that a short walk, however many received messages a
-- retention queue keeps and whatever the planner's statistics say of them.
CREATE INDEX queue_messages_waiting ON broker.queue_messages (queue_id, queue_position)
    WHERE received_at IS NULL;

-- Nothing reads the transmission queue by due time alone (batches go by
-- destination and conversation): the index only cost every send a write.
DROP INDEX broker.transmission_queue_due;

------------------------------------------------------------------------------
-- Sending
------------------------------------------------------------------------------

-- As in revision 0001.  A conversation with a remote far side (the common
-- case) is locked, numbered and checked by one UPDATE and its message goes
-- straight to the transmission queue; a local one, a type with validation,
-- or anything that fails a check takes the general path with its errors.
CREATE OR REPLACE FUNCTION broker.send(conversation_handle uuid, message_type text, body bytea DEFAULT NULL)
RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    sender broker.endpoints;
    mt broker.message_types;
    far_queue broker.queues;
    numbered record;
BEGIN
    -- The common case in one statement: a conversing endpoint with a remote far
    -- side, sending a type without validation that its contract allows it to.
    UPDATE broker.endpoints e SET send_sequence = e.send_sequence + 1
    FROM broker.message_types t, broker.contract_message_types cmt
    WHERE e.conversation_handle = send.conversation_handle AND e.state = 'conversing' AND NOT e.far_is_local
      AND t.name = message_type AND t.validation = 'none' AND t.name NOT LIKE 'broker.%'
      AND cmt.contract_id = e.contract_id AND cmt.message_type_id = t.message_type_id
      AND cmt.sent_by IN ('any', CASE WHEN e.is_initiator THEN 'initiator' ELSE 'target' END)
      AND coalesce(octet_length(body), 0) <= (SELECT max_message_bytes FROM broker.node)
    RETURNING e.conversation_handle, e.send_sequence, e.conversation_id, e.far_service, t.message_type_id
    INTO numbered;
    IF FOUND THEN
        INSERT INTO broker.transmission_queue (conversation_handle, message_sequence_number, conversation_id,
                                               to_service, message_type_id, body)
        VALUES (numbered.conversation_handle, numbered.send_sequence, numbered.conversation_id, numbered.far_service,
                numbered.message_type_id, body);
        PERFORM pg_notify('broker_transmission_queue', '');
        RETURN numbered.send_sequence;
    END IF;

    sender := broker._lock_endpoint(conversation_handle);
    mt := broker._message_type(message_type);
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
COMMENT ON FUNCTION broker.send(uuid, text, bytea) IS
    'Sends a message on a conversation; returns its sequence number.  Durable when the caller commits.';

------------------------------------------------------------------------------
-- Receiving
------------------------------------------------------------------------------

-- As in revision 0001, with the group's messages picked by the group alone (a
-- group belongs to one queue): they come in the order of the group index,
-- and the walk stops at max_messages.
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
        WHERE m.conversation_group_id = locked_group AND m.received_at IS NULL
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

------------------------------------------------------------------------------
-- Accepting a batch from another node
------------------------------------------------------------------------------

-- n commit-ordered positions (see broker._next_queue_position): returns the
-- first; the others follow it one by one.
CREATE FUNCTION broker._next_queue_positions(n integer) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    first integer := coalesce(nullif(current_setting('broker.position_counter', true), ''), '0')::integer + 1;
BEGIN
    IF first + n - 1 >= 1048576 THEN
        PERFORM broker._raise('BR050', 'a transaction may enqueue at most 1048575 messages');
    END IF;
    PERFORM set_config('broker.position_counter', (first + n - 1)::text, true);
    RETURN (pg_current_xact_id()::text::bigint << 20) | first;
END $$;

-- As in revision 0002.  The messages that come next are stored by one INSERT
-- and the endpoint moves on by one UPDATE, when they are all application
-- messages for an endpoint whose application still reads; system messages
-- (which change the endpoint's state) are delivered one by one as before.
CREATE OR REPLACE FUNCTION broker._accept_messages(e broker.endpoints, messages jsonb) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    message jsonb;
    sequence_number bigint;
    mt broker.message_types;
    body bytea;
    next_messages jsonb;
    stored integer;
    first_position bigint;
BEGIN
    IF NOT (SELECT is_enabled FROM broker.queues WHERE queue_id = e.queue_id) THEN
        PERFORM broker._raise('BR030', 'the target queue is disabled');
    END IF;
    -- The run of numbers that follows receive_sequence without a gap, in order.
    SELECT coalesce(jsonb_agg(m ORDER BY n), '[]') INTO next_messages
    FROM (SELECT m, n, row_number() OVER (ORDER BY n) AS k
          FROM (SELECT DISTINCT ON (n) m, n
                FROM jsonb_array_elements(messages) m, CAST(m ->> 'sequence_number' AS bigint) n
                WHERE n > e.receive_sequence
                ORDER BY n) once_each) numbered
    WHERE n = e.receive_sequence + k;

    IF e.state IN ('conversing', 'disconnected_inbound')
       AND NOT jsonb_path_exists(next_messages, '$[*] ? (@.message_type starts with "broker.")') THEN
        FOR message IN
            SELECT m FROM jsonb_array_elements(next_messages) m
            WHERE NOT EXISTS (SELECT 1 FROM broker.message_types t
                              JOIN broker.contract_message_types cmt
                                ON cmt.message_type_id = t.message_type_id AND cmt.contract_id = e.contract_id
                               AND cmt.sent_by IN ('any', CASE WHEN e.is_initiator THEN 'target' ELSE 'initiator' END)
                              WHERE t.name = m ->> 'message_type' AND t.validation = 'none'
                                AND octet_length(decode(m ->> 'body', 'base64'))
                                    <= (SELECT max_message_bytes FROM broker.node))
        LOOP  -- raises for the first message that does not pass (it would be refused)
            PERFORM broker._check_message(e.contract_id, NOT e.is_initiator,
                                          broker._message_type(message ->> 'message_type'),
                                          decode(message ->> 'body', 'base64'));
        END LOOP;
        stored := jsonb_array_length(next_messages);
        IF stored = 0 THEN
            RETURN e.receive_sequence;
        END IF;
        first_position := broker._next_queue_positions(stored);
        INSERT INTO broker.queue_messages (queue_id, queue_position, conversation_group_id, conversation_handle,
                                           conversation_id, message_sequence_number, message_type_id, body)
        SELECT e.queue_id, first_position + m.k - 1, e.conversation_group_id, e.conversation_handle,
               e.conversation_id, (m.value ->> 'sequence_number')::bigint, t.message_type_id,
               decode(m.value ->> 'body', 'base64')
        FROM jsonb_array_elements(next_messages) WITH ORDINALITY AS m(value, k)
        JOIN broker.message_types t ON t.name = m.value ->> 'message_type';
        UPDATE broker.endpoints SET receive_sequence = e.receive_sequence + stored
        WHERE conversation_handle = e.conversation_handle;
        PERFORM pg_notify('broker_queue', e.queue_id::text);
        RETURN e.receive_sequence + stored;
    END IF;

    FOR message IN SELECT value FROM jsonb_array_elements(next_messages) LOOP
        sequence_number := (message ->> 'sequence_number')::bigint;
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

-- The message types each side of each contract may send that are stored
-- without a second look: application types without validation.  A message
-- of such a type within the size limit is "plain" for broker._accept_in_bulk.
CREATE VIEW broker._plain_message_types AS
SELECT cmt.contract_id, side.sent_by_initiator, t.name, t.message_type_id
FROM broker.contract_message_types cmt
JOIN broker.message_types t USING (message_type_id)
CROSS JOIN (VALUES (true), (false)) AS side(sent_by_initiator)
WHERE t.validation = 'none' AND t.name NOT LIKE 'broker.%'
  AND cmt.sent_by IN ('any', CASE WHEN side.sent_by_initiator THEN 'initiator' ELSE 'target' END);

-- A conversation of a batch whose endpoint is here, and the messages of a
-- batch that come next, as broker._accept_in_bulk collects them.
CREATE TYPE broker._bulk_conversation AS (
    ord bigint, conversation_handle uuid, conversation_id uuid, sender_is_initiator boolean,
    receive_sequence bigint, queue_id integer, conversation_group_id uuid, contract_id integer,
    is_initiator boolean, messages jsonb
);
CREATE TYPE broker._bulk_message AS (
    ord bigint, conversation_handle uuid, conversation_id uuid, queue_id integer, conversation_group_id uuid,
    sequence_number bigint, message_type_id integer, body bytea, simple boolean
);

-- The steady state of a batch in a few statements: new conversations, and
-- those whose endpoint is here, talks with the sending node, reads, and whose
-- queue is enabled, when every message that comes next is plain (see
-- broker._plain_message_types).  Returns their
-- results, keyed by their place in the batch; the caller takes the others
-- (new, refused, carrying system messages, ...) one by one.
CREATE FUNCTION broker._accept_in_bulk(from_instance uuid, conversations jsonb) RETURNS jsonb
LANGUAGE plpgsql AS $$
DECLARE
    taken broker._bulk_conversation[];
    incoming broker._bulk_message[];
    unusual bigint[];
    first_position bigint;
    -- A body's size read off its base64 text (a hair above the true size: a body within a
    -- few bytes of the limit takes the careful path, which measures it exactly).
    limit_bytes integer := (SELECT max_message_bytes FROM broker.node);
    results jsonb;
BEGIN
    -- New conversations for services here that take their contract: the target
    -- endpoints, each in a new group, created together.
    WITH listed AS (
        SELECT c.h, (c.h ->> 'conversation_id')::uuid AS conversation_id,
               count(*) OVER (PARTITION BY c.h ->> 'conversation_id') AS copies
        FROM jsonb_array_elements(conversations) c(h)
        WHERE (c.h ->> 'sender_is_initiator')::boolean
    ), opening AS (
        SELECT gen_random_uuid() AS conversation_group_id, l.conversation_id, s.service_id, s.queue_id,
               ct.contract_id, broker._check_name('service', l.h ->> 'from_service') AS far_service,
               (l.h ->> 'expires_at')::timestamptz AS expires_at
        FROM listed l
        JOIN broker.services s ON s.name = l.h ->> 'to_service'
        JOIN broker.queues q ON q.queue_id = s.queue_id AND q.is_enabled
        JOIN broker.contracts ct ON ct.name = l.h ->> 'contract'
        JOIN broker.service_contracts sc ON sc.service_id = s.service_id AND sc.contract_id = ct.contract_id
        WHERE l.copies = 1
          AND NOT EXISTS (SELECT 1 FROM broker.endpoints e
                          WHERE e.conversation_id = l.conversation_id AND NOT e.is_initiator)
          AND NOT EXISTS (SELECT 1 FROM broker.forgotten_conversations f
                          WHERE f.conversation_id = l.conversation_id AND NOT f.is_initiator)
          AND jsonb_typeof(l.h -> 'messages') = 'array'
          AND NOT EXISTS (SELECT 1 FROM jsonb_array_elements(l.h -> 'messages') m
                          LEFT JOIN broker._plain_message_types p
                                 ON p.contract_id = ct.contract_id AND p.sent_by_initiator AND p.name = m ->> 'message_type'
                          WHERE p.name IS NULL OR coalesce(length(m ->> 'body'), 0) / 4 * 3 > limit_bytes)
    ), opened_groups AS (
        INSERT INTO broker.conversation_groups (conversation_group_id, queue_id)
        SELECT conversation_group_id, queue_id FROM opening
    )
    INSERT INTO broker.endpoints (conversation_handle, conversation_id, is_initiator, conversation_group_id,
                                  service_id, queue_id, far_service, far_is_local, far_broker_instance,
                                  contract_id, expires_at)
    SELECT gen_random_uuid(), o.conversation_id, false, o.conversation_group_id, o.service_id, o.queue_id,
           o.far_service, false, from_instance, o.contract_id, o.expires_at
    FROM opening o;

    WITH listed AS (
        SELECT c.ord, c.h, (c.h ->> 'conversation_id')::uuid AS conversation_id,
               (c.h ->> 'sender_is_initiator')::boolean AS sender_is_initiator,
               count(*) OVER (PARTITION BY c.h ->> 'conversation_id') AS copies
        FROM jsonb_array_elements(conversations) WITH ORDINALITY AS c(h, ord)
    ), locked AS (
        SELECT l.ord, e.conversation_handle, e.conversation_id, l.sender_is_initiator, e.receive_sequence, e.queue_id,
               e.conversation_group_id, e.contract_id, e.is_initiator, l.h -> 'messages' AS messages
        FROM listed l
        JOIN broker.endpoints e ON e.conversation_id = l.conversation_id AND e.is_initiator = NOT l.sender_is_initiator
        WHERE l.copies = 1 AND jsonb_typeof(l.h -> 'messages') = 'array'
          AND NOT e.far_is_local AND e.far_broker_instance = from_instance
          AND e.state IN ('conversing', 'disconnected_inbound')
          AND (SELECT q.is_enabled FROM broker.queues q WHERE q.queue_id = e.queue_id)
        ORDER BY e.conversation_handle
        FOR UPDATE OF e
    )
    SELECT array_agg(ROW(l.ord, l.conversation_handle, l.conversation_id, l.sender_is_initiator, l.receive_sequence,
                         l.queue_id, l.conversation_group_id, l.contract_id, l.is_initiator,
                         l.messages)::broker._bulk_conversation)
    INTO taken FROM locked l;
    IF taken IS NULL THEN
        RETURN '{}';
    END IF;

    -- Each conversation's run of numbers after receive_sequence without a gap, checked.
    WITH fresh AS (
        SELECT DISTINCT ON (c.ord, n) c.*, n, m
        FROM unnest(taken) c, jsonb_array_elements(c.messages) m, CAST(m ->> 'sequence_number' AS bigint) n
        WHERE n > c.receive_sequence
        ORDER BY c.ord, n
    ), next_run AS (
        SELECT f.*, row_number() OVER (PARTITION BY f.ord ORDER BY f.n) AS k FROM fresh f
    )
    SELECT array_agg(ROW(r.ord, r.conversation_handle, r.conversation_id, r.queue_id, r.conversation_group_id, r.n,
                         p.message_type_id, decode(r.m ->> 'body', 'base64'),
                         p.name IS NOT NULL AND coalesce(length(r.m ->> 'body'), 0) / 4 * 3 <= limit_bytes
                        )::broker._bulk_message)
    INTO incoming
    FROM next_run r
    LEFT JOIN broker._plain_message_types p
           ON p.contract_id = r.contract_id AND p.sent_by_initiator = NOT r.is_initiator
          AND p.name = r.m ->> 'message_type'
    WHERE r.n = r.receive_sequence + r.k;

    -- Conversations with anything unusual go the careful way, all of their messages with them.
    SELECT array_agg(DISTINCT i.ord) INTO unusual FROM unnest(incoming) i WHERE NOT i.simple;
    IF unusual IS NOT NULL THEN
        SELECT array_agg(c) INTO taken FROM unnest(taken) c WHERE c.ord <> ALL (unusual);
        SELECT array_agg(i) INTO incoming FROM unnest(incoming) i WHERE i.ord <> ALL (unusual);
    END IF;
    IF taken IS NULL THEN
        RETURN '{}';
    END IF;

    IF incoming IS NOT NULL THEN
        first_position := broker._next_queue_positions(cardinality(incoming));
        INSERT INTO broker.queue_messages (queue_id, queue_position, conversation_group_id, conversation_handle,
                                           conversation_id, message_sequence_number, message_type_id, body)
        SELECT i.queue_id, first_position + row_number() OVER (ORDER BY i.ord, i.sequence_number) - 1,
               i.conversation_group_id, i.conversation_handle, i.conversation_id, i.sequence_number,
               i.message_type_id, i.body
        FROM unnest(incoming) i;
        UPDATE broker.endpoints e SET receive_sequence = last.sequence_number
        FROM (SELECT i.conversation_handle, max(i.sequence_number) AS sequence_number
              FROM unnest(incoming) i GROUP BY i.conversation_handle) last
        WHERE e.conversation_handle = last.conversation_handle;
        PERFORM pg_notify('broker_queue', queue_id::text) FROM (SELECT DISTINCT i.queue_id FROM unnest(incoming) i) q;
    END IF;

    SELECT jsonb_object_agg(c.ord::text, jsonb_build_object(
               'conversation_id', c.conversation_id, 'sender_is_initiator', c.sender_is_initiator,
               'acknowledged', greatest(c.receive_sequence, last.sequence_number)))
    INTO results
    FROM unnest(taken) c
    LEFT JOIN (SELECT i.ord, max(i.sequence_number) AS sequence_number FROM unnest(incoming) i GROUP BY i.ord) last
           ON last.ord = c.ord;
    RETURN results;
END $$;

-- As in revision 0002: the steady state in bulk, the rest one conversation
-- at a time, each in a subtransaction of its own so that a bad conversation
-- never spoils the rest.  Anything the bulk path trips over sends the whole
-- batch the careful way.
CREATE OR REPLACE FUNCTION broker.accept_transport_batch(from_instance uuid, batch jsonb) RETURNS jsonb
LANGUAGE plpgsql AS $$
DECLARE
    in_bulk jsonb;
    results jsonb;
BEGIN
    IF jsonb_typeof(batch -> 'conversations') IS DISTINCT FROM 'array' THEN
        PERFORM broker._raise('BR050', 'a transport batch is {"conversations": [...]}');
    END IF;
    BEGIN
        in_bulk := broker._accept_in_bulk(from_instance, batch -> 'conversations');
    EXCEPTION WHEN OTHERS THEN
        in_bulk := '{}';
    END;
    SELECT coalesce(jsonb_agg(coalesce(in_bulk -> c.ord::text, broker._accept_conversation(from_instance, c.h))
                              ORDER BY c.ord), '[]')
    INTO results
    FROM jsonb_array_elements(batch -> 'conversations') WITH ORDINALITY AS c(h, ord);
    RETURN jsonb_build_object('broker_instance', (SELECT broker_instance FROM broker.node), 'results', results);
END $$;

------------------------------------------------------------------------------
-- Building a batch
------------------------------------------------------------------------------

-- As in revision 0002, with the waiting messages read in the order of the
-- transmission queue's key, up to max_messages, rather than all of them
-- sorted: a long queue (a peer down for days) costs a batch no more than a
-- short one.  The batch is built as json text (the relay sends it as it is),
-- not as jsonb.
DROP FUNCTION broker.transport_batch(text, integer);
CREATE FUNCTION broker.transport_batch(destination text, max_messages integer) RETURNS json
LANGUAGE sql STABLE AS $$
    WITH due AS (
        SELECT t.* FROM broker.transmission_queue t
        WHERE t.to_service = ANY (ARRAY(SELECT r.service_name FROM broker.routes r WHERE r.address = destination))
          AND t.next_attempt_at <= now()
        ORDER BY t.conversation_handle, t.message_sequence_number
        LIMIT max_messages
    ), conversations AS (
        SELECT json_build_object(
                   'conversation_id', e.conversation_id,
                   'sender_is_initiator', e.is_initiator,
                   'from_service', s.name,
                   'to_service', e.far_service,
                   'contract', c.name,
                   'expires_at', e.expires_at,
                   'messages', json_agg(json_build_object(
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
    SELECT json_build_object('conversations', coalesce(json_agg(conversation), '[]'::json)) FROM conversations
$$;

------------------------------------------------------------------------------
-- Applying the answer
------------------------------------------------------------------------------

-- As in revision 0002, with every acknowledgement applied by one DELETE and
-- one UPDATE; refusals and hold-backs are rare and handled one by one.
CREATE OR REPLACE FUNCTION broker.apply_transport_results(answer jsonb) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    handles uuid[];
    acknowledged bigint[];
    answered boolean[];
    result record;
    delivered bigint;
BEGIN
    SELECT array_agg(e.conversation_handle), array_agg((r ->> 'acknowledged')::bigint),
           array_agg(NOT (r ? 'refused' OR r ? 'waiting'))
    INTO handles, acknowledged, answered
    FROM jsonb_array_elements(answer -> 'results') r
    JOIN broker.endpoints e ON e.conversation_id = (r ->> 'conversation_id')::uuid
                           AND e.is_initiator = (r ->> 'sender_is_initiator')::boolean AND NOT e.far_is_local;

    WITH removed AS (
        DELETE FROM broker.transmission_queue t
        USING unnest(handles, acknowledged) AS a(conversation_handle, acknowledged)
        WHERE t.conversation_handle = a.conversation_handle AND t.message_sequence_number <= a.acknowledged
        RETURNING 1
    )
    SELECT count(*) INTO delivered FROM removed;
    -- The far node answered for these: earlier failures no longer apply.
    UPDATE broker.transmission_queue t
    SET attempts = 0, transmission_status = 'sent; waiting for the numbers before it to be acknowledged'
    FROM unnest(handles, answered) AS a(conversation_handle, answered)
    WHERE t.conversation_handle = a.conversation_handle AND a.answered AND t.attempts > 0;

    FOR result IN
        SELECT e.conversation_handle, r AS answer
        FROM jsonb_array_elements(answer -> 'results') r
        JOIN broker.endpoints e ON e.conversation_id = (r ->> 'conversation_id')::uuid
                               AND e.is_initiator = (r ->> 'sender_is_initiator')::boolean AND NOT e.far_is_local
        WHERE r ? 'refused' OR r ? 'waiting'
    LOOP
        IF result.answer ? 'refused' THEN
            PERFORM broker._refused_by_far_side(broker._lock_endpoint(result.conversation_handle),
                                                result.answer -> 'refused' ->> 'reason');
        ELSE
            UPDATE broker.transmission_queue
            SET transmission_status = 'the far node holds it back: ' || (result.answer ->> 'waiting'),
                attempts = attempts + 1, next_attempt_at = now() + interval '5 seconds'
            WHERE conversation_handle = result.conversation_handle;
        END IF;
    END LOOP;
    RETURN delivered;
END $$;
