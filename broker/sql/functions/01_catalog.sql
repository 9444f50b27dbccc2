-- The catalog's functions (message types, contracts, queues, services,
-- routes) and the helpers every other file uses.
--
-- Each file in this folder holds the functions of one concern, each stated
-- once with what it runs as and who may execute it: an application's entry
-- point runs as its owner (SECURITY DEFINER, with a pinned search_path) and is
-- granted to broker_application; what the relay and the transport endpoint
-- call is granted to broker_relay; broker_admin executes everything, and
-- PUBLIC nothing (broker/sql/function_privileges.sql).  A file is applied
-- again, as a whole, whenever it changes (broker/schema.py), so every
-- statement in it is CREATE OR REPLACE; a revision drops a function that is
-- removed or whose arguments change.
--
-- SQLSTATEs raised (class BR, documented in README.md):
--   BR001 unknown service          BR010 message type not allowed in this direction
--   BR002 unknown message type     BR011 contract not accepted by the target service
--   BR003 unknown contract         BR012 body fails the message type's validation
--   BR004 unknown queue            BR020 conversation not in a state that allows this
--   BR005 unknown conversation     BR021 sequence number out of turn, or reused with another content
--   BR006 unknown route            BR030 queue disabled
--   BR050 invalid argument         BR040 name already exists
--   BR051 message too large        BR041 object still in use
--   BR060 lock lost: expired, completed, abandoned, or never issued
--   BR070 the ingest checkpoint is not where the run started (another run moved it)
--   BR080 no activation procedure of that name taking the queue's name
--   BR081 the activation's role may not run it (unknown, a superuser, or lacks EXECUTE)

------------------------------------------------------------------------------
-- Internal helpers
------------------------------------------------------------------------------

CREATE OR REPLACE FUNCTION broker._raise(code text, message text, hint text DEFAULT NULL) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    IF hint IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = code, MESSAGE = message;
    END IF;
    RAISE EXCEPTION USING ERRCODE = code, MESSAGE = message, HINT = hint;
END $$;
GRANT EXECUTE ON FUNCTION broker._raise(text,text,text) TO broker_relay;

-- A time a caller sets (a delivery time, a lifetime's end, a timer), refused
-- with BR050 unless finite and before the year 10000 UTC: clients, Python's
-- datetime among them, cannot read a later one back.
CREATE OR REPLACE FUNCTION broker._settable_time(what text, t timestamptz) RETURNS timestamptz
LANGUAGE plpgsql AS $$
BEGIN
    IF NOT isfinite(t) OR t >= timestamptz '10000-01-01 00:00:00+00' THEN
        PERFORM broker._raise('BR050', format('%s must be finite and before the year 10000 UTC, got %s', what, t));
    END IF;
    RETURN t;
END $$;
GRANT EXECUTE ON FUNCTION broker._settable_time(text, timestamptz) TO broker_relay;

-- Names are 1-128 characters: letters, digits and _ . : / @ # -, starting with
-- a letter, a digit or /.  Names beginning with "broker." are reserved.
CREATE OR REPLACE FUNCTION broker._check_name(kind text, name text) RETURNS text
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
GRANT EXECUTE ON FUNCTION broker._check_name(text,text) TO broker_relay;

CREATE OR REPLACE FUNCTION broker._require(argument text, value anyelement) RETURNS anyelement
LANGUAGE plpgsql IMMUTABLE AS $$
BEGIN
    IF value IS NULL THEN
        PERFORM broker._raise('BR050', format('%s must not be null', argument));
    END IF;
    RETURN value;
END $$;
GRANT EXECUTE ON FUNCTION broker._require(text,anyelement) TO broker_relay;

CREATE OR REPLACE FUNCTION broker._queue(queue_name text) RETURNS broker.queues
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
GRANT EXECUTE ON FUNCTION broker._queue(text) TO broker_relay;

CREATE OR REPLACE FUNCTION broker._enabled_queue(queue_name text) RETURNS broker.queues
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
GRANT EXECUTE ON FUNCTION broker._enabled_queue(text) TO broker_relay;

CREATE OR REPLACE FUNCTION broker._service(service_name text) RETURNS broker.services
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
GRANT EXECUTE ON FUNCTION broker._service(text) TO broker_relay;

CREATE OR REPLACE FUNCTION broker._contract_id(contract_name text) RETURNS integer
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
GRANT EXECUTE ON FUNCTION broker._contract_id(text) TO broker_relay;

CREATE OR REPLACE FUNCTION broker._message_type(message_type_name text) RETURNS broker.message_types
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
GRANT EXECUTE ON FUNCTION broker._message_type(text) TO broker_relay;

-- Checks a body against its message type's validation and the node's size limit.
CREATE OR REPLACE FUNCTION broker._validate_body(mt broker.message_types, body bytea) RETURNS void
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
GRANT EXECUTE ON FUNCTION broker._validate_body(broker.message_types,bytea) TO broker_relay;

-- Checks that the contract lets this side (the initiator's or the target's)
-- send the message type, and that the body passes the type's validation.
CREATE OR REPLACE FUNCTION broker._check_message(contract_id integer, sent_by_initiator boolean, mt broker.message_types,
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
GRANT EXECUTE ON FUNCTION broker._check_message(integer,boolean,broker.message_types,bytea) TO broker_relay;

------------------------------------------------------------------------------
-- Catalog API
------------------------------------------------------------------------------

CREATE OR REPLACE FUNCTION broker.create_message_type(name text, validation text DEFAULT 'none') RETURNS void
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
COMMENT ON FUNCTION broker.create_message_type(text, text) IS $$Defines a message type. `validation` says what its
bodies must be: `none` (anything), `empty` (no body) or `json` (a body that parses as JSON). BR040 when the name is
taken.$$;

CREATE OR REPLACE FUNCTION broker.drop_message_type(name text) RETURNS void
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
COMMENT ON FUNCTION broker.drop_message_type(text) IS $$Drops a message type. Refused with BR041 while a contract uses
it, and with BR050 for one of the broker's own (`broker.` names).$$;

CREATE OR REPLACE FUNCTION broker.create_contract(name text, message_types jsonb) RETURNS void
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
COMMENT ON FUNCTION broker.create_contract(text, jsonb) IS $$Defines a contract. `message_types` is a JSON object
`{"message type": "initiator" | "target" | "any"}`: who may send each type. The broker's own types (`broker.` names)
are part of every contract, and naming one is BR050. BR040 when the name is taken.$$;

CREATE OR REPLACE FUNCTION broker.drop_contract(name text) RETURNS void
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
COMMENT ON FUNCTION broker.drop_contract(text) IS $$Drops a contract. Refused with BR041 while a service or a
conversation uses it.$$;

CREATE OR REPLACE FUNCTION broker.create_queue(name text, status boolean DEFAULT true, retention boolean DEFAULT false,
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
COMMENT ON FUNCTION broker.create_queue(text, boolean, boolean, integer) IS $$Creates a queue. `status`: whether it is
enabled; `retention` keeps received messages (marked `received_at`) until the conversation ends; `poison_threshold`
(at least 1): the failed attempts on a message after which its conversation is quarantined. BR040 when the name is
taken.$$;

-- NULL arguments leave a setting as it is.
CREATE OR REPLACE FUNCTION broker.alter_queue(name text, status boolean DEFAULT NULL, retention boolean DEFAULT NULL,
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
COMMENT ON FUNCTION broker.alter_queue(text, boolean, boolean, integer) IS $$Changes a queue's `status`, `retention`
and `poison_threshold`, as `create_queue` sets them; NULL leaves a setting as it is.$$;

CREATE OR REPLACE FUNCTION broker.drop_queue(name text) RETURNS void
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
COMMENT ON FUNCTION broker.drop_queue(text) IS $$Drops a queue and its conversation groups. Refused with BR041 while a
service uses it.$$;

CREATE OR REPLACE FUNCTION broker.create_service(name text, queue text, contracts text[] DEFAULT '{}') RETURNS void
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
COMMENT ON FUNCTION broker.create_service(text, text, text[]) IS $$Creates a service on a queue; `contracts` are those
it accepts as a target. BR040 when the name is taken.$$;

-- Conversations already begun go on under their contract whatever the
-- service accepts from then on: a target checks its contracts only when a
-- conversation begins.
CREATE OR REPLACE FUNCTION broker.alter_service(name text, contracts text[]) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    s broker.services := broker._service(name);
    contract_name text;
BEGIN
    DELETE FROM broker.service_contracts WHERE service_id = s.service_id;
    FOREACH contract_name IN ARRAY broker._require('contracts', contracts) LOOP
        INSERT INTO broker.service_contracts (service_id, contract_id)
        VALUES (s.service_id, broker._contract_id(contract_name))
        ON CONFLICT DO NOTHING;
    END LOOP;
END $$;
COMMENT ON FUNCTION broker.alter_service(text, text[]) IS $$Sets the contracts a service accepts as a target;
conversations already begun go on under theirs.$$;

CREATE OR REPLACE FUNCTION broker.drop_service(name text) RETURNS void
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
COMMENT ON FUNCTION broker.drop_service(text) IS $$Drops a service, with its closed conversation sides and their
messages. Refused with BR041 while it has conversations that are not closed: end them first, or with
`end_conversation(handle, cleanup => true)`.$$;

-- Whether the operator lets routes reach link-local and cloud metadata
-- addresses: the setting broker.allow_metadata_addresses, off unless set
-- (ALTER DATABASE ... SET, or ALTER ROLE ... SET, for new sessions).
CREATE OR REPLACE FUNCTION broker._metadata_addresses_allowed() RETURNS boolean
LANGUAGE plpgsql STABLE AS $$
BEGIN
    RETURN coalesce(nullif(current_setting('broker.allow_metadata_addresses', true), '')::boolean, false);
EXCEPTION WHEN invalid_text_representation THEN
    PERFORM broker._raise('BR050', format('broker.allow_metadata_addresses must be on or off, got %L',
        current_setting('broker.allow_metadata_addresses', true)));
END $$;
GRANT EXECUTE ON FUNCTION broker._metadata_addresses_allowed() TO broker_relay;

-- Link-local addresses and those of cloud metadata services (169.254.169.254
-- of most clouds, Alibaba's 100.100.100.200, AWS's fd00:ec2::254), also
-- written as IPv4-mapped or NAT64 IPv6 addresses.  The relay refuses the
-- same networks when it connects (broker/transport/addresses.py).
CREATE OR REPLACE FUNCTION broker._metadata_address(address inet) RETURNS boolean
LANGUAGE sql IMMUTABLE AS $$
    SELECT EXISTS (SELECT FROM unnest('{169.254.0.0/16, 100.100.100.200/32, fe80::/10, fd00:ec2::254/128,
                                        ::ffff:169.254.0.0/112, ::ffff:100.100.100.200/128,
                                        64:ff9b::169.254.0.0/112, 64:ff9b::100.100.100.200/128}'::cidr[]) network
                   WHERE address <<= network)
$$;

-- Refuses a route's host that is a link-local or cloud metadata address or
-- name (unless allowed), and an IPv4 address written other than as four
-- decimal numbers (2852039166, 0xa9fea9fe, 0251.0376.0251.0376 and the like,
-- which resolvers read as 169.254.169.254), whatever is allowed.
CREATE OR REPLACE FUNCTION broker._check_route_host(host text) RETURNS void
LANGUAGE plpgsql STABLE AS $$
DECLARE
    literal inet;
BEGIN
    IF host ~ '(^|\.)([0-9]+|0[xX][0-9A-Fa-f]*)$'
       AND host !~ '^((25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])\.){3}(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])$' THEN
        PERFORM broker._raise('BR050', format('route host %s ends in a number but is not an IPv4 address written as '
            'four decimal numbers 0-255 without leading zeros', host), 'write the address as, e.g., 192.0.2.10');
    END IF;
    IF broker._metadata_addresses_allowed() THEN
        RETURN;
    END IF;
    IF host ~ '^\[' OR host ~ '^[0-9.]+$' THEN
        BEGIN
            literal := trim(host, '[]')::inet;
        EXCEPTION WHEN invalid_text_representation THEN
            PERFORM broker._raise('BR050', format('route host %s is not an IP address', host));
        END;
    END IF;
    IF broker._metadata_address(literal)
       OR lower(host) IN ('metadata', 'metadata.google.internal', 'metadata.goog', 'instance-data',
                          'instance-data.ec2.internal', 'metadata.tencentyun.com') THEN
        PERFORM broker._raise('BR050', format('route host %s is a link-local or cloud metadata address: a route does '
            'not reach it unless the operator allows it', host),
            'to allow it: ALTER DATABASE <database> SET broker.allow_metadata_addresses = on');
    END IF;
END $$;

-- Routes name plain http(s) URLs: a host (a name, an IPv4 address or a
-- bracketed IPv6 address), an optional port and an optional path; no
-- credentials (the route's secret authenticates the peer), no query, no
-- fragment.  The address is checked part by part, and the error says what an
-- address may hold; a link-local or metadata host is refused unless allowed
-- (broker._check_route_host).
CREATE OR REPLACE FUNCTION broker.create_route(service_name text, address text, broker_instance uuid, secret text)
RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM broker._check_name('service', service_name);
    IF address IS NULL OR length(address) > 2000
       OR address !~ '^https?://([A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?|\[[0-9A-Fa-f:.]+\])(:[0-9]{1,5})?(/[A-Za-z0-9._~%!$&''()*+,;=:@/-]*)?$'
       OR coalesce(substring(address FROM '^https?://[^/]*:([0-9]+)')::integer, 1) NOT BETWEEN 1 AND 65535 THEN
        PERFORM broker._raise('BR050', format('route address must be an http:// or https:// URL of a host, with an '
            'optional port and path and without credentials, query or fragment; got %s', left(quote_nullable(address), 200)));
    END IF;
    PERFORM broker._check_route_host(substring(address FROM '^https?://(\[[^]]*\]|[^:/]*)'));
    PERFORM broker._require('broker_instance', broker_instance);
    IF secret IS NULL OR length(secret) < 16 THEN
        PERFORM broker._raise('BR050', 'the route''s secret must have at least 16 characters');
    END IF;
    INSERT INTO broker.routes (service_name, address, broker_instance, peer_secret)
    VALUES (create_route.service_name, rtrim(create_route.address, '/'), create_route.broker_instance, secret);
EXCEPTION WHEN unique_violation THEN
    PERFORM broker._raise('BR040', format('a route for service %L already exists', service_name));
END $$;
COMMENT ON FUNCTION broker.create_route(text, text, uuid, text) IS $$Says where a remote service lives: its node's URL
(`address`), its instance id (`broker_instance`) and the secret shared with that node (at least 16 characters, else
BR050). BR040 when the service has a route already. BR050 for an address that is not a plain `http(s)` URL of a host
(with an optional port and path; no credentials, query or fragment); for a host that is a link-local or cloud metadata
address or name (169.254.0.0/16, fe80::/10, 100.100.100.200, fd00:ec2::254, also as IPv4-mapped or NAT64 IPv6
addresses; `metadata`, `metadata.google.internal`, `metadata.goog`, `instance-data`, `instance-data.ec2.internal`,
`metadata.tencentyun.com`) unless the setting `broker.allow_metadata_addresses` is on (`ALTER DATABASE … SET
broker.allow_metadata_addresses = on`); and, whatever is allowed, for a host that ends in a number but is not an IPv4
address in four decimals (`2852039166`, `0xa9fea9fe`, `010.0.0.1`: resolvers read these as other addresses).$$;

CREATE OR REPLACE FUNCTION broker.drop_route(service_name text) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM broker.routes WHERE routes.service_name = broker._require('service_name', drop_route.service_name);
    IF NOT FOUND THEN
        PERFORM broker._raise('BR006', format('no route for service %L', service_name));
    END IF;
END $$;
COMMENT ON FUNCTION broker.drop_route(text) IS $$Drops the route of a remote service; BR006 when it has none.$$;
