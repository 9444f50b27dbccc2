-- Back to locks that cannot be renewed and are lost without saying why (revision 0018).

-- With the group's row locked: true when no live lease holds the group.  An
-- expired lease is ended here and counted as a processing failure.
CREATE OR REPLACE FUNCTION broker._free_of_lease(q broker.queues, group_id uuid) RETURNS boolean
LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM broker.leases WHERE conversation_group_id = group_id AND expires_at <= clock_timestamp();
    IF FOUND THEN
        PERFORM broker.report_processing_failure(q.name, group_id, 'the lock expired before it was completed');
        RETURN true;
    END IF;
    RETURN NOT EXISTS (SELECT 1 FROM broker.leases WHERE conversation_group_id = group_id);
END $$;

CREATE OR REPLACE FUNCTION broker._lock_lost(lock_token uuid) RETURNS void
LANGUAGE sql AS $$
    SELECT broker._raise('BR060', format('lock %s is lost: it expired, was completed or abandoned, or never existed',
        lock_token), 'receive again: messages not completed come back with a higher delivery_count')
$$;

-- Locks the next conversation group of a queue by a lease of lock_duration
-- and returns its messages in order, each with the lease's token: up to
-- max_messages and, when max_bytes is given, up to that many bytes of bodies,
-- always at least one message, so that one larger than the budget still goes,
-- alone.  Each conversation's messages come in the order of
-- broker.queue_messages_in_order, and there is no lease when nothing was left
-- to hand out (the conversation was ended after its group was locked).
-- Nothing is consumed until broker.complete_lock.
CREATE OR REPLACE FUNCTION broker.receive_with_lock(queue text, max_messages integer, lock_duration interval,
                                         max_bytes bigint DEFAULT NULL)
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
    IF max_bytes < 1 THEN
        PERFORM broker._raise('BR050', format('max_bytes must be at least 1, got %s', max_bytes));
    END IF;
    locked_group := broker._wait_for_group(q, NULL, 0);
    IF locked_group IS NULL THEN
        RETURN;
    END IF;
    expires := clock_timestamp() + lock_duration;
    WITH next_messages AS (
        SELECT m.queue_position, coalesce(octet_length(m.body), 0) AS body_bytes,
               row_number() OVER (ORDER BY m.conversation_handle, coalesce(m.notice_after, m.message_sequence_number),
                                           m.notice_after IS NOT NULL, m.queue_position) AS turn
        FROM broker.queue_messages m
        WHERE m.conversation_group_id = locked_group AND m.queue_id = q.queue_id AND m.received_at IS NULL
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
ALTER FUNCTION broker.receive_with_lock(text, integer, interval, bigint) SECURITY DEFINER SET search_path = broker, pg_catalog, pg_temp;

-- Consumes the messages handed out under a live lease and ends it.  Returns
-- how many were consumed (fewer than were handed out when the conversation
-- was ended or quarantined meanwhile).
CREATE OR REPLACE FUNCTION broker.complete_lock(lock_token uuid) RETURNS integer
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
ALTER FUNCTION broker.complete_lock(uuid) SECURITY DEFINER SET search_path = broker, pg_catalog, pg_temp;

-- Returns a lease's messages to the queue at once.  Counts as a processing
-- failure; returns true when that quarantined the conversation.
CREATE OR REPLACE FUNCTION broker.abandon_lock(lock_token uuid) RETURNS boolean
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
ALTER FUNCTION broker.abandon_lock(uuid) SECURITY DEFINER SET search_path = broker, pg_catalog, pg_temp;

DROP FUNCTION broker.renew_lock(uuid, interval);
DROP FUNCTION broker._lock_expiry(interval);
DROP FUNCTION broker._record_lease_end(uuid, integer, text, timestamptz);
DROP TABLE broker.ended_leases;
