-- Back to revision 0014.

DROP INDEX broker.transmission_queue_failed;
DROP INDEX broker.transmission_queue_by_service;

CREATE OR REPLACE FUNCTION broker._lock_conversations(handles uuid[]) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM FROM (SELECT FROM broker.endpoints e
                  WHERE e.conversation_id IN (SELECT l.conversation_id FROM broker.endpoints l
                                              WHERE l.conversation_handle = ANY (handles))
                  ORDER BY e.conversation_id, e.is_initiator DESC
                  FOR NO KEY UPDATE) locked;
END $$;

CREATE OR REPLACE FUNCTION broker.send_batch(conversation_handles uuid[], message_type text, bodies bytea[] DEFAULT NULL)
RETURNS bigint[]
LANGUAGE plpgsql AS $$
DECLARE
    mt broker.message_types := broker._message_type(message_type);
    given integer := cardinality(conversation_handles);
    plain integer;
    local_messages integer;
    first_position bigint;
    numbers bigint[];
BEGIN
    IF given IS NULL OR array_position(conversation_handles, NULL) IS NOT NULL THEN
        PERFORM broker._raise('BR050', 'conversation_handles must be an array of conversation handles without NULL');
    END IF;
    IF cardinality(bodies) <> given THEN
        PERFORM broker._raise('BR050', format('bodies has %s elements and conversation_handles %s: give one body per handle',
            cardinality(bodies), given));
    END IF;
    PERFORM broker._lock_conversations(conversation_handles);
    SELECT count(*) INTO plain
    FROM broker.endpoints e
    JOIN broker._plain_message_types p
      ON p.contract_id = e.contract_id AND p.sent_by_initiator = e.is_initiator AND p.message_type_id = mt.message_type_id
    WHERE e.conversation_handle = ANY (conversation_handles) AND e.state = 'conversing' AND NOT e.far_is_local
      AND (e.expires_at IS NULL OR e.expires_at > clock_timestamp());
    SELECT plain + count(*) INTO plain
    FROM broker.endpoints e
    JOIN broker.endpoints far ON far.conversation_id = e.conversation_id AND far.is_initiator <> e.is_initiator
    JOIN broker.queues q ON q.queue_id = far.queue_id
    JOIN broker._plain_message_types p
      ON p.contract_id = e.contract_id AND p.sent_by_initiator = e.is_initiator AND p.message_type_id = mt.message_type_id
    WHERE e.conversation_handle = ANY (conversation_handles) AND e.state = 'conversing' AND e.far_is_local
      AND (e.expires_at IS NULL OR e.expires_at > clock_timestamp())
      AND far.state IN ('conversing', 'disconnected_inbound') AND far.receive_sequence = e.send_sequence
      AND q.is_enabled;
    IF plain < (SELECT count(DISTINCT h) FROM unnest(conversation_handles) h)
       OR EXISTS (SELECT 1 FROM unnest(bodies) b WHERE octet_length(b) > (SELECT max_message_bytes FROM broker.node)) THEN
        numbers := '{}';
        FOR i IN 1 .. given LOOP
            numbers := numbers || broker.send(conversation_handles[i], message_type, bodies[i]);
        END LOOP;
        RETURN numbers;
    END IF;
    SELECT count(*) INTO local_messages
    FROM unnest(conversation_handles) h JOIN broker.endpoints e ON e.conversation_handle = h AND e.far_is_local;
    IF local_messages > 0 THEN
        first_position := broker._next_queue_positions(local_messages);
    END IF;
    WITH numbered AS (
        SELECT g.k, g.h, e.send_sequence + row_number() OVER (PARTITION BY g.h ORDER BY g.k) AS sequence_number,
               e.conversation_id, e.far_service, e.far_is_local, e.is_initiator, g.b
        FROM unnest(conversation_handles, bodies) WITH ORDINALITY AS g(h, b, k)
        JOIN broker.endpoints e ON e.conversation_handle = g.h
        WHERE e.conversation_handle = ANY (conversation_handles)
    ), queued AS (
        INSERT INTO broker.transmission_queue (conversation_handle, message_sequence_number, conversation_id,
                                               to_service, message_type_id, body)
        SELECT n.h, n.sequence_number, n.conversation_id, n.far_service, mt.message_type_id, n.b
        FROM numbered n WHERE NOT n.far_is_local
    ), delivered AS (
        INSERT INTO broker.queue_messages (queue_id, queue_position, conversation_group_id, conversation_handle,
                                           conversation_id, message_sequence_number, message_type_id, body)
        SELECT far.queue_id, first_position + row_number() OVER (ORDER BY n.k) - 1, far.conversation_group_id,
               far.conversation_handle, far.conversation_id, n.sequence_number, mt.message_type_id, n.b
        FROM numbered n
        JOIN broker.endpoints far ON far.conversation_id = n.conversation_id AND far.is_initiator <> n.is_initiator
        WHERE n.far_is_local
    )
    SELECT array_agg(n.sequence_number ORDER BY n.k) INTO numbers FROM numbered n;
    UPDATE broker.endpoints e SET send_sequence = e.send_sequence + c.messages
    FROM (SELECT h, count(*) AS messages FROM unnest(conversation_handles) h GROUP BY h) c
    WHERE e.conversation_handle = c.h AND e.conversation_handle = ANY (conversation_handles);
    IF local_messages > 0 THEN
        UPDATE broker.endpoints far SET receive_sequence = e.send_sequence
        FROM broker.endpoints e
        WHERE e.conversation_handle = ANY (conversation_handles) AND e.far_is_local
          AND far.conversation_id = e.conversation_id AND far.is_initiator <> e.is_initiator;
        PERFORM pg_notify('broker_queue', queue_id::text)
        FROM (SELECT DISTINCT far.queue_id FROM broker.endpoints e
              JOIN broker.endpoints far ON far.conversation_id = e.conversation_id AND far.is_initiator <> e.is_initiator
              WHERE e.conversation_handle = ANY (conversation_handles) AND e.far_is_local) queues;
    END IF;
    IF local_messages < given THEN
        PERFORM pg_notify('broker_transmission_queue', digit)
        FROM (SELECT DISTINCT left(e.conversation_handle::text, 1) AS digit FROM broker.endpoints e
              WHERE e.conversation_handle = ANY (conversation_handles) AND NOT e.far_is_local) digits;
    END IF;
    RETURN coalesce(numbers, '{}');
END $$;
ALTER FUNCTION broker.send_batch(uuid[], text, bytea[]) SECURITY DEFINER SET search_path = broker, pg_catalog, pg_temp;

CREATE OR REPLACE FUNCTION broker.receive(queue text, max_messages integer DEFAULT 1, conversation_group uuid DEFAULT NULL,
                                          wait_ms integer DEFAULT 0)
RETURNS SETOF broker.received_message
LANGUAGE plpgsql AS $$
DECLARE
    q broker.queues := broker._enabled_queue(queue);
    locked_group uuid;
BEGIN
    IF max_messages IS NULL OR max_messages < 1 THEN
        PERFORM broker._raise('BR050', format('max_messages must be at least 1, got %s', max_messages));
    END IF;
    locked_group := broker._wait_for_group(q, conversation_group, broker._require('wait_ms', wait_ms));
    IF locked_group IS NULL THEN
        RETURN;
    END IF;
    -- Without retention every row of the queue waits (received rows are deleted):
    -- said so, the walk takes the group index alone, in its order.
    RETURN QUERY
    WITH picked AS (
        SELECT m.queue_position FROM broker.queue_messages m
        WHERE m.conversation_group_id = locked_group AND (NOT q.retention OR m.received_at IS NULL)
        ORDER BY m.conversation_handle, coalesce(m.notice_after, m.message_sequence_number),
                 m.notice_after IS NOT NULL, m.queue_position
        LIMIT max_messages
    ), consumed AS (
        DELETE FROM broker.queue_messages m USING picked
        WHERE NOT q.retention AND m.queue_id = q.queue_id AND m.queue_position = picked.queue_position
        RETURNING m.*
    ), retained AS (
        UPDATE broker.queue_messages m SET received_at = now() FROM picked
        WHERE q.retention AND m.queue_id = q.queue_id AND m.queue_position = picked.queue_position
        RETURNING m.*
    ), names AS (  -- of the group's endpoints, once each
        SELECT e.conversation_handle, s.name AS service_name, c.name AS contract_name
        FROM broker.endpoints e
        JOIN broker.services s ON s.service_id = e.service_id
        JOIN broker.contracts c ON c.contract_id = e.contract_id
        WHERE e.conversation_group_id = locked_group
    )
    SELECT m.queue_position, m.conversation_group_id, m.conversation_handle, m.conversation_id,
           m.message_sequence_number, n.service_name, n.contract_name, mt.name, m.body, m.enqueued_at
    FROM (SELECT * FROM consumed UNION ALL SELECT * FROM retained) m
    JOIN names n ON n.conversation_handle = m.conversation_handle
    JOIN broker.message_types mt ON mt.message_type_id = m.message_type_id
    ORDER BY m.conversation_handle, coalesce(m.notice_after, m.message_sequence_number),
             m.notice_after IS NOT NULL, m.queue_position;
END $$;
ALTER FUNCTION broker.receive(text, integer, uuid, integer) SECURITY DEFINER SET search_path = broker, pg_catalog, pg_temp;

CREATE OR REPLACE FUNCTION broker.receive_with_lock(queue text, max_messages integer, lock_duration interval,
                                         max_bytes bigint DEFAULT NULL)
RETURNS SETOF broker.locked_message
LANGUAGE plpgsql AS $$
DECLARE
    q broker.queues := broker._enabled_queue(queue);
    locked_group uuid;
    token uuid := gen_random_uuid();
    expires timestamptz;
BEGIN
    IF max_messages IS NULL OR max_messages < 1 THEN
        PERFORM broker._raise('BR050', format('max_messages must be at least 1, got %s', max_messages));
    END IF;
    IF lock_duration IS NULL OR lock_duration <= interval '0' OR lock_duration > interval '1 day' THEN
        PERFORM broker._raise('BR050', format('lock_duration must be positive and at most a day, got %s',
            quote_nullable(lock_duration)));
    END IF;
    IF max_bytes < 1 THEN
        PERFORM broker._raise('BR050', format('max_bytes must be at least 1, got %s', max_bytes));
    END IF;
    locked_group := broker._wait_for_group(q, NULL, 0);
    IF locked_group IS NULL THEN
        RETURN;
    END IF;
    expires := clock_timestamp() + lock_duration;
    WITH next_messages AS (
        SELECT m.queue_position, coalesce(octet_length(m.body), 0) AS body_bytes,
               row_number() OVER (ORDER BY m.conversation_handle, coalesce(m.notice_after, m.message_sequence_number),
                                           m.notice_after IS NOT NULL, m.queue_position) AS turn
        FROM broker.queue_messages m
        WHERE m.conversation_group_id = locked_group AND m.queue_id = q.queue_id AND m.received_at IS NULL
        ORDER BY turn
        LIMIT max_messages
    ), picked AS (
        SELECT queue_position FROM (
            SELECT queue_position, turn, sum(body_bytes) OVER (ORDER BY turn) AS bytes_through
            FROM next_messages) running
        WHERE turn = 1 OR max_bytes IS NULL OR bytes_through <= max_bytes
    ), handed_out AS (
        UPDATE broker.queue_messages m SET delivery_count = m.delivery_count + 1
        FROM picked WHERE m.queue_id = q.queue_id AND m.queue_position = picked.queue_position
        RETURNING m.queue_position
    )
    INSERT INTO broker.leases (lock_token, queue_id, conversation_group_id, queue_positions, expires_at)
    SELECT token, q.queue_id, locked_group, array_agg(queue_position), expires FROM handed_out
    HAVING count(*) > 0;
    IF NOT FOUND THEN
        RETURN;
    END IF;

    RETURN QUERY
    SELECT token, expires, m.delivery_count, m.queue_position, m.conversation_group_id, m.conversation_handle,
           m.conversation_id, m.message_sequence_number, s.name, c.name, mt.name, m.body, m.enqueued_at
    FROM broker.leases l
    JOIN broker.queue_messages m ON m.queue_id = l.queue_id AND m.queue_position = ANY (l.queue_positions)
    JOIN broker.endpoints e ON e.conversation_handle = m.conversation_handle
    JOIN broker.services s ON s.service_id = e.service_id
    JOIN broker.contracts c ON c.contract_id = e.contract_id
    JOIN broker.message_types mt ON mt.message_type_id = m.message_type_id
    WHERE l.lock_token = token
    ORDER BY m.conversation_handle, coalesce(m.notice_after, m.message_sequence_number),
             m.notice_after IS NOT NULL, m.queue_position;
END $$;
ALTER FUNCTION broker.receive_with_lock(text, integer, interval, bigint) SECURITY DEFINER SET search_path = broker, pg_catalog, pg_temp;

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
          FROM (SELECT t.* FROM broker.transmission_queue t
                WHERE t.conversation_handle BETWEEN first_handle AND last_handle
                  AND t.to_service = ANY (ARRAY(SELECT r.service_name FROM broker.routes r
                                                WHERE r.address = destination))
                  AND t.next_attempt_at <= now()
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

    WITH removed AS (
        DELETE FROM broker.transmission_queue t
        USING unnest(handles, acknowledged) AS a(conversation_handle, acknowledged)
        WHERE t.conversation_handle = a.conversation_handle AND t.message_sequence_number <= a.acknowledged
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
