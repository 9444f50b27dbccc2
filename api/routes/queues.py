"""/v1/queues and /v1/locks: receiving with peek-lock, and queue status.

A REST reader cannot hold a transaction open, so it holds a conversation
group by a lease: receive hands out the group's next messages under a
lock_token; renew holds it longer; complete consumes them; abandon, or
letting the lock expire, hands them out again with a higher delivery_count
and counts toward the queue's poison threshold.
"""
import asyncio
import base64
import codecs
import time
from datetime import datetime, timedelta
from typing import Any
from uuid import UUID

from fastapi import APIRouter, Depends, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

import broker
from broker.api import audit, bodies, visibility
from broker.api.auth import require
from broker.api.deps import AdminKey, Database, Key, NodeSettings
from broker.api.problems import KEYED, READS_BODY, Problem, error_responses
from broker.api.types import NamePath, Number, Text, integer, known_query_parameters
from broker import queries
from broker.metrics import API_ABANDONED, API_COMPLETED, API_RECEIVED

router = APIRouter(tags=["queues"], responses=error_responses(*KEYED), dependencies=[Depends(known_query_parameters)])

# A browse shows this much of each body, and says its whole size.
PREVIEW_BYTES = 1024
# A waiting reader looks again at least this often, for locks that expire and
# timers that fall due: neither sends a notification.
LOOK_AGAIN_S = 1.0


class ReceiveRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"max_messages": 10, "wait_ms": 20000, "lock_s": 60}]})

    max_messages: integer(ge=1, le=1000) = Field(10, description="at most this many messages of one conversation group")
    wait_ms: integer(ge=0, le=60000) = Field(0, description=(
        "long poll: wait up to this long for a message (the node may cap it lower)"))
    lock_s: Number = Field(30, ge=0.01, le=86400, description="how long the lock holds before the messages come back")
    max_bytes: integer(ge=1, le=2**53 - 1) = Field(4 * 1024 * 1024, description=(
        "at most this many bytes of bodies, as stored; the first message comes whatever its size"))
    conversation_handle: UUID | None = Field(None, description=(
        "only this conversation's messages (the receiving side's handle), its group locked"))


class Message(BaseModel):
    conversation_id: UUID
    conversation_handle: UUID = Field(description="the receiving side's handle: reply and end with it")
    conversation_group_id: UUID
    sequence_number: int = Field(description="1, 2, 3, … per conversation and direction; 0 for a local notice")
    message_type: str
    service_name: str
    contract_name: str
    body: Any = Field(None, description="the body when it is JSON")
    body_base64: str | None = Field(None, description="the body in base64 when it is not JSON")
    enqueued_at: datetime
    queue_position: int
    delivery_count: int = Field(description="how many times this message was handed out under a lock, this one "
                                            "included")
    traceparent: str | None = Field(None, description="the W3C traceparent it carries: continue its trace from it")


class Received(BaseModel):
    lock_token: UUID
    lock_expires_at: datetime
    messages: list[Message]


class Completed(BaseModel):
    completed: int = Field(description="messages consumed")


class RenewRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{"lock_s": 60}]})

    lock_s: Number = Field(30, ge=0.01, le=86400, description="the lock holds this long from now")


class Renewed(BaseModel):
    lock_token: UUID
    lock_expires_at: datetime


class GroupState(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{"state": {"step": "paid"}}]})

    state: Any = Field(None, description="any JSON value kept for the lock's conversation group; null when none "
                                         "(a PUT of null forgets it)")


class Abandoned(BaseModel):
    quarantined: bool = Field(description="true when this failure reached the poison threshold")


class Purged(BaseModel):
    purged: int = Field(description="messages (or dead letters) deleted")


class DeadLetterMessage(BaseModel):
    dead_letter_id: int
    conversation_handle: UUID
    conversation_id: UUID
    sequence_number: int
    message_type: str
    body: Any = Field(None, description="the body when it is JSON")
    body_base64: str | None = Field(None, description="the body in base64 when it is not JSON")
    enqueued_at: datetime
    dead_lettered_at: datetime
    failed_attempts: int
    reason: str = Field(description="why it was dead-lettered, in words")
    traceparent: str | None = Field(None, description="the W3C traceparent its message carried")


class DeadLetterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"conversation_handle": "3cad8df1-6a4f-4f7e-8a47-6f9b6a1f2e3d", "reason": "unknown sku"}]})

    conversation_handle: UUID = Field(description="the conversation of the lock's messages to dead-letter")
    reason: Text = Field(min_length=1, max_length=4000)


class DeadLettered(BaseModel):
    dead_lettered: int = Field(description="messages moved to the dead letters")


class Resubmit(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"conversation_handle": "3cad8df1-6a4f-4f7e-8a47-6f9b6a1f2e3d"}]})

    conversation_handle: UUID = Field(description="the quarantined conversation side, still in error")


class Resubmitted(BaseModel):
    resubmitted: int = Field(description="dead letters put back into the queue, in order")


class PurgeDeadLetters(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{}, {"older_than_s": 604800}]})

    older_than_s: Number | None = Field(None, ge=0, le=100 * 365 * 86400, description=(
        "only those dead-lettered longer ago than this"))


class BrowsedMessage(BaseModel):
    """A message waiting in a queue, as a browse shows it: its place, its conversation, and the head of its body."""

    queue_position: int
    conversation_handle: UUID = Field(description="the receiving side's handle")
    conversation_id: UUID
    conversation_group_id: UUID
    sequence_number: int = Field(description="0 for a local notice")
    message_type: str
    priority: int
    enqueued_at: datetime
    delivery_count: int = Field(description="how many times it was handed out under a lock")
    failed_attempts: int
    locked_until: datetime | None = Field(description="while a reader holds it under a lock: until when")
    body_bytes: int | None = Field(description="the whole body's size; null for a message without a body")
    body_preview: str | None = Field(description=f"the body's first {PREVIEW_BYTES:,} bytes as text, when they are "
                                                 "UTF-8 (a character cut at the end left out)")
    body_preview_base64: str | None = Field(description=f"the body's first {PREVIEW_BYTES:,} bytes in base64, when "
                                                        "they are not UTF-8 text")
    body_truncated: bool = Field(description=f"true when the body is longer than {PREVIEW_BYTES:,} bytes")


class QueueStatus(BaseModel):
    queue_name: str
    status: str = Field(examples=["enabled"])
    retention: bool
    poison_threshold: int
    depth: int
    oldest_message_age_s: float | None
    readers: int
    dead_letters: int


def _lease(engine, queue: str, options: ReceiveRequest) -> list[broker.LockedMessage]:
    with engine.begin() as connection:
        return broker.receive_with_lock(connection, queue, options.max_messages, timedelta(seconds=options.lock_s),
                                        options.max_bytes, options.conversation_handle)


def _queue_id(engine, queue: str) -> int:
    with engine.connect() as connection:
        return connection.execute(queries.QUERIES["queue_id"], {"queue": queue}).scalar()


@router.post("/v1/queues/{queue}/receive", response_model=Received, summary="Receive with peek-lock",
             responses={204: {"description": "nothing arrived within wait_ms"},
                        **error_responses(404, 409, *READS_BODY)})
async def receive(queue: NamePath, request: Request, key: Key, db: Database, settings: NodeSettings,
                  options: ReceiveRequest | None = None) -> Any:
    """Locks the next conversation group and returns its next messages in order.

    Complete the lock to consume them. Without that they come back after
    lock_s, so a reader that crashes loses nothing; it de-duplicates by
    remembering the last sequence_number it applied per conversation_id.
    """
    options = options or ReceiveRequest()
    require(key, f"receive:{queue}")
    arrivals = request.app.state.arrivals
    wait_s = min(options.wait_ms, settings.max_wait_ms) / 1000
    deadline = time.monotonic() + wait_s
    messages = await run_in_threadpool(_lease, db, queue, options)
    if not messages and wait_s > 0:
        queue_id = await run_in_threadpool(_queue_id, db, queue)
        with arrivals.subscription(queue_id) as arrived:
            while not messages and (remaining := deadline - time.monotonic()) > 0:
                await arrivals.listen()  # again after the listener broke
                arrived.clear()
                messages = await run_in_threadpool(_lease, db, queue, options)
                if not messages:
                    await _wait(arrived, min(remaining, LOOK_AGAIN_S))
    if not messages:
        return Response(status_code=204)
    API_RECEIVED.labels(queue).inc(len(messages))
    return _received(messages)


def _received(messages: list[broker.LockedMessage]) -> Response:
    """The Received document, written with each body spliced in as stored (api.bodies.as_members): a large
    body is neither parsed into values nor copied more than once on its way out."""
    lock = Received(lock_token=messages[0].lock_token, lock_expires_at=messages[0].lock_expires_at, messages=[])
    envelope = lock.model_dump_json(exclude={"messages"})
    return Response(f'{envelope[:-1]},"messages":[{",".join(_message_json(m) for m in messages)}]}}',
                    media_type="application/json")


def _with_body(fields: BaseModel, body: bytes | None) -> str:
    """A model's JSON with the stored body spliced in as its body or body_base64 member (api.bodies.as_members)."""
    return f'{fields.model_dump_json(exclude={"body", "body_base64"})[:-1]},{bodies.as_members(body)}}}'


def _message_json(m: broker.LockedMessage) -> str:
    return _with_body(Message(conversation_id=m.conversation_id, conversation_handle=m.conversation_handle,
                              conversation_group_id=m.conversation_group_id, sequence_number=m.message_sequence_number,
                              message_type=m.message_type, service_name=m.service_name,
                              contract_name=m.contract_name, enqueued_at=m.enqueued_at,
                              queue_position=m.queue_position, delivery_count=m.delivery_count,
                              traceparent=m.traceparent), m.body)


async def _wait(event: asyncio.Event, timeout_s: float) -> None:
    try:
        await asyncio.wait_for(event.wait(), timeout_s)
    except TimeoutError:
        pass


@router.post("/v1/locks/{lock_token}/complete", response_model=Completed, summary="Consume a lock's messages",
             responses=error_responses(409, 422))
def complete_lock(lock_token: UUID, key: Key, db: Database) -> Completed:
    with db.begin() as connection:
        queue = visibility.lock_queue(connection, key, lock_token)
        completed = broker.complete_lock(connection, lock_token)
    API_COMPLETED.labels(queue).inc(completed)
    return Completed(completed=completed)


@router.post("/v1/locks/{lock_token}/renew", response_model=Renewed, summary="Hold a lock longer",
             responses=error_responses(409, *READS_BODY))
def renew_lock(lock_token: UUID, key: Key, db: Database, options: RenewRequest | None = None) -> Renewed:
    """Extends a live lock to lock_s from now, so that long work keeps its messages without an expiry
    counting toward the poison threshold. A lock already lost answers lock-lost with its reason."""
    options = options or RenewRequest()
    with db.begin() as connection:
        visibility.lock_queue(connection, key, lock_token)
        expires = broker.renew_lock(connection, lock_token, timedelta(seconds=options.lock_s))
    return Renewed(lock_token=lock_token, lock_expires_at=expires)


@router.get("/v1/locks/{lock_token}/state", response_model=GroupState, summary="The state of a lock's group",
            responses=error_responses(409, 422))
def get_group_state(lock_token: UUID, key: Key, db: Database) -> GroupState:
    """The state kept for the conversation group this live lock holds (null when none)."""
    with db.begin() as connection:
        visibility.lock_queue(connection, key, lock_token)
        group = connection.execute(queries.QUERIES["group_of_lock"], {"token": lock_token}).scalar()
        return GroupState(state=broker.get_conversation_group_state(connection, group, lock_token))


@router.put("/v1/locks/{lock_token}/state", response_model=GroupState, summary="Keep state for a lock's group",
            responses=error_responses(409, *READS_BODY))
def set_group_state(lock_token: UUID, update: GroupState, key: Key, db: Database) -> GroupState:
    """Keeps state for the conversation group this live lock holds, until it is set again (null forgets it):
    the next reader of the group reads it, as Service Bus sessions keep theirs."""
    with db.begin() as connection:
        visibility.lock_queue(connection, key, lock_token)
        group = connection.execute(queries.QUERIES["group_of_lock"], {"token": lock_token}).scalar()
        broker.set_conversation_group_state(connection, group, update.state, lock_token)
    return update


@router.post("/v1/locks/{lock_token}/dead-letter", response_model=DeadLettered,
             summary="Dead-letter a conversation of a lock", responses=error_responses(404, 409, *READS_BODY))
def dead_letter(lock_token: UUID, request_body: DeadLetterRequest, key: Key, db: Database) -> DeadLettered:
    """Moves what waits of one conversation of the lock's messages to the dead letters, with the reason on its
    first message, and ends the conversation with broker.error (-2) on both sides; the lock ends, and its other
    messages come back, counting no failure."""
    with db.begin() as connection:
        visibility.conversation(connection, key, request_body.conversation_handle)  # first, as the broker looks
        visibility.lock_queue(connection, key, lock_token)
        moved = broker.dead_letter_conversation(connection, request_body.conversation_handle, request_body.reason,
                                                lock_token)
    return DeadLettered(dead_lettered=moved)


@router.post("/v1/locks/{lock_token}/abandon", response_model=Abandoned, summary="Hand a lock's messages back",
             responses=error_responses(409, 422))
def abandon_lock(lock_token: UUID, key: Key, db: Database) -> Abandoned:
    with db.begin() as connection:
        queue = visibility.lock_queue(connection, key, lock_token)
        quarantined = broker.abandon_lock(connection, lock_token)
    API_ABANDONED.labels(queue).inc()
    return Abandoned(quarantined=quarantined)


@router.get("/v1/queues", response_model=list[QueueStatus], summary="Status of every queue")
def list_queues(key: AdminKey, db: Database) -> list[QueueStatus]:
    with db.connect() as connection:
        return [QueueStatus(**row._mapping) for row in queries.queue_statuses(connection)]


@router.get("/v1/queues/{queue}", response_model=QueueStatus, summary="Status of one queue",
            responses=error_responses(404, 422))
def get_queue_status(queue: NamePath, key: Key, db: Database) -> QueueStatus:
    require(key, f"receive:{queue}")
    with db.connect() as connection:
        row = next(iter(queries.queue_statuses(connection, queue)), None)
    if row is None:
        raise Problem(404, "unknown-object", "No such object", f"unknown queue {queue!r}")
    return QueueStatus(**row._mapping)


@router.get("/v1/queues/{queue}/messages", response_model=list[BrowsedMessage],
            summary="Look at the messages waiting in a queue, without receiving them",
            responses=error_responses(404, 422))
def browse_queue(queue: NamePath, key: Key, db: Database,
                 limit: int = Query(20, ge=1, le=100), offset: int = Query(0, ge=0, le=2**62)) -> list[BrowsedMessage]:
    """The queue's waiting messages, the highest priority first and then the oldest, each with the
    first 1,024 bytes of its body: a look that takes no lock and consumes nothing, so a message shown here may
    be received a moment later (needs the admin scope; recorded in the node's log)."""
    with audit.action(key, "browse", f"queue {queue!r}") as outcome:
        require(key, "admin")
        with db.connect() as connection:
            queue_id = connection.execute(queries.QUERIES["queue_id"], {"queue": queue}).scalar()
            if queue_id is None:
                raise Problem(404, "unknown-object", "No such object", f"unknown queue {queue!r}")
            rows = connection.execute(queries.QUERIES["waiting_messages"], {
                "queue_id": queue_id, "limit": limit, "offset": offset, "head_bytes": PREVIEW_BYTES}).all()
        outcome.done = f"waiting messages shown: {len(rows)}"
    return [_waiting_message(row) for row in rows]


def _waiting_message(row) -> BrowsedMessage:
    head = None if row.body_head is None else bytes(row.body_head)
    truncated = (row.body_bytes or 0) > PREVIEW_BYTES
    try:  # a cut body may end inside a character: the incremental decoder leaves it out
        preview = None if head is None else codecs.getincrementaldecoder("utf-8")().decode(head, final=not truncated)
    except UnicodeDecodeError:
        preview = None
    fields = {name: value for name, value in row._mapping.items() if name != "body_head"}
    return BrowsedMessage(**fields, sequence_number=row.message_sequence_number, body_preview=preview,
                          body_preview_base64=base64.b64encode(head).decode() if head and preview is None else None,
                          body_truncated=truncated)


@router.post("/v1/queues/{queue}/purge", response_model=Purged, summary="Delete every message waiting in a queue",
             responses=error_responses(404, 422))
def purge_queue(queue: NamePath, key: Key, db: Database) -> Purged:
    """Deletes every message waiting in the queue and ends its locks (needs the admin scope). The
    conversations go on without those messages."""
    with audit.action(key, "purge", f"queue {queue!r}") as outcome:
        require(key, "admin")
        with db.begin() as connection:
            purged = broker.purge_queue(connection, queue)
        outcome.done = f"waiting messages deleted: {purged}"
    return Purged(purged=purged)


@router.get("/v1/queues/{queue}/dead-letters", response_model=list[DeadLetterMessage],
            summary="A queue's dead letters", responses=error_responses(404, 422))
def list_dead_letters(queue: NamePath, key: Key, db: Database,
                      limit: int = Query(100, ge=1, le=1000), offset: int = Query(0, ge=0, le=2**62),
                      max_bytes: int = Query(4 * 1024 * 1024, ge=1, le=64 * 1024 * 1024, description=(
                          "at most this many bytes of bodies, as stored; the first letter comes whatever its size: "
                          "page on with offset"))) -> Response:
    """The queue's dead letters, oldest first, each with why it was dead-lettered."""
    require(key, f"receive:{queue}")
    with db.connect() as connection:
        if connection.execute(queries.QUERIES["queue_id"], {"queue": queue}).scalar() is None:
            raise Problem(404, "unknown-object", "No such object", f"unknown queue {queue!r}")
        letters = connection.execute(queries.QUERIES["dead_letters"], {
            "queue": queue, "limit": limit, "offset": offset, "max_bytes": max_bytes}).all()
    return Response(f"[{','.join(_dead_letter_json(letter) for letter in letters)}]", media_type="application/json")


def _dead_letter_json(letter) -> str:
    fields = DeadLetterMessage(**{**letter._mapping, "sequence_number": letter.message_sequence_number, "body": None})
    return _with_body(fields, None if letter.body is None else bytes(letter.body))


@router.post("/v1/queues/{queue}/dead-letters/resubmit", response_model=Resubmitted,
             summary="Put a conversation's dead letters back", responses=error_responses(404, 409, *READS_BODY))
def resubmit_dead_letters(queue: NamePath, resubmit: Resubmit, key: Key, db: Database) -> Resubmitted:
    """Puts a quarantined conversation's dead letters back into the queue, in order, to be processed again
    (needs the admin scope); only while that side is in error, not yet ended."""
    handle = resubmit.conversation_handle
    with audit.action(key, "resubmit the dead letters of", f"conversation {handle} in queue {queue!r}") as outcome:
        require(key, "admin")
        with db.begin() as connection:
            resubmitted = broker.resubmit_dead_letters(connection, queue, handle)
        outcome.done = f"dead letters put back in order: {resubmitted}"
    return Resubmitted(resubmitted=resubmitted)


@router.post("/v1/queues/{queue}/dead-letters/purge", response_model=Purged, summary="Delete a queue's dead letters",
             responses=error_responses(404, *READS_BODY))
def purge_dead_letters(queue: NamePath, key: Key, db: Database,
                       options: PurgeDeadLetters | None = None) -> Purged:
    """Deletes the queue's dead letters, or those dead-lettered longer ago than older_than_s (needs the admin
    scope)."""
    options = options or PurgeDeadLetters()
    older_than = None if options.older_than_s is None else timedelta(seconds=options.older_than_s)
    which = "" if older_than is None else f" dead-lettered over {options.older_than_s:g} s ago"
    with audit.action(key, "purge the dead letters of", f"queue {queue!r}{which}") as outcome:
        require(key, "admin")
        with db.begin() as connection:
            purged = broker.purge_dead_letters(connection, queue, older_than)
        outcome.done = f"dead letters deleted: {purged}"
    return Purged(purged=purged)
