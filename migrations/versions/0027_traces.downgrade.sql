-- Back to messages without traces (revision 0026): the functions first, then
-- the columns, the attributes and the domain.

-- Numbers a message from a locked endpoint and hands it to the far side:
-- delivered in this transaction when the far side is local, otherwise put
-- on the transmission queue.  A message with a delivery time to come is held
-- until then, and so is every later message of its side of the conversation
-- while one is held, whatever the far side: each waits in the transmission
-- queue, due at the latest delivery time (held_until) so far.  The relay sends
-- a remote one once it is due; broker._fire_due_events delivers a local one,
-- and forgets held_until when none is left.  Returns the message's sequence
-- number.
CREATE OR REPLACE FUNCTION broker._transmit(sender broker.endpoints, mt broker.message_types, body bytea,
                                 deliver_at timestamptz DEFAULT NULL)
RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    sequence_number bigint := sender.send_sequence + 1;
    hold_until timestamptz := CASE WHEN deliver_at > clock_timestamp() THEN greatest(deliver_at, sender.held_until)
                                   ELSE sender.held_until END;
    far broker.endpoints;
BEGIN
    UPDATE broker.endpoints e SET send_sequence = sequence_number, held_until = hold_until
    WHERE e.conversation_handle = sender.conversation_handle;
    IF sender.far_is_local AND hold_until IS NULL THEN
        far := broker._far_endpoint(sender);
        PERFORM broker._deliver(far, sequence_number, mt, body);
    ELSE
        INSERT INTO broker.transmission_queue (conversation_handle, message_sequence_number, conversation_id,
                                               to_service, message_type_id, body, next_attempt_at, priority)
        VALUES (sender.conversation_handle, sequence_number, sender.conversation_id,
                sender.far_service, mt.message_type_id, body, greatest(hold_until, now()), sender.priority);
        IF NOT sender.far_is_local THEN
            PERFORM pg_notify('broker_transmission_queue', '');
        END IF;
    END IF;
    RETURN sequence_number;
END $$;

-- A conversation with a remote far side (the common case) is locked, numbered
-- and checked by one UPDATE and its message goes straight to the transmission
-- queue; a local one, a type with validation, or anything that fails a check
-- takes the general path with its errors.  The notification carries the first
-- hex digit of the handle, so that only the relay lane for that share of the
-- handles wakes (an empty one wakes all).  A conversation past its lifetime
-- refuses to send (BR020), on either side, even before its expiry has been
-- fired.  A message given a delivery time (deliver_after from now, or
-- deliver_at) is held until then, and the later ones of its conversation
-- behind it (broker._transmit).
CREATE OR REPLACE FUNCTION broker.send(conversation_handle uuid, message_type text, body bytea DEFAULT NULL,
                            deliver_after interval DEFAULT NULL, deliver_at timestamptz DEFAULT NULL)
RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    sender broker.endpoints;
    mt broker.message_types;
    far_queue broker.queues;
    numbered record;
    due timestamptz := CASE WHEN deliver_after IS NOT NULL OR deliver_at IS NOT NULL
                            THEN broker._delivery_time(deliver_after, deliver_at) END;
BEGIN
    -- The common case in one statement: a conversing endpoint with a remote far
    -- side, within its lifetime, sending a type without validation that its
    -- contract allows it to, at once (behind what the conversation holds).
    UPDATE broker.endpoints e SET send_sequence = e.send_sequence + 1
    FROM broker.message_types t, broker.contract_message_types cmt
    WHERE due IS NULL
      AND e.conversation_handle = send.conversation_handle AND e.state = 'conversing' AND NOT e.far_is_local
      AND (e.expires_at IS NULL OR e.expires_at > clock_timestamp())
      AND t.name = message_type AND t.validation = 'none' AND t.name NOT LIKE 'broker.%'
      AND cmt.contract_id = e.contract_id AND cmt.message_type_id = t.message_type_id
      AND cmt.sent_by IN ('any', CASE WHEN e.is_initiator THEN 'initiator' ELSE 'target' END)
      AND coalesce(octet_length(body), 0) <= (SELECT max_message_bytes FROM broker.node)
    RETURNING e.conversation_handle, e.send_sequence, e.conversation_id, e.far_service, t.message_type_id,
              e.held_until, e.priority
    INTO numbered;
    IF FOUND THEN
        INSERT INTO broker.transmission_queue (conversation_handle, message_sequence_number, conversation_id,
                                               to_service, message_type_id, body, next_attempt_at, priority)
        VALUES (numbered.conversation_handle, numbered.send_sequence, numbered.conversation_id, numbered.far_service,
                numbered.message_type_id, body, greatest(numbered.held_until, now()), numbered.priority);
        PERFORM pg_notify('broker_transmission_queue', left(numbered.conversation_handle::text, 1));
        RETURN numbered.send_sequence;
    END IF;

    sender := broker._lock_endpoint(conversation_handle);
    mt := broker._message_type(message_type);
    IF sender.state <> 'conversing' THEN
        PERFORM broker._raise('BR020', format('cannot send on conversation %s: it is %s',
            conversation_handle, replace(sender.state, '_', ' ')));
    END IF;
    IF sender.expires_at <= clock_timestamp() THEN
        PERFORM broker._raise('BR020', format('cannot send on conversation %s: its lifetime expired at %s',
            conversation_handle, sender.expires_at), 'end the conversation');
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
    RETURN broker._transmit(sender, mt, body, due);
END $$;

-- Sends many messages of one type at once, bodies[i] on conversation_handles[i]
-- (bodies NULL: every body NULL).  A handle may appear more than once: its
-- messages are numbered in the order given.  Returns the sequence numbers in
-- that order.  All or nothing, with every check and error of broker.send.
-- The common case is set-based: conversing conversations within their
-- lifetime sending a type without validation that their contract allows are
-- locked together (broker._lock_conversations), numbered by one UPDATE, and
-- queued by one INSERT into the transmission queue when their far side is
-- remote, or delivered by one INSERT into the far side's queue when it is
-- local, takes messages and its queue is enabled.  Anything else (a
-- conversation past its lifetime, say, which broker.send refuses) goes through
-- broker.send one message at a time.
CREATE OR REPLACE FUNCTION broker.send_batch(conversation_handles uuid[], message_type text, bodies bytea[] DEFAULT NULL)
RETURNS bigint[]
LANGUAGE plpgsql AS $$
DECLARE
    mt broker.message_types := broker._message_type(message_type);
    given integer := cardinality(conversation_handles);
    plain integer;
    local_messages integer;
    first_position bigint;
    numbers bigint[];
BEGIN
    IF given IS NULL OR array_position(conversation_handles, NULL) IS NOT NULL THEN
        PERFORM broker._raise('BR050', 'conversation_handles must be an array of conversation handles without NULL');
    END IF;
    IF cardinality(bodies) <> given THEN
        PERFORM broker._raise('BR050', format('bodies has %s elements and conversation_handles %s: give one body per handle',
            cardinality(bodies), given));
    END IF;
    PERFORM broker._lock_conversations(conversation_handles);
    SELECT count(*) INTO plain
    FROM broker.endpoints e
    JOIN broker._plain_message_types p
      ON p.contract_id = e.contract_id AND p.sent_by_initiator = e.is_initiator AND p.message_type_id = mt.message_type_id
    WHERE e.conversation_handle = ANY (conversation_handles) AND e.state = 'conversing' AND NOT e.far_is_local
      AND (e.expires_at IS NULL OR e.expires_at > clock_timestamp());
    SELECT plain + count(*) INTO plain
    FROM broker.endpoints e
    JOIN broker.endpoints far ON far.conversation_id = e.conversation_id AND far.is_initiator <> e.is_initiator
    JOIN broker.queues q ON q.queue_id = far.queue_id
    JOIN broker._plain_message_types p
      ON p.contract_id = e.contract_id AND p.sent_by_initiator = e.is_initiator AND p.message_type_id = mt.message_type_id
    WHERE e.conversation_handle = ANY (conversation_handles) AND e.state = 'conversing' AND e.far_is_local
      AND (e.expires_at IS NULL OR e.expires_at > clock_timestamp())
      AND far.state IN ('conversing', 'disconnected_inbound') AND far.receive_sequence = e.send_sequence
      AND q.is_enabled;
    IF plain < (SELECT count(DISTINCT h) FROM unnest(conversation_handles) h)
       OR EXISTS (SELECT 1 FROM unnest(bodies) b WHERE octet_length(b) > (SELECT max_message_bytes FROM broker.node)) THEN
        numbers := '{}';
        FOR i IN 1 .. given LOOP
            numbers := numbers || broker.send(conversation_handles[i], message_type, bodies[i]);
        END LOOP;
        RETURN numbers;
    END IF;
    SELECT count(*) INTO local_messages
    FROM unnest(conversation_handles) h JOIN broker.endpoints e ON e.conversation_handle = h AND e.far_is_local
    WHERE e.conversation_handle = ANY (conversation_handles);
    IF local_messages > 0 THEN
        first_position := broker._next_queue_positions(local_messages);
    END IF;
    WITH numbered AS (
        SELECT g.k, g.h, e.send_sequence + row_number() OVER (PARTITION BY g.h ORDER BY g.k) AS sequence_number,
               e.conversation_id, e.far_service, e.far_is_local, e.is_initiator, e.held_until, e.priority, g.b
        FROM unnest(conversation_handles, bodies) WITH ORDINALITY AS g(h, b, k)
        JOIN broker.endpoints e ON e.conversation_handle = g.h
        WHERE e.conversation_handle = ANY (conversation_handles)
    ), queued AS (
        INSERT INTO broker.transmission_queue (conversation_handle, message_sequence_number, conversation_id,
                                               to_service, message_type_id, body, next_attempt_at, priority)
        SELECT n.h, n.sequence_number, n.conversation_id, n.far_service, mt.message_type_id, n.b,
               greatest(n.held_until, now()), n.priority
        FROM numbered n WHERE NOT n.far_is_local
    ), delivered AS (
        INSERT INTO broker.queue_messages (queue_id, queue_position, conversation_group_id, conversation_handle,
                                           conversation_id, message_sequence_number, message_type_id, body, priority)
        SELECT far.queue_id, first_position + row_number() OVER (ORDER BY n.k) - 1, far.conversation_group_id,
               far.conversation_handle, far.conversation_id, n.sequence_number, mt.message_type_id, n.b, far.priority
        FROM numbered n
        JOIN broker.endpoints far ON far.conversation_id = n.conversation_id AND far.is_initiator <> n.is_initiator
        WHERE n.far_is_local
    )
    SELECT array_agg(n.sequence_number ORDER BY n.k) INTO numbers FROM numbered n;
    UPDATE broker.endpoints e SET send_sequence = e.send_sequence + c.messages
    FROM (SELECT h, count(*) AS messages FROM unnest(conversation_handles) h GROUP BY h) c
    WHERE e.conversation_handle = c.h AND e.conversation_handle = ANY (conversation_handles);
    IF local_messages > 0 THEN
        UPDATE broker.endpoints far SET receive_sequence = e.send_sequence
        FROM broker.endpoints e
        WHERE e.conversation_handle = ANY (conversation_handles) AND e.far_is_local
          AND far.conversation_id = e.conversation_id AND far.is_initiator <> e.is_initiator;
        PERFORM pg_notify('broker_queue', queue_id::text)
        FROM (SELECT DISTINCT far.queue_id FROM broker.endpoints e
              JOIN broker.endpoints far ON far.conversation_id = e.conversation_id AND far.is_initiator <> e.is_initiator
              WHERE e.conversation_handle = ANY (conversation_handles) AND e.far_is_local) queues;
    END IF;
    IF local_messages < given THEN
        PERFORM pg_notify('broker_transmission_queue', digit)
        FROM (SELECT DISTINCT left(e.conversation_handle::text, 1) AS digit FROM broker.endpoints e
              WHERE e.conversation_handle = ANY (conversation_handles) AND NOT e.far_is_local) digits;
    END IF;
    RETURN coalesce(numbers, '{}');
END $$;

-- A group's messages are picked by the group alone (a group belongs to one
-- queue), each conversation's in the order of broker.queue_messages_in_order
-- (notices after the messages they follow); the walk stops at max_messages,
-- and what is returned comes from the rows consumed (or kept, with retention)
-- rather than from reading them again.  The picked rows are consumed by their
-- positions as an array, one probe of the primary key each: as a join, the
-- plan kept for the function may scan the whole queue to find them.  The
-- names that go with each message are looked up once per endpoint of the
-- group, and the message types by key: joined row by row, they took a sixth of
-- a receive of 100.  As in Service Broker, a receive may name the conversation
-- (only its messages come, its group locked), take the whole group
-- (max_messages NULL) and wait until something comes (wait_ms -1).
CREATE OR REPLACE FUNCTION broker.receive(queue text, max_messages integer DEFAULT 1, conversation_group uuid DEFAULT NULL,
                               wait_ms integer DEFAULT 0, conversation_handle uuid DEFAULT NULL)
RETURNS SETOF broker.received_message
LANGUAGE plpgsql AS $$
DECLARE
    q broker.queues := broker._enabled_queue(queue);
    requested_group uuid := broker._receiving_group(q, conversation_group, conversation_handle);
    locked_group uuid;
BEGIN
    IF max_messages < 1 THEN
        PERFORM broker._raise('BR050', format('max_messages must be at least 1 (or NULL for the whole group), got %s',
            max_messages));
    END IF;
    locked_group := broker._wait_for_group(q, requested_group, conversation_handle,
                                           broker._require('wait_ms', wait_ms));
    IF locked_group IS NULL THEN
        RETURN;
    END IF;
    -- Without retention every row of the queue waits (received rows are deleted):
    -- said so, the walk takes the group index alone, in its order.
    RETURN QUERY
    WITH picked AS (
        SELECT m.queue_position FROM broker.queue_messages m
        WHERE m.conversation_group_id = locked_group AND (NOT q.retention OR m.received_at IS NULL)
          AND (receive.conversation_handle IS NULL OR m.conversation_handle = receive.conversation_handle)
        ORDER BY m.conversation_handle, coalesce(m.notice_after, m.message_sequence_number),
                 m.notice_after IS NOT NULL, m.queue_position
        LIMIT max_messages
    ), consumed AS (
        DELETE FROM broker.queue_messages m
        WHERE NOT q.retention AND m.queue_id = q.queue_id AND m.queue_position = ANY (ARRAY(SELECT * FROM picked))
        RETURNING m.*
    ), retained AS (
        UPDATE broker.queue_messages m SET received_at = now()
        WHERE q.retention AND m.queue_id = q.queue_id AND m.queue_position = ANY (ARRAY(SELECT * FROM picked))
        RETURNING m.*
    ), names AS MATERIALIZED (  -- of the group's endpoints, once each
        SELECT e.conversation_handle,
               (SELECT s.name FROM broker.services s WHERE s.service_id = e.service_id) AS service_name,
               (SELECT c.name FROM broker.contracts c WHERE c.contract_id = e.contract_id) AS contract_name
        FROM broker.endpoints e
        WHERE e.conversation_group_id = locked_group
    )
    SELECT m.queue_position, m.conversation_group_id, m.conversation_handle, m.conversation_id,
           m.message_sequence_number, n.service_name, n.contract_name,
           (SELECT mt.name FROM broker.message_types mt WHERE mt.message_type_id = m.message_type_id), m.body,
           m.enqueued_at
    FROM (SELECT * FROM consumed UNION ALL SELECT * FROM retained) m
    JOIN names n ON n.conversation_handle = m.conversation_handle
    ORDER BY m.conversation_handle, coalesce(m.notice_after, m.message_sequence_number),
             m.notice_after IS NOT NULL, m.queue_position;
END $$;

-- Moves the waiting messages of a locked conversation side, head (its first)
-- with head_reason and the others after it, to broker.dead_letters, and ends
-- the conversation with broker.error (-2, error_description) on both sides.
CREATE OR REPLACE FUNCTION broker._quarantine(q broker.queues, e broker.endpoints, head broker.queue_messages, head_reason text,
                                   error_description text) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    moved_count integer;
BEGIN
    WITH moved AS (
        DELETE FROM broker.queue_messages m
        WHERE m.conversation_group_id = e.conversation_group_id AND m.conversation_handle = e.conversation_handle
          AND m.received_at IS NULL
        RETURNING m.*
    )
    INSERT INTO broker.dead_letters (queue_name, queue_position, conversation_handle, conversation_id,
                                     message_sequence_number, message_type, body, enqueued_at, failed_attempts, reason)
    SELECT q.name, moved.queue_position, moved.conversation_handle, moved.conversation_id,
           moved.message_sequence_number, mt.name, moved.body, moved.enqueued_at, moved.failed_attempts,
           CASE WHEN moved.queue_position = head.queue_position THEN head_reason
                ELSE format('conversation quarantined after message %s', head.message_sequence_number) END
    FROM moved JOIN broker.message_types mt USING (message_type_id);
    GET DIAGNOSTICS moved_count = ROW_COUNT;
    IF e.state IN ('conversing', 'disconnected_inbound', 'disconnected_outbound') THEN
        PERFORM broker._fail_conversation(e, -2, error_description);
    END IF;
    RETURN moved_count;
END $$;

-- Puts a quarantined conversation's dead letters back into its queue, in
-- order, to be processed again (after a fix): only while its side is in
-- error, not yet ended by the application, whose replies it still refuses.
-- Returns how many came back.
CREATE OR REPLACE FUNCTION broker.resubmit_dead_letters(queue text, conversation_handle uuid) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    q broker.queues := broker._queue(queue);
    e broker.endpoints;
    resubmitted integer;
    first_position bigint;
BEGIN
    SELECT * INTO e FROM broker.endpoints
    WHERE endpoints.conversation_handle = broker._require('conversation_handle', resubmit_dead_letters.conversation_handle)
      AND endpoints.queue_id = q.queue_id;
    IF NOT FOUND THEN
        PERFORM broker._raise('BR005', format('unknown conversation %s in queue %L (an ended one is forgotten)',
            resubmit_dead_letters.conversation_handle, q.name));
    END IF;
    e := broker._lock_endpoint(e.conversation_handle);
    IF e.state <> 'error' THEN
        PERFORM broker._raise('BR020', format('conversation %s is %s: only one in error (quarantined, not yet ended) '
            'takes its dead letters back', e.conversation_handle, replace(e.state, '_', ' ')));
    END IF;
    SELECT count(*) INTO resubmitted FROM broker.dead_letters d
    WHERE d.queue_name = q.name AND d.conversation_handle = e.conversation_handle;
    IF resubmitted = 0 THEN
        RETURN 0;
    END IF;
    first_position := broker._next_queue_positions(resubmitted);
    WITH letters AS (
        DELETE FROM broker.dead_letters d
        WHERE d.queue_name = q.name AND d.conversation_handle = e.conversation_handle
        RETURNING d.*
    )
    INSERT INTO broker.queue_messages (queue_id, queue_position, conversation_group_id, conversation_handle,
                                       conversation_id, message_sequence_number, message_type_id, body, enqueued_at,
                                       priority)
    SELECT q.queue_id, first_position + row_number() OVER (ORDER BY l.message_sequence_number, l.queue_position) - 1,
           e.conversation_group_id, e.conversation_handle, e.conversation_id, l.message_sequence_number,
           mt.message_type_id, l.body, l.enqueued_at, e.priority
    FROM letters l JOIN broker.message_types mt ON mt.name = l.message_type;
    PERFORM pg_notify('broker_queue', q.queue_id::text);
    RETURN resubmitted;
END $$;

-- Fires due conversation timers and lifetimes, and delivers the held messages
-- of local conversations that are due, of one queue or (target_queue_id NULL)
-- every queue, at most max_events endpoints a call; returns how many it fired
-- (a local conversation's lifetime ends both sides at once).  An endpoint whose conversation another transaction holds is left
-- for later.  A running node calls broker.fire_due_events every quarter second,
-- so that timers and lifetimes take effect when they fall due, not when
-- somebody next receives.
CREATE OR REPLACE FUNCTION broker._fire_due_events(target_queue_id integer, max_events integer DEFAULT 1000) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    due_by timestamptz := clock_timestamp();  -- a waiting receive outlives its transaction's now()
    due record;
    e broker.endpoints;
    held record;
    fired integer := 0;
BEGIN
    FOR due IN
        SELECT conversation_handle FROM broker.endpoints
        WHERE (target_queue_id IS NULL OR queue_id = target_queue_id)
          AND (timer_at <= due_by
               OR (expires_at <= due_by AND state IN ('conversing', 'disconnected_inbound', 'disconnected_outbound')))
        LIMIT max_events
    LOOP
        e := broker._try_lock_endpoint(due.conversation_handle);
        CONTINUE WHEN e.conversation_handle IS NULL;
        IF e.timer_at <= due_by THEN
            UPDATE broker.endpoints SET timer_at = NULL WHERE conversation_handle = e.conversation_handle;
            PERFORM broker._enqueue(e, 0, (broker._message_type('broker.dialog_timer')).message_type_id, NULL);
            fired := fired + 1;
        END IF;
        IF e.expires_at <= due_by AND e.state IN ('conversing', 'disconnected_inbound', 'disconnected_outbound') THEN
            PERFORM broker._fail_conversation(e, -1, 'the conversation''s lifetime expired before it was ended');
            fired := fired + 1;
        END IF;
    END LOOP;
    -- Held messages of local conversations whose delivery time has come, each
    -- conversation's in order; the earliest held message of a conversation is
    -- always one with a delivery time of its own, in transmission_queue_held.
    FOR due IN
        SELECT DISTINCT t.conversation_handle
        FROM broker.services s
        JOIN broker.transmission_queue t
          ON t.to_service = s.name AND t.next_attempt_at > t.enqueued_at AND t.next_attempt_at <= due_by
        JOIN broker.endpoints sender ON sender.conversation_handle = t.conversation_handle AND sender.far_is_local
        WHERE target_queue_id IS NULL OR s.queue_id = target_queue_id
        LIMIT max_events
    LOOP
        e := broker._try_lock_endpoint(due.conversation_handle);
        CONTINUE WHEN e.conversation_handle IS NULL;
        FOR held IN
            SELECT t.* FROM broker.transmission_queue t
            WHERE t.to_service = e.far_service AND t.priority = e.priority
              AND t.conversation_handle = e.conversation_handle AND t.next_attempt_at <= due_by
            ORDER BY t.message_sequence_number
        LOOP
            DELETE FROM broker.transmission_queue t
            WHERE t.to_service = held.to_service AND t.priority = held.priority
              AND t.conversation_handle = held.conversation_handle
              AND t.message_sequence_number = held.message_sequence_number;
            PERFORM broker._deliver(broker._far_endpoint(e), held.message_sequence_number,
                                    (SELECT mt FROM broker.message_types mt WHERE mt.message_type_id = held.message_type_id),
                                    held.body);
            fired := fired + 1;
        END LOOP;
        UPDATE broker.endpoints SET held_until = NULL
        WHERE conversation_handle = e.conversation_handle
          AND NOT EXISTS (SELECT 1 FROM broker.transmission_queue t
                          WHERE t.to_service = e.far_service AND t.priority = e.priority
                            AND t.conversation_handle = e.conversation_handle);
    END LOOP;
    RETURN fired;
END $$;

-- Stores the messages of one conversation that come next (invariant 3):
-- duplicates are skipped, a gap stops the conversation's batch, and a
-- broker.error that follows the run across a gap is accepted with it (see the
-- comment inside).  The messages that come next are stored by one INSERT and
-- the endpoint moves on by one UPDATE, when they are all application messages
-- for an endpoint whose application still reads; system messages (which change
-- the endpoint's state) are delivered one by one.
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
    -- The run of numbers that follows receive_sequence without a gap, in order,
    -- and a broker.error right after it even across a gap: a side that ends a
    -- conversation with an error (or whose lifetime expires) drops what it had
    -- not transmitted yet, and its error keeps the next number it would have
    -- sent.  The error is the last message of its direction, so nothing can
    -- come into the numbers it skips.
    WITH numbered AS (
        SELECT m, n, row_number() OVER (ORDER BY n) AS k
        FROM (SELECT DISTINCT ON (n) m, n
              FROM jsonb_array_elements(messages) m, CAST(m ->> 'sequence_number' AS bigint) n
              WHERE n > e.receive_sequence
              ORDER BY n) once_each
    ), run AS (
        SELECT * FROM numbered WHERE n = e.receive_sequence + k
    )
    SELECT coalesce(jsonb_agg(m ORDER BY n), '[]') INTO next_messages
    FROM numbered
    WHERE n = e.receive_sequence + k
       OR (k = (SELECT count(*) FROM run) + 1 AND m ->> 'message_type' = 'broker.error');

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
                                           conversation_id, message_sequence_number, message_type_id, body, priority)
        SELECT e.queue_id, first_position + m.k - 1, e.conversation_group_id, e.conversation_handle,
               e.conversation_id, (m.value ->> 'sequence_number')::bigint, t.message_type_id,
               decode(m.value ->> 'body', 'base64'), e.priority
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

-- The steady state of a batch in a few statements: the batch's conversations
-- that are new here, or whose endpoint talks with the sending node, reads, and
-- has its queue enabled, when every message that comes next is plain.  The
-- batch is in pg_temp.incoming_transport_batch.  Returns their results; the
-- caller takes the others (refused, carrying system messages, ...) one by one.
-- Conversations with a broker.error among their new messages are left to the
-- careful way, which accepts an error across the numbers its sender dropped
-- (see broker._accept_messages).
CREATE OR REPLACE FUNCTION broker._accept_in_bulk(from_instance uuid) RETURNS jsonb
LANGUAGE plpgsql AS $$
DECLARE
    limit_bytes integer := (SELECT max_message_bytes FROM broker.node);
    taken broker._batch_conversation[];
    results jsonb;
    queues integer[];
    with_error uuid[];
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
    -- Conversations with a broker.error among their new messages go the careful
    -- way, even when the error lies beyond a gap: it may skip the numbers its
    -- sender dropped (see broker._transmit_error).
    SELECT coalesce(array_agg(DISTINCT t.conversation_handle), '{}') INTO with_error
    FROM unnest(taken) t
    JOIN pg_temp.incoming_transport_batch b
      ON b.conversation_id = t.conversation_id AND b.sender_is_initiator = NOT t.is_initiator
    WHERE b.sequence_number > t.receive_sequence AND b.message_type = 'broker.error';

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
        FROM judged j WHERE j.plain AND j.conversation_handle <> ALL (with_error)
    ), stored AS (
        INSERT INTO broker.queue_messages (queue_id, queue_position, conversation_group_id, conversation_handle,
                                           conversation_id, message_sequence_number, message_type_id, body, priority)
        SELECT a.queue_id, (SELECT broker._next_queue_positions(count(*)::integer) FROM accepted) + a.place - 1,
               a.conversation_group_id, a.conversation_handle, a.conversation_id, a.sequence_number,
               a.message_type_id, a.body, a.priority
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
    WHERE NOT EXISTS (SELECT 1 FROM judged j WHERE j.conversation_handle = t.conversation_handle AND NOT j.plain)
      AND t.conversation_handle <> ALL (with_error);
    PERFORM pg_notify('broker_queue', q::text) FROM unnest(queues) q;
    RETURN results;
END $$;

-- The batch is in pg_temp.incoming_transport_batch (rows of
-- broker.transport_message, filled by COPY in this transaction): the steady
-- state in bulk, the rest one conversation at a time, each in a subtransaction
-- of its own so that a bad conversation never spoils the rest.  Anything the
-- bulk path trips over sends the whole batch the careful way.
--
-- The conversations that are not the sender's are set aside first: those known
-- here (by an endpoint, or by the tombstone of a forgotten one) other than as
-- this node's side of a conversation with the sending node.  That is another
-- peer's conversation, a local one, or the side this node holds itself.  Each
-- is refused exactly as a conversation that does not exist is, so the sender
-- learns nothing of it, and its rows leave the batch before anything else reads
-- it: nothing of it changes.
CREATE OR REPLACE FUNCTION broker.accept_transport_batch(from_instance uuid) RETURNS jsonb
LANGUAGE plpgsql AS $$
DECLARE
    not_the_senders jsonb;
    in_bulk jsonb;
    one_by_one jsonb;
BEGIN
    WITH batch_conversations AS (
        SELECT DISTINCT b.conversation_id, b.sender_is_initiator FROM pg_temp.incoming_transport_batch b
    ), foreign_conversations AS (
        SELECT c.* FROM batch_conversations c
        WHERE EXISTS (SELECT 1 FROM broker.endpoints e
                      WHERE e.conversation_id = c.conversation_id
                        AND (e.is_initiator = c.sender_is_initiator OR e.far_is_local
                             OR e.far_broker_instance IS DISTINCT FROM from_instance))
           OR EXISTS (SELECT 1 FROM broker.forgotten_conversations f
                      WHERE f.conversation_id = c.conversation_id
                        AND (f.is_initiator = c.sender_is_initiator OR f.far_broker_instance <> from_instance))
    ), set_aside AS (
        DELETE FROM pg_temp.incoming_transport_batch b USING foreign_conversations f
        WHERE b.conversation_id = f.conversation_id AND b.sender_is_initiator = f.sender_is_initiator
    )
    SELECT coalesce(jsonb_agg(jsonb_build_object(
               'conversation_id', f.conversation_id, 'sender_is_initiator', f.sender_is_initiator, 'acknowledged', 0,
               'refused', jsonb_build_object('sqlstate', 'BR005',
                                             'reason', format('unknown conversation %s', f.conversation_id)))), '[]')
    INTO not_the_senders
    FROM foreign_conversations f;

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
                              'results', not_the_senders || in_bulk || one_by_one);
END $$;

-- The next batch for a destination, as rows of broker.transport_message for
-- COPY, for the conversations whose handles fall in [first_handle,
-- last_handle]: a relay splits the conversations among lanes that send at
-- once.  The waiting messages are read service by service and priority by
-- priority in the order of the primary key, up to max_messages each, and the
-- first max_messages of those, the highest priority first, are taken, rather
-- than all of them sorted: a long
-- queue costs a batch no more than a short one, and messages waiting for
-- other destinations (a peer down for days) are not read at all, nor those
-- whose conversations wait for a retry after a failure.  The
-- batch is cut where its bodies and headers reach max_bytes.  The first
-- message always goes, whatever its size, so that a message at the size limit
-- still travels alone.  A message's share is its body and the texts that
-- travel with it, plus 80 bytes for the fixed-size fields and lengths of its
-- row in the binary COPY format.
CREATE OR REPLACE FUNCTION broker.transport_batch(destination text, max_messages integer, max_bytes bigint,
                                       first_handle uuid, last_handle uuid)
RETURNS SETOF broker.transport_message
LANGUAGE plpgsql STABLE AS $$
DECLARE  -- conversations held back after a failure: seldom any, so each message is looked at only then
    holds_back boolean := EXISTS (SELECT 1 FROM broker.transmission_failures f
                                  WHERE f.address = destination AND f.next_attempt_at > now());
BEGIN  -- plpgsql rather than sql: the plan is kept between batches, not made again for each
    RETURN QUERY
    SELECT sized.conversation_id, sized.is_initiator, sized.from_service, sized.to_service, sized.contract,
           sized.expires_at, sized.sequence_number, sized.message_type, sized.body
    FROM (SELECT e.conversation_id, e.is_initiator, s.name AS from_service, e.far_service AS to_service,
                 c.name AS contract, e.expires_at, due.message_sequence_number AS sequence_number,
                 mt.name AS message_type, due.body,
                 sum(80 + coalesce(octet_length(due.body), 0) + octet_length(s.name) + octet_length(e.far_service)
                     + octet_length(c.name) + octet_length(mt.name))
                     OVER (ORDER BY due.priority DESC, due.conversation_handle, due.message_sequence_number)
                     AS bytes_so_far,
                 row_number() OVER (ORDER BY due.priority DESC, due.conversation_handle, due.message_sequence_number)
                     AS place
          FROM (SELECT t.* FROM broker.routes r, generate_series(10, 1, -1) AS p(priority),
                     LATERAL (SELECT t.* FROM broker.transmission_queue t
                              WHERE t.to_service = r.service_name AND t.priority = p.priority
                                AND t.conversation_handle BETWEEN first_handle AND last_handle
                                AND t.next_attempt_at <= now()
                                AND (NOT holds_back
                                     OR NOT EXISTS (SELECT 1 FROM broker.transmission_failures f
                                                    WHERE f.address = destination AND f.next_attempt_at > now()
                                                      AND t.conversation_handle
                                                          BETWEEN f.first_handle AND f.last_handle))
                              ORDER BY t.conversation_handle, t.message_sequence_number
                              LIMIT max_messages) t
                WHERE r.address = destination
                ORDER BY t.priority DESC, t.conversation_handle, t.message_sequence_number
                LIMIT max_messages) due
          JOIN broker.endpoints e ON e.conversation_handle = due.conversation_handle AND NOT e.far_is_local
          JOIN broker.services s ON s.service_id = e.service_id
          JOIN broker.contracts c ON c.contract_id = e.contract_id
          JOIN broker.message_types mt ON mt.message_type_id = due.message_type_id) sized
    WHERE sized.place = 1 OR sized.bytes_so_far <= max_bytes
    ORDER BY sized.place;
END $$;

-- Locks the next conversation group of a queue by a lease of lock_duration
-- and returns its messages in order, each with the lease's token: up to
-- max_messages and, when max_bytes is given, up to that many bytes of bodies,
-- always at least one message, so that one larger than the budget still goes,
-- alone.  Each conversation's messages come in the order of
-- broker.queue_messages_in_order, and there is no lease when nothing was left
-- to hand out (the conversation was ended after its group was locked).
-- Given a conversation_handle, only that conversation's messages come.
-- Nothing is consumed until broker.complete_lock.
CREATE OR REPLACE FUNCTION broker.receive_with_lock(queue text, max_messages integer, lock_duration interval,
                                         max_bytes bigint DEFAULT NULL, conversation_handle uuid DEFAULT NULL)
RETURNS SETOF broker.locked_message
LANGUAGE plpgsql AS $$
DECLARE
    q broker.queues := broker._enabled_queue(queue);
    requested_group uuid := broker._receiving_group(q, NULL, conversation_handle);
    locked_group uuid;
    token uuid := gen_random_uuid();
    expires timestamptz;
BEGIN
    IF max_messages IS NULL OR max_messages < 1 THEN
        PERFORM broker._raise('BR050', format('max_messages must be at least 1, got %s', max_messages));
    END IF;
    expires := broker._lock_expiry(lock_duration);
    IF max_bytes < 1 THEN
        PERFORM broker._raise('BR050', format('max_bytes must be at least 1, got %s', max_bytes));
    END IF;
    locked_group := broker._wait_for_group(q, requested_group, conversation_handle, 0);
    IF locked_group IS NULL THEN
        RETURN;
    END IF;
    WITH next_messages AS (
        SELECT m.queue_position, coalesce(octet_length(m.body), 0) AS body_bytes,
               row_number() OVER (ORDER BY m.conversation_handle, coalesce(m.notice_after, m.message_sequence_number),
                                           m.notice_after IS NOT NULL, m.queue_position) AS turn
        FROM broker.queue_messages m
        WHERE m.conversation_group_id = locked_group AND m.queue_id = q.queue_id AND m.received_at IS NULL
          AND (receive_with_lock.conversation_handle IS NULL
               OR m.conversation_handle = receive_with_lock.conversation_handle)
        ORDER BY turn
        LIMIT max_messages
    ), picked AS (
        SELECT queue_position FROM (
            SELECT queue_position, turn, sum(body_bytes) OVER (ORDER BY turn) AS bytes_through
            FROM next_messages) running
        WHERE turn = 1 OR max_bytes IS NULL OR bytes_through <= max_bytes
    ), handed_out AS (
        UPDATE broker.queue_messages m SET delivery_count = m.delivery_count + 1
        WHERE m.queue_id = q.queue_id AND m.queue_position = ANY (ARRAY(SELECT * FROM picked))  -- see broker.receive
        RETURNING m.queue_position
    )
    INSERT INTO broker.leases (lock_token, queue_id, conversation_group_id, queue_positions, expires_at)
    SELECT token, q.queue_id, locked_group, array_agg(queue_position), expires FROM handed_out
    HAVING count(*) > 0;
    IF NOT FOUND THEN
        RETURN;
    END IF;

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
    ORDER BY m.conversation_handle, coalesce(m.notice_after, m.message_sequence_number),
             m.notice_after IS NOT NULL, m.queue_position;
END $$;

ALTER FUNCTION broker.send(uuid, text, bytea, interval, timestamptz) SECURITY DEFINER SET search_path = broker, pg_catalog, pg_temp;
ALTER FUNCTION broker.send_batch(uuid[], text, bytea[]) SECURITY DEFINER SET search_path = broker, pg_catalog, pg_temp;
ALTER FUNCTION broker.receive(text, integer, uuid, integer, uuid) SECURITY DEFINER SET search_path = broker, pg_catalog, pg_temp;
ALTER FUNCTION broker.receive_with_lock(text, integer, interval, bigint, uuid) SECURITY DEFINER SET search_path = broker, pg_catalog, pg_temp;

DROP FUNCTION broker._deliver(broker.endpoints, bigint, broker.message_types, bytea, text);
DROP FUNCTION broker._enqueue(broker.endpoints, bigint, integer, bytea, text);

-- Puts a message in the receiver's queue, with a notification on channel
-- broker_queue with the queue's id, which wakes REST readers that wait for it
-- (PostgreSQL sends one per queue per transaction, however many messages it
-- enqueued).  A notice (sequence_number 0) records the last number received
-- from the far side, after which it is received.
CREATE OR REPLACE FUNCTION broker._enqueue(receiver broker.endpoints, sequence_number bigint, message_type_id integer,
                                           body bytea)
RETURNS void
LANGUAGE sql AS $$
    INSERT INTO broker.queue_messages (queue_id, queue_position, conversation_group_id, conversation_handle,
                                       conversation_id, message_sequence_number, message_type_id, body, notice_after,
                                       priority)
    VALUES (receiver.queue_id, broker._next_queue_position(), receiver.conversation_group_id,
            receiver.conversation_handle, receiver.conversation_id, sequence_number, message_type_id, body,
            CASE WHEN sequence_number = 0 THEN receiver.receive_sequence END, receiver.priority);
    SELECT pg_notify('broker_queue', receiver.queue_id::text);
$$;
REVOKE EXECUTE ON FUNCTION broker._enqueue(broker.endpoints, bigint, integer, bytea) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION broker._enqueue(broker.endpoints, bigint, integer, bytea) TO broker_relay;

-- Stores message number sequence_number from the far side at a locked local
-- endpoint, applying what system messages do to its state.  The caller has
-- checked that sequence_number comes next (invariant 3), except that a
-- broker.error may skip numbers (see broker._transmit_error).
CREATE OR REPLACE FUNCTION broker._deliver(receiver broker.endpoints, sequence_number bigint, mt broker.message_types,
                                           body bytea)
RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    new_state text := receiver.state;
    visible boolean := receiver.state IN ('conversing', 'disconnected_inbound');
BEGIN
    IF sequence_number <> receiver.receive_sequence + 1
       AND NOT (mt.name = 'broker.error' AND sequence_number > receiver.receive_sequence) THEN
        PERFORM broker._raise('XX000', format('conversation %s expected message %s, got %s',
            receiver.conversation_id, receiver.receive_sequence + 1, sequence_number));
    END IF;
    IF mt.name = 'broker.end_dialog' THEN
        new_state := CASE receiver.state WHEN 'conversing' THEN 'disconnected_inbound'
                                         WHEN 'disconnected_outbound' THEN 'closed'
                                         ELSE receiver.state END;
    ELSIF mt.name = 'broker.error' THEN
        new_state := CASE WHEN receiver.state IN ('conversing', 'disconnected_inbound') THEN 'error'
                          WHEN receiver.state = 'disconnected_outbound' THEN 'closed'
                          ELSE receiver.state END;
    END IF;
    UPDATE broker.endpoints
    SET receive_sequence = sequence_number,
        state = new_state,
        closed_at = CASE WHEN new_state = 'closed' THEN coalesce(closed_at, now()) END,
        timer_at = CASE WHEN new_state = 'closed' THEN NULL ELSE timer_at END
    WHERE conversation_handle = receiver.conversation_handle;
    IF visible THEN
        PERFORM broker._enqueue(receiver, sequence_number, mt.message_type_id, body);
    END IF;
END $$;
REVOKE EXECUTE ON FUNCTION broker._deliver(broker.endpoints, bigint, broker.message_types, bytea) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION broker._deliver(broker.endpoints, bigint, broker.message_types, bytea) TO broker_relay;

DROP VIEW broker.transmission_queue_status;
CREATE VIEW broker.transmission_queue_status AS
SELECT t.conversation_handle, t.conversation_id, t.to_service, t.message_sequence_number,
       mt.name AS message_type, octet_length(t.body) AS body_bytes, t.enqueued_at,
       coalesce(f.attempts, t.attempts) AS attempts,
       coalesce(f.next_attempt_at, t.next_attempt_at) AS next_attempt_at,
       CASE WHEN t.attempts = 0 AND t.next_attempt_at > now()
                 THEN format('held until its delivery time, %s',
                             to_char(t.next_attempt_at, 'YYYY-MM-DD HH24:MI:SS TZ'))
            WHEN f.reason IS NULL THEN t.transmission_status
            ELSE format('%s (attempt %s, next at %s)', f.reason, f.attempts,
                        to_char(f.next_attempt_at, 'YYYY-MM-DD HH24:MI:SS TZ')) END AS transmission_status
FROM broker.transmission_queue t
JOIN broker.message_types mt USING (message_type_id)
LEFT JOIN LATERAL (SELECT f.* FROM broker.routes r
                   JOIN broker.transmission_failures f ON f.address = r.address
                   WHERE r.service_name = t.to_service
                     AND t.conversation_handle BETWEEN f.first_handle AND f.last_handle
                   ORDER BY f.failed_at DESC
                   LIMIT 1) f ON true;
GRANT SELECT ON broker.transmission_queue_status TO broker_application;

ALTER TYPE broker.locked_message DROP ATTRIBUTE traceparent;
ALTER TYPE broker.received_message DROP ATTRIBUTE traceparent;
ALTER TYPE broker.transport_message DROP ATTRIBUTE traceparent CASCADE;
REVOKE SELECT (dead_letter_id, queue_name, conversation_handle, message_sequence_number, reason, dead_lettered_at,
               traceparent) ON broker.dead_letters FROM broker_relay;
ALTER TABLE broker.dead_letters DROP COLUMN traceparent;
ALTER TABLE broker.queue_messages DROP COLUMN traceparent;
ALTER TABLE broker.transmission_queue DROP COLUMN traceparent;
DROP FUNCTION broker._traceparent();
DROP DOMAIN broker.traceparent;
