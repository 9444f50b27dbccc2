-- broker.send_batch delivers to conversations whose far side is in the same
-- database set-based, as it queues those with a remote far side: one INSERT
-- into the far side's queue instead of broker.send per message.  CREATE OR
-- REPLACE resets what revision 0012 gave the function, so it is given again.

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
    SELECT count(*) INTO plain
    FROM (SELECT e.contract_id, e.is_initiator FROM broker.endpoints e
          WHERE e.conversation_handle = ANY (conversation_handles) AND e.state = 'conversing' AND NOT e.far_is_local
            AND (e.expires_at IS NULL OR e.expires_at > clock_timestamp())
          ORDER BY e.conversation_handle
          FOR NO KEY UPDATE) e
    JOIN broker._plain_message_types p
      ON p.contract_id = e.contract_id AND p.sent_by_initiator = e.is_initiator AND p.message_type_id = mt.message_type_id;
    PERFORM FROM (SELECT FROM broker.endpoints e
                  WHERE e.conversation_id IN (SELECT l.conversation_id FROM broker.endpoints l
                                              WHERE l.conversation_handle = ANY (conversation_handles) AND l.far_is_local)
                  ORDER BY e.conversation_id, e.is_initiator DESC
                  FOR NO KEY UPDATE) locked;
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
