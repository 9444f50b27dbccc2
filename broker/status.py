"""What a node is doing, read from its catalog: the data behind `broker status` and the console."""
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, text

QUEUES = text(
    "SELECT queue_name, status, depth, extract(epoch FROM oldest_message_age)::float8 AS oldest_message_age_s, readers,"
    " dead_letters, retention, poison_threshold"
    " FROM broker.queue_status ORDER BY queue_name")
CONVERSATIONS = text(
    "SELECT service_name, state, endpoints, oldest_created_at, without_lifetime"
    " FROM broker.endpoint_counts ORDER BY service_name, state")
# One row per destination node: how much waits for it, since when, and why (the
# status of the message that has waited longest).
TRANSMISSION = text(
    "SELECT coalesce(r.address, '(no route)') AS destination, count(*) AS messages,"
    " count(DISTINCT t.conversation_handle) AS conversations,"
    " extract(epoch FROM now() - min(t.enqueued_at))::float8 AS oldest_message_age_s, max(t.attempts) AS attempts,"
    " min(t.next_attempt_at) AS next_attempt_at,"
    " (array_agg(t.transmission_status ORDER BY t.enqueued_at))[1] AS status"
    " FROM broker.transmission_queue t LEFT JOIN broker.routes r ON r.service_name = t.to_service"
    " GROUP BY r.address ORDER BY destination")
INGESTS = text(
    "SELECT queue_name, output, queue_position, last_run, rows_ingested, runs, updated_at"
    " FROM broker.ingests ORDER BY queue_name, output")
DEAD_LETTERS = text(
    "SELECT queue_name, conversation_id, message_sequence_number, message_type, reason, dead_lettered_at"
    " FROM broker.dead_letters ORDER BY dead_letter_id DESC LIMIT :limit")


def _rows(connection: Connection, query, **params: Any) -> list[dict[str, Any]]:
    return [dict(row._mapping) for row in connection.execute(query, params)]


def node_status(connection: Connection, dead_letters: int = 20) -> dict[str, list[dict[str, Any]]]:
    """Queues, conversations by service and state, the transmission queue by destination,
    ingests, and the latest dead letters."""
    return {
        "queues": _rows(connection, QUEUES),
        "conversations": _rows(connection, CONVERSATIONS),
        "transmission_queue": _rows(connection, TRANSMISSION),
        "ingests": _rows(connection, INGESTS),
        "dead_letters": _rows(connection, DEAD_LETTERS, limit=dead_letters),
    }


def json_default(value: Any) -> Any:
    """For json.dumps: datetimes as ISO 8601, UUIDs as strings (ages are float8 already)."""
    return value.isoformat() if isinstance(value, datetime) else str(value)


def age(seconds: float | None) -> str:
    """A duration in words a person reads at a glance: 0.4 s, 12 s, 5 min, 3.5 h, 2 d."""
    if seconds is None:
        return ""
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= 2 * size:
            return f"{seconds / size:.1f} {unit}".replace(".0 ", " ")
    return f"{seconds:.1f} s" if seconds < 10 else f"{seconds:.0f} s"
