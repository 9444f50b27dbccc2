-- Peek-lock leases on conversation groups, for the REST API.  (Its idempotent
-- numbered sends are broker.send_numbered, and its readers wake on the
-- broker_queue notification of broker._enqueue.)

CREATE OR REPLACE FUNCTION broker._leased(group_id uuid) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT EXISTS (SELECT 1 FROM broker.leases
                   WHERE conversation_group_id = group_id AND expires_at > clock_timestamp())
$$;
GRANT EXECUTE ON FUNCTION broker._leased(uuid) TO broker_relay;

-- Records how a lease ended and forgets up to ten endings recorded more than
-- an hour ago, passing over any that another session is forgetting: each
-- ending makes room for itself, so the table stays as large as an hour of
-- leases.  plpgsql rather than sql: the plans are kept, not made at each call.
CREATE OR REPLACE FUNCTION broker._record_lease_end(token uuid, queue_id integer, how text, ended_at timestamptz)
RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    WITH forgotten AS (
        SELECT e.lock_token FROM broker.ended_leases e
        WHERE e.recorded_at < now() - interval '1 hour'  -- now(): stable, so the index can serve it
        ORDER BY e.recorded_at
        LIMIT 10
        FOR UPDATE SKIP LOCKED
    )
    DELETE FROM broker.ended_leases e USING forgotten WHERE e.lock_token = forgotten.lock_token;
    INSERT INTO broker.ended_leases (lock_token, queue_id, how, ended_at)
    VALUES (token, _record_lease_end.queue_id, _record_lease_end.how, _record_lease_end.ended_at);
END $$;
GRANT EXECUTE ON FUNCTION broker._record_lease_end(uuid,integer,text,timestamp with time zone) TO broker_relay;

-- With the group's row locked: true when no live lease holds the group.  An
-- expired lease is ended here and counted as a processing failure.
CREATE OR REPLACE FUNCTION broker._free_of_lease(q broker.queues, group_id uuid) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    expired broker.leases;
BEGIN
    DELETE FROM broker.leases WHERE conversation_group_id = group_id AND expires_at <= clock_timestamp()
    RETURNING * INTO expired;
    IF FOUND THEN
        PERFORM broker._record_lease_end(expired.lock_token, expired.queue_id, 'expired', expired.expires_at);
        PERFORM broker.report_processing_failure(q.name, group_id, 'the lock expired before it was completed');
        RETURN true;
    END IF;
    RETURN NOT EXISTS (SELECT 1 FROM broker.leases WHERE conversation_group_id = group_id);
END $$;
GRANT EXECUTE ON FUNCTION broker._free_of_lease(broker.queues,uuid) TO broker_relay;

-- Raises BR060 for a lock lost the way how says, at ended: its DETAIL is one
-- of expired, completed, abandoned, purged, dead_lettered or unknown (how
-- NULL: never made, or ended more than an hour ago), for a client to act on.
-- The REST API answers a lock of a queue its key may not receive from as
-- unknown, so that the key learns nothing of it.
CREATE OR REPLACE FUNCTION broker._refuse_lost_lock(lock_token uuid, how text, ended timestamptz) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION USING ERRCODE = 'BR060', DETAIL = coalesce(how, 'unknown'),
        MESSAGE = format('lock %s is lost: %s', lock_token, CASE how
            WHEN 'expired' THEN format('it expired at %s', ended)
            WHEN 'completed' THEN format('it was completed at %s', ended)
            WHEN 'abandoned' THEN format('it was abandoned at %s', ended)
            WHEN 'purged' THEN format('its queue was purged at %s', ended)
            WHEN 'dead_lettered' THEN format('its conversation was dead-lettered at %s', ended)
            ELSE 'no lock with this token is known (it never existed, or it ended more than an hour ago)' END),
        HINT = CASE how
            WHEN 'completed' THEN 'its messages were consumed: nothing is left to do with this lock'
            WHEN 'abandoned' THEN 'its messages were handed back: receive again'
            WHEN 'purged' THEN 'its messages were deleted with the rest of the queue'
            WHEN 'dead_lettered' THEN 'that conversation''s messages are in broker.dead_letters; the others came back'
            ELSE 'receive again: messages not completed come back with a higher delivery_count; '
                 'renew a lock before it expires to hold it longer' END;
END $$;
GRANT EXECUTE ON FUNCTION broker._refuse_lost_lock(uuid,text,timestamp with time zone) TO broker_relay;

-- Raises BR060 for a lock that is not live, saying why (broker._refuse_lost_lock).
CREATE OR REPLACE FUNCTION broker._lock_lost(lock_token uuid) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    how text;
    ended timestamptz;
BEGIN
    SELECT 'expired', l.expires_at INTO how, ended FROM broker.leases l WHERE l.lock_token = _lock_lost.lock_token;
    IF NOT FOUND THEN
        SELECT e.how, e.ended_at INTO how, ended FROM broker.ended_leases e WHERE e.lock_token = _lock_lost.lock_token;
    END IF;
    PERFORM broker._refuse_lost_lock(lock_token, how, ended);
END $$;
GRANT EXECUTE ON FUNCTION broker._lock_lost(uuid) TO broker_relay;

-- When a lock of lock_duration taken now ends; BR050 for a duration that is
-- not positive or longer than a day.
CREATE OR REPLACE FUNCTION broker._lock_expiry(lock_duration interval) RETURNS timestamptz
LANGUAGE plpgsql AS $$
BEGIN
    IF lock_duration IS NULL OR lock_duration <= interval '0' OR lock_duration > interval '1 day' THEN
        PERFORM broker._raise('BR050', format('lock_duration must be positive and at most a day, got %s',
            quote_nullable(lock_duration)));
    END IF;
    RETURN clock_timestamp() + lock_duration;
END $$;
GRANT EXECUTE ON FUNCTION broker._lock_expiry(interval) TO broker_relay;

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
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = broker, pg_catalog, pg_temp
AS $$
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
           m.conversation_id, m.message_sequence_number, s.name, c.name, mt.name, m.body, m.enqueued_at,
           m.traceparent
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
COMMENT ON FUNCTION broker.receive_with_lock(text, integer, interval, bigint, uuid) IS $$Peek-lock: leases one
conversation group (that of `conversation_handle`, and only its messages, when given) for `lock_duration` and returns
its next messages with a `lock_token` and `delivery_count`, at most `max_messages` and, when given, `max_bytes` of
bodies (the first message always). Nothing is consumed: `complete_lock` consumes them.$$;
GRANT EXECUTE ON FUNCTION broker.receive_with_lock(text,integer,interval,bigint,uuid) TO broker_application;

-- Consumes the messages handed out under a live lease and ends it.  Returns
-- how many were consumed (fewer than were handed out when the conversation
-- was ended or quarantined meanwhile).
CREATE OR REPLACE FUNCTION broker.complete_lock(lock_token uuid) RETURNS integer
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = broker, pg_catalog, pg_temp
AS $$
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
    PERFORM broker._record_lease_end(lease.lock_token, lease.queue_id, 'completed', clock_timestamp());
    RETURN consumed;
END $$;
COMMENT ON FUNCTION broker.complete_lock(uuid) IS $$Consumes a live lease's messages and returns how many (fewer when
the conversation was ended or quarantined meanwhile). BR060 when the lock is lost: expired, completed, abandoned or
unknown.$$;
GRANT EXECUTE ON FUNCTION broker.complete_lock(uuid) TO broker_application;

-- Returns a lease's messages to the queue at once.  Counts as a processing
-- failure; returns true when that quarantined the conversation.
CREATE OR REPLACE FUNCTION broker.abandon_lock(lock_token uuid) RETURNS boolean
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = broker, pg_catalog, pg_temp
AS $$
DECLARE
    lease broker.leases;
BEGIN
    DELETE FROM broker.leases l WHERE l.lock_token = broker._require('lock_token', abandon_lock.lock_token)
    RETURNING * INTO lease;
    IF NOT FOUND THEN
        PERFORM broker._lock_lost(lock_token);
    END IF;
    PERFORM broker._record_lease_end(lease.lock_token, lease.queue_id, 'abandoned', clock_timestamp());
    PERFORM pg_notify('broker_queue', lease.queue_id::text);
    RETURN broker._head_failed((SELECT q FROM broker.queues q WHERE q.queue_id = lease.queue_id),
                               lease.conversation_group_id, 'the lock was abandoned', false);
END $$;
COMMENT ON FUNCTION broker.abandon_lock(uuid) IS $$Hands a lease's messages back to the queue now, counting a failure
toward the poison threshold; true when that quarantined the conversation. BR060 when the lock is lost.$$;
GRANT EXECUTE ON FUNCTION broker.abandon_lock(uuid) TO broker_application;

-- Extends a live lease to lock_duration from now (a reader with long work
-- renews before the lock runs out, and no expiry counts against the
-- conversation); returns the new expiry.  A lock already lost raises BR060
-- with why.  Renewing does not hand out messages again: delivery_count stays.
CREATE OR REPLACE FUNCTION broker.renew_lock(lock_token uuid, lock_duration interval) RETURNS timestamptz
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = broker, pg_catalog, pg_temp
AS $$
DECLARE
    expires timestamptz := broker._lock_expiry(lock_duration);
BEGIN
    UPDATE broker.leases l SET expires_at = expires
    WHERE l.lock_token = broker._require('lock_token', renew_lock.lock_token) AND l.expires_at > clock_timestamp();
    IF NOT FOUND THEN
        PERFORM broker._lock_lost(lock_token);
    END IF;
    RETURN expires;
END $$;
COMMENT ON FUNCTION broker.renew_lock(uuid, interval) IS $$Extends a live lease to `lock_duration` from now (at most a
day) and returns its new expiry; counts no failure. BR060, with why, when the lock is lost.$$;
GRANT EXECUTE ON FUNCTION broker.renew_lock(uuid,interval) TO broker_application;
