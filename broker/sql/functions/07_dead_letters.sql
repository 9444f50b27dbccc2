-- Poison messages and dead letters: failures counted, conversations
-- quarantined, dead letters resubmitted and purged, and queues purged.

-- Counts a failed attempt on the head message of a group (see
-- broker.report_processing_failure), backing the group off when asked to
-- (broker._back_off); true when that quarantined its conversation.
CREATE OR REPLACE FUNCTION broker._head_failed(q broker.queues, group_id uuid, reason text, backing_off boolean)
RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    head broker.queue_messages;
    quarantined boolean;
BEGIN
    SELECT m.* INTO head FROM broker.queue_messages m
    WHERE m.conversation_group_id = group_id AND m.queue_id = q.queue_id AND m.received_at IS NULL
    ORDER BY m.conversation_handle, coalesce(m.notice_after, m.message_sequence_number),
             m.notice_after IS NOT NULL, m.queue_position
    LIMIT 1;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    quarantined := broker._count_failure(q, broker._lock_endpoint(head.conversation_handle), head, reason);
    IF backing_off THEN
        PERFORM broker._back_off(group_id, head.failed_attempts + 1);
    END IF;
    RETURN quarantined;
END $$;
GRANT EXECUTE ON FUNCTION broker._head_failed(broker.queues,uuid,text,boolean) TO broker_relay;

-- Records that processing the head message of a group failed (its transaction
-- rolled back, a lease expired), and backs the group off (broker._back_off).
-- At the queue's poison threshold the message's conversation is quarantined:
-- its waiting messages move to broker.dead_letters and it ends with
-- broker.error on both sides.  Returns true when it quarantined.  The head message is the first in the
-- order of broker.queue_messages_in_order, and its conversation is locked
-- before the message is: every writer locks a conversation's endpoints before
-- its messages (broker.end_conversation, say, which deletes them), so taking
-- them the other way round could deadlock with it.
CREATE OR REPLACE FUNCTION broker.report_processing_failure(queue text, conversation_group uuid, reason text)
RETURNS boolean
LANGUAGE sql
SECURITY DEFINER SET search_path = broker, pg_catalog, pg_temp
AS $$
    SELECT broker._head_failed(broker._queue(queue), broker._require('conversation_group', conversation_group), reason,
                               true);
$$;
COMMENT ON FUNCTION broker.report_processing_failure(text, uuid, text) IS $$Counts a failed attempt on the group's
first message, and backs the group off: readers pass it over while another group waits, for a second after the first
failure, doubling up to a minute. Returns true when that quarantined its conversation (at the queue's
`poison_threshold`).$$;
GRANT EXECUTE ON FUNCTION broker.report_processing_failure(text,uuid,text) TO broker_application;

-- Counts a failed attempt on a waiting message of a locked conversation side.
-- At the queue's poison threshold its conversation is quarantined (true).
CREATE OR REPLACE FUNCTION broker._count_failure(q broker.queues, e broker.endpoints, message broker.queue_messages, reason text)
RETURNS boolean
LANGUAGE plpgsql AS $$
BEGIN
    UPDATE broker.queue_messages m SET failed_attempts = m.failed_attempts + 1
    WHERE m.queue_id = message.queue_id AND m.queue_position = message.queue_position AND m.received_at IS NULL
    RETURNING * INTO message;
    IF NOT FOUND OR message.failed_attempts < q.poison_threshold THEN  -- consumed or ended meanwhile, or not yet poison
        RETURN false;
    END IF;
    PERFORM broker._quarantine(q, e, message,
        format('processing failed %s times; last failure: %s', message.failed_attempts, coalesce(reason, 'not given')),
        format('message %s could not be processed after %s attempts and was moved to broker.dead_letters',
               message.message_sequence_number, message.failed_attempts));
    RETURN true;
END $$;
GRANT EXECUTE ON FUNCTION broker._count_failure(broker.queues,broker.endpoints,broker.queue_messages,text) TO broker_relay;

-- A group whose processing failed (its reader's transaction rolled back, or its
-- lock expired; not a lock abandoned, which gives the group back at once) is
-- passed over by readers that look for a group while another waits that no
-- one holds (broker._lock_group): for a second after the first failure of its
-- head message, doubling with each failure up to a minute.  So a poison
-- message does not hold the queue's other conversations back while it is
-- tried again, and is tried again at once when nothing else waits.  A group
-- another transaction holds is left as it is: its reader is at it again, and
-- the caller, which holds the conversation, never waits for the group
-- (readers lock a group before its conversations).
CREATE OR REPLACE FUNCTION broker._back_off(group_id uuid, failures integer) RETURNS void
LANGUAGE sql AS $$
    UPDATE broker.conversation_groups g
    SET backed_off_until = clock_timestamp() + least(interval '1 minute', interval '1 second' * 2 ^ (failures - 1))
    WHERE g.conversation_group_id IN (SELECT f.conversation_group_id FROM broker.conversation_groups f
                                      WHERE f.conversation_group_id = group_id
                                      FOR NO KEY UPDATE SKIP LOCKED);
$$;
GRANT EXECUTE ON FUNCTION broker._back_off(uuid,integer) TO broker_relay;

-- Whether the transaction with this 32-bit id rolled back: the id of this
-- epoch, or of the one before when it is above the next id's low bits.
-- NULL once the status has been truncated away.
CREATE OR REPLACE FUNCTION broker._rolled_back(transaction_id xid) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT pg_xact_status(full_id::text::xid8) = 'aborted'
    FROM (SELECT transaction_id::text::bigint AS low_bits,
                 pg_snapshot_xmax(pg_current_snapshot())::text::bigint AS next_id) ids,
         LATERAL (SELECT ((ids.next_id >> 32) - CASE WHEN ids.low_bits > (ids.next_id & 4294967295) THEN 1 ELSE 0 END)
                         * 4294967296 + ids.low_bits AS full_id) f
    WHERE ids.low_bits >= 3 AND f.full_id >= 0
$$;
GRANT EXECUTE ON FUNCTION broker._rolled_back(xid) TO broker_relay;

-- Watches, then counts at most one failure (each in its own transaction, so
-- that waiting for one group never holds another); returns how many it counted.
CREATE OR REPLACE FUNCTION broker.count_unreported_rollbacks(grace interval DEFAULT '2 seconds',
                                                  max_messages integer DEFAULT 1000) RETURNS integer
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = broker, pg_catalog, pg_temp
AS $$
DECLARE
    due record;
    e broker.endpoints;
    message broker.queue_messages;
BEGIN
    IF grace IS NULL OR grace < interval '0' THEN
        PERFORM broker._raise('BR050', format('grace must be zero or more, got %s', coalesce(grace::text, 'NULL')),
            'a failure is counted once a receive has ended without a report for this long');
    END IF;
    IF max_messages < 0 THEN
        PERFORM broker._raise('BR050', format('max_messages must be zero or more, got %s', max_messages));
    END IF;
    WITH heads AS (
        SELECT h.*
        FROM broker.queues q,
             LATERAL (SELECT DISTINCT m.conversation_group_id
                      FROM (SELECT m.conversation_group_id FROM broker.queue_messages m
                            WHERE m.queue_id = q.queue_id AND m.received_at IS NULL
                            ORDER BY m.priority DESC, m.queue_position
                            LIMIT broker._require('max_messages', max_messages)) m) g,
             LATERAL (SELECT m.queue_id, m.queue_position, m.failed_attempts, m.xmin, m.xmax
                      FROM broker.queue_messages m
                      WHERE m.conversation_group_id = g.conversation_group_id AND m.queue_id = q.queue_id
                        AND m.received_at IS NULL
                      ORDER BY m.conversation_handle, coalesce(m.notice_after, m.message_sequence_number),
                               m.notice_after IS NOT NULL, m.queue_position
                      LIMIT 1) h
        WHERE h.xmax <> '0'::xid
    ), forgotten AS (
        DELETE FROM broker.watched_heads w
        WHERE NOT EXISTS (SELECT 1 FROM heads h WHERE h.queue_id = w.queue_id AND h.queue_position = w.queue_position)
    )
    INSERT INTO broker.watched_heads AS w
    SELECT h.queue_id, h.queue_position, h.xmin, h.failed_attempts, h.xmax,
           CASE WHEN broker._rolled_back(h.xmax) THEN now() END
    FROM heads h
    ON CONFLICT (queue_id, queue_position) DO UPDATE
    SET row_version = excluded.row_version, failed_attempts = excluded.failed_attempts,
        last_taken_by = excluded.last_taken_by,
        ended_seen_at = CASE WHEN w.row_version <> excluded.row_version OR w.failed_attempts <> excluded.failed_attempts
                             THEN excluded.ended_seen_at
                             WHEN w.ended_seen_at IS NULL
                                  AND (w.last_taken_by <> excluded.last_taken_by OR broker._rolled_back(w.last_taken_by))
                             THEN now()
                             ELSE w.ended_seen_at END;

    SELECT q AS queue, w.queue_position, w.row_version, w.failed_attempts, m.conversation_group_id,
           m.conversation_handle
    INTO due
    FROM broker.watched_heads w
    JOIN broker.queues q ON q.queue_id = w.queue_id
    JOIN broker.queue_messages m ON m.queue_id = w.queue_id AND m.queue_position = w.queue_position
    WHERE w.ended_seen_at <= now() - grace
    ORDER BY w.ended_seen_at
    LIMIT 1;
    IF NOT FOUND THEN
        RETURN 0;
    END IF;
    -- Locked as a reader locks: the group (after its reader, if any), then the conversation.
    PERFORM set_config('lock_timeout', '1s', true);
    BEGIN
        PERFORM 1 FROM broker.conversation_groups WHERE conversation_group_id = due.conversation_group_id
        FOR NO KEY UPDATE;
        e := broker._lock_endpoint(due.conversation_handle);
    EXCEPTION WHEN lock_not_available THEN
        RETURN 0;  -- a reader still holds it: looked at again next time
    END;
    DELETE FROM broker.watched_heads
    WHERE queue_id = (due.queue).queue_id AND queue_position = due.queue_position;
    SELECT m.* INTO message FROM broker.queue_messages m
    WHERE m.queue_id = (due.queue).queue_id AND m.queue_position = due.queue_position
      AND m.xmin = due.row_version AND m.failed_attempts = due.failed_attempts AND m.received_at IS NULL;
    IF NOT FOUND THEN  -- taken, reported or changed meanwhile
        RETURN 0;
    END IF;
    PERFORM broker._count_failure(due.queue, e, message,
        'its reader rolled back without calling broker.report_processing_failure (counted by the node)');
    PERFORM broker._back_off(message.conversation_group_id, message.failed_attempts + 1);
    RETURN 1;
END $$;
COMMENT ON FUNCTION broker.count_unreported_rollbacks(interval, integer) IS $$(admin, relay) Watches the head messages
of the groups at the front of each queue (the first `max_messages` a receive would walk) and counts a failed attempt,
as `report_processing_failure` would, for one whose receive ended without taking it and without a report for `grace`
(at most one a call, waiting up to a second for its group); returns how many it counted. BR050 for a NULL or negative
`grace` (a negative one would count a rollback that has just happened) or a negative `max_messages`. A running node
calls it every second (see the how-to "Poison messages and dead letters").$$;
GRANT EXECUTE ON FUNCTION broker.count_unreported_rollbacks(interval,integer) TO broker_relay;

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
                                     message_sequence_number, message_type, body, enqueued_at, failed_attempts, reason,
                                     traceparent)
    SELECT q.name, moved.queue_position, moved.conversation_handle, moved.conversation_id,
           moved.message_sequence_number, mt.name, moved.body, moved.enqueued_at, moved.failed_attempts,
           CASE WHEN moved.queue_position = head.queue_position THEN head_reason
                ELSE format('conversation quarantined after message %s', head.message_sequence_number) END,
           moved.traceparent
    FROM moved JOIN broker.message_types mt USING (message_type_id);
    GET DIAGNOSTICS moved_count = ROW_COUNT;
    IF e.state IN ('conversing', 'disconnected_inbound', 'disconnected_outbound') THEN
        PERFORM broker._fail_conversation(e, -2, error_description);
    END IF;
    RETURN moved_count;
END $$;
GRANT EXECUTE ON FUNCTION broker._quarantine(broker.queues,broker.endpoints,broker.queue_messages,text,text) TO broker_relay;

-- A reader dead-letters a conversation whose next message it cannot process
-- (a reader that rolled back its receive, or holds a lease): what waits of it
-- moves to broker.dead_letters, the first message with the reason, and the
-- conversation ends with broker.error (-2) on both sides.  The caller holds
-- the group (broker._hold_group); a lease's messages of other conversations
-- come back, and the lease ends.  Returns how many messages moved.
CREATE OR REPLACE FUNCTION broker.dead_letter_conversation(conversation_handle uuid, reason text, lock_token uuid DEFAULT NULL)
RETURNS integer
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = broker, pg_catalog, pg_temp
AS $$
DECLARE
    e broker.endpoints;
    q broker.queues;
    head broker.queue_messages;
    lease record;
BEGIN
    IF reason IS NULL OR length(reason) NOT BETWEEN 1 AND 4000 THEN
        PERFORM broker._raise('BR050', 'reason must be 1 to 4000 characters');
    END IF;
    SELECT * INTO e FROM broker.endpoints
    WHERE endpoints.conversation_handle = broker._require('conversation_handle',
                                                          dead_letter_conversation.conversation_handle);
    IF NOT FOUND THEN
        PERFORM broker._raise('BR005', format('unknown conversation %s', dead_letter_conversation.conversation_handle));
    END IF;
    PERFORM broker._hold_group(e.conversation_group_id, lock_token);
    e := broker._lock_endpoint(e.conversation_handle);
    SELECT * INTO q FROM broker.queues WHERE queue_id = e.queue_id;
    SELECT m.* INTO head FROM broker.queue_messages m
    WHERE m.conversation_group_id = e.conversation_group_id AND m.conversation_handle = e.conversation_handle
      AND m.received_at IS NULL
    ORDER BY coalesce(m.notice_after, m.message_sequence_number), m.notice_after IS NOT NULL, m.queue_position
    LIMIT 1;
    IF NOT FOUND THEN
        PERFORM broker._raise('BR020', format('conversation %s has no message waiting to dead-letter',
            e.conversation_handle), 'roll back the receive first: the messages come back');
    END IF;
    IF lock_token IS NOT NULL THEN
        DELETE FROM broker.leases l WHERE l.lock_token = dead_letter_conversation.lock_token RETURNING * INTO lease;
        PERFORM broker._record_lease_end(lease.lock_token, lease.queue_id, 'dead_lettered', clock_timestamp());
        PERFORM pg_notify('broker_queue', lease.queue_id::text);
    END IF;
    RETURN broker._quarantine(q, e, head, format('dead-lettered by its reader: %s', reason),
        format('message %s was dead-lettered by its reader: %s', head.message_sequence_number, reason));
END $$;
COMMENT ON FUNCTION broker.dead_letter_conversation(uuid, text, uuid) IS $$A reader that holds the group (after
rolling back its receive, or by its lease's `lock_token`) quarantines the conversation now: what waits of it moves to
`dead_letters`, the first message with the reason, and it ends with `broker.error` (-2) on both sides. A lease ends
(lost as `dead_lettered`) and its other messages come back. Returns how many messages moved; BR020 when nothing of it
waits.$$;
GRANT EXECUTE ON FUNCTION broker.dead_letter_conversation(uuid,text,uuid) TO broker_application;

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
    SELECT count(*) INTO resubmitted FROM broker.dead_letters d  -- what arrived: not what this side withheld
    WHERE d.queue_name = q.name AND d.conversation_handle = e.conversation_handle AND d.queue_position > 0;
    IF resubmitted = 0 THEN
        RETURN 0;
    END IF;
    first_position := broker._next_queue_positions(resubmitted);
    WITH letters AS (
        DELETE FROM broker.dead_letters d
        WHERE d.queue_name = q.name AND d.conversation_handle = e.conversation_handle AND d.queue_position > 0
        RETURNING d.*
    )
    INSERT INTO broker.queue_messages (queue_id, queue_position, conversation_group_id, conversation_handle,
                                       conversation_id, message_sequence_number, message_type_id, body, enqueued_at,
                                       priority, traceparent)
    SELECT q.queue_id, first_position + row_number() OVER (ORDER BY l.message_sequence_number, l.queue_position) - 1,
           e.conversation_group_id, e.conversation_handle, e.conversation_id, l.message_sequence_number,
           mt.message_type_id, l.body, l.enqueued_at, e.priority, l.traceparent
    FROM letters l JOIN broker.message_types mt ON mt.name = l.message_type;
    PERFORM pg_notify('broker_queue', q.queue_id::text);
    RETURN resubmitted;
END $$;
COMMENT ON FUNCTION broker.resubmit_dead_letters(text, uuid) IS $$(admin) Puts a quarantined conversation's dead
letters back into its queue in order, while its side is in error (BR020 once ended), and returns how many. They keep
their sequence numbers and are received **before** the `broker.error` that quarantined the conversation, if that still
waits (a notice is received after the last message that had arrived when it was raised, as they had). So a reader that
ends a conversation on its `broker.error`, as readers do, processes every resubmitted message first; one that ended it
before the resubmit cannot take them back.$$;

-- Deletes a queue's dead letters (older_than: only those dead-lettered longer
-- ago); returns how many.
CREATE OR REPLACE FUNCTION broker.purge_dead_letters(queue text, older_than interval DEFAULT NULL) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    q broker.queues := broker._queue(queue);
    purged bigint;
BEGIN
    DELETE FROM broker.dead_letters d
    WHERE d.queue_name = q.name AND (older_than IS NULL OR d.dead_lettered_at < now() - older_than);
    GET DIAGNOSTICS purged = ROW_COUNT;
    RETURN purged;
END $$;
COMMENT ON FUNCTION broker.purge_dead_letters(text, interval) IS $$(admin) Deletes a queue's dead letters, or those
dead-lettered longer ago than `older_than`; returns how many.$$;

-- Deletes every message waiting in a queue (received ones that retention
-- keeps stay) and ends its leases; returns how many messages it deleted.  The
-- conversations go on: what was purged is gone, sequence numbers continue.
-- It waits for readers that are receiving from the queue.
CREATE OR REPLACE FUNCTION broker.purge_queue(queue text) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    q broker.queues := broker._queue(queue);
    purged bigint;
BEGIN
    PERFORM broker._record_lease_end(l.lock_token, l.queue_id, 'purged', clock_timestamp())
    FROM broker.leases l WHERE l.queue_id = q.queue_id;
    DELETE FROM broker.leases l WHERE l.queue_id = q.queue_id;
    DELETE FROM broker.queue_messages m WHERE m.queue_id = q.queue_id AND m.received_at IS NULL;
    GET DIAGNOSTICS purged = ROW_COUNT;
    RETURN purged;
END $$;
COMMENT ON FUNCTION broker.purge_queue(text) IS $$(admin) Deletes every message waiting in the queue and ends its
leases (their lock is lost as `purged`); the conversations go on. Returns how many messages it deleted.$$;
