"""What a key may see of conversation sides and locks: one of a service or queue outside the key's scopes is
answered exactly as one that does not exist (404 unknown-object, 409 lock-lost "unknown"), so that a key learns
nothing of the handles and locks of others.  Once a key may see one, a scope it lacks for what it asks is 403."""
from uuid import UUID

from sqlalchemy import Connection, Row

from broker.api.problems import Problem
from broker import queries
from broker.api_keys import ApiKey


def sees(key: ApiKey, endpoint: Row) -> bool:
    """Either scope shows a conversation side: sending on its service, or receiving from its queue."""
    return key.allows(f"send:{endpoint.service_name}") or key.allows(f"receive:{endpoint.queue_name}")


def unknown_conversation(handle: UUID) -> Problem:
    return Problem(404, "unknown-object", "No such object", f"unknown conversation {handle}")


def conversation(connection: Connection, key: ApiKey, handle: UUID) -> Row:
    """The conversation side (a row of broker.conversation_endpoints) when the key may see it; 404 otherwise."""
    endpoint = connection.execute(queries.QUERIES["endpoint"], {"handle": handle}).first()
    if endpoint is None or not sees(key, endpoint):
        raise unknown_conversation(handle)
    return endpoint


def lock_queue(connection: Connection, key: ApiKey, lock_token: UUID) -> str | None:
    """The queue of a lock, live or ended, when the key may receive from it; None for a lock not known (the broker's
    call then refuses it as lost).  A lock of another queue is refused as an unknown one."""
    queue = connection.execute(queries.QUERIES["queue_of_lock"], {"token": lock_token}).scalar()
    if queue is not None and not key.allows(f"receive:{queue}"):
        queries.refuse_lock_as_unknown(connection, lock_token)
    return queue
