-- Receive the way Service Broker users write it: by conversation handle
-- (receive, receive_with_lock), the whole locked group (max_messages NULL),
-- waiting until a message comes (wait_ms -1), and begin_dialog's related
-- conversation by handle.  Each entry point gains a parameter, so it is made
-- anew: a second overload would make calls that leave it out ambiguous.

DROP FUNCTION broker.begin_dialog(text, text, text, interval, uuid);
DROP FUNCTION broker.receive(text, integer, uuid, integer);
DROP FUNCTION broker.receive_with_lock(text, integer, interval, bigint);
DROP FUNCTION broker._wait_for_group(broker.queues, uuid, integer);

-- The new conversation joins the group of related_conversation_group, or of
-- the local conversation side related_conversation (Service Broker's
-- RELATED_CONVERSATION), which must be in the initiating service's queue.
CREATE FUNCTION broker.begin_dialog(from_service text, to_service text, contract text,
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
REVOKE EXECUTE ON FUNCTION broker.begin_dialog(text, text, text, interval, uuid, uuid) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION broker.begin_dialog(text, text, text, interval, uuid, uuid) TO broker_application, broker_admin;

-- Waits up to wait_ms (-1: until there is one) for a group with messages and
-- locks it: the requested group when one is given, and then only once it has
-- messages of the requested conversation when one is given too.  Sleeps with
-- a growing interval (5 ms to 100 ms) while nothing is there: notifications
-- cannot reach a session inside a transaction.  A group found at the head of
-- the queue has messages, so only a requested group is looked at again.
CREATE FUNCTION broker._wait_for_group(q broker.queues, requested_group uuid, requested_handle uuid,
                                       wait_ms integer) RETURNS uuid
LANGUAGE plpgsql AS $$
DECLARE
    deadline timestamptz := CASE WHEN wait_ms <> -1 THEN clock_timestamp() + make_interval(secs => wait_ms / 1000.0) END;
    pause double precision := 0.005;
    locked_group uuid;
BEGIN
    IF wait_ms < -1 THEN
        PERFORM broker._raise('BR050', format('wait_ms must be -1 (wait until a message comes) or more, got %s',
            wait_ms));
    END IF;
    -- Marks this transaction as a reader of the queue (see broker.queue_status).
    PERFORM pg_advisory_xact_lock_shared(1651663723, q.queue_id);
    LOOP
        PERFORM broker._fire_due_events(q.queue_id);
        locked_group := broker._lock_group(q, requested_group);
        IF locked_group IS NOT NULL AND (requested_group IS NULL OR EXISTS (
                SELECT 1 FROM broker.queue_messages
                WHERE conversation_group_id = locked_group AND queue_id = q.queue_id AND received_at IS NULL
                  AND (requested_handle IS NULL OR conversation_handle = requested_handle))) THEN
            RETURN locked_group;
        END IF;
        EXIT WHEN clock_timestamp() >= deadline;  -- never when there is no deadline
        PERFORM pg_sleep(least(pause, extract(epoch FROM deadline - clock_timestamp())));
        pause := least(pause * 2, 0.1);
    END LOOP;
    RETURN NULL;
END $$;
REVOKE EXECUTE ON FUNCTION broker._wait_for_group(broker.queues, uuid, uuid, integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION broker._wait_for_group(broker.queues, uuid, uuid, integer) TO broker_relay, broker_admin;

-- The group to receive from: that of the conversation side handle when one is
-- given (BR005 when this queue holds no such side; BR050 when group_id is given
-- too and is not its group), else group_id.
CREATE FUNCTION broker._receiving_group(q broker.queues, group_id uuid, handle uuid) RETURNS uuid
LANGUAGE plpgsql STABLE AS $$
DECLARE
    handle_group uuid;
BEGIN
    IF handle IS NULL THEN
        RETURN group_id;
    END IF;
    SELECT e.conversation_group_id INTO handle_group FROM broker.endpoints e
    WHERE e.conversation_handle = handle AND e.queue_id = q.queue_id;
    IF NOT FOUND THEN
        PERFORM broker._raise('BR005', format('unknown conversation %s in queue %L', handle, q.name));
    END IF;
    IF handle_group <> group_id THEN
        PERFORM broker._raise('BR050', format('conversation %s is not in conversation group %s', handle, group_id));
    END IF;
    RETURN handle_group;
END $$;
REVOKE EXECUTE ON FUNCTION broker._receiving_group(broker.queues, uuid, uuid) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION broker._receiving_group(broker.queues, uuid, uuid) TO broker_relay, broker_admin;

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
CREATE FUNCTION broker.receive(queue text, max_messages integer DEFAULT 1, conversation_group uuid DEFAULT NULL,
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
COMMENT ON FUNCTION broker.receive(text, integer, uuid, integer, uuid) IS
    'Locks one conversation group of a queue (or the one given, or that of the conversation given) and returns up to max_messages (NULL: all) of its messages in order; they are consumed when the caller commits.';
ALTER FUNCTION broker.receive(text, integer, uuid, integer, uuid) SECURITY DEFINER SET search_path = broker, pg_catalog, pg_temp;
REVOKE EXECUTE ON FUNCTION broker.receive(text, integer, uuid, integer, uuid) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION broker.receive(text, integer, uuid, integer, uuid) TO broker_application, broker_admin;

CREATE OR REPLACE FUNCTION broker.get_conversation_group(queue text, wait_ms integer DEFAULT 0) RETURNS uuid
LANGUAGE sql AS $$
    SELECT broker._wait_for_group(broker._enabled_queue(queue), NULL, NULL, broker._require('wait_ms', wait_ms))
$$;
COMMENT ON FUNCTION broker.get_conversation_group(text, integer) IS
    'Locks the next conversation group with messages until the transaction ends and returns it (NULL if none).';
ALTER FUNCTION broker.get_conversation_group(text, integer) SECURITY DEFINER SET search_path = broker, pg_catalog, pg_temp;

-- Locks the next conversation group of a queue by a lease of lock_duration
-- and returns its messages in order, each with the lease's token: up to
-- max_messages and, when max_bytes is given, up to that many bytes of bodies,
-- always at least one message, so that one larger than the budget still goes,
-- alone.  Each conversation's messages come in the order of
-- broker.queue_messages_in_order, and there is no lease when nothing was left
-- to hand out (the conversation was ended after its group was locked).
-- Given a conversation_handle, only that conversation's messages come.
-- Nothing is consumed until broker.complete_lock.
CREATE FUNCTION broker.receive_with_lock(queue text, max_messages integer, lock_duration interval,
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
COMMENT ON FUNCTION broker.receive_with_lock(text, integer, interval, bigint, uuid) IS
    'Peek-lock: leases one conversation group and returns its next messages, at most max_messages and (but for '
    'the first) max_bytes of bodies; complete_lock consumes them.';
ALTER FUNCTION broker.receive_with_lock(text, integer, interval, bigint, uuid) SECURITY DEFINER SET search_path = broker, pg_catalog, pg_temp;
REVOKE EXECUTE ON FUNCTION broker.receive_with_lock(text, integer, interval, bigint, uuid) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION broker.receive_with_lock(text, integer, interval, bigint, uuid) TO broker_application, broker_admin;
