-- Back to revision 0027: nothing kept for a resend window, nothing found of a
-- database that went back.

-- A message's attempts and status are those of the latest failure that covers
-- it, or else its own (the far node held its conversation back).
CREATE OR REPLACE VIEW broker.transmission_queue_status AS
SELECT t.conversation_handle, t.conversation_id, t.to_service, t.message_sequence_number,
       mt.name AS message_type, octet_length(t.body) AS body_bytes, t.enqueued_at,
       coalesce(f.attempts, t.attempts) AS attempts,
       coalesce(f.next_attempt_at, t.next_attempt_at) AS next_attempt_at,
       CASE WHEN t.attempts = 0 AND t.next_attempt_at > now()
                 THEN format('held until its delivery time, %s',
                             to_char(t.next_attempt_at, 'YYYY-MM-DD HH24:MI:SS TZ'))
            WHEN f.reason IS NULL THEN t.transmission_status
            ELSE format('%s (attempt %s, next at %s)', f.reason, f.attempts,
                        to_char(f.next_attempt_at, 'YYYY-MM-DD HH24:MI:SS TZ')) END AS transmission_status,
       t.traceparent
FROM broker.transmission_queue t
JOIN broker.message_types mt USING (message_type_id)
LEFT JOIN LATERAL (SELECT f.* FROM broker.routes r
                   JOIN broker.transmission_failures f ON f.address = r.address
                   WHERE r.service_name = t.to_service
                     AND t.conversation_handle BETWEEN f.first_handle AND f.last_handle
                   ORDER BY f.failed_at DESC
                   LIMIT 1) f ON true;

-- Stores message number sequence_number from the far side at a locked local
-- endpoint, applying what system messages do to its state.  The caller has
-- checked that sequence_number comes next (invariant 3), except that a
-- broker.error may skip numbers (see broker._transmit_error).  traceparent
-- is the message's trace.
CREATE OR REPLACE FUNCTION broker._deliver(receiver broker.endpoints, sequence_number bigint, mt broker.message_types,
                                body bytea, traceparent text)
RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    new_state text := receiver.state;
    visible boolean := receiver.state IN ('conversing', 'disconnected_inbound');
BEGIN
    IF sequence_number <> receiver.receive_sequence + 1
       AND NOT (mt.name = 'broker.error' AND sequence_number > receiver.receive_sequence) THEN
        PERFORM broker._raise('XX000', format('conversation %s expected message %s, got %s',
            receiver.conversation_id, receiver.receive_sequence + 1, sequence_number));
    END IF;
    IF mt.name = 'broker.end_dialog' THEN
        new_state := CASE receiver.state WHEN 'conversing' THEN 'disconnected_inbound'
                                         WHEN 'disconnected_outbound' THEN 'closed'
                                         ELSE receiver.state END;
    ELSIF mt.name = 'broker.error' THEN
        new_state := CASE WHEN receiver.state IN ('conversing', 'disconnected_inbound') THEN 'error'
                          WHEN receiver.state = 'disconnected_outbound' THEN 'closed'
                          ELSE receiver.state END;
    END IF;
    UPDATE broker.endpoints
    SET receive_sequence = sequence_number,
        state = new_state,
        closed_at = CASE WHEN new_state = 'closed' THEN coalesce(closed_at, now()) END,
        timer_at = CASE WHEN new_state = 'closed' THEN NULL ELSE timer_at END
    WHERE conversation_handle = receiver.conversation_handle;
    IF visible THEN
        PERFORM broker._enqueue(receiver, sequence_number, mt.message_type_id, body, traceparent);
    END IF;
END $$;

-- Puts a quarantined conversation's dead letters back into its queue, in
-- order, to be processed again (after a fix): only while its side is in
-- error, not yet ended by the application, whose replies it still refuses.
-- Returns how many came back.
CREATE OR REPLACE FUNCTION broker.resubmit_dead_letters(queue text, conversation_handle uuid) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    q broker.queues := broker._queue(queue);
    e broker.endpoints;
    resubmitted integer;
    first_position bigint;
BEGIN
    SELECT * INTO e FROM broker.endpoints
    WHERE endpoints.conversation_handle = broker._require('conversation_handle', resubmit_dead_letters.conversation_handle)
      AND endpoints.queue_id = q.queue_id;
    IF NOT FOUND THEN
        PERFORM broker._raise('BR005', format('unknown conversation %s in queue %L (an ended one is forgotten)',
            resubmit_dead_letters.conversation_handle, q.name));
    END IF;
    e := broker._lock_endpoint(e.conversation_handle);
    IF e.state <> 'error' THEN
        PERFORM broker._raise('BR020', format('conversation %s is %s: only one in error (quarantined, not yet ended) '
            'takes its dead letters back', e.conversation_handle, replace(e.state, '_', ' ')));
    END IF;
    SELECT count(*) INTO resubmitted FROM broker.dead_letters d
    WHERE d.queue_name = q.name AND d.conversation_handle = e.conversation_handle;
    IF resubmitted = 0 THEN
        RETURN 0;
    END IF;
    first_position := broker._next_queue_positions(resubmitted);
    WITH letters AS (
        DELETE FROM broker.dead_letters d
        WHERE d.queue_name = q.name AND d.conversation_handle = e.conversation_handle
        RETURNING d.*
    )
    INSERT INTO broker.queue_messages (queue_id, queue_position, conversation_group_id, conversation_handle,
                                       conversation_id, message_sequence_number, message_type_id, body, enqueued_at,
                                       priority, traceparent)
    SELECT q.queue_id, first_position + row_number() OVER (ORDER BY l.message_sequence_number, l.queue_position) - 1,
           e.conversation_group_id, e.conversation_handle, e.conversation_id, l.message_sequence_number,
           mt.message_type_id, l.body, l.enqueued_at, e.priority, l.traceparent
    FROM letters l JOIN broker.message_types mt ON mt.name = l.message_type;
    PERFORM pg_notify('broker_queue', q.queue_id::text);
    RETURN resubmitted;
END $$;
COMMENT ON FUNCTION broker.resubmit_dead_letters(text, uuid) IS
    'Puts a quarantined conversation''s dead letters back into its queue, in order; returns how many.';

-- One conversation of a batch, in a subtransaction of its own so that a bad
-- conversation never spoils the rest.  The result acknowledges the highest
-- number held without a gap, and says why anything was refused.  A
-- conversation forgotten here is acknowledged, not opened again.  A refusal
-- ends this side only when it is the sender's conversation:
-- broker.accept_transport_batch sets the others aside first, and one that
-- appears meanwhile is not the sender's to end either.
CREATE OR REPLACE FUNCTION broker._accept_conversation(from_instance uuid, header jsonb) RETURNS jsonb
LANGUAGE plpgsql AS $$
DECLARE
    conversation uuid;
    sender_is_initiator boolean;
    e broker.endpoints;
    known boolean;
    tombstone broker.forgotten_conversations;
    result jsonb;
    failed_sqlstate text;
    failure text;
BEGIN
    conversation := broker._require('conversation_id', (header ->> 'conversation_id')::uuid);
    sender_is_initiator := broker._require('sender_is_initiator', (header ->> 'sender_is_initiator')::boolean);
    result := jsonb_build_object('conversation_id', conversation, 'sender_is_initiator', sender_is_initiator);
    BEGIN
        SELECT * INTO e FROM broker.endpoints
        WHERE conversation_id = conversation AND is_initiator = NOT sender_is_initiator
        FOR UPDATE;
        known := FOUND;
        IF NOT known THEN
            SELECT * INTO tombstone FROM broker.forgotten_conversations f
            WHERE f.conversation_id = conversation AND f.is_initiator = NOT sender_is_initiator
              AND f.far_broker_instance = from_instance;
            IF FOUND THEN  -- closed and forgotten here: take nothing, and let the sender stop resending
                RETURN result || jsonb_build_object('acknowledged', greatest(tombstone.receive_sequence,
                    (SELECT max((m ->> 'sequence_number')::bigint)
                     FROM jsonb_array_elements(header -> 'messages') m)));
            END IF;
        END IF;
        IF NOT known AND sender_is_initiator THEN
            e := broker._create_target_endpoint(from_instance, header);
        ELSIF NOT known OR e.far_is_local OR e.far_broker_instance IS DISTINCT FROM from_instance THEN
            PERFORM broker._raise('BR005', format('unknown conversation %s', conversation));
        END IF;
        RETURN result || jsonb_build_object('acknowledged', broker._accept_messages(e, header -> 'messages'));
    EXCEPTION WHEN SQLSTATE 'BR030' THEN
        RETURN result || jsonb_build_object('acknowledged', coalesce(e.receive_sequence, 0), 'waiting', SQLERRM);
    WHEN OTHERS THEN
        failed_sqlstate := SQLSTATE;
        failure := SQLERRM;
        IF failed_sqlstate NOT LIKE 'BR%' AND failed_sqlstate NOT IN ('22P02', '22023', '22007', '22008') THEN
            RAISE;  -- not the conversation's fault: fail the batch, the sender retries
        END IF;
    END;
    -- Refused: end this side too, if it is the sender's, so both sides see broker.error.
    SELECT * INTO e FROM broker.endpoints
    WHERE conversation_id = conversation AND is_initiator = NOT sender_is_initiator
      AND NOT far_is_local AND far_broker_instance = from_instance;
    IF FOUND AND e.state IN ('conversing', 'disconnected_inbound', 'disconnected_outbound') THEN
        e := broker._lock_endpoint(e.conversation_handle);
        PERFORM broker._fail_conversation(e, -3, 'the conversation was refused: ' || failure);
    END IF;
    RETURN result || jsonb_build_object('acknowledged', coalesce(e.receive_sequence, 0),
                                        'refused', jsonb_build_object('sqlstate', failed_sqlstate, 'reason', failure));
END $$;

-- Locks the endpoints of the batch's conversations that can take it in bulk,
-- in the order of their conversation ids: one probe of the unique index each,
-- whatever the plan (a join here could be planned to rescan the batch once per
-- endpoint).
CREATE OR REPLACE FUNCTION broker._lock_batch_conversations(from_instance uuid) RETURNS broker._batch_conversation[]
LANGUAGE plpgsql AS $$
BEGIN
    RETURN (
    SELECT array_agg(ROW(e.conversation_handle, e.conversation_id, e.is_initiator, e.receive_sequence, e.queue_id,
                         e.conversation_group_id, e.contract_id, e.priority)::broker._batch_conversation)
    FROM (SELECT DISTINCT b.conversation_id, b.sender_is_initiator FROM pg_temp.incoming_transport_batch b
          ORDER BY b.conversation_id, b.sender_is_initiator) c,
         LATERAL (SELECT e.* FROM broker.endpoints e
                  WHERE e.conversation_id = c.conversation_id AND e.is_initiator = NOT c.sender_is_initiator
                    AND NOT e.far_is_local AND e.far_broker_instance = from_instance
                    AND e.state IN ('conversing', 'disconnected_inbound')
                    AND (SELECT q.is_enabled FROM broker.queues q WHERE q.queue_id = e.queue_id)
                  FOR UPDATE) e);
END $$;

-- Opens the batch's new conversations for services here that take their
-- contract, when all their messages are plain, and only from services that
-- this node routes to the sending node (see broker._create_target_endpoint,
-- which refuses the rest): the target endpoints, each in a new group, created
-- together.
CREATE OR REPLACE FUNCTION broker._open_batch_conversations(from_instance uuid, limit_bytes integer) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    WITH new_conversations AS (
        SELECT b.conversation_id, array_agg(DISTINCT b.message_type) AS message_types,
               max(coalesce(octet_length(b.body), 0)) AS largest_body
        FROM pg_temp.incoming_transport_batch b
        WHERE b.sender_is_initiator
        GROUP BY b.conversation_id
        HAVING NOT EXISTS (SELECT 1 FROM broker.endpoints e
                           WHERE e.conversation_id = b.conversation_id AND NOT e.is_initiator)
           AND NOT EXISTS (SELECT 1 FROM broker.forgotten_conversations f
                           WHERE f.conversation_id = b.conversation_id AND NOT f.is_initiator)
    ), headers AS (  -- each new conversation's header, from its lowest-numbered message
        SELECT DISTINCT ON (b.conversation_id) b.*
        FROM pg_temp.incoming_transport_batch b
        JOIN new_conversations n ON n.conversation_id = b.conversation_id
        WHERE b.sender_is_initiator
        ORDER BY b.conversation_id, b.sequence_number
    ), plain AS (
        SELECT p.contract_id, array_agg(p.name) AS message_types
        FROM broker._plain_message_types p WHERE p.sent_by_initiator GROUP BY p.contract_id
    ), opening AS (
        SELECT gen_random_uuid() AS conversation_group_id, h.conversation_id, s.service_id, s.queue_id,
               ct.contract_id, broker._check_name('service', h.from_service) AS far_service, h.expires_at,
               broker._priority(h.contract, h.to_service, h.from_service) AS priority
        FROM new_conversations n
        JOIN headers h ON h.conversation_id = n.conversation_id
        JOIN broker.routes r ON r.service_name = h.from_service AND r.broker_instance = from_instance
        JOIN broker.services s ON s.name = h.to_service
        JOIN broker.queues q ON q.queue_id = s.queue_id AND q.is_enabled
        JOIN broker.contracts ct ON ct.name = h.contract
        JOIN broker.service_contracts sc ON sc.service_id = s.service_id AND sc.contract_id = ct.contract_id
        JOIN plain ON plain.contract_id = ct.contract_id
        WHERE n.message_types <@ plain.message_types AND n.largest_body <= limit_bytes
    ), opened_groups AS (
        INSERT INTO broker.conversation_groups (conversation_group_id, queue_id)
        SELECT conversation_group_id, queue_id FROM opening
    )
    INSERT INTO broker.endpoints (conversation_handle, conversation_id, is_initiator, conversation_group_id,
                                  service_id, queue_id, far_service, far_is_local, far_broker_instance,
                                  contract_id, expires_at, priority)
    SELECT gen_random_uuid(), o.conversation_id, false, o.conversation_group_id, o.service_id, o.queue_id,
           o.far_service, false, from_instance, o.contract_id, o.expires_at, o.priority
    FROM opening o;
END $$;

-- The steady state of a batch in a few statements: the batch's conversations
-- that are new here, or whose endpoint talks with the sending node, reads, and
-- has its queue enabled, when every message that comes next is plain.  The
-- batch is in pg_temp.incoming_transport_batch.  Returns their results; the
-- caller takes the others (refused, carrying system messages, ...) one by one.
-- Conversations with a broker.error among their new messages are left to the
-- careful way, which accepts an error across the numbers its sender dropped
-- (see broker._accept_messages).
CREATE OR REPLACE FUNCTION broker._accept_in_bulk(from_instance uuid) RETURNS jsonb
LANGUAGE plpgsql AS $$
DECLARE
    limit_bytes integer := (SELECT max_message_bytes FROM broker.node);
    taken broker._batch_conversation[];
    results jsonb;
    queues integer[];
    with_error uuid[];
BEGIN
    taken := broker._lock_batch_conversations(from_instance);
    IF EXISTS (SELECT b.conversation_id FROM pg_temp.incoming_transport_batch b WHERE b.sender_is_initiator
               EXCEPT SELECT t.conversation_id FROM unnest(taken) t) THEN
        PERFORM broker._open_batch_conversations(from_instance, limit_bytes);
        taken := broker._lock_batch_conversations(from_instance);
    END IF;
    IF taken IS NULL THEN
        RETURN '[]';
    END IF;
    -- Conversations with a broker.error among their new messages go the careful
    -- way, even when the error lies beyond a gap: it may skip the numbers its
    -- sender dropped (see broker._transmit_error).
    SELECT coalesce(array_agg(DISTINCT t.conversation_handle), '{}') INTO with_error
    FROM unnest(taken) t
    JOIN pg_temp.incoming_transport_batch b
      ON b.conversation_id = t.conversation_id AND b.sender_is_initiator = NOT t.is_initiator
    WHERE b.sequence_number > t.receive_sequence AND b.message_type = 'broker.error';

    -- Each conversation's run of numbers after receive_sequence without a gap;
    -- a conversation is taken here only when all of its run is plain.
    WITH fresh AS (
        SELECT DISTINCT ON (t.conversation_handle, b.sequence_number)
               t.*, b.sequence_number, b.message_type, b.body, b.traceparent
        FROM unnest(taken) t
        JOIN pg_temp.incoming_transport_batch b
          ON b.conversation_id = t.conversation_id AND b.sender_is_initiator = NOT t.is_initiator
        WHERE b.sequence_number > t.receive_sequence
        ORDER BY t.conversation_handle, b.sequence_number
    ), next_run AS (
        SELECT f.*, row_number() OVER (PARTITION BY f.conversation_handle ORDER BY f.sequence_number) AS k
        FROM fresh f
    ), judged AS (
        SELECT r.*, p.message_type_id,
               bool_and(p.name IS NOT NULL AND coalesce(octet_length(r.body), 0) <= limit_bytes)
                   OVER (PARTITION BY r.conversation_handle) AS plain
        FROM next_run r
        LEFT JOIN broker._plain_message_types p
               ON p.contract_id = r.contract_id AND p.sent_by_initiator = NOT r.is_initiator
              AND p.name = r.message_type
        WHERE r.sequence_number = r.receive_sequence + r.k
    ), accepted AS (
        SELECT j.*, row_number() OVER (ORDER BY j.conversation_handle, j.sequence_number) AS place
        FROM judged j WHERE j.plain AND j.conversation_handle <> ALL (with_error)
    ), stored AS (
        INSERT INTO broker.queue_messages (queue_id, queue_position, conversation_group_id, conversation_handle,
                                           conversation_id, message_sequence_number, message_type_id, body, priority,
                                           traceparent)
        SELECT a.queue_id, (SELECT broker._next_queue_positions(count(*)::integer) FROM accepted) + a.place - 1,
               a.conversation_group_id, a.conversation_handle, a.conversation_id, a.sequence_number,
               a.message_type_id, a.body, a.priority, a.traceparent
        FROM accepted a
        RETURNING queue_id
    ), moved_on AS (
        UPDATE broker.endpoints e SET receive_sequence = last.sequence_number
        FROM (SELECT a.conversation_handle, max(a.sequence_number) AS sequence_number
              FROM accepted a GROUP BY a.conversation_handle) last
        WHERE e.conversation_handle = last.conversation_handle
        RETURNING e.conversation_handle, e.receive_sequence
    )
    SELECT coalesce(jsonb_agg(jsonb_build_object(
               'conversation_id', t.conversation_id, 'sender_is_initiator', NOT t.is_initiator,
               'acknowledged', coalesce(m.receive_sequence, t.receive_sequence))), '[]'),
           (SELECT array_agg(DISTINCT queue_id) FROM stored)
    INTO results, queues
    FROM unnest(taken) t
    LEFT JOIN moved_on m ON m.conversation_handle = t.conversation_handle
    WHERE NOT EXISTS (SELECT 1 FROM judged j WHERE j.conversation_handle = t.conversation_handle AND NOT j.plain)
      AND t.conversation_handle <> ALL (with_error);
    PERFORM pg_notify('broker_queue', q::text) FROM unnest(queues) q;
    RETURN results;
END $$;

-- The batch is in pg_temp.incoming_transport_batch (rows of
-- broker.transport_message, filled by COPY in this transaction): the steady
-- state in bulk, the rest one conversation at a time, each in a subtransaction
-- of its own so that a bad conversation never spoils the rest.  Anything the
-- bulk path trips over sends the whole batch the careful way.
--
-- The conversations that are not the sender's are set aside first: those known
-- here (by an endpoint, or by the tombstone of a forgotten one) other than as
-- this node's side of a conversation with the sending node.  That is another
-- peer's conversation, a local one, or the side this node holds itself.  Each
-- is refused exactly as a conversation that does not exist is, so the sender
-- learns nothing of it, and its rows leave the batch before anything else reads
-- it: nothing of it changes.
CREATE OR REPLACE FUNCTION broker.accept_transport_batch(from_instance uuid) RETURNS jsonb
LANGUAGE plpgsql AS $$
DECLARE
    not_the_senders jsonb;
    in_bulk jsonb;
    one_by_one jsonb;
BEGIN
    -- Each trace of the batch checked once: a malformed traceparent refuses the
    -- whole batch (SQLSTATE 23514), before anything is stored.
    PERFORM given::broker.traceparent
    FROM (SELECT DISTINCT b.traceparent AS given FROM pg_temp.incoming_transport_batch b) traces;
    WITH batch_conversations AS (
        SELECT DISTINCT b.conversation_id, b.sender_is_initiator FROM pg_temp.incoming_transport_batch b
    ), foreign_conversations AS (
        SELECT c.* FROM batch_conversations c
        WHERE EXISTS (SELECT 1 FROM broker.endpoints e
                      WHERE e.conversation_id = c.conversation_id
                        AND (e.is_initiator = c.sender_is_initiator OR e.far_is_local
                             OR e.far_broker_instance IS DISTINCT FROM from_instance))
           OR EXISTS (SELECT 1 FROM broker.forgotten_conversations f
                      WHERE f.conversation_id = c.conversation_id
                        AND (f.is_initiator = c.sender_is_initiator OR f.far_broker_instance <> from_instance))
    ), set_aside AS (
        DELETE FROM pg_temp.incoming_transport_batch b USING foreign_conversations f
        WHERE b.conversation_id = f.conversation_id AND b.sender_is_initiator = f.sender_is_initiator
    )
    SELECT coalesce(jsonb_agg(jsonb_build_object(
               'conversation_id', f.conversation_id, 'sender_is_initiator', f.sender_is_initiator, 'acknowledged', 0,
               'refused', jsonb_build_object('sqlstate', 'BR005',
                                             'reason', format('unknown conversation %s', f.conversation_id)))), '[]')
    INTO not_the_senders
    FROM foreign_conversations f;

    BEGIN
        in_bulk := broker._accept_in_bulk(from_instance);
    EXCEPTION WHEN OTHERS THEN
        in_bulk := '[]';
    END;
    WITH taken_in_bulk AS (
        SELECT * FROM jsonb_to_recordset(in_bulk) AS r(conversation_id uuid, sender_is_initiator boolean)
    ), left_over AS (
        SELECT b.conversation_id, b.sender_is_initiator,
               (array_agg(jsonb_build_object('conversation_id', b.conversation_id,
                                             'sender_is_initiator', b.sender_is_initiator,
                                             'from_service', b.from_service, 'to_service', b.to_service,
                                             'contract', b.contract, 'expires_at', b.expires_at)
                          ORDER BY b.sequence_number))[1] AS header,
               jsonb_agg(jsonb_build_object('sequence_number', b.sequence_number, 'message_type', b.message_type,
                                            'body', encode(b.body, 'base64'), 'traceparent', b.traceparent)
                         ORDER BY b.sequence_number) AS messages
        FROM pg_temp.incoming_transport_batch b
        WHERE NOT EXISTS (SELECT 1 FROM taken_in_bulk t
                          WHERE t.conversation_id = b.conversation_id AND t.sender_is_initiator = b.sender_is_initiator)
        GROUP BY b.conversation_id, b.sender_is_initiator
    )
    SELECT coalesce(jsonb_agg(broker._accept_conversation(from_instance,
                                                          l.header || jsonb_build_object('messages', l.messages))),
                    '[]')
    INTO one_by_one
    FROM left_over l;
    RETURN jsonb_build_object('broker_instance', (SELECT broker_instance FROM broker.node),
                              'results', not_the_senders || in_bulk || one_by_one);
END $$;
COMMENT ON FUNCTION broker.accept_transport_batch(uuid) IS
    'Stores what comes next of each conversation of the batch in pg_temp.incoming_transport_batch; returns the acknowledgements.';

-- The next batch for a destination, as rows of broker.transport_message for
-- COPY, for the conversations whose handles fall in [first_handle,
-- last_handle]: a relay splits the conversations among lanes that send at
-- once.  The waiting messages are read service by service and priority by
-- priority in the order of the primary key, up to max_messages each, and the
-- first max_messages of those, the highest priority first, are taken, rather
-- than all of them sorted: a long
-- queue costs a batch no more than a short one, and messages waiting for
-- other destinations (a peer down for days) are not read at all, nor those
-- whose conversations wait for a retry after a failure.  The
-- batch is cut where its bodies and headers reach max_bytes.  The first
-- message always goes, whatever its size, so that a message at the size limit
-- still travels alone.  A message's share is its body and the texts that
-- travel with it (its traceparent among them), plus 80 bytes for the
-- fixed-size fields and lengths of its row in the binary COPY format.
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
           sized.expires_at, sized.sequence_number, sized.message_type, sized.body, sized.traceparent
    FROM (SELECT e.conversation_id, e.is_initiator, s.name AS from_service, e.far_service AS to_service,
                 c.name AS contract, e.expires_at, due.message_sequence_number AS sequence_number,
                 mt.name AS message_type, due.body, due.traceparent,
                 sum(80 + coalesce(octet_length(due.body), 0) + octet_length(s.name) + octet_length(e.far_service)
                     + octet_length(c.name) + octet_length(mt.name) + coalesce(octet_length(due.traceparent), 0))
                     OVER (ORDER BY due.priority DESC, due.conversation_handle, due.message_sequence_number)
                     AS bytes_so_far,
                 row_number() OVER (ORDER BY due.priority DESC, due.conversation_handle, due.message_sequence_number)
                     AS place
          FROM (SELECT t.* FROM broker.routes r, generate_series(10, 1, -1) AS p(priority),
                     LATERAL (SELECT t.* FROM broker.transmission_queue t
                              WHERE t.to_service = r.service_name AND t.priority = p.priority
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
                ORDER BY t.priority DESC, t.conversation_handle, t.message_sequence_number
                LIMIT max_messages) due
          JOIN broker.endpoints e ON e.conversation_handle = due.conversation_handle AND NOT e.far_is_local
          JOIN broker.services s ON s.service_id = e.service_id
          JOIN broker.contracts c ON c.contract_id = e.contract_id
          JOIN broker.message_types mt ON mt.message_type_id = due.message_type_id) sized
    WHERE sized.place = 1 OR sized.bytes_so_far <= max_bytes
    ORDER BY sized.place;
END $$;
COMMENT ON FUNCTION broker.transport_batch(text, integer, bigint, uuid, uuid) IS
    'The next batch for a destination: the lowest waiting numbers of its conversations between the handles, up to a count and a size.';

-- Applies a destination node's answer in one transaction: deletes what it
-- acknowledged, ends what it refused.  Returns how many messages were
-- delivered.  Every acknowledgement is applied by one DELETE and one UPDATE;
-- refusals and hold-backs are rare and handled one by one.  The transaction
-- that applies an answer commits without waiting for its WAL to reach the
-- disk: if a crash loses it, the messages it deleted are sent again and the far
-- node acknowledges them as duplicates (guarantee 3), so the relay need not
-- wait for a flush in every cycle.
--
-- The answer is held to the batch it answers: the relay puts the batch it sent
-- into pg_temp.sent_transport_batch (rows of broker.transport_message, by COPY
-- in this transaction), and only the results for that batch's conversations
-- apply, each acknowledging at most the highest number the batch carried of its
-- conversation.  So no answer, however it is signed, acknowledges, refuses or
-- holds back a message it was not sent.  A result without a number
-- acknowledges nothing.
CREATE OR REPLACE FUNCTION broker.apply_transport_results(answer jsonb) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    handles uuid[];
    services text[];
    priorities smallint[];
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
    SELECT array_agg(e.conversation_handle), array_agg(e.far_service), array_agg(e.priority),
           array_agg(least(coalesce(r.acknowledged, 0), s.last_sent)),
           array_agg(CASE WHEN r.refused IS NOT NULL
                          THEN coalesce(r.refused ->> 'reason', 'no reason given') END),
           array_agg(r.waiting)
    INTO handles, services, priorities, acknowledged, refusals, holds
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
        FROM unnest(handles, services, priorities, acknowledged)
                 AS a(conversation_handle, to_service, priority, acknowledged),
             LATERAL (SELECT t.ctid FROM broker.transmission_queue t
                      WHERE t.to_service = a.to_service AND t.priority = a.priority
                        AND t.conversation_handle = a.conversation_handle
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
        SELECT * FROM unnest(handles, services, priorities, refusals, holds)
                 AS a(conversation_handle, to_service, priority, refused, waiting)
        WHERE a.refused IS NOT NULL OR a.waiting IS NOT NULL
    LOOP
        IF result.refused IS NOT NULL THEN
            PERFORM broker._refused_by_far_side(broker._lock_endpoint(result.conversation_handle), result.refused);
        ELSE
            UPDATE broker.transmission_queue
            SET transmission_status = 'the far node holds it back: ' || result.waiting,
                attempts = attempts + 1, next_attempt_at = now() + interval '5 seconds'
            WHERE to_service = result.to_service AND priority = result.priority
              AND conversation_handle = result.conversation_handle;
        END IF;
    END LOOP;
    RETURN delivered;
END $$;

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

DROP FUNCTION broker.withhold_what_peers_forgot(interval);
DROP FUNCTION broker.forget_acknowledged_messages(integer);
DROP FUNCTION broker._number_past(uuid, bigint, bigint);
DROP FUNCTION broker._send_again(uuid, bigint, bigint);
DROP FUNCTION broker._record_lost_messages(broker.endpoints, text, bigint, bigint, text);
DROP TABLE broker.peer_retention;
DROP TABLE broker.lost_messages;
DROP TABLE broker.acknowledged_messages;
DROP TABLE broker.transmission_progress;
DELETE FROM broker.message_types WHERE name = 'broker.renumbered';
SELECT setval('broker.message_types_message_type_id_seq', max(message_type_id)) FROM broker.message_types;
ALTER TABLE broker.node DROP COLUMN resend_window;
