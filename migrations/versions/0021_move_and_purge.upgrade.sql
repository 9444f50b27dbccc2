-- Service Broker's MOVE CONVERSATION (broker.move_conversation, for the
-- application) and a purge of a queue (broker.purge_queue, for its admin).

-- Moves one side of a conversation, and its waiting messages, to another
-- conversation group of its queue (Service Broker's MOVE CONVERSATION); a
-- group that does not exist yet is made.  Both groups are locked first, in
-- the order of their ids, and the endpoint after them: the order of a reader,
-- which locks its group and then the endpoints it replies on.  It waits for
-- a reader that holds either group, and refuses (BR041) while a live lease
-- holds one.
CREATE FUNCTION broker.move_conversation(conversation_handle uuid, conversation_group uuid) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    e broker.endpoints;
    target_queue integer;
BEGIN
    SELECT * INTO e FROM broker.endpoints
    WHERE endpoints.conversation_handle = broker._require('conversation_handle', move_conversation.conversation_handle);
    IF NOT FOUND THEN
        PERFORM broker._raise('BR005', format('unknown conversation %s', move_conversation.conversation_handle));
    END IF;
    INSERT INTO broker.conversation_groups
    VALUES (broker._require('conversation_group', conversation_group), e.queue_id)
    ON CONFLICT DO NOTHING;
    SELECT queue_id INTO target_queue FROM broker.conversation_groups g
    WHERE g.conversation_group_id = conversation_group;
    IF target_queue <> e.queue_id THEN
        PERFORM broker._raise('BR050', format('conversation group %s belongs to another queue', conversation_group));
    END IF;
    PERFORM FROM broker.conversation_groups g
    WHERE g.conversation_group_id IN (e.conversation_group_id, conversation_group)
    ORDER BY g.conversation_group_id
    FOR NO KEY UPDATE;
    IF broker._leased(e.conversation_group_id) OR broker._leased(conversation_group) THEN
        PERFORM broker._raise('BR041', format('conversation %s cannot move while a lock holds its group or the other',
            move_conversation.conversation_handle), 'complete or abandon the lock first');
    END IF;
    UPDATE broker.endpoints SET conversation_group_id = conversation_group
    WHERE endpoints.conversation_handle = e.conversation_handle AND conversation_group_id = e.conversation_group_id;
    IF NOT FOUND THEN  -- moved by another transaction while this one waited for the groups
        PERFORM broker._raise('BR041', format('conversation %s was moved meanwhile', e.conversation_handle),
            'try again');
    END IF;
    UPDATE broker.queue_messages m SET conversation_group_id = conversation_group
    WHERE m.conversation_group_id = e.conversation_group_id AND m.conversation_handle = e.conversation_handle;
END $$;
COMMENT ON FUNCTION broker.move_conversation(uuid, uuid) IS
    'Moves one side of a conversation and its waiting messages to another conversation group of its queue.';
ALTER FUNCTION broker.move_conversation(uuid, uuid) SECURITY DEFINER SET search_path = broker, pg_catalog, pg_temp;
REVOKE EXECUTE ON FUNCTION broker.move_conversation(uuid, uuid) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION broker.move_conversation(uuid, uuid) TO broker_application, broker_admin;

-- Deletes every message waiting in a queue (received ones that retention
-- keeps stay) and ends its leases; returns how many messages it deleted.  The
-- conversations go on: what was purged is gone, sequence numbers continue.
-- It waits for readers that are receiving from the queue.
CREATE FUNCTION broker.purge_queue(queue text) RETURNS bigint
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
COMMENT ON FUNCTION broker.purge_queue(text) IS
    'Deletes every message waiting in a queue and ends its leases; returns how many messages it deleted.';
REVOKE EXECUTE ON FUNCTION broker.purge_queue(text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION broker.purge_queue(text) TO broker_admin;
