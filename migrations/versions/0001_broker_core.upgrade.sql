-- The broker core: catalog, conversations, destination and transmission queues,
-- and the SQL-level API.  Frozen with revision 0001; later changes go into new
-- revisions.
--
-- SQLSTATEs raised here (class BR, documented in README.md):
--   BR001 unknown service          BR010 message type not allowed in this direction
--   BR002 unknown message type     BR011 contract not accepted by the target service
--   BR003 unknown contract         BR012 body fails the message type's validation
--   BR004 unknown queue            BR020 conversation not in a state that allows this
--   BR005 unknown conversation     BR030 queue disabled
--   BR006 unknown route            BR040 name already exists
--   BR050 invalid argument         BR041 object still in use
--   BR051 message too large

CREATE SCHEMA broker;

------------------------------------------------------------------------------
-- Catalog
------------------------------------------------------------------------------

-- The local node: one row.
CREATE TABLE broker.node (
    singleton          boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    broker_instance    uuid NOT NULL DEFAULT gen_random_uuid(),
    max_message_bytes  integer NOT NULL DEFAULT 16777216 CHECK (max_message_bytes > 0)
);
INSERT INTO broker.node DEFAULT VALUES;

CREATE TABLE broker.message_types (
    message_type_id  serial PRIMARY KEY,
    name             text NOT NULL UNIQUE,
    validation       text NOT NULL CHECK (validation IN ('none', 'empty', 'json'))
);
INSERT INTO broker.message_types (name, validation) VALUES
    ('broker.end_dialog', 'empty'),
    ('broker.error', 'json'),
    ('broker.dialog_timer', 'empty');

CREATE TABLE broker.contracts (
    contract_id  serial PRIMARY KEY,
    name         text NOT NULL UNIQUE
);

CREATE TABLE broker.contract_message_types (
    contract_id      integer NOT NULL REFERENCES broker.contracts ON DELETE CASCADE,
    message_type_id  integer NOT NULL REFERENCES broker.message_types,
    sent_by          text NOT NULL CHECK (sent_by IN ('initiator', 'target', 'any')),
    PRIMARY KEY (contract_id, message_type_id)
);

CREATE TABLE broker.queues (
    queue_id          serial PRIMARY KEY,
    name              text NOT NULL UNIQUE,
    is_enabled        boolean NOT NULL DEFAULT true,
    retention         boolean NOT NULL DEFAULT false,
    poison_threshold  integer NOT NULL DEFAULT 5 CHECK (poison_threshold > 0),
    created_at        timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE broker.services (
    service_id  serial PRIMARY KEY,
    name        text NOT NULL UNIQUE,
    queue_id    integer NOT NULL REFERENCES broker.queues
);

-- Contracts a service accepts as a target.
CREATE TABLE broker.service_contracts (
    service_id   integer NOT NULL REFERENCES broker.services ON DELETE CASCADE,
    contract_id  integer NOT NULL REFERENCES broker.contracts,
    PRIMARY KEY (service_id, contract_id)
);

-- peer_secret is shared with the peer node: requests and answers are signed
-- with HMAC-SHA256 under it, so it cannot be kept as a hash.
CREATE TABLE broker.routes (
    route_id         serial PRIMARY KEY,
    service_name     text NOT NULL UNIQUE,
    address          text NOT NULL,
    broker_instance  uuid NOT NULL,
    peer_secret      text NOT NULL,
    created_at       timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX routes_address ON broker.routes (address);
CREATE INDEX routes_broker_instance ON broker.routes (broker_instance);

------------------------------------------------------------------------------
-- Conversations
------------------------------------------------------------------------------

-- A receive locks one group row; every message of the group waits for it.
CREATE TABLE broker.conversation_groups (
    conversation_group_id  uuid PRIMARY KEY,
    queue_id               integer NOT NULL REFERENCES broker.queues
);

-- One side of a conversation.  A local conversation has both endpoints here.
-- send_sequence is the last number this side sent; receive_sequence the last
-- number it stored without a gap from the far side.
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
    UNIQUE (conversation_id, is_initiator)
);
CREATE INDEX endpoints_group ON broker.endpoints (conversation_group_id);
CREATE INDEX endpoints_timer_due ON broker.endpoints (timer_at) WHERE timer_at IS NOT NULL;
CREATE INDEX endpoints_lifetime_due ON broker.endpoints (expires_at)
    WHERE expires_at IS NOT NULL AND state IN ('conversing', 'disconnected_inbound', 'disconnected_outbound');

------------------------------------------------------------------------------
-- Destination queue, dead letters, transmission queue
------------------------------------------------------------------------------

-- queue_position is commit-ordered (see broker._next_queue_position).
-- message_sequence_number 0 marks a notice raised by this node itself
-- (dialog timer, lifetime expiry, quarantine); far-side messages count from 1.
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
    PRIMARY KEY (queue_id, queue_position)
);
CREATE INDEX queue_messages_group ON broker.queue_messages
    (conversation_group_id, conversation_handle, message_sequence_number);

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
    dead_lettered_at         timestamptz NOT NULL DEFAULT now()
);

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
    PRIMARY KEY (conversation_handle, message_sequence_number)
);
CREATE INDEX transmission_queue_due ON broker.transmission_queue (next_attempt_at);

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
    enqueued_at              timestamptz
);

------------------------------------------------------------------------------
-- Internal helpers
------------------------------------------------------------------------------

CREATE FUNCTION broker._raise(code text, message text, hint text DEFAULT NULL) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    IF hint IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = code, MESSAGE = message;
    END IF;
    RAISE EXCEPTION USING ERRCODE = code, MESSAGE = message, HINT = hint;
END $$;

-- Names are 1-128 characters: letters, digits and _ . : / @ # -, starting with
-- a letter, a digit or /.  Names beginning with "broker." are reserved.
CREATE FUNCTION broker._check_name(kind text, name text) RETURNS text
LANGUAGE plpgsql IMMUTABLE AS $$
BEGIN
    IF name IS NULL THEN
        PERFORM broker._raise('BR050', format('%s name must not be null', kind));
    END IF;
    IF length(name) > 128 OR name !~ '^[A-Za-z0-9/][A-Za-z0-9_.:/@#-]*$' THEN
        PERFORM broker._raise('BR050', format('invalid %s name %s', kind, left(quote_literal(name), 140)),
            'use 1-128 letters, digits and _ . : / @ # -, starting with a letter, a digit or /');
    END IF;
    IF name LIKE 'broker.%' THEN
        PERFORM broker._raise('BR050', format('%s name %L is reserved: names beginning with "broker." belong to the broker', kind, name));
    END IF;
    RETURN name;
END $$;

CREATE FUNCTION broker._require(argument text, value anyelement) RETURNS anyelement
LANGUAGE plpgsql IMMUTABLE AS $$
BEGIN
    IF value IS NULL THEN
        PERFORM broker._raise('BR050', format('%s must not be null', argument));
    END IF;
    RETURN value;
END $$;

CREATE FUNCTION broker._queue(queue_name text) RETURNS broker.queues
LANGUAGE plpgsql STABLE AS $$
DECLARE
    q broker.queues;
BEGIN
    SELECT * INTO q FROM broker.queues WHERE name = broker._require('queue', queue_name);
    IF NOT FOUND THEN
        PERFORM broker._raise('BR004', format('unknown queue %L', queue_name));
    END IF;
    RETURN q;
END $$;

CREATE FUNCTION broker._service(service_name text) RETURNS broker.services
LANGUAGE plpgsql STABLE AS $$
DECLARE
    s broker.services;
BEGIN
    SELECT * INTO s FROM broker.services WHERE name = broker._require('service', service_name);
    IF NOT FOUND THEN
        PERFORM broker._raise('BR001', format('unknown service %L', service_name));
    END IF;
    RETURN s;
END $$;

CREATE FUNCTION broker._contract_id(contract_name text) RETURNS integer
LANGUAGE plpgsql STABLE AS $$
DECLARE
    id integer;
BEGIN
    SELECT contract_id INTO id FROM broker.contracts WHERE name = broker._require('contract', contract_name);
    IF NOT FOUND THEN
        PERFORM broker._raise('BR003', format('unknown contract %L', contract_name));
    END IF;
    RETURN id;
END $$;

CREATE FUNCTION broker._message_type(message_type_name text) RETURNS broker.message_types
LANGUAGE plpgsql STABLE AS $$
DECLARE
    mt broker.message_types;
BEGIN
    SELECT * INTO mt FROM broker.message_types WHERE name = broker._require('message type', message_type_name);
    IF NOT FOUND THEN
        PERFORM broker._raise('BR002', format('unknown message type %L', message_type_name));
    END IF;
    RETURN mt;
END $$;

-- Checks a body against its message type's validation and the node's size limit.
CREATE FUNCTION broker._validate_body(mt broker.message_types, body bytea) RETURNS void
LANGUAGE plpgsql STABLE AS $$
DECLARE
    limit_bytes integer := (SELECT max_message_bytes FROM broker.node);
BEGIN
    IF octet_length(body) > limit_bytes THEN
        PERFORM broker._raise('BR051', format('message body of %s bytes exceeds the limit of %s bytes',
            octet_length(body), limit_bytes));
    END IF;
    IF mt.validation = 'empty' AND octet_length(body) > 0 THEN
        PERFORM broker._raise('BR012', format('message type %L must have an empty body', mt.name));
    ELSIF mt.validation = 'json' THEN
        BEGIN
            PERFORM convert_from(body, 'UTF8')::jsonb;
        EXCEPTION WHEN OTHERS THEN
            PERFORM broker._raise('BR012', format('message type %L requires a JSON body: %s', mt.name, SQLERRM));
        END;
        IF body IS NULL THEN
            PERFORM broker._raise('BR012', format('message type %L requires a JSON body, got NULL', mt.name));
        END IF;
    END IF;
END $$;

-- Checks that the contract lets this side (the initiator's or the target's)
-- send the message type, and that the body passes the type's validation.
CREATE FUNCTION broker._check_message(contract_id integer, sent_by_initiator boolean, mt broker.message_types,
                                      body bytea) RETURNS void
LANGUAGE plpgsql STABLE AS $$
DECLARE
    side text := CASE WHEN sent_by_initiator THEN 'initiator' ELSE 'target' END;
BEGIN
    IF NOT EXISTS (SELECT 1 FROM broker.contract_message_types cmt
                   WHERE cmt.contract_id = _check_message.contract_id AND cmt.message_type_id = mt.message_type_id
                     AND cmt.sent_by IN ('any', side)) THEN
        PERFORM broker._raise('BR010', format('contract %L does not let the %s send message type %L',
            (SELECT name FROM broker.contracts c WHERE c.contract_id = _check_message.contract_id), side, mt.name));
    END IF;
    PERFORM broker._validate_body(mt, body);
END $$;

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

CREATE FUNCTION broker.committed_position_horizon() RETURNS bigint
LANGUAGE sql STABLE AS $$
    SELECT pg_snapshot_xmin(pg_current_snapshot())::text::bigint << 20
$$;
COMMENT ON FUNCTION broker.committed_position_horizon() IS
    'Every destination-queue row below this position was written by a finished transaction; bulk readers read below it.';

CREATE FUNCTION broker._enqueue(receiver broker.endpoints, sequence_number bigint, message_type_id integer, body bytea)
RETURNS void
LANGUAGE sql AS $$
    INSERT INTO broker.queue_messages (queue_id, queue_position, conversation_group_id, conversation_handle,
                                       conversation_id, message_sequence_number, message_type_id, body)
    VALUES (receiver.queue_id, broker._next_queue_position(), receiver.conversation_group_id,
            receiver.conversation_handle, receiver.conversation_id, sequence_number, message_type_id, body)
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
-- checked that sequence_number comes next (invariant 3).
CREATE FUNCTION broker._deliver(receiver broker.endpoints, sequence_number bigint, mt broker.message_types, body bytea)
RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    new_state text := receiver.state;
    visible boolean := receiver.state IN ('conversing', 'disconnected_inbound');
BEGIN
    IF sequence_number <> receiver.receive_sequence + 1 THEN
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
        PERFORM broker._enqueue(receiver, sequence_number, mt.message_type_id, body);
    END IF;
END $$;

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

-- Ends a locked endpoint's conversation because this node cannot go on with it:
-- the local application sees a broker.error notice, the far side a broker.error.
CREATE FUNCTION broker._fail_conversation(e broker.endpoints, error_code integer, error_description text)
RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    error_type broker.message_types := broker._message_type('broker.error');
    far_state text := (broker._far_endpoint(e)).state;
BEGIN
    IF NOT e.far_is_local OR far_state IN ('conversing', 'disconnected_outbound') THEN
        PERFORM broker._transmit(e, error_type, broker._error_body(error_code, error_description));
    END IF;
    UPDATE broker.endpoints SET state = 'error', timer_at = NULL WHERE conversation_handle = e.conversation_handle;
    PERFORM broker._enqueue(e, 0, error_type.message_type_id, broker._error_body(error_code, error_description));
END $$;

-- Fires due conversation timers and lifetimes of a queue's endpoints.  An
-- endpoint whose conversation another transaction holds is left for later.
CREATE FUNCTION broker._fire_due_events(target_queue_id integer) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    due_by timestamptz := clock_timestamp();  -- a waiting receive outlives its transaction's now()
    due record;
    e broker.endpoints;
BEGIN
    FOR due IN
        SELECT conversation_handle, conversation_id FROM broker.endpoints
        WHERE queue_id = target_queue_id
          AND (timer_at <= due_by
               OR (expires_at <= due_by AND state IN ('conversing', 'disconnected_inbound', 'disconnected_outbound')))
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
        END IF;
        IF e.expires_at <= due_by AND e.state IN ('conversing', 'disconnected_inbound', 'disconnected_outbound') THEN
            PERFORM broker._fail_conversation(e, -1, 'the conversation''s lifetime expired before it was ended');
        END IF;
    END LOOP;
END $$;

-- Locks the given group, or the group holding the oldest waiting message that
-- no other transaction holds, and returns it; NULL when there is none.
CREATE FUNCTION broker._lock_group(q broker.queues, requested_group uuid) RETURNS uuid
LANGUAGE plpgsql AS $$
DECLARE
    candidate uuid;
    tried uuid[] := '{}';
BEGIN
    IF requested_group IS NOT NULL THEN
        PERFORM 1 FROM broker.conversation_groups
        WHERE conversation_group_id = requested_group AND queue_id = q.queue_id
        FOR NO KEY UPDATE SKIP LOCKED;
        RETURN CASE WHEN FOUND THEN requested_group END;
    END IF;
    -- Fast path: groups of the messages at the head of the queue.
    FOR candidate IN
        SELECT conversation_group_id FROM broker.queue_messages
        WHERE queue_id = q.queue_id AND received_at IS NULL
        ORDER BY queue_position LIMIT 200
    LOOP
        CONTINUE WHEN candidate = ANY (tried);
        tried := tried || candidate;
        PERFORM 1 FROM broker.conversation_groups WHERE conversation_group_id = candidate
        FOR NO KEY UPDATE SKIP LOCKED;
        IF FOUND AND EXISTS (SELECT 1 FROM broker.queue_messages
                             WHERE conversation_group_id = candidate AND queue_id = q.queue_id
                               AND received_at IS NULL) THEN
            RETURN candidate;
        END IF;
    END LOOP;
    -- The head belongs to groups held by others: look at every group of the queue.
    SELECT g.conversation_group_id INTO candidate
    FROM broker.conversation_groups g
    WHERE g.queue_id = q.queue_id
      AND g.conversation_group_id <> ALL (tried)
      AND EXISTS (SELECT 1 FROM broker.queue_messages m
                  WHERE m.conversation_group_id = g.conversation_group_id AND m.queue_id = q.queue_id
                    AND m.received_at IS NULL)
    LIMIT 1
    FOR NO KEY UPDATE OF g SKIP LOCKED;
    RETURN candidate;
END $$;

-- Waits up to wait_ms for a group with messages and locks it.  Sleeps with a
-- growing interval (5 ms to 100 ms) while nothing is there: notifications
-- cannot reach a session inside a transaction.
CREATE FUNCTION broker._wait_for_group(q broker.queues, requested_group uuid, wait_ms integer) RETURNS uuid
LANGUAGE plpgsql AS $$
DECLARE
    deadline timestamptz := clock_timestamp() + make_interval(secs => wait_ms / 1000.0);
    pause double precision := 0.005;
    locked_group uuid;
BEGIN
    IF wait_ms < 0 THEN
        PERFORM broker._raise('BR050', format('wait_ms must not be negative, got %s', wait_ms));
    END IF;
    -- Marks this transaction as a reader of the queue (see broker.queue_status).
    PERFORM pg_advisory_xact_lock_shared(1651663723, q.queue_id);
    LOOP
        PERFORM broker._fire_due_events(q.queue_id);
        locked_group := broker._lock_group(q, requested_group);
        IF locked_group IS NOT NULL AND EXISTS (
                SELECT 1 FROM broker.queue_messages
                WHERE conversation_group_id = locked_group AND queue_id = q.queue_id AND received_at IS NULL) THEN
            RETURN locked_group;
        END IF;
        EXIT WHEN clock_timestamp() >= deadline;
        PERFORM pg_sleep(least(pause, extract(epoch FROM deadline - clock_timestamp())));
        pause := least(pause * 2, 0.1);
    END LOOP;
    RETURN NULL;
END $$;

CREATE FUNCTION broker._enabled_queue(queue_name text) RETURNS broker.queues
LANGUAGE plpgsql STABLE AS $$
DECLARE
    q broker.queues := broker._queue(queue_name);
BEGIN
    IF NOT q.is_enabled THEN
        PERFORM broker._raise('BR030', format('queue %L is disabled', queue_name),
            'enable it with broker.alter_queue(name, status => true)');
    END IF;
    RETURN q;
END $$;

------------------------------------------------------------------------------
-- Catalog API
------------------------------------------------------------------------------

CREATE FUNCTION broker.create_message_type(name text, validation text DEFAULT 'none') RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM broker._check_name('message type', name);
    IF validation IS NULL OR validation NOT IN ('none', 'empty', 'json') THEN
        PERFORM broker._raise('BR050', format('unknown validation %L', validation), 'use none, empty or json');
    END IF;
    INSERT INTO broker.message_types (name, validation) VALUES (create_message_type.name, create_message_type.validation);
EXCEPTION WHEN unique_violation THEN
    PERFORM broker._raise('BR040', format('message type %L already exists', name));
END $$;
COMMENT ON FUNCTION broker.create_message_type(text, text) IS 'Defines a message type with validation none, empty or json.';

CREATE FUNCTION broker.drop_message_type(name text) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    mt broker.message_types := broker._message_type(name);
BEGIN
    IF mt.name LIKE 'broker.%' THEN
        PERFORM broker._raise('BR050', format('message type %L belongs to the broker', name));
    END IF;
    IF EXISTS (SELECT 1 FROM broker.contract_message_types WHERE message_type_id = mt.message_type_id) THEN
        PERFORM broker._raise('BR041', format('message type %L is used by a contract', name), 'drop the contract first');
    END IF;
    DELETE FROM broker.message_types WHERE message_type_id = mt.message_type_id;
END $$;

CREATE FUNCTION broker.create_contract(name text, message_types jsonb) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    new_id integer;
    entry record;
BEGIN
    PERFORM broker._check_name('contract', name);
    IF message_types IS NULL OR jsonb_typeof(message_types) <> 'object' OR message_types = '{}' THEN
        PERFORM broker._raise('BR050', 'message_types must be a non-empty JSON object',
            'e.g. {"order.submit": "initiator", "order.ack": "target", "order.note": "any"}');
    END IF;
    INSERT INTO broker.contracts (name) VALUES (create_contract.name) RETURNING contract_id INTO new_id;
    FOR entry IN SELECT key, value FROM jsonb_each(message_types) LOOP
        IF jsonb_typeof(entry.value) <> 'string' OR entry.value #>> '{}' NOT IN ('initiator', 'target', 'any') THEN
            PERFORM broker._raise('BR050', format('message type %L: sent by must be "initiator", "target" or "any", got %s',
                entry.key, entry.value));
        END IF;
        IF entry.key LIKE 'broker.%' THEN
            PERFORM broker._raise('BR050', format('system message type %L is part of every contract', entry.key));
        END IF;
        INSERT INTO broker.contract_message_types (contract_id, message_type_id, sent_by)
        VALUES (new_id, (broker._message_type(entry.key)).message_type_id, entry.value #>> '{}');
    END LOOP;
EXCEPTION WHEN unique_violation THEN
    PERFORM broker._raise('BR040', format('contract %L already exists', name));
END $$;
COMMENT ON FUNCTION broker.create_contract(text, jsonb) IS
    'Defines a contract: {"message type": "initiator" | "target" | "any"}.';

CREATE FUNCTION broker.drop_contract(name text) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    id integer := broker._contract_id(name);
BEGIN
    IF EXISTS (SELECT 1 FROM broker.service_contracts WHERE contract_id = id)
       OR EXISTS (SELECT 1 FROM broker.endpoints WHERE contract_id = id) THEN
        PERFORM broker._raise('BR041', format('contract %L is used by a service or a conversation', name));
    END IF;
    DELETE FROM broker.contracts WHERE contract_id = id;
END $$;

CREATE FUNCTION broker.create_queue(name text, status boolean DEFAULT true, retention boolean DEFAULT false,
                                    poison_threshold integer DEFAULT 5) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM broker._check_name('queue', name);
    IF poison_threshold IS NULL OR poison_threshold < 1 THEN
        PERFORM broker._raise('BR050', format('poison_threshold must be at least 1, got %s', poison_threshold));
    END IF;
    INSERT INTO broker.queues (name, is_enabled, retention, poison_threshold)
    VALUES (create_queue.name, broker._require('status', status), broker._require('retention', retention),
            create_queue.poison_threshold);
EXCEPTION WHEN unique_violation THEN
    PERFORM broker._raise('BR040', format('queue %L already exists', name));
END $$;
COMMENT ON FUNCTION broker.create_queue(text, boolean, boolean, integer) IS
    'Creates a queue: status (enabled), retention (keep received messages until the conversation is closed), poison_threshold.';

-- NULL arguments leave a setting as it is.
CREATE FUNCTION broker.alter_queue(name text, status boolean DEFAULT NULL, retention boolean DEFAULT NULL,
                                   poison_threshold integer DEFAULT NULL) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    q broker.queues := broker._queue(name);
BEGIN
    IF poison_threshold < 1 THEN
        PERFORM broker._raise('BR050', format('poison_threshold must be at least 1, got %s', poison_threshold));
    END IF;
    UPDATE broker.queues
    SET is_enabled = coalesce(status, is_enabled),
        retention = coalesce(alter_queue.retention, queues.retention),
        poison_threshold = coalesce(alter_queue.poison_threshold, queues.poison_threshold)
    WHERE queue_id = q.queue_id;
END $$;

CREATE FUNCTION broker.drop_queue(name text) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    q broker.queues := broker._queue(name);
BEGIN
    IF EXISTS (SELECT 1 FROM broker.services WHERE queue_id = q.queue_id) THEN
        PERFORM broker._raise('BR041', format('queue %L is used by a service', name), 'drop the service first');
    END IF;
    DELETE FROM broker.conversation_groups WHERE queue_id = q.queue_id;
    DELETE FROM broker.queues WHERE queue_id = q.queue_id;
END $$;

CREATE FUNCTION broker.create_service(name text, queue text, contracts text[] DEFAULT '{}') RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    new_id integer;
    contract_name text;
BEGIN
    PERFORM broker._check_name('service', name);
    INSERT INTO broker.services (name, queue_id) VALUES (create_service.name, (broker._queue(queue)).queue_id)
    RETURNING service_id INTO new_id;
    FOREACH contract_name IN ARRAY broker._require('contracts', contracts) LOOP
        INSERT INTO broker.service_contracts (service_id, contract_id)
        VALUES (new_id, broker._contract_id(contract_name))
        ON CONFLICT DO NOTHING;
    END LOOP;
EXCEPTION WHEN unique_violation THEN
    PERFORM broker._raise('BR040', format('service %L already exists', name));
END $$;
COMMENT ON FUNCTION broker.create_service(text, text, text[]) IS
    'Creates a service on a queue, accepting the given contracts as a target.';

CREATE FUNCTION broker.drop_service(name text) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    s broker.services := broker._service(name);
BEGIN
    IF EXISTS (SELECT 1 FROM broker.endpoints WHERE service_id = s.service_id AND state <> 'closed') THEN
        PERFORM broker._raise('BR041', format('service %L has open conversations', name),
            'end them first, or with broker.end_conversation(handle, cleanup => true)');
    END IF;
    DELETE FROM broker.queue_messages m USING broker.endpoints e
    WHERE e.service_id = s.service_id AND m.conversation_handle = e.conversation_handle;
    DELETE FROM broker.endpoints WHERE service_id = s.service_id;
    DELETE FROM broker.services WHERE service_id = s.service_id;
END $$;

CREATE FUNCTION broker.create_route(service_name text, address text, broker_instance uuid, secret text) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM broker._check_name('service', service_name);
    IF address IS NULL OR address !~ '^https?://[^\s/]+(/\S*)?$' OR length(address) > 2000 THEN
        PERFORM broker._raise('BR050', format('route address must be an http:// or https:// URL, got %s',
            left(quote_nullable(address), 200)));
    END IF;
    PERFORM broker._require('broker_instance', broker_instance);
    IF secret IS NULL OR length(secret) < 16 THEN
        PERFORM broker._raise('BR050', 'the route''s secret must have at least 16 characters');
    END IF;
    INSERT INTO broker.routes (service_name, address, broker_instance, peer_secret)
    VALUES (create_route.service_name, rtrim(create_route.address, '/'), create_route.broker_instance, secret);
EXCEPTION WHEN unique_violation THEN
    PERFORM broker._raise('BR040', format('a route for service %L already exists', service_name));
END $$;
COMMENT ON FUNCTION broker.create_route(text, text, uuid, text) IS
    'Tells where a remote service lives: its node''s base URL, broker_instance and the secret shared with that node.';

CREATE FUNCTION broker.drop_route(service_name text) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM broker.routes WHERE routes.service_name = broker._require('service_name', drop_route.service_name);
    IF NOT FOUND THEN
        PERFORM broker._raise('BR006', format('no route for service %L', service_name));
    END IF;
END $$;

------------------------------------------------------------------------------
-- Conversation API
------------------------------------------------------------------------------

CREATE FUNCTION broker.begin_dialog(from_service text, to_service text, contract text,
                                    lifetime interval DEFAULT NULL, related_conversation_group uuid DEFAULT NULL)
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
                                  contract_id, expires_at)
    VALUES (handle, conversation, true, group_id, initiator_service.service_id, initiator_service.queue_id,
            to_service, target_service.service_id IS NOT NULL, far_instance, dialog_contract, now() + lifetime);

    IF target_service.service_id IS NOT NULL THEN
        INSERT INTO broker.conversation_groups VALUES (target_group, target_service.queue_id);
        INSERT INTO broker.endpoints (conversation_handle, conversation_id, is_initiator, conversation_group_id,
                                      service_id, queue_id, far_service, far_is_local, contract_id, expires_at)
        VALUES (gen_random_uuid(), conversation, false, target_group, target_service.service_id,
                target_service.queue_id, from_service, true, dialog_contract, now() + lifetime);
    END IF;
    RETURN handle;
END $$;
COMMENT ON FUNCTION broker.begin_dialog(text, text, text, interval, uuid) IS
    'Begins a conversation from a local service to a local or routed service; returns the initiator''s handle.';

CREATE FUNCTION broker.send(conversation_handle uuid, message_type text, body bytea DEFAULT NULL) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    sender broker.endpoints := broker._lock_endpoint(conversation_handle);
    mt broker.message_types := broker._message_type(message_type);
    far_queue broker.queues;
BEGIN
    IF sender.state <> 'conversing' THEN
        PERFORM broker._raise('BR020', format('cannot send on conversation %s: it is %s',
            conversation_handle, replace(sender.state, '_', ' ')));
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

CREATE FUNCTION broker.receive(queue text, max_messages integer DEFAULT 1, conversation_group uuid DEFAULT NULL,
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
    RETURN QUERY
    WITH picked AS (
        SELECT m.queue_position FROM broker.queue_messages m
        WHERE m.conversation_group_id = locked_group AND m.queue_id = q.queue_id AND m.received_at IS NULL
        ORDER BY m.conversation_handle, m.message_sequence_number
        LIMIT max_messages
    ), consumed AS (
        DELETE FROM broker.queue_messages m USING picked
        WHERE NOT q.retention AND m.queue_id = q.queue_id AND m.queue_position = picked.queue_position
    ), retained AS (
        UPDATE broker.queue_messages m SET received_at = now() FROM picked
        WHERE q.retention AND m.queue_id = q.queue_id AND m.queue_position = picked.queue_position
    )
    SELECT m.queue_position, m.conversation_group_id, m.conversation_handle, m.conversation_id,
           m.message_sequence_number, s.name, c.name, mt.name, m.body, m.enqueued_at
    FROM picked
    JOIN broker.queue_messages m ON m.queue_id = q.queue_id AND m.queue_position = picked.queue_position
    JOIN broker.endpoints e ON e.conversation_handle = m.conversation_handle
    JOIN broker.services s ON s.service_id = e.service_id
    JOIN broker.contracts c ON c.contract_id = e.contract_id
    JOIN broker.message_types mt ON mt.message_type_id = m.message_type_id
    ORDER BY m.conversation_handle, m.message_sequence_number;
END $$;
COMMENT ON FUNCTION broker.receive(text, integer, uuid, integer) IS
    'Locks one conversation group of a queue and returns up to max_messages of its messages in order; they are consumed when the caller commits.';

CREATE FUNCTION broker.get_conversation_group(queue text, wait_ms integer DEFAULT 0) RETURNS uuid
LANGUAGE sql AS $$
    SELECT broker._wait_for_group(broker._enabled_queue(queue), NULL, broker._require('wait_ms', wait_ms))
$$;
COMMENT ON FUNCTION broker.get_conversation_group(text, integer) IS
    'Locks the next conversation group with messages until the transaction ends and returns it (NULL if none).';

CREATE FUNCTION broker.end_conversation(conversation_handle uuid, error_code integer DEFAULT NULL,
                                        error_description text DEFAULT NULL, cleanup boolean DEFAULT false)
RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    e broker.endpoints := broker._lock_endpoint(conversation_handle);
BEGIN
    IF cleanup THEN
        DELETE FROM broker.transmission_queue t WHERE t.conversation_handle = e.conversation_handle;
        PERFORM broker._close_endpoint(e);
        RETURN;
    END IF;
    IF (error_code IS NULL) <> (error_description IS NULL) THEN
        PERFORM broker._raise('BR050', 'error_code and error_description go together: give both or neither');
    END IF;
    IF length(error_description) > 4000 THEN
        PERFORM broker._raise('BR050', 'error_description must be at most 4000 characters');
    END IF;
    IF e.state IN ('closed', 'disconnected_outbound') THEN
        PERFORM broker._raise('BR020', format('conversation %s is already ended (%s)',
            conversation_handle, replace(e.state, '_', ' ')));
    END IF;
    IF error_code IS NOT NULL AND e.state IN ('conversing', 'disconnected_inbound') THEN
        PERFORM broker._transmit(e, broker._message_type('broker.error'), broker._error_body(error_code, error_description));
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

-- Records that processing the head message of a group failed (its transaction
-- rolled back, a lease was abandoned or expired).  At the queue's poison
-- threshold the message's conversation is quarantined: its waiting messages
-- move to broker.dead_letters and it ends with broker.error on both sides.
-- Returns true when it quarantined.
CREATE FUNCTION broker.report_processing_failure(queue text, conversation_group uuid, reason text)
RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    q broker.queues := broker._queue(queue);
    head broker.queue_messages;
    e broker.endpoints;
BEGIN
    UPDATE broker.queue_messages SET failed_attempts = failed_attempts + 1
    WHERE (queue_id, queue_position) = (
        SELECT m.queue_id, m.queue_position FROM broker.queue_messages m
        WHERE m.conversation_group_id = broker._require('conversation_group', conversation_group)
          AND m.queue_id = q.queue_id AND m.received_at IS NULL
        ORDER BY m.conversation_handle, m.message_sequence_number LIMIT 1)
    RETURNING * INTO head;
    IF head.queue_position IS NULL OR head.failed_attempts < q.poison_threshold THEN
        RETURN false;
    END IF;
    e := broker._lock_endpoint(head.conversation_handle);
    WITH moved AS (
        DELETE FROM broker.queue_messages m
        WHERE m.conversation_group_id = e.conversation_group_id AND m.conversation_handle = e.conversation_handle
        RETURNING m.*
    )
    INSERT INTO broker.dead_letters (queue_name, queue_position, conversation_handle, conversation_id,
                                     message_sequence_number, message_type, body, enqueued_at, failed_attempts, reason)
    SELECT q.name, moved.queue_position, moved.conversation_handle, moved.conversation_id,
           moved.message_sequence_number, mt.name, moved.body, moved.enqueued_at, moved.failed_attempts,
           CASE WHEN moved.queue_position = head.queue_position
                THEN format('processing failed %s times; last failure: %s', moved.failed_attempts, coalesce(reason, 'not given'))
                ELSE format('conversation quarantined after message %s failed', head.message_sequence_number) END
    FROM moved JOIN broker.message_types mt USING (message_type_id);
    IF e.state IN ('conversing', 'disconnected_inbound', 'disconnected_outbound') THEN
        PERFORM broker._fail_conversation(e, -2, format(
            'message %s could not be processed after %s attempts and was moved to broker.dead_letters',
            head.message_sequence_number, head.failed_attempts));
    END IF;
    RETURN true;
END $$;

------------------------------------------------------------------------------
-- Views
------------------------------------------------------------------------------

CREATE VIEW broker.conversation_endpoints AS
SELECT e.conversation_handle, e.conversation_id, e.conversation_group_id, e.is_initiator,
       s.name AS service_name, q.name AS queue_name, e.far_service, e.far_is_local, e.far_broker_instance,
       c.name AS contract_name, e.state, e.send_sequence, e.receive_sequence,
       e.expires_at, e.timer_at, e.created_at, e.closed_at
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

CREATE VIEW broker.transmission_queue_status AS
SELECT t.conversation_handle, t.conversation_id, t.to_service, t.message_sequence_number,
       mt.name AS message_type, octet_length(t.body) AS body_bytes,
       t.enqueued_at, t.attempts, t.next_attempt_at, t.transmission_status
FROM broker.transmission_queue t
JOIN broker.message_types mt USING (message_type_id);

-- What a bulk reader (the Spark ingest) reads: the committed destination queue.
CREATE VIEW broker.destination_queue AS
SELECT q.name AS queue_name, m.queue_position, m.conversation_id, m.conversation_handle,
       m.conversation_group_id, m.message_sequence_number, s.name AS service_name,
       c.name AS contract_name, mt.name AS message_type, mt.validation, m.body, m.enqueued_at, m.received_at
FROM broker.queue_messages m
JOIN broker.queues q ON q.queue_id = m.queue_id
JOIN broker.endpoints e ON e.conversation_handle = m.conversation_handle
JOIN broker.services s ON s.service_id = e.service_id
JOIN broker.contracts c ON c.contract_id = e.contract_id
JOIN broker.message_types mt ON mt.message_type_id = m.message_type_id;
