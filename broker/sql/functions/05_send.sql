-- Sending: one message, a batch, and the numbered sends of the REST API that
-- store each (conversation, number) once.
--
-- broker.send is the one implementation of a send with every check and error;
-- the others are built on it: send_numbered numbers a send, send_batch sends
-- the common case set-based and everything else through broker.send, and
-- send_numbered_batch numbers sends and makes them through send_batch.  The
-- common case is one rule, stated once for send's one-statement path and
-- send_batch's set-based one: a side that may send now
-- (broker._may_send) sending a plain type its contract lets it send
-- (broker._plain_message_types).

-- Whether a conversation side may send now: it is conversing and within its
-- lifetime.  One SQL expression, inlined where it is used, so that a query
-- that uses it is planned as if it were written out.
CREATE OR REPLACE FUNCTION broker._may_send(state text, expires_at timestamptz) RETURNS boolean
LANGUAGE sql VOLATILE AS $$
    SELECT state = 'conversing' AND (expires_at IS NULL OR expires_at > clock_timestamp())
$$;
GRANT EXECUTE ON FUNCTION broker._may_send(text,timestamp with time zone) TO broker_relay;

-- A conversation with a remote far side (the common case) is locked, numbered
-- and checked by one UPDATE and its message goes straight to the transmission
-- queue; a local one, a type with validation, or anything that fails a check
-- takes the general path with its errors.  The notification carries the first
-- hex digit of the handle, so that only the relay lane for that share of the
-- handles wakes (an empty one wakes all).  A conversation past its lifetime
-- refuses to send (BR020), on either side, even before its expiry has been
-- fired.  A message given a delivery time (deliver_after from now, or
-- deliver_at) is held until then, and the later ones of its conversation
-- behind it (broker._transmit).
CREATE OR REPLACE FUNCTION broker.send(conversation_handle uuid, message_type text, body bytea DEFAULT NULL,
                            deliver_after interval DEFAULT NULL, deliver_at timestamptz DEFAULT NULL)
RETURNS bigint
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = broker, pg_catalog, pg_temp
AS $$
DECLARE
    sender broker.endpoints;
    mt broker.message_types;
    far_queue broker.queues;
    numbered record;
    due timestamptz := CASE WHEN deliver_after IS NOT NULL OR deliver_at IS NOT NULL
                            THEN broker._delivery_time(deliver_after, deliver_at) END;
BEGIN
    -- The common case in one statement: a conversing endpoint with a remote far
    -- side, within its lifetime, sending a type without validation that its
    -- contract allows it to, at once (behind what the conversation holds).
    UPDATE broker.endpoints e SET send_sequence = e.send_sequence + 1
    FROM broker._plain_message_types p
    WHERE due IS NULL
      AND e.conversation_handle = send.conversation_handle AND NOT e.far_is_local
      AND broker._may_send(e.state, e.expires_at)
      AND p.name = message_type AND p.contract_id = e.contract_id AND p.sent_by_initiator = e.is_initiator
      AND coalesce(octet_length(body), 0) <= (SELECT max_message_bytes FROM broker.node)
    RETURNING e.conversation_handle, e.send_sequence, e.conversation_id, e.far_service, p.message_type_id,
              e.held_until, e.priority
    INTO numbered;
    IF FOUND THEN
        INSERT INTO broker.transmission_log (conversation_handle, message_sequence_number, conversation_id,
                                             to_service, message_type_id, body, next_attempt_at, priority,
                                             traceparent)
        VALUES (numbered.conversation_handle, numbered.send_sequence, numbered.conversation_id, numbered.far_service,
                numbered.message_type_id, body, greatest(numbered.held_until, now()), numbered.priority,
                broker._traceparent());
        PERFORM pg_notify('broker_transmission_queue', left(numbered.conversation_handle::text, 1));
        RETURN numbered.send_sequence;
    END IF;

    sender := broker._lock_endpoint(conversation_handle);
    mt := broker._message_type(message_type);
    IF NOT broker._may_send(sender.state, sender.expires_at) THEN
        IF sender.state <> 'conversing' THEN
            PERFORM broker._raise('BR020', format('cannot send on conversation %s: it is %s',
                conversation_handle, replace(sender.state, '_', ' ')));
        END IF;
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
    RETURN broker._transmit(sender, mt, body, due);
END $$;
COMMENT ON FUNCTION broker.send(uuid, text, bytea, interval, timestamptz) IS $$Sends a message on a conversation and
returns its sequence number; it is durable when the caller commits, and a local target gets it in this transaction.
Given a delivery time to come (`deliver_after` from now, or `deliver_at`; BR050 for both or for `infinity`), the
message is held until then, and every later message of this side of the conversation (`send_batch` and the ending
included) waits behind it: it shows in `transmission_queue_status` as "held until its delivery time", and is delivered
by the node within about a quarter second of it (or by a `receive` of its queue, or `fire_due_events()`), or sent by
the relay within about a second to a remote service.$$;
GRANT EXECUTE ON FUNCTION broker.send(uuid,text,bytea,interval,timestamp with time zone) TO broker_application;

-- When a message given deliver_after (from now) or deliver_at is to be
-- delivered: BR050 for both, or for a time without end.
CREATE OR REPLACE FUNCTION broker._delivery_time(deliver_after interval, deliver_at timestamptz) RETURNS timestamptz
LANGUAGE plpgsql AS $$
BEGIN
    IF deliver_after IS NOT NULL AND deliver_at IS NOT NULL THEN
        PERFORM broker._raise('BR050', 'give deliver_after or deliver_at, not both');
    END IF;
    RETURN broker._settable_time('a delivery time', coalesce(deliver_at, clock_timestamp() + deliver_after));
END $$;
GRANT EXECUTE ON FUNCTION broker._delivery_time(interval,timestamp with time zone) TO broker_relay;

-- Locks every local endpoint of the conversations whose handles are given,
-- conversation by conversation and the initiator's endpoint first: the order
-- of broker._lock_endpoint and of an arriving batch, so that writers of many
-- conversations at once and writers of one cannot deadlock.  Returns the
-- locked endpoints as they are now, so that a caller judges them in the
-- statement that locks them.  The conversations are looked up as an array,
-- one probe of the index each: as a semi-join, the plan kept for a calling
-- function could scan every endpoint.
DROP FUNCTION IF EXISTS broker._lock_conversations(uuid[]);
CREATE OR REPLACE FUNCTION broker._locked_conversations(handles uuid[]) RETURNS SETOF broker.endpoints
LANGUAGE plpgsql AS $$
BEGIN
    RETURN QUERY
        SELECT e.* FROM broker.endpoints e
        WHERE e.conversation_id = ANY (ARRAY(SELECT l.conversation_id FROM broker.endpoints l
                                             WHERE l.conversation_handle = ANY (handles)))
        ORDER BY e.conversation_id, e.is_initiator DESC
        FOR NO KEY UPDATE;
END $$;
GRANT EXECUTE ON FUNCTION broker._locked_conversations(uuid[]) TO broker_relay;

-- Sends many messages of one type at once, bodies[i] on conversation_handles[i]
-- (bodies NULL: every body NULL).  A handle may appear more than once: its
-- messages are numbered in the order given.  Returns the sequence numbers in
-- that order.  All or nothing, with every check and error of broker.send.
-- The common case is set-based, in two statements: one locks the
-- conversations (broker._locked_conversations) and judges whether each may
-- send the type without validation that its contract allows, within its
-- lifetime, with every body within the size limit (a local far side must
-- also take it now: in step, its queue enabled); the other numbers the
-- messages, queues them (into the transmission log when their far side is
-- remote, into the far side's queue when it is local) and moves on each
-- endpoint's numbers, a conversation's endpoints looked up once whatever
-- number of its messages the batch holds.  Anything else (a conversation past
-- its lifetime, say, which broker.send refuses) goes through broker.send one
-- message at a time.  Each statement costs its executor start whatever it
-- does, which is why the work is not split further.
CREATE OR REPLACE FUNCTION broker.send_batch(conversation_handles uuid[], message_type text, bodies bytea[] DEFAULT NULL)
RETURNS bigint[]
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = broker, pg_catalog, pg_temp
AS $$
DECLARE
    mt broker.message_types := broker._message_type(message_type);
    given integer := cardinality(conversation_handles);
    plain boolean;
    local_messages integer;
    first_position bigint;
    numbers bigint[];
    queues integer[];
    lanes text[];
    trace text := broker._traceparent();  -- checked once, not for each message
BEGIN
    IF given IS NULL OR array_position(conversation_handles, NULL) IS NOT NULL THEN
        PERFORM broker._raise('BR050', 'conversation_handles must be an array of conversation handles without NULL');
    END IF;
    IF cardinality(bodies) <> given THEN
        PERFORM broker._raise('BR050', format('bodies has %s elements and conversation_handles %s: give one body per handle',
            cardinality(bodies), given));
    END IF;
    WITH locked AS MATERIALIZED (
        SELECT * FROM broker._locked_conversations(conversation_handles)
    )
    SELECT coalesce(bool_and(coalesce(
               broker._may_send(e.state, e.expires_at)
               AND (e.contract_id, e.is_initiator) IN (SELECT p.contract_id, p.sent_by_initiator
                                                       FROM broker._plain_message_types p
                                                       WHERE p.message_type_id = mt.message_type_id)
               AND (NOT e.far_is_local
                    OR (far.state IN ('conversing', 'disconnected_inbound') AND far.receive_sequence = e.send_sequence
                        AND q.is_enabled)), false)), false)
           AND (SELECT coalesce(max(octet_length(b)), 0) FROM unnest(bodies) b) <= (SELECT max_message_bytes FROM broker.node),
           coalesce(sum(g.messages) FILTER (WHERE e.far_is_local), 0)
    INTO plain, local_messages
    FROM (SELECT h, count(*) AS messages FROM unnest(conversation_handles) h GROUP BY h) g
    LEFT JOIN locked e ON e.conversation_handle = g.h
    LEFT JOIN locked far ON e.far_is_local AND far.conversation_id = e.conversation_id AND far.is_initiator = NOT e.is_initiator
    LEFT JOIN broker.queues q ON q.queue_id = far.queue_id;
    IF NOT plain THEN
        numbers := '{}';
        FOR i IN 1 .. given LOOP
            numbers := numbers || broker.send(conversation_handles[i], message_type, bodies[i]);
        END LOOP;
        RETURN numbers;
    END IF;
    IF local_messages > 0 THEN
        first_position := broker._next_queue_positions(local_messages);
    END IF;
    WITH conversations AS (
        SELECT e.conversation_handle, e.conversation_id, e.send_sequence, e.far_service, e.far_is_local, e.held_until,
               e.priority, far.conversation_handle AS far_handle, far.queue_id AS far_queue_id,
               far.conversation_group_id AS far_group_id, far.priority AS far_priority, g.messages
        FROM (SELECT h, count(*) AS messages FROM unnest(conversation_handles) h GROUP BY h) g
        JOIN broker.endpoints e ON e.conversation_handle = g.h AND e.conversation_handle = ANY (conversation_handles)
        LEFT JOIN broker.endpoints far
               ON e.far_is_local AND far.conversation_id = e.conversation_id AND far.is_initiator = NOT e.is_initiator
    ), numbered AS (  -- the bodies stay in their array, taken by index where they are stored
        SELECT m.k, c.*, c.send_sequence + row_number() OVER (PARTITION BY m.h ORDER BY m.k) AS sequence_number
        FROM unnest(conversation_handles) WITH ORDINALITY AS m(h, k)
        JOIN conversations c ON c.conversation_handle = m.h
    ), queued AS (
        INSERT INTO broker.transmission_log (conversation_handle, message_sequence_number, conversation_id,
                                             to_service, message_type_id, body, next_attempt_at, priority,
                                             traceparent)
        SELECT n.conversation_handle, n.sequence_number, n.conversation_id, n.far_service, mt.message_type_id,
               bodies[n.k], greatest(n.held_until, now()), n.priority, trace
        FROM numbered n WHERE NOT n.far_is_local
    ), delivered AS (
        INSERT INTO broker.queue_messages (queue_id, queue_position, conversation_group_id, conversation_handle,
                                           conversation_id, message_sequence_number, message_type_id, body, priority,
                                           traceparent)
        SELECT n.far_queue_id, first_position + row_number() OVER (ORDER BY n.k) - 1, n.far_group_id, n.far_handle,
               n.conversation_id, n.sequence_number, mt.message_type_id, bodies[n.k], n.far_priority, trace
        FROM numbered n WHERE n.far_is_local
    ), moved AS (  -- each endpoint once: a sender's send_sequence, a local far side's receive_sequence, or both
        UPDATE broker.endpoints e SET send_sequence = e.send_sequence + m.sent,
                                      receive_sequence = e.receive_sequence + m.received
        FROM (SELECT x.handle, sum(x.sent) AS sent, sum(x.received) AS received
              FROM conversations c
              CROSS JOIN LATERAL (VALUES (c.conversation_handle, c.messages, 0),
                                         (c.far_handle, 0, c.messages)) AS x(handle, sent, received)
              WHERE x.handle IS NOT NULL
              GROUP BY x.handle) m
        WHERE e.conversation_handle = m.handle
    )
    SELECT array_agg(n.sequence_number ORDER BY n.k),
           array_agg(DISTINCT n.far_queue_id) FILTER (WHERE n.far_is_local),
           array_agg(DISTINCT left(n.conversation_handle::text, 1)) FILTER (WHERE NOT n.far_is_local)
    INTO numbers, queues, lanes
    FROM numbered n;
    PERFORM pg_notify('broker_queue', q::text) FROM unnest(queues) q;
    PERFORM pg_notify('broker_transmission_queue', lane) FROM unnest(lanes) lane;
    RETURN coalesce(numbers, '{}');
END $$;
COMMENT ON FUNCTION broker.send_batch(uuid[], text, bytea[]) IS $$Sends `bodies[i]` on `conversation_handles[i]` in
one statement, all of one message type; a handle may repeat (numbered in the order given). Returns the sequence
numbers in that order. All or nothing, with `send`'s checks and errors.$$;
GRANT EXECUTE ON FUNCTION broker.send_batch(uuid[],text,bytea[]) TO broker_application;

CREATE OR REPLACE FUNCTION broker._content_sha256(message_type text, body bytea) RETURNS bytea
LANGUAGE sql IMMUTABLE AS $$
    SELECT sha256(convert_to(message_type, 'UTF8') || CASE WHEN body IS NULL THEN '\x00'::bytea
                                                             ELSE '\x01'::bytea || body END)
$$;
GRANT EXECUTE ON FUNCTION broker._content_sha256(text,bytea) TO broker_relay;

-- Sends message number sequence_number, chosen by the client, so that a
-- client can retry a send whose outcome it does not know: the same number
-- with the same content again is a no-op that returns false; the next number
-- sends and returns true.  Anything else raises BR021 with the number that
-- comes next in its DETAIL.  The delivery time is not part of the content: a
-- retry is the same message whatever it gives.
CREATE OR REPLACE FUNCTION broker.send_numbered(conversation_handle uuid, sequence_number bigint, message_type text,
                                     body bytea DEFAULT NULL, deliver_after interval DEFAULT NULL,
                                     deliver_at timestamptz DEFAULT NULL)
RETURNS boolean
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = broker, pg_catalog, pg_temp
AS $$
DECLARE
    sender broker.endpoints := broker._lock_endpoint(conversation_handle);
    expected bigint := sender.send_sequence + 1;
    digest bytea := broker._content_sha256(message_type, body);
    stored bytea;
BEGIN
    IF broker._require('sequence_number', sequence_number) = expected THEN
        PERFORM broker.send(conversation_handle, message_type, body, deliver_after, deliver_at);
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
COMMENT ON FUNCTION broker.send_numbered(uuid, bigint, text, bytea, interval, timestamptz) IS $$Idempotent send: the
client numbers the message; returns false, sending nothing, when that very message was sent already (its delivery time
is not part of what is compared). A number out of turn, or reused with another content, is BR021 (its DETAIL: the next
number). Held as `send` holds it.$$;
GRANT EXECUTE ON FUNCTION broker.send_numbered(uuid,bigint,text,bytea,interval,timestamp with time zone) TO broker_application;

-- broker.send_numbered for many messages, in the order given, all or none:
-- whether each was sent now.  Each message is judged as broker.send_numbered
-- would judge it after the ones before it: a number already sent (or given
-- earlier in the batch) is a no-op when its content is the same; the next
-- number sends; anything else raises BR021 for the first such message.  The
-- messages sent now go through broker.send_batch, one call per run of one
-- message type.
CREATE OR REPLACE FUNCTION broker.send_numbered_batch(conversation_handles uuid[], sequence_numbers bigint[],
                                           message_types text[], bodies bytea[])
RETURNS boolean[]
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = broker, pg_catalog, pg_temp
AS $$
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
    PERFORM FROM broker._locked_conversations(conversation_handles);
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
COMMENT ON FUNCTION broker.send_numbered_batch(uuid[], bigint[], text[], bytea[]) IS $$`send_numbered` for many
messages in the order given, all or none, each judged as it would be after the ones before it; returns whether each
was sent now. What `POST /v1/messages` runs.$$;
GRANT EXECUTE ON FUNCTION broker.send_numbered_batch(uuid[],bigint[],text[],bytea[]) TO broker_application;
