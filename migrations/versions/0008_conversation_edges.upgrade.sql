-- Conversation edges: leases that never wedge a queue, cancelled work dropped,
-- lifetimes and timers on time, notices after the messages they follow.
-- Frozen with revision 0008.

------------------------------------------------------------------------------
-- Notices in their place
------------------------------------------------------------------------------

-- A notice raised by this node (message_sequence_number 0: a dialog timer, an
-- expired lifetime, a quarantine, a refusal) is received after the far side's
-- messages that were waiting when it was raised: notice_after holds the
-- number of the last of them.  Within a conversation messages come in the
-- order of coalesce(notice_after, message_sequence_number), a notice after
-- the far side's message of the same number, notices among themselves in the
-- order they were raised; the index below is that order.
ALTER TABLE broker.queue_messages ADD COLUMN notice_after bigint;

DROP INDEX broker.queue_messages_group;
CREATE INDEX queue_messages_in_order ON broker.queue_messages
    (conversation_group_id, conversation_handle, (coalesce(notice_after, message_sequence_number)),
     (notice_after IS NOT NULL), queue_position);

-- As in revision 0003, and a notice (sequence_number 0) records the last
-- number received from the far side, after which it is received.
CREATE OR REPLACE FUNCTION broker._enqueue(receiver broker.endpoints, sequence_number bigint, message_type_id integer,
                                           body bytea)
RETURNS void
LANGUAGE sql AS $$
    INSERT INTO broker.queue_messages (queue_id, queue_position, conversation_group_id, conversation_handle,
                                       conversation_id, message_sequence_number, message_type_id, body, notice_after)
    VALUES (receiver.queue_id, broker._next_queue_position(), receiver.conversation_group_id,
            receiver.conversation_handle, receiver.conversation_id, sequence_number, message_type_id, body,
            CASE WHEN sequence_number = 0 THEN receiver.receive_sequence END);
    SELECT pg_notify('broker_queue', receiver.queue_id::text);
$$;

------------------------------------------------------------------------------
-- Ending with an error drops what was not transmitted
------------------------------------------------------------------------------

-- Sends broker.error to the far side of a locked endpoint.  What this side
-- had not transmitted yet is dropped first, as Service Broker does: the far
-- side must not act on work that the error cancels.  The error keeps the next
-- number, and the far side accepts a broker.error across the numbers dropped
-- (it is the last message of its direction: nothing can come into them).
-- Numbering the error into the dropped numbers instead would not do: a
-- dropped message may already be stored at the far node, by a batch whose
-- acknowledgement is still on its way, and the error would be discarded
-- there as a duplicate.
CREATE FUNCTION broker._transmit_error(sender broker.endpoints, error_code integer, error_description text)
RETURNS bigint
LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM broker.transmission_queue t WHERE t.conversation_handle = sender.conversation_handle;
    RETURN broker._transmit(sender, broker._message_type('broker.error'),
                            broker._error_body(error_code, error_description));
END $$;

-- As in revision 0001, and a broker.error may skip numbers (see
-- broker._transmit_error).
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

-- As in revision 0001, with the error sent by broker._transmit_error.
CREATE OR REPLACE FUNCTION broker._fail_conversation(e broker.endpoints, error_code integer, error_description text)
RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    far_state text := (broker._far_endpoint(e)).state;
BEGIN
    IF NOT e.far_is_local OR far_state IN ('conversing', 'disconnected_outbound') THEN
        PERFORM broker._transmit_error(e, error_code, error_description);
    END IF;
    UPDATE broker.endpoints SET state = 'error', timer_at = NULL WHERE conversation_handle = e.conversation_handle;
    PERFORM broker._enqueue(e, 0, (broker._message_type('broker.error')).message_type_id,
                            broker._error_body(error_code, error_description));
END $$;

-- As in revision 0001, with the error sent by broker._transmit_error, and
-- error codes of 0 and below refused: they are the broker's own (-1 an
-- expired lifetime, -2 a quarantine, -3 a refusal).
CREATE OR REPLACE FUNCTION broker.end_conversation(conversation_handle uuid, error_code integer DEFAULT NULL,
                                                   error_description text DEFAULT NULL, cleanup boolean DEFAULT false)
RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    e broker.endpoints := broker._lock_endpoint(conversation_handle);
BEGIN
    IF cleanup THEN
        DELETE FROM broker.transmission_queue t WHERE t.conversation_handle = e.conversation_handle;
        PERFORM broker._close_endpoint(e);
        RETURN;
    END IF;
    IF (error_code IS NULL) <> (error_description IS NULL) THEN
        PERFORM broker._raise('BR050', 'error_code and error_description go together: give both or neither');
    END IF;
    IF error_code <= 0 THEN
        PERFORM broker._raise('BR050', format('error_code must be positive, got %s', error_code),
            'codes of 0 and below belong to the broker');
    END IF;
    IF length(error_description) > 4000 THEN
        PERFORM broker._raise('BR050', 'error_description must be at most 4000 characters');
    END IF;
    IF e.state IN ('closed', 'disconnected_outbound') THEN
        PERFORM broker._raise('BR020', format('conversation %s is already ended (%s)',
            conversation_handle, replace(e.state, '_', ' ')));
    END IF;
    IF error_code IS NOT NULL AND e.state IN ('conversing', 'disconnected_inbound') THEN
        PERFORM broker._transmit_error(e, error_code, error_description);
        PERFORM broker._close_endpoint(e);
    ELSIF e.state = 'conversing' THEN
        PERFORM broker._transmit(e, broker._message_type('broker.end_dialog'), NULL);
        DELETE FROM broker.queue_messages m
        WHERE m.conversation_group_id = e.conversation_group_id AND m.conversation_handle = e.conversation_handle;
        UPDATE broker.endpoints SET state = 'disconnected_outbound', timer_at = NULL
        WHERE endpoints.conversation_handle = e.conversation_handle;
    ELSIF e.state = 'disconnected_inbound' THEN
        PERFORM broker._transmit(e, broker._message_type('broker.end_dialog'), NULL);
        PERFORM broker._close_endpoint(e);
    ELSE  -- error: the far side is gone already
        PERFORM broker._close_endpoint(e);
    END IF;
END $$;

------------------------------------------------------------------------------
-- Timers and lifetimes on time
------------------------------------------------------------------------------

-- As in revision 0001, for one queue or (target_queue_id NULL) every queue,
-- at most max_events endpoints a call; returns how many timers and lifetimes
-- it fired (a local conversation's lifetime ends both sides at once).  A running
-- node calls broker.fire_due_events every quarter second, so that timers and
-- lifetimes take effect when they fall due, not when somebody next receives.
DROP FUNCTION broker._fire_due_events(integer);
CREATE FUNCTION broker._fire_due_events(target_queue_id integer, max_events integer DEFAULT 1000) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    due_by timestamptz := clock_timestamp();  -- a waiting receive outlives its transaction's now()
    due record;
    e broker.endpoints;
    fired integer := 0;
BEGIN
    FOR due IN
        SELECT conversation_handle, conversation_id FROM broker.endpoints
        WHERE (target_queue_id IS NULL OR queue_id = target_queue_id)
          AND (timer_at <= due_by
               OR (expires_at <= due_by AND state IN ('conversing', 'disconnected_inbound', 'disconnected_outbound')))
        LIMIT max_events
    LOOP
        -- Lock the initiator without waiting, then the rest: the usual order.
        PERFORM 1 FROM broker.endpoints
        WHERE conversation_handle = (SELECT conversation_handle FROM broker.endpoints
                                     WHERE conversation_id = due.conversation_id
                                     ORDER BY is_initiator DESC LIMIT 1)
        FOR UPDATE SKIP LOCKED;
        CONTINUE WHEN NOT FOUND;
        e := broker._lock_endpoint(due.conversation_handle);
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
    RETURN fired;
END $$;

CREATE FUNCTION broker.fire_due_events() RETURNS integer
LANGUAGE sql AS $$
    SELECT broker._fire_due_events(NULL)
$$;
COMMENT ON FUNCTION broker.fire_due_events() IS
    'Fires the conversation timers and lifetimes that are due, on every queue; returns how many.  A running node calls it every quarter second.';

-- As in revision 0006, and a conversation past its lifetime refuses to send
-- (BR020), on either side, even before its expiry has been fired.
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
    -- side, within its lifetime, sending a type without validation that its
    -- contract allows it to.
    UPDATE broker.endpoints e SET send_sequence = e.send_sequence + 1
    FROM broker.message_types t, broker.contract_message_types cmt
    WHERE e.conversation_handle = send.conversation_handle AND e.state = 'conversing' AND NOT e.far_is_local
      AND (e.expires_at IS NULL OR e.expires_at > clock_timestamp())
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
    RETURN broker._transmit(sender, mt, body);
END $$;

-- As in revision 0006; a conversation past its lifetime goes through
-- broker.send, which refuses it.
CREATE OR REPLACE FUNCTION broker.send_batch(conversation_handles uuid[], message_type text, bodies bytea[] DEFAULT NULL)
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
            AND (e.expires_at IS NULL OR e.expires_at > clock_timestamp())
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

------------------------------------------------------------------------------
-- Receiving: in conversation order, and never wedged by a lease
------------------------------------------------------------------------------

-- As in revision 0006.  A group whose expired lease is ended here may have
-- lost its messages meanwhile: the expiry counts as a processing failure and
-- can quarantine the conversation, moving its messages to the dead letters.
-- Such a group is passed over, and the walk goes on to the next.
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
        IF candidate IS NULL OR NOT EXISTS (SELECT 1 FROM broker.leases l WHERE l.conversation_group_id = candidate) THEN
            RETURN candidate;
        END IF;
        -- Two statements: one snapshot for both would not see what the failure moved away.
        IF broker._free_of_lease(q, candidate) THEN
            IF EXISTS (SELECT 1 FROM broker.queue_messages m
                       WHERE m.conversation_group_id = candidate AND m.queue_id = q.queue_id AND m.received_at IS NULL)
            THEN
                RETURN candidate;
            END IF;
        END IF;
        leases_here := true;
    END LOOP;
END $$;

-- As in revision 0006, with each conversation's messages in the order of
-- broker.queue_messages_in_order (notices after the messages they follow).
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
        ORDER BY m.conversation_handle, coalesce(m.notice_after, m.message_sequence_number),
                 m.notice_after IS NOT NULL, m.queue_position
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
    ORDER BY m.conversation_handle, coalesce(m.notice_after, m.message_sequence_number),
             m.notice_after IS NOT NULL, m.queue_position;
END $$;

-- As in revision 0003, with each conversation's messages in the order of
-- broker.queue_messages_in_order, and no lease when nothing was left to hand
-- out (the conversation was ended after its group was locked).
CREATE OR REPLACE FUNCTION broker.receive_with_lock(queue text, max_messages integer, lock_duration interval)
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
        ORDER BY m.conversation_handle, coalesce(m.notice_after, m.message_sequence_number),
                 m.notice_after IS NOT NULL, m.queue_position
        LIMIT max_messages
    ), handed_out AS (
        UPDATE broker.queue_messages m SET delivery_count = m.delivery_count + 1
        FROM picked WHERE m.queue_id = q.queue_id AND m.queue_position = picked.queue_position
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

-- As in revision 0001, with the group's head message in the order of
-- broker.queue_messages_in_order, and its conversation locked before the
-- message is: every writer locks a conversation's endpoints before its
-- messages (broker.end_conversation, say, which deletes them), so taking them
-- the other way round could deadlock with it.
CREATE OR REPLACE FUNCTION broker.report_processing_failure(queue text, conversation_group uuid, reason text)
RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    q broker.queues := broker._queue(queue);
    head broker.queue_messages;
    e broker.endpoints;
BEGIN
    SELECT m.* INTO head FROM broker.queue_messages m
    WHERE m.conversation_group_id = broker._require('conversation_group', conversation_group)
      AND m.queue_id = q.queue_id AND m.received_at IS NULL
    ORDER BY m.conversation_handle, coalesce(m.notice_after, m.message_sequence_number),
             m.notice_after IS NOT NULL, m.queue_position
    LIMIT 1;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    e := broker._lock_endpoint(head.conversation_handle);
    UPDATE broker.queue_messages m SET failed_attempts = m.failed_attempts + 1
    WHERE m.queue_id = head.queue_id AND m.queue_position = head.queue_position AND m.received_at IS NULL
    RETURNING * INTO head;
    IF NOT FOUND OR head.failed_attempts < q.poison_threshold THEN  -- consumed or ended meanwhile, or not yet poison
        RETURN false;
    END IF;
    WITH moved AS (
        DELETE FROM broker.queue_messages m
        WHERE m.conversation_group_id = e.conversation_group_id AND m.conversation_handle = e.conversation_handle
        RETURNING m.*
    )
    INSERT INTO broker.dead_letters (queue_name, queue_position, conversation_handle, conversation_id,
                                     message_sequence_number, message_type, body, enqueued_at, failed_attempts, reason)
    SELECT q.name, moved.queue_position, moved.conversation_handle, moved.conversation_id,
           moved.message_sequence_number, mt.name, moved.body, moved.enqueued_at, moved.failed_attempts,
           CASE WHEN moved.queue_position = head.queue_position
                THEN format('processing failed %s times; last failure: %s', moved.failed_attempts, coalesce(reason, 'not given'))
                ELSE format('conversation quarantined after message %s failed', head.message_sequence_number) END
    FROM moved JOIN broker.message_types mt USING (message_type_id);
    IF e.state IN ('conversing', 'disconnected_inbound', 'disconnected_outbound') THEN
        PERFORM broker._fail_conversation(e, -2, format(
            'message %s could not be processed after %s attempts and was moved to broker.dead_letters',
            head.message_sequence_number, head.failed_attempts));
    END IF;
    RETURN true;
END $$;
