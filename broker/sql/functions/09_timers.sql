-- Conversation timers and lifetimes: broker.dialog_timer and the error of an
-- expired conversation, fired when due.

CREATE OR REPLACE FUNCTION broker.begin_conversation_timer(conversation_handle uuid, timeout interval) RETURNS void
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = broker, pg_catalog, pg_temp
AS $$
DECLARE
    e broker.endpoints := broker._lock_endpoint(conversation_handle);
BEGIN
    IF timeout IS NULL OR timeout < interval '0' THEN
        PERFORM broker._raise('BR050', format('timeout must be zero or positive, got %s', quote_nullable(timeout)));
    END IF;
    IF e.state = 'closed' THEN
        PERFORM broker._raise('BR020', format('conversation %s is closed', conversation_handle));
    END IF;
    UPDATE broker.endpoints SET timer_at = broker._settable_time('a timer', now() + timeout)
    WHERE endpoints.conversation_handle = e.conversation_handle;
END $$;
COMMENT ON FUNCTION broker.begin_conversation_timer(uuid, interval) IS $$After `timeout`, a `broker.dialog_timer`
message arrives on this side of the conversation.$$;
GRANT EXECUTE ON FUNCTION broker.begin_conversation_timer(uuid,interval) TO broker_application;

-- broker._lock_endpoint, or a NULL endpoint without waiting when another
-- transaction holds the conversation's initiator (locked first, the usual
-- order): what fires events leaves such a conversation for later.
CREATE OR REPLACE FUNCTION broker._try_lock_endpoint(handle uuid) RETURNS broker.endpoints
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM 1 FROM broker.endpoints
    WHERE conversation_handle = (SELECT i.conversation_handle FROM broker.endpoints i
                                 JOIN broker.endpoints e ON e.conversation_id = i.conversation_id
                                 WHERE e.conversation_handle = handle
                                 ORDER BY i.is_initiator DESC LIMIT 1)
    FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    RETURN broker._lock_endpoint(handle);
END $$;
GRANT EXECUTE ON FUNCTION broker._try_lock_endpoint(uuid) TO broker_relay;

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
    -- always one with a delivery time of its own, in transmission_log_held.
    FOR due IN
        SELECT DISTINCT t.conversation_handle
        FROM broker.services s
        JOIN broker.transmission_log t
          ON t.to_service = s.name AND t.next_attempt_at > t.enqueued_at AND t.next_attempt_at <= due_by
        JOIN broker.endpoints sender ON sender.conversation_handle = t.conversation_handle AND sender.far_is_local
        WHERE target_queue_id IS NULL OR s.queue_id = target_queue_id
        LIMIT max_events
    LOOP
        e := broker._try_lock_endpoint(due.conversation_handle);
        CONTINUE WHEN e.conversation_handle IS NULL;
        FOR held IN
            SELECT t.* FROM broker.transmission_log t
            WHERE t.conversation_handle = e.conversation_handle AND t.next_attempt_at <= due_by
            ORDER BY t.message_sequence_number
        LOOP
            DELETE FROM broker.transmission_log t
            WHERE t.conversation_handle = held.conversation_handle
              AND t.message_sequence_number = held.message_sequence_number;
            PERFORM broker._deliver(broker._far_endpoint(e), held.message_sequence_number,
                                    (SELECT mt FROM broker.message_types mt WHERE mt.message_type_id = held.message_type_id),
                                    held.body, held.traceparent);
            fired := fired + 1;
        END LOOP;
        UPDATE broker.endpoints SET held_until = NULL
        WHERE conversation_handle = e.conversation_handle
          AND NOT EXISTS (SELECT 1 FROM broker.transmission_log t WHERE t.conversation_handle = e.conversation_handle);
    END LOOP;
    RETURN fired;
END $$;
GRANT EXECUTE ON FUNCTION broker._fire_due_events(integer,integer) TO broker_relay;

CREATE OR REPLACE FUNCTION broker.fire_due_events() RETURNS integer
LANGUAGE sql AS $$
    SELECT broker._fire_due_events(NULL)
$$;
COMMENT ON FUNCTION broker.fire_due_events() IS $$Fires the conversation timers and lifetimes that are due, and
delivers held local messages that are due, on every queue; returns how many. A running node calls it every quarter
second, and a `receive` fires those of its own queue.$$;
GRANT EXECUTE ON FUNCTION broker.fire_due_events() TO broker_relay;
