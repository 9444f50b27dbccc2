-- Hygiene: closed conversation endpoints are forgotten after a retention, so
-- that fire-and-forget traffic leaves nothing behind, and counts per service
-- and state make a leak visible.  Frozen with revision 0005.
--
-- An endpoint with a remote far side leaves a small tombstone when it is
-- forgotten: a peer that never got our acknowledgement (its node down for
-- days, say) may send the conversation's messages again, and they must not
-- open the conversation anew and be delivered twice (invariant 3).  The
-- tombstone acknowledges them and delivers nothing, as the closed endpoint did.

ALTER TABLE broker.node
    ADD COLUMN closed_endpoint_retention interval NOT NULL DEFAULT '30 minutes'
        CHECK (closed_endpoint_retention >= interval '0'),
    ADD COLUMN tombstone_retention interval NOT NULL DEFAULT '90 days'
        CHECK (tombstone_retention >= interval '1 day');

CREATE INDEX endpoints_closed ON broker.endpoints (closed_at) WHERE state = 'closed';

CREATE TABLE broker.forgotten_conversations (
    conversation_id      uuid NOT NULL,
    is_initiator         boolean NOT NULL,
    far_broker_instance  uuid NOT NULL,
    receive_sequence     bigint NOT NULL,
    forgotten_at         timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (conversation_id, is_initiator)
);
CREATE INDEX forgotten_conversations_age ON broker.forgotten_conversations (forgotten_at);

-- Forgets up to max_endpoints endpoints closed longer than the retention ago
-- (none with messages still to transmit), the conversation groups left
-- without endpoints, and tombstones past their own retention.  Returns the
-- number of endpoints forgotten.  Runs by itself whenever an endpoint closes.
CREATE FUNCTION broker.forget_closed_endpoints(max_endpoints integer DEFAULT 1000) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    settings broker.node := (SELECT n FROM broker.node n);
    forgotten broker.endpoints[];
BEGIN
    WITH gone AS (
        DELETE FROM broker.endpoints e
        WHERE e.conversation_handle IN (
            SELECT c.conversation_handle FROM broker.endpoints c
            WHERE c.state = 'closed' AND c.closed_at <= now() - settings.closed_endpoint_retention
              AND NOT EXISTS (SELECT 1 FROM broker.transmission_queue t
                              WHERE t.conversation_handle = c.conversation_handle)
            ORDER BY c.closed_at
            LIMIT broker._require('max_endpoints', max_endpoints)
            FOR UPDATE SKIP LOCKED)
        RETURNING e.*
    )
    SELECT coalesce(array_agg(gone), '{}') INTO forgotten FROM gone;

    INSERT INTO broker.forgotten_conversations (conversation_id, is_initiator, far_broker_instance, receive_sequence)
    SELECT f.conversation_id, f.is_initiator, f.far_broker_instance, f.receive_sequence
    FROM unnest(forgotten) f WHERE NOT f.far_is_local
    ON CONFLICT DO NOTHING;
    DELETE FROM broker.queue_messages m
    USING unnest(forgotten) f
    WHERE m.conversation_group_id = f.conversation_group_id AND m.conversation_handle = f.conversation_handle;
    DELETE FROM broker.conversation_groups g
    WHERE g.conversation_group_id IN (
        SELECT candidate.conversation_group_id FROM broker.conversation_groups candidate
        WHERE candidate.conversation_group_id IN (SELECT f.conversation_group_id FROM unnest(forgotten) f)
          AND NOT EXISTS (SELECT 1 FROM broker.endpoints o
                          WHERE o.conversation_group_id = candidate.conversation_group_id)
          AND NOT EXISTS (SELECT 1 FROM broker.leases l
                          WHERE l.conversation_group_id = candidate.conversation_group_id)
        FOR UPDATE SKIP LOCKED);
    DELETE FROM broker.forgotten_conversations
    WHERE (conversation_id, is_initiator) IN (
        SELECT conversation_id, is_initiator FROM broker.forgotten_conversations
        WHERE forgotten_at < now() - settings.tombstone_retention
        ORDER BY forgotten_at LIMIT max_endpoints);
    RETURN cardinality(forgotten);
END $$;
COMMENT ON FUNCTION broker.forget_closed_endpoints(integer) IS
    'Forgets closed endpoints older than broker.node.closed_endpoint_retention; runs whenever an endpoint closes.';

-- Each close (and each acknowledgement) forgets a few old closed endpoints
-- (the one just closed too, when the retention is zero): the cleanup keeps
-- pace with the closing.
CREATE FUNCTION broker._forget_on_close() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM broker.forget_closed_endpoints(4);
    RETURN NULL;
END $$;

CREATE TRIGGER forget_on_close AFTER UPDATE OF state ON broker.endpoints
FOR EACH ROW WHEN (NEW.state = 'closed' AND OLD.state IS DISTINCT FROM 'closed')
EXECUTE FUNCTION broker._forget_on_close();

-- An endpoint closed while its last messages still waited to be transmitted
-- can be forgotten once the far node acknowledges them.
CREATE TRIGGER forget_on_acknowledgement AFTER DELETE ON broker.transmission_queue
FOR EACH STATEMENT EXECUTE FUNCTION broker._forget_on_close();

-- Counts per service and state: a number that only grows is a leak.
CREATE VIEW broker.endpoint_counts AS
SELECT s.name AS service_name, e.state, count(*) AS endpoints, min(e.created_at) AS oldest_created_at,
       count(*) FILTER (WHERE e.expires_at IS NULL) AS without_lifetime
FROM broker.endpoints e
JOIN broker.services s USING (service_id)
GROUP BY s.name, e.state;

-- As revision 0002's, and a conversation forgotten here is acknowledged, not opened again.
CREATE OR REPLACE FUNCTION broker._accept_conversation(from_instance uuid, header jsonb) RETURNS jsonb
LANGUAGE plpgsql AS $$
DECLARE
    conversation uuid;
    sender_is_initiator boolean;
    e broker.endpoints;
    known boolean;
    tombstone broker.forgotten_conversations;
    result jsonb;
    failed_sqlstate text;
    failure text;
BEGIN
    conversation := broker._require('conversation_id', (header ->> 'conversation_id')::uuid);
    sender_is_initiator := broker._require('sender_is_initiator', (header ->> 'sender_is_initiator')::boolean);
    result := jsonb_build_object('conversation_id', conversation, 'sender_is_initiator', sender_is_initiator);
    BEGIN
        SELECT * INTO e FROM broker.endpoints
        WHERE conversation_id = conversation AND is_initiator = NOT sender_is_initiator
        FOR UPDATE;
        known := FOUND;
        IF NOT known THEN
            SELECT * INTO tombstone FROM broker.forgotten_conversations f
            WHERE f.conversation_id = conversation AND f.is_initiator = NOT sender_is_initiator
              AND f.far_broker_instance = from_instance;
            IF FOUND THEN  -- closed and forgotten here: take nothing, and let the sender stop resending
                RETURN result || jsonb_build_object('acknowledged', greatest(tombstone.receive_sequence,
                    (SELECT max((m ->> 'sequence_number')::bigint)
                     FROM jsonb_array_elements(header -> 'messages') m)));
            END IF;
        END IF;
        IF NOT known AND sender_is_initiator THEN
            e := broker._create_target_endpoint(from_instance, header);
        ELSIF NOT known OR e.far_is_local OR e.far_broker_instance IS DISTINCT FROM from_instance THEN
            PERFORM broker._raise('BR005', format('unknown conversation %s', conversation));
        END IF;
        RETURN result || jsonb_build_object('acknowledged', broker._accept_messages(e, header -> 'messages'));
    EXCEPTION WHEN SQLSTATE 'BR030' THEN
        RETURN result || jsonb_build_object('acknowledged', coalesce(e.receive_sequence, 0), 'waiting', SQLERRM);
    WHEN OTHERS THEN
        failed_sqlstate := SQLSTATE;
        failure := SQLERRM;
        IF failed_sqlstate NOT LIKE 'BR%' AND failed_sqlstate NOT IN ('22P02', '22023', '22007', '22008') THEN
            RAISE;  -- not the conversation's fault: fail the batch, the sender retries
        END IF;
    END;
    -- Refused: end this side too, if it exists, so both sides see broker.error.
    SELECT * INTO e FROM broker.endpoints WHERE conversation_id = conversation AND is_initiator = NOT sender_is_initiator;
    IF FOUND AND e.state IN ('conversing', 'disconnected_inbound', 'disconnected_outbound') THEN
        e := broker._lock_endpoint(e.conversation_handle);
        PERFORM broker._fail_conversation(e, -3, 'the conversation was refused: ' || failure);
    END IF;
    RETURN result || jsonb_build_object('acknowledged', coalesce(e.receive_sequence, 0),
                                        'refused', jsonb_build_object('sqlstate', failed_sqlstate, 'reason', failure));
END $$;
