-- Back to counting only the failures that readers report (revision 0025).

DROP FUNCTION broker.count_unreported_rollbacks(interval, integer);
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

DROP FUNCTION broker._count_failure(broker.queues, broker.endpoints, broker.queue_messages, text);
DROP FUNCTION broker._rolled_back(xid);
DROP TABLE broker.watched_heads;
