-- Back to revision 0013: send_batch sends to local far sides one message at a time, locking remote
-- conversations in the order of their handles; no send_numbered_batch.

DROP FUNCTION broker.send_numbered_batch(uuid[], bigint[], text[], bytea[]);
DROP TYPE broker._judged_send;

CREATE OR REPLACE FUNCTION broker.send_batch(conversation_handles uuid[], message_type text, bodies bytea[] DEFAULT NULL)
RETURNS bigint[]
LANGUAGE plpgsql AS $$
DECLARE
    mt broker.message_types := broker._message_type(message_type);
    given integer := cardinality(conversation_handles);
    plain integer;
    numbers bigint[];
BEGIN
    IF given IS NULL OR array_position(conversation_handles, NULL) IS NOT NULL THEN
        PERFORM broker._raise('BR050', 'conversation_handles must be an array of conversation handles without NULL');
    END IF;
    IF cardinality(bodies) <> given THEN
        PERFORM broker._raise('BR050', format('bodies has %s elements and conversation_handles %s: give one body per handle',
            cardinality(bodies), given));
    END IF;
    SELECT count(*) INTO plain
    FROM (SELECT e.contract_id, e.is_initiator FROM broker.endpoints e
          WHERE e.conversation_handle = ANY (conversation_handles) AND e.state = 'conversing' AND NOT e.far_is_local
            AND (e.expires_at IS NULL OR e.expires_at > clock_timestamp())
          ORDER BY e.conversation_handle
          FOR NO KEY UPDATE) e
    JOIN broker._plain_message_types p
      ON p.contract_id = e.contract_id AND p.sent_by_initiator = e.is_initiator AND p.message_type_id = mt.message_type_id;
    IF plain < (SELECT count(DISTINCT h) FROM unnest(conversation_handles) h)
       OR EXISTS (SELECT 1 FROM unnest(bodies) b WHERE octet_length(b) > (SELECT max_message_bytes FROM broker.node)) THEN
        numbers := '{}';
        FOR i IN 1 .. given LOOP
            numbers := numbers || broker.send(conversation_handles[i], message_type, bodies[i]);
        END LOOP;
        RETURN numbers;
    END IF;
    WITH numbered AS (
        SELECT g.k, g.h, e.send_sequence + row_number() OVER (PARTITION BY g.h ORDER BY g.k) AS sequence_number,
               e.conversation_id, e.far_service, g.b
        FROM unnest(conversation_handles, bodies) WITH ORDINALITY AS g(h, b, k)
        JOIN broker.endpoints e ON e.conversation_handle = g.h
        WHERE e.conversation_handle = ANY (conversation_handles)
    ), queued AS (
        INSERT INTO broker.transmission_queue (conversation_handle, message_sequence_number, conversation_id,
                                               to_service, message_type_id, body)
        SELECT n.h, n.sequence_number, n.conversation_id, n.far_service, mt.message_type_id, n.b FROM numbered n
    )
    SELECT array_agg(n.sequence_number ORDER BY n.k) INTO numbers FROM numbered n;
    UPDATE broker.endpoints e SET send_sequence = e.send_sequence + c.messages
    FROM (SELECT h, count(*) AS messages FROM unnest(conversation_handles) h GROUP BY h) c
    WHERE e.conversation_handle = c.h AND e.conversation_handle = ANY (conversation_handles);
    PERFORM pg_notify('broker_transmission_queue', digit)
    FROM (SELECT DISTINCT left(h::text, 1) AS digit FROM unnest(conversation_handles) h) digits;
    RETURN coalesce(numbers, '{}');
END $$;
ALTER FUNCTION broker.send_batch(uuid[], text, bytea[]) SECURITY DEFINER SET search_path = broker, pg_catalog, pg_temp;

DROP FUNCTION broker._lock_conversations(uuid[]);
