-- Receiving: a conversation group at a time, in conversation order.

------------------------------------------------------------------------------
-- Receiving: in conversation order, and never wedged by a lease
------------------------------------------------------------------------------

-- Locks the given group, or the group holding the oldest waiting message of
-- the highest priority that no other transaction holds (Service Broker hands
-- out the group of the highest priority first), and returns it; NULL when
-- there is none.  A group's messages then come in conversation order, whatever
-- their priorities.  The
-- head of the queue is walked by one statement that passes over the groups
-- other readers hold (SKIP LOCKED) or lease, however many there are.  Leases
-- are looked for message by message only when the queue has any.  A lease
-- committed before the group was locked is seen by the check that follows, and
-- then the walk looks for leases; none can be taken after the group is locked.
-- A group whose expired lease is ended here may have lost its messages
-- meanwhile: the expiry counts as a processing failure and can quarantine the
-- conversation, moving its messages to the dead letters.  Such a group is
-- passed over, and the walk goes on to the next.  A group backed off after a
-- failure (broker._back_off) is passed over too, and taken only when the
-- walk finds no other.
CREATE OR REPLACE FUNCTION broker._lock_group(q broker.queues, requested_group uuid) RETURNS uuid
LANGUAGE plpgsql AS $$
DECLARE
    candidate uuid;
    leases_here boolean := EXISTS (SELECT 1 FROM broker.leases l WHERE l.queue_id = q.queue_id);
    backed_off_too boolean := false;
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
          AND (backed_off_too OR g.backed_off_until IS NULL OR g.backed_off_until <= clock_timestamp())
        ORDER BY m.priority DESC, m.queue_position
        LIMIT 1
        FOR NO KEY UPDATE OF g SKIP LOCKED;
        IF candidate IS NULL AND NOT backed_off_too THEN
            backed_off_too := true;  -- no other group waits: one backed off is taken after all
            CONTINUE;
        END IF;
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
GRANT EXECUTE ON FUNCTION broker._lock_group(broker.queues,uuid) TO broker_relay;

-- Waits up to wait_ms (-1: until there is one) for a group with messages and
-- locks it: the requested group when one is given, and then only once it has
-- messages of the requested conversation when one is given too.  Sleeps with
-- a growing interval (5 ms to 100 ms) while nothing is there: notifications
-- cannot reach a session inside a transaction.  A group found at the head of
-- the queue has messages, so only a requested group is looked at again.
CREATE OR REPLACE FUNCTION broker._wait_for_group(q broker.queues, requested_group uuid, requested_handle uuid,
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
GRANT EXECUTE ON FUNCTION broker._wait_for_group(broker.queues,uuid,uuid,integer) TO broker_relay;

-- The group to receive from: that of the conversation side handle when one is
-- given (BR005 when this queue holds no such side; BR050 when group_id is given
-- too and is not its group), else group_id.
CREATE OR REPLACE FUNCTION broker._receiving_group(q broker.queues, group_id uuid, handle uuid) RETURNS uuid
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
GRANT EXECUTE ON FUNCTION broker._receiving_group(broker.queues,uuid,uuid) TO broker_relay;

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
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = broker, pg_catalog, pg_temp
AS $$
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
           m.enqueued_at, m.traceparent
    FROM (SELECT * FROM consumed UNION ALL SELECT * FROM retained) m
    JOIN names n ON n.conversation_handle = m.conversation_handle
    ORDER BY m.conversation_handle, coalesce(m.notice_after, m.message_sequence_number),
             m.notice_after IS NOT NULL, m.queue_position;
END $$;
COMMENT ON FUNCTION broker.receive(text, integer, uuid, integer, uuid) IS $$Locks one conversation group of a queue
(or the one given, or that of the conversation given) and returns its messages in order, up to `max_messages`; they
are consumed when the caller commits, and come back on rollback. `max_messages => NULL` takes every message of the
locked group (`RECEIVE` without `TOP`); `wait_ms => -1` waits until a message comes (`WAITFOR` without `TIMEOUT`;
`statement_timeout` still bounds it); `conversation_handle` hands out only that conversation's messages, its group
locked (BR005 when the queue holds no such conversation side).$$;
GRANT EXECUTE ON FUNCTION broker.receive(text,integer,uuid,integer,uuid) TO broker_application;

CREATE OR REPLACE FUNCTION broker.get_conversation_group(queue text, wait_ms integer DEFAULT 0) RETURNS uuid
LANGUAGE sql
SECURITY DEFINER SET search_path = broker, pg_catalog, pg_temp
AS $$
    SELECT broker._wait_for_group(broker._enabled_queue(queue), NULL, NULL, broker._require('wait_ms', wait_ms))
$$;
COMMENT ON FUNCTION broker.get_conversation_group(text, integer) IS $$Locks the next conversation group with messages
until the transaction ends and returns it (NULL when there is none); `wait_ms => -1` waits until there is one.$$;
GRANT EXECUTE ON FUNCTION broker.get_conversation_group(text,integer) TO broker_application;
