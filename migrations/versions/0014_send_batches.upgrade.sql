-- Batches of sends in one statement:
-- * broker.send_batch delivers to conversations whose far side is in the same
--   database set-based, as it queues those with a remote far side, and locks
--   every conversation of a batch in one order (broker._lock_conversations);
-- * broker.send_numbered_batch is broker.send_numbered for many messages.
-- CREATE OR REPLACE resets what revision 0012 gave send_batch, and a new
-- function is executable by PUBLIC: both are said again.

CREATE FUNCTION broker._lock_conversations(handles uuid[]) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM FROM (SELECT FROM broker.endpoints e
                  WHERE e.conversation_id IN (SELECT l.conversation_id FROM broker.endpoints l
                                              WHERE l.conversation_handle = ANY (handles))
                  ORDER BY e.conversation_id, e.is_initiator DESC
                  FOR NO KEY UPDATE) locked;
END $$;
REVOKE EXECUTE ON FUNCTION broker._lock_conversations(uuid[]) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION broker._lock_conversations(uuid[]) TO broker_relay, broker_admin;

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

CREATE TYPE broker._judged_send AS (
    k bigint, conversation_handle uuid, sequence_number bigint, message_type text, body bytea, digest bytea,
    repeat_of bigint, fresh boolean, expected bigint
);

CREATE FUNCTION broker.send_numbered_batch(conversation_handles uuid[], sequence_numbers bigint[],
                                           message_types text[], bodies bytea[])
RETURNS boolean[]
LANGUAGE plpgsql SECURITY DEFINER SET search_path = broker, pg_catalog, pg_temp AS $$
DECLARE
    given integer := cardinality(conversation_handles);
    unknown uuid;
    judged broker._judged_send[];
    conflict record;
    run record;
BEGIN
    IF given IS NULL OR array_position(conversation_handles, NULL) IS NOT NULL
       OR array_position(sequence_numbers, NULL) IS NOT NULL OR array_position(message_types, NULL) IS NOT NULL
       OR cardinality(sequence_numbers) IS DISTINCT FROM given OR cardinality(message_types) IS DISTINCT FROM given
       OR cardinality(bodies) IS DISTINCT FROM given THEN
        PERFORM broker._raise('BR050', 'give as many conversation handles, sequence numbers, message types and '
            'bodies, without NULL but in bodies');
    END IF;
    PERFORM broker._lock_conversations(conversation_handles);
    SELECT h INTO unknown FROM unnest(conversation_handles) WITH ORDINALITY AS g(h, k)
    WHERE NOT EXISTS (SELECT FROM broker.endpoints e WHERE e.conversation_handle = g.h) ORDER BY k LIMIT 1;
    IF FOUND THEN
        PERFORM broker._raise('BR005', format('unknown conversation %s', unknown));
    END IF;
    WITH m AS (
        SELECT g.k, g.h, g.n, g.t, g.b, broker._content_sha256(g.t, g.b) AS digest,
               min(g.k) OVER (PARTITION BY g.h, g.n) AS first_k, e.send_sequence
        FROM unnest(conversation_handles, sequence_numbers, message_types, bodies) WITH ORDINALITY AS g(h, n, t, b, k)
        JOIN broker.endpoints e ON e.conversation_handle = g.h
    ), with_freshness AS (
        SELECT m.*, m.first_k = m.k AND m.n > m.send_sequence AS fresh FROM m
    ), with_expected AS (
        SELECT f.*, f.send_sequence + 1 + count(*) FILTER (WHERE f.fresh) OVER (
                   PARTITION BY f.h ORDER BY f.k ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS expected
        FROM with_freshness f
    )
    SELECT array_agg(ROW(f.k, f.h, f.n, f.t, f.b, f.digest, CASE WHEN f.first_k <> f.k THEN f.first_k END, f.fresh,
                         f.expected)::broker._judged_send ORDER BY f.k)
    INTO judged FROM with_expected f;
    SELECT j.k, j.conversation_handle, j.sequence_number, j.expected, j.stored IS NOT NULL AS was_sent INTO conflict
    FROM (SELECT x.*, coalesce(first.digest, s.content_sha256) AS stored
          FROM unnest(judged) x
          LEFT JOIN unnest(judged) first ON first.k = x.repeat_of
          LEFT JOIN broker.numbered_sends s
            ON x.repeat_of IS NULL AND NOT x.fresh AND s.conversation_handle = x.conversation_handle
           AND s.sequence_number = x.sequence_number) j
    WHERE (j.fresh AND j.sequence_number <> j.expected) OR (NOT j.fresh AND j.stored IS DISTINCT FROM j.digest)
    ORDER BY j.k LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION USING ERRCODE = 'BR021', DETAIL = conflict.expected::text,
            MESSAGE = CASE WHEN NOT conflict.was_sent
                THEN format('message %s is out of turn on conversation %s: the next number is %s',
                            conflict.sequence_number, conflict.conversation_handle, conflict.expected)
                ELSE format('message %s of conversation %s was already sent with another content; the next number is %s',
                            conflict.sequence_number, conflict.conversation_handle, conflict.expected) END;
    END IF;
    FOR run IN
        SELECT min(x.message_type) AS message_type, array_agg(x.conversation_handle ORDER BY x.k) AS handles,
               array_agg(x.body ORDER BY x.k) AS bodies
        FROM (SELECT x.*, row_number() OVER (ORDER BY x.k)
                          - row_number() OVER (PARTITION BY x.message_type ORDER BY x.k) AS run_id
              FROM unnest(judged) x WHERE x.fresh) x
        GROUP BY x.message_type, x.run_id ORDER BY min(x.k)
    LOOP
        PERFORM broker.send_batch(run.handles, run.message_type, run.bodies);
    END LOOP;
    INSERT INTO broker.numbered_sends (conversation_handle, sequence_number, content_sha256)
    SELECT x.conversation_handle, x.sequence_number, x.digest FROM unnest(judged) x WHERE x.fresh;
    RETURN coalesce((SELECT array_agg(x.fresh ORDER BY x.k) FROM unnest(judged) x), '{}');
END $$;
COMMENT ON FUNCTION broker.send_numbered_batch(uuid[], bigint[], text[], bytea[]) IS
    'broker.send_numbered for many messages in order, all or none: whether each was sent now.';
REVOKE EXECUTE ON FUNCTION broker.send_numbered_batch(uuid[], bigint[], text[], bytea[]) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION broker.send_numbered_batch(uuid[], bigint[], text[], bytea[]) TO broker_application, broker_admin;
