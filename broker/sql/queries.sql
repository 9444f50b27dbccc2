-- Every statement the Python side runs on the broker's database that is not a plain call of a function of the
-- SQL API (those are broker.queries.call and select_from): lookups on the broker's tables and views, the relay's
-- and the transport's COPY, locks, settings, the schema's own records.  Each block is a line `-- name --`, comment
-- lines that say what it is, and its statement; broker.queries.QUERIES holds each by name.

-- The node -----------------------------------------------------------------------------------------

-- broker_instance --
-- This node's broker_instance: what a peer's routes to it name.
SELECT broker_instance FROM broker.node;

-- schema_revision --
-- The revision Alembic stamped: none before the schema is built.
SELECT version_num FROM public.broker_alembic_version;

-- Routes and peers ---------------------------------------------------------------------------------

-- routes --
-- Every route, without its secret: for showing.
SELECT service_name, address, broker_instance, created_at FROM broker.routes ORDER BY service_name;

-- routes_with_secrets --
-- Every route with its secret, grouped by peer (address, broker_instance, secret).
SELECT service_name, address, broker_instance, peer_secret
FROM broker.routes
ORDER BY address, broker_instance, peer_secret, service_name;

-- destinations --
-- One row per destination node the relay sends to: its address, broker_instance, the secret its routes sign
-- with, and the secrets being rotated in or out (other_secrets).
SELECT r.address, r.broker_instance, min(r.peer_secret) AS peer_secret,
       ARRAY(SELECT p.secret FROM broker.peer_secrets p WHERE p.broker_instance = r.broker_instance
             ORDER BY p.role, p.added_at DESC) AS other_secrets
FROM broker.routes r
GROUP BY r.address, r.broker_instance
ORDER BY r.address;

-- database_clock --
-- The database server's clock, in seconds since the epoch.
SELECT extract(epoch FROM clock_timestamp())::float8;

-- rotated_secrets --
-- The secrets held for the peer besides its routes' while one is rotated, each with its role (next or previous).
SELECT secret, role FROM broker.peer_secrets WHERE broker_instance = :instance ORDER BY role, added_at DESC;

-- metadata_addresses_allowed --
-- Whether the operator lets routes reach link-local and cloud metadata addresses (broker/transport/addresses.py).
SELECT broker._metadata_addresses_allowed();

-- peer_is_routed --
-- Whether this node routes any service to the node of that broker_instance.
SELECT EXISTS (SELECT FROM broker.routes WHERE broker_instance = :instance);

-- secrets_of_peer --
-- The secrets this node shares with the node of that broker_instance.  The routes' secrets first: while no
-- secret is rotated they are the only ones.
SELECT peer_secret FROM broker.routes WHERE broker_instance = :instance
UNION
SELECT secret FROM broker.peer_secrets WHERE broker_instance = :instance;

-- note_secret_use --
-- The peer just signed a batch with the secret of that SHA-256.  broker.transport.receiving writes it at most
-- every NOTE_SECRET_USE_EVERY_S per peer and secret.
INSERT INTO broker.peer_secret_use (broker_instance, secret_sha256, last_used_at)
VALUES (:instance, :secret_sha256, now())
ON CONFLICT (broker_instance, secret_sha256) DO UPDATE SET last_used_at = excluded.last_used_at;

-- peer_secrets --
-- Each secret this node holds for a peer: the routes' (current), and those being rotated in (next) or out
-- (previous, with since when), with when the peer last signed a batch with it; the latest used first.
SELECT s.role, s.since, u.last_used_at
FROM (SELECT DISTINCT 'current' AS role, peer_secret AS secret, NULL::timestamptz AS since FROM broker.routes
      WHERE broker_instance = :instance
      UNION ALL
      SELECT role, secret, added_at FROM broker.peer_secrets WHERE broker_instance = :instance) s
LEFT JOIN broker.peer_secret_use u
       ON u.broker_instance = :instance AND u.secret_sha256 = sha256(convert_to(s.secret, 'UTF8'))
ORDER BY u.last_used_at DESC NULLS LAST;

-- services_routed_to --
-- The services this node routes to the node of that broker_instance.
SELECT service_name FROM broker.routes WHERE broker_instance = :instance ORDER BY 1;

-- The catalog --------------------------------------------------------------------------------------

-- message_types --
-- Every message type with its validation.
SELECT name, validation FROM broker.message_types ORDER BY name;

-- contracts --
-- Contracts (all, or those named) as two nodes compare them: each message type, who sends it and its validation.
SELECT c.name,
       coalesce(jsonb_object_agg(mt.name, jsonb_build_object('sent_by', cmt.sent_by, 'validation', mt.validation))
                FILTER (WHERE mt.name IS NOT NULL), '{}') AS message_types
FROM broker.contracts c
LEFT JOIN broker.contract_message_types cmt USING (contract_id)
LEFT JOIN broker.message_types mt USING (message_type_id)
WHERE CAST(:names AS text[]) IS NULL OR c.name = ANY(CAST(:names AS text[]))
GROUP BY c.name
ORDER BY c.name;

-- services --
-- Services (all, or those named): name, queue, queue_enabled and the contracts each accepts.
SELECT s.name, q.name AS queue, q.is_enabled AS queue_enabled,
       coalesce(array_agg(c.name ORDER BY c.name) FILTER (WHERE c.name IS NOT NULL), '{}') AS contracts
FROM broker.services s
JOIN broker.queues q USING (queue_id)
LEFT JOIN broker.service_contracts sc USING (service_id)
LEFT JOIN broker.contracts c ON c.contract_id = sc.contract_id
WHERE CAST(:names AS text[]) IS NULL OR s.name = ANY(CAST(:names AS text[]))
GROUP BY s.name, q.name, q.is_enabled
ORDER BY s.name;

-- broker_priorities --
-- Every broker priority.
SELECT name, priority, contract_name, local_service_name, remote_service_name
FROM broker.broker_priorities
ORDER BY name;

-- queues --
-- Every queue with its settings.
SELECT name, is_enabled, retention, poison_threshold FROM broker.queues ORDER BY name;

-- lock_definitions --
-- Two `broker definitions apply` on one node run one after the other, each planned on what the other left.
SELECT pg_advisory_xact_lock(hashtext('broker definitions'));

-- contracts_in_use --
-- The contracts of the open conversations begun here, by remote service.  Only the conversations this side
-- began: the service that begins a conversation need not accept its contract.
SELECT DISTINCT far_service, contract_name
FROM broker.conversation_endpoints
WHERE is_initiator AND NOT far_is_local AND state <> 'closed';

-- Queues and conversations -------------------------------------------------------------------------

-- queue_status --
-- broker.queue_status of every queue (or the one named), with the oldest message's age in seconds.
SELECT queue_name, status, retention, poison_threshold, depth,
       extract(epoch FROM oldest_message_age)::float8 AS oldest_message_age_s, readers, dead_letters
FROM broker.queue_status
WHERE CAST(:queue AS text) IS NULL OR queue_name = :queue
ORDER BY queue_name;

-- queue_id --
-- The queue's id, or none.
SELECT queue_id FROM broker.queues WHERE name = :queue;

-- queue_of_lock --
-- The queue whose lease the lock token is, or was while its ending is kept.
SELECT q.name FROM broker.queues q
WHERE q.queue_id IN (SELECT l.queue_id FROM broker.leases l WHERE l.lock_token = :token
                     UNION ALL
                     SELECT e.queue_id FROM broker.ended_leases e WHERE e.lock_token = :token);

-- refuse_lock_as_unknown --
-- BR060 as for a lock never made (broker/sql/functions/12_leases.sql).
SELECT broker._refuse_lost_lock(:token, NULL, NULL);

-- group_of_lock --
-- The conversation group a lease holds, while the lease is kept.
SELECT conversation_group_id FROM broker.leases WHERE lock_token = :token;

-- endpoint --
-- One side of a conversation, from broker.conversation_endpoints.
SELECT * FROM broker.conversation_endpoints WHERE conversation_handle = :handle;

-- conversation_messages --
-- The messages of one conversation side that this node still holds, the first of them up to the limit, and why
-- each is where it is: sent and not yet acknowledged (or held, or delivered locally once due), arrived and not
-- yet received (or kept by the queue's retention), or dead-lettered; with how many it holds in all, how many of
-- them wait to be sent, and how many arrived and are not received.  What was acknowledged or received and
-- deleted is counted, not listed.
SELECT m.*, count(*) OVER () AS held_here,
       count(*) FILTER (WHERE m.direction = 'sent') OVER () AS waiting_to_send,
       count(*) FILTER (WHERE m.direction <> 'sent' AND m.sequence_number > 0  -- notices (0) are not numbered
                              AND m.status NOT LIKE 'received%') OVER () AS not_received
FROM (
SELECT 'sent' AS direction, t.message_sequence_number AS sequence_number, t.message_type, t.body_bytes,
       t.enqueued_at AS since, t.attempts, t.transmission_status AS status, t.traceparent
FROM broker.transmission_queue_status t WHERE t.conversation_handle = :handle
UNION ALL
SELECT 'arrived', m.message_sequence_number, mt.name, octet_length(m.body), m.enqueued_at, m.failed_attempts,
       CASE WHEN m.received_at IS NOT NULL
                 THEN format('received at %s, kept by the queue''s retention',
                             to_char(m.received_at, 'YYYY-MM-DD HH24:MI:SS TZ'))
            WHEN l.expires_at > now()
                 THEN format('handed out under a lock until %s', to_char(l.expires_at, 'YYYY-MM-DD HH24:MI:SS TZ'))
            WHEN m.failed_attempts > 0
                 THEN format('waiting for a reader after %s failed attempts', m.failed_attempts)
            ELSE 'waiting for a reader' END,
       m.traceparent
FROM broker.endpoints e
JOIN broker.queue_messages m ON m.conversation_group_id = e.conversation_group_id
                            AND m.conversation_handle = e.conversation_handle
JOIN broker.message_types mt USING (message_type_id)
LEFT JOIN broker.leases l ON l.conversation_group_id = m.conversation_group_id
                         AND m.queue_position = ANY (l.queue_positions)
WHERE e.conversation_handle = :handle
UNION ALL
SELECT 'dead letter', d.message_sequence_number, d.message_type, octet_length(d.body), d.enqueued_at,
       d.failed_attempts, format('dead-lettered at %s: %s', to_char(d.dead_lettered_at, 'YYYY-MM-DD HH24:MI:SS TZ'),
                                 d.reason),
       d.traceparent
FROM broker.dead_letters d WHERE d.conversation_handle = :handle) m
ORDER BY m.direction DESC, m.sequence_number
LIMIT :limit;

-- endpoints_named --
-- Each conversation side named, from broker.conversation_endpoints (unknown handles are left out).
SELECT * FROM broker.conversation_endpoints WHERE conversation_handle = ANY(CAST(:handles AS uuid[]));

-- open_endpoints --
-- How many conversation sides are not closed.
SELECT count(*) FROM broker.endpoints WHERE state <> 'closed';

-- endpoint_handle --
-- The handle of this node's side of a conversation.
SELECT conversation_handle FROM broker.endpoints
WHERE conversation_id = :conversation_id AND is_initiator = :is_initiator;

-- waiting_messages --
-- The messages waiting in a queue, in the order receive takes them, each with the head of its body and its whole
-- size: a look that takes no lock and consumes nothing (the console's browse, GET /v1/queues/{queue}/messages).
SELECT m.queue_position, m.conversation_handle, m.conversation_id, m.conversation_group_id,
       m.message_sequence_number, mt.name AS message_type, m.priority, m.enqueued_at, m.delivery_count,
       m.failed_attempts, l.expires_at AS locked_until, octet_length(m.body) AS body_bytes,
       substring(m.body FROM 1 FOR :head_bytes) AS body_head
FROM broker.queue_messages m
JOIN broker.message_types mt USING (message_type_id)
LEFT JOIN broker.leases l ON l.conversation_group_id = m.conversation_group_id
                         AND m.queue_position = ANY (l.queue_positions) AND l.expires_at > now()
WHERE m.queue_id = :queue_id AND m.received_at IS NULL
ORDER BY m.priority DESC, m.queue_position
LIMIT :limit OFFSET :offset;

-- The transmission queue ---------------------------------------------------------------------------

-- transmission_queue --
-- Waiting messages, oldest first, from broker.transmission_queue_status.
SELECT * FROM broker.transmission_queue_status
ORDER BY enqueued_at, conversation_handle, message_sequence_number
LIMIT :limit OFFSET :offset;

-- transmission_by_destination --
-- One row per destination node: how much waits for it, since when, and why (the status of the message that has
-- waited longest).  Messages held until their delivery time for a service of this node wait there too:
-- "(this node)".
SELECT t.destination, count(*) AS messages, count(DISTINCT t.conversation_handle) AS conversations,
       extract(epoch FROM now() - min(t.enqueued_at))::float8 AS oldest_message_age_s,
       max(t.attempts) AS attempts, min(t.next_attempt_at) AS next_attempt_at,
       (array_agg(t.transmission_status ORDER BY t.enqueued_at))[1] AS status
FROM (SELECT t.*, CASE WHEN EXISTS (SELECT 1 FROM broker.services s WHERE s.name = t.to_service)
                       THEN '(this node)' ELSE coalesce(r.address, '(no route)') END AS destination
      FROM broker.transmission_queue_status t
      LEFT JOIN broker.routes r ON r.service_name = t.to_service) t
GROUP BY t.destination
ORDER BY t.destination;

-- unrouted_services --
-- Remote services that messages wait for and no route names.
SELECT t.to_service, count(*) AS messages
FROM broker.transmission_queue_status t
WHERE NOT EXISTS (SELECT 1 FROM broker.routes r WHERE r.service_name = t.to_service)
  AND NOT EXISTS (SELECT 1 FROM broker.services s WHERE s.name = t.to_service)
GROUP BY t.to_service
ORDER BY t.to_service;

-- failing_destinations --
-- Destinations with messages that were tried and not acknowledged, and the last failure's words.
SELECT r.address, count(*) AS messages, max(t.attempts) AS attempts,
       (array_agg(t.transmission_status ORDER BY t.attempts DESC))[1] AS status
FROM broker.transmission_queue_status t
JOIN broker.routes r ON r.service_name = t.to_service
WHERE t.attempts > 0
GROUP BY r.address
ORDER BY r.address;

-- waiting_to_transmit --
-- How many messages wait to be transmitted (or, for a service of this node, for their delivery time).
SELECT count(*) FROM broker.transmission_queue_status;

-- try_lane_lock --
-- A relay lane talks to a destination while its session holds this lock (broker.relay.Lane).
SELECT pg_try_advisory_lock(1651663724, hashtext(:address || ' lane ' || :lane));

-- routed_backlogs --
-- What waits for each destination node: how many messages, how many have been due for longer than max_wait_s
-- (a held message from its delivery time), the longest wait, and whether a relay holds a lock of one of its
-- lanes (pg_locks shows a two-key advisory lock as classid, objid and objsubid 2).
SELECT r.address, count(*) AS messages,
       count(*) FILTER (WHERE w.due_since < now() - make_interval(secs => :max_wait_s)) AS overdue,
       extract(epoch FROM now() - min(w.due_since))::float8 AS longest_wait_s,
       EXISTS (SELECT FROM pg_locks l, generate_series(0, :lanes - 1) lane
               WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2
                 AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
                 AND l.classid = 1651663724 AND l.objid = hashtext(r.address || ' lane ' || lane)::oid
              ) AS relayed
FROM broker.transmission_queue_status t
JOIN broker.routes r ON r.service_name = t.to_service
CROSS JOIN LATERAL (SELECT CASE WHEN t.attempts = 0 THEN least(t.next_attempt_at, now())
                                ELSE t.enqueued_at END AS due_since) w
WHERE NOT EXISTS (SELECT 1 FROM broker.services s WHERE s.name = t.to_service)
GROUP BY r.address
ORDER BY r.address;

-- What `broker status` shows besides queues and the transmission queue -----------------------------

-- conversation_counts --
-- Conversation endpoints by service and state.
SELECT service_name, state, endpoints, oldest_created_at, without_lifetime
FROM broker.endpoint_counts
ORDER BY service_name, state;

-- ingests --
-- Each ingest's checkpoint and how far it is behind its queue (broker.ingest_lag): the messages above it and the
-- age of the oldest of them.
SELECT i.queue_name, i.output, i.queue_position, i.last_run, i.rows_ingested, i.runs, i.updated_at,
       l.lag_messages, l.lag_s
FROM broker.ingests i
JOIN broker.ingest_lag() l USING (queue_name, output)
ORDER BY queue_name, output;

-- latest_dead_letters --
-- The latest dead letters of every queue, the latest first.
SELECT queue_name, conversation_id, conversation_handle, message_sequence_number, message_type, reason,
       dead_lettered_at
FROM broker.dead_letters
ORDER BY dead_letter_id DESC
LIMIT :limit;

-- dead_letters --
-- A queue's dead letters, oldest first, with why each was dead-lettered: up to the limit after the offset, and
-- only as many as come to max_bytes of bodies, but always the first; the bodies' lengths are read without
-- reading the bodies.
SELECT dead_letter_id, conversation_handle, conversation_id, message_sequence_number, message_type, body,
       enqueued_at, dead_lettered_at, failed_attempts, reason, traceparent
FROM (SELECT d.dead_letter_id, sum(coalesce(octet_length(d.body), 0)) OVER (ORDER BY d.dead_letter_id) AS bytes,
             row_number() OVER (ORDER BY d.dead_letter_id) AS place
      FROM (SELECT dead_letter_id, body FROM broker.dead_letters WHERE queue_name = :queue
            ORDER BY dead_letter_id LIMIT :limit OFFSET :offset) d) listed
JOIN broker.dead_letters USING (dead_letter_id)
WHERE listed.place = 1 OR listed.bytes <= :max_bytes
ORDER BY dead_letter_id;

-- lost_messages --
-- What a database that went back to an earlier point lost, as this node found it, the latest first.
SELECT l.conversation_id, e.conversation_handle, coalesce(e.far_service, '') AS far_service,
       l.far_broker_instance, l.direction, l.first_number, l.last_number, l.outcome, l.found_at
FROM broker.lost_messages l
LEFT JOIN broker.endpoints e ON e.conversation_id = l.conversation_id AND e.is_initiator = l.is_initiator
ORDER BY l.found_at DESC, l.conversation_id
LIMIT :limit;

-- last_dead_letter --
-- The id of the latest dead letter, 0 when there is none.
SELECT coalesce(max(dead_letter_id), 0) FROM broker.dead_letters;

-- traced_dead_letters_after --
-- The next dead letters after that id that carry a traceparent, oldest first.
SELECT dead_letter_id, queue_name, conversation_handle, message_sequence_number, reason, dead_lettered_at,
       traceparent
FROM broker.dead_letters
WHERE dead_letter_id > :after AND traceparent IS NOT NULL
ORDER BY dead_letter_id
LIMIT 1000;

-- API keys -----------------------------------------------------------------------------------------

-- insert_api_key --
-- A new key: only its secret's SHA-256 is kept.
INSERT INTO broker.api_keys (key_id, name, secret_sha256, scopes) VALUES (:key_id, :name, :secret_sha256, :scopes);

-- live_api_key --
-- The key's name, secret hash and scopes, unless it is revoked or unknown.
SELECT name, secret_sha256, scopes FROM broker.api_keys WHERE key_id = :key_id AND revoked_at IS NULL;

-- api_keys --
-- Every key, revoked or not, without its secret.
SELECT key_id, name, scopes, created_at, revoked_at FROM broker.api_keys ORDER BY created_at;

-- revoke_api_key --
-- Revokes a live key (one row updated) and nothing else.
UPDATE broker.api_keys SET revoked_at = now() WHERE key_id = :key_id AND revoked_at IS NULL;

-- The SQL API --------------------------------------------------------------------------------------

-- end_the_trace --
-- A traced call sets broker.traceparent for its transaction (broker.queries.call); this clears it after the
-- call, so that it reaches no later send.
SELECT set_config('broker.traceparent', '', true);

-- The relay (broker.relay) -------------------------------------------------------------------------

-- next_batch_v4 --
-- A lane's next batch for a destination in wire version 4 (broker.transport.wire).
COPY (SELECT * FROM broker.next_batch(:address, :max_messages, :max_bytes, :first, :last)) TO STDOUT (FORMAT binary);

-- next_batch_v3 --
-- A lane's next batch for a destination in wire version 3, which has no message ids.
COPY (SELECT conversation_id, sender_is_initiator, from_service, to_service, contract, expires_at,
             sequence_number, message_type, body, traceparent
      FROM broker.next_batch(:address, :max_messages, :max_bytes, :first, :last))
TO STDOUT (FORMAT binary);

-- A transport batch accepted (broker.transport.receiving) ------------------------------------------

-- copy_batch_v4 --
-- A batch of wire version 4 into the session's temporary table, made by broker.stage_batch.
COPY pg_temp.incoming_batch FROM STDIN (FORMAT binary);

-- copy_batch_v3 --
-- A batch of wire version 3, which has no message ids: they stay NULL.
COPY pg_temp.incoming_batch (conversation_id, sender_is_initiator, from_service, to_service, contract,
                             expires_at, sequence_number, message_type, body, traceparent)
FROM STDIN (FORMAT binary);

-- accept_batch --
-- The batch stored, and the answer as the database writes it: the answer is signed as these very bytes.
SELECT broker.accept_batch(:instance)::text;

-- The node's timers (broker.timers) ----------------------------------------------------------------

-- listen_for_transmissions --
-- The relay wakes on what comes into the transmission queue.
LISTEN broker_transmission_queue;

-- Internal activation (broker.activator) -----------------------------------------------------------

-- activate --
-- One call of the procedure, in a session as the node opened it: whatever the previous call set for the session
-- (its role, its settings: SET without LOCAL) is reset first.
RESET ROLE; RESET ALL; SELECT broker.call_activated_procedure(:queue, :slot);

-- record_activations --
-- What a node's readers did since it last said, added to the queue's totals.
UPDATE broker.queue_activation a
SET activations = a.activations + :activations, failures = a.failures + :failures,
    last_failure = coalesce(:last_failure, a.last_failure),
    last_failure_at = CASE WHEN :last_failure IS NULL THEN a.last_failure_at ELSE now() END
FROM broker.queues q
WHERE q.queue_id = a.queue_id AND q.name = :queue;

-- activation_status --
-- broker.activation_status: each queue's activation, its readers now and what its calls did.
SELECT queue_name, procedure_name, status, max_queue_readers, execute_as, readers, activations, failures,
       last_failure, last_failure_at
FROM broker.activation_status
ORDER BY queue_name;

-- The REST API (api) -------------------------------------------------------------------------------

-- limit_lock_waits --
-- A statement that waits this long for a lock gives up (503, nothing applied): a transaction that holds rows for
-- long must not hold the API's connections as long.
SET lock_timeout = '5s';

-- listen_for_arrivals --
-- Readers that wait for a queue wake on broker._enqueue's notification.
LISTEN broker_queue;

-- The Spark ingest (spark_ingest) ------------------------------------------------------------------

-- ingest_lag --
-- The messages above the checkpoint of (queue, output) and the age of the oldest in seconds.
SELECT lag_messages, lag_s FROM broker.ingest_lag() WHERE queue_name = :queue AND output = :output;

-- release_run_lock --
-- An ingest run lets its lock go before its session closes: a closed session's server process lets go of it only
-- as it exits, a moment later, and a follow's next round, started at once, would find the lock still held.  The
-- session is the run's own, so it holds no other.
SELECT pg_advisory_unlock_all();

-- no_idle_session_timeout --
-- The session waits while Spark writes: the server's idle_session_timeout must not end it (PostgreSQL 14+).
SELECT set_config(name, '0', false) FROM pg_settings WHERE name = 'idle_session_timeout';

-- The schema's own records (broker.schema, broker.migrate) -----------------------------------------

-- lock_schema_changes --
-- Two processes that build or upgrade one database at once do it one after the other.
SELECT pg_advisory_xact_lock(hashtext('broker schema build'));

-- schema_exists --
-- Whether anything of the broker's schema is there.
SELECT to_regnamespace('broker') IS NOT NULL OR to_regclass('public.broker_alembic_version') IS NOT NULL;

-- version_table_exists --
-- Whether Alembic's version table is there.
SELECT to_regclass('public.broker_alembic_version') IS NOT NULL;

-- stamp --
-- broker/sql/ creates the version table as Alembic does (it grants on it); the row is Alembic's stamp.
INSERT INTO public.broker_alembic_version (version_num) VALUES (:revision);

-- function_files_applied --
-- Each function file applied, with its SHA-256.
SELECT file_name, sha256 FROM broker.function_files;

-- record_function_file --
-- A function file applied, with its SHA-256.
INSERT INTO broker.function_files (file_name, sha256) VALUES (:file_name, :sha256)
ON CONFLICT (file_name) DO UPDATE SET sha256 = excluded.sha256;

-- function_release --
-- The release whose function files the database holds, and the earliest release they serve.
SELECT release, serves_from FROM broker.function_release;

-- record_function_release --
-- The release whose function files were just applied, and the earliest release they serve.
INSERT INTO broker.function_release (release, serves_from) VALUES (:release, :serves_from)
ON CONFLICT (only_row) DO UPDATE SET release = excluded.release, serves_from = excluded.serves_from;
