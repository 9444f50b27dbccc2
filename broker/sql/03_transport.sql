-- Between nodes: the transmission queue, accepting a transport batch, and the
-- relay's side (building batches, applying answers, recording failures).
--
-- A conversation belongs to the peer it was opened with, and answers apply
-- only to the batch they answer.  A peer is any node with a route here and a
-- secret of its own.  Whatever it signs, it can touch only its own
-- conversations: those whose endpoint here has it as far_broker_instance (a
-- local conversation belongs to no peer).  It opens conversations only from
-- services that this node routes to it, and its answers apply only to the
-- batch it was sent.

-- What waits to be sent to another node, vacuumed as the queue tables are
-- (see broker.queue_messages).
CREATE TABLE broker.transmission_queue (
    conversation_handle      uuid NOT NULL,
    message_sequence_number  bigint NOT NULL,
    conversation_id          uuid NOT NULL,
    to_service               text NOT NULL,
    message_type_id          integer NOT NULL,
    body                     bytea,
    enqueued_at              timestamptz NOT NULL DEFAULT now(),
    attempts                 integer NOT NULL DEFAULT 0,
    next_attempt_at          timestamptz NOT NULL DEFAULT now(),
    transmission_status      text NOT NULL DEFAULT 'waiting for its first transmission',
    priority                 smallint NOT NULL DEFAULT 5,  -- the sending endpoint's
    traceparent              text,  -- the sending transaction's broker._traceparent()
    -- A destination's messages of each priority in the order they are sent
    -- (broker.transport_batch): a batch reads its own destination's messages
    -- and no others.  to_service and priority are the sending endpoint's
    -- far_service and priority, which every lookup by conversation gives.
    PRIMARY KEY (to_service, priority, conversation_handle, message_sequence_number)
) WITH (autovacuum_vacuum_scale_factor = 0.01, autovacuum_vacuum_threshold = 1000,
        autovacuum_vacuum_insert_threshold = -1, autovacuum_vacuum_cost_delay = 0);
-- The few messages whose transmission has failed: an answer from their
-- destination resets them (broker.apply_transport_results) without a look at
-- the others.
CREATE INDEX transmission_queue_failed ON broker.transmission_queue (conversation_handle) WHERE attempts > 0;
-- The messages held until a delivery time to come (broker._transmit): due
-- later than they were queued, which no other message is until it fails.
CREATE INDEX transmission_queue_held ON broker.transmission_queue (to_service, next_attempt_at)
    WHERE next_attempt_at > enqueued_at;

-- A destination that could not be reached, per relay lane (the conversations
-- whose handles fall in [first_handle, last_handle]; a single conversation when
-- its message alone is too large for the far node): one row, however many
-- messages wait, so that a peer down for days with a long queue costs each
-- retry one row.  The next answer from the destination for one of these
-- conversations removes it (broker.apply_transport_results).
CREATE TABLE broker.transmission_failures (
    address          text NOT NULL,
    first_handle     uuid NOT NULL,
    last_handle      uuid NOT NULL,
    attempts         integer NOT NULL,
    failed_at        timestamptz NOT NULL,
    next_attempt_at  timestamptz NOT NULL,
    reason           text NOT NULL,
    PRIMARY KEY (address, first_handle, last_handle)
);

-- How far each conversation side with a remote far side has got in sending:
-- the highest number it put in a batch before the latest batch
-- (previously_transmitted) and since (transmitted_sequence), the highest it
-- had put in a batch when the latest answer applied (answered_sequence), and
-- the highest number the far node acknowledged.  The relay commits a batch's
-- numbers here before the batch leaves (broker.transport_batch), so the far
-- node never holds a number above transmitted_sequence, and never held one
-- above previously_transmitted before the batch came: an answer that says
-- otherwise shows this database went back to an earlier point (a restore, a
-- failover to a standby that lagged), and the numbers after
-- answered_sequence are those its attempts since may have sent in vain.  An
-- answer that acknowledges less than the far node did before shows that the
-- far node's database went back.  See broker.apply_transport_results.
CREATE TABLE broker.transmission_progress (
    conversation_handle     uuid PRIMARY KEY,
    previously_transmitted  bigint NOT NULL DEFAULT 0,
    transmitted_sequence    bigint NOT NULL,
    answered_sequence       bigint NOT NULL DEFAULT 0,
    acknowledged_sequence   bigint NOT NULL DEFAULT 0
) WITH (fillfactor = 70, autovacuum_vacuum_scale_factor = 0.01, autovacuum_vacuum_threshold = 1000);

-- What a far node acknowledged, kept for broker.node.resend_window: a peer
-- whose database went back to an earlier point lost messages it had
-- acknowledged, and gets exactly those again, in order (see
-- broker._send_again).  Rows older than the window are forgotten by
-- broker.forget_acknowledged_messages, which a running relay calls every
-- minute.
CREATE TABLE broker.acknowledged_messages (
    conversation_handle      uuid NOT NULL,
    message_sequence_number  bigint NOT NULL,
    message_type_id          integer NOT NULL,
    body                     bytea,
    enqueued_at              timestamptz NOT NULL,
    traceparent              text,
    acknowledged_at          timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (conversation_handle, message_sequence_number)
) WITH (autovacuum_vacuum_scale_factor = 0.01, autovacuum_vacuum_threshold = 1000,
        autovacuum_vacuum_insert_threshold = -1, autovacuum_vacuum_cost_delay = 0);
-- Rows come in the order they are acknowledged: a block range index finds the
-- old ones for next to nothing per insert.
CREATE INDEX acknowledged_messages_age ON broker.acknowledged_messages USING brin (acknowledged_at);

-- Numbers of a conversation that one of its sides lost because its database
-- went back to an earlier point, as this side found them: messages from the
-- far node missing here (missing, until the far node sends them again:
-- resent; or lost), messages this side had sent that the far node lost
-- (resent from the resend window, or lost), or numbers this side used again
-- that the far node already held (renumbered: this side's messages from
-- first_number on were numbered past them).  A lost conversation ends with
-- broker.error code -4 on both sides.  Rows go with their conversation when
-- it is forgotten.  Messages that waited longer than the far node remembers
-- are withheld (see broker.withhold_what_peers_forgot).  broker diagnose
-- reports the missing, the lost and the withheld.
CREATE TABLE broker.lost_messages (
    conversation_id      uuid NOT NULL,
    is_initiator         boolean NOT NULL,  -- this side's
    far_broker_instance  uuid NOT NULL,
    direction            text NOT NULL CHECK (direction IN ('received', 'sent')),
    first_number         bigint NOT NULL,
    last_number          bigint NOT NULL,
    outcome              text NOT NULL CHECK (outcome IN ('missing', 'resent', 'renumbered', 'lost', 'withheld')),
    found_at             timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (conversation_id, is_initiator, direction, first_number)
);
CREATE INDEX lost_messages_missing ON broker.lost_messages (conversation_id) WHERE outcome = 'missing';

-- How long each peer remembers a conversation it ended and forgot (its
-- broker.node.tombstone_retention), as every answer of its says.
CREATE TABLE broker.peer_retention (
    broker_instance      uuid PRIMARY KEY,
    tombstone_retention  interval NOT NULL,
    learned_at           timestamptz NOT NULL DEFAULT now()
);

-- A message's attempts and status are those of the latest failure that covers
-- it, or else its own (the far node held its conversation back).
CREATE VIEW broker.transmission_queue_status AS
SELECT t.conversation_handle, t.conversation_id, t.to_service, t.message_sequence_number,
       mt.name AS message_type, octet_length(t.body) AS body_bytes, t.enqueued_at,
       coalesce(f.attempts, t.attempts) AS attempts,
       coalesce(f.next_attempt_at, t.next_attempt_at) AS next_attempt_at,
       CASE WHEN t.attempts = 0 AND t.next_attempt_at > now()
                 THEN format('held until its delivery time, %s',
                             to_char(t.next_attempt_at, 'YYYY-MM-DD HH24:MI:SS TZ'))
            WHEN f.reason IS NOT NULL
                 THEN format('%s (attempt %s, next at %s)', f.reason, f.attempts,
                             to_char(f.next_attempt_at, 'YYYY-MM-DD HH24:MI:SS TZ'))
            WHEN t.transmission_status = 'waiting for its first transmission'
                 AND t.message_sequence_number <= p.transmitted_sequence
                 THEN 'sent; no acknowledgement yet'
            ELSE t.transmission_status END AS transmission_status,
       t.traceparent
FROM broker.transmission_queue t
JOIN broker.message_types mt USING (message_type_id)
LEFT JOIN broker.transmission_progress p USING (conversation_handle)
LEFT JOIN LATERAL (SELECT f.* FROM broker.routes r
                   JOIN broker.transmission_failures f ON f.address = r.address
                   WHERE r.service_name = t.to_service
                     AND t.conversation_handle BETWEEN f.first_handle AND f.last_handle
                   ORDER BY f.failed_at DESC
                   LIMIT 1) f ON true;

-- One message of a transport batch, as it travels between nodes: a batch is
-- PostgreSQL's binary COPY format of these rows, written by the sending
-- node's COPY (SELECT * FROM broker.transport_batch(...)) TO STDOUT and read
-- by the receiving node's COPY into a temporary table of this type.  Every
-- row carries its conversation's header; a new conversation is opened with
-- the header of its lowest-numbered message.
CREATE TYPE broker.transport_message AS (
    conversation_id      uuid,
    sender_is_initiator  boolean,
    from_service         text,
    to_service           text,
    contract             text,
    expires_at           timestamptz,
    sequence_number      bigint,
    message_type         text,
    body                 bytea,
    traceparent          text  -- the span that handed it on (see broker.tracing)
);

-- A conversation of a batch whose endpoint here is locked for the batch.
CREATE TYPE broker._batch_conversation AS (
    conversation_handle uuid, conversation_id uuid, is_initiator boolean, receive_sequence bigint,
    queue_id integer, conversation_group_id uuid, contract_id integer, priority smallint
);

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
            from_instance, dialog_contract, (header ->> 'expires_at')::timestamptz,
            broker._priority(header ->> 'contract', target_service.name, header ->> 'from_service'))
    RETURNING * INTO e;
    RETURN e;
END $$;

-- The far node refused a conversation: it ends here with a broker.error
-- notice; nothing more is sent.
CREATE FUNCTION broker._refused_by_far_side(e broker.endpoints, reason text) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM broker.transmission_queue
    WHERE to_service = e.far_service AND priority = e.priority AND conversation_handle = e.conversation_handle;
    IF e.state IN ('conversing', 'disconnected_inbound', 'disconnected_outbound') THEN
        UPDATE broker.endpoints SET state = 'error', timer_at = NULL WHERE conversation_handle = e.conversation_handle;
        PERFORM broker._enqueue(e, 0, (broker._message_type('broker.error')).message_type_id,
                                broker._error_body(-3, 'the far node refused the conversation: ' || reason));
    END IF;
END $$;

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
              FROM jsonb_array_elements(messages) m, CAST(m ->> 'sequence_number' AS bigint) n
              WHERE n > e.receive_sequence
              ORDER BY n) once_each
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

-- One conversation of a batch, in a subtransaction of its own so that a bad
-- conversation never spoils the rest.  The result acknowledges the highest
-- number held without a gap, says which number was held before the batch, and
-- why anything was refused or waits.  A conversation forgotten here is
-- acknowledged, not opened again.  A refusal ends this side only when it is
-- the sender's conversation: broker.accept_transport_batch sets the others
-- aside first, and one that appears meanwhile is not the sender's to end
-- either.
--
-- Messages that begin past a gap are not taken: the numbers before them are
-- missing here (this database went back to an earlier point), so they are
-- recorded in broker.lost_messages and the sender is told to wait, and to send
-- them again.  So a conversation unknown here is opened only from its first
-- number, or by a broker.error that ends it across the numbers its sender
-- dropped.  A conversation that an application transaction holds is not waited
-- for: the answer says it waits.
CREATE OR REPLACE FUNCTION broker._accept_conversation(from_instance uuid, header jsonb) RETURNS jsonb
LANGUAGE plpgsql AS $$
DECLARE
    conversation uuid;
    sender_is_initiator boolean;
    e broker.endpoints;
    known boolean;
    tombstone broker.forgotten_conversations;
    first_sent bigint := (SELECT min((m ->> 'sequence_number')::bigint) FROM jsonb_array_elements(header -> 'messages') m);
    ends_it boolean := jsonb_path_exists(header -> 'messages', '$[*] ? (@.message_type == "broker.error")');
    held bigint;
    acknowledged bigint;
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
        FOR UPDATE NOWAIT;
        known := FOUND;
        IF NOT known THEN
            SELECT * INTO tombstone FROM broker.forgotten_conversations f
            WHERE f.conversation_id = conversation AND f.is_initiator = NOT sender_is_initiator
              AND f.far_broker_instance = from_instance;
            IF FOUND THEN  -- closed and forgotten here: take nothing, and let the sender stop resending
                RETURN result || jsonb_build_object('acknowledged', greatest(tombstone.receive_sequence,
                    (SELECT max((m ->> 'sequence_number')::bigint)
                     FROM jsonb_array_elements(header -> 'messages') m)), 'held', tombstone.receive_sequence);
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
        IF first_sent > held + 1 AND NOT ends_it THEN
            PERFORM broker._record_lost_messages(e, 'received', held + 1, first_sent - 1, 'missing');
            RETURN result || jsonb_build_object('acknowledged', held, 'held', held, 'waiting', format(
                'messages %s to %s of the conversation are missing here (its database went back to an earlier '
                'point?): send them again', held + 1, first_sent - 1));
        END IF;
        acknowledged := broker._accept_messages(e, header -> 'messages');
        UPDATE broker.lost_messages l
        SET outcome = CASE WHEN ends_it THEN 'lost' ELSE 'resent' END
        WHERE l.conversation_id = conversation AND l.is_initiator = NOT sender_is_initiator
          AND l.direction = 'received' AND l.outcome = 'missing' AND l.last_number <= acknowledged;
        RETURN result || jsonb_build_object('acknowledged', acknowledged, 'held', held);
    EXCEPTION WHEN SQLSTATE 'BR030' THEN
        RETURN result || jsonb_build_object('acknowledged', coalesce(e.receive_sequence, 0), 'waiting', SQLERRM);
    WHEN lock_not_available THEN
        RETURN result || jsonb_build_object(
            'acknowledged', (SELECT receive_sequence FROM broker.endpoints
                             WHERE conversation_id = conversation AND is_initiator = NOT sender_is_initiator),
            'waiting', 'an application transaction holds the conversation here');
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
-- endpoint).  One that an application transaction holds is passed over, not
-- waited for: the node's own work never takes part in a deadlock with an
-- application (broker._accept_conversation answers that it waits).
CREATE FUNCTION broker._lock_batch_conversations(from_instance uuid) RETURNS broker._batch_conversation[]
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
                  FOR UPDATE SKIP LOCKED) e);
END $$;

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
        FROM pg_temp.incoming_transport_batch b
        WHERE b.sender_is_initiator
        GROUP BY b.conversation_id
        HAVING min(b.sequence_number) = 1
           AND NOT EXISTS (SELECT 1 FROM broker.endpoints e
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
-- (see broker._accept_messages), and so are those whose new messages begin
-- past a gap, which it records.  Numbers recorded missing that arrive are
-- recorded resent (broker.lost_messages).
CREATE OR REPLACE FUNCTION broker._accept_in_bulk(from_instance uuid) RETURNS jsonb
LANGUAGE plpgsql AS $$
DECLARE
    limit_bytes integer := (SELECT max_message_bytes FROM broker.node);
    taken broker._batch_conversation[];
    results jsonb;
    queues integer[];
    careful uuid[];
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
    -- sender dropped (see broker._transmit_error).  So do those whose new
    -- messages begin past a gap.
    SELECT coalesce(array_agg(c.conversation_handle), '{}') INTO careful
    FROM (SELECT t.conversation_handle
          FROM unnest(taken) t
          JOIN pg_temp.incoming_transport_batch b
            ON b.conversation_id = t.conversation_id AND b.sender_is_initiator = NOT t.is_initiator
          WHERE b.sequence_number > t.receive_sequence
          GROUP BY t.conversation_handle, t.receive_sequence
          HAVING bool_or(b.message_type = 'broker.error') OR min(b.sequence_number) > t.receive_sequence + 1) c;

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
        FROM judged j WHERE j.plain AND j.conversation_handle <> ALL (careful)
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
        RETURNING e.conversation_handle, e.conversation_id, e.is_initiator, e.receive_sequence
    ), resent AS (
        UPDATE broker.lost_messages l SET outcome = 'resent'
        FROM moved_on m
        WHERE l.outcome = 'missing' AND l.conversation_id = m.conversation_id AND l.is_initiator = m.is_initiator
          AND l.direction = 'received' AND l.last_number <= m.receive_sequence
    )
    SELECT coalesce(jsonb_agg(jsonb_build_object(
               'conversation_id', t.conversation_id, 'sender_is_initiator', NOT t.is_initiator,
               'acknowledged', coalesce(m.receive_sequence, t.receive_sequence), 'held', t.receive_sequence)), '[]'),
           (SELECT array_agg(DISTINCT queue_id) FROM stored)
    INTO results, queues
    FROM unnest(taken) t
    LEFT JOIN moved_on m ON m.conversation_handle = t.conversation_handle
    WHERE NOT EXISTS (SELECT 1 FROM judged j WHERE j.conversation_handle = t.conversation_handle AND NOT j.plain)
      AND t.conversation_handle <> ALL (careful);
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
                              'tombstone_retention_s', (SELECT extract(epoch FROM tombstone_retention)
                                                        FROM broker.node),
                              'results', not_the_senders || in_bulk || one_by_one);
END $$;
COMMENT ON FUNCTION broker.accept_transport_batch(uuid) IS
    'Stores what comes next of each conversation of the batch in pg_temp.incoming_transport_batch; returns the acknowledgements.';

------------------------------------------------------------------------------
-- Sending side
------------------------------------------------------------------------------

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
-- fixed-size fields and lengths of its row in the binary COPY format.  The
-- numbers taken are recorded in broker.transmission_progress, in the relay's
-- transaction that commits before the batch leaves.
CREATE OR REPLACE FUNCTION broker.transport_batch(destination text, max_messages integer, max_bytes bigint,
                                                  first_handle uuid, last_handle uuid)
RETURNS SETOF broker.transport_message
LANGUAGE plpgsql AS $$
DECLARE  -- conversations held back after a failure: seldom any, so each message is looked at only then
    holds_back boolean := EXISTS (SELECT 1 FROM broker.transmission_failures f
                                  WHERE f.address = destination AND f.next_attempt_at > now());
BEGIN  -- plpgsql rather than sql: the plan is kept between batches, not made again for each
    RETURN QUERY
    WITH batch AS (
        SELECT sized.*
        FROM (SELECT due.conversation_handle, e.conversation_id, e.is_initiator, s.name AS from_service,
                     e.far_service AS to_service, c.name AS contract, e.expires_at,
                     due.message_sequence_number AS sequence_number, mt.name AS message_type, due.body,
                     due.traceparent,
                     sum(80 + coalesce(octet_length(due.body), 0) + octet_length(s.name)
                         + octet_length(e.far_service) + octet_length(c.name) + octet_length(mt.name)
                         + coalesce(octet_length(due.traceparent), 0))
                         OVER (ORDER BY due.priority DESC, due.conversation_handle, due.message_sequence_number)
                         AS bytes_so_far,
                     row_number() OVER (ORDER BY due.priority DESC, due.conversation_handle,
                                                 due.message_sequence_number) AS place
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
    ), recorded AS (
        INSERT INTO broker.transmission_progress AS p (conversation_handle, transmitted_sequence)
        SELECT b.conversation_handle, max(b.sequence_number) FROM batch b GROUP BY b.conversation_handle
        ON CONFLICT (conversation_handle) DO UPDATE
        SET previously_transmitted = p.transmitted_sequence,
            transmitted_sequence = greatest(p.transmitted_sequence, excluded.transmitted_sequence)
    )
    SELECT b.conversation_id, b.is_initiator, b.from_service, b.to_service, b.contract, b.expires_at,
           b.sequence_number, b.message_type, b.body, b.traceparent
    FROM batch b
    ORDER BY b.place;
END $$;
COMMENT ON FUNCTION broker.transport_batch(text, integer, bigint, uuid, uuid) IS
    'The next batch for a destination: the lowest waiting numbers of its conversations between the handles, up to a count and a size.';

-- Applies a destination node's answer in one transaction: deletes what it
-- acknowledged (keeping it for broker.node.resend_window), ends what it
-- refused.  Returns how many messages were delivered.  Every acknowledgement
-- is applied by one DELETE and one UPDATE; refusals and hold-backs are rare and
-- handled one by one.  The transaction that applies an answer commits without
-- waiting for its WAL to reach the disk: if a crash loses it, the messages it
-- deleted are sent again and the far node acknowledges them as duplicates
-- (guarantee 3), so the relay need not wait for a flush in every cycle.
--
-- The answer is held to the batch it answers: the relay puts the batch it sent
-- into pg_temp.sent_transport_batch (rows of broker.transport_message, by COPY
-- in this transaction), and only the results for that batch's conversations
-- apply, each acknowledging at most the highest number the batch carried of its
-- conversation.  So no answer, however it is signed, acknowledges, refuses or
-- holds back a message it was not sent.  A result without a number
-- acknowledges nothing.
--
-- A database that went back to an earlier point shows in the answer (see
-- broker.transmission_progress): a far node that acknowledges less than it did
-- before lost what it had acknowledged, and gets it again
-- (broker._send_again); a far node that held, before the batch came, numbers
-- this side had not transmitted yet (the answer's held), or that acknowledges
-- more than this side ever numbered, holds what this side numbered before its
-- database went back, and this side's messages are numbered past them
-- (broker._number_past).
CREATE OR REPLACE FUNCTION broker.apply_transport_results(answer jsonb) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    handles uuid[];
    services text[];
    priorities smallint[];
    acknowledged bigint[];
    reported bigint[];
    held bigint[];
    refusals text[];
    holds text[];
    result record;
    went_back uuid[] := '{}';
    sent_again uuid[] := '{}';
    delivered bigint;
BEGIN
    PERFORM set_config('synchronous_commit', 'off', true);
    WITH sent AS (
        SELECT b.conversation_id, b.sender_is_initiator, max(b.sequence_number) AS last_sent
        FROM pg_temp.sent_transport_batch b
        GROUP BY b.conversation_id, b.sender_is_initiator
    )
    SELECT array_agg(e.conversation_handle), array_agg(e.far_service), array_agg(e.priority),
           array_agg(least(coalesce(r.acknowledged, 0), s.last_sent)), array_agg(r.acknowledged), array_agg(r.held),
           array_agg(CASE WHEN r.refused IS NOT NULL
                          THEN coalesce(r.refused ->> 'reason', 'no reason given') END),
           array_agg(r.waiting)
    INTO handles, services, priorities, acknowledged, reported, held, refusals, holds
    FROM jsonb_to_recordset(answer -> 'results')
         AS r(conversation_id uuid, sender_is_initiator boolean, acknowledged bigint, held bigint, refused jsonb,
              waiting text)
    JOIN sent s ON s.conversation_id = r.conversation_id AND s.sender_is_initiator = r.sender_is_initiator
    JOIN broker.endpoints e ON e.conversation_id = s.conversation_id AND e.is_initiator = s.sender_is_initiator
                           AND NOT e.far_is_local;

    INSERT INTO broker.peer_retention AS p (broker_instance, tombstone_retention)
    SELECT e.far_broker_instance, make_interval(secs => (answer ->> 'tombstone_retention_s')::float8)
    FROM broker.endpoints e
    WHERE e.conversation_handle = handles[1] AND answer ? 'tombstone_retention_s'
    ON CONFLICT (broker_instance) DO UPDATE
    SET tombstone_retention = excluded.tombstone_retention, learned_at = excluded.learned_at
    WHERE p.tombstone_retention <> excluded.tombstone_retention;

    FOR result IN
        SELECT a.conversation_handle, a.reported, a.held, p.previously_transmitted, p.answered_sequence,
               p.acknowledged_sequence, e.send_sequence
        FROM unnest(handles, reported, held) AS a(conversation_handle, reported, held)
        JOIN broker.transmission_progress p ON p.conversation_handle = a.conversation_handle
        JOIN broker.endpoints e ON e.conversation_handle = a.conversation_handle
        WHERE a.reported < p.acknowledged_sequence OR a.held > p.previously_transmitted
           OR a.reported > e.send_sequence
    LOOP
        went_back := went_back || result.conversation_handle;
        IF result.reported < result.acknowledged_sequence THEN
            IF broker._send_again(result.conversation_handle, result.reported, result.acknowledged_sequence) THEN
                sent_again := sent_again || result.conversation_handle;
            END IF;
        ELSE
            PERFORM broker._number_past(result.conversation_handle,
                                        greatest(result.reported, result.held), result.answered_sequence);
        END IF;
    END LOOP;

    -- The acknowledged rows are found conversation by conversation through the
    -- primary key (OFFSET 0 keeps the planner from making the lateral subquery
    -- a join), then deleted where they lie, and kept for the resend window.  As
    -- a join, the plan could scan the whole transmission queue for every
    -- answer: a long queue (a peer down for days) would make every batch
    -- slower.  A row that another transaction changed meanwhile is not
    -- deleted: it is sent again, and acknowledged as a duplicate.  Nothing is
    -- deleted of a conversation whose answer showed a database that went back:
    -- what that answer acknowledges is not what this side sent.
    WITH acknowledged_rows AS (
        SELECT d.ctid
        FROM unnest(handles, services, priorities, acknowledged)
                 AS a(conversation_handle, to_service, priority, acknowledged),
             LATERAL (SELECT t.ctid FROM broker.transmission_queue t
                      WHERE t.to_service = a.to_service AND t.priority = a.priority
                        AND t.conversation_handle = a.conversation_handle
                        AND t.message_sequence_number <= a.acknowledged
                      OFFSET 0) d
        WHERE a.conversation_handle <> ALL (went_back)
    ), removed AS (
        DELETE FROM broker.transmission_queue t
        WHERE t.ctid = ANY (ARRAY(SELECT r.ctid FROM acknowledged_rows r))
        RETURNING t.*
    ), kept AS (
        INSERT INTO broker.acknowledged_messages (conversation_handle, message_sequence_number, message_type_id,
                                                  body, enqueued_at, traceparent)
        SELECT r.conversation_handle, r.message_sequence_number, r.message_type_id, r.body, r.enqueued_at,
               r.traceparent
        FROM removed r
        WHERE (SELECT n.resend_window > interval '0' FROM broker.node n)
    )
    SELECT count(*) INTO delivered FROM removed;
    UPDATE broker.transmission_progress p
    SET acknowledged_sequence = greatest(p.acknowledged_sequence, a.acknowledged),
        answered_sequence = p.transmitted_sequence
    FROM unnest(handles, acknowledged) AS a(conversation_handle, acknowledged)
    WHERE p.conversation_handle = a.conversation_handle AND a.conversation_handle <> ALL (went_back);
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

    -- A conversation held back is tried again after a back-off that doubles
    -- with each attempt, from a quarter of a second up to a minute.
    FOR result IN
        SELECT * FROM unnest(handles, services, priorities, refusals, holds)
                 AS a(conversation_handle, to_service, priority, refused, waiting)
        WHERE (a.refused IS NOT NULL OR a.waiting IS NOT NULL) AND a.conversation_handle <> ALL (sent_again)
    LOOP
        IF result.refused IS NOT NULL THEN
            PERFORM broker._refused_by_far_side(broker._lock_endpoint(result.conversation_handle), result.refused);
        ELSE
            UPDATE broker.transmission_queue
            SET transmission_status = 'the far node holds it back: ' || result.waiting,
                attempts = attempts + 1,
                next_attempt_at = now() + least(interval '60 seconds', interval '250 milliseconds' * 2 ^ attempts)
            WHERE to_service = result.to_service AND priority = result.priority
              AND conversation_handle = result.conversation_handle;
        END IF;
    END LOOP;
    RETURN delivered;
END $$;

-- The far node lost the numbers after held up to acknowledged of a
-- conversation side's messages, which it had acknowledged: its database went
-- back to an earlier point.  They go to the transmission queue again, from the
-- resend window (broker.acknowledged_messages), in order and before the
-- messages that wait.  When the window no longer holds them all, the
-- conversation ends with broker.error code -4 on both sides (the far node
-- takes the error across the numbers it lacks).  Either way the loss is
-- recorded in broker.lost_messages.  Returns whether they were sent again.
CREATE FUNCTION broker._send_again(handle uuid, held bigint, acknowledged bigint) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    e broker.endpoints;
    resent boolean;
BEGIN
    SELECT * INTO e FROM broker.endpoints WHERE conversation_handle = handle FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        RETURN false;  -- an application holds the conversation: the next answer finds the same
    END IF;
    resent := (SELECT count(*) FROM broker.acknowledged_messages k
               WHERE k.conversation_handle = handle AND k.message_sequence_number BETWEEN held + 1 AND acknowledged)
              = acknowledged - held;
    IF resent THEN
        WITH taken_back AS (
            DELETE FROM broker.acknowledged_messages k
            WHERE k.conversation_handle = handle AND k.message_sequence_number BETWEEN held + 1 AND acknowledged
            RETURNING k.*
        )
        INSERT INTO broker.transmission_queue (conversation_handle, message_sequence_number, conversation_id,
                                               to_service, message_type_id, body, enqueued_at, transmission_status,
                                               priority, traceparent)
        SELECT handle, k.message_sequence_number, e.conversation_id, e.far_service, k.message_type_id, k.body,
               k.enqueued_at, format('sent again: the far node lost it (its database went back to number %s)', held),
               e.priority, k.traceparent
        FROM taken_back k;
    ELSIF e.state IN ('conversing', 'disconnected_inbound', 'disconnected_outbound') THEN
        PERFORM broker._fail_conversation(e, -4, format(
            'messages %s to %s of this conversation were lost: the far node''s database went back to an earlier '
            'point, and this node no longer keeps them (broker.node.resend_window)', held + 1, acknowledged));
    END IF;
    UPDATE broker.transmission_progress SET acknowledged_sequence = held WHERE conversation_handle = handle;
    PERFORM broker._record_lost_messages(e, 'sent', held + 1, acknowledged,
                                         CASE WHEN resent THEN 'resent' ELSE 'lost' END);
    RETURN resent;
END $$;

-- This side's database went back to an earlier point: the far node already
-- holds its numbers up to held, of which this side knows it had transmitted
-- only those up to transmitted (its answered_sequence).  The messages it numbered after transmitted may be
-- new ones, which the far node would discard as duplicates, or old ones it
-- holds already: this side cannot tell.  So they are numbered past held,
-- behind a broker.renumbered message (number held + 1, and a notice here) that
-- tells both applications which numbers the far side holds from before, so
-- that they can reconcile.  Nothing new is discarded.
CREATE FUNCTION broker._number_past(handle uuid, held bigint, transmitted bigint) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    e broker.endpoints;
    shift bigint := held + 1 - transmitted;
    renumbered broker.message_types := broker._message_type('broker.renumbered');
    notice bytea;
BEGIN
    SELECT * INTO e FROM broker.endpoints WHERE conversation_handle = handle FOR UPDATE SKIP LOCKED;
    IF NOT FOUND OR e.state NOT IN ('conversing', 'disconnected_inbound', 'disconnected_outbound') THEN
        RETURN;  -- held by an application (the next answer finds the same), or ended
    END IF;
    notice := convert_to(jsonb_build_object(
        'first_number', transmitted + 1, 'last_number', held, 'next_number', held + 2,
        'description', format('the database of the sending side went back to an earlier point: the receiving side '
                              'already holds numbers %s to %s from before; the sender''s messages from number %s on '
                              'follow as numbers %s on, and may repeat some of those',
                              transmitted + 1, held, transmitted + 1, held + 2))::text, 'UTF8');
    WITH moved AS (
        DELETE FROM broker.transmission_queue t
        WHERE t.to_service = e.far_service AND t.priority = e.priority AND t.conversation_handle = handle
          AND t.message_sequence_number > transmitted
        RETURNING t.*
    )
    INSERT INTO broker.transmission_queue (conversation_handle, message_sequence_number, conversation_id, to_service,
                                           message_type_id, body, enqueued_at, next_attempt_at, transmission_status,
                                           priority, traceparent)
    SELECT m.conversation_handle, m.message_sequence_number + shift, m.conversation_id, m.to_service,
           m.message_type_id, m.body, m.enqueued_at, m.next_attempt_at,
           format('numbered again from %s: the far node already held that number', m.message_sequence_number),
           m.priority, m.traceparent
    FROM moved m;
    INSERT INTO broker.transmission_queue (conversation_handle, message_sequence_number, conversation_id, to_service,
                                           message_type_id, body, priority)
    VALUES (handle, held + 1, e.conversation_id, e.far_service, renumbered.message_type_id, notice, e.priority);
    UPDATE broker.endpoints SET send_sequence = greatest(send_sequence, transmitted) + shift
    WHERE conversation_handle = handle;
    UPDATE broker.transmission_progress
    SET previously_transmitted = held, transmitted_sequence = held, answered_sequence = held,
        acknowledged_sequence = held
    WHERE conversation_handle = handle;
    PERFORM broker._enqueue(e, 0, renumbered.message_type_id, notice);
    PERFORM broker._record_lost_messages(e, 'sent', transmitted + 1, held, 'renumbered');
END $$;

-- Records numbers of a conversation side that a database going back lost
-- (see broker.lost_messages); the same numbers found again update the row.
CREATE FUNCTION broker._record_lost_messages(e broker.endpoints, direction text, first_number bigint,
                                             last_number bigint, outcome text) RETURNS void
LANGUAGE sql AS $$
    INSERT INTO broker.lost_messages AS l (conversation_id, is_initiator, far_broker_instance, direction,
                                           first_number, last_number, outcome)
    VALUES (e.conversation_id, e.is_initiator, e.far_broker_instance, direction, first_number, last_number, outcome)
    ON CONFLICT (conversation_id, is_initiator, direction, first_number) DO UPDATE
    SET last_number = excluded.last_number, outcome = excluded.outcome, found_at = excluded.found_at;
$$;

-- A peer forgets a conversation it ended after its tombstone_retention (see
-- broker.peer_retention): a message it has not acknowledged after that long
-- may reach it after it forgot, and open the conversation anew.  So a
-- conversation side whose oldest waiting message is older than its peer's
-- retention, less margin, stops: what waits of it moves to the dead letters
-- (queue_position 0: never delivered) with the reason, it ends here with a
-- broker.error notice, code -5, and nothing more goes to the peer, which may
-- not know it.  Conversations that an application holds are passed over
-- until the next call.  Returns how many conversations stopped.  A running
-- relay calls it every minute.
CREATE FUNCTION broker.withhold_what_peers_forgot(margin interval DEFAULT '1 hour') RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    candidate record;
    e broker.endpoints;
    first_number bigint;
    last_number bigint;
    reason text;
    stopped integer := 0;
BEGIN
    FOR candidate IN
        SELECT o AS side, r.tombstone_retention AS retention
        FROM (SELECT DISTINCT t.conversation_handle FROM broker.transmission_queue t
              WHERE t.enqueued_at < now() - (SELECT min(r.tombstone_retention) FROM broker.peer_retention r) + margin
             ) waiting
        JOIN broker.endpoints o ON o.conversation_handle = waiting.conversation_handle AND NOT o.far_is_local
        JOIN broker.peer_retention r ON r.broker_instance = o.far_broker_instance
        WHERE EXISTS (SELECT 1 FROM broker.transmission_queue t
                      WHERE t.to_service = o.far_service AND t.priority = o.priority
                        AND t.conversation_handle = o.conversation_handle
                        AND t.enqueued_at < now() - r.tombstone_retention + margin)
        FOR UPDATE OF o SKIP LOCKED
    LOOP
        e := candidate.side;
        reason := format('not sent: it waited longer than the far node remembers ended conversations (its '
                         'tombstone_retention, %s), and could reach it as new', candidate.retention);
        WITH withheld AS (
            DELETE FROM broker.transmission_queue t
            WHERE t.to_service = e.far_service AND t.priority = e.priority
              AND t.conversation_handle = e.conversation_handle
            RETURNING t.*
        ), lettered AS (
            INSERT INTO broker.dead_letters (queue_name, queue_position, conversation_handle, conversation_id,
                                             message_sequence_number, message_type, body, enqueued_at,
                                             failed_attempts, reason, traceparent)
            SELECT q.name, 0, w.conversation_handle, w.conversation_id, w.message_sequence_number, mt.name, w.body,
                   w.enqueued_at, w.attempts, reason, w.traceparent
            FROM withheld w
            JOIN broker.message_types mt USING (message_type_id)
            JOIN broker.queues q ON q.queue_id = e.queue_id
            RETURNING message_sequence_number
        )
        SELECT min(message_sequence_number), max(message_sequence_number) INTO first_number, last_number
        FROM lettered;
        UPDATE broker.endpoints SET state = 'error', timer_at = NULL WHERE conversation_handle = e.conversation_handle;
        PERFORM broker._enqueue(e, 0, (broker._message_type('broker.error')).message_type_id,
                                broker._error_body(-5, format('messages %s to %s were %s', first_number, last_number,
                                                              reason)));
        PERFORM broker._record_lost_messages(e, 'sent', first_number, last_number, 'withheld');
        stopped := stopped + 1;
    END LOOP;
    RETURN stopped;
END $$;

-- Forgets the acknowledged messages older than broker.node.resend_window, at
-- most max_messages of them; returns how many.  A running relay calls it every
-- minute.
CREATE FUNCTION broker.forget_acknowledged_messages(max_messages integer DEFAULT 100000) RETURNS integer
LANGUAGE sql AS $$
    WITH due AS (
        SELECT k.ctid FROM broker.acknowledged_messages k
        WHERE k.acknowledged_at < now() - (SELECT n.resend_window FROM broker.node n)
        LIMIT max_messages
    ), gone AS (
        DELETE FROM broker.acknowledged_messages k WHERE k.ctid = ANY (ARRAY(SELECT d.ctid FROM due d))
        RETURNING 1
    )
    SELECT count(*)::integer FROM gone;
$$;

-- A destination could not be reached: the conversations of one lane of a relay
-- (or a single one) waiting for it get the reason in words and their next
-- attempt after the relay's back-off, in one row however many messages wait.
-- Failures of addresses no longer routed to are forgotten.
CREATE FUNCTION broker.record_transport_failure(destination text, first_handle uuid, last_handle uuid, reason text,
                                                retry_after interval) RETURNS void
LANGUAGE sql AS $$
    DELETE FROM broker.transmission_failures f
    WHERE NOT EXISTS (SELECT 1 FROM broker.routes r WHERE r.address = f.address);
    INSERT INTO broker.transmission_failures AS f
    VALUES (destination, first_handle, last_handle, 1, now(), now() + retry_after, reason)
    ON CONFLICT (address, first_handle, last_handle) DO UPDATE
    SET attempts = f.attempts + 1, failed_at = excluded.failed_at, next_attempt_at = excluded.next_attempt_at,
        reason = excluded.reason;
$$;
