-- The transmission queue's primary key leads with the destination service, so
-- that one index serves both a destination's batches (broker.transport_batch)
-- and every lookup by conversation, which now gives the service (the sending
-- endpoint's far_service): transmission_queue_by_service, which kept the
-- other order beside the key, is gone, and with it a tenth of the cost of
-- sending.  CREATE OR REPLACE resets what revision 0012 gave the
-- application's entry points: it is said again.

ALTER TABLE broker.transmission_queue DROP CONSTRAINT transmission_queue_pkey,
    ADD PRIMARY KEY (to_service, conversation_handle, message_sequence_number);
DROP INDEX broker.transmission_queue_by_service;

CREATE OR REPLACE FUNCTION broker._transmit_error(sender broker.endpoints, error_code integer, error_description text)
RETURNS bigint
LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM broker.transmission_queue t
    WHERE t.to_service = sender.far_service AND t.conversation_handle = sender.conversation_handle;
    RETURN broker._transmit(sender, broker._message_type('broker.error'),
                            broker._error_body(error_code, error_description));
END $$;

CREATE OR REPLACE FUNCTION broker.end_conversation(conversation_handle uuid, error_code integer DEFAULT NULL,
                                                   error_description text DEFAULT NULL, cleanup boolean DEFAULT false)
RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    e broker.endpoints := broker._lock_endpoint(conversation_handle);
BEGIN
    IF cleanup THEN
        DELETE FROM broker.transmission_queue t
        WHERE t.to_service = e.far_service AND t.conversation_handle = e.conversation_handle;
        PERFORM broker._close_endpoint(e);
        RETURN;
    END IF;
    IF (error_code IS NULL) <> (error_description IS NULL) THEN
        PERFORM broker._raise('BR050', 'error_code and error_description go together: give both or neither');
    END IF;
    IF error_code <= 0 THEN
        PERFORM broker._raise('BR050', format('error_code must be positive, got %s', error_code),
            'codes of 0 and below belong to the broker');
    END IF;
    IF length(error_description) > 4000 THEN
        PERFORM broker._raise('BR050', 'error_description must be at most 4000 characters');
    END IF;
    IF e.state IN ('closed', 'disconnected_outbound') THEN
        PERFORM broker._raise('BR020', format('conversation %s is already ended (%s)',
            conversation_handle, replace(e.state, '_', ' ')));
    END IF;
    IF error_code IS NOT NULL AND e.state IN ('conversing', 'disconnected_inbound') THEN
        PERFORM broker._transmit_error(e, error_code, error_description);
        PERFORM broker._close_endpoint(e);
    ELSIF e.state = 'conversing' THEN
        PERFORM broker._transmit(e, broker._message_type('broker.end_dialog'), NULL);
        DELETE FROM broker.queue_messages m
        WHERE m.conversation_group_id = e.conversation_group_id AND m.conversation_handle = e.conversation_handle;
        UPDATE broker.endpoints SET state = 'disconnected_outbound', timer_at = NULL
        WHERE endpoints.conversation_handle = e.conversation_handle;
    ELSIF e.state = 'disconnected_inbound' THEN
        PERFORM broker._transmit(e, broker._message_type('broker.end_dialog'), NULL);
        PERFORM broker._close_endpoint(e);
    ELSE  -- error: the far side is gone already
        PERFORM broker._close_endpoint(e);
    END IF;
END $$;

ALTER FUNCTION broker.end_conversation(uuid, integer, text, boolean) SECURITY DEFINER SET search_path = broker, pg_catalog, pg_temp;

CREATE OR REPLACE FUNCTION broker._refused_by_far_side(e broker.endpoints, reason text) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM broker.transmission_queue WHERE to_service = e.far_service AND conversation_handle = e.conversation_handle;
    IF e.state IN ('conversing', 'disconnected_inbound', 'disconnected_outbound') THEN
        UPDATE broker.endpoints SET state = 'error', timer_at = NULL WHERE conversation_handle = e.conversation_handle;
        PERFORM broker._enqueue(e, 0, (broker._message_type('broker.error')).message_type_id,
                                broker._error_body(-3, 'the far node refused the conversation: ' || reason));
    END IF;
END $$;

CREATE OR REPLACE FUNCTION broker.apply_transport_results(answer jsonb) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    handles uuid[];
    services text[];
    acknowledged bigint[];
    refusals text[];
    holds text[];
    result record;
    delivered bigint;
BEGIN
    PERFORM set_config('synchronous_commit', 'off', true);
    WITH sent AS (
        SELECT b.conversation_id, b.sender_is_initiator, max(b.sequence_number) AS last_sent
        FROM pg_temp.sent_transport_batch b
        GROUP BY b.conversation_id, b.sender_is_initiator
    )
    SELECT array_agg(e.conversation_handle), array_agg(e.far_service),
           array_agg(least(coalesce(r.acknowledged, 0), s.last_sent)),
           array_agg(CASE WHEN r.refused IS NOT NULL
                          THEN coalesce(r.refused ->> 'reason', 'no reason given') END),
           array_agg(r.waiting)
    INTO handles, services, acknowledged, refusals, holds
    FROM jsonb_to_recordset(answer -> 'results')
         AS r(conversation_id uuid, sender_is_initiator boolean, acknowledged bigint, refused jsonb, waiting text)
    JOIN sent s ON s.conversation_id = r.conversation_id AND s.sender_is_initiator = r.sender_is_initiator
    JOIN broker.endpoints e ON e.conversation_id = s.conversation_id AND e.is_initiator = s.sender_is_initiator
                           AND NOT e.far_is_local;

    -- The acknowledged rows are found conversation by conversation through the
    -- primary key (OFFSET 0 keeps the planner from making the lateral subquery
    -- a join), then deleted where they lie.  As a join, the plan could scan the
    -- whole transmission queue for every answer: a long queue (a peer down for
    -- days) would make every batch slower.  A row that another transaction
    -- changed meanwhile is not deleted: it is sent again, and acknowledged as a
    -- duplicate.
    WITH acknowledged_rows AS (
        SELECT d.ctid
        FROM unnest(handles, services, acknowledged) AS a(conversation_handle, to_service, acknowledged),
             LATERAL (SELECT t.ctid FROM broker.transmission_queue t
                      WHERE t.to_service = a.to_service AND t.conversation_handle = a.conversation_handle
                        AND t.message_sequence_number <= a.acknowledged
                      OFFSET 0) d
    ), removed AS (
        DELETE FROM broker.transmission_queue t
        WHERE t.ctid = ANY (ARRAY(SELECT r.ctid FROM acknowledged_rows r))
        RETURNING 1
    )
    SELECT count(*) INTO delivered FROM removed;
    -- The far node answered for these: earlier failures no longer apply.
    DELETE FROM broker.transmission_failures f
    WHERE f.next_attempt_at <= now()
      AND f.address IN (SELECT r.address FROM broker.routes r WHERE r.service_name = ANY (services))
      AND EXISTS (SELECT 1 FROM unnest(handles) h WHERE h BETWEEN f.first_handle AND f.last_handle);
    UPDATE broker.transmission_queue t
    SET attempts = 0, transmission_status = 'sent; waiting for the numbers before it to be acknowledged'
    FROM unnest(handles, refusals, holds) AS a(conversation_handle, refused, waiting)
    WHERE t.conversation_handle = a.conversation_handle AND a.refused IS NULL AND a.waiting IS NULL
      AND t.attempts > 0;

    FOR result IN
        SELECT * FROM unnest(handles, services, refusals, holds) AS a(conversation_handle, to_service, refused, waiting)
        WHERE a.refused IS NOT NULL OR a.waiting IS NOT NULL
    LOOP
        IF result.refused IS NOT NULL THEN
            PERFORM broker._refused_by_far_side(broker._lock_endpoint(result.conversation_handle), result.refused);
        ELSE
            UPDATE broker.transmission_queue
            SET transmission_status = 'the far node holds it back: ' || result.waiting,
                attempts = attempts + 1, next_attempt_at = now() + interval '5 seconds'
            WHERE to_service = result.to_service AND conversation_handle = result.conversation_handle;
        END IF;
    END LOOP;
    RETURN delivered;
END $$;

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
                          WHERE t.to_service = c.far_service AND t.conversation_handle = c.conversation_handle)
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

