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
-- share of dead rows rather than the default fifth of the table, and without
-- the cost-based pauses, so a steady stream reuses the same pages.  Rows
-- inserted are soon deleted: insertions alone never call for a vacuum.
ALTER TABLE broker.queue_messages SET (autovacuum_vacuum_scale_factor = 0.01, autovacuum_vacuum_threshold = 1000,
                                       autovacuum_vacuum_insert_threshold = -1, autovacuum_vacuum_cost_delay = 0);
ALTER TABLE broker.transmission_queue SET (autovacuum_vacuum_scale_factor = 0.01, autovacuum_vacuum_threshold = 1000,
                                           autovacuum_vacuum_insert_threshold = -1, autovacuum_vacuum_cost_delay = 0);

-- A receive starts from the oldest waiting messages of its queue: an index
-- of exactly those keeps that a short walk, however many received messages a
-- retention queue keeps and whatever the planner's statistics say of them.
CREATE INDEX queue_messages_waiting ON broker.queue_messages (queue_id, queue_position)
    WHERE received_at IS NULL;

-- Nothing reads the transmission queue by due time alone (batches go by
-- destination and conversation): the index only cost every send a write.
DROP INDEX broker.transmission_queue_due;

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

------------------------------------------------------------------------------
-- Sending
------------------------------------------------------------------------------

-- As in revision 0001.  A conversation with a remote far side (the common
-- case) is locked, numbered and checked by one UPDATE and its message goes
-- straight to the transmission queue; a local one, a type with validation,
-- or anything that fails a check takes the general path with its errors.
-- The notification carries the first hex digit of the handle, so that only
-- the relay lane for that share of the handles wakes (an empty one wakes all).
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
        PERFORM pg_notify('broker_transmission_queue', left(numbered.conversation_handle::text, 1));
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

-- Sends many messages of one type at once, bodies[i] on conversation_handles[i]
-- (bodies NULL: every body NULL).  A handle may appear more than once: its
-- messages are numbered in the order given.  Returns the sequence numbers in
-- that order.  All or nothing, with every check and error of broker.send.
-- Conversations with a remote far side sending a type without validation (the
-- common case) are locked in the order of their handles, numbered by one
-- UPDATE and queued by one INSERT; anything else goes through broker.send
-- one message at a time.
CREATE FUNCTION broker.send_batch(conversation_handles uuid[], message_type text, bodies bytea[] DEFAULT NULL)
RETURNS bigint[]
LANGUAGE plpgsql AS $$
DECLARE
    mt broker.message_types := broker._message_type(message_type);
    given integer := cardinality(conversation_handles);
    plain integer;
    numbers bigint[];
BEGIN
    IF given IS NULL OR array_position(conversation_handles, NULL) IS NOT NULL THEN
        PERFORM broker._raise('BR050', 'conversation_handles must be an array of conversation handles without NULL');
    END IF;
    IF cardinality(bodies) <> given THEN
        PERFORM broker._raise('BR050', format('bodies has %s elements and conversation_handles %s: give one body per handle',
            cardinality(bodies), given));
    END IF;
    SELECT count(*) INTO plain
    FROM (SELECT e.contract_id, e.is_initiator FROM broker.endpoints e
          WHERE e.conversation_handle = ANY (conversation_handles) AND e.state = 'conversing' AND NOT e.far_is_local
          ORDER BY e.conversation_handle
          FOR NO KEY UPDATE) e
    JOIN broker._plain_message_types p
      ON p.contract_id = e.contract_id AND p.sent_by_initiator = e.is_initiator AND p.message_type_id = mt.message_type_id;
    IF plain < (SELECT count(DISTINCT h) FROM unnest(conversation_handles) h)
       OR EXISTS (SELECT 1 FROM unnest(bodies) b WHERE octet_length(b) > (SELECT max_message_bytes FROM broker.node)) THEN
        numbers := '{}';
        FOR i IN 1 .. given LOOP
            numbers := numbers || broker.send(conversation_handles[i], message_type, bodies[i]);
        END LOOP;
        RETURN numbers;
    END IF;
    WITH numbered AS (
        SELECT g.k, g.h, e.send_sequence + row_number() OVER (PARTITION BY g.h ORDER BY g.k) AS sequence_number,
               e.conversation_id, e.far_service, g.b
        FROM unnest(conversation_handles, bodies) WITH ORDINALITY AS g(h, b, k)
        JOIN broker.endpoints e ON e.conversation_handle = g.h
        WHERE e.conversation_handle = ANY (conversation_handles)
    ), queued AS (
        INSERT INTO broker.transmission_queue (conversation_handle, message_sequence_number, conversation_id,
                                               to_service, message_type_id, body)
        SELECT n.h, n.sequence_number, n.conversation_id, n.far_service, mt.message_type_id, n.b FROM numbered n
    )
    SELECT array_agg(n.sequence_number ORDER BY n.k) INTO numbers FROM numbered n;
    UPDATE broker.endpoints e SET send_sequence = e.send_sequence + c.messages
    FROM (SELECT h, count(*) AS messages FROM unnest(conversation_handles) h GROUP BY h) c
    WHERE e.conversation_handle = c.h AND e.conversation_handle = ANY (conversation_handles);
    PERFORM pg_notify('broker_transmission_queue', digit)
    FROM (SELECT DISTINCT left(h::text, 1) AS digit FROM unnest(conversation_handles) h) digits;
    RETURN coalesce(numbers, '{}');
END $$;
COMMENT ON FUNCTION broker.send_batch(uuid[], text, bytea[]) IS
    'Sends bodies[i] on conversation_handles[i], all of one message type; returns the sequence numbers in order.';

------------------------------------------------------------------------------
-- Receiving
------------------------------------------------------------------------------

-- As in revision 0003, with the head of the queue walked by one statement
-- that passes over the groups other readers hold (SKIP LOCKED) or lease,
-- however many there are, rather than looking at the first 200 messages and
-- then at every group of the queue.  Leases are looked for message by message
-- only when the queue has any.  A lease committed before the group was locked
-- is seen by the check that follows, and then the walk looks for leases; none
-- can be taken after the group is locked.
CREATE OR REPLACE FUNCTION broker._lock_group(q broker.queues, requested_group uuid) RETURNS uuid
LANGUAGE plpgsql AS $$
DECLARE
    candidate uuid;
    leases_here boolean := EXISTS (SELECT 1 FROM broker.leases l WHERE l.queue_id = q.queue_id);
BEGIN
    IF requested_group IS NOT NULL THEN
        PERFORM 1 FROM broker.conversation_groups
        WHERE conversation_group_id = requested_group AND queue_id = q.queue_id
        FOR NO KEY UPDATE SKIP LOCKED;
        RETURN CASE WHEN FOUND AND broker._free_of_lease(q, requested_group) THEN requested_group END;
    END IF;
    LOOP
        SELECT g.conversation_group_id INTO candidate
        FROM broker.queue_messages m
        JOIN broker.conversation_groups g ON g.conversation_group_id = m.conversation_group_id
        WHERE m.queue_id = q.queue_id AND m.received_at IS NULL
          AND (NOT leases_here OR NOT EXISTS (SELECT 1 FROM broker.leases l
                                              WHERE l.conversation_group_id = m.conversation_group_id
                                                AND l.expires_at > clock_timestamp()))
        ORDER BY m.queue_position
        LIMIT 1
        FOR NO KEY UPDATE OF g SKIP LOCKED;
        IF candidate IS NULL OR NOT EXISTS (SELECT 1 FROM broker.leases l WHERE l.conversation_group_id = candidate)
           OR broker._free_of_lease(q, candidate) THEN
            RETURN candidate;
        END IF;
        leases_here := true;
    END LOOP;
END $$;

-- As in revision 0001; a group found at the head of the queue has messages,
-- so only a requested group is looked at again.
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
        IF locked_group IS NOT NULL AND (requested_group IS NULL OR EXISTS (
                SELECT 1 FROM broker.queue_messages
                WHERE conversation_group_id = locked_group AND queue_id = q.queue_id AND received_at IS NULL)) THEN
            RETURN locked_group;
        END IF;
        EXIT WHEN clock_timestamp() >= deadline;
        PERFORM pg_sleep(least(pause, extract(epoch FROM deadline - clock_timestamp())));
        pause := least(pause * 2, 0.1);
    END LOOP;
    RETURN NULL;
END $$;

-- As in revision 0001, with the group's messages picked by the group alone (a
-- group belongs to one queue): they come in the order of the group index,
-- the walk stops at max_messages, and what is returned comes from the rows
-- consumed (or kept, with retention) rather than from reading them again.
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
    -- Without retention every row of the queue waits (received rows are deleted):
    -- said so, the walk takes the group index alone, in its order.
    RETURN QUERY
    WITH picked AS (
        SELECT m.queue_position FROM broker.queue_messages m
        WHERE m.conversation_group_id = locked_group AND (NOT q.retention OR m.received_at IS NULL)
        ORDER BY m.conversation_handle, m.message_sequence_number
        LIMIT max_messages
    ), consumed AS (
        DELETE FROM broker.queue_messages m USING picked
        WHERE NOT q.retention AND m.queue_id = q.queue_id AND m.queue_position = picked.queue_position
        RETURNING m.*
    ), retained AS (
        UPDATE broker.queue_messages m SET received_at = now() FROM picked
        WHERE q.retention AND m.queue_id = q.queue_id AND m.queue_position = picked.queue_position
        RETURNING m.*
    ), names AS (  -- of the group's endpoints, once each
        SELECT e.conversation_handle, s.name AS service_name, c.name AS contract_name
        FROM broker.endpoints e
        JOIN broker.services s ON s.service_id = e.service_id
        JOIN broker.contracts c ON c.contract_id = e.contract_id
        WHERE e.conversation_group_id = locked_group
    )
    SELECT m.queue_position, m.conversation_group_id, m.conversation_handle, m.conversation_id,
           m.message_sequence_number, n.service_name, n.contract_name, mt.name, m.body, m.enqueued_at
    FROM (SELECT * FROM consumed UNION ALL SELECT * FROM retained) m
    JOIN names n ON n.conversation_handle = m.conversation_handle
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
    body                 bytea
);

-- A conversation of a batch whose endpoint here is locked for the batch.
CREATE TYPE broker._batch_conversation AS (
    conversation_handle uuid, conversation_id uuid, is_initiator boolean, receive_sequence bigint,
    queue_id integer, conversation_group_id uuid, contract_id integer
);

-- Locks the endpoints of the batch's conversations that can take it in bulk,
-- in the order of their conversation ids: one probe of the unique index each,
-- whatever the plan (a join here could be planned to rescan the batch once per
-- endpoint).
CREATE FUNCTION broker._lock_batch_conversations(from_instance uuid) RETURNS broker._batch_conversation[]
LANGUAGE plpgsql AS $$
BEGIN
    RETURN (
    SELECT array_agg(ROW(e.conversation_handle, e.conversation_id, e.is_initiator, e.receive_sequence, e.queue_id,
                         e.conversation_group_id, e.contract_id)::broker._batch_conversation)
    FROM (SELECT DISTINCT b.conversation_id, b.sender_is_initiator FROM pg_temp.incoming_transport_batch b
          ORDER BY b.conversation_id, b.sender_is_initiator) c,
         LATERAL (SELECT e.* FROM broker.endpoints e
                  WHERE e.conversation_id = c.conversation_id AND e.is_initiator = NOT c.sender_is_initiator
                    AND NOT e.far_is_local AND e.far_broker_instance = from_instance
                    AND e.state IN ('conversing', 'disconnected_inbound')
                    AND (SELECT q.is_enabled FROM broker.queues q WHERE q.queue_id = e.queue_id)
                  FOR UPDATE) e);
END $$;

-- Opens the batch's new conversations for services here that take their
-- contract, when all their messages are plain: the target endpoints, each in
-- a new group, created together.
CREATE FUNCTION broker._open_batch_conversations(from_instance uuid, limit_bytes integer) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    WITH new_conversations AS (
        SELECT b.conversation_id, array_agg(DISTINCT b.message_type) AS message_types,
               max(coalesce(octet_length(b.body), 0)) AS largest_body
        FROM pg_temp.incoming_transport_batch b
        WHERE b.sender_is_initiator
        GROUP BY b.conversation_id
        HAVING NOT EXISTS (SELECT 1 FROM broker.endpoints e
                           WHERE e.conversation_id = b.conversation_id AND NOT e.is_initiator)
           AND NOT EXISTS (SELECT 1 FROM broker.forgotten_conversations f
                           WHERE f.conversation_id = b.conversation_id AND NOT f.is_initiator)
    ), headers AS (  -- each new conversation's header, from its lowest-numbered message
        SELECT DISTINCT ON (b.conversation_id) b.*
        FROM pg_temp.incoming_transport_batch b
        JOIN new_conversations n ON n.conversation_id = b.conversation_id
        WHERE b.sender_is_initiator
        ORDER BY b.conversation_id, b.sequence_number
    ), plain AS (
        SELECT p.contract_id, array_agg(p.name) AS message_types
        FROM broker._plain_message_types p WHERE p.sent_by_initiator GROUP BY p.contract_id
    ), opening AS (
        SELECT gen_random_uuid() AS conversation_group_id, h.conversation_id, s.service_id, s.queue_id,
               ct.contract_id, broker._check_name('service', h.from_service) AS far_service, h.expires_at
        FROM new_conversations n
        JOIN headers h ON h.conversation_id = n.conversation_id
        JOIN broker.services s ON s.name = h.to_service
        JOIN broker.queues q ON q.queue_id = s.queue_id AND q.is_enabled
        JOIN broker.contracts ct ON ct.name = h.contract
        JOIN broker.service_contracts sc ON sc.service_id = s.service_id AND sc.contract_id = ct.contract_id
        JOIN plain ON plain.contract_id = ct.contract_id
        WHERE n.message_types <@ plain.message_types AND n.largest_body <= limit_bytes
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
END $$;

-- The steady state of a batch in a few statements: the batch's conversations
-- that are new here, or whose endpoint talks with the sending node, reads, and
-- has its queue enabled, when every message that comes next is plain.  The
-- batch is in pg_temp.incoming_transport_batch.  Returns their results; the
-- caller takes the others (refused, carrying system messages, ...) one by one.
CREATE FUNCTION broker._accept_in_bulk(from_instance uuid) RETURNS jsonb
LANGUAGE plpgsql AS $$
DECLARE
    limit_bytes integer := (SELECT max_message_bytes FROM broker.node);
    taken broker._batch_conversation[];
    results jsonb;
    queues integer[];
BEGIN
    taken := broker._lock_batch_conversations(from_instance);
    IF EXISTS (SELECT b.conversation_id FROM pg_temp.incoming_transport_batch b WHERE b.sender_is_initiator
               EXCEPT SELECT t.conversation_id FROM unnest(taken) t) THEN
        PERFORM broker._open_batch_conversations(from_instance, limit_bytes);
        taken := broker._lock_batch_conversations(from_instance);
    END IF;
    IF taken IS NULL THEN
        RETURN '[]';
    END IF;

    -- Each conversation's run of numbers after receive_sequence without a gap;
    -- a conversation is taken here only when all of its run is plain.
    WITH fresh AS (
        SELECT DISTINCT ON (t.conversation_handle, b.sequence_number) t.*, b.sequence_number, b.message_type, b.body
        FROM unnest(taken) t
        JOIN pg_temp.incoming_transport_batch b
          ON b.conversation_id = t.conversation_id AND b.sender_is_initiator = NOT t.is_initiator
        WHERE b.sequence_number > t.receive_sequence
        ORDER BY t.conversation_handle, b.sequence_number
    ), next_run AS (
        SELECT f.*, row_number() OVER (PARTITION BY f.conversation_handle ORDER BY f.sequence_number) AS k
        FROM fresh f
    ), judged AS (
        SELECT r.*, p.message_type_id,
               bool_and(p.name IS NOT NULL AND coalesce(octet_length(r.body), 0) <= limit_bytes)
                   OVER (PARTITION BY r.conversation_handle) AS plain
        FROM next_run r
        LEFT JOIN broker._plain_message_types p
               ON p.contract_id = r.contract_id AND p.sent_by_initiator = NOT r.is_initiator
              AND p.name = r.message_type
        WHERE r.sequence_number = r.receive_sequence + r.k
    ), accepted AS (
        SELECT j.*, row_number() OVER (ORDER BY j.conversation_handle, j.sequence_number) AS place
        FROM judged j WHERE j.plain
    ), stored AS (
        INSERT INTO broker.queue_messages (queue_id, queue_position, conversation_group_id, conversation_handle,
                                           conversation_id, message_sequence_number, message_type_id, body)
        SELECT a.queue_id, (SELECT broker._next_queue_positions(count(*)::integer) FROM accepted) + a.place - 1,
               a.conversation_group_id, a.conversation_handle, a.conversation_id, a.sequence_number,
               a.message_type_id, a.body
        FROM accepted a
        RETURNING queue_id
    ), moved_on AS (
        UPDATE broker.endpoints e SET receive_sequence = last.sequence_number
        FROM (SELECT a.conversation_handle, max(a.sequence_number) AS sequence_number
              FROM accepted a GROUP BY a.conversation_handle) last
        WHERE e.conversation_handle = last.conversation_handle
        RETURNING e.conversation_handle, e.receive_sequence
    )
    SELECT coalesce(jsonb_agg(jsonb_build_object(
               'conversation_id', t.conversation_id, 'sender_is_initiator', NOT t.is_initiator,
               'acknowledged', coalesce(m.receive_sequence, t.receive_sequence))), '[]'),
           (SELECT array_agg(DISTINCT queue_id) FROM stored)
    INTO results, queues
    FROM unnest(taken) t
    LEFT JOIN moved_on m ON m.conversation_handle = t.conversation_handle
    WHERE NOT EXISTS (SELECT 1 FROM judged j WHERE j.conversation_handle = t.conversation_handle AND NOT j.plain);
    PERFORM pg_notify('broker_queue', q::text) FROM unnest(queues) q;
    RETURN results;
END $$;

-- As in revision 0002, with the batch in pg_temp.incoming_transport_batch
-- (rows of broker.transport_message, filled by COPY in this transaction): the
-- steady state in bulk, the rest one conversation at a time, each in a
-- subtransaction of its own so that a bad conversation never spoils the rest.
-- Anything the bulk path trips over sends the whole batch the careful way.
DROP FUNCTION broker.accept_transport_batch(uuid, jsonb);
CREATE FUNCTION broker.accept_transport_batch(from_instance uuid) RETURNS jsonb
LANGUAGE plpgsql AS $$
DECLARE
    in_bulk jsonb;
    one_by_one jsonb;
BEGIN
    BEGIN
        in_bulk := broker._accept_in_bulk(from_instance);
    EXCEPTION WHEN OTHERS THEN
        in_bulk := '[]';
    END;
    WITH taken_in_bulk AS (
        SELECT * FROM jsonb_to_recordset(in_bulk) AS r(conversation_id uuid, sender_is_initiator boolean)
    ), left_over AS (
        SELECT b.conversation_id, b.sender_is_initiator,
               (array_agg(jsonb_build_object('conversation_id', b.conversation_id,
                                             'sender_is_initiator', b.sender_is_initiator,
                                             'from_service', b.from_service, 'to_service', b.to_service,
                                             'contract', b.contract, 'expires_at', b.expires_at)
                          ORDER BY b.sequence_number))[1] AS header,
               jsonb_agg(jsonb_build_object('sequence_number', b.sequence_number, 'message_type', b.message_type,
                                            'body', encode(b.body, 'base64')) ORDER BY b.sequence_number) AS messages
        FROM pg_temp.incoming_transport_batch b
        WHERE NOT EXISTS (SELECT 1 FROM taken_in_bulk t
                          WHERE t.conversation_id = b.conversation_id AND t.sender_is_initiator = b.sender_is_initiator)
        GROUP BY b.conversation_id, b.sender_is_initiator
    )
    SELECT coalesce(jsonb_agg(broker._accept_conversation(from_instance,
                                                          l.header || jsonb_build_object('messages', l.messages))),
                    '[]')
    INTO one_by_one
    FROM left_over l;
    RETURN jsonb_build_object('broker_instance', (SELECT broker_instance FROM broker.node),
                              'results', in_bulk || one_by_one);
END $$;
COMMENT ON FUNCTION broker.accept_transport_batch(uuid) IS
    'Stores what comes next of each conversation of the batch in pg_temp.incoming_transport_batch; returns the acknowledgements.';

------------------------------------------------------------------------------
-- Building a batch
------------------------------------------------------------------------------

-- As in revision 0002, as rows of broker.transport_message for COPY, and for
-- the conversations whose handles fall in [first_handle, last_handle]: a
-- relay splits the conversations among lanes that send at once.  The waiting
-- messages are read in the order of the transmission queue's key, up to
-- max_messages, rather than all of them sorted: a long queue (a peer down for
-- days) costs a batch no more than a short one.
DROP FUNCTION broker.transport_batch(text, integer);
CREATE FUNCTION broker.transport_batch(destination text, max_messages integer, first_handle uuid, last_handle uuid)
RETURNS SETOF broker.transport_message
LANGUAGE plpgsql STABLE AS $$
BEGIN  -- plpgsql rather than sql: the plan is kept between batches, not made again for each
    RETURN QUERY
    SELECT e.conversation_id, e.is_initiator, s.name, e.far_service, c.name, e.expires_at,
           due.message_sequence_number, mt.name, due.body
    FROM (SELECT t.* FROM broker.transmission_queue t
          WHERE t.conversation_handle BETWEEN first_handle AND last_handle
            AND t.to_service = ANY (ARRAY(SELECT r.service_name FROM broker.routes r WHERE r.address = destination))
            AND t.next_attempt_at <= now()
          ORDER BY t.conversation_handle, t.message_sequence_number
          LIMIT max_messages) due
    JOIN broker.endpoints e ON e.conversation_handle = due.conversation_handle
    JOIN broker.services s ON s.service_id = e.service_id
    JOIN broker.contracts c ON c.contract_id = e.contract_id
    JOIN broker.message_types mt ON mt.message_type_id = due.message_type_id;
END $$;

------------------------------------------------------------------------------
-- Applying the answer
------------------------------------------------------------------------------

-- As in revision 0002, with every acknowledgement applied by one DELETE and
-- one UPDATE; refusals and hold-backs are rare and handled one by one.  The
-- transaction that applies an answer commits without waiting for its WAL to
-- reach the disk: if a crash loses it, the messages it deleted are sent again
-- and the far node acknowledges them as duplicates (guarantee 3), so the
-- relay need not wait for a flush in every cycle.
CREATE OR REPLACE FUNCTION broker.apply_transport_results(answer jsonb) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    handles uuid[];
    acknowledged bigint[];
    answered boolean[];
    result record;
    delivered bigint;
BEGIN
    PERFORM set_config('synchronous_commit', 'off', true);
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

-- As in revision 0002, for the conversations of one lane of a relay: every
-- message of the lane waiting for the destination gets the reason in words
-- and its next attempt after the relay's back-off.
DROP FUNCTION broker.record_transport_failure(text, text, interval);
CREATE FUNCTION broker.record_transport_failure(destination text, first_handle uuid, last_handle uuid, reason text,
                                                retry_after interval) RETURNS void
LANGUAGE sql AS $$
    UPDATE broker.transmission_queue t
    SET attempts = t.attempts + 1,
        next_attempt_at = now() + retry_after,
        transmission_status = format('%s (attempt %s, next at %s)', reason, t.attempts + 1,
                                     to_char(now() + retry_after, 'YYYY-MM-DD HH24:MI:SS TZ'))
    FROM broker.routes r
    WHERE r.service_name = t.to_service AND r.address = destination
      AND t.conversation_handle BETWEEN first_handle AND last_handle
$$;

-- The relay keeps its back-off in memory and asks each destination for a
-- batch: nothing scans the whole transmission queue to find what is due.
DROP VIEW broker.transport_destinations;

------------------------------------------------------------------------------
-- Forgetting closed conversations
------------------------------------------------------------------------------

-- As in revision 0005, with the rows to delete locked by CTEs, which run once
-- (a locking subquery under IN can be planned to run again for every row of
-- the table), and nothing more done when nothing is past its retention: this
-- runs at every close and every acknowledgement.
CREATE OR REPLACE FUNCTION broker.forget_closed_endpoints(max_endpoints integer DEFAULT 1000) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    settings broker.node := (SELECT n FROM broker.node n);
    forgotten broker.endpoints[];
BEGIN
    WITH due AS (
        SELECT c.conversation_handle FROM broker.endpoints c
        WHERE c.state = 'closed' AND c.closed_at <= now() - settings.closed_endpoint_retention
          AND NOT EXISTS (SELECT 1 FROM broker.transmission_queue t
                          WHERE t.conversation_handle = c.conversation_handle)
        ORDER BY c.closed_at
        LIMIT broker._require('max_endpoints', max_endpoints)
        FOR UPDATE SKIP LOCKED
    ), gone AS (
        DELETE FROM broker.endpoints e USING due WHERE e.conversation_handle = due.conversation_handle
        RETURNING e.*
    )
    SELECT coalesce(array_agg(gone), '{}') INTO forgotten FROM gone;

    IF cardinality(forgotten) > 0 THEN
        INSERT INTO broker.forgotten_conversations (conversation_id, is_initiator, far_broker_instance,
                                                    receive_sequence)
        SELECT f.conversation_id, f.is_initiator, f.far_broker_instance, f.receive_sequence
        FROM unnest(forgotten) f WHERE NOT f.far_is_local
        ON CONFLICT DO NOTHING;
        DELETE FROM broker.queue_messages m
        USING unnest(forgotten) f
        WHERE m.conversation_group_id = f.conversation_group_id AND m.conversation_handle = f.conversation_handle;
        WITH emptied AS (
            SELECT candidate.conversation_group_id FROM broker.conversation_groups candidate
            WHERE candidate.conversation_group_id IN (SELECT f.conversation_group_id FROM unnest(forgotten) f)
              AND NOT EXISTS (SELECT 1 FROM broker.endpoints o
                              WHERE o.conversation_group_id = candidate.conversation_group_id)
              AND NOT EXISTS (SELECT 1 FROM broker.leases l
                              WHERE l.conversation_group_id = candidate.conversation_group_id)
            FOR UPDATE SKIP LOCKED
        )
        DELETE FROM broker.conversation_groups g USING emptied
        WHERE g.conversation_group_id = emptied.conversation_group_id;
    END IF;
    DELETE FROM broker.forgotten_conversations
    WHERE (conversation_id, is_initiator) IN (
        SELECT conversation_id, is_initiator FROM broker.forgotten_conversations
        WHERE forgotten_at < now() - settings.tombstone_retention
        ORDER BY forgotten_at LIMIT max_endpoints);
    RETURN cardinality(forgotten);
END $$;
