-- Removes what revision 0003 added and puts back revision 0001's
-- broker._lock_group and broker._enqueue.
DROP FUNCTION broker.send_numbered(uuid, bigint, text, bytea);
DROP FUNCTION broker._content_sha256(text, bytea);
DROP TABLE broker.numbered_sends;
DROP FUNCTION broker.abandon_lock(uuid);
DROP FUNCTION broker.complete_lock(uuid);
DROP FUNCTION broker.receive_with_lock(text, integer, interval);

CREATE OR REPLACE FUNCTION broker._lock_group(q broker.queues, requested_group uuid) RETURNS uuid
LANGUAGE plpgsql AS $$
DECLARE
    candidate uuid;
    tried uuid[] := '{}';
BEGIN
    IF requested_group IS NOT NULL THEN
        PERFORM 1 FROM broker.conversation_groups
        WHERE conversation_group_id = requested_group AND queue_id = q.queue_id
        FOR NO KEY UPDATE SKIP LOCKED;
        RETURN CASE WHEN FOUND THEN requested_group END;
    END IF;
    -- Fast path: groups of the messages at the head of the queue.
    FOR candidate IN
        SELECT conversation_group_id FROM broker.queue_messages
        WHERE queue_id = q.queue_id AND received_at IS NULL
        ORDER BY queue_position LIMIT 200
    LOOP
        CONTINUE WHEN candidate = ANY (tried);
        tried := tried || candidate;
        PERFORM 1 FROM broker.conversation_groups WHERE conversation_group_id = candidate
        FOR NO KEY UPDATE SKIP LOCKED;
        IF FOUND AND EXISTS (SELECT 1 FROM broker.queue_messages
                             WHERE conversation_group_id = candidate AND queue_id = q.queue_id
                               AND received_at IS NULL) THEN
            RETURN candidate;
        END IF;
    END LOOP;
    -- The head belongs to groups held by others: look at every group of the queue.
    SELECT g.conversation_group_id INTO candidate
    FROM broker.conversation_groups g
    WHERE g.queue_id = q.queue_id
      AND g.conversation_group_id <> ALL (tried)
      AND EXISTS (SELECT 1 FROM broker.queue_messages m
                  WHERE m.conversation_group_id = g.conversation_group_id AND m.queue_id = q.queue_id
                    AND m.received_at IS NULL)
    LIMIT 1
    FOR NO KEY UPDATE OF g SKIP LOCKED;
    RETURN candidate;
END $$;

CREATE OR REPLACE FUNCTION broker._enqueue(receiver broker.endpoints, sequence_number bigint, message_type_id integer, body bytea)
RETURNS void
LANGUAGE sql AS $$
    INSERT INTO broker.queue_messages (queue_id, queue_position, conversation_group_id, conversation_handle,
                                       conversation_id, message_sequence_number, message_type_id, body)
    VALUES (receiver.queue_id, broker._next_queue_position(), receiver.conversation_group_id,
            receiver.conversation_handle, receiver.conversation_id, sequence_number, message_type_id, body)
$$;

DROP FUNCTION broker._leased(uuid);
DROP FUNCTION broker._free_of_lease(broker.queues, uuid);
DROP FUNCTION broker._lock_lost(uuid);
DROP TYPE broker.locked_message;
ALTER TABLE broker.queue_messages DROP COLUMN delivery_count;
DROP TABLE broker.leases;
DROP TABLE broker.api_keys;
