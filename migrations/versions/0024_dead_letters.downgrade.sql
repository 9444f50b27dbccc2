-- Back to dead letters that can only be read (revision 0023).

DROP FUNCTION broker.purge_dead_letters(text, interval);
DROP FUNCTION broker.resubmit_dead_letters(text, uuid);
DROP FUNCTION broker.dead_letter_conversation(uuid, text, uuid);
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
ALTER FUNCTION broker.report_processing_failure(text, uuid, text) SECURITY DEFINER SET search_path = broker, pg_catalog, pg_temp;
DROP FUNCTION broker._quarantine(broker.queues, broker.endpoints, broker.queue_messages, text, text);
DROP INDEX broker.dead_letters_by_conversation;
