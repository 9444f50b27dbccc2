-- Back to one priority (revision 0024): the functions that know of
-- priorities go first, then the columns, the key and the table.

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
                                       conversation_id, message_sequence_number, message_type_id, body, notice_after)
    VALUES (receiver.queue_id, broker._next_queue_position(), receiver.conversation_group_id,
            receiver.conversation_handle, receiver.conversation_id, sequence_number, message_type_id, body,
            CASE WHEN sequence_number = 0 THEN receiver.receive_sequence END);
    SELECT pg_notify('broker_queue', receiver.queue_id::text);
$$;


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
                                               to_service, message_type_id, body, next_attempt_at)
        VALUES (sender.conversation_handle, sequence_number, sender.conversation_id,
                sender.far_service, mt.message_type_id, body, greatest(hold_until, now()));
        IF NOT sender.far_is_local THEN
            PERFORM pg_notify('broker_transmission_queue', '');
        END IF;
    END IF;
    RETURN sequence_number;
END $$;


-- Sends broker.error to the far side of a locked endpoint.  What this side
-- had not transmitted yet is dropped first, as Service Broker does: the far
-- side must not act on work that the error cancels.  The error keeps the next
-- number, and the far side accepts a broker.error across the numbers dropped
-- (it is the last message of its direction: nothing can come into them).
-- Numbering the error into the dropped numbers instead would not do: a
-- dropped message may already be stored at the far node, by a batch whose
-- acknowledgement is still on its way, and the error would be discarded
-- there as a duplicate.
CREATE OR REPLACE FUNCTION broker._transmit_error(sender broker.endpoints, error_code integer, error_description text)
RETURNS bigint
LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM broker.transmission_queue t
    WHERE t.to_service = sender.far_service AND t.conversation_handle = sender.conversation_handle;
    sender.held_until := NULL;  -- what was held is dropped, and the error goes now
    RETURN broker._transmit(sender, broker._message_type('broker.error'),
                            broker._error_body(error_code, error_description));
END $$;


-- The new conversation joins the group of related_conversation_group, or of
-- the local conversation side related_conversation (Service Broker's
-- RELATED_CONVERSATION), which must be in the initiating service's queue.
CREATE OR REPLACE FUNCTION broker.begin_dialog(from_service text, to_service text, contract text,
                                    lifetime interval DEFAULT NULL, related_conversation_group uuid DEFAULT NULL,
                                    related_conversation uuid DEFAULT NULL)
RETURNS uuid
LANGUAGE plpgsql AS $$
DECLARE
    initiator_service broker.services := broker._service(from_service);
    dialog_contract integer := broker._contract_id(contract);
    target_service broker.services;
    far_instance uuid;
    conversation uuid := gen_random_uuid();
    handle uuid := gen_random_uuid();
    group_id uuid := coalesce(related_conversation_group, gen_random_uuid());
    group_queue integer;
    target_group uuid := gen_random_uuid();
BEGIN
    IF lifetime <= interval '0' THEN
        PERFORM broker._raise('BR050', format('lifetime must be positive, got %s', lifetime));
    END IF;
    IF related_conversation IS NOT NULL THEN
        IF related_conversation_group IS NOT NULL THEN
            PERFORM broker._raise('BR050', 'give related_conversation or related_conversation_group, not both');
        END IF;
        SELECT e.conversation_group_id INTO group_id FROM broker.endpoints e
        WHERE e.conversation_handle = related_conversation;
        IF NOT FOUND THEN
            PERFORM broker._raise('BR005', format('unknown conversation %s', related_conversation));
        END IF;
    END IF;
    SELECT * INTO target_service FROM broker.services WHERE name = broker._require('to_service', to_service);
    IF FOUND THEN
        IF NOT EXISTS (SELECT 1 FROM broker.service_contracts sc
                       WHERE sc.service_id = target_service.service_id AND sc.contract_id = dialog_contract) THEN
            PERFORM broker._raise('BR011', format('service %L does not accept contract %L', to_service, contract));
        END IF;
    ELSE
        SELECT r.broker_instance INTO far_instance FROM broker.routes r WHERE r.service_name = to_service;
        IF NOT FOUND THEN
            PERFORM broker._raise('BR001', format('unknown service %L: no local service and no route by that name', to_service),
                'create the service, or a route to the node that has it');
        END IF;
    END IF;

    SELECT queue_id INTO group_queue FROM broker.conversation_groups WHERE conversation_group_id = group_id;
    IF NOT FOUND THEN
        INSERT INTO broker.conversation_groups VALUES (group_id, initiator_service.queue_id);
    ELSIF group_queue <> initiator_service.queue_id THEN
        PERFORM broker._raise('BR050', format('conversation group %s belongs to another queue', group_id));
    END IF;

    INSERT INTO broker.endpoints (conversation_handle, conversation_id, is_initiator, conversation_group_id,
                                  service_id, queue_id, far_service, far_is_local, far_broker_instance,
                                  contract_id, expires_at)
    VALUES (handle, conversation, true, group_id, initiator_service.service_id, initiator_service.queue_id,
            to_service, target_service.service_id IS NOT NULL, far_instance, dialog_contract, now() + lifetime);

    IF target_service.service_id IS NOT NULL THEN
        INSERT INTO broker.conversation_groups VALUES (target_group, target_service.queue_id);
        INSERT INTO broker.endpoints (conversation_handle, conversation_id, is_initiator, conversation_group_id,
                                      service_id, queue_id, far_service, far_is_local, contract_id, expires_at)
        VALUES (gen_random_uuid(), conversation, false, target_group, target_service.service_id,
                target_service.queue_id, from_service, true, dialog_contract, now() + lifetime);
    END IF;
    RETURN handle;
END $$;
COMMENT ON FUNCTION broker.begin_dialog(text, text, text, interval, uuid, uuid) IS
    'Begins a conversation from a local service to a local or routed service; returns the initiator''s handle.';
ALTER FUNCTION broker.begin_dialog(text, text, text, interval, uuid, uuid) SECURITY DEFINER SET search_path = broker, pg_catalog, pg_temp;

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
              e.held_until
    INTO numbered;
    IF FOUND THEN
        INSERT INTO broker.transmission_queue (conversation_handle, message_sequence_number, conversation_id,
                                               to_service, message_type_id, body, next_attempt_at)
        VALUES (numbered.conversation_handle, numbered.send_sequence, numbered.conversation_id, numbered.far_service,
                numbered.message_type_id, body, greatest(numbered.held_until, now()));
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
COMMENT ON FUNCTION broker.send(uuid, text, bytea, interval, timestamptz) IS
    'Sends a message on a conversation, at once or held until its delivery time; returns its sequence number.  Durable when the caller commits.';
ALTER FUNCTION broker.send(uuid, text, bytea, interval, timestamptz) SECURITY DEFINER SET search_path = broker, pg_catalog, pg_temp;

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
               e.conversation_id, e.far_service, e.far_is_local, e.is_initiator, e.held_until, g.b
        FROM unnest(conversation_handles, bodies) WITH ORDINALITY AS g(h, b, k)
        JOIN broker.endpoints e ON e.conversation_handle = g.h
        WHERE e.conversation_handle = ANY (conversation_handles)
    ), queued AS (
        INSERT INTO broker.transmission_queue (conversation_handle, message_sequence_number, conversation_id,
                                               to_service, message_type_id, body, next_attempt_at)
        SELECT n.h, n.sequence_number, n.conversation_id, n.far_service, mt.message_type_id, n.b,
               greatest(n.held_until, now())
        FROM numbered n WHERE NOT n.far_is_local
    ), delivered AS (
        INSERT INTO broker.queue_messages (queue_id, queue_position, conversation_group_id, conversation_handle,
                                           conversation_id, message_sequence_number, message_type_id, body)
        SELECT far.queue_id, first_position + row_number() OVER (ORDER BY n.k) - 1, far.conversation_group_id,
               far.conversation_handle, far.conversation_id, n.sequence_number, mt.message_type_id, n.b
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
COMMENT ON FUNCTION broker.send_batch(uuid[], text, bytea[]) IS
    'Sends bodies[i] on conversation_handles[i], all of one message type; returns the sequence numbers in order.';
ALTER FUNCTION broker.send_batch(uuid[], text, bytea[]) SECURITY DEFINER SET search_path = broker, pg_catalog, pg_temp;

-- Locks the given group, or the group holding the oldest waiting message that
-- no other transaction holds, and returns it; NULL when there is none.  The
-- head of the queue is walked by one statement that passes over the groups
-- other readers hold (SKIP LOCKED) or lease, however many there are.  Leases
-- are looked for message by message only when the queue has any.  A lease
-- committed before the group was locked is seen by the check that follows, and
-- then the walk looks for leases; none can be taken after the group is locked.
-- A group whose expired lease is ended here may have lost its messages
-- meanwhile: the expiry counts as a processing failure and can quarantine the
-- conversation, moving its messages to the dead letters.  Such a group is
-- passed over, and the walk goes on to the next.
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
                                       conversation_id, message_sequence_number, message_type_id, body, enqueued_at)
    SELECT q.queue_id, first_position + row_number() OVER (ORDER BY l.message_sequence_number, l.queue_position) - 1,
           e.conversation_group_id, e.conversation_handle, e.conversation_id, l.message_sequence_number,
           mt.message_type_id, l.body, l.enqueued_at
    FROM letters l JOIN broker.message_types mt ON mt.name = l.message_type;
    PERFORM pg_notify('broker_queue', q.queue_id::text);
    RETURN resubmitted;
END $$;
COMMENT ON FUNCTION broker.resubmit_dead_letters(text, uuid) IS
    'Puts a quarantined conversation''s dead letters back into its queue, in order; returns how many.';

-- An error goes to the far side by broker._transmit_error.  Error codes of 0
-- and below are refused: they are the broker's own (-1 an expired lifetime, -2
-- a quarantine, -3 a refusal).
CREATE OR REPLACE FUNCTION broker.end_conversation(conversation_handle uuid, error_code integer DEFAULT NULL,
                                                   error_description text DEFAULT NULL, cleanup boolean DEFAULT false)
RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    e broker.endpoints := broker._lock_endpoint(conversation_handle);
BEGIN
    IF cleanup THEN
        DELETE FROM broker.transmission_queue t
        WHERE t.to_service = e.far_service AND t.conversation_handle = e.conversation_handle;
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
COMMENT ON FUNCTION broker.end_conversation(uuid, integer, text, boolean) IS
    'Ends a conversation: broker.end_dialog to the far side, or broker.error with an error code, or nothing with cleanup.';
ALTER FUNCTION broker.end_conversation(uuid, integer, text, boolean) SECURITY DEFINER SET search_path = broker, pg_catalog, pg_temp;

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
            WHERE t.to_service = e.far_service AND t.conversation_handle = e.conversation_handle
              AND t.next_attempt_at <= due_by
            ORDER BY t.message_sequence_number
        LOOP
            DELETE FROM broker.transmission_queue t
            WHERE t.to_service = held.to_service AND t.conversation_handle = held.conversation_handle
              AND t.message_sequence_number = held.message_sequence_number;
            PERFORM broker._deliver(broker._far_endpoint(e), held.message_sequence_number,
                                    (SELECT mt FROM broker.message_types mt WHERE mt.message_type_id = held.message_type_id),
                                    held.body);
            fired := fired + 1;
        END LOOP;
        UPDATE broker.endpoints SET held_until = NULL
        WHERE conversation_handle = e.conversation_handle
          AND NOT EXISTS (SELECT 1 FROM broker.transmission_queue t
                          WHERE t.to_service = e.far_service AND t.conversation_handle = e.conversation_handle);
    END LOOP;
    RETURN fired;
END $$;


-- The far node refused a conversation: it ends here with a broker.error
-- notice; nothing more is sent.
CREATE OR REPLACE FUNCTION broker._refused_by_far_side(e broker.endpoints, reason text) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM broker.transmission_queue WHERE to_service = e.far_service AND conversation_handle = e.conversation_handle;
    IF e.state IN ('conversing', 'disconnected_inbound', 'disconnected_outbound') THEN
        UPDATE broker.endpoints SET state = 'error', timer_at = NULL WHERE conversation_handle = e.conversation_handle;
        PERFORM broker._enqueue(e, 0, (broker._message_type('broker.error')).message_type_id,
                                broker._error_body(-3, 'the far node refused the conversation: ' || reason));
    END IF;
END $$;


-- The target endpoint of a conversation whose first message arrives from
-- another node.  Raises BR001/BR003/BR011 when the conversation is refused.  A
-- conversation is opened only from a service that this node routes to the
-- sending node: that node is where its replies go.  Checked first, so that a
-- node with no business here learns nothing of the services and contracts it
-- names.
CREATE OR REPLACE FUNCTION broker._create_target_endpoint(from_instance uuid, header jsonb) RETURNS broker.endpoints
LANGUAGE plpgsql AS $$
DECLARE
    target_service broker.services;
    dialog_contract integer;
    group_id uuid := gen_random_uuid();
    e broker.endpoints;
BEGIN
    IF NOT EXISTS (SELECT 1 FROM broker.routes r
                   WHERE r.service_name = header ->> 'from_service' AND r.broker_instance = from_instance) THEN
        PERFORM broker._raise('BR006', format(
            'no route here for service %s to broker instance %s, the node it comes from',
            left(quote_nullable(header ->> 'from_service'), 140), from_instance));
    END IF;
    target_service := broker._service(header ->> 'to_service');
    dialog_contract := broker._contract_id(header ->> 'contract');
    IF NOT EXISTS (SELECT 1 FROM broker.service_contracts sc
                   WHERE sc.service_id = target_service.service_id AND sc.contract_id = dialog_contract) THEN
        PERFORM broker._raise('BR011', format('service %L does not accept contract %L',
            target_service.name, header ->> 'contract'));
    END IF;
    INSERT INTO broker.conversation_groups VALUES (group_id, target_service.queue_id);
    INSERT INTO broker.endpoints (conversation_handle, conversation_id, is_initiator, conversation_group_id,
                                  service_id, queue_id, far_service, far_is_local, far_broker_instance,
                                  contract_id, expires_at)
    VALUES (gen_random_uuid(), (header ->> 'conversation_id')::uuid, false, group_id, target_service.service_id,
            target_service.queue_id, broker._check_name('service', header ->> 'from_service'), false,
            from_instance, dialog_contract, (header ->> 'expires_at')::timestamptz)
    RETURNING * INTO e;
    RETURN e;
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


-- Locks the endpoints of the batch's conversations that can take it in bulk,
-- in the order of their conversation ids: one probe of the unique index each,
-- whatever the plan (a join here could be planned to rescan the batch once per
-- endpoint).
CREATE OR REPLACE FUNCTION broker._lock_batch_conversations(from_instance uuid) RETURNS broker._batch_conversation[]
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
-- contract, when all their messages are plain, and only from services that
-- this node routes to the sending node (see broker._create_target_endpoint,
-- which refuses the rest): the target endpoints, each in a new group, created
-- together.
CREATE OR REPLACE FUNCTION broker._open_batch_conversations(from_instance uuid, limit_bytes integer) RETURNS void
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
        JOIN broker.routes r ON r.service_name = h.from_service AND r.broker_instance = from_instance
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
    WHERE NOT EXISTS (SELECT 1 FROM judged j WHERE j.conversation_handle = t.conversation_handle AND NOT j.plain)
      AND t.conversation_handle <> ALL (with_error);
    PERFORM pg_notify('broker_queue', q::text) FROM unnest(queues) q;
    RETURN results;
END $$;


-- The next batch for a destination, as rows of broker.transport_message for
-- COPY, for the conversations whose handles fall in [first_handle,
-- last_handle]: a relay splits the conversations among lanes that send at
-- once.  The waiting messages are read service by service in the order of
-- the primary key, up to max_messages each, and the lowest
-- max_messages of those are taken, rather than all of them sorted: a long
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
                     OVER (ORDER BY due.conversation_handle, due.message_sequence_number) AS bytes_so_far,
                 row_number() OVER (ORDER BY due.conversation_handle, due.message_sequence_number) AS place
          FROM (SELECT t.* FROM broker.routes r,
                     LATERAL (SELECT t.* FROM broker.transmission_queue t
                              WHERE t.to_service = r.service_name
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
                ORDER BY t.conversation_handle, t.message_sequence_number
                LIMIT max_messages) due
          JOIN broker.endpoints e ON e.conversation_handle = due.conversation_handle AND NOT e.far_is_local
          JOIN broker.services s ON s.service_id = e.service_id
          JOIN broker.contracts c ON c.contract_id = e.contract_id
          JOIN broker.message_types mt ON mt.message_type_id = due.message_type_id) sized
    WHERE sized.place = 1 OR sized.bytes_so_far <= max_bytes
    ORDER BY sized.place;
END $$;
COMMENT ON FUNCTION broker.transport_batch(text, integer, bigint, uuid, uuid) IS
    'The next batch for a destination: the lowest waiting numbers of its conversations between the handles, up to a count and a size.';

-- Applies a destination node's answer in one transaction: deletes what it
-- acknowledged, ends what it refused.  Returns how many messages were
-- delivered.  Every acknowledgement is applied by one DELETE and one UPDATE;
-- refusals and hold-backs are rare and handled one by one.  The transaction
-- that applies an answer commits without waiting for its WAL to reach the
-- disk: if a crash loses it, the messages it deleted are sent again and the far
-- node acknowledges them as duplicates (guarantee 3), so the relay need not
-- wait for a flush in every cycle.
--
-- The answer is held to the batch it answers: the relay puts the batch it sent
-- into pg_temp.sent_transport_batch (rows of broker.transport_message, by COPY
-- in this transaction), and only the results for that batch's conversations
-- apply, each acknowledging at most the highest number the batch carried of its
-- conversation.  So no answer, however it is signed, acknowledges, refuses or
-- holds back a message it was not sent.  A result without a number
-- acknowledges nothing.
CREATE OR REPLACE FUNCTION broker.apply_transport_results(answer jsonb) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    handles uuid[];
    services text[];
    acknowledged bigint[];
    refusals text[];
    holds text[];
    result record;
    delivered bigint;
BEGIN
    PERFORM set_config('synchronous_commit', 'off', true);
    WITH sent AS (
        SELECT b.conversation_id, b.sender_is_initiator, max(b.sequence_number) AS last_sent
        FROM pg_temp.sent_transport_batch b
        GROUP BY b.conversation_id, b.sender_is_initiator
    )
    SELECT array_agg(e.conversation_handle), array_agg(e.far_service),
           array_agg(least(coalesce(r.acknowledged, 0), s.last_sent)),
           array_agg(CASE WHEN r.refused IS NOT NULL
                          THEN coalesce(r.refused ->> 'reason', 'no reason given') END),
           array_agg(r.waiting)
    INTO handles, services, acknowledged, refusals, holds
    FROM jsonb_to_recordset(answer -> 'results')
         AS r(conversation_id uuid, sender_is_initiator boolean, acknowledged bigint, refused jsonb, waiting text)
    JOIN sent s ON s.conversation_id = r.conversation_id AND s.sender_is_initiator = r.sender_is_initiator
    JOIN broker.endpoints e ON e.conversation_id = s.conversation_id AND e.is_initiator = s.sender_is_initiator
                           AND NOT e.far_is_local;

    -- The acknowledged rows are found conversation by conversation through the
    -- primary key (OFFSET 0 keeps the planner from making the lateral subquery
    -- a join), then deleted where they lie.  As a join, the plan could scan the
    -- whole transmission queue for every answer: a long queue (a peer down for
    -- days) would make every batch slower.  A row that another transaction
    -- changed meanwhile is not deleted: it is sent again, and acknowledged as a
    -- duplicate.
    WITH acknowledged_rows AS (
        SELECT d.ctid
        FROM unnest(handles, services, acknowledged) AS a(conversation_handle, to_service, acknowledged),
             LATERAL (SELECT t.ctid FROM broker.transmission_queue t
                      WHERE t.to_service = a.to_service AND t.conversation_handle = a.conversation_handle
                        AND t.message_sequence_number <= a.acknowledged
                      OFFSET 0) d
    ), removed AS (
        DELETE FROM broker.transmission_queue t
        WHERE t.ctid = ANY (ARRAY(SELECT r.ctid FROM acknowledged_rows r))
        RETURNING 1
    )
    SELECT count(*) INTO delivered FROM removed;
    -- The far node answered for these: earlier failures no longer apply.
    DELETE FROM broker.transmission_failures f
    WHERE f.next_attempt_at <= now()
      AND f.address IN (SELECT r.address FROM broker.routes r WHERE r.service_name = ANY (services))
      AND EXISTS (SELECT 1 FROM unnest(handles) h WHERE h BETWEEN f.first_handle AND f.last_handle);
    UPDATE broker.transmission_queue t
    SET attempts = 0, transmission_status = 'sent; waiting for the numbers before it to be acknowledged'
    FROM unnest(handles, refusals, holds) AS a(conversation_handle, refused, waiting)
    WHERE t.conversation_handle = a.conversation_handle AND a.refused IS NULL AND a.waiting IS NULL
      AND t.attempts > 0;

    FOR result IN
        SELECT * FROM unnest(handles, services, refusals, holds) AS a(conversation_handle, to_service, refused, waiting)
        WHERE a.refused IS NOT NULL OR a.waiting IS NOT NULL
    LOOP
        IF result.refused IS NOT NULL THEN
            PERFORM broker._refused_by_far_side(broker._lock_endpoint(result.conversation_handle), result.refused);
        ELSE
            UPDATE broker.transmission_queue
            SET transmission_status = 'the far node holds it back: ' || result.waiting,
                attempts = attempts + 1, next_attempt_at = now() + interval '5 seconds'
            WHERE to_service = result.to_service AND conversation_handle = result.conversation_handle;
        END IF;
    END LOOP;
    RETURN delivered;
END $$;


-- Forgets up to max_endpoints endpoints closed longer than the retention ago
-- (none with messages still to transmit), the conversation groups left
-- without endpoints, and tombstones past their own retention.  Returns the
-- number of endpoints forgotten.  Runs by itself whenever an endpoint closes,
-- and at every acknowledgement: so the rows to delete are locked by CTEs,
-- which run once (a locking subquery under IN can be planned to run again for
-- every row of the table), and nothing more is done when nothing is past its
-- retention.
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
                          WHERE t.to_service = c.far_service AND t.conversation_handle = c.conversation_handle)
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
COMMENT ON FUNCTION broker.forget_closed_endpoints(integer) IS
    'Forgets closed endpoints older than broker.node.closed_endpoint_retention; runs whenever an endpoint closes.';

DROP FUNCTION broker._priority(text, text, text);
DROP FUNCTION broker.drop_broker_priority(text);
DROP FUNCTION broker.create_broker_priority(text, integer, text, text, text);

DROP VIEW broker.conversation_endpoints;
CREATE VIEW broker.conversation_endpoints AS
SELECT e.conversation_handle, e.conversation_id, e.conversation_group_id, e.is_initiator,
       s.name AS service_name, q.name AS queue_name, e.far_service, e.far_is_local, e.far_broker_instance,
       c.name AS contract_name, e.state, e.send_sequence, e.receive_sequence,
       e.expires_at, e.timer_at, e.created_at, e.closed_at
FROM broker.endpoints e
JOIN broker.services s USING (service_id)
JOIN broker.queues q ON q.queue_id = e.queue_id
JOIN broker.contracts c USING (contract_id);
GRANT SELECT ON broker.conversation_endpoints TO broker_application;

ALTER TYPE broker._batch_conversation DROP ATTRIBUTE priority;
ALTER TABLE broker.transmission_queue DROP CONSTRAINT transmission_queue_pkey,
    ADD PRIMARY KEY (to_service, conversation_handle, message_sequence_number);
ALTER TABLE broker.transmission_queue DROP COLUMN priority;
DROP INDEX broker.queue_messages_waiting;
CREATE INDEX queue_messages_waiting ON broker.queue_messages (queue_id, queue_position)
    WHERE received_at IS NULL;
ALTER TABLE broker.queue_messages DROP COLUMN priority;
ALTER TABLE broker.endpoints DROP COLUMN priority;
DROP TABLE broker.broker_priorities;
