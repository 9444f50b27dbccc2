-- Between nodes, the receiving side: a transport batch accepted, its
-- conversations opened or continued, and its answer.
--
-- A conversation belongs to the peer it was opened with, and answers apply
-- only to the batch they answer.  A peer is any node with a route here and a
-- secret of its own.  Whatever it signs, it can touch only its own
-- conversations: those whose endpoint here has it as far_broker_instance (a
-- local conversation belongs to no peer).  It opens conversations only from
-- services that this node routes to it, and its answers apply only to the
-- batch it was sent.

------------------------------------------------------------------------------
-- Receiving side
------------------------------------------------------------------------------

-- The target endpoint of a conversation whose first message arrives from
-- another node.  Raises BR001/BR003/BR011 when the conversation is refused.  A
-- conversation is opened only from a service that this node routes to the
-- sending node: that node is where its replies go.  Checked first, so that a
-- node with no business here learns nothing of the services and contracts it
-- names.
CREATE OR REPLACE FUNCTION broker._create_target_endpoint(from_instance uuid, header jsonb) RETURNS broker.endpoints
LANGUAGE plpgsql AS $$
DECLARE
    target_service broker.services;
    dialog_contract integer;
    group_id uuid := gen_random_uuid();
    e broker.endpoints;
BEGIN
    IF NOT EXISTS (SELECT 1 FROM broker.routes r
                   WHERE r.service_name = header ->> 'from_service' AND r.broker_instance = from_instance) THEN
        PERFORM broker._raise('BR006', format(
            'no route here for service %s to broker instance %s, the node it comes from',
            left(quote_nullable(header ->> 'from_service'), 140), from_instance));
    END IF;
    target_service := broker._service(header ->> 'to_service');
    dialog_contract := broker._contract_id(header ->> 'contract');
    IF NOT EXISTS (SELECT 1 FROM broker.service_contracts sc
                   WHERE sc.service_id = target_service.service_id AND sc.contract_id = dialog_contract) THEN
        PERFORM broker._raise('BR011', format('service %L does not accept contract %L',
            target_service.name, header ->> 'contract'));
    END IF;
    INSERT INTO broker.conversation_groups VALUES (group_id, target_service.queue_id);
    INSERT INTO broker.endpoints (conversation_handle, conversation_id, is_initiator, conversation_group_id,
                                  service_id, queue_id, far_service, far_is_local, far_broker_instance,
                                  contract_id, expires_at, priority)
    VALUES (gen_random_uuid(), (header ->> 'conversation_id')::uuid, false, group_id, target_service.service_id,
            target_service.queue_id, broker._check_name('service', header ->> 'from_service'), false,
            from_instance, dialog_contract,
            broker._settable_time('the end of its lifetime', (header ->> 'expires_at')::timestamptz),
            broker._priority(header ->> 'contract', target_service.name, header ->> 'from_service'))
    RETURNING * INTO e;
    RETURN e;
END $$;
GRANT EXECUTE ON FUNCTION broker._create_target_endpoint(uuid,jsonb) TO broker_relay;

-- The far node refused a conversation: it ends here with a broker.error
-- notice; nothing more is sent.  A far node that began the conversation and
-- sent messages on it, and now knows no such conversation (BR005, "unknown
-- conversation ..."), went back to an earlier point, before it began: the
-- notice is -4, and what this side sent it is recorded as lost
-- (broker.lost_messages).
CREATE OR REPLACE FUNCTION broker._refused_by_far_side(e broker.endpoints, reason text) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    forgot_it boolean := NOT e.is_initiator AND e.receive_sequence > 0 AND reason LIKE 'unknown conversation %';
BEGIN
    PERFORM broker._take_waiting(e.conversation_handle);
    IF e.state IN ('conversing', 'disconnected_inbound', 'disconnected_outbound') THEN
        UPDATE broker.endpoints SET state = 'error', timer_at = NULL WHERE conversation_handle = e.conversation_handle;
        PERFORM broker._enqueue(e, 0, (broker._message_type('broker.error')).message_type_id, CASE
            WHEN forgot_it THEN broker._error_body(-4, format(
                'the far node began this conversation and sent %s messages on it, and now knows no such '
                'conversation: its database went back to before it began; messages 1 to %s of this side are lost',
                e.receive_sequence, e.send_sequence))
            ELSE broker._error_body(-3, 'the far node refused the conversation: ' || reason) END);
        IF forgot_it THEN
            PERFORM broker._record_lost_messages(e, 'sent', 1, e.send_sequence, 'lost');
        END IF;
    END IF;
END $$;
GRANT EXECUTE ON FUNCTION broker._refused_by_far_side(broker.endpoints,text) TO broker_relay;

-- Stores the messages of one conversation that come next (invariant 3):
-- duplicates are skipped, a gap stops the conversation's batch, and a
-- broker.error that follows the run across a gap is accepted with it (see the
-- comment inside).  The messages that come next are stored by one INSERT and
-- the endpoint moves on by one UPDATE, when they are all application messages
-- for an endpoint whose application still reads; system messages (which change
-- the endpoint's state) are delivered one by one.
CREATE OR REPLACE FUNCTION broker._accept_messages(e broker.endpoints, messages jsonb) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    message jsonb;
    sequence_number bigint;
    mt broker.message_types;
    body bytea;
    next_messages jsonb;
    stored integer;
    first_position bigint;
BEGIN
    IF NOT (SELECT is_enabled FROM broker.queues WHERE queue_id = e.queue_id) THEN
        PERFORM broker._raise('BR030', 'the target queue is disabled');
    END IF;
    -- The run of numbers that follows receive_sequence without a gap, in order,
    -- and a broker.error right after it even across a gap: a side that ends a
    -- conversation with an error (or whose lifetime expires) drops what it had
    -- not transmitted yet, and its error keeps the next number it would have
    -- sent.  The error is the last message of its direction, so nothing can
    -- come into the numbers it skips.
    WITH numbered AS (
        SELECT m, n, row_number() OVER (ORDER BY n) AS k
        FROM (SELECT DISTINCT ON (n) m, n
              FROM jsonb_array_elements(messages) WITH ORDINALITY AS given(m, place),
                   CAST(m ->> 'sequence_number' AS bigint) n
              WHERE n > e.receive_sequence
              ORDER BY n, place) once_each  -- of a number repeated, the first in the batch
    ), run AS (
        SELECT * FROM numbered WHERE n = e.receive_sequence + k
    )
    SELECT coalesce(jsonb_agg(m ORDER BY n), '[]') INTO next_messages
    FROM numbered
    WHERE n = e.receive_sequence + k
       OR (k = (SELECT count(*) FROM run) + 1 AND m ->> 'message_type' = 'broker.error');

    IF e.state IN ('conversing', 'disconnected_inbound')
       AND NOT jsonb_path_exists(next_messages, '$[*] ? (@.message_type starts with "broker.")') THEN
        FOR message IN
            SELECT m FROM jsonb_array_elements(next_messages) m
            WHERE NOT EXISTS (SELECT 1 FROM broker.message_types t
                              JOIN broker.contract_message_types cmt
                                ON cmt.message_type_id = t.message_type_id AND cmt.contract_id = e.contract_id
                               AND cmt.sent_by IN ('any', CASE WHEN e.is_initiator THEN 'target' ELSE 'initiator' END)
                              WHERE t.name = m ->> 'message_type' AND t.validation = 'none'
                                AND octet_length(decode(m ->> 'body', 'base64'))
                                    <= (SELECT max_message_bytes FROM broker.node))
        LOOP  -- raises for the first message that does not pass (it would be refused)
            PERFORM broker._check_message(e.contract_id, NOT e.is_initiator,
                                          broker._message_type(message ->> 'message_type'),
                                          decode(message ->> 'body', 'base64'));
        END LOOP;
        stored := jsonb_array_length(next_messages);
        IF stored = 0 THEN
            RETURN e.receive_sequence;
        END IF;
        first_position := broker._next_queue_positions(stored);
        INSERT INTO broker.queue_messages (queue_id, queue_position, conversation_group_id, conversation_handle,
                                           conversation_id, message_sequence_number, message_type_id, body, priority,
                                           traceparent)
        SELECT e.queue_id, first_position + m.k - 1, e.conversation_group_id, e.conversation_handle,
               e.conversation_id, (m.value ->> 'sequence_number')::bigint, t.message_type_id,
               decode(m.value ->> 'body', 'base64'), e.priority, m.value ->> 'traceparent'
        FROM jsonb_array_elements(next_messages) WITH ORDINALITY AS m(value, k)
        JOIN broker.message_types t ON t.name = m.value ->> 'message_type';
        UPDATE broker.endpoints SET receive_sequence = e.receive_sequence + stored
        WHERE conversation_handle = e.conversation_handle;
        PERFORM pg_notify('broker_queue', e.queue_id::text);
        RETURN e.receive_sequence + stored;
    END IF;

    FOR message IN SELECT value FROM jsonb_array_elements(next_messages) LOOP
        sequence_number := (message ->> 'sequence_number')::bigint;
        mt := broker._message_type(message ->> 'message_type');
        body := decode(message ->> 'body', 'base64');
        IF mt.name NOT LIKE 'broker.%' THEN
            PERFORM broker._check_message(e.contract_id, NOT e.is_initiator, mt, body);
        END IF;
        PERFORM broker._deliver(e, sequence_number, mt, body, message ->> 'traceparent');
        SELECT * INTO e FROM broker.endpoints WHERE conversation_handle = e.conversation_handle;
    END LOOP;
    RETURN e.receive_sequence;
END $$;
GRANT EXECUTE ON FUNCTION broker._accept_messages(broker.endpoints,jsonb) TO broker_relay;

-- A side that ended here (closed, or closed and forgotten) took the numbers up
-- to ended_after; a sender that sends past them sent after its own end of the
-- conversation, which it no longer knows of (its database went back to before
-- it), and is refused (BR020) so that its side ends too, rather than having them
-- acknowledged into nothing.  A broker.error is taken: that side ends anyway.
CREATE OR REPLACE FUNCTION broker._refuse_past_the_end(ended_after bigint, last_sent bigint, ends_it boolean)
RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    IF last_sent > ended_after AND NOT ends_it THEN
        PERFORM broker._raise('BR020', format(
            'the conversation ended on the receiving node after message %s; later messages are not taken (did the '
            'sending node''s database go back to before it ended?)', ended_after));
    END IF;
END $$;
GRANT EXECUTE ON FUNCTION broker._refuse_past_the_end(bigint, bigint, boolean) TO broker_relay;

-- Whether a batch's messages of a conversation side (JSON, as
-- broker._accept_conversation takes them) may be taken past what the side
-- holds: the batch begins right after it, or carries the number it holds last
-- with the id of the message it holds under that number.  Otherwise the
-- sender and this node may not agree on what this side holds (the sender's
-- database went back, and it numbered new messages as ones held here), or
-- this node cannot tell: nothing past it is taken, and the answer says what
-- it holds, so that the sender, which can tell, numbers its messages past it
-- before any of them is delivered.
CREATE OR REPLACE FUNCTION broker._anchored(e broker.endpoints, messages jsonb) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT min(n) = e.receive_sequence + 1 OR coalesce(bool_or(n = e.receive_sequence AND id = e.received_message_id), false)
    FROM jsonb_array_elements(messages) m,
         LATERAL (SELECT (m ->> 'sequence_number')::bigint AS n, (m ->> 'message_id')::uuid AS id) row_of;
$$;
GRANT EXECUTE ON FUNCTION broker._anchored(broker.endpoints,jsonb) TO broker_relay;

-- One conversation of a batch, in a subtransaction of its own so that a bad
-- conversation never spoils the rest.  The result acknowledges the highest
-- number held without a gap, says which number was held before the batch and
-- the id of the message held under it, and why anything was refused or waits.
-- A conversation forgotten here is acknowledged, not opened again.  A refusal
-- ends this side only when it is the sender's conversation:
-- broker.accept_batch sets the others aside first, and one that appears
-- meanwhile is not the sender's to end either.
--
-- Messages that begin past a gap are not taken: the numbers before them are
-- missing here (this database went back to an earlier point), so they are
-- recorded in broker.lost_messages and the sender is told to wait, and to send
-- them again.  So a conversation unknown here is opened only from its first
-- number, or by a broker.error that ends it across the numbers its sender
-- dropped.  A conversation that an application transaction holds is not waited
-- for: the answer says it waits.  Nothing is taken past what this side holds
-- unless the batch is anchored to it (broker._anchored).
CREATE OR REPLACE FUNCTION broker._accept_conversation(from_instance uuid, header jsonb) RETURNS jsonb
LANGUAGE plpgsql AS $$
DECLARE
    conversation uuid;
    sender_is_initiator boolean;
    e broker.endpoints;
    known boolean;
    tombstone broker.forgotten_conversations;
    first_sent bigint := (SELECT min((m ->> 'sequence_number')::bigint) FROM jsonb_array_elements(header -> 'messages') m);
    last_sent bigint := (SELECT max((m ->> 'sequence_number')::bigint) FROM jsonb_array_elements(header -> 'messages') m);
    ends_it boolean := jsonb_path_exists(header -> 'messages', '$[*] ? (@.message_type == "broker.error")');
    held bigint;
    acknowledged bigint;
    result jsonb;
    held_here jsonb;
    failed_sqlstate text;
    failure text;
BEGIN
    conversation := broker._require('conversation_id', (header ->> 'conversation_id')::uuid);
    sender_is_initiator := broker._require('sender_is_initiator', (header ->> 'sender_is_initiator')::boolean);
    result := jsonb_build_object('conversation_id', conversation, 'sender_is_initiator', sender_is_initiator);
    BEGIN
        SELECT * INTO e FROM broker.endpoints
        WHERE conversation_id = conversation AND is_initiator = NOT sender_is_initiator
        FOR UPDATE NOWAIT;
        known := FOUND;
        IF NOT known THEN
            SELECT * INTO tombstone FROM broker.forgotten_conversations f
            WHERE f.conversation_id = conversation AND f.is_initiator = NOT sender_is_initiator
              AND f.far_broker_instance = from_instance;
            IF FOUND THEN  -- closed and forgotten here: take nothing, and let the sender stop resending
                PERFORM broker._refuse_past_the_end(tombstone.receive_sequence, last_sent, ends_it);
                RETURN result || jsonb_build_object('acknowledged', greatest(tombstone.receive_sequence, last_sent),
                                                    'held', tombstone.receive_sequence);
            END IF;
        END IF;
        IF NOT known AND sender_is_initiator AND first_sent > 1 AND NOT ends_it
           AND EXISTS (SELECT 1 FROM broker.routes r
                       WHERE r.service_name = header ->> 'from_service' AND r.broker_instance = from_instance) THEN
            e.conversation_id := conversation;
            e.is_initiator := false;
            e.far_broker_instance := from_instance;
            e.receive_sequence := 0;
        ELSIF NOT known AND sender_is_initiator THEN
            e := broker._create_target_endpoint(from_instance, header);
        ELSIF NOT known OR e.far_is_local OR e.far_broker_instance IS DISTINCT FROM from_instance THEN
            PERFORM broker._raise('BR005', format('unknown conversation %s', conversation));
        END IF;
        held := e.receive_sequence;
        held_here := result || jsonb_strip_nulls(jsonb_build_object('held', held,
                                                                    'held_message_id', e.received_message_id));
        IF e.state = 'closed' THEN
            PERFORM broker._refuse_past_the_end(held, last_sent, ends_it);
        END IF;
        IF first_sent <= held AND NOT broker._anchored(e, header -> 'messages') THEN
            RETURN held_here || jsonb_build_object('acknowledged', held);
        END IF;
        IF first_sent > held + 1 AND NOT ends_it THEN
            PERFORM broker._record_lost_messages(e, 'received', held + 1, first_sent - 1, 'missing');
            RETURN held_here || jsonb_build_object('acknowledged', held, 'waiting', format(
                'messages %s to %s of the conversation are missing here (its database went back to an earlier '
                'point?): send them again', held + 1, first_sent - 1));
        END IF;
        acknowledged := broker._accept_messages(e, header -> 'messages');
        IF acknowledged > held THEN
            UPDATE broker.endpoints
            SET received_message_id = (SELECT (m ->> 'message_id')::uuid FROM jsonb_array_elements(header -> 'messages') m
                                       WHERE (m ->> 'sequence_number')::bigint = acknowledged LIMIT 1)
            WHERE endpoints.conversation_id = conversation AND is_initiator = NOT sender_is_initiator;
        END IF;
        UPDATE broker.lost_messages l
        SET outcome = CASE WHEN ends_it THEN 'lost' ELSE 'resent' END
        WHERE l.conversation_id = conversation AND l.is_initiator = NOT sender_is_initiator
          AND l.direction = 'received' AND l.outcome = 'missing' AND l.last_number <= acknowledged;
        RETURN held_here || jsonb_build_object('acknowledged', acknowledged);
    EXCEPTION WHEN SQLSTATE 'BR030' THEN
        RETURN result || broker._held_here(conversation, sender_is_initiator) || jsonb_build_object('waiting', SQLERRM);
    WHEN lock_not_available THEN
        RETURN result || broker._held_here(conversation, sender_is_initiator)
               || jsonb_build_object('waiting', 'an application transaction holds the conversation here');
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
    held := coalesce(e.receive_sequence, tombstone.receive_sequence, 0);
    RETURN result || jsonb_strip_nulls(jsonb_build_object(
        'acknowledged', held, 'held', held, 'held_message_id', e.received_message_id,
        'refused', jsonb_build_object('sqlstate', failed_sqlstate, 'reason', failure)));
END $$;
GRANT EXECUTE ON FUNCTION broker._accept_conversation(uuid,jsonb) TO broker_relay;

-- What this node holds of the sender's side of a conversation, read without
-- taking its lock (an application transaction may hold it, or its queue is
-- disabled): the answer's acknowledged and held, and held_message_id.
CREATE OR REPLACE FUNCTION broker._held_here(conversation uuid, sender_is_initiator boolean) RETURNS jsonb
LANGUAGE sql STABLE AS $$
    SELECT jsonb_strip_nulls(jsonb_build_object('acknowledged', coalesce(e.receive_sequence, 0),
                                                'held', coalesce(e.receive_sequence, 0),
                                                'held_message_id', e.received_message_id))
    FROM (SELECT NULL) nothing
    LEFT JOIN broker.endpoints e ON e.conversation_id = conversation AND e.is_initiator = NOT sender_is_initiator;
$$;
GRANT EXECUTE ON FUNCTION broker._held_here(uuid,boolean) TO broker_relay;

-- Locks the endpoints of the batch's conversations that can take it in bulk,
-- in the order of their conversation ids: one probe of the unique index each,
-- whatever the plan (a join here could be planned to rescan the batch once per
-- endpoint).  One that an application transaction holds is passed over, not
-- waited for: the node's own work never takes part in a deadlock with an
-- application (broker._accept_conversation answers that it waits).
CREATE OR REPLACE FUNCTION broker._lock_batch_conversations(from_instance uuid) RETURNS broker._batch_conversation[]
LANGUAGE plpgsql AS $$
BEGIN
    RETURN (
    SELECT array_agg(ROW(e.conversation_handle, e.conversation_id, e.is_initiator, e.receive_sequence, e.queue_id,
                         e.conversation_group_id, e.contract_id, e.priority,
                         e.received_message_id)::broker._batch_conversation)
    FROM (SELECT DISTINCT b.conversation_id, b.sender_is_initiator FROM pg_temp.incoming_batch b
          ORDER BY b.conversation_id, b.sender_is_initiator) c,
         LATERAL (SELECT e.* FROM broker.endpoints e
                  WHERE e.conversation_id = c.conversation_id AND e.is_initiator = NOT c.sender_is_initiator
                    AND NOT e.far_is_local AND e.far_broker_instance = from_instance
                    AND e.state IN ('conversing', 'disconnected_inbound')
                    AND (SELECT q.is_enabled FROM broker.queues q WHERE q.queue_id = e.queue_id)
                  FOR UPDATE SKIP LOCKED) e);
END $$;
GRANT EXECUTE ON FUNCTION broker._lock_batch_conversations(uuid) TO broker_relay;

-- Opens the batch's new conversations for services here that take their
-- contract, when all their messages are plain and the first is number 1, and
-- only from services that this node routes to the sending node (see
-- broker._create_target_endpoint, which refuses the rest): the target
-- endpoints, each in a new group, created together.
CREATE OR REPLACE FUNCTION broker._open_batch_conversations(from_instance uuid, limit_bytes integer) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    WITH new_conversations AS (
        SELECT b.conversation_id, array_agg(DISTINCT b.message_type) AS message_types,
               max(coalesce(octet_length(b.body), 0)) AS largest_body
        FROM pg_temp.incoming_batch b
        WHERE b.sender_is_initiator
        GROUP BY b.conversation_id
        HAVING min(b.sequence_number) = 1
           AND NOT EXISTS (SELECT 1 FROM broker.endpoints e
                           WHERE e.conversation_id = b.conversation_id AND NOT e.is_initiator)
           AND NOT EXISTS (SELECT 1 FROM broker.forgotten_conversations f
                           WHERE f.conversation_id = b.conversation_id AND NOT f.is_initiator)
    ), headers AS (  -- each new conversation's header, from its lowest-numbered message
        SELECT DISTINCT ON (b.conversation_id) b.*
        FROM pg_temp.incoming_batch b
        JOIN new_conversations n ON n.conversation_id = b.conversation_id
        WHERE b.sender_is_initiator
        ORDER BY b.conversation_id, b.sequence_number, b.ctid
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
          AND (h.expires_at < timestamptz '10000-01-01 00:00:00+00') IS NOT false  -- else refused one by one
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
GRANT EXECUTE ON FUNCTION broker._open_batch_conversations(uuid,integer) TO broker_relay;

-- The steady state of a batch in a few statements: the batch's conversations
-- that are new here, or whose endpoint talks with the sending node, reads, and
-- has its queue enabled, when their messages in the batch are exactly the
-- numbers that come next, each once, and all plain.  That is judged by ranges,
-- one row a conversation: the lowest number right after what this side holds,
-- as many messages as numbers from the lowest to the highest, every one a
-- plain type of its contract within the size limit.  The batch is in
-- pg_temp.incoming_batch.  Returns their results; the caller takes the others
-- one by one: a broker.error among the messages (it is no plain type; the
-- careful way accepts it across the numbers its sender dropped, see
-- broker._accept_messages), messages that do not begin right after what this
-- side holds (past a gap, which the careful way records, or at a number it
-- holds already, taken only when the batch is anchored to what it holds, see
-- broker._anchored), a number twice or a gap within the batch, and a type
-- that needs validation.  Numbers recorded missing that arrive are recorded
-- resent (broker.lost_messages).
CREATE OR REPLACE FUNCTION broker._accept_in_bulk(from_instance uuid) RETURNS jsonb
LANGUAGE plpgsql AS $$
DECLARE
    limit_bytes integer := (SELECT max_message_bytes FROM broker.node);
    taken broker._batch_conversation[];
    results jsonb;
    queues integer[];
BEGIN
    taken := broker._lock_batch_conversations(from_instance);
    IF EXISTS (SELECT b.conversation_id FROM pg_temp.incoming_batch b WHERE b.sender_is_initiator
               EXCEPT SELECT t.conversation_id FROM unnest(taken) t) THEN
        PERFORM broker._open_batch_conversations(from_instance, limit_bytes);
        taken := broker._lock_batch_conversations(from_instance);
    END IF;
    IF taken IS NULL THEN
        RETURN '[]';
    END IF;
    WITH plain_types AS MATERIALIZED (  -- the few of the batch's contracts, read once, not probed for each message
        SELECT p.* FROM broker._plain_message_types p
        WHERE p.contract_id IN (SELECT t.contract_id FROM unnest(taken) t)
    ), sides AS MATERIALIZED (  -- each conversation side of the batch that is taken: its range of numbers
        SELECT t.conversation_handle, t.conversation_id, t.is_initiator, t.receive_sequence, t.queue_id,
               t.conversation_group_id, t.priority, t.received_message_id,
               min(b.sequence_number) AS first_number, max(b.sequence_number) AS last_number, count(*) AS messages,
               count(DISTINCT b.sequence_number) AS numbers,
               bool_and(p.name IS NOT NULL AND coalesce(octet_length(b.body), 0) <= limit_bytes) AS plain
        FROM unnest(taken) t
        JOIN pg_temp.incoming_batch b
          ON b.conversation_id = t.conversation_id AND b.sender_is_initiator = NOT t.is_initiator
        LEFT JOIN plain_types p
               ON p.contract_id = t.contract_id AND p.sent_by_initiator = NOT t.is_initiator AND p.name = b.message_type
        GROUP BY t.conversation_handle, t.conversation_id, t.is_initiator, t.receive_sequence, t.queue_id,
                 t.conversation_group_id, t.priority, t.received_message_id
    ), fitting AS MATERIALIZED (  -- exactly the numbers that come next, each once, all plain
        SELECT s.* FROM sides s
        WHERE s.plain AND s.first_number = s.receive_sequence + 1
          AND s.last_number - s.first_number + 1 = s.messages AND s.numbers = s.messages
    ), accepted AS MATERIALIZED (
        SELECT f.queue_id, f.conversation_group_id, f.conversation_handle, f.conversation_id, f.priority,
               f.last_number, b.sequence_number, b.message_id, b.message_type, b.body, b.traceparent,
               row_number() OVER (ORDER BY f.conversation_handle, b.sequence_number) AS place
        FROM fitting f
        JOIN pg_temp.incoming_batch b
          ON b.conversation_id = f.conversation_id AND b.sender_is_initiator = NOT f.is_initiator
    ), stored AS (
        INSERT INTO broker.queue_messages (queue_id, queue_position, conversation_group_id, conversation_handle,
                                           conversation_id, message_sequence_number, message_type_id, body, priority,
                                           traceparent)
        SELECT a.queue_id, (SELECT broker._next_queue_positions(count(*)::integer) FROM accepted) + a.place - 1,
               a.conversation_group_id, a.conversation_handle, a.conversation_id, a.sequence_number,
               t.message_type_id, a.body, a.priority, a.traceparent
        FROM accepted a
        JOIN broker.message_types t ON t.name = a.message_type
        RETURNING queue_id
    ), moved_on AS (
        UPDATE broker.endpoints e SET receive_sequence = a.sequence_number, received_message_id = a.message_id
        FROM accepted a
        WHERE e.conversation_handle = a.conversation_handle AND a.sequence_number = a.last_number
        RETURNING e.conversation_id, e.is_initiator, e.receive_sequence
    ), resent AS (
        UPDATE broker.lost_messages l SET outcome = 'resent'
        FROM moved_on m
        WHERE l.outcome = 'missing' AND l.conversation_id = m.conversation_id AND l.is_initiator = m.is_initiator
          AND l.direction = 'received' AND l.last_number <= m.receive_sequence
    )
    SELECT coalesce(jsonb_agg(jsonb_strip_nulls(jsonb_build_object(
               'conversation_id', f.conversation_id, 'sender_is_initiator', NOT f.is_initiator,
               'acknowledged', f.last_number, 'held', f.receive_sequence,
               'held_message_id', f.received_message_id))), '[]'),
           (SELECT array_agg(DISTINCT queue_id) FROM stored)
    INTO results, queues
    FROM fitting f;
    PERFORM pg_notify('broker_queue', q::text) FROM unnest(queues) q;
    RETURN results;
END $$;
GRANT EXECUTE ON FUNCTION broker._accept_in_bulk(uuid) TO broker_relay;

-- The session's table for the batch it accepts, made once per session: rows
-- of broker.wire_message, emptied when the transaction that accepts them
-- commits.  A NULL where the wire format allows none refuses the batch at its
-- COPY.
CREATE OR REPLACE FUNCTION broker.stage_batch() RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    IF to_regclass('pg_temp.incoming_batch') IS NULL THEN
        CREATE TEMPORARY TABLE incoming_batch OF broker.wire_message (
            conversation_id WITH OPTIONS NOT NULL, sender_is_initiator WITH OPTIONS NOT NULL,
            sequence_number WITH OPTIONS NOT NULL, message_type WITH OPTIONS NOT NULL) ON COMMIT DELETE ROWS;
    END IF;
END $$;
COMMENT ON FUNCTION broker.stage_batch() IS $$(node) Makes the session's temporary table `incoming_batch` (rows of
`wire_message`, emptied at commit), which `accept_batch` reads, unless the session has it. A node calls it before it
copies in a batch a peer sent.$$;
GRANT EXECUTE ON FUNCTION broker.stage_batch() TO broker_relay;

-- The batch is in pg_temp.incoming_batch (rows of broker.wire_message,
-- filled by COPY in this transaction, see broker.stage_batch): the steady
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
--
-- Never compiled (jit): the batch's table has no statistics and its planned
-- size is a guess, and with stale statistics of the endpoints one statement
-- was costed high enough to be compiled, 20 ms for 15 messages.  Its plans
-- are made for each batch, as they depend on its size.
CREATE OR REPLACE FUNCTION broker.accept_batch(from_instance uuid) RETURNS jsonb
LANGUAGE plpgsql SET jit = off AS $$
DECLARE
    not_the_senders jsonb;
    in_bulk jsonb;
    one_by_one jsonb;
BEGIN
    -- Each trace of the batch checked once: a malformed traceparent refuses the
    -- whole batch (SQLSTATE 23514), before anything is stored.
    PERFORM given::broker.traceparent
    FROM (SELECT DISTINCT b.traceparent AS given FROM pg_temp.incoming_batch b) traces;
    WITH batch_conversations AS (
        SELECT DISTINCT b.conversation_id, b.sender_is_initiator FROM pg_temp.incoming_batch b
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
        DELETE FROM pg_temp.incoming_batch b USING foreign_conversations f
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
                          ORDER BY b.sequence_number, b.ctid))[1] AS header,
               jsonb_agg(jsonb_build_object('sequence_number', b.sequence_number, 'message_id', b.message_id,
                                            'message_type', b.message_type, 'body', encode(b.body, 'base64'),
                                            'traceparent', b.traceparent)
                         ORDER BY b.sequence_number, b.ctid) AS messages
        FROM pg_temp.incoming_batch b
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
                              'tombstone_retention_s', (SELECT extract(epoch FROM tombstone_retention)
                                                        FROM broker.node),
                              'results', not_the_senders || in_bulk || one_by_one);
END $$;
COMMENT ON FUNCTION broker.accept_batch(uuid) IS $$(node) Accepts the batch a peer node (`from_instance`) sent, copied
into `pg_temp.incoming_batch`: stores what comes next of each of its conversations, opening those that begin, and
returns the answer (JSON: this node's `broker_instance`, its `tombstone_retention_s`, and a result per conversation
side: what it acknowledged and held, or why it was refused). A conversation that is not the sender's is refused as
unknown (BR005), and a malformed `traceparent` refuses the whole batch (SQLSTATE 23514).$$;
GRANT EXECUTE ON FUNCTION broker.accept_batch(uuid) TO broker_relay;

-- A batch in pg_temp.incoming_transport_batch (rows of
-- broker.transport_message), as the node of the release before revision 0035
-- stages it: those nodes serve a database migrated ahead of them until they
-- are replaced.
CREATE OR REPLACE FUNCTION broker.accept_transport_batch(from_instance uuid) RETURNS jsonb
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM broker.stage_batch();
    INSERT INTO pg_temp.incoming_batch (conversation_id, sender_is_initiator, from_service, to_service, contract,
                                        expires_at, sequence_number, message_type, body, traceparent)
    SELECT b.conversation_id, b.sender_is_initiator, b.from_service, b.to_service, b.contract, b.expires_at,
           b.sequence_number, b.message_type, b.body, b.traceparent
    FROM pg_temp.incoming_transport_batch b;
    RETURN broker.accept_batch(from_instance);
END $$;
COMMENT ON FUNCTION broker.accept_transport_batch(uuid) IS $$(node) `accept_batch` of a batch in
`pg_temp.incoming_transport_batch` (rows of `transport_message`, wire version 3), as a node of the release before
revision 0035 stages it.$$;
GRANT EXECUTE ON FUNCTION broker.accept_transport_batch(uuid) TO broker_relay;
