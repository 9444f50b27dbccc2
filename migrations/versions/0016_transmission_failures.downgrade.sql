-- Back to failures written on every waiting message (revision 0015).

CREATE OR REPLACE VIEW broker.transmission_queue_status AS
SELECT t.conversation_handle, t.conversation_id, t.to_service, t.message_sequence_number,
       mt.name AS message_type, octet_length(t.body) AS body_bytes,
       t.enqueued_at, t.attempts, t.next_attempt_at, t.transmission_status
FROM broker.transmission_queue t
JOIN broker.message_types mt USING (message_type_id);

CREATE OR REPLACE FUNCTION broker.transport_batch(destination text, max_messages integer, max_bytes bigint,
                                       first_handle uuid, last_handle uuid)
RETURNS SETOF broker.transport_message
LANGUAGE plpgsql STABLE AS $$
BEGIN  -- plpgsql rather than sql: the plan is kept between batches, not made again for each
    RETURN QUERY
    SELECT sized.conversation_id, sized.is_initiator, sized.from_service, sized.to_service, sized.contract,
           sized.expires_at, sized.sequence_number, sized.message_type, sized.body
    FROM (SELECT e.conversation_id, e.is_initiator, s.name AS from_service, e.far_service AS to_service,
                 c.name AS contract, e.expires_at, due.message_sequence_number AS sequence_number,
                 mt.name AS message_type, due.body,
                 sum(80 + coalesce(octet_length(due.body), 0) + octet_length(s.name) + octet_length(e.far_service)
                     + octet_length(c.name) + octet_length(mt.name))
                     OVER (ORDER BY due.conversation_handle, due.message_sequence_number) AS bytes_so_far,
                 row_number() OVER (ORDER BY due.conversation_handle, due.message_sequence_number) AS place
          FROM (SELECT t.* FROM broker.routes r,
                     LATERAL (SELECT t.* FROM broker.transmission_queue t
                              WHERE t.to_service = r.service_name
                                AND t.conversation_handle BETWEEN first_handle AND last_handle
                                AND t.next_attempt_at <= now()
                              ORDER BY t.conversation_handle, t.message_sequence_number
                              LIMIT max_messages) t
                WHERE r.address = destination
                ORDER BY t.conversation_handle, t.message_sequence_number
                LIMIT max_messages) due
          JOIN broker.endpoints e ON e.conversation_handle = due.conversation_handle
          JOIN broker.services s ON s.service_id = e.service_id
          JOIN broker.contracts c ON c.contract_id = e.contract_id
          JOIN broker.message_types mt ON mt.message_type_id = due.message_type_id) sized
    WHERE sized.place = 1 OR sized.bytes_so_far <= max_bytes
    ORDER BY sized.place;
END $$;

CREATE OR REPLACE FUNCTION broker.apply_transport_results(answer jsonb) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    handles uuid[];
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
    SELECT array_agg(e.conversation_handle), array_agg(least(coalesce(r.acknowledged, 0), s.last_sent)),
           array_agg(CASE WHEN r.refused IS NOT NULL
                          THEN coalesce(r.refused ->> 'reason', 'no reason given') END),
           array_agg(r.waiting)
    INTO handles, acknowledged, refusals, holds
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
        FROM unnest(handles, acknowledged) AS a(conversation_handle, acknowledged),
             LATERAL (SELECT t.ctid FROM broker.transmission_queue t
                      WHERE t.conversation_handle = a.conversation_handle
                        AND t.message_sequence_number <= a.acknowledged
                      OFFSET 0) d
    ), removed AS (
        DELETE FROM broker.transmission_queue t
        WHERE t.ctid = ANY (ARRAY(SELECT r.ctid FROM acknowledged_rows r))
        RETURNING 1
    )
    SELECT count(*) INTO delivered FROM removed;
    -- The far node answered for these: earlier failures no longer apply.
    UPDATE broker.transmission_queue t
    SET attempts = 0, transmission_status = 'sent; waiting for the numbers before it to be acknowledged'
    FROM unnest(handles, refusals, holds) AS a(conversation_handle, refused, waiting)
    WHERE t.conversation_handle = a.conversation_handle AND a.refused IS NULL AND a.waiting IS NULL
      AND t.attempts > 0;

    FOR result IN
        SELECT * FROM unnest(handles, refusals, holds) AS a(conversation_handle, refused, waiting)
        WHERE a.refused IS NOT NULL OR a.waiting IS NOT NULL
    LOOP
        IF result.refused IS NOT NULL THEN
            PERFORM broker._refused_by_far_side(broker._lock_endpoint(result.conversation_handle), result.refused);
        ELSE
            UPDATE broker.transmission_queue
            SET transmission_status = 'the far node holds it back: ' || result.waiting,
                attempts = attempts + 1, next_attempt_at = now() + interval '5 seconds'
            WHERE conversation_handle = result.conversation_handle;
        END IF;
    END LOOP;
    RETURN delivered;
END $$;

CREATE OR REPLACE FUNCTION broker.record_transport_failure(destination text, first_handle uuid, last_handle uuid, reason text,
                                                retry_after interval) RETURNS void
LANGUAGE sql AS $$
    UPDATE broker.transmission_queue t
    SET attempts = t.attempts + 1,
        next_attempt_at = now() + retry_after,
        transmission_status = format('%s (attempt %s, next at %s)', reason, t.attempts + 1,
                                     to_char(now() + retry_after, 'YYYY-MM-DD HH24:MI:SS TZ'))
    FROM broker.routes r
    WHERE r.service_name = t.to_service AND r.address = destination
      AND t.conversation_handle BETWEEN first_handle AND last_handle
$$;

DROP TABLE broker.transmission_failures;
