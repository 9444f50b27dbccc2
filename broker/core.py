"""The SQL-level API from Python: one function per SQL function.

Each function takes the caller's SQLAlchemy Connection or Session and runs in
the caller's transaction, so an application can receive, do its own work and
send in one transaction; nothing here commits.
"""
from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any
from uuid import UUID

from sqlalchemy import Result

from broker import queries, tracing
from broker.errors import translated_errors
from broker.queries import Executor


def _call(executor: Executor, function: str, /, *, casts: dict[str, str] | None = None, **arguments: Any) -> Result:
    with translated_errors():
        return queries.call(executor, function, casts=casts, **arguments)


def _send(executor: Executor, function: str, traceparent: str | None, attributes: dict[str, Any], /, *,
          casts: dict[str, str] | None = None, **arguments: Any) -> Any:
    """Calls a send function; its messages carry the trace of broker.tracing.sending (queries.call sets it for
    the call).  A send outside any trace costs nothing more."""
    if traceparent is None and not tracing.enabled():
        return _call(executor, function, casts=casts, **arguments).scalar_one()
    with tracing.sending(traceparent, attributes) as handed_on, translated_errors():
        return queries.call(executor, function, casts=casts, traceparent=handed_on, **arguments).scalar_one()


def _received(queue: str, started_ns: int, messages: list) -> list:
    tracing.received(queue, messages, started_ns)
    return messages


def _as_bytes(body: bytes | str | None) -> bytes | None:
    return body.encode() if isinstance(body, str) else body


def _bytes_or_none(body: memoryview | bytes | None) -> bytes | None:
    return None if body is None else bytes(body)


@dataclass(frozen=True, slots=True)
class ReceivedMessage:
    queue_position: int
    conversation_group_id: UUID
    conversation_handle: UUID
    conversation_id: UUID
    message_sequence_number: int
    service_name: str
    contract_name: str
    message_type: str
    body: bytes | None
    enqueued_at: datetime
    # The W3C traceparent it carries (broker.tracing): continue its trace from it.
    traceparent: str | None

    def json(self) -> Any:
        return None if self.body is None else json.loads(self.body)


@dataclass(frozen=True, slots=True)
class LockedMessage(ReceivedMessage):
    """A message handed out under a lease (peek-lock): consumed only by complete_lock."""

    lock_token: UUID
    lock_expires_at: datetime
    delivery_count: int


# Catalog


def create_message_type(executor: Executor, name: str, validation: str = "none") -> None:
    _call(executor, "create_message_type", name=name, validation=validation)


def drop_message_type(executor: Executor, name: str) -> None:
    _call(executor, "drop_message_type", name=name)


def create_contract(executor: Executor, name: str, message_types: dict[str, str]) -> None:
    """message_types maps each message type to who sends it: "initiator", "target" or "any"."""
    _call(executor, "create_contract", casts={"message_types": "jsonb"},
          name=name, message_types=json.dumps(message_types))


def drop_contract(executor: Executor, name: str) -> None:
    _call(executor, "drop_contract", name=name)


def create_queue(executor: Executor, name: str, *, enabled: bool = True, retention: bool = False,
                 poison_threshold: int = 5) -> None:
    _call(executor, "create_queue", name=name, status=enabled, retention=retention, poison_threshold=poison_threshold)


def alter_queue(executor: Executor, name: str, *, enabled: bool | None = None, retention: bool | None = None,
                poison_threshold: int | None = None) -> None:
    """Changes the settings given; None leaves a setting as it is."""
    _call(executor, "alter_queue", name=name, status=enabled, retention=retention, poison_threshold=poison_threshold)


def drop_queue(executor: Executor, name: str) -> None:
    _call(executor, "drop_queue", name=name)


def set_queue_activation(executor: Executor, queue: str, procedure_name: str | None = None, *,
                         max_queue_readers: int | None = None, enabled: bool | None = None,
                         execute_as: str | None = None) -> None:
    """Declares the procedure the running nodes call while the queue has messages (broker.set_queue_activation);
    None leaves a setting as it is."""
    _call(executor, "set_queue_activation", queue=queue, procedure_name=procedure_name,
          max_queue_readers=max_queue_readers, status=enabled, execute_as=execute_as)


def drop_queue_activation(executor: Executor, queue: str) -> None:
    _call(executor, "drop_queue_activation", queue=queue)


def create_service(executor: Executor, name: str, queue: str, contracts: list[str] | tuple[str, ...] = ()) -> None:
    _call(executor, "create_service", casts={"contracts": "text[]"},
          name=name, queue=queue, contracts=list(contracts))


def alter_service(executor: Executor, name: str, contracts: list[str] | tuple[str, ...]) -> None:
    """Sets the contracts the service accepts as a target; conversations already begun keep theirs."""
    _call(executor, "alter_service", casts={"contracts": "text[]"}, name=name, contracts=list(contracts))


def drop_service(executor: Executor, name: str) -> None:
    _call(executor, "drop_service", name=name)


def create_route(executor: Executor, service_name: str, address: str, broker_instance: UUID, secret: str) -> None:
    """Where a remote service lives: its node's base URL and instance id, and the secret shared with that node."""
    _call(executor, "create_route", service_name=service_name, address=address, broker_instance=broker_instance,
          secret=secret)


def drop_route(executor: Executor, service_name: str) -> None:
    _call(executor, "drop_route", service_name=service_name)


def add_peer_secret(executor: Executor, broker_instance: UUID, secret: str) -> None:
    """Rotating the secret shared with a peer node, step 1 (on both nodes): the new secret is taken from it too."""
    _call(executor, "add_peer_secret", broker_instance=broker_instance, secret=secret)


def switch_peer_secret(executor: Executor, broker_instance: UUID) -> None:
    """Step 2 (on both nodes, once both hold the new secret): the routes to the peer sign with the new secret."""
    _call(executor, "switch_peer_secret", broker_instance=broker_instance)


def retire_peer_secret(executor: Executor, broker_instance: UUID) -> int:
    """Step 3 (on both nodes, once `broker diagnose` shows the peer signs with the new secret): the old secret
    is no longer taken.  Returns how many secrets were retired."""
    return _call(executor, "retire_peer_secret", broker_instance=broker_instance).scalar_one()


def create_broker_priority(executor: Executor, name: str, priority: int, *, contract: str | None = None,
                           local_service: str | None = None, remote_service: str | None = None) -> None:
    """Service Broker's CREATE BROKER PRIORITY: conversation sides created from now on for this contract, local
    and remote service (None: any) get this priority, 1 to 10 (default 5); the most specific match wins."""
    _call(executor, "create_broker_priority", name=name, priority=priority, contract=contract,
          local_service=local_service, remote_service=remote_service)


def drop_broker_priority(executor: Executor, name: str) -> None:
    _call(executor, "drop_broker_priority", name=name)


# Conversations


def begin_dialog(executor: Executor, from_service: str, to_service: str, contract: str, *,
                 lifetime: timedelta | None = None, related_conversation_group: UUID | None = None,
                 related_conversation: UUID | None = None) -> UUID:
    """Begins a conversation and returns the initiator's conversation handle. It joins the group given, or
    that of the local conversation side related_conversation."""
    return _call(executor, "begin_dialog", from_service=from_service, to_service=to_service, contract=contract,
                 lifetime=lifetime, related_conversation_group=related_conversation_group,
                 related_conversation=related_conversation).scalar_one()


def send(executor: Executor, conversation_handle: UUID, message_type: str, body: bytes | str | None = None, *,
         deliver_after: timedelta | None = None, deliver_at: datetime | None = None,
         traceparent: str | None = None) -> int:
    """Sends a message (str bodies are UTF-8 encoded); returns its sequence number. Given deliver_after (from
    now, by the database's clock) or deliver_at, it is held until then, and the later messages of its
    conversation behind it.  The message belongs to the trace of traceparent, or else of the current
    OpenTelemetry span (see broker.tracing); every send function takes it."""
    return _send(executor, "send", traceparent,
                 {"pg_broker.conversation_handle": str(conversation_handle), "pg_broker.message_type": message_type},
                 conversation_handle=conversation_handle, message_type=message_type, body=_as_bytes(body),
                 deliver_after=deliver_after, deliver_at=deliver_at)


def send_batch(executor: Executor, conversation_handles: Sequence[UUID], message_type: str,
               bodies: Sequence[bytes | str | None] | None = None, *, traceparent: str | None = None) -> list[int]:
    """Sends bodies[i] on conversation_handles[i], all of one message type, in one statement; returns the
    sequence numbers in the order given.  A handle may repeat: its messages are numbered in that order.
    All or nothing, with the checks and errors of send."""
    return _send(executor, "send_batch", traceparent,
                 {"messaging.batch.message_count": len(conversation_handles), "pg_broker.message_type": message_type},
                 casts={"conversation_handles": "uuid[]", "bodies": "bytea[]"},
                 conversation_handles=[str(handle) for handle in conversation_handles], message_type=message_type,
                 bodies=None if bodies is None else [_as_bytes(body) for body in bodies])


def send_numbered(executor: Executor, conversation_handle: UUID, sequence_number: int, message_type: str,
                  body: bytes | str | None = None, *, deliver_after: timedelta | None = None,
                  deliver_at: datetime | None = None, traceparent: str | None = None) -> bool:
    """Sends message number sequence_number, held as send holds it; False when that very message was sent
    already (whatever delivery time either gave).

    Raises SequenceConflict when the number is out of turn or was used for another content.
    """
    return _send(executor, "send_numbered", traceparent,
                 {"pg_broker.conversation_handle": str(conversation_handle), "pg_broker.message_type": message_type},
                 conversation_handle=conversation_handle, sequence_number=sequence_number, message_type=message_type,
                 body=_as_bytes(body), deliver_after=deliver_after, deliver_at=deliver_at)


def send_numbered_batch(executor: Executor, messages: Sequence[tuple[UUID, int, str, bytes | str | None]], *,
                        traceparent: str | None = None) -> list[bool]:
    """send_numbered for each (conversation_handle, sequence_number, message_type, body), in the order given, all
    or none, in one statement: whether each was sent now (False: that very message was sent already).

    Raises SequenceConflict for the first message out of turn or sent before with another content."""
    return _send(executor, "send_numbered_batch", traceparent, {"messaging.batch.message_count": len(messages)},
                 casts={"conversation_handles": "uuid[]", "sequence_numbers": "bigint[]", "message_types": "text[]",
                        "bodies": "bytea[]"},
                 conversation_handles=[str(handle) for handle, _, _, _ in messages],
                 sequence_numbers=[number for _, number, _, _ in messages],
                 message_types=[message_type for _, _, message_type, _ in messages],
                 bodies=[_as_bytes(body) for _, _, _, body in messages])


def receive(executor: Executor, queue: str, max_messages: int | None = 1, *, conversation_group: UUID | None = None,
            wait_ms: int = 0, conversation_handle: UUID | None = None) -> list[ReceivedMessage]:
    """Locks one conversation group (the one given, or that of the conversation given) and returns up to
    max_messages of its messages in order (None: all of them; only the given conversation's, when one is
    given). wait_ms -1 waits until a message comes.

    The messages are consumed when the caller commits and come back on rollback.
    """
    started_ns = time.time_ns()
    with translated_errors():
        rows = queries.select_from(executor, "receive", queue=queue, max_messages=max_messages,
                                   conversation_group=conversation_group, wait_ms=wait_ms,
                                   conversation_handle=conversation_handle)
    return _received(queue, started_ns,
                     [ReceivedMessage(**{**row._mapping, "body": _bytes_or_none(row.body)}) for row in rows])


def receive_with_lock(executor: Executor, queue: str, max_messages: int, lock_duration: timedelta,
                      max_bytes: int | None = None, conversation_handle: UUID | None = None) -> list[LockedMessage]:
    """Leases one conversation group for lock_duration and returns its next messages (peek-lock): at most
    max_messages and, when given, max_bytes of bodies (but always the first message, however large); only
    those of conversation_handle, and its group, when one is given.

    They stay in the queue until complete_lock; abandon_lock or expiry hands them out again.
    """
    started_ns = time.time_ns()
    with translated_errors():
        rows = queries.select_from(executor, "receive_with_lock", queue=queue, max_messages=max_messages,
                                   lock_duration=lock_duration, max_bytes=max_bytes,
                                   conversation_handle=conversation_handle)
    return _received(queue, started_ns,
                     [LockedMessage(**{**row._mapping, "body": _bytes_or_none(row.body)}) for row in rows])


def complete_lock(executor: Executor, lock_token: UUID) -> int:
    """Consumes a live lease's messages; returns how many. Raises LockLost when it is not live."""
    return _call(executor, "complete_lock", lock_token=lock_token).scalar_one()


def renew_lock(executor: Executor, lock_token: UUID, lock_duration: timedelta) -> datetime:
    """Extends a live lease to lock_duration from now; returns its new expiry. Raises LockLost, with why, when
    it is not live."""
    return _call(executor, "renew_lock", lock_token=lock_token, lock_duration=lock_duration).scalar_one()


def abandon_lock(executor: Executor, lock_token: UUID) -> bool:
    """Hands a lease's messages back now; returns True when the failure quarantined the conversation."""
    return _call(executor, "abandon_lock", lock_token=lock_token).scalar_one()


def get_conversation_group(executor: Executor, queue: str, wait_ms: int = 0) -> UUID | None:
    """Locks the next conversation group with messages until the transaction ends (wait_ms -1: waits until
    there is one) and returns it, or None."""
    return _call(executor, "get_conversation_group", queue=queue, wait_ms=wait_ms).scalar_one()


def end_conversation(executor: Executor, conversation_handle: UUID, *, error_code: int | None = None,
                     error_description: str | None = None, cleanup: bool = False) -> None:
    _call(executor, "end_conversation", conversation_handle=conversation_handle, error_code=error_code,
          error_description=error_description, cleanup=cleanup)


def move_conversation(executor: Executor, conversation_handle: UUID, conversation_group: UUID) -> None:
    """Moves one side of a conversation, and its waiting messages, to another group of its queue (made when it
    does not exist). Raises InUse while a live lease holds either group."""
    _call(executor, "move_conversation", conversation_handle=conversation_handle,
          conversation_group=conversation_group)


def get_conversation_group_state(executor: Executor, conversation_group: UUID,
                                 lock_token: UUID | None = None) -> Any:
    """The state kept for a conversation group that the caller holds (by its transaction, or by lock_token), as
    JSON values, or None. Holds the group until the transaction ends; raises InUse when another reader holds it."""
    return _call(executor, "get_conversation_group_state", conversation_group=conversation_group,
                 lock_token=lock_token).scalar_one()


def set_conversation_group_state(executor: Executor, conversation_group: UUID, state: Any,
                                 lock_token: UUID | None = None) -> None:
    """Keeps state (any JSON value; None forgets it) for a conversation group that the caller holds."""
    _call(executor, "set_conversation_group_state", casts={"state": "jsonb"},
          conversation_group=conversation_group, state=None if state is None else json.dumps(state),
          lock_token=lock_token)


def dead_letter_conversation(executor: Executor, conversation_handle: UUID, reason: str,
                             lock_token: UUID | None = None) -> int:
    """Dead-letters a conversation whose next message the caller cannot process: what waits of it moves to
    broker.dead_letters (the first message with the reason) and it ends with broker.error (-2). The caller
    holds its group: by its transaction (after rolling back its receive), or by its lease's lock_token."""
    return _call(executor, "dead_letter_conversation", conversation_handle=conversation_handle, reason=reason,
                 lock_token=lock_token).scalar_one()


def resubmit_dead_letters(executor: Executor, queue: str, conversation_handle: UUID) -> int:
    """Puts a quarantined conversation's dead letters back into its queue, in order; returns how many."""
    return _call(executor, "resubmit_dead_letters", queue=queue, conversation_handle=conversation_handle).scalar_one()


def purge_dead_letters(executor: Executor, queue: str, older_than: timedelta | None = None) -> int:
    """Deletes a queue's dead letters (only those dead-lettered longer ago than older_than, when given)."""
    return _call(executor, "purge_dead_letters", queue=queue, older_than=older_than).scalar_one()


def purge_queue(executor: Executor, queue: str) -> int:
    """Deletes every message waiting in a queue and ends its leases; returns how many messages it deleted."""
    return _call(executor, "purge_queue", queue=queue).scalar_one()


def begin_conversation_timer(executor: Executor, conversation_handle: UUID, timeout: timedelta) -> None:
    _call(executor, "begin_conversation_timer", conversation_handle=conversation_handle, timeout=timeout)


def report_processing_failure(executor: Executor, queue: str, conversation_group: UUID, reason: str) -> bool:
    """Counts a failed attempt at the group's head message; returns True when its conversation was quarantined."""
    return _call(executor, "report_processing_failure", queue=queue, conversation_group=conversation_group,
                 reason=reason).scalar_one()
