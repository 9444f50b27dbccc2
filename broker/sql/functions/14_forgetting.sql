-- What the node forgets, and when.  Closed conversation endpoints are
-- forgotten after a retention, so that fire-and-forget traffic leaves nothing
-- behind (broker.endpoint_counts makes a leak visible); the resend window of
-- acknowledged messages is pruned; and what a peer may have forgotten is
-- withheld from it.  The retentions are columns of broker.node.
--
-- An endpoint with a remote far side leaves a small tombstone when it is
-- forgotten: a peer that never got our acknowledgement (its node down for
-- days, say) may send the conversation's messages again, and they must not
-- open the conversation anew and be delivered twice (invariant 3).  The
-- tombstone acknowledges them and delivers nothing, as the closed endpoint did
-- (broker.forgotten_conversations: the transport reads it too); numbers past
-- those the conversation took before it ended it refuses (see
-- broker._accept_conversation).

-- A peer forgets a conversation it ended after its tombstone_retention (see
-- broker.peer_retention): a message it has not acknowledged after that long
-- may reach it after it forgot, and open the conversation anew.  A peer whose
-- retention was never heard (none of its answers came back) is taken to keep
-- the shortest a node can (a day, see broker.node).  So a
-- conversation side whose oldest waiting message is older than its peer's
-- retention, less margin, stops: what waits of it moves to the dead letters
-- (queue_position 0: never delivered) with the reason, and the conversation
-- ends with broker.error -5 on both sides: the peer takes the error across the
-- numbers withheld (a peer that was only down would otherwise wait for them
-- for ever, and its replies would be discarded here; one that did forget the
-- conversation gets an error for a conversation it ended, which delivers
-- nothing twice).  Conversations that an application holds are passed over
-- until the next call.  Returns how many conversations stopped.  A running
-- relay calls it every minute.
CREATE OR REPLACE FUNCTION broker.withhold_what_peers_forgot(margin interval DEFAULT '1 hour') RETURNS integer
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = broker, pg_catalog, pg_temp
AS $$
DECLARE
    shortest_retention constant interval := '1 day';  -- the least broker.node.tombstone_retention takes
    candidate record;
    e broker.endpoints;
    first_number bigint;
    last_number bigint;
    reason text;
    stopped integer := 0;
BEGIN
    FOR candidate IN
        SELECT o AS side, coalesce(r.tombstone_retention, shortest_retention) AS retention,
               coalesce(p.acknowledged_sequence, 0) AS acknowledged
        FROM broker.endpoints o
        LEFT JOIN broker.transmission_progress p ON p.conversation_handle = o.conversation_handle
        LEFT JOIN broker.peer_retention r ON r.broker_instance = o.far_broker_instance
        WHERE NOT o.far_is_local AND o.send_sequence > coalesce(p.acknowledged_sequence, 0)
          AND (SELECT t.enqueued_at FROM broker.transmission_log t
               WHERE t.conversation_handle = o.conversation_handle
                 AND t.message_sequence_number > coalesce(p.acknowledged_sequence, 0)
               ORDER BY t.message_sequence_number LIMIT 1)
              < now() - coalesce(r.tombstone_retention, shortest_retention) + margin
        FOR UPDATE OF o SKIP LOCKED
    LOOP
        e := candidate.side;
        reason := format('not sent: it waited longer than the far node remembers ended conversations (its '
                         'tombstone_retention, %s), and could reach it as new', candidate.retention);
        WITH attempted AS (
            SELECT coalesce((SELECT r.attempts FROM broker.transmission_retries r
                             WHERE r.conversation_handle = e.conversation_handle), 0) AS attempts
        ), withheld AS (
            SELECT w.* FROM broker._take_waiting(e.conversation_handle) w
        ), lettered AS (
            INSERT INTO broker.dead_letters (queue_name, queue_position, conversation_handle, conversation_id,
                                             message_sequence_number, message_type, body, enqueued_at,
                                             failed_attempts, reason, traceparent)
            SELECT q.name, 0, w.conversation_handle, w.conversation_id, w.message_sequence_number, mt.name, w.body,
                   w.enqueued_at, a.attempts, reason, w.traceparent
            FROM withheld w
            CROSS JOIN attempted a
            JOIN broker.message_types mt USING (message_type_id)
            JOIN broker.queues q ON q.queue_id = e.queue_id
            RETURNING message_sequence_number
        )
        SELECT min(message_sequence_number), max(message_sequence_number) INTO first_number, last_number
        FROM lettered;
        PERFORM broker._fail_conversation(e, -5, format('messages %s to %s were %s', first_number, last_number,
                                                         reason));
        PERFORM broker._record_lost_messages(e, 'sent', first_number, last_number, 'withheld');
        stopped := stopped + 1;
    END LOOP;
    RETURN stopped;
END $$;
COMMENT ON FUNCTION broker.withhold_what_peers_forgot(interval) IS $$(admin, relay) Ends, with `broker.error` -5 on
both sides (the far node takes it across the numbers withheld), each conversation whose oldest waiting message is
older than its peer's `tombstone_retention` (learned from its answers, in `peer_retention`; a day when never heard)
less the margin, and moves what waits of it to `dead_letters` (with `queue_position` 0: never delivered, and never
resubmitted); returns how many. A running relay calls it every minute.$$;
GRANT EXECUTE ON FUNCTION broker.withhold_what_peers_forgot(interval) TO broker_relay;

-- Forgets up to max_messages messages of the transmission log sent longer
-- than broker.node.resend_window ago that their far node acknowledged (or
-- whose conversation was forgotten), and as many of the resend window the
-- release before revision 0037 kept (broker.acknowledged_messages); returns
-- how many.  A running relay calls it every minute, again and again while it
-- forgets max_messages, each call in a transaction of its own: so the window
-- keeps up with any rate.
CREATE OR REPLACE FUNCTION broker.forget_acknowledged_messages(max_messages integer DEFAULT 100000) RETURNS integer
LANGUAGE sql AS $$
    WITH due AS (
        SELECT t.ctid FROM broker.transmission_log t
        LEFT JOIN broker.transmission_progress p ON p.conversation_handle = t.conversation_handle
        WHERE t.enqueued_at < now() - (SELECT n.resend_window FROM broker.node n)
          AND (t.message_sequence_number <= p.acknowledged_sequence
               OR NOT EXISTS (SELECT 1 FROM broker.endpoints e WHERE e.conversation_handle = t.conversation_handle))
        LIMIT max_messages
    ), gone AS (
        DELETE FROM broker.transmission_log t WHERE t.ctid = ANY (ARRAY(SELECT d.ctid FROM due d))
        RETURNING 1
    ), kept_before AS (
        SELECT k.ctid FROM broker.acknowledged_messages k
        WHERE k.acknowledged_at < now() - (SELECT n.resend_window FROM broker.node n)
        LIMIT max_messages
    ), gone_before AS (
        DELETE FROM broker.acknowledged_messages k WHERE k.ctid = ANY (ARRAY(SELECT d.ctid FROM kept_before d))
        RETURNING 1
    )
    SELECT greatest((SELECT count(*) FROM gone), (SELECT count(*) FROM gone_before))::integer;
$$;
COMMENT ON FUNCTION broker.forget_acknowledged_messages(integer) IS $$(admin, relay) Forgets up to `max_messages`
messages of the transmission log sent longer than `broker.node.resend_window` ago that their far node acknowledged;
returns how many. A running relay calls it every minute, and again while it forgets `max_messages`.$$;
GRANT EXECUTE ON FUNCTION broker.forget_acknowledged_messages(integer) TO broker_relay;

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
          AND NOT EXISTS (SELECT 1 FROM broker.transmission_log t
                          WHERE t.conversation_handle = c.conversation_handle
                            AND t.message_sequence_number > coalesce(
                                (SELECT p.acknowledged_sequence FROM broker.transmission_progress p
                                 WHERE p.conversation_handle = c.conversation_handle), 0))
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
        DELETE FROM broker.transmission_retries r  -- a question asked of the far node, say
        USING unnest(forgotten) f WHERE r.conversation_handle = f.conversation_handle;
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
COMMENT ON FUNCTION broker.forget_closed_endpoints(integer) IS $$Forgets up to `max_endpoints` endpoints closed longer
than `broker.node.closed_endpoint_retention` ago, the conversation groups left without endpoints, and tombstones past
their own retention; returns how many endpoints it forgot. Runs by itself on every close and acknowledgement.$$;
GRANT EXECUTE ON FUNCTION broker.forget_closed_endpoints(integer) TO broker_relay;

-- Each close (and each acknowledgement) forgets a few old closed endpoints
-- (the one just closed too, when the retention is zero): the cleanup keeps
-- pace with the closing.
CREATE OR REPLACE FUNCTION broker._forget_on_close() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM broker.forget_closed_endpoints(4);
    RETURN NULL;
END $$;
GRANT EXECUTE ON FUNCTION broker._forget_on_close() TO broker_relay;

CREATE OR REPLACE TRIGGER forget_on_close AFTER UPDATE OF state ON broker.endpoints
FOR EACH ROW WHEN (NEW.state = 'closed' AND OLD.state IS DISTINCT FROM 'closed')
EXECUTE FUNCTION broker._forget_on_close();
