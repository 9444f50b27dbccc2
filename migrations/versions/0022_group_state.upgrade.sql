-- State kept per conversation group, read and written by the reader that
-- holds the group (broker.get_conversation_group_state and
-- broker.set_conversation_group_state).

-- What a reader keeps for a conversation group between receives (Service
-- Bus's session state; a Service Broker application's state table keyed by
-- the group): read and written only by the reader that holds the group, so
-- it changes with the messages it goes with, in one transaction.  It goes
-- when the group goes.
CREATE TABLE broker.conversation_group_state (
    conversation_group_id  uuid PRIMARY KEY REFERENCES broker.conversation_groups ON DELETE CASCADE,
    state                  jsonb NOT NULL,
    updated_at             timestamptz NOT NULL DEFAULT now()
);

-- Holds a conversation group for the caller: the group stays locked until
-- its transaction ends (at once when a receive of this transaction holds it
-- already), or, with lock_token, the caller's live lease is the one that
-- holds it.  BR041 when another reader holds it, BR060 when the lease is lost.
CREATE FUNCTION broker._hold_group(group_id uuid, lock_token uuid) RETURNS void
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
REVOKE EXECUTE ON FUNCTION broker._hold_group(uuid, uuid) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION broker._hold_group(uuid, uuid) TO broker_relay, broker_admin;

-- The state kept for a conversation group the caller holds, or NULL.
CREATE FUNCTION broker.get_conversation_group_state(conversation_group uuid, lock_token uuid DEFAULT NULL)
RETURNS jsonb
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM broker._hold_group(conversation_group, lock_token);
    RETURN (SELECT s.state FROM broker.conversation_group_state s
            WHERE s.conversation_group_id = get_conversation_group_state.conversation_group);
END $$;
COMMENT ON FUNCTION broker.get_conversation_group_state(uuid, uuid) IS
    'The state kept for a conversation group that the caller holds (by its transaction, or by lock_token), or NULL.';
ALTER FUNCTION broker.get_conversation_group_state(uuid, uuid) SECURITY DEFINER SET search_path = broker, pg_catalog, pg_temp;
REVOKE EXECUTE ON FUNCTION broker.get_conversation_group_state(uuid, uuid) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION broker.get_conversation_group_state(uuid, uuid) TO broker_application, broker_admin;

-- Keeps state for a conversation group the caller holds (NULL: forgets it),
-- at most the node's message size.
CREATE FUNCTION broker.set_conversation_group_state(conversation_group uuid, state jsonb, lock_token uuid DEFAULT NULL)
RETURNS void
LANGUAGE plpgsql AS $$
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
COMMENT ON FUNCTION broker.set_conversation_group_state(uuid, jsonb, uuid) IS
    'Keeps state for a conversation group that the caller holds (NULL forgets it).';
ALTER FUNCTION broker.set_conversation_group_state(uuid, jsonb, uuid) SECURITY DEFINER SET search_path = broker, pg_catalog, pg_temp;
REVOKE EXECUTE ON FUNCTION broker.set_conversation_group_state(uuid, jsonb, uuid) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION broker.set_conversation_group_state(uuid, jsonb, uuid) TO broker_application, broker_admin;
