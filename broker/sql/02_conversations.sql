-- Conversations inside one database: endpoints, groups, the destination
-- queues, and the API an application calls (begin_dialog, send, receive,
-- end_conversation, timers and lifetimes).

------------------------------------------------------------------------------
-- Traces
------------------------------------------------------------------------------

-- A W3C trace context (https://www.w3.org/TR/trace-context/), version 00: the
-- trace a message belongs to and the span it was last handed on from.  It is
-- checked where it comes in, once per trace: the setting of a sending
-- transaction (broker._traceparent) and an arriving batch
-- (broker.accept_transport_batch).  The tables keep it as text: checked for
-- every message stored, it cost a tenth of a transfer's speed.
CREATE DOMAIN broker.traceparent AS text
    CONSTRAINT traceparent_is_w3c_version_00 CHECK (
        VALUE ~ '^00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$'
        AND substr(VALUE, 4, 32) <> repeat('0', 32) AND substr(VALUE, 37, 16) <> repeat('0', 16));

-- The trace of the messages a transaction sends: the setting
-- broker.traceparent (SET LOCAL broker.traceparent = '00-...'), NULL when it
-- is not set or empty.  Each message sent takes it when it is queued.
CREATE FUNCTION broker._traceparent() RETURNS broker.traceparent
LANGUAGE sql STABLE AS $$
    SELECT nullif(current_setting('broker.traceparent', true), '')::broker.traceparent
$$;

------------------------------------------------------------------------------
-- Conversations
------------------------------------------------------------------------------

-- A receive locks one group row; every message of the group waits for it.
CREATE TABLE broker.conversation_groups (
    conversation_group_id  uuid PRIMARY KEY,
    queue_id               integer NOT NULL REFERENCES broker.queues
);

-- Service Broker's BROKER PRIORITY: a conversation side created for a contract
-- between a local and a far service takes the priority (1 to 10) of the most
-- specific match, the contract first, then the local service, then the far
-- one; a name left NULL matches any.  Without a match it is 5.  A side keeps
-- the priority it was created with.
CREATE TABLE broker.broker_priorities (
    name                 text PRIMARY KEY,
    priority             smallint NOT NULL CHECK (priority BETWEEN 1 AND 10),
    contract_name        text,
    local_service_name   text,
    remote_service_name  text,
    UNIQUE NULLS NOT DISTINCT (contract_name, local_service_name, remote_service_name)
);

-- One side of a conversation.  A local conversation has both endpoints here.
-- send_sequence is the last number this side sent; receive_sequence the last
-- number it stored without a gap from the far side.  Endpoints are updated
-- with every message sent or accepted: free space on each page lets those
-- updates stay on the page (HOT), without index writes.
CREATE TABLE broker.endpoints (
    conversation_handle    uuid PRIMARY KEY,
    conversation_id        uuid NOT NULL,
    is_initiator           boolean NOT NULL,
    conversation_group_id  uuid NOT NULL REFERENCES broker.conversation_groups,
    service_id             integer NOT NULL REFERENCES broker.services,
    queue_id               integer NOT NULL REFERENCES broker.queues,
    far_service            text NOT NULL,
    far_is_local           boolean NOT NULL,
    far_broker_instance    uuid,
    contract_id            integer NOT NULL REFERENCES broker.contracts,
    state                  text NOT NULL DEFAULT 'conversing' CHECK (state IN
                               ('conversing', 'disconnected_inbound', 'disconnected_outbound', 'error', 'closed')),
    send_sequence          bigint NOT NULL DEFAULT 0,
    receive_sequence       bigint NOT NULL DEFAULT 0,
    expires_at             timestamptz,
    timer_at               timestamptz,
    created_at             timestamptz NOT NULL DEFAULT now(),
    closed_at              timestamptz,
    -- The latest delivery time of a message this side holds (broker._transmit).
    held_until             timestamptz,
    -- Its messages are received, and sent to another node, before those of a
    -- lower priority (see broker.broker_priorities).
    priority               smallint NOT NULL DEFAULT 5,
    UNIQUE (conversation_id, is_initiator)
) WITH (fillfactor = 70);
CREATE INDEX endpoints_group ON broker.endpoints (conversation_group_id);
CREATE INDEX endpoints_timer_due ON broker.endpoints (timer_at) WHERE timer_at IS NOT NULL;
CREATE INDEX endpoints_lifetime_due ON broker.endpoints (expires_at)
    WHERE expires_at IS NOT NULL AND state IN ('conversing', 'disconnected_inbound', 'disconnected_outbound');

-- The tombstone of a forgotten endpoint whose far side is remote (see
-- 06_hygiene.sql): its messages, sent again, are acknowledged, not delivered.
CREATE TABLE broker.forgotten_conversations (
    conversation_id      uuid NOT NULL,
    is_initiator         boolean NOT NULL,
    far_broker_instance  uuid NOT NULL,
    receive_sequence     bigint NOT NULL,
    forgotten_at         timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (conversation_id, is_initiator)
);
CREATE INDEX forgotten_conversations_age ON broker.forgotten_conversations (forgotten_at);

------------------------------------------------------------------------------
-- Destination queue, dead letters
------------------------------------------------------------------------------

-- queue_position is commit-ordered (see broker._next_queue_position).
-- message_sequence_number 0 marks a notice raised by this node itself (a
-- dialog timer, an expired lifetime, a quarantine, a refusal); far-side
-- messages count from 1.  delivery_count is how often a message was handed
-- out under a lease.
--
-- A notice is received after the far side's messages that were waiting when
-- it was raised: notice_after holds the number of the last of them.  Within a
-- conversation messages come in the order of coalesce(notice_after,
-- message_sequence_number), a notice after the far side's message of the same
-- number, notices among themselves in the order they were raised; the index
-- queue_messages_in_order is that order.
--
-- Queue tables are written and emptied all day: vacuum them after a small
-- share of dead rows rather than the default fifth of the table, and without
-- the cost-based pauses, so a steady stream reuses the same pages.  Rows
-- inserted are soon deleted: insertions alone never call for a vacuum.
CREATE TABLE broker.queue_messages (
    queue_id                 integer NOT NULL,
    queue_position           bigint NOT NULL,
    conversation_group_id    uuid NOT NULL,
    conversation_handle      uuid NOT NULL,
    conversation_id          uuid NOT NULL,
    message_sequence_number  bigint NOT NULL,
    message_type_id          integer NOT NULL,
    body                     bytea,
    enqueued_at              timestamptz NOT NULL DEFAULT now(),
    received_at              timestamptz,
    failed_attempts          integer NOT NULL DEFAULT 0,
    delivery_count           integer NOT NULL DEFAULT 0,
    notice_after             bigint,
    priority                 smallint NOT NULL DEFAULT 5,  -- the receiving endpoint's
    traceparent              text,  -- a broker.traceparent
    PRIMARY KEY (queue_id, queue_position)
) WITH (autovacuum_vacuum_scale_factor = 0.01, autovacuum_vacuum_threshold = 1000,
        autovacuum_vacuum_insert_threshold = -1, autovacuum_vacuum_cost_delay = 0);
CREATE INDEX queue_messages_in_order ON broker.queue_messages
    (conversation_group_id, conversation_handle, (coalesce(notice_after, message_sequence_number)),
     (notice_after IS NOT NULL), queue_position);
-- A receive starts from the oldest waiting messages of the highest priority in
-- its queue: an index of exactly those keeps that a short walk, however many
-- received messages a retention queue keeps and whatever the planner's
-- statistics say of them.
CREATE INDEX queue_messages_waiting ON broker.queue_messages (queue_id, priority DESC, queue_position)
    WHERE received_at IS NULL;

CREATE TABLE broker.dead_letters (
    dead_letter_id           bigserial PRIMARY KEY,
    queue_name               text NOT NULL,
    queue_position           bigint NOT NULL,
    conversation_handle      uuid NOT NULL,
    conversation_id          uuid NOT NULL,
    message_sequence_number  bigint NOT NULL,
    message_type             text NOT NULL,
    body                     bytea,
    enqueued_at              timestamptz NOT NULL,
    failed_attempts          integer NOT NULL,
    reason                   text NOT NULL,
    dead_lettered_at         timestamptz NOT NULL DEFAULT now(),
    traceparent              text
);

-- What each numbered send carried, to recognise a retry.
CREATE TABLE broker.numbered_sends (
    conversation_handle  uuid NOT NULL REFERENCES broker.endpoints ON DELETE CASCADE,
    sequence_number      bigint NOT NULL,
    content_sha256       bytea NOT NULL,
    PRIMARY KEY (conversation_handle, sequence_number)
);

CREATE TYPE broker.received_message AS (
    queue_position           bigint,
    conversation_group_id    uuid,
    conversation_handle      uuid,
    conversation_id          uuid,
    message_sequence_number  bigint,
    service_name             text,
    contract_name            text,
    message_type             text,
    body                     bytea,
    enqueued_at              timestamptz,
    traceparent              text
);

CREATE VIEW broker.conversation_endpoints AS
SELECT e.conversation_handle, e.conversation_id, e.conversation_group_id, e.is_initiator,
       s.name AS service_name, q.name AS queue_name, e.far_service, e.far_is_local, e.far_broker_instance,
       c.name AS contract_name, e.state, e.send_sequence, e.receive_sequence,
       e.expires_at, e.timer_at, e.created_at, e.closed_at, e.priority
FROM broker.endpoints e
JOIN broker.services s USING (service_id)
JOIN broker.queues q ON q.queue_id = e.queue_id
JOIN broker.contracts c USING (contract_id);

CREATE VIEW broker.queue_status AS
SELECT q.name AS queue_name,
       CASE WHEN q.is_enabled THEN 'enabled' ELSE 'disabled' END AS status,
       q.retention, q.poison_threshold,
       coalesce(m.depth, 0) AS depth,
       now() - m.oldest_enqueued_at AS oldest_message_age,
       (SELECT count(DISTINCT l.pid) FROM pg_locks l
        WHERE l.locktype = 'advisory' AND l.classid = 1651663723 AND l.objid = q.queue_id
          AND l.objsubid = 2 AND l.granted) AS readers,
       (SELECT count(*) FROM broker.dead_letters d WHERE d.queue_name = q.name) AS dead_letters
FROM broker.queues q
LEFT JOIN LATERAL (
    SELECT count(*) AS depth, min(enqueued_at) AS oldest_enqueued_at
    FROM broker.queue_messages qm WHERE qm.queue_id = q.queue_id AND qm.received_at IS NULL
) m ON true;

------------------------------------------------------------------------------
-- Positions
------------------------------------------------------------------------------

-- A commit-ordered position: the writer's transaction id in the high bits and
-- a counter within the transaction in the low 20 bits.  Every row with a
-- position below broker.committed_position_horizon() was written by a
-- transaction that has already finished, so a bulk reader that reads up to the
-- horizon never later sees a newly committed position below what it has read
-- (invariant 6).  A transaction may enqueue at most 1,048,575 messages.
CREATE FUNCTION broker._next_queue_position() RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    counter integer := coalesce(nullif(current_setting('broker.position_counter', true), ''), '0')::integer + 1;
BEGIN
    IF counter >= 1048576 THEN
        PERFORM broker._raise('BR050', 'a transaction may enqueue at most 1048575 messages');
    END IF;
    PERFORM set_config('broker.position_counter', counter::text, true);
    RETURN (pg_current_xact_id()::text::bigint << 20) | counter;
END $$;

-- n commit-ordered positions (see broker._next_queue_position): returns the
-- first; the others follow it one by one.
CREATE FUNCTION broker._next_queue_positions(n integer) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    first integer := coalesce(nullif(current_setting('broker.position_counter', true), ''), '0')::integer + 1;
BEGIN
    IF first + n - 1 >= 1048576 THEN
        PERFORM broker._raise('BR050', 'a transaction may enqueue at most 1048575 messages');
    END IF;
    PERFORM set_config('broker.position_counter', (first + n - 1)::text, true);
    RETURN (pg_current_xact_id()::text::bigint << 20) | first;
END $$;

CREATE FUNCTION broker.committed_position_horizon() RETURNS bigint
LANGUAGE sql STABLE AS $$
    SELECT pg_snapshot_xmin(pg_current_snapshot())::text::bigint << 20
$$;
COMMENT ON FUNCTION broker.committed_position_horizon() IS
    'Every destination-queue row below this position was written by a finished transaction; bulk readers read below it.';

------------------------------------------------------------------------------
-- Delivering and transmitting
------------------------------------------------------------------------------

-- Puts a message in the receiver's queue, with a notification on channel
-- broker_queue with the queue's id, which wakes REST readers that wait for it
-- (PostgreSQL sends one per queue per transaction, however many messages it
-- enqueued).  A notice (sequence_number 0) records the last number received
-- from the far side, after which it is received.
CREATE FUNCTION broker._enqueue(receiver broker.endpoints, sequence_number bigint, message_type_id integer,
                                body bytea, traceparent text DEFAULT NULL)
RETURNS void
LANGUAGE sql AS $$
    INSERT INTO broker.queue_messages (queue_id, queue_position, conversation_group_id, conversation_handle,
                                       conversation_id, message_sequence_number, message_type_id, body, notice_after,
                                       priority, traceparent)
    VALUES (receiver.queue_id, broker._next_queue_position(), receiver.conversation_group_id,
            receiver.conversation_handle, receiver.conversation_id, sequence_number, message_type_id, body,
            CASE WHEN sequence_number = 0 THEN receiver.receive_sequence END, receiver.priority, traceparent);
    SELECT pg_notify('broker_queue', receiver.queue_id::text);
$$;

-- Locks every local endpoint of a conversation, the initiator's first, and
-- returns the one for the handle.  All writers lock in this order, so two
-- transactions on the two sides of a local conversation cannot deadlock.
CREATE FUNCTION broker._lock_endpoint(handle uuid) RETURNS broker.endpoints
LANGUAGE plpgsql AS $$
DECLARE
    e broker.endpoints;
    result broker.endpoints;
BEGIN
    FOR e IN
        SELECT * FROM broker.endpoints
        WHERE conversation_id = (SELECT conversation_id FROM broker.endpoints
                                 WHERE conversation_handle = broker._require('conversation_handle', handle))
        ORDER BY is_initiator DESC
        FOR UPDATE
    LOOP
        IF e.conversation_handle = handle THEN
            result := e;
        END IF;
    END LOOP;
    IF result.conversation_handle IS NULL THEN
        PERFORM broker._raise('BR005', format('unknown conversation %s', handle));
    END IF;
    RETURN result;
END $$;

-- The far endpoint of a local conversation, or NULL when the far side is remote.
CREATE FUNCTION broker._far_endpoint(e broker.endpoints) RETURNS broker.endpoints
LANGUAGE sql STABLE AS $$
    SELECT * FROM broker.endpoints
    WHERE conversation_id = e.conversation_id AND is_initiator <> e.is_initiator
$$;

-- Stores message number sequence_number from the far side at a locked local
-- endpoint, applying what system messages do to its state.  The caller has
-- checked that sequence_number comes next (invariant 3), except that a
-- broker.error may skip numbers (see broker._transmit_error).  traceparent
-- is the message's trace.
CREATE FUNCTION broker._deliver(receiver broker.endpoints, sequence_number bigint, mt broker.message_types,
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
    ELSIF mt.name = 'broker.renumbered' THEN  -- the far side went back and numbered past what is here
        PERFORM broker._record_lost_messages(receiver, 'received',
                                             (convert_from(body, 'UTF8')::jsonb ->> 'first_number')::bigint,
                                             (convert_from(body, 'UTF8')::jsonb ->> 'last_number')::bigint,
                                             'renumbered');
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

-- Numbers a message from a locked endpoint and hands it to the far side:
-- delivered in this transaction when the far side is local, otherwise put
-- on the transmission queue.  A message with a delivery time to come is held
-- until then, and so is every later message of its side of the conversation
-- while one is held, whatever the far side: each waits in the transmission
-- queue, due at the latest delivery time (held_until) so far.  The relay sends
-- a remote one once it is due; broker._fire_due_events delivers a local one,
-- and forgets held_until when none is left.  Returns the message's sequence
-- number.
CREATE FUNCTION broker._transmit(sender broker.endpoints, mt broker.message_types, body bytea,
                                 deliver_at timestamptz DEFAULT NULL)
RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    sequence_number bigint := sender.send_sequence + 1;
    hold_until timestamptz := CASE WHEN deliver_at > clock_timestamp() THEN greatest(deliver_at, sender.held_until)
                                   ELSE sender.held_until END;
    far broker.endpoints;
BEGIN
    UPDATE broker.endpoints e SET send_sequence = sequence_number, held_until = hold_until
    WHERE e.conversation_handle = sender.conversation_handle;
    IF sender.far_is_local AND hold_until IS NULL THEN
        far := broker._far_endpoint(sender);
        PERFORM broker._deliver(far, sequence_number, mt, body, broker._traceparent());
    ELSE
        INSERT INTO broker.transmission_queue (conversation_handle, message_sequence_number, conversation_id,
                                               to_service, message_type_id, body, next_attempt_at, priority,
                                               traceparent)
        VALUES (sender.conversation_handle, sequence_number, sender.conversation_id,
                sender.far_service, mt.message_type_id, body, greatest(hold_until, now()), sender.priority,
                broker._traceparent());
        IF NOT sender.far_is_local THEN
            PERFORM pg_notify('broker_transmission_queue', '');
        END IF;
    END IF;
    RETURN sequence_number;
END $$;

-- Removes what waits in an endpoint's own queue and marks it closed.
CREATE FUNCTION broker._close_endpoint(e broker.endpoints) RETURNS void
LANGUAGE sql AS $$
    DELETE FROM broker.queue_messages
    WHERE conversation_group_id = e.conversation_group_id AND conversation_handle = e.conversation_handle;
    UPDATE broker.endpoints SET state = 'closed', closed_at = now(), timer_at = NULL
    WHERE conversation_handle = e.conversation_handle;
$$;

CREATE FUNCTION broker._error_body(error_code integer, error_description text) RETURNS bytea
LANGUAGE sql IMMUTABLE AS $$
    SELECT convert_to(jsonb_build_object('code', error_code, 'description', error_description)::text, 'UTF8')
$$;

-- Sends broker.error to the far side of a locked endpoint.  What this side
-- had not transmitted yet is dropped first, as Service Broker does: the far
-- side must not act on work that the error cancels.  The error keeps the next
-- number, and the far side accepts a broker.error across the numbers dropped
-- (it is the last message of its direction: nothing can come into them).
-- Numbering the error into the dropped numbers instead would not do: a
-- dropped message may already be stored at the far node, by a batch whose
-- acknowledgement is still on its way, and the error would be discarded
-- there as a duplicate.
CREATE FUNCTION broker._transmit_error(sender broker.endpoints, error_code integer, error_description text)
RETURNS bigint
LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM broker.transmission_queue t
    WHERE t.to_service = sender.far_service AND t.priority = sender.priority
      AND t.conversation_handle = sender.conversation_handle;
    sender.held_until := NULL;  -- what was held is dropped, and the error goes now
    RETURN broker._transmit(sender, broker._message_type('broker.error'),
                            broker._error_body(error_code, error_description));
END $$;

-- Ends a locked endpoint's conversation because this node cannot go on with it:
-- the local application sees a broker.error notice, the far side a broker.error
-- (sent by broker._transmit_error).
CREATE OR REPLACE FUNCTION broker._fail_conversation(e broker.endpoints, error_code integer, error_description text)
RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    far_state text := (broker._far_endpoint(e)).state;
BEGIN
    IF NOT e.far_is_local OR far_state IN ('conversing', 'disconnected_outbound') THEN
        PERFORM broker._transmit_error(e, error_code, error_description);
    END IF;
    UPDATE broker.endpoints SET state = 'error', timer_at = NULL WHERE conversation_handle = e.conversation_handle;
    PERFORM broker._enqueue(e, 0, (broker._message_type('broker.error')).message_type_id,
                            broker._error_body(error_code, error_description));
END $$;

------------------------------------------------------------------------------
-- Priorities
------------------------------------------------------------------------------

CREATE FUNCTION broker.create_broker_priority(name text, priority integer, contract text DEFAULT NULL,
                                              local_service text DEFAULT NULL, remote_service text DEFAULT NULL)
RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM broker._check_name('broker priority', name);
    IF priority IS NULL OR priority NOT BETWEEN 1 AND 10 THEN
        PERFORM broker._raise('BR050', format('priority must be 1 to 10, got %s', coalesce(priority::text, 'NULL')));
    END IF;
    INSERT INTO broker.broker_priorities
    VALUES (name, priority,
            CASE WHEN contract IS NOT NULL THEN broker._check_name('contract', contract) END,
            CASE WHEN local_service IS NOT NULL THEN broker._check_name('service', local_service) END,
            CASE WHEN remote_service IS NOT NULL THEN broker._check_name('service', remote_service) END);
EXCEPTION WHEN unique_violation THEN
    PERFORM broker._raise('BR040', format('broker priority %L, or one for the same contract and services, already exists',
        name));
END $$;
COMMENT ON FUNCTION broker.create_broker_priority(text, integer, text, text, text) IS
    'Gives conversation sides created from now on for the contract, local and remote service given (NULL: any) a priority from 1 to 10 (default 5): their messages are received and transmitted first.';

CREATE FUNCTION broker.drop_broker_priority(name text) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM broker.broker_priorities p WHERE p.name = drop_broker_priority.name;
    IF NOT FOUND THEN
        PERFORM broker._raise('BR005', format('unknown broker priority %L', name));
    END IF;
END $$;
COMMENT ON FUNCTION broker.drop_broker_priority(text) IS
    'Drops a broker priority; conversation sides that have it keep it.';

-- The priority of a new conversation side (see broker.broker_priorities).
-- plpgsql rather than sql: its plan is kept for the session; as sql it was
-- planned again in each begin_dialog, which then took twice as long.
CREATE FUNCTION broker._priority(contract text, local_service text, remote_service text) RETURNS smallint
LANGUAGE plpgsql STABLE AS $$
BEGIN
    RETURN coalesce((SELECT p.priority FROM broker.broker_priorities p
                     WHERE coalesce(p.contract_name = contract, true)
                       AND coalesce(p.local_service_name = local_service, true)
                       AND coalesce(p.remote_service_name = remote_service, true)
                     ORDER BY p.contract_name IS NULL, p.local_service_name IS NULL, p.remote_service_name IS NULL
                     LIMIT 1), 5::smallint);
END $$;

------------------------------------------------------------------------------
-- Conversation API
------------------------------------------------------------------------------

-- The new conversation joins the group of related_conversation_group, or of
-- the local conversation side related_conversation (Service Broker's
-- RELATED_CONVERSATION), which must be in the initiating service's queue.
CREATE FUNCTION broker.begin_dialog(from_service text, to_service text, contract text,
                                    lifetime interval DEFAULT NULL, related_conversation_group uuid DEFAULT NULL,
                                    related_conversation uuid DEFAULT NULL)
RETURNS uuid
LANGUAGE plpgsql AS $$
DECLARE
    initiator_service broker.services := broker._service(from_service);
    dialog_contract integer := broker._contract_id(contract);
    target_service broker.services;
    far_instance uuid;
    conversation uuid := gen_random_uuid();
    handle uuid := gen_random_uuid();
    group_id uuid := coalesce(related_conversation_group, gen_random_uuid());
    group_queue integer;
    target_group uuid := gen_random_uuid();
BEGIN
    IF lifetime <= interval '0' THEN
        PERFORM broker._raise('BR050', format('lifetime must be positive, got %s', lifetime));
    END IF;
    IF related_conversation IS NOT NULL THEN
        IF related_conversation_group IS NOT NULL THEN
            PERFORM broker._raise('BR050', 'give related_conversation or related_conversation_group, not both');
        END IF;
        SELECT e.conversation_group_id INTO group_id FROM broker.endpoints e
        WHERE e.conversation_handle = related_conversation;
        IF NOT FOUND THEN
            PERFORM broker._raise('BR005', format('unknown conversation %s', related_conversation));
        END IF;
    END IF;
    SELECT * INTO target_service FROM broker.services WHERE name = broker._require('to_service', to_service);
    IF FOUND THEN
        IF NOT EXISTS (SELECT 1 FROM broker.service_contracts sc
                       WHERE sc.service_id = target_service.service_id AND sc.contract_id = dialog_contract) THEN
            PERFORM broker._raise('BR011', format('service %L does not accept contract %L', to_service, contract));
        END IF;
    ELSE
        SELECT r.broker_instance INTO far_instance FROM broker.routes r WHERE r.service_name = to_service;
        IF NOT FOUND THEN
            PERFORM broker._raise('BR001', format('unknown service %L: no local service and no route by that name', to_service),
                'create the service, or a route to the node that has it');
        END IF;
    END IF;

    SELECT queue_id INTO group_queue FROM broker.conversation_groups WHERE conversation_group_id = group_id;
    IF NOT FOUND THEN
        INSERT INTO broker.conversation_groups VALUES (group_id, initiator_service.queue_id);
    ELSIF group_queue <> initiator_service.queue_id THEN
        PERFORM broker._raise('BR050', format('conversation group %s belongs to another queue', group_id));
    END IF;

    INSERT INTO broker.endpoints (conversation_handle, conversation_id, is_initiator, conversation_group_id,
                                  service_id, queue_id, far_service, far_is_local, far_broker_instance,
                                  contract_id, expires_at, priority)
    VALUES (handle, conversation, true, group_id, initiator_service.service_id, initiator_service.queue_id,
            to_service, target_service.service_id IS NOT NULL, far_instance, dialog_contract, now() + lifetime,
            broker._priority(contract, from_service, to_service));

    IF target_service.service_id IS NOT NULL THEN
        INSERT INTO broker.conversation_groups VALUES (target_group, target_service.queue_id);
        INSERT INTO broker.endpoints (conversation_handle, conversation_id, is_initiator, conversation_group_id,
                                      service_id, queue_id, far_service, far_is_local, contract_id, expires_at,
                                      priority)
        VALUES (gen_random_uuid(), conversation, false, target_group, target_service.service_id,
                target_service.queue_id, from_service, true, dialog_contract, now() + lifetime,
                broker._priority(contract, to_service, from_service));
    END IF;
    RETURN handle;
END $$;
COMMENT ON FUNCTION broker.begin_dialog(text, text, text, interval, uuid, uuid) IS
    'Begins a conversation from a local service to a local or routed service; returns the initiator''s handle.';

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
CREATE FUNCTION broker.send(conversation_handle uuid, message_type text, body bytea DEFAULT NULL,
                            deliver_after interval DEFAULT NULL, deliver_at timestamptz DEFAULT NULL)
RETURNS bigint
LANGUAGE plpgsql AS $$
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
    FROM broker.message_types t, broker.contract_message_types cmt
    WHERE due IS NULL
      AND e.conversation_handle = send.conversation_handle AND e.state = 'conversing' AND NOT e.far_is_local
      AND (e.expires_at IS NULL OR e.expires_at > clock_timestamp())
      AND t.name = message_type AND t.validation = 'none' AND t.name NOT LIKE 'broker.%'
      AND cmt.contract_id = e.contract_id AND cmt.message_type_id = t.message_type_id
      AND cmt.sent_by IN ('any', CASE WHEN e.is_initiator THEN 'initiator' ELSE 'target' END)
      AND coalesce(octet_length(body), 0) <= (SELECT max_message_bytes FROM broker.node)
    RETURNING e.conversation_handle, e.send_sequence, e.conversation_id, e.far_service, t.message_type_id,
              e.held_until, e.priority
    INTO numbered;
    IF FOUND THEN
        INSERT INTO broker.transmission_queue (conversation_handle, message_sequence_number, conversation_id,
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
    RETURN broker._transmit(sender, mt, body, due);
END $$;
COMMENT ON FUNCTION broker.send(uuid, text, bytea, interval, timestamptz) IS
    'Sends a message on a conversation, at once or held until its delivery time; returns its sequence number.  Durable when the caller commits.';

-- When a message given deliver_after (from now) or deliver_at is to be
-- delivered: BR050 for both, or for a time without end.
CREATE FUNCTION broker._delivery_time(deliver_after interval, deliver_at timestamptz) RETURNS timestamptz
LANGUAGE plpgsql AS $$
BEGIN
    IF deliver_after IS NOT NULL AND deliver_at IS NOT NULL THEN
        PERFORM broker._raise('BR050', 'give deliver_after or deliver_at, not both');
    END IF;
    IF NOT isfinite(coalesce(deliver_at, now() + deliver_after)) THEN
        PERFORM broker._raise('BR050', 'a delivery time must be finite');
    END IF;
    RETURN coalesce(deliver_at, clock_timestamp() + deliver_after);
END $$;

-- Locks every local endpoint of the conversations whose handles are given,
-- conversation by conversation and the initiator's endpoint first: the order
-- of broker._lock_endpoint and of an arriving batch, so that writers of many
-- conversations at once and writers of one cannot deadlock.  The
-- conversations are looked up as an array, one probe of the index each: as a
-- semi-join, the plan kept for the function could scan every endpoint.
CREATE FUNCTION broker._lock_conversations(handles uuid[]) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM FROM (SELECT FROM broker.endpoints e
                  WHERE e.conversation_id = ANY (ARRAY(SELECT l.conversation_id FROM broker.endpoints l
                                                       WHERE l.conversation_handle = ANY (handles)))
                  ORDER BY e.conversation_id, e.is_initiator DESC
                  FOR NO KEY UPDATE) locked;
END $$;

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
    trace text := broker._traceparent();  -- checked once, not for each message
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
               e.conversation_id, e.far_service, e.far_is_local, e.is_initiator, e.held_until, e.priority, g.b
        FROM unnest(conversation_handles, bodies) WITH ORDINALITY AS g(h, b, k)
        JOIN broker.endpoints e ON e.conversation_handle = g.h
        WHERE e.conversation_handle = ANY (conversation_handles)
    ), queued AS (
        INSERT INTO broker.transmission_queue (conversation_handle, message_sequence_number, conversation_id,
                                               to_service, message_type_id, body, next_attempt_at, priority,
                                               traceparent)
        SELECT n.h, n.sequence_number, n.conversation_id, n.far_service, mt.message_type_id, n.b,
               greatest(n.held_until, now()), n.priority, trace
        FROM numbered n WHERE NOT n.far_is_local
    ), delivered AS (
        INSERT INTO broker.queue_messages (queue_id, queue_position, conversation_group_id, conversation_handle,
                                           conversation_id, message_sequence_number, message_type_id, body, priority,
                                           traceparent)
        SELECT far.queue_id, first_position + row_number() OVER (ORDER BY n.k) - 1, far.conversation_group_id,
               far.conversation_handle, far.conversation_id, n.sequence_number, mt.message_type_id, n.b, far.priority,
               trace
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

CREATE FUNCTION broker._content_sha256(message_type text, body bytea) RETURNS bytea
LANGUAGE sql IMMUTABLE AS $$
    SELECT sha256(convert_to(message_type, 'UTF8') || CASE WHEN body IS NULL THEN '\x00'::bytea
                                                             ELSE '\x01'::bytea || body END)
$$;

-- Sends message number sequence_number, chosen by the client, so that a
-- client can retry a send whose outcome it does not know: the same number
-- with the same content again is a no-op that returns false; the next number
-- sends and returns true.  Anything else raises BR021 with the number that
-- comes next in its DETAIL.  The delivery time is not part of the content: a
-- retry is the same message whatever it gives.
CREATE FUNCTION broker.send_numbered(conversation_handle uuid, sequence_number bigint, message_type text,
                                     body bytea DEFAULT NULL, deliver_after interval DEFAULT NULL,
                                     deliver_at timestamptz DEFAULT NULL)
RETURNS boolean
LANGUAGE plpgsql AS $$
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
COMMENT ON FUNCTION broker.send_numbered(uuid, bigint, text, bytea, interval, timestamptz) IS
    'Idempotent send: the client numbers the message; a retry with the same number and content is a no-op.';

-- A message of broker.send_numbered_batch as it is judged: repeat_of is the
-- position of the first message of the batch with the same conversation and
-- number; fresh, whether it is sent now; expected, the number that comes next
-- on its conversation when it is judged.
CREATE TYPE broker._judged_send AS (
    k bigint, conversation_handle uuid, sequence_number bigint, message_type text, body bytea, digest bytea,
    repeat_of bigint, fresh boolean, expected bigint
);

-- broker.send_numbered for many messages, in the order given, all or none:
-- whether each was sent now.  Each message is judged as broker.send_numbered
-- would judge it after the ones before it: a number already sent (or given
-- earlier in the batch) is a no-op when its content is the same; the next
-- number sends; anything else raises BR021 for the first such message.  The
-- messages sent now go through broker.send_batch, one call per run of one
-- message type.
CREATE FUNCTION broker.send_numbered_batch(conversation_handles uuid[], sequence_numbers bigint[],
                                           message_types text[], bodies bytea[])
RETURNS boolean[]
LANGUAGE plpgsql AS $$
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

------------------------------------------------------------------------------
-- Receiving: in conversation order, and never wedged by a lease
------------------------------------------------------------------------------

-- Locks the given group, or the group holding the oldest waiting message of
-- the highest priority that no other transaction holds (Service Broker hands
-- out the group of the highest priority first), and returns it; NULL when
-- there is none.  A group's messages then come in conversation order, whatever
-- their priorities.  The
-- head of the queue is walked by one statement that passes over the groups
-- other readers hold (SKIP LOCKED) or lease, however many there are.  Leases
-- are looked for message by message only when the queue has any.  A lease
-- committed before the group was locked is seen by the check that follows, and
-- then the walk looks for leases; none can be taken after the group is locked.
-- A group whose expired lease is ended here may have lost its messages
-- meanwhile: the expiry counts as a processing failure and can quarantine the
-- conversation, moving its messages to the dead letters.  Such a group is
-- passed over, and the walk goes on to the next.
CREATE OR REPLACE FUNCTION broker._lock_group(q broker.queues, requested_group uuid) RETURNS uuid
LANGUAGE plpgsql AS $$
DECLARE
    candidate uuid;
    leases_here boolean := EXISTS (SELECT 1 FROM broker.leases l WHERE l.queue_id = q.queue_id);
BEGIN
    IF requested_group IS NOT NULL THEN
        PERFORM 1 FROM broker.conversation_groups
        WHERE conversation_group_id = requested_group AND queue_id = q.queue_id
        FOR NO KEY UPDATE SKIP LOCKED;
        RETURN CASE WHEN FOUND AND broker._free_of_lease(q, requested_group) THEN requested_group END;
    END IF;
    LOOP
        SELECT g.conversation_group_id INTO candidate
        FROM broker.queue_messages m
        JOIN broker.conversation_groups g ON g.conversation_group_id = m.conversation_group_id
        WHERE m.queue_id = q.queue_id AND m.received_at IS NULL
          AND (NOT leases_here OR NOT EXISTS (SELECT 1 FROM broker.leases l
                                              WHERE l.conversation_group_id = m.conversation_group_id
                                                AND l.expires_at > clock_timestamp()))
        ORDER BY m.priority DESC, m.queue_position
        LIMIT 1
        FOR NO KEY UPDATE OF g SKIP LOCKED;
        IF candidate IS NULL OR NOT EXISTS (SELECT 1 FROM broker.leases l WHERE l.conversation_group_id = candidate) THEN
            RETURN candidate;
        END IF;
        -- Two statements: one snapshot for both would not see what the failure moved away.
        IF broker._free_of_lease(q, candidate) THEN
            IF EXISTS (SELECT 1 FROM broker.queue_messages m
                       WHERE m.conversation_group_id = candidate AND m.queue_id = q.queue_id AND m.received_at IS NULL)
            THEN
                RETURN candidate;
            END IF;
        END IF;
        leases_here := true;
    END LOOP;
END $$;

-- Waits up to wait_ms (-1: until there is one) for a group with messages and
-- locks it: the requested group when one is given, and then only once it has
-- messages of the requested conversation when one is given too.  Sleeps with
-- a growing interval (5 ms to 100 ms) while nothing is there: notifications
-- cannot reach a session inside a transaction.  A group found at the head of
-- the queue has messages, so only a requested group is looked at again.
CREATE FUNCTION broker._wait_for_group(q broker.queues, requested_group uuid, requested_handle uuid,
                                       wait_ms integer) RETURNS uuid
LANGUAGE plpgsql AS $$
DECLARE
    deadline timestamptz := CASE WHEN wait_ms <> -1 THEN clock_timestamp() + make_interval(secs => wait_ms / 1000.0) END;
    pause double precision := 0.005;
    locked_group uuid;
BEGIN
    IF wait_ms < -1 THEN
        PERFORM broker._raise('BR050', format('wait_ms must be -1 (wait until a message comes) or more, got %s',
            wait_ms));
    END IF;
    -- Marks this transaction as a reader of the queue (see broker.queue_status).
    PERFORM pg_advisory_xact_lock_shared(1651663723, q.queue_id);
    LOOP
        PERFORM broker._fire_due_events(q.queue_id);
        locked_group := broker._lock_group(q, requested_group);
        IF locked_group IS NOT NULL AND (requested_group IS NULL OR EXISTS (
                SELECT 1 FROM broker.queue_messages
                WHERE conversation_group_id = locked_group AND queue_id = q.queue_id AND received_at IS NULL
                  AND (requested_handle IS NULL OR conversation_handle = requested_handle))) THEN
            RETURN locked_group;
        END IF;
        EXIT WHEN clock_timestamp() >= deadline;  -- never when there is no deadline
        PERFORM pg_sleep(least(pause, extract(epoch FROM deadline - clock_timestamp())));
        pause := least(pause * 2, 0.1);
    END LOOP;
    RETURN NULL;
END $$;

-- The group to receive from: that of the conversation side handle when one is
-- given (BR005 when this queue holds no such side; BR050 when group_id is given
-- too and is not its group), else group_id.
CREATE FUNCTION broker._receiving_group(q broker.queues, group_id uuid, handle uuid) RETURNS uuid
LANGUAGE plpgsql STABLE AS $$
DECLARE
    handle_group uuid;
BEGIN
    IF handle IS NULL THEN
        RETURN group_id;
    END IF;
    SELECT e.conversation_group_id INTO handle_group FROM broker.endpoints e
    WHERE e.conversation_handle = handle AND e.queue_id = q.queue_id;
    IF NOT FOUND THEN
        PERFORM broker._raise('BR005', format('unknown conversation %s in queue %L', handle, q.name));
    END IF;
    IF handle_group <> group_id THEN
        PERFORM broker._raise('BR050', format('conversation %s is not in conversation group %s', handle, group_id));
    END IF;
    RETURN handle_group;
END $$;

-- A group's messages are picked by the group alone (a group belongs to one
-- queue), each conversation's in the order of broker.queue_messages_in_order
-- (notices after the messages they follow); the walk stops at max_messages,
-- and what is returned comes from the rows consumed (or kept, with retention)
-- rather than from reading them again.  The picked rows are consumed by their
-- positions as an array, one probe of the primary key each: as a join, the
-- plan kept for the function may scan the whole queue to find them.  The
-- names that go with each message are looked up once per endpoint of the
-- group, and the message types by key: joined row by row, they took a sixth of
-- a receive of 100.  As in Service Broker, a receive may name the conversation
-- (only its messages come, its group locked), take the whole group
-- (max_messages NULL) and wait until something comes (wait_ms -1).
CREATE FUNCTION broker.receive(queue text, max_messages integer DEFAULT 1, conversation_group uuid DEFAULT NULL,
                               wait_ms integer DEFAULT 0, conversation_handle uuid DEFAULT NULL)
RETURNS SETOF broker.received_message
LANGUAGE plpgsql AS $$
DECLARE
    q broker.queues := broker._enabled_queue(queue);
    requested_group uuid := broker._receiving_group(q, conversation_group, conversation_handle);
    locked_group uuid;
BEGIN
    IF max_messages < 1 THEN
        PERFORM broker._raise('BR050', format('max_messages must be at least 1 (or NULL for the whole group), got %s',
            max_messages));
    END IF;
    locked_group := broker._wait_for_group(q, requested_group, conversation_handle,
                                           broker._require('wait_ms', wait_ms));
    IF locked_group IS NULL THEN
        RETURN;
    END IF;
    -- Without retention every row of the queue waits (received rows are deleted):
    -- said so, the walk takes the group index alone, in its order.
    RETURN QUERY
    WITH picked AS (
        SELECT m.queue_position FROM broker.queue_messages m
        WHERE m.conversation_group_id = locked_group AND (NOT q.retention OR m.received_at IS NULL)
          AND (receive.conversation_handle IS NULL OR m.conversation_handle = receive.conversation_handle)
        ORDER BY m.conversation_handle, coalesce(m.notice_after, m.message_sequence_number),
                 m.notice_after IS NOT NULL, m.queue_position
        LIMIT max_messages
    ), consumed AS (
        DELETE FROM broker.queue_messages m
        WHERE NOT q.retention AND m.queue_id = q.queue_id AND m.queue_position = ANY (ARRAY(SELECT * FROM picked))
        RETURNING m.*
    ), retained AS (
        UPDATE broker.queue_messages m SET received_at = now()
        WHERE q.retention AND m.queue_id = q.queue_id AND m.queue_position = ANY (ARRAY(SELECT * FROM picked))
        RETURNING m.*
    ), names AS MATERIALIZED (  -- of the group's endpoints, once each
        SELECT e.conversation_handle,
               (SELECT s.name FROM broker.services s WHERE s.service_id = e.service_id) AS service_name,
               (SELECT c.name FROM broker.contracts c WHERE c.contract_id = e.contract_id) AS contract_name
        FROM broker.endpoints e
        WHERE e.conversation_group_id = locked_group
    )
    SELECT m.queue_position, m.conversation_group_id, m.conversation_handle, m.conversation_id,
           m.message_sequence_number, n.service_name, n.contract_name,
           (SELECT mt.name FROM broker.message_types mt WHERE mt.message_type_id = m.message_type_id), m.body,
           m.enqueued_at, m.traceparent
    FROM (SELECT * FROM consumed UNION ALL SELECT * FROM retained) m
    JOIN names n ON n.conversation_handle = m.conversation_handle
    ORDER BY m.conversation_handle, coalesce(m.notice_after, m.message_sequence_number),
             m.notice_after IS NOT NULL, m.queue_position;
END $$;
COMMENT ON FUNCTION broker.receive(text, integer, uuid, integer, uuid) IS
    'Locks one conversation group of a queue (or the one given, or that of the conversation given) and returns up to max_messages (NULL: all) of its messages in order; they are consumed when the caller commits.';

CREATE FUNCTION broker.get_conversation_group(queue text, wait_ms integer DEFAULT 0) RETURNS uuid
LANGUAGE sql AS $$
    SELECT broker._wait_for_group(broker._enabled_queue(queue), NULL, NULL, broker._require('wait_ms', wait_ms))
$$;
COMMENT ON FUNCTION broker.get_conversation_group(text, integer) IS
    'Locks the next conversation group with messages until the transaction ends and returns it (NULL if none).';

-- Records that processing the head message of a group failed (its transaction
-- rolled back, a lease was abandoned or expired).  At the queue's poison
-- threshold the message's conversation is quarantined: its waiting messages
-- move to broker.dead_letters and it ends with broker.error on both sides.
-- Returns true when it quarantined.  The head message is the first in the
-- order of broker.queue_messages_in_order, and its conversation is locked
-- before the message is: every writer locks a conversation's endpoints before
-- its messages (broker.end_conversation, say, which deletes them), so taking
-- them the other way round could deadlock with it.
CREATE OR REPLACE FUNCTION broker.report_processing_failure(queue text, conversation_group uuid, reason text)
RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    q broker.queues := broker._queue(queue);
    head broker.queue_messages;
    e broker.endpoints;
BEGIN
    SELECT m.* INTO head FROM broker.queue_messages m
    WHERE m.conversation_group_id = broker._require('conversation_group', conversation_group)
      AND m.queue_id = q.queue_id AND m.received_at IS NULL
    ORDER BY m.conversation_handle, coalesce(m.notice_after, m.message_sequence_number),
             m.notice_after IS NOT NULL, m.queue_position
    LIMIT 1;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    RETURN broker._count_failure(q, broker._lock_endpoint(head.conversation_handle), head, reason);
END $$;

-- Counts a failed attempt on a waiting message of a locked conversation side.
-- At the queue's poison threshold its conversation is quarantined (true).
CREATE FUNCTION broker._count_failure(q broker.queues, e broker.endpoints, message broker.queue_messages, reason text)
RETURNS boolean
LANGUAGE plpgsql AS $$
BEGIN
    UPDATE broker.queue_messages m SET failed_attempts = m.failed_attempts + 1
    WHERE m.queue_id = message.queue_id AND m.queue_position = message.queue_position AND m.received_at IS NULL
    RETURNING * INTO message;
    IF NOT FOUND OR message.failed_attempts < q.poison_threshold THEN  -- consumed or ended meanwhile, or not yet poison
        RETURN false;
    END IF;
    PERFORM broker._quarantine(q, e, message,
        format('processing failed %s times; last failure: %s', message.failed_attempts, coalesce(reason, 'not given')),
        format('message %s could not be processed after %s attempts and was moved to broker.dead_letters',
               message.message_sequence_number, message.failed_attempts));
    RETURN true;
END $$;

------------------------------------------------------------------------------
-- Dead letters
------------------------------------------------------------------------------

CREATE INDEX dead_letters_by_conversation ON broker.dead_letters (queue_name, conversation_handle,
                                                                  message_sequence_number);

-- A reader that receives in SQL and rolls back without calling
-- broker.report_processing_failure would be handed the same message forever.
-- Its transaction leaves a trace that outlives it: the message's row keeps, as
-- its xmax, the id of the last transaction that deleted it (or marked it
-- received).  While that row version lives on (the same xmin) and waits, a
-- different xmax, or the same one now rolled back, means that the transaction
-- seen before ended without taking the message: nothing else writes a
-- waiting message's row without making a new version of it.
--
-- broker.count_unreported_rollbacks, which a running node calls every second,
-- watches the head messages of the groups at the front of each queue (the
-- first max_messages that a receive would walk) that a receive has touched.
-- Once it has seen such an end, and grace later no failure was reported (the
-- same version, the same failed_attempts), it counts a failure for the message
-- as its reader would have: after waiting for the group, as a reader does.
-- Counting makes a new version, so an end is counted once; a reader that
-- reports within grace of its rollback is never counted twice.  Several
-- rollbacks within one grace count as one.  A rollback of anything else that
-- deletes or moves a waiting message (end_conversation, move_conversation,
-- purge_queue) counts as a failure too.
CREATE TABLE broker.watched_heads (
    queue_id         integer NOT NULL,
    queue_position   bigint NOT NULL,
    row_version      xid NOT NULL,  -- the xmin of the row seen
    failed_attempts  integer NOT NULL,
    last_taken_by    xid NOT NULL,  -- the xmax seen last
    ended_seen_at    timestamptz,   -- when a transaction that took it was first seen to have ended without it
    PRIMARY KEY (queue_id, queue_position)
);

-- Whether the transaction with this 32-bit id rolled back: the id of this
-- epoch, or of the one before when it is above the next id's low bits.
-- NULL once the status has been truncated away.
CREATE FUNCTION broker._rolled_back(transaction_id xid) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT pg_xact_status(full_id::text::xid8) = 'aborted'
    FROM (SELECT transaction_id::text::bigint AS low_bits,
                 pg_snapshot_xmax(pg_current_snapshot())::text::bigint AS next_id) ids,
         LATERAL (SELECT ((ids.next_id >> 32) - CASE WHEN ids.low_bits > (ids.next_id & 4294967295) THEN 1 ELSE 0 END)
                         * 4294967296 + ids.low_bits AS full_id) f
    WHERE ids.low_bits >= 3 AND f.full_id >= 0
$$;

-- Watches, then counts at most one failure (each in its own transaction, so
-- that waiting for one group never holds another); returns how many it counted.
CREATE FUNCTION broker.count_unreported_rollbacks(grace interval DEFAULT '2 seconds',
                                                  max_messages integer DEFAULT 1000) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    due record;
    e broker.endpoints;
    message broker.queue_messages;
BEGIN
    WITH heads AS (
        SELECT h.*
        FROM broker.queues q,
             LATERAL (SELECT DISTINCT m.conversation_group_id
                      FROM (SELECT m.conversation_group_id FROM broker.queue_messages m
                            WHERE m.queue_id = q.queue_id AND m.received_at IS NULL
                            ORDER BY m.priority DESC, m.queue_position
                            LIMIT broker._require('max_messages', max_messages)) m) g,
             LATERAL (SELECT m.queue_id, m.queue_position, m.failed_attempts, m.xmin, m.xmax
                      FROM broker.queue_messages m
                      WHERE m.conversation_group_id = g.conversation_group_id AND m.queue_id = q.queue_id
                        AND m.received_at IS NULL
                      ORDER BY m.conversation_handle, coalesce(m.notice_after, m.message_sequence_number),
                               m.notice_after IS NOT NULL, m.queue_position
                      LIMIT 1) h
        WHERE h.xmax <> '0'::xid
    ), forgotten AS (
        DELETE FROM broker.watched_heads w
        WHERE NOT EXISTS (SELECT 1 FROM heads h WHERE h.queue_id = w.queue_id AND h.queue_position = w.queue_position)
    )
    INSERT INTO broker.watched_heads AS w
    SELECT h.queue_id, h.queue_position, h.xmin, h.failed_attempts, h.xmax,
           CASE WHEN broker._rolled_back(h.xmax) THEN now() END
    FROM heads h
    ON CONFLICT (queue_id, queue_position) DO UPDATE
    SET row_version = excluded.row_version, failed_attempts = excluded.failed_attempts,
        last_taken_by = excluded.last_taken_by,
        ended_seen_at = CASE WHEN w.row_version <> excluded.row_version OR w.failed_attempts <> excluded.failed_attempts
                             THEN excluded.ended_seen_at
                             WHEN w.ended_seen_at IS NULL
                                  AND (w.last_taken_by <> excluded.last_taken_by OR broker._rolled_back(w.last_taken_by))
                             THEN now()
                             ELSE w.ended_seen_at END;

    SELECT q AS queue, w.queue_position, w.row_version, w.failed_attempts, m.conversation_group_id,
           m.conversation_handle
    INTO due
    FROM broker.watched_heads w
    JOIN broker.queues q ON q.queue_id = w.queue_id
    JOIN broker.queue_messages m ON m.queue_id = w.queue_id AND m.queue_position = w.queue_position
    WHERE w.ended_seen_at <= now() - grace
    ORDER BY w.ended_seen_at
    LIMIT 1;
    IF NOT FOUND THEN
        RETURN 0;
    END IF;
    -- Locked as a reader locks: the group (after its reader, if any), then the conversation.
    PERFORM set_config('lock_timeout', '1s', true);
    BEGIN
        PERFORM 1 FROM broker.conversation_groups WHERE conversation_group_id = due.conversation_group_id
        FOR NO KEY UPDATE;
        e := broker._lock_endpoint(due.conversation_handle);
    EXCEPTION WHEN lock_not_available THEN
        RETURN 0;  -- a reader still holds it: looked at again next time
    END;
    DELETE FROM broker.watched_heads
    WHERE queue_id = (due.queue).queue_id AND queue_position = due.queue_position;
    SELECT m.* INTO message FROM broker.queue_messages m
    WHERE m.queue_id = (due.queue).queue_id AND m.queue_position = due.queue_position
      AND m.xmin = due.row_version AND m.failed_attempts = due.failed_attempts AND m.received_at IS NULL;
    IF NOT FOUND THEN  -- taken, reported or changed meanwhile
        RETURN 0;
    END IF;
    PERFORM broker._count_failure(due.queue, e, message,
        'its reader rolled back without calling broker.report_processing_failure (counted by the node)');
    RETURN 1;
END $$;
COMMENT ON FUNCTION broker.count_unreported_rollbacks(interval, integer) IS
    'Watches the heads of the groups at the front of each queue and counts a processing failure (at most one a call) for one whose receive ended without taking it and without a report for grace; returns how many it counted.  A running node calls it every second.';

-- Moves the waiting messages of a locked conversation side, head (its first)
-- with head_reason and the others after it, to broker.dead_letters, and ends
-- the conversation with broker.error (-2, error_description) on both sides.
CREATE FUNCTION broker._quarantine(q broker.queues, e broker.endpoints, head broker.queue_messages, head_reason text,
                                   error_description text) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    moved_count integer;
BEGIN
    WITH moved AS (
        DELETE FROM broker.queue_messages m
        WHERE m.conversation_group_id = e.conversation_group_id AND m.conversation_handle = e.conversation_handle
          AND m.received_at IS NULL
        RETURNING m.*
    )
    INSERT INTO broker.dead_letters (queue_name, queue_position, conversation_handle, conversation_id,
                                     message_sequence_number, message_type, body, enqueued_at, failed_attempts, reason,
                                     traceparent)
    SELECT q.name, moved.queue_position, moved.conversation_handle, moved.conversation_id,
           moved.message_sequence_number, mt.name, moved.body, moved.enqueued_at, moved.failed_attempts,
           CASE WHEN moved.queue_position = head.queue_position THEN head_reason
                ELSE format('conversation quarantined after message %s', head.message_sequence_number) END,
           moved.traceparent
    FROM moved JOIN broker.message_types mt USING (message_type_id);
    GET DIAGNOSTICS moved_count = ROW_COUNT;
    IF e.state IN ('conversing', 'disconnected_inbound', 'disconnected_outbound') THEN
        PERFORM broker._fail_conversation(e, -2, error_description);
    END IF;
    RETURN moved_count;
END $$;

-- A reader dead-letters a conversation whose next message it cannot process
-- (a reader that rolled back its receive, or holds a lease): what waits of it
-- moves to broker.dead_letters, the first message with the reason, and the
-- conversation ends with broker.error (-2) on both sides.  The caller holds
-- the group (broker._hold_group); a lease's messages of other conversations
-- come back, and the lease ends.  Returns how many messages moved.
CREATE FUNCTION broker.dead_letter_conversation(conversation_handle uuid, reason text, lock_token uuid DEFAULT NULL)
RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    e broker.endpoints;
    q broker.queues;
    head broker.queue_messages;
    lease record;
BEGIN
    IF reason IS NULL OR length(reason) NOT BETWEEN 1 AND 4000 THEN
        PERFORM broker._raise('BR050', 'reason must be 1 to 4000 characters');
    END IF;
    SELECT * INTO e FROM broker.endpoints
    WHERE endpoints.conversation_handle = broker._require('conversation_handle',
                                                          dead_letter_conversation.conversation_handle);
    IF NOT FOUND THEN
        PERFORM broker._raise('BR005', format('unknown conversation %s', dead_letter_conversation.conversation_handle));
    END IF;
    PERFORM broker._hold_group(e.conversation_group_id, lock_token);
    e := broker._lock_endpoint(e.conversation_handle);
    SELECT * INTO q FROM broker.queues WHERE queue_id = e.queue_id;
    SELECT m.* INTO head FROM broker.queue_messages m
    WHERE m.conversation_group_id = e.conversation_group_id AND m.conversation_handle = e.conversation_handle
      AND m.received_at IS NULL
    ORDER BY coalesce(m.notice_after, m.message_sequence_number), m.notice_after IS NOT NULL, m.queue_position
    LIMIT 1;
    IF NOT FOUND THEN
        PERFORM broker._raise('BR020', format('conversation %s has no message waiting to dead-letter',
            e.conversation_handle), 'roll back the receive first: the messages come back');
    END IF;
    IF lock_token IS NOT NULL THEN
        DELETE FROM broker.leases l WHERE l.lock_token = dead_letter_conversation.lock_token RETURNING * INTO lease;
        PERFORM broker._record_lease_end(lease.lock_token, lease.queue_id, 'dead_lettered', clock_timestamp());
        PERFORM pg_notify('broker_queue', lease.queue_id::text);
    END IF;
    RETURN broker._quarantine(q, e, head, format('dead-lettered by its reader: %s', reason),
        format('message %s was dead-lettered by its reader: %s', head.message_sequence_number, reason));
END $$;
COMMENT ON FUNCTION broker.dead_letter_conversation(uuid, text, uuid) IS
    'A reader that holds the group dead-letters a conversation: its waiting messages move to broker.dead_letters and it ends with broker.error (-2).';

-- Puts a quarantined conversation's dead letters back into its queue, in
-- order, to be processed again (after a fix): only while its side is in
-- error, not yet ended by the application, whose replies it still refuses.
-- Returns how many came back.
CREATE FUNCTION broker.resubmit_dead_letters(queue text, conversation_handle uuid) RETURNS integer
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
    SELECT count(*) INTO resubmitted FROM broker.dead_letters d  -- what arrived: not what this side withheld
    WHERE d.queue_name = q.name AND d.conversation_handle = e.conversation_handle AND d.queue_position > 0;
    IF resubmitted = 0 THEN
        RETURN 0;
    END IF;
    first_position := broker._next_queue_positions(resubmitted);
    WITH letters AS (
        DELETE FROM broker.dead_letters d
        WHERE d.queue_name = q.name AND d.conversation_handle = e.conversation_handle AND d.queue_position > 0
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

-- Deletes a queue's dead letters (older_than: only those dead-lettered longer
-- ago); returns how many.
CREATE FUNCTION broker.purge_dead_letters(queue text, older_than interval DEFAULT NULL) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    q broker.queues := broker._queue(queue);
    purged bigint;
BEGIN
    DELETE FROM broker.dead_letters d
    WHERE d.queue_name = q.name AND (older_than IS NULL OR d.dead_lettered_at < now() - older_than);
    GET DIAGNOSTICS purged = ROW_COUNT;
    RETURN purged;
END $$;
COMMENT ON FUNCTION broker.purge_dead_letters(text, interval) IS
    'Deletes a queue''s dead letters, or those dead-lettered longer ago than older_than; returns how many.';

------------------------------------------------------------------------------
-- Moving and purging
------------------------------------------------------------------------------

-- Moves one side of a conversation, and its waiting messages, to another
-- conversation group of its queue (Service Broker's MOVE CONVERSATION); a
-- group that does not exist yet is made.  Both groups are locked first, in
-- the order of their ids, and the endpoint after them: the order of a reader,
-- which locks its group and then the endpoints it replies on.  It waits for
-- a reader that holds either group, and refuses (BR041) while a live lease
-- holds one.
CREATE FUNCTION broker.move_conversation(conversation_handle uuid, conversation_group uuid) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    e broker.endpoints;
    target_queue integer;
BEGIN
    SELECT * INTO e FROM broker.endpoints
    WHERE endpoints.conversation_handle = broker._require('conversation_handle', move_conversation.conversation_handle);
    IF NOT FOUND THEN
        PERFORM broker._raise('BR005', format('unknown conversation %s', move_conversation.conversation_handle));
    END IF;
    INSERT INTO broker.conversation_groups
    VALUES (broker._require('conversation_group', conversation_group), e.queue_id)
    ON CONFLICT DO NOTHING;
    SELECT queue_id INTO target_queue FROM broker.conversation_groups g
    WHERE g.conversation_group_id = conversation_group;
    IF target_queue <> e.queue_id THEN
        PERFORM broker._raise('BR050', format('conversation group %s belongs to another queue', conversation_group));
    END IF;
    PERFORM FROM broker.conversation_groups g
    WHERE g.conversation_group_id IN (e.conversation_group_id, conversation_group)
    ORDER BY g.conversation_group_id
    FOR NO KEY UPDATE;
    IF broker._leased(e.conversation_group_id) OR broker._leased(conversation_group) THEN
        PERFORM broker._raise('BR041', format('conversation %s cannot move while a lock holds its group or the other',
            move_conversation.conversation_handle), 'complete or abandon the lock first');
    END IF;
    UPDATE broker.endpoints SET conversation_group_id = conversation_group
    WHERE endpoints.conversation_handle = e.conversation_handle AND conversation_group_id = e.conversation_group_id;
    IF NOT FOUND THEN  -- moved by another transaction while this one waited for the groups
        PERFORM broker._raise('BR041', format('conversation %s was moved meanwhile', e.conversation_handle),
            'try again');
    END IF;
    UPDATE broker.queue_messages m SET conversation_group_id = conversation_group
    WHERE m.conversation_group_id = e.conversation_group_id AND m.conversation_handle = e.conversation_handle;
END $$;
COMMENT ON FUNCTION broker.move_conversation(uuid, uuid) IS
    'Moves one side of a conversation and its waiting messages to another conversation group of its queue.';

-- Deletes every message waiting in a queue (received ones that retention
-- keeps stay) and ends its leases; returns how many messages it deleted.  The
-- conversations go on: what was purged is gone, sequence numbers continue.
-- It waits for readers that are receiving from the queue.
CREATE FUNCTION broker.purge_queue(queue text) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    q broker.queues := broker._queue(queue);
    purged bigint;
BEGIN
    PERFORM broker._record_lease_end(l.lock_token, l.queue_id, 'purged', clock_timestamp())
    FROM broker.leases l WHERE l.queue_id = q.queue_id;
    DELETE FROM broker.leases l WHERE l.queue_id = q.queue_id;
    DELETE FROM broker.queue_messages m WHERE m.queue_id = q.queue_id AND m.received_at IS NULL;
    GET DIAGNOSTICS purged = ROW_COUNT;
    RETURN purged;
END $$;
COMMENT ON FUNCTION broker.purge_queue(text) IS
    'Deletes every message waiting in a queue and ends its leases; returns how many messages it deleted.';

------------------------------------------------------------------------------
-- Conversation group state
------------------------------------------------------------------------------

-- What a reader keeps for a conversation group between receives (Service
-- Bus's session state; a Service Broker application's state table keyed by
-- the group): read and written only by the reader that holds the group, so
-- it changes with the messages it goes with, in one transaction.  It goes
-- when the group goes.
CREATE TABLE broker.conversation_group_state (
    conversation_group_id  uuid PRIMARY KEY REFERENCES broker.conversation_groups ON DELETE CASCADE,
    state                  jsonb NOT NULL,
    updated_at             timestamptz NOT NULL DEFAULT now()
);

-- Holds a conversation group for the caller: the group stays locked until
-- its transaction ends (at once when a receive of this transaction holds it
-- already), or, with lock_token, the caller's live lease is the one that
-- holds it.  BR041 when another reader holds it, BR060 when the lease is lost.
CREATE FUNCTION broker._hold_group(group_id uuid, lock_token uuid) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    leased_group uuid;
BEGIN
    IF lock_token IS NOT NULL THEN
        SELECT l.conversation_group_id INTO leased_group FROM broker.leases l
        WHERE l.lock_token = _hold_group.lock_token AND l.expires_at > clock_timestamp();
        IF NOT FOUND THEN
            PERFORM broker._lock_lost(lock_token);
        END IF;
        IF leased_group IS DISTINCT FROM group_id THEN
            PERFORM broker._raise('BR050', format('lock %s holds another conversation group than %s', lock_token,
                group_id));
        END IF;
        RETURN;
    END IF;
    BEGIN
        PERFORM 1 FROM broker.conversation_groups g
        WHERE g.conversation_group_id = broker._require('conversation_group', group_id)
        FOR NO KEY UPDATE NOWAIT;
    EXCEPTION WHEN lock_not_available THEN
        PERFORM broker._raise('BR041', format('conversation group %s is held by another reader', group_id),
            'read and write its state in the transaction that received from it');
    END;
    IF NOT FOUND THEN
        PERFORM broker._raise('BR005', format('unknown conversation group %s', group_id));
    END IF;
    IF broker._leased(group_id) THEN
        PERFORM broker._raise('BR041', format('conversation group %s is held by a lock', group_id),
            'give the lock''s token');
    END IF;
END $$;

-- The state kept for a conversation group the caller holds, or NULL.
CREATE FUNCTION broker.get_conversation_group_state(conversation_group uuid, lock_token uuid DEFAULT NULL)
RETURNS jsonb
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM broker._hold_group(conversation_group, lock_token);
    RETURN (SELECT s.state FROM broker.conversation_group_state s
            WHERE s.conversation_group_id = get_conversation_group_state.conversation_group);
END $$;
COMMENT ON FUNCTION broker.get_conversation_group_state(uuid, uuid) IS
    'The state kept for a conversation group that the caller holds (by its transaction, or by lock_token), or NULL.';

-- Keeps state for a conversation group the caller holds (NULL: forgets it),
-- at most the node's message size.
CREATE FUNCTION broker.set_conversation_group_state(conversation_group uuid, state jsonb, lock_token uuid DEFAULT NULL)
RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    limit_bytes integer := (SELECT max_message_bytes FROM broker.node);
BEGIN
    PERFORM broker._hold_group(conversation_group, lock_token);
    IF octet_length(state::text) > limit_bytes THEN
        PERFORM broker._raise('BR051', format('state of %s bytes exceeds the limit of %s bytes',
            octet_length(state::text), limit_bytes));
    END IF;
    IF state IS NULL THEN
        DELETE FROM broker.conversation_group_state s
        WHERE s.conversation_group_id = set_conversation_group_state.conversation_group;
        RETURN;
    END IF;
    INSERT INTO broker.conversation_group_state AS s (conversation_group_id, state)
    VALUES (conversation_group, set_conversation_group_state.state)
    ON CONFLICT (conversation_group_id) DO UPDATE SET state = excluded.state, updated_at = now();
END $$;
COMMENT ON FUNCTION broker.set_conversation_group_state(uuid, jsonb, uuid) IS
    'Keeps state for a conversation group that the caller holds (NULL forgets it).';

------------------------------------------------------------------------------
-- Ending, timers and lifetimes
------------------------------------------------------------------------------

-- An error goes to the far side by broker._transmit_error.  Error codes of 0
-- and below are refused: they are the broker's own (-1 an expired lifetime, -2
-- a quarantine, -3 a refusal).
CREATE OR REPLACE FUNCTION broker.end_conversation(conversation_handle uuid, error_code integer DEFAULT NULL,
                                                   error_description text DEFAULT NULL, cleanup boolean DEFAULT false)
RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    e broker.endpoints := broker._lock_endpoint(conversation_handle);
BEGIN
    IF cleanup THEN
        DELETE FROM broker.transmission_queue t
        WHERE t.to_service = e.far_service AND t.priority = e.priority AND t.conversation_handle = e.conversation_handle;
        PERFORM broker._close_endpoint(e);
        RETURN;
    END IF;
    IF (error_code IS NULL) <> (error_description IS NULL) THEN
        PERFORM broker._raise('BR050', 'error_code and error_description go together: give both or neither');
    END IF;
    IF error_code <= 0 THEN
        PERFORM broker._raise('BR050', format('error_code must be positive, got %s', error_code),
            'codes of 0 and below belong to the broker');
    END IF;
    IF length(error_description) > 4000 THEN
        PERFORM broker._raise('BR050', 'error_description must be at most 4000 characters');
    END IF;
    IF e.state IN ('closed', 'disconnected_outbound') THEN
        PERFORM broker._raise('BR020', format('conversation %s is already ended (%s)',
            conversation_handle, replace(e.state, '_', ' ')));
    END IF;
    IF error_code IS NOT NULL AND e.state IN ('conversing', 'disconnected_inbound') THEN
        PERFORM broker._transmit_error(e, error_code, error_description);
        PERFORM broker._close_endpoint(e);
    ELSIF e.state = 'conversing' THEN
        PERFORM broker._transmit(e, broker._message_type('broker.end_dialog'), NULL);
        DELETE FROM broker.queue_messages m
        WHERE m.conversation_group_id = e.conversation_group_id AND m.conversation_handle = e.conversation_handle;
        UPDATE broker.endpoints SET state = 'disconnected_outbound', timer_at = NULL
        WHERE endpoints.conversation_handle = e.conversation_handle;
    ELSIF e.state = 'disconnected_inbound' THEN
        PERFORM broker._transmit(e, broker._message_type('broker.end_dialog'), NULL);
        PERFORM broker._close_endpoint(e);
    ELSE  -- error: the far side is gone already
        PERFORM broker._close_endpoint(e);
    END IF;
END $$;
COMMENT ON FUNCTION broker.end_conversation(uuid, integer, text, boolean) IS
    'Ends a conversation: broker.end_dialog to the far side, or broker.error with an error code, or nothing with cleanup.';

CREATE FUNCTION broker.begin_conversation_timer(conversation_handle uuid, timeout interval) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    e broker.endpoints := broker._lock_endpoint(conversation_handle);
BEGIN
    IF timeout IS NULL OR timeout < interval '0' THEN
        PERFORM broker._raise('BR050', format('timeout must be zero or positive, got %s', quote_nullable(timeout)));
    END IF;
    IF e.state = 'closed' THEN
        PERFORM broker._raise('BR020', format('conversation %s is closed', conversation_handle));
    END IF;
    UPDATE broker.endpoints SET timer_at = now() + timeout WHERE endpoints.conversation_handle = e.conversation_handle;
END $$;
COMMENT ON FUNCTION broker.begin_conversation_timer(uuid, interval) IS
    'After timeout, a broker.dialog_timer message arrives on this side of the conversation.';

-- broker._lock_endpoint, or a NULL endpoint without waiting when another
-- transaction holds the conversation's initiator (locked first, the usual
-- order): what fires events leaves such a conversation for later.
CREATE FUNCTION broker._try_lock_endpoint(handle uuid) RETURNS broker.endpoints
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM 1 FROM broker.endpoints
    WHERE conversation_handle = (SELECT i.conversation_handle FROM broker.endpoints i
                                 JOIN broker.endpoints e ON e.conversation_id = i.conversation_id
                                 WHERE e.conversation_handle = handle
                                 ORDER BY i.is_initiator DESC LIMIT 1)
    FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    RETURN broker._lock_endpoint(handle);
END $$;

-- Fires due conversation timers and lifetimes, and delivers the held messages
-- of local conversations that are due, of one queue or (target_queue_id NULL)
-- every queue, at most max_events endpoints a call; returns how many it fired
-- (a local conversation's lifetime ends both sides at once).  An endpoint whose conversation another transaction holds is left
-- for later.  A running node calls broker.fire_due_events every quarter second,
-- so that timers and lifetimes take effect when they fall due, not when
-- somebody next receives.
CREATE FUNCTION broker._fire_due_events(target_queue_id integer, max_events integer DEFAULT 1000) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    due_by timestamptz := clock_timestamp();  -- a waiting receive outlives its transaction's now()
    due record;
    e broker.endpoints;
    held record;
    fired integer := 0;
BEGIN
    FOR due IN
        SELECT conversation_handle FROM broker.endpoints
        WHERE (target_queue_id IS NULL OR queue_id = target_queue_id)
          AND (timer_at <= due_by
               OR (expires_at <= due_by AND state IN ('conversing', 'disconnected_inbound', 'disconnected_outbound')))
        LIMIT max_events
    LOOP
        e := broker._try_lock_endpoint(due.conversation_handle);
        CONTINUE WHEN e.conversation_handle IS NULL;
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
    -- Held messages of local conversations whose delivery time has come, each
    -- conversation's in order; the earliest held message of a conversation is
    -- always one with a delivery time of its own, in transmission_queue_held.
    FOR due IN
        SELECT DISTINCT t.conversation_handle
        FROM broker.services s
        JOIN broker.transmission_queue t
          ON t.to_service = s.name AND t.next_attempt_at > t.enqueued_at AND t.next_attempt_at <= due_by
        JOIN broker.endpoints sender ON sender.conversation_handle = t.conversation_handle AND sender.far_is_local
        WHERE target_queue_id IS NULL OR s.queue_id = target_queue_id
        LIMIT max_events
    LOOP
        e := broker._try_lock_endpoint(due.conversation_handle);
        CONTINUE WHEN e.conversation_handle IS NULL;
        FOR held IN
            SELECT t.* FROM broker.transmission_queue t
            WHERE t.to_service = e.far_service AND t.priority = e.priority
              AND t.conversation_handle = e.conversation_handle AND t.next_attempt_at <= due_by
            ORDER BY t.message_sequence_number
        LOOP
            DELETE FROM broker.transmission_queue t
            WHERE t.to_service = held.to_service AND t.priority = held.priority
              AND t.conversation_handle = held.conversation_handle
              AND t.message_sequence_number = held.message_sequence_number;
            PERFORM broker._deliver(broker._far_endpoint(e), held.message_sequence_number,
                                    (SELECT mt FROM broker.message_types mt WHERE mt.message_type_id = held.message_type_id),
                                    held.body, held.traceparent);
            fired := fired + 1;
        END LOOP;
        UPDATE broker.endpoints SET held_until = NULL
        WHERE conversation_handle = e.conversation_handle
          AND NOT EXISTS (SELECT 1 FROM broker.transmission_queue t
                          WHERE t.to_service = e.far_service AND t.priority = e.priority
                            AND t.conversation_handle = e.conversation_handle);
    END LOOP;
    RETURN fired;
END $$;

CREATE FUNCTION broker.fire_due_events() RETURNS integer
LANGUAGE sql AS $$
    SELECT broker._fire_due_events(NULL)
$$;
COMMENT ON FUNCTION broker.fire_due_events() IS
    'Fires the conversation timers and lifetimes that are due, and delivers held local messages that are due, on every queue; returns how many.  A running node calls it every quarter second.';
