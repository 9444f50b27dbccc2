-- Closed conversation endpoints are forgotten after a retention, so that
-- fire-and-forget traffic leaves nothing behind, and counts per service and
-- state make a leak visible.  The retentions are columns of broker.node.
--
-- An endpoint with a remote far side leaves a small tombstone when it is
-- forgotten: a peer that never got our acknowledgement (its node down for
-- days, say) may send the conversation's messages again, and they must not
-- open the conversation anew and be delivered twice (invariant 3).  The
-- tombstone acknowledges them and delivers nothing, as the closed endpoint did
-- (broker.forgotten_conversations, in 02_conversations.sql: the transport
-- reads it too).

CREATE INDEX endpoints_closed ON broker.endpoints (closed_at) WHERE state = 'closed';

-- Forgets up to max_endpoints endpoints closed longer than the retention ago
-- (none with messages still to transmit), the conversation groups left
-- without endpoints, and tombstones past their own retention.  Returns the
-- number of endpoints forgotten.  Runs by itself whenever an endpoint closes,
-- and at every acknowledgement: so the rows to delete are locked by CTEs,
-- which run once (a locking subquery under IN can be planned to run again for
-- every row of the table), and nothing more is done when nothing is past its
-- retention.
CREATE OR REPLACE FUNCTION broker.forget_closed_endpoints(max_endpoints integer DEFAULT 1000) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    settings broker.node := (SELECT n FROM broker.node n);
    forgotten broker.endpoints[];
BEGIN
    WITH due AS (
        SELECT c.conversation_handle FROM broker.endpoints c
        WHERE c.state = 'closed' AND c.closed_at <= now() - settings.closed_endpoint_retention
          AND NOT EXISTS (SELECT 1 FROM broker.transmission_queue t
                          WHERE t.to_service = c.far_service AND t.priority = c.priority
                            AND t.conversation_handle = c.conversation_handle)
        ORDER BY c.closed_at
        LIMIT broker._require('max_endpoints', max_endpoints)
        FOR UPDATE SKIP LOCKED
    ), gone AS (
        DELETE FROM broker.endpoints e USING due WHERE e.conversation_handle = due.conversation_handle
        RETURNING e.*
    )
    SELECT coalesce(array_agg(gone), '{}') INTO forgotten FROM gone;

    IF cardinality(forgotten) > 0 THEN
        INSERT INTO broker.forgotten_conversations (conversation_id, is_initiator, far_broker_instance,
                                                    receive_sequence)
        SELECT f.conversation_id, f.is_initiator, f.far_broker_instance, f.receive_sequence
        FROM unnest(forgotten) f WHERE NOT f.far_is_local
        ON CONFLICT DO NOTHING;
        DELETE FROM broker.transmission_progress p
        USING unnest(forgotten) f WHERE p.conversation_handle = f.conversation_handle;
        DELETE FROM broker.lost_messages l
        USING unnest(forgotten) f WHERE l.conversation_id = f.conversation_id AND l.is_initiator = f.is_initiator;
        DELETE FROM broker.queue_messages m
        USING unnest(forgotten) f
        WHERE m.conversation_group_id = f.conversation_group_id AND m.conversation_handle = f.conversation_handle;
        WITH emptied AS (
            SELECT candidate.conversation_group_id FROM broker.conversation_groups candidate
            WHERE candidate.conversation_group_id IN (SELECT f.conversation_group_id FROM unnest(forgotten) f)
              AND NOT EXISTS (SELECT 1 FROM broker.endpoints o
                              WHERE o.conversation_group_id = candidate.conversation_group_id)
              AND NOT EXISTS (SELECT 1 FROM broker.leases l
                              WHERE l.conversation_group_id = candidate.conversation_group_id)
            FOR UPDATE SKIP LOCKED
        )
        DELETE FROM broker.conversation_groups g USING emptied
        WHERE g.conversation_group_id = emptied.conversation_group_id;
    END IF;
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
