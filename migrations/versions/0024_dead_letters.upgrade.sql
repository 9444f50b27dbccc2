-- Dead letters to manage: a reader dead-letters a conversation with a reason
-- (broker.dead_letter_conversation), and an admin puts a quarantined
-- conversation's dead letters back in order (broker.resubmit_dead_letters) or
-- deletes them (broker.purge_dead_letters).

CREATE INDEX dead_letters_by_conversation ON broker.dead_letters (queue_name, conversation_handle,
                                                                  message_sequence_number);

-- Moves the waiting messages of a locked conversation side, head (its first)
-- with head_reason and the others after it, to broker.dead_letters, and ends
-- the conversation with broker.error (-2, error_description) on both sides.
CREATE FUNCTION broker._quarantine(q broker.queues, e broker.endpoints, head broker.queue_messages, head_reason text,
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
REVOKE EXECUTE ON FUNCTION broker._quarantine(broker.queues, broker.endpoints, broker.queue_messages, text, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION broker._quarantine(broker.queues, broker.endpoints, broker.queue_messages, text, text) TO broker_relay, broker_admin;

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
    e := broker._lock_endpoint(head.conversation_handle);
    UPDATE broker.queue_messages m SET failed_attempts = m.failed_attempts + 1
    WHERE m.queue_id = head.queue_id AND m.queue_position = head.queue_position AND m.received_at IS NULL
    RETURNING * INTO head;
    IF NOT FOUND OR head.failed_attempts < q.poison_threshold THEN  -- consumed or ended meanwhile, or not yet poison
        RETURN false;
    END IF;
    PERFORM broker._quarantine(q, e, head,
        format('processing failed %s times; last failure: %s', head.failed_attempts, coalesce(reason, 'not given')),
        format('message %s could not be processed after %s attempts and was moved to broker.dead_letters',
               head.message_sequence_number, head.failed_attempts));
    RETURN true;
END $$;
ALTER FUNCTION broker.report_processing_failure(text, uuid, text) SECURITY DEFINER SET search_path = broker, pg_catalog, pg_temp;

-- A reader dead-letters a conversation whose next message it cannot process
-- (a reader that rolled back its receive, or holds a lease): what waits of it
-- moves to broker.dead_letters, the first message with the reason, and the
-- conversation ends with broker.error (-2) on both sides.  The caller holds
-- the group (broker._hold_group); a lease's messages of other conversations
-- come back, and the lease ends.  Returns how many messages moved.
CREATE FUNCTION broker.dead_letter_conversation(conversation_handle uuid, reason text, lock_token uuid DEFAULT NULL)
RETURNS integer
LANGUAGE plpgsql AS $$
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
COMMENT ON FUNCTION broker.dead_letter_conversation(uuid, text, uuid) IS
    'A reader that holds the group dead-letters a conversation: its waiting messages move to broker.dead_letters and it ends with broker.error (-2).';
ALTER FUNCTION broker.dead_letter_conversation(uuid, text, uuid) SECURITY DEFINER SET search_path = broker, pg_catalog, pg_temp;
REVOKE EXECUTE ON FUNCTION broker.dead_letter_conversation(uuid, text, uuid) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION broker.dead_letter_conversation(uuid, text, uuid) TO broker_application, broker_admin;

-- Puts a quarantined conversation's dead letters back into its queue, in
-- order, to be processed again (after a fix): only while its side is in
-- error, not yet ended by the application, whose replies it still refuses.
-- Returns how many came back.
CREATE FUNCTION broker.resubmit_dead_letters(queue text, conversation_handle uuid) RETURNS integer
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
REVOKE EXECUTE ON FUNCTION broker.resubmit_dead_letters(text, uuid) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION broker.resubmit_dead_letters(text, uuid) TO broker_admin;

-- Deletes a queue's dead letters (older_than: only those dead-lettered longer
-- ago); returns how many.
CREATE FUNCTION broker.purge_dead_letters(queue text, older_than interval DEFAULT NULL) RETURNS bigint
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
COMMENT ON FUNCTION broker.purge_dead_letters(text, interval) IS
    'Deletes a queue''s dead letters, or those dead-lettered longer ago than older_than; returns how many.';
REVOKE EXECUTE ON FUNCTION broker.purge_dead_letters(text, interval) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION broker.purge_dead_letters(text, interval) TO broker_admin;
