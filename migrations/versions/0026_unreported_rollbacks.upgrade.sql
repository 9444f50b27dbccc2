-- A running node counts the rollbacks that SQL readers did not report
-- (broker.count_unreported_rollbacks), so that a reader that keeps rolling back
-- ends in the dead letters instead of looping forever.

-- A reader that receives in SQL and rolls back without calling
-- broker.report_processing_failure would be handed the same message forever.
-- Its transaction leaves a trace that outlives it: the message's row keeps, as
-- its xmax, the id of the last transaction that deleted it (or marked it
-- received).  While that row version lives on (the same xmin) and waits, a
-- different xmax, or the same one now rolled back, means that the transaction
-- seen before ended without taking the message: nothing else writes a
-- waiting message's row without making a new version of it.
--
-- broker.count_unreported_rollbacks, which a running node calls every second,
-- watches the head messages of the groups at the front of each queue (the
-- first max_messages that a receive would walk) that a receive has touched.
-- Once it has seen such an end, and grace later no failure was reported (the
-- same version, the same failed_attempts), it counts a failure for the message
-- as its reader would have: after waiting for the group, as a reader does.
-- Counting makes a new version, so an end is counted once; a reader that
-- reports within grace of its rollback is never counted twice.  Several
-- rollbacks within one grace count as one.  A rollback of anything else that
-- deletes or moves a waiting message (end_conversation, move_conversation,
-- purge_queue) counts as a failure too.
CREATE TABLE broker.watched_heads (
    queue_id         integer NOT NULL,
    queue_position   bigint NOT NULL,
    row_version      xid NOT NULL,  -- the xmin of the row seen
    failed_attempts  integer NOT NULL,
    last_taken_by    xid NOT NULL,  -- the xmax seen last
    ended_seen_at    timestamptz,   -- when a transaction that took it was first seen to have ended without it
    PRIMARY KEY (queue_id, queue_position)
);

-- Whether the transaction with this 32-bit id rolled back: the id of this
-- epoch, or of the one before when it is above the next id's low bits.
-- NULL once the status has been truncated away.
CREATE FUNCTION broker._rolled_back(transaction_id xid) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT pg_xact_status(full_id::text::xid8) = 'aborted'
    FROM (SELECT transaction_id::text::bigint AS low_bits,
                 pg_snapshot_xmax(pg_current_snapshot())::text::bigint AS next_id) ids,
         LATERAL (SELECT ((ids.next_id >> 32) - CASE WHEN ids.low_bits > (ids.next_id & 4294967295) THEN 1 ELSE 0 END)
                         * 4294967296 + ids.low_bits AS full_id) f
    WHERE ids.low_bits >= 3 AND f.full_id >= 0
$$;

REVOKE EXECUTE ON FUNCTION broker._rolled_back(xid) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION broker._rolled_back(xid) TO broker_relay, broker_admin;

-- Counts a failed attempt on a waiting message of a locked conversation side.
-- At the queue's poison threshold its conversation is quarantined (true).
CREATE FUNCTION broker._count_failure(q broker.queues, e broker.endpoints, message broker.queue_messages, reason text)
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

REVOKE EXECUTE ON FUNCTION broker._count_failure(broker.queues, broker.endpoints, broker.queue_messages, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION broker._count_failure(broker.queues, broker.endpoints, broker.queue_messages, text) TO broker_relay, broker_admin;

-- Records that processing the head message of a group failed (its transaction
-- rolled back, a lease was abandoned or expired).  At the queue's poison
-- threshold the message's conversation is quarantined: its waiting messages
-- move to broker.dead_letters and it ends with broker.error on both sides.
-- Returns true when it quarantined.  The head message is the first in the
-- order of broker.queue_messages_in_order, and its conversation is locked
-- before the message is: every writer locks a conversation's endpoints before
-- its messages (broker.end_conversation, say, which deletes them), so taking
-- them the other way round could deadlock with it.
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
    RETURN broker._count_failure(q, broker._lock_endpoint(head.conversation_handle), head, reason);
END $$;

ALTER FUNCTION broker.report_processing_failure(text, uuid, text) SECURITY DEFINER SET search_path = broker, pg_catalog, pg_temp;

-- Watches, then counts at most one failure (each in its own transaction, so
-- that waiting for one group never holds another); returns how many it counted.
CREATE FUNCTION broker.count_unreported_rollbacks(grace interval DEFAULT '2 seconds',
                                                  max_messages integer DEFAULT 1000) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    due record;
    e broker.endpoints;
    message broker.queue_messages;
BEGIN
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
    RETURN 1;
END $$;
COMMENT ON FUNCTION broker.count_unreported_rollbacks(interval, integer) IS
    'Watches the heads of the groups at the front of each queue and counts a processing failure (at most one a call) for one whose receive ended without taking it and without a report for grace; returns how many it counted.  A running node calls it every second.';
ALTER FUNCTION broker.count_unreported_rollbacks(interval, integer) SECURITY DEFINER SET search_path = broker, pg_catalog, pg_temp;
REVOKE EXECUTE ON FUNCTION broker.count_unreported_rollbacks(interval, integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION broker.count_unreported_rollbacks(interval, integer) TO broker_relay, broker_admin;
