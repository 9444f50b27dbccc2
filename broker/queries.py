"""Every statement the Python side runs on the broker's database, each named once here, so that the SQL a module
depends on is found in one place: the SQL API as broker.core calls it, the lookups around it (the node, routes
and peers, the catalog as it is described, queues, the transmission queue, API keys, what `broker status`
shows), the relay's and the transport's statements, the REST API's and the Spark ingest's, and the schema's own
records.  Where a lookup needs more than its statement, it is a function here too.
"""
from typing import Any
from uuid import UUID

from sqlalchemy import Connection, Row, text

from broker import errors

# --- The node -------------------------------------------------------------------------------------

BROKER_INSTANCE = text("SELECT broker_instance FROM broker.node")
SCHEMA_REVISION = text("SELECT version_num FROM public.broker_alembic_version")


def broker_instance(connection: Connection) -> str:
    """This node's broker_instance: what a peer's routes to it name."""
    return str(connection.execute(BROKER_INSTANCE).scalar_one())


def schema_revision(connection: Connection) -> str | None:
    return connection.execute(SCHEMA_REVISION).scalar()


# The head revision of the oldest release whose nodes may serve this database (broker/sql/functions/15_compatibility.sql).
OLDEST_SERVING_REVISION = text("SELECT broker.oldest_serving_revision()")


def oldest_serving_revision(connection: Connection) -> str:
    return connection.execute(OLDEST_SERVING_REVISION).scalar_one()


# --- Routes and peers -----------------------------------------------------------------------------

ROUTES = text("SELECT service_name, address, broker_instance, created_at FROM broker.routes ORDER BY service_name")
ROUTES_WITH_SECRETS = text(
    "SELECT service_name, address, broker_instance, peer_secret FROM broker.routes"
    " ORDER BY address, broker_instance, peer_secret, service_name")
# Each destination with the secret its routes sign with, and those being rotated in or out (other_secrets).
DESTINATIONS = text(
    "SELECT r.address, r.broker_instance, min(r.peer_secret) AS peer_secret,"
    "       ARRAY(SELECT p.secret FROM broker.peer_secrets p WHERE p.broker_instance = r.broker_instance"
    "             ORDER BY p.role, p.added_at DESC) AS other_secrets"
    " FROM broker.routes r GROUP BY r.address, r.broker_instance ORDER BY r.address")
DATABASE_CLOCK = text("SELECT extract(epoch FROM clock_timestamp())::float8")
ROTATED_SECRETS = text("SELECT secret, role FROM broker.peer_secrets WHERE broker_instance = :instance"
                       " ORDER BY role, added_at DESC")
METADATA_ADDRESSES_ALLOWED = text("SELECT broker._metadata_addresses_allowed()")
PEER_IS_ROUTED = text("SELECT EXISTS (SELECT FROM broker.routes WHERE broker_instance = :instance)")
# The routes' secrets first: while no secret is rotated they are the only ones.
SECRETS_OF_PEER = text(
    "SELECT peer_secret FROM broker.routes WHERE broker_instance = :instance"
    " UNION SELECT secret FROM broker.peer_secrets WHERE broker_instance = :instance")
# broker.transport.receiving writes it at most every NOTE_SECRET_USE_EVERY_S per peer and secret.
NOTE_SECRET_USE = text(
    "INSERT INTO broker.peer_secret_use (broker_instance, secret_sha256, last_used_at)"
    " VALUES (:instance, :secret_sha256, now())"
    " ON CONFLICT (broker_instance, secret_sha256) DO UPDATE SET last_used_at = excluded.last_used_at")
# Each secret this node holds for a peer: the routes' (current), and those being rotated in (next) or out
# (previous), with when the peer last signed a batch with it.
PEER_SECRETS = text("""
    SELECT s.role, s.since, u.last_used_at
    FROM (SELECT DISTINCT 'current' AS role, peer_secret AS secret, NULL::timestamptz AS since FROM broker.routes
          WHERE broker_instance = :instance
          UNION ALL
          SELECT role, secret, added_at FROM broker.peer_secrets WHERE broker_instance = :instance) s
    LEFT JOIN broker.peer_secret_use u
           ON u.broker_instance = :instance AND u.secret_sha256 = sha256(convert_to(s.secret, 'UTF8'))
    ORDER BY u.last_used_at DESC NULLS LAST""")
SERVICES_ROUTED_TO = text("SELECT service_name FROM broker.routes WHERE broker_instance = :instance ORDER BY 1")


def routes(connection: Connection) -> list[Row]:
    """Every route, without its secret: for showing."""
    return connection.execute(ROUTES).all()


def routes_with_secrets(connection: Connection) -> list[Row]:
    """Every route with its secret, grouped by peer (address, broker_instance, secret)."""
    return connection.execute(ROUTES_WITH_SECRETS).all()


def database_clock(connection: Connection) -> float:
    """The database server's clock, in seconds since the epoch."""
    return connection.execute(DATABASE_CLOCK).scalar_one()


def rotated_secrets(connection: Connection, instance: str) -> list[Row]:
    """The secrets held for the peer besides its routes' while one is rotated, each with its role (next or
    previous)."""
    return connection.execute(ROTATED_SECRETS, {"instance": instance}).all()


def destinations(connection: Connection) -> list[Row]:
    """One row per destination node the relay sends to: its address, broker_instance, the secret its routes sign
    with, and the other secrets held for it while one is rotated."""
    return connection.execute(DESTINATIONS).all()


def metadata_addresses_allowed(connection: Connection) -> bool:
    """Whether the operator lets routes reach link-local and cloud metadata addresses (broker/transport/addresses.py)."""
    return connection.execute(METADATA_ADDRESSES_ALLOWED).scalar_one()


def is_routed_peer(connection: Connection, instance: str) -> bool:
    """Whether this node routes any service to the node of that broker_instance."""
    return connection.execute(PEER_IS_ROUTED, {"instance": instance}).scalar_one()


def secrets_of_peer(connection: Connection, instance: str) -> list[str]:
    """The secrets this node shares with the node of that broker_instance."""
    return list(connection.execute(SECRETS_OF_PEER, {"instance": instance}).scalars())


def note_secret_use(connection: Connection, instance: str, secret_sha256: bytes) -> None:
    """Records that the peer just signed a batch with the secret of that SHA-256."""
    connection.execute(NOTE_SECRET_USE, {"instance": instance, "secret_sha256": secret_sha256})


def peer_secrets(connection: Connection, instance: str) -> list[Row]:
    """The role of each secret held for the peer (current, next or previous), since when a previous one is
    on its way out, and when the peer last signed with it; the latest used first."""
    return connection.execute(PEER_SECRETS, {"instance": instance}).all()


def services_routed_to(connection: Connection, instance: str) -> list[str]:
    return list(connection.execute(SERVICES_ROUTED_TO, {"instance": instance}).scalars())


# --- The catalog ----------------------------------------------------------------------------------

MESSAGE_TYPES = text("SELECT name, validation FROM broker.message_types ORDER BY name")
# A contract as two nodes compare it: each message type, who sends it and its validation.
CONTRACTS = text(
    "SELECT c.name, coalesce(jsonb_object_agg(mt.name, jsonb_build_object('sent_by', cmt.sent_by,"
    " 'validation', mt.validation)) FILTER (WHERE mt.name IS NOT NULL), '{}') AS message_types"
    " FROM broker.contracts c"
    " LEFT JOIN broker.contract_message_types cmt USING (contract_id)"
    " LEFT JOIN broker.message_types mt USING (message_type_id)"
    " WHERE CAST(:names AS text[]) IS NULL OR c.name = ANY(CAST(:names AS text[]))"
    " GROUP BY c.name ORDER BY c.name")
SERVICES = text(
    "SELECT s.name, q.name AS queue, q.is_enabled AS queue_enabled,"
    " coalesce(array_agg(c.name ORDER BY c.name) FILTER (WHERE c.name IS NOT NULL), '{}') AS contracts"
    " FROM broker.services s JOIN broker.queues q USING (queue_id)"
    " LEFT JOIN broker.service_contracts sc USING (service_id)"
    " LEFT JOIN broker.contracts c ON c.contract_id = sc.contract_id"
    " WHERE CAST(:names AS text[]) IS NULL OR s.name = ANY(CAST(:names AS text[]))"
    " GROUP BY s.name, q.name, q.is_enabled ORDER BY s.name")
BROKER_PRIORITIES = text(
    "SELECT name, priority, contract_name, local_service_name, remote_service_name FROM broker.broker_priorities"
    " ORDER BY name")
QUEUES = text("SELECT name, is_enabled, retention, poison_threshold FROM broker.queues ORDER BY name")
# Two `broker definitions apply` on one node run one after the other, each planned on what the other left.
LOCK_DEFINITIONS = text("SELECT pg_advisory_xact_lock(hashtext('broker definitions'))")
# Only the conversations this side began: the service that begins a conversation need not accept its contract.
CONTRACTS_IN_USE = text(
    "SELECT DISTINCT far_service, contract_name FROM broker.conversation_endpoints"
    " WHERE is_initiator AND NOT far_is_local AND state <> 'closed'")


def broker_priorities(connection: Connection) -> list[Row]:
    return connection.execute(BROKER_PRIORITIES).all()


def queues(connection: Connection) -> list[Row]:
    """Every queue with its settings."""
    return connection.execute(QUEUES).all()


def lock_definitions(connection: Connection) -> None:
    connection.execute(LOCK_DEFINITIONS)


def message_types(connection: Connection) -> list[Row]:
    return connection.execute(MESSAGE_TYPES).all()


def contracts(connection: Connection, names: list[str] | None = None) -> dict[str, dict[str, dict]]:
    """Contracts (all, or those named) by name: message type -> {"sent_by": …, "validation": …}."""
    return dict(connection.execute(CONTRACTS, {"names": names}).all())


def services(connection: Connection, names: list[str] | None = None) -> list[Row]:
    """Services (all, or those named): name, queue, queue_enabled and the contracts each accepts."""
    return connection.execute(SERVICES, {"names": names}).all()


def contracts_in_use_by_remote_service(connection: Connection) -> dict[str, set[str]]:
    """For each remote service with open conversations begun here: the contracts they use."""
    in_use: dict[str, set[str]] = {}
    for row in connection.execute(CONTRACTS_IN_USE):
        in_use.setdefault(row.far_service, set()).add(row.contract_name)
    return in_use


# --- Queues and conversations ---------------------------------------------------------------------

QUEUE_STATUS = text(
    "SELECT queue_name, status, retention, poison_threshold, depth,"
    " extract(epoch FROM oldest_message_age)::float8 AS oldest_message_age_s, readers, dead_letters"
    " FROM broker.queue_status WHERE CAST(:queue AS text) IS NULL OR queue_name = :queue ORDER BY queue_name")
QUEUE_ID = text("SELECT queue_id FROM broker.queues WHERE name = :queue")
QUEUE_OF_LOCK = text("""
    SELECT q.name FROM broker.queues q
    WHERE q.queue_id IN (SELECT l.queue_id FROM broker.leases l WHERE l.lock_token = :token
                         UNION ALL
                         SELECT e.queue_id FROM broker.ended_leases e WHERE e.lock_token = :token)
""")
# BR060 as for a lock never made (broker/sql/functions/12_leases.sql).
REFUSE_LOCK_AS_UNKNOWN = text("SELECT broker._refuse_lost_lock(:token, NULL, NULL)")
GROUP_OF_LOCK = text("SELECT conversation_group_id FROM broker.leases WHERE lock_token = :token")
ENDPOINT = text("SELECT * FROM broker.conversation_endpoints WHERE conversation_handle = :handle")
# The messages of one conversation side that this node still holds, the first :limit of them, and why each is
# where it is: sent and not yet acknowledged (or held, or delivered locally once due), arrived and not yet received
# (or kept by the queue's retention), or dead-lettered; with how many it holds in all, how many of them wait to be
# sent, and how many arrived and are not received.  What was acknowledged or received and deleted is counted, not
# listed.
CONVERSATION_MESSAGES = text("""
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
    LIMIT :limit
""")
ENDPOINTS_NAMED = text("SELECT * FROM broker.conversation_endpoints"
                       " WHERE conversation_handle = ANY(CAST(:handles AS uuid[]))")
OPEN_ENDPOINTS = text("SELECT count(*) FROM broker.endpoints WHERE state <> 'closed'")
ENDPOINT_HANDLE = text("SELECT conversation_handle FROM broker.endpoints"
                       " WHERE conversation_id = :conversation_id AND is_initiator = :is_initiator")


def queue_statuses(connection: Connection, queue: str | None = None) -> list[Row]:
    """broker.queue_status of every queue (or the one named), with the oldest message's age in seconds."""
    return connection.execute(QUEUE_STATUS, {"queue": queue}).all()


def queue_id(connection: Connection, queue: str) -> int | None:
    return connection.execute(QUEUE_ID, {"queue": queue}).scalar()


def queue_of_lock(connection: Connection, lock_token: UUID) -> str | None:
    """The queue whose lease the lock token is, or was while its ending is kept."""
    return connection.execute(QUEUE_OF_LOCK, {"token": lock_token}).scalar()


def refuse_lock_as_unknown(connection: Connection, lock_token: UUID) -> None:
    """Raises LockLost (reason unknown), word for word what the broker raises for a lock never made."""
    with errors.translated_errors():
        connection.execute(REFUSE_LOCK_AS_UNKNOWN, {"token": lock_token})


def group_of_lock(connection: Connection, lock_token: UUID) -> UUID | None:
    """The conversation group a lease holds, while the lease is kept."""
    return connection.execute(GROUP_OF_LOCK, {"token": lock_token}).scalar()


def conversation_messages(connection: Connection, handle: UUID, limit: int) -> list[Row]:
    return connection.execute(CONVERSATION_MESSAGES, {"handle": handle, "limit": limit}).all()


def endpoint(connection: Connection, handle: UUID) -> Row | None:
    """One side of a conversation, from broker.conversation_endpoints."""
    return connection.execute(ENDPOINT, {"handle": handle}).first()


def endpoints_named(connection: Connection, handles: list[UUID]) -> dict[UUID, Row]:
    """Each conversation side named, by its handle, from broker.conversation_endpoints (unknown handles are left
    out)."""
    rows = connection.execute(ENDPOINTS_NAMED, {"handles": [str(handle) for handle in handles]}).all()
    return {row.conversation_handle: row for row in rows}


# The messages waiting in a queue, in the order receive takes them, each with the head of its body: a look that
# takes no lock and consumes nothing (the console's browse, GET /v1/queues/{queue}/messages).
WAITING_MESSAGES = text("""
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
    LIMIT :limit OFFSET :offset
""")


def waiting_messages(connection: Connection, queue_id: int, limit: int, offset: int, head_bytes: int) -> list[Row]:
    """A queue's waiting messages, with the first head_bytes of each body and its whole size."""
    return connection.execute(WAITING_MESSAGES, {"queue_id": queue_id, "limit": limit, "offset": offset,
                                                 "head_bytes": head_bytes}).all()


def open_endpoints(connection: Connection) -> int:
    return connection.execute(OPEN_ENDPOINTS).scalar_one()


def endpoint_handle(connection: Connection, conversation_id: UUID, is_initiator: bool) -> UUID:
    """The handle of this node's side of a conversation."""
    return connection.execute(ENDPOINT_HANDLE, {"conversation_id": conversation_id,
                                                "is_initiator": is_initiator}).scalar_one()


# --- The transmission queue -----------------------------------------------------------------------

TRANSMISSION_QUEUE = text(
    "SELECT * FROM broker.transmission_queue_status ORDER BY enqueued_at, conversation_handle, message_sequence_number"
    " LIMIT :limit OFFSET :offset")
# One row per destination node: how much waits for it, since when, and why (the status of the
# message that has waited longest).
# Messages held until their delivery time for a service of this node wait there too: "(this node)".
TRANSMISSION_BY_DESTINATION = text("""
    SELECT t.destination, count(*) AS messages, count(DISTINCT t.conversation_handle) AS conversations,
           extract(epoch FROM now() - min(t.enqueued_at))::float8 AS oldest_message_age_s,
           max(t.attempts) AS attempts, min(t.next_attempt_at) AS next_attempt_at,
           (array_agg(t.transmission_status ORDER BY t.enqueued_at))[1] AS status
    FROM (SELECT t.*, CASE WHEN EXISTS (SELECT 1 FROM broker.services s WHERE s.name = t.to_service)
                           THEN '(this node)' ELSE coalesce(r.address, '(no route)') END AS destination
          FROM broker.transmission_queue_status t
          LEFT JOIN broker.routes r ON r.service_name = t.to_service) t
    GROUP BY t.destination ORDER BY t.destination
""")
UNROUTED_SERVICES = text(
    "SELECT t.to_service, count(*) AS messages FROM broker.transmission_queue t"
    " WHERE NOT EXISTS (SELECT 1 FROM broker.routes r WHERE r.service_name = t.to_service)"
    " AND NOT EXISTS (SELECT 1 FROM broker.services s WHERE s.name = t.to_service)"
    " GROUP BY t.to_service ORDER BY t.to_service")
FAILING_DESTINATIONS = text(
    "SELECT r.address, count(*) AS messages, max(t.attempts) AS attempts,"
    " (array_agg(t.transmission_status ORDER BY t.attempts DESC))[1] AS status"
    " FROM broker.transmission_queue_status t JOIN broker.routes r ON r.service_name = t.to_service"
    " WHERE t.attempts > 0 GROUP BY r.address ORDER BY r.address")
WAITING_TO_TRANSMIT = text("SELECT count(*) FROM broker.transmission_queue")
# A relay lane talks to a destination while its session holds this lock (broker.relay.Lane).
TRY_LANE_LOCK = text("SELECT pg_try_advisory_lock(1651663724, hashtext(:address || ' lane ' || :lane))")
# What waits for each destination node: how many messages, how many have been due for longer than max_wait_s
# (a held message from its delivery time), the longest wait, and whether a relay holds a lock of one of its
# lanes (pg_locks shows a two-key advisory lock as classid, objid and objsubid 2).
ROUTED_BACKLOGS = text("""
    SELECT r.address, count(*) AS messages,
           count(*) FILTER (WHERE w.due_since < now() - make_interval(secs => :max_wait_s)) AS overdue,
           extract(epoch FROM now() - min(w.due_since))::float8 AS longest_wait_s,
           EXISTS (SELECT FROM pg_locks l, generate_series(0, :lanes - 1) lane
                   WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2
                     AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
                     AND l.classid = 1651663724 AND l.objid = hashtext(r.address || ' lane ' || lane)::oid
                  ) AS relayed
    FROM broker.transmission_queue t
    JOIN broker.routes r ON r.service_name = t.to_service
    CROSS JOIN LATERAL (SELECT CASE WHEN t.attempts = 0 THEN least(t.next_attempt_at, now())
                                    ELSE t.enqueued_at END AS due_since) w
    WHERE NOT EXISTS (SELECT 1 FROM broker.services s WHERE s.name = t.to_service)
    GROUP BY r.address ORDER BY r.address
""")


def transmission_queue(connection: Connection, limit: int, offset: int) -> list[Row]:
    """Waiting messages, oldest first, from broker.transmission_queue_status."""
    return connection.execute(TRANSMISSION_QUEUE, {"limit": limit, "offset": offset}).all()


def transmission_by_destination(connection: Connection) -> list[Row]:
    return connection.execute(TRANSMISSION_BY_DESTINATION).all()


def unrouted_services(connection: Connection) -> list[Row]:
    """Remote services that messages wait for and no route names."""
    return connection.execute(UNROUTED_SERVICES).all()


def failing_destinations(connection: Connection) -> list[Row]:
    """Destinations with messages that were tried and not acknowledged, and the last failure's words."""
    return connection.execute(FAILING_DESTINATIONS).all()


def waiting_to_transmit(connection: Connection) -> int:
    return connection.execute(WAITING_TO_TRANSMIT).scalar_one()


def try_lane_lock(connection: Connection, address: str, lane: int) -> bool:
    return connection.execute(TRY_LANE_LOCK, {"address": address, "lane": lane}).scalar_one()


def routed_backlogs(connection: Connection, max_wait_s: float, lanes: int) -> list[Row]:
    """Per destination node with messages waiting: see ROUTED_BACKLOGS."""
    return connection.execute(ROUTED_BACKLOGS, {"max_wait_s": max_wait_s, "lanes": lanes}).all()


# --- What `broker status` shows besides queues and the transmission queue -------------------------

CONVERSATION_COUNTS = text(
    "SELECT service_name, state, endpoints, oldest_created_at, without_lifetime"
    " FROM broker.endpoint_counts ORDER BY service_name, state")
# Each ingest's checkpoint and how far it is behind its queue (broker.ingest_lag).
INGESTS = text(
    "SELECT i.queue_name, i.output, i.queue_position, i.last_run, i.rows_ingested, i.runs, i.updated_at,"
    " l.lag_messages, l.lag_s"
    " FROM broker.ingests i JOIN broker.ingest_lag() l USING (queue_name, output) ORDER BY queue_name, output")
LATEST_DEAD_LETTERS = text(
    "SELECT queue_name, conversation_id, conversation_handle, message_sequence_number, message_type, reason, dead_lettered_at"
    " FROM broker.dead_letters ORDER BY dead_letter_id DESC LIMIT :limit")


def conversation_counts(connection: Connection) -> list[Row]:
    """Conversation endpoints by service and state."""
    return connection.execute(CONVERSATION_COUNTS).all()


def ingests(connection: Connection) -> list[Row]:
    """Each ingest's checkpoint, and its lag: the messages above it and the age of the oldest of them."""
    return connection.execute(INGESTS).all()


# Up to :limit dead letters after the first :offset, as far as their bodies come to :max_bytes (the first one
# whatever its size); the bodies' lengths are read without reading the bodies.
DEAD_LETTERS = text("""
    SELECT dead_letter_id, conversation_handle, conversation_id, message_sequence_number, message_type, body,
           enqueued_at, dead_lettered_at, failed_attempts, reason, traceparent
    FROM (SELECT d.dead_letter_id, sum(coalesce(octet_length(d.body), 0)) OVER (ORDER BY d.dead_letter_id) AS bytes,
                 row_number() OVER (ORDER BY d.dead_letter_id) AS place
          FROM (SELECT dead_letter_id, body FROM broker.dead_letters WHERE queue_name = :queue
                ORDER BY dead_letter_id LIMIT :limit OFFSET :offset) d) listed
    JOIN broker.dead_letters USING (dead_letter_id)
    WHERE listed.place = 1 OR listed.bytes <= :max_bytes
    ORDER BY dead_letter_id
""")


def dead_letters(connection: Connection, queue: str, limit: int, offset: int, max_bytes: int) -> list[Row]:
    """A queue's dead letters, oldest first, with why each was dead-lettered: at most limit, and only as many as
    come to max_bytes of bodies, but always the first."""
    return connection.execute(DEAD_LETTERS, {"queue": queue, "limit": limit, "offset": offset,
                                             "max_bytes": max_bytes}).all()


def latest_dead_letters(connection: Connection, limit: int) -> list[Row]:
    return connection.execute(LATEST_DEAD_LETTERS, {"limit": limit}).all()


LOST_MESSAGES = text("""
    SELECT l.conversation_id, e.conversation_handle, coalesce(e.far_service, '') AS far_service,
           l.far_broker_instance, l.direction, l.first_number, l.last_number, l.outcome, l.found_at
    FROM broker.lost_messages l
    LEFT JOIN broker.endpoints e ON e.conversation_id = l.conversation_id AND e.is_initiator = l.is_initiator
    ORDER BY l.found_at DESC, l.conversation_id LIMIT :limit""")


def lost_messages(connection: Connection, limit: int) -> list[Row]:
    """What a database that went back to an earlier point lost, as this node found it, the latest first."""
    return connection.execute(LOST_MESSAGES, {"limit": limit}).all()


LAST_DEAD_LETTER = text("SELECT coalesce(max(dead_letter_id), 0) FROM broker.dead_letters")
TRACED_DEAD_LETTERS_AFTER = text("""
    SELECT dead_letter_id, queue_name, conversation_handle, message_sequence_number, reason, dead_lettered_at,
           traceparent
    FROM broker.dead_letters WHERE dead_letter_id > :after AND traceparent IS NOT NULL
    ORDER BY dead_letter_id LIMIT 1000
""")


def last_dead_letter(connection: Connection) -> int:
    return connection.execute(LAST_DEAD_LETTER).scalar_one()


def traced_dead_letters_after(connection: Connection, dead_letter_id: int) -> list[Row]:
    """The next dead letters after dead_letter_id that carry a traceparent, oldest first."""
    return connection.execute(TRACED_DEAD_LETTERS_AFTER, {"after": dead_letter_id}).all()


# --- API keys -------------------------------------------------------------------------------------

INSERT_API_KEY = text("INSERT INTO broker.api_keys (key_id, name, secret_sha256, scopes)"
                      " VALUES (:key_id, :name, :secret_sha256, :scopes)")
LIVE_API_KEY = text("SELECT name, secret_sha256, scopes FROM broker.api_keys"
                    " WHERE key_id = :key_id AND revoked_at IS NULL")
API_KEYS = text("SELECT key_id, name, scopes, created_at, revoked_at FROM broker.api_keys ORDER BY created_at")
REVOKE_API_KEY = text("UPDATE broker.api_keys SET revoked_at = now() WHERE key_id = :key_id AND revoked_at IS NULL")


def insert_api_key(connection: Connection, key_id: str, name: str, secret_sha256: bytes, scopes: list[str]) -> None:
    connection.execute(INSERT_API_KEY, {"key_id": key_id, "name": name, "secret_sha256": secret_sha256,
                                        "scopes": scopes})


def live_api_key(connection: Connection, key_id: str) -> Row | None:
    """The key's name, secret hash and scopes, unless it is revoked or unknown."""
    return connection.execute(LIVE_API_KEY, {"key_id": key_id}).first()


def api_keys(connection: Connection) -> list[Row]:
    return connection.execute(API_KEYS).all()


def revoke_api_key(connection: Connection, key_id: str) -> bool:
    """Whether a live key was revoked."""
    return connection.execute(REVOKE_API_KEY, {"key_id": key_id}).rowcount == 1


def as_dicts(rows: list[Row]) -> list[dict[str, Any]]:
    return [row._asdict() for row in rows]


# --- The SQL API, one statement per function of broker.core ---------------------------------------

CREATE_MESSAGE_TYPE = text("SELECT broker.create_message_type(:name, :validation)")
DROP_MESSAGE_TYPE = text("SELECT broker.drop_message_type(:name)")
CREATE_CONTRACT = text("SELECT broker.create_contract(:name, CAST(:types AS jsonb))")
DROP_CONTRACT = text("SELECT broker.drop_contract(:name)")
CREATE_QUEUE = text("SELECT broker.create_queue(:name, :enabled, :retention, :threshold)")
ALTER_QUEUE = text("SELECT broker.alter_queue(:name, :enabled, :retention, :threshold)")
DROP_QUEUE = text("SELECT broker.drop_queue(:name)")
SET_QUEUE_ACTIVATION = text(
    "SELECT broker.set_queue_activation(:queue, :procedure_name, :max_queue_readers, :status, :execute_as)")
DROP_QUEUE_ACTIVATION = text("SELECT broker.drop_queue_activation(:queue)")
CREATE_SERVICE = text("SELECT broker.create_service(:name, :queue, CAST(:contracts AS text[]))")
ALTER_SERVICE = text("SELECT broker.alter_service(:name, CAST(:contracts AS text[]))")
DROP_SERVICE = text("SELECT broker.drop_service(:name)")
CREATE_ROUTE = text("SELECT broker.create_route(:service, :address, :instance, :secret)")
DROP_ROUTE = text("SELECT broker.drop_route(:service)")
ADD_PEER_SECRET = text("SELECT broker.add_peer_secret(:instance, :secret)")
SWITCH_PEER_SECRET = text("SELECT broker.switch_peer_secret(:instance)")
RETIRE_PEER_SECRET = text("SELECT broker.retire_peer_secret(:instance)")
CREATE_BROKER_PRIORITY = text("SELECT broker.create_broker_priority(:name, :priority, :contract, :local, :remote)")
DROP_BROKER_PRIORITY = text("SELECT broker.drop_broker_priority(:name)")
BEGIN_DIALOG = text("SELECT broker.begin_dialog(:from_service, :to_service, :contract, :lifetime, :group, :related)")
SEND = text("SELECT broker.send(:handle, :message_type, :body, :after, :at)")
SEND_TRACED = text(
    "WITH traced AS MATERIALIZED (SELECT set_config('broker.traceparent', :traceparent, true))"
    " SELECT broker.send(:handle, :message_type, :body, :after, :at)"
    " FROM traced")
SEND_BATCH = text("SELECT broker.send_batch(CAST(:handles AS uuid[]), :message_type, CAST(:bodies AS bytea[]))")
SEND_BATCH_TRACED = text(
    "WITH traced AS MATERIALIZED (SELECT set_config('broker.traceparent', :traceparent, true))"
    " SELECT broker.send_batch(CAST(:handles AS uuid[]), :message_type, CAST(:bodies AS bytea[]))"
    " FROM traced")
SEND_NUMBERED = text("SELECT broker.send_numbered(:handle, :number, :message_type, :body, :after, :at)")
SEND_NUMBERED_TRACED = text(
    "WITH traced AS MATERIALIZED (SELECT set_config('broker.traceparent', :traceparent, true))"
    " SELECT broker.send_numbered(:handle, :number, :message_type, :body, :after, :at)"
    " FROM traced")
SEND_NUMBERED_BATCH = text(
    "SELECT broker.send_numbered_batch(CAST(:handles AS uuid[]), CAST(:numbers AS bigint[]),"
    " CAST(:message_types AS text[]), CAST(:bodies AS bytea[]))")
SEND_NUMBERED_BATCH_TRACED = text(
    "WITH traced AS MATERIALIZED (SELECT set_config('broker.traceparent', :traceparent, true))"
    " SELECT broker.send_numbered_batch(CAST(:handles AS uuid[]), CAST(:numbers AS bigint[]),"
    " CAST(:message_types AS text[]), CAST(:bodies AS bytea[]))"
    " FROM traced")
RECEIVE = text("SELECT * FROM broker.receive(:queue, :max_messages, :group, :wait_ms, :handle)")
RECEIVE_WITH_LOCK = text(
    "SELECT * FROM broker.receive_with_lock(:queue, :max_messages, :lock_duration, :max_bytes, :handle)")
COMPLETE_LOCK = text("SELECT broker.complete_lock(:token)")
RENEW_LOCK = text("SELECT broker.renew_lock(:token, :lock_duration)")
ABANDON_LOCK = text("SELECT broker.abandon_lock(:token)")
GET_CONVERSATION_GROUP = text("SELECT broker.get_conversation_group(:queue, :wait_ms)")
END_CONVERSATION = text("SELECT broker.end_conversation(:handle, :code, :description, :cleanup)")
MOVE_CONVERSATION = text("SELECT broker.move_conversation(:handle, :group)")
GET_CONVERSATION_GROUP_STATE = text("SELECT broker.get_conversation_group_state(:group, :token)")
SET_CONVERSATION_GROUP_STATE = text(
    "SELECT broker.set_conversation_group_state(:group, CAST(:state AS jsonb), :token)")
DEAD_LETTER_CONVERSATION = text("SELECT broker.dead_letter_conversation(:handle, :reason, :token)")
RESUBMIT_DEAD_LETTERS = text("SELECT broker.resubmit_dead_letters(:queue, :handle)")
PURGE_DEAD_LETTERS = text("SELECT broker.purge_dead_letters(:queue, :older_than)")
PURGE_QUEUE = text("SELECT broker.purge_queue(:queue)")
BEGIN_CONVERSATION_TIMER = text("SELECT broker.begin_conversation_timer(:handle, :timeout)")
REPORT_PROCESSING_FAILURE = text("SELECT broker.report_processing_failure(:queue, :group, :reason)")
# A traced send sets broker.traceparent for its transaction; this clears it after the send.
END_THE_TRACE = text("SELECT set_config('broker.traceparent', '', true)")


# --- The relay (broker.relay) ---------------------------------------------------------------------

# A lane's next batch for a destination, by the wire version it is sent in (broker.transport.wire): version 3
# has no message ids.
NEXT_BATCH = {
    4: "COPY (SELECT * FROM broker.next_batch(%(address)s, %(max_messages)s, %(max_bytes)s,"
       " %(first)s, %(last)s)) TO STDOUT (FORMAT binary)",
    3: "COPY (SELECT conversation_id, sender_is_initiator, from_service, to_service, contract, expires_at,"
       " sequence_number, message_type, body, traceparent"
       " FROM broker.next_batch(%(address)s, %(max_messages)s, %(max_bytes)s, %(first)s, %(last)s))"
       " TO STDOUT (FORMAT binary)"}
# The far node's answer, held to the highest number the batch carried of each conversation side (in step).
APPLY_ANSWER = text("SELECT broker.apply_transport_results(CAST(:answer AS jsonb), CAST(:conversations AS uuid[]),"
                    " :by_initiator, :last_sent)")
RECORD_FAILURE = text("SELECT broker.record_transport_failure(:address, :first, :last, :reason, :retry_after)")
FORGET_CLOSED_ENDPOINTS = text("SELECT broker.forget_closed_endpoints()")
FORGET_ACKNOWLEDGED_MESSAGES = text("SELECT broker.forget_acknowledged_messages()")
WITHHOLD_WHAT_PEERS_FORGOT = text("SELECT broker.withhold_what_peers_forgot()")
# Queue positions after every earlier one in a database restored into a cluster behind it in transaction ids.
CONTINUE_QUEUE_POSITIONS = text("SELECT broker.continue_queue_positions()")
# Whether the far node still holds the last number it acknowledged of a conversation side: it goes again.
PROBE_CONVERSATION = text("SELECT broker.probe_conversation(CAST(:conversation AS uuid), :by_initiator)")


# --- A transport batch accepted (broker.transport.receiving) --------------------------------------

# The batch's rows live for one transaction in a temporary table of the session, incoming_batch.
STAGE_BATCH = text("SELECT broker.stage_batch()")
# A batch of each wire version: version 3 has no message ids, which stay NULL.
COPY_BATCH = {
    4: "COPY pg_temp.incoming_batch FROM STDIN (FORMAT binary)",
    3: "COPY pg_temp.incoming_batch (conversation_id, sender_is_initiator, from_service, to_service, contract,"
       " expires_at, sequence_number, message_type, body, traceparent) FROM STDIN (FORMAT binary)"}
ACCEPT_BATCH = text("SELECT broker.accept_batch(:instance)::text")


# --- The node's timers (broker.timers) ------------------------------------------------------------

FIRE_DUE_EVENTS = text("SELECT broker.fire_due_events()")
COUNT_UNREPORTED_ROLLBACKS = text("SELECT broker.count_unreported_rollbacks()")
LISTEN_FOR_TRANSMISSIONS = "LISTEN broker_transmission_queue"


# --- Internal activation (broker.activator) -------------------------------------------------------

ACTIVATED_QUEUES = text(
    "SELECT queue_id, queue_name, max_queue_readers, messages_waiting FROM broker.activated_queues()")
TAKE_ACTIVATION_SLOT = text("SELECT broker.take_activation_slot(:queue)")
# One call of the procedure, in a session as the node opened it: whatever the previous call set for the session
# (its role, its settings: SET without LOCAL) is reset first.
ACTIVATE = text("RESET ROLE; RESET ALL; SELECT broker.call_activated_procedure(:queue, :slot)")
# What a node's readers did since it last said, added to the queue's totals.
RECORD_ACTIVATIONS = text("""
    UPDATE broker.queue_activation a
    SET activations = a.activations + :activations, failures = a.failures + :failures,
        last_failure = coalesce(:last_failure, a.last_failure),
        last_failure_at = CASE WHEN :last_failure IS NULL THEN a.last_failure_at ELSE now() END
    FROM broker.queues q
    WHERE q.queue_id = a.queue_id AND q.name = :queue
""")
ACTIVATION_STATUS = text(
    "SELECT queue_name, procedure_name, status, max_queue_readers, execute_as, readers, activations, failures,"
    " last_failure, last_failure_at FROM broker.activation_status ORDER BY queue_name")


def activation_statuses(connection: Connection) -> list[Row]:
    """broker.activation_status: each queue's activation, its readers now and what its calls did."""
    return connection.execute(ACTIVATION_STATUS).all()


# --- The REST API (api) ---------------------------------------------------------------------------

# A statement that waits this long for a lock gives up (503, nothing applied): a transaction that holds rows
# for long must not hold the API's connections as long.
LIMIT_LOCK_WAITS = "SET lock_timeout = '5s'"
# Readers that wait for a queue wake on broker._enqueue's notification.
LISTEN_FOR_ARRIVALS = "LISTEN broker_queue"


# --- The Spark ingest (spark_ingest) --------------------------------------------------------------

TRY_LOCK_INGEST = text("SELECT broker.try_lock_ingest(:queue, :output)")
HOLDS_INGEST_LOCK = text("SELECT broker.holds_ingest_lock(:queue, :output)")
START_INGEST = text("SELECT * FROM broker.start_ingest(:queue, :output)")
INGEST_PARTITIONS = text("SELECT * FROM broker.ingest_partitions(:queue, :after, :up_to, :count)")
ADVANCE_INGEST_CHECKPOINT = text(
    "SELECT broker.advance_ingest_checkpoint(:queue, :output, :after, :up_to, :run, :rows, :consume)")
INGEST_LAG = text("SELECT lag_messages, lag_s FROM broker.ingest_lag() WHERE queue_name = :queue AND output = :output")
# The session waits while Spark writes: the server's idle_session_timeout must not end it (PostgreSQL 14+).
NO_IDLE_SESSION_TIMEOUT = text(
    "SELECT set_config(name, '0', false) FROM pg_settings WHERE name = 'idle_session_timeout'")


# --- The schema's own records (broker.schema, broker.migrate) -------------------------------------

# Two processes that build or upgrade one database at once do it one after the other.
LOCK_SCHEMA_CHANGES = text("SELECT pg_advisory_xact_lock(hashtext('broker schema build'))")
SCHEMA_EXISTS = text("SELECT to_regnamespace('broker') IS NOT NULL"
                     " OR to_regclass('public.broker_alembic_version') IS NOT NULL")
VERSION_TABLE_EXISTS = text("SELECT to_regclass('public.broker_alembic_version') IS NOT NULL")
# broker/sql/ creates the version table as Alembic does (it grants on it); the row is Alembic's stamp.
STAMP = text("INSERT INTO public.broker_alembic_version (version_num) VALUES (:revision)")
FUNCTION_FILES_APPLIED = text("SELECT file_name, sha256 FROM broker.function_files")
RECORD_FUNCTION_FILE = text(
    "INSERT INTO broker.function_files (file_name, sha256) VALUES (:file_name, :sha256)"
    " ON CONFLICT (file_name) DO UPDATE SET sha256 = excluded.sha256")
