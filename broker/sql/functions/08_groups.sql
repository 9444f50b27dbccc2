-- Conversation groups: moving a conversation to another, and the state an
-- application keeps with a group.

------------------------------------------------------------------------------
-- Moving a conversation to another group
------------------------------------------------------------------------------

-- Moves one side of a conversation, and its waiting messages, to another
-- conversation group of its queue (Service Broker's MOVE CONVERSATION); a
-- group that does not exist yet is made.  Both groups are locked first, in
-- the order of their ids, and the endpoint after them: the order of a reader,
-- which locks its group and then the endpoints it replies on.  It waits for
-- a reader that holds either group, and refuses (BR041) while a live lease
-- holds one.
CREATE OR REPLACE FUNCTION broker.move_conversation(conversation_handle uuid, conversation_group uuid) RETURNS void
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = broker, pg_catalog, pg_temp
AS $$
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
COMMENT ON FUNCTION broker.move_conversation(uuid, uuid) IS $$Moves one side of a conversation and its waiting
messages to another conversation group of its queue, made when it does not exist (`MOVE CONVERSATION`). Waits for a
reader holding either group; BR041 while a lock (lease) holds one.$$;
GRANT EXECUTE ON FUNCTION broker.move_conversation(uuid,uuid) TO broker_application;

-- Holds a conversation group for the caller: the group stays locked until
-- its transaction ends (at once when a receive of this transaction holds it
-- already), or, with lock_token, the caller's live lease is the one that
-- holds it.  BR041 when another reader holds it, BR060 when the lease is lost.
CREATE OR REPLACE FUNCTION broker._hold_group(group_id uuid, lock_token uuid) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    leased_group uuid;
BEGIN
    IF lock_token IS NOT NULL THEN
        SELECT l.conversation_group_id INTO leased_group FROM broker.leases l
        WHERE l.lock_token = _hold_group.lock_token AND l.expires_at > clock_timestamp();
        IF NOT FOUND THEN
            PERFORM broker._lock_lost(lock_token);
        END IF;
        IF leased_group IS DISTINCT FROM group_id THEN
            PERFORM broker._raise('BR050', format('lock %s holds another conversation group than %s', lock_token,
                group_id));
        END IF;
        RETURN;
    END IF;
    BEGIN
        PERFORM 1 FROM broker.conversation_groups g
        WHERE g.conversation_group_id = broker._require('conversation_group', group_id)
        FOR NO KEY UPDATE NOWAIT;
    EXCEPTION WHEN lock_not_available THEN
        PERFORM broker._raise('BR041', format('conversation group %s is held by another reader', group_id),
            'read and write its state in the transaction that received from it');
    END;
    IF NOT FOUND THEN
        PERFORM broker._raise('BR005', format('unknown conversation group %s', group_id));
    END IF;
    IF broker._leased(group_id) THEN
        PERFORM broker._raise('BR041', format('conversation group %s is held by a lock', group_id),
            'give the lock''s token');
    END IF;
END $$;
GRANT EXECUTE ON FUNCTION broker._hold_group(uuid,uuid) TO broker_relay;

-- The state kept for a conversation group the caller holds, or NULL.
CREATE OR REPLACE FUNCTION broker.get_conversation_group_state(conversation_group uuid, lock_token uuid DEFAULT NULL)
RETURNS jsonb
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = broker, pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM broker._hold_group(conversation_group, lock_token);
    RETURN (SELECT s.state FROM broker.conversation_group_state s
            WHERE s.conversation_group_id = get_conversation_group_state.conversation_group);
END $$;
COMMENT ON FUNCTION broker.get_conversation_group_state(uuid, uuid) IS $$The state kept for a conversation group (NULL
when none), read by the reader that holds the group: by its transaction (which then holds the group until it ends;
BR041 while another reader holds it), or by its live lease's `lock_token` (BR060 when lost).$$;
GRANT EXECUTE ON FUNCTION broker.get_conversation_group_state(uuid,uuid) TO broker_application;

-- Keeps state for a conversation group the caller holds (NULL: forgets it),
-- at most the node's message size.
CREATE OR REPLACE FUNCTION broker.set_conversation_group_state(conversation_group uuid, state jsonb, lock_token uuid DEFAULT NULL)
RETURNS void
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = broker, pg_catalog, pg_temp
AS $$
DECLARE
    limit_bytes integer := (SELECT max_message_bytes FROM broker.node);
BEGIN
    PERFORM broker._hold_group(conversation_group, lock_token);
    IF octet_length(state::text) > limit_bytes THEN
        PERFORM broker._raise('BR051', format('state of %s bytes exceeds the limit of %s bytes',
            octet_length(state::text), limit_bytes));
    END IF;
    IF state IS NULL THEN
        DELETE FROM broker.conversation_group_state s
        WHERE s.conversation_group_id = set_conversation_group_state.conversation_group;
        RETURN;
    END IF;
    INSERT INTO broker.conversation_group_state AS s (conversation_group_id, state)
    VALUES (conversation_group, set_conversation_group_state.state)
    ON CONFLICT (conversation_group_id) DO UPDATE SET state = excluded.state, updated_at = now();
END $$;
COMMENT ON FUNCTION broker.set_conversation_group_state(uuid, jsonb, uuid) IS $$Keeps state for a conversation group,
written by the reader that holds it: by its transaction (which then holds the group until it ends; BR041 while another
reader holds it), or by its live lease's `lock_token` (BR060 when lost). NULL forgets it; at most the node's message
size (BR051); it goes with the group.$$;
GRANT EXECUTE ON FUNCTION broker.set_conversation_group_state(uuid,jsonb,uuid) TO broker_application;
