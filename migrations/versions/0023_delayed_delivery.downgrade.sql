-- Back to messages delivered as soon as they are sent (revision 0022).  What is
-- held is made due now, and the held messages of local conversations are
-- delivered, before the functions that know of holding go.

UPDATE broker.transmission_queue t SET next_attempt_at = t.enqueued_at + interval '1 microsecond'
FROM broker.endpoints e
WHERE e.conversation_handle = t.conversation_handle AND e.far_is_local;
UPDATE broker.transmission_queue SET next_attempt_at = enqueued_at WHERE next_attempt_at > now() AND attempts = 0;
DO $$
BEGIN
    WHILE EXISTS (SELECT 1 FROM broker.transmission_queue t JOIN broker.endpoints e USING (conversation_handle)
                  WHERE e.far_is_local) LOOP
        PERFORM broker._fire_due_events(NULL);
    END LOOP;
END $$;

CREATE OR REPLACE VIEW broker.transmission_queue_status AS
SELECT t.conversation_handle, t.conversation_id, t.to_service, t.message_sequence_number,
       mt.name AS message_type, octet_length(t.body) AS body_bytes, t.enqueued_at,
       coalesce(f.attempts, t.attempts) AS attempts,
       coalesce(f.next_attempt_at, t.next_attempt_at) AS next_attempt_at,
       CASE WHEN f.reason IS NULL THEN t.transmission_status
            ELSE format('%s (attempt %s, next at %s)', f.reason, f.attempts,
                        to_char(f.next_attempt_at, 'YYYY-MM-DD HH24:MI:SS TZ')) END AS transmission_status
FROM broker.transmission_queue t
JOIN broker.message_types mt USING (message_type_id)
LEFT JOIN LATERAL (SELECT f.* FROM broker.routes r
                   JOIN broker.transmission_failures f ON f.address = r.address
                   WHERE r.service_name = t.to_service
                     AND t.conversation_handle BETWEEN f.first_handle AND f.last_handle
                   ORDER BY f.failed_at DESC
                   LIMIT 1) f ON true;

DROP INDEX broker.transmission_queue_held;

DROP FUNCTION broker._transmit(broker.endpoints, broker.message_types, bytea, timestamptz);
-- Numbers a message from a locked endpoint and hands it to the far side:
-- delivered in this transaction when the far side is local, otherwise put
-- on the transmission queue.  Returns the message's sequence number.
CREATE FUNCTION broker._transmit(sender broker.endpoints, mt broker.message_types, body bytea)
RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    sequence_number bigint := sender.send_sequence + 1;
    far broker.endpoints;
BEGIN
    UPDATE broker.endpoints SET send_sequence = sequence_number
    WHERE conversation_handle = sender.conversation_handle;
    IF sender.far_is_local THEN
        far := broker._far_endpoint(sender);
        PERFORM broker._deliver(far, sequence_number, mt, body);
    ELSE
        INSERT INTO broker.transmission_queue (conversation_handle, message_sequence_number, conversation_id,
                                               to_service, message_type_id, body)
        VALUES (sender.conversation_handle, sequence_number, sender.conversation_id,
                sender.far_service, mt.message_type_id, body);
        PERFORM pg_notify('broker_transmission_queue', '');
    END IF;
    RETURN sequence_number;
END $$;
REVOKE EXECUTE ON FUNCTION broker._transmit(broker.endpoints, broker.message_types, bytea) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION broker._transmit(broker.endpoints, broker.message_types, bytea) TO broker_relay, broker_admin;

CREATE OR REPLACE FUNCTION broker._transmit_error(sender broker.endpoints, error_code integer, error_description text)
RETURNS bigint
LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM broker.transmission_queue t
    WHERE t.to_service = sender.far_service AND t.conversation_handle = sender.conversation_handle;
    RETURN broker._transmit(sender, broker._message_type('broker.error'),
                            broker._error_body(error_code, error_description));
END $$;

DROP FUNCTION broker.send(uuid, text, bytea, interval, timestamptz);
DROP FUNCTION broker._delivery_time(interval, timestamptz);
-- A conversation with a remote far side (the common case) is locked, numbered
-- and checked by one UPDATE and its message goes straight to the transmission
-- queue; a local one, a type with validation, or anything that fails a check
-- takes the general path with its errors.  The notification carries the first
-- hex digit of the handle, so that only the relay lane for that share of the
-- handles wakes (an empty one wakes all).  A conversation past its lifetime
-- refuses to send (BR020), on either side, even before its expiry has been
-- fired.
CREATE FUNCTION broker.send(conversation_handle uuid, message_type text, body bytea DEFAULT NULL)
RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    sender broker.endpoints;
    mt broker.message_types;
    far_queue broker.queues;
    numbered record;
BEGIN
    -- The common case in one statement: a conversing endpoint with a remote far
    -- side, within its lifetime, sending a type without validation that its
    -- contract allows it to.
    UPDATE broker.endpoints e SET send_sequence = e.send_sequence + 1
    FROM broker.message_types t, broker.contract_message_types cmt
    WHERE e.conversation_handle = send.conversation_handle AND e.state = 'conversing' AND NOT e.far_is_local
      AND (e.expires_at IS NULL OR e.expires_at > clock_timestamp())
      AND t.name = message_type AND t.validation = 'none' AND t.name NOT LIKE 'broker.%'
      AND cmt.contract_id = e.contract_id AND cmt.message_type_id = t.message_type_id
      AND cmt.sent_by IN ('any', CASE WHEN e.is_initiator THEN 'initiator' ELSE 'target' END)
      AND coalesce(octet_length(body), 0) <= (SELECT max_message_bytes FROM broker.node)
    RETURNING e.conversation_handle, e.send_sequence, e.conversation_id, e.far_service, t.message_type_id
    INTO numbered;
    IF FOUND THEN
        INSERT INTO broker.transmission_queue (conversation_handle, message_sequence_number, conversation_id,
                                               to_service, message_type_id, body)
        VALUES (numbered.conversation_handle, numbered.send_sequence, numbered.conversation_id, numbered.far_service,
                numbered.message_type_id, body);
        PERFORM pg_notify('broker_transmission_queue', left(numbered.conversation_handle::text, 1));
        RETURN numbered.send_sequence;
    END IF;

    sender := broker._lock_endpoint(conversation_handle);
    mt := broker._message_type(message_type);
    IF sender.state <> 'conversing' THEN
        PERFORM broker._raise('BR020', format('cannot send on conversation %s: it is %s',
            conversation_handle, replace(sender.state, '_', ' ')));
    END IF;
    IF sender.expires_at <= clock_timestamp() THEN
        PERFORM broker._raise('BR020', format('cannot send on conversation %s: its lifetime expired at %s',
            conversation_handle, sender.expires_at), 'end the conversation');
    END IF;
    IF mt.name LIKE 'broker.%' THEN
        PERFORM broker._raise('BR010', format('message type %L is sent by the broker itself', message_type),
            'use broker.end_conversation to end a conversation or report an error');
    END IF;
    PERFORM broker._check_message(sender.contract_id, sender.is_initiator, mt, body);
    IF sender.far_is_local THEN
        SELECT q.* INTO far_queue FROM broker.queues q JOIN broker.endpoints e USING (queue_id)
        WHERE e.conversation_id = sender.conversation_id AND e.is_initiator <> sender.is_initiator;
        IF NOT far_queue.is_enabled THEN
            PERFORM broker._raise('BR030', format('queue %L of service %L is disabled', far_queue.name, sender.far_service));
        END IF;
    END IF;
    RETURN broker._transmit(sender, mt, body);
END $$;
COMMENT ON FUNCTION broker.send(uuid, text, bytea) IS
    'Sends a message on a conversation; returns its sequence number.  Durable when the caller commits.';
ALTER FUNCTION broker.send(uuid, text, bytea) SECURITY DEFINER SET search_path = broker, pg_catalog, pg_temp;
REVOKE EXECUTE ON FUNCTION broker.send(uuid, text, bytea) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION broker.send(uuid, text, bytea) TO broker_application, broker_admin;

-- Sends many messages of one type at once, bodies[i] on conversation_handles[i]
-- (bodies NULL: every body NULL).  A handle may appear more than once: its
-- messages are numbered in the order given.  Returns the sequence numbers in
-- that order.  All or nothing, with every check and error of broker.send.
-- The common case is set-based: conversing conversations within their
-- lifetime sending a type without validation that their contract allows are
-- locked together (broker._lock_conversations), numbered by one UPDATE, and
-- queued by one INSERT into the transmission queue when their far side is
-- remote, or delivered by one INSERT into the far side's queue when it is
-- local, takes messages and its queue is enabled.  Anything else (a
-- conversation past its lifetime, say, which broker.send refuses) goes through
-- broker.send one message at a time.
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
    FROM unnest(conversation_handles) h JOIN broker.endpoints e ON e.conversation_handle = h AND e.far_is_local
    WHERE e.conversation_handle = ANY (conversation_handles);
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
COMMENT ON FUNCTION broker.send_batch(uuid[], text, bytea[]) IS
    'Sends bodies[i] on conversation_handles[i], all of one message type; returns the sequence numbers in order.';
ALTER FUNCTION broker.send_batch(uuid[], text, bytea[]) SECURITY DEFINER SET search_path = broker, pg_catalog, pg_temp;

DROP FUNCTION broker.send_numbered(uuid, bigint, text, bytea, interval, timestamptz);
-- Sends message number sequence_number, chosen by the client, so that a
-- client can retry a send whose outcome it does not know: the same number
-- with the same content again is a no-op that returns false; the next number
-- sends and returns true.  Anything else raises BR021 with the number that
-- comes next in its DETAIL.
CREATE FUNCTION broker.send_numbered(conversation_handle uuid, sequence_number bigint, message_type text,
                                     body bytea DEFAULT NULL)
RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    sender broker.endpoints := broker._lock_endpoint(conversation_handle);
    expected bigint := sender.send_sequence + 1;
    digest bytea := broker._content_sha256(message_type, body);
    stored bytea;
BEGIN
    IF broker._require('sequence_number', sequence_number) = expected THEN
        PERFORM broker.send(conversation_handle, message_type, body);
        INSERT INTO broker.numbered_sends VALUES (conversation_handle, sequence_number, digest);
        RETURN true;
    END IF;
    SELECT content_sha256 INTO stored FROM broker.numbered_sends n
    WHERE n.conversation_handle = send_numbered.conversation_handle AND n.sequence_number = send_numbered.sequence_number;
    IF stored = digest THEN
        RETURN false;
    END IF;
    RAISE EXCEPTION USING ERRCODE = 'BR021', DETAIL = expected::text,
        MESSAGE = CASE WHEN stored IS NULL
            THEN format('message %s is out of turn on conversation %s: the next number is %s',
                        sequence_number, conversation_handle, expected)
            ELSE format('message %s of conversation %s was already sent with another content; the next number is %s',
                        sequence_number, conversation_handle, expected) END;
END $$;
COMMENT ON FUNCTION broker.send_numbered(uuid, bigint, text, bytea) IS
    'Idempotent send: the client numbers the message; a retry with the same number and content is a no-op.';
ALTER FUNCTION broker.send_numbered(uuid, bigint, text, bytea) SECURITY DEFINER SET search_path = broker, pg_catalog, pg_temp;
REVOKE EXECUTE ON FUNCTION broker.send_numbered(uuid, bigint, text, bytea) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION broker.send_numbered(uuid, bigint, text, bytea) TO broker_application, broker_admin;

-- Fires due conversation timers and lifetimes, of one queue or
-- (target_queue_id NULL) every queue, at most max_events endpoints a call;
-- returns how many it fired (a local conversation's lifetime ends both sides
-- at once).  An endpoint whose conversation another transaction holds is left
-- for later.  A running node calls broker.fire_due_events every quarter second,
-- so that timers and lifetimes take effect when they fall due, not when
-- somebody next receives.
CREATE OR REPLACE FUNCTION broker._fire_due_events(target_queue_id integer, max_events integer DEFAULT 1000) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    due_by timestamptz := clock_timestamp();  -- a waiting receive outlives its transaction's now()
    due record;
    e broker.endpoints;
    fired integer := 0;
BEGIN
    FOR due IN
        SELECT conversation_handle, conversation_id FROM broker.endpoints
        WHERE (target_queue_id IS NULL OR queue_id = target_queue_id)
          AND (timer_at <= due_by
               OR (expires_at <= due_by AND state IN ('conversing', 'disconnected_inbound', 'disconnected_outbound')))
        LIMIT max_events
    LOOP
        -- Lock the initiator without waiting, then the rest: the usual order.
        PERFORM 1 FROM broker.endpoints
        WHERE conversation_handle = (SELECT conversation_handle FROM broker.endpoints
                                     WHERE conversation_id = due.conversation_id
                                     ORDER BY is_initiator DESC LIMIT 1)
        FOR UPDATE SKIP LOCKED;
        CONTINUE WHEN NOT FOUND;
        e := broker._lock_endpoint(due.conversation_handle);
        IF e.timer_at <= due_by THEN
            UPDATE broker.endpoints SET timer_at = NULL WHERE conversation_handle = e.conversation_handle;
            PERFORM broker._enqueue(e, 0, (broker._message_type('broker.dialog_timer')).message_type_id, NULL);
            fired := fired + 1;
        END IF;
        IF e.expires_at <= due_by AND e.state IN ('conversing', 'disconnected_inbound', 'disconnected_outbound') THEN
            PERFORM broker._fail_conversation(e, -1, 'the conversation''s lifetime expired before it was ended');
            fired := fired + 1;
        END IF;
    END LOOP;
    RETURN fired;
END $$;

COMMENT ON FUNCTION broker.fire_due_events() IS
    'Fires the conversation timers and lifetimes that are due, on every queue; returns how many.  A running node calls it every quarter second.';
DROP FUNCTION broker._try_lock_endpoint(uuid);

CREATE OR REPLACE FUNCTION broker.transport_batch(destination text, max_messages integer, max_bytes bigint,
                                       first_handle uuid, last_handle uuid)
RETURNS SETOF broker.transport_message
LANGUAGE plpgsql STABLE AS $$
DECLARE  -- conversations held back after a failure: seldom any, so each message is looked at only then
    holds_back boolean := EXISTS (SELECT 1 FROM broker.transmission_failures f
                                  WHERE f.address = destination AND f.next_attempt_at > now());
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
                                AND (NOT holds_back
                                     OR NOT EXISTS (SELECT 1 FROM broker.transmission_failures f
                                                    WHERE f.address = destination AND f.next_attempt_at > now()
                                                      AND t.conversation_handle
                                                          BETWEEN f.first_handle AND f.last_handle))
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
COMMENT ON FUNCTION broker.transport_batch(text, integer, bigint, uuid, uuid) IS
    'The next batch for a destination: the lowest waiting numbers of its conversations between the handles, up to a count and a size.';

ALTER TABLE broker.endpoints DROP COLUMN held_until;
