"""/v1/conversations: begin, look at, send on and end conversations."""
from contextlib import nullcontext
from datetime import datetime, timedelta
from typing import Any, Literal
from uuid import UUID

from fastapi import APIRouter, Depends, Header
from pydantic import AwareDatetime, BaseModel, ConfigDict, Field
from sqlalchemy import Connection

import broker
from broker.api import audit, bodies, visibility
from broker.api.auth import require
from broker.api.deps import Database, Key
from broker.api.problems import KEYED, READS_BODY, error_responses
from broker.api.types import Name, Number, Text, integer, known_query_parameters
from broker import queries
from broker.api_keys import ApiKey
from broker.status import MESSAGES_LISTED, conversation_life

router = APIRouter(prefix="/v1/conversations", tags=["conversations"], responses=error_responses(*KEYED),
                   dependencies=[Depends(known_query_parameters)])
messages_router = APIRouter(prefix="/v1", tags=["conversations"], responses=error_responses(*KEYED),
                            dependencies=[Depends(known_query_parameters)])
# Enough for a client to amortise a request's cost; a request stays well within BROKER_MAX_REQUEST_BYTES' default.
MAX_MESSAGES_A_REQUEST = 1000


class BeginConversation(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"from_service": "shop", "to_service": "warehouse", "contract": "orders", "lifetime_s": 3600}]})

    from_service: Name = Field(description="the local service that begins (needs send:<from_service>)")
    to_service: Name = Field(description="a local service, or a remote one with a route")
    contract: Name
    lifetime_s: integer(gt=0, le=10 * 365 * 86400) | None = Field(None,
                                   description="end the conversation with broker.error (-1) after this long")
    related_conversation_group: UUID | None = Field(None, description="join an existing conversation group")
    related_conversation: UUID | None = Field(None, description=(
        "join the group of this conversation side, which is in from_service's queue (instead of "
        "related_conversation_group)"))


class Conversation(BaseModel):
    """One side of a conversation, as broker.conversation_endpoints shows it."""

    conversation_handle: UUID
    conversation_id: UUID
    conversation_group_id: UUID
    is_initiator: bool
    service_name: str
    queue_name: str
    far_service: str
    far_is_local: bool
    contract_name: str
    state: str = Field(examples=["conversing"])
    send_sequence: int = Field(description="the last number this side sent")
    receive_sequence: int = Field(description="the last number this side received without a gap")
    expires_at: datetime | None
    created_at: datetime
    closed_at: datetime | None
    priority: int = Field(description="1 to 10: groups of a higher priority are received, and messages of a higher "
                                      "priority sent to another node, first")


class ConversationMessage(BaseModel):
    """A message of the conversation side that this node still holds, and why it is here."""

    direction: Literal["sent", "arrived", "dead letter"]
    sequence_number: int = Field(description="0 for a notice this node raised itself (an error, a timer)")
    message_type: str
    body_bytes: int | None
    since: datetime = Field(description="when it was queued here")
    attempts: int = Field(description="sent: failed transmissions; arrived and dead letters: failed receives")
    status: str = Field(examples=["waiting for its first transmission", "waiting for a reader"])
    traceparent: str | None = Field(None, description="the W3C traceparent it carries: its trace")


class ConversationLife(BaseModel):
    """One side of a conversation on this node: what it sent and received, and every message still here. What was
    acknowledged, delivered or received and then deleted is counted, not listed."""

    conversation: Conversation
    sent: int = Field(description="messages this side sent")
    sent_and_gone: int = Field(description="of those, acknowledged by the far node (or delivered to a local one)")
    arrived: int = Field(description="messages that arrived for this side, in order")
    arrived_and_received: int = Field(description="of those, received (consumed)")
    messages: list[ConversationMessage] = Field(
        description=f"the first {MESSAGES_LISTED:,} messages this side holds here")
    messages_not_listed: int = Field(description="how many more it holds here, past those listed")


IDEMPOTENT = ("makes the send idempotent: the number this message must get. Resending the same number with the same "
              "content returns the stored result; another content, or a number out of turn, is 409")
SequenceNumber = integer(ge=1, le=2**53 - 1)


class MessageContent(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra={"not": {"required": ["body", "body_base64"]}})

    message_type: Name
    body: Any = Field(None, description="any JSON value, stored as its JSON text")
    body_base64: str | None = Field(
        None, pattern=r"^(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?$",
        description="raw bytes, base64 (RFC 4648, padded): instead of body")


class SendMessage(MessageContent):
    model_config = ConfigDict(extra="forbid", json_schema_extra={
        "examples": [{"message_type": "order.submit", "body": {"sku": "A-1", "quantity": 2}, "sequence_number": 1},
                     {"message_type": "order.note", "body": "remind", "deliver_after_s": 3600}],
        "not": {"required": ["body", "body_base64"]}})

    sequence_number: SequenceNumber | None = Field(None, description=IDEMPOTENT)
    deliver_after_s: Number | None = Field(None, ge=0, le=10 * 365 * 86400, description=(
        "hold the message this long from now, and the later messages of the conversation behind it"))
    deliver_at: AwareDatetime | None = Field(None, description="hold the message until then (instead of "
                                                               "deliver_after_s)")


class NumberedMessage(MessageContent):
    model_config = ConfigDict(extra="forbid", json_schema_extra={
        "examples": [{"conversation_handle": "8f7c4268-32b4-4c58-9c4f-7e2f1c0f5b1a", "message_type": "order.submit",
                      "body": {"sku": "A-1", "quantity": 2}, "sequence_number": 1}],
        "not": {"required": ["body", "body_base64"]}})

    conversation_handle: UUID
    sequence_number: SequenceNumber = Field(description=IDEMPOTENT)


class SendMessages(BaseModel):
    model_config = ConfigDict(extra="forbid")

    messages: list[NumberedMessage] = Field(min_length=1, max_length=MAX_MESSAGES_A_REQUEST, description=(
        "sent in this order, all or none, each numbered by the client: a batch sent again after a timeout is "
        "stored once"))


class Sent(BaseModel):
    sequence_number: int
    duplicate: bool = Field(description="true when this was a retry of a send already stored")


class SentMany(BaseModel):
    messages: list[Sent] = Field(description="one per message, in the order given")


class EndConversation(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {}, {"error_code": 42, "error_description": "out of stock"}]})

    error_code: integer(ge=-2**31, le=2**31 - 1) | None = None
    error_description: Text | None = Field(None, max_length=4000)


class MoveConversation(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"conversation_group": "5b0c7a3e-8f1d-4c2b-9a6e-1d2f3c4b5a69"}]})

    conversation_group: UUID = Field(description="a group of the same queue; one that does not exist yet is made")

# W3C Trace Context: the messages sent join this trace (see broker.tracing).
TRACEPARENT = Header(None, description="a W3C traceparent (00-<trace id>-<parent id>-<flags>): the messages sent "
                                       "carry it, and their transmission and receipt continue its trace")


def _sending_endpoint(connection: Connection, key: ApiKey, handle: UUID):
    endpoint = visibility.conversation(connection, key, handle)
    require(key, f"send:{endpoint.service_name}")
    return endpoint


@router.post("", status_code=201, response_model=Conversation, summary="Begin a conversation",
             responses=error_responses(404, 409, *READS_BODY))
def begin_conversation(begin: BeginConversation, key: Key, db: Database) -> Any:
    require(key, f"send:{begin.from_service}")
    lifetime = timedelta(seconds=begin.lifetime_s) if begin.lifetime_s else None
    with db.begin() as connection:
        if begin.related_conversation is not None:
            visibility.conversation(connection, key, begin.related_conversation)
        handle = broker.begin_dialog(connection, begin.from_service, begin.to_service, begin.contract,
                                     lifetime=lifetime, related_conversation_group=begin.related_conversation_group,
                                     related_conversation=begin.related_conversation)
        return connection.execute(queries.QUERIES["endpoint"], {"handle": handle}).first()._asdict()


@router.get("/{conversation_handle}", response_model=Conversation, summary="Look at one side of a conversation",
            responses=error_responses(404, 422))
def get_conversation(conversation_handle: UUID, key: Key, db: Database) -> Any:
    with db.connect() as connection:
        return visibility.conversation(connection, key, conversation_handle)._asdict()


@router.get("/{conversation_handle}/messages", response_model=ConversationLife,
            summary="Follow one side of a conversation: what it sent and received, and why each message here waits",
            responses=error_responses(404, 422))
def get_conversation_messages(conversation_handle: UUID, key: Key, db: Database) -> Any:
    with db.connect() as connection:
        visibility.conversation(connection, key, conversation_handle)
        return conversation_life(connection, conversation_handle)


@router.post("/{conversation_handle}/messages", status_code=201, response_model=Sent, summary="Send a message",
             responses=error_responses(404, 409, *READS_BODY))
def send_message(conversation_handle: UUID, message: SendMessage, key: Key, db: Database,
                 traceparent: str | None = TRACEPARENT) -> Sent:
    body = bodies.encode(message.body, message.body_base64)
    with db.begin() as connection:
        _sending_endpoint(connection, key, conversation_handle)
        after = None if message.deliver_after_s is None else timedelta(seconds=message.deliver_after_s)
        delivery = {"deliver_after": after, "deliver_at": message.deliver_at, "traceparent": traceparent}
        if message.sequence_number is None:
            return Sent(sequence_number=broker.send(connection, conversation_handle, message.message_type, body,
                                                    **delivery), duplicate=False)
        sent_now = broker.send_numbered(connection, conversation_handle, message.sequence_number,
                                        message.message_type, body, **delivery)
        return Sent(sequence_number=message.sequence_number, duplicate=not sent_now)


@messages_router.post("/messages", response_model=SentMany, summary="Send many messages, on any conversations",
                      responses=error_responses(404, 409, *READS_BODY))
def send_messages(batch: SendMessages, key: Key, db: Database, traceparent: str | None = TRACEPARENT) -> SentMany:
    """One request and one transaction for many numbered sends: each as POST …/messages with its sequence_number
    would do it, all or none.  The key needs send:<service> for every conversation named; one it may not see
    is unknown (404)."""
    handles = list(dict.fromkeys(message.conversation_handle for message in batch.messages))
    encoded = [(message.conversation_handle, message.sequence_number, message.message_type,
                bodies.encode(message.body, message.body_base64)) for message in batch.messages]
    with db.begin() as connection:
        endpoints = queries.endpoints_named(connection, handles)
        unseen = next((handle for handle in handles
                       if handle not in endpoints or not visibility.sees(key, endpoints[handle])), None)
        if unseen is not None:
            raise visibility.unknown_conversation(unseen)
        for service in sorted({endpoint.service_name for endpoint in endpoints.values()}):
            require(key, f"send:{service}")
        sent_now = broker.send_numbered_batch(connection, encoded, traceparent=traceparent)
    return SentMany(messages=[Sent(sequence_number=message.sequence_number, duplicate=not now)
                              for message, now in zip(batch.messages, sent_now)])


@router.post("/{conversation_handle}/end", response_model=Conversation, summary="End a conversation",
             responses=error_responses(404, 409, *READS_BODY))
def end_conversation(conversation_handle: UUID, key: Key, db: Database, end: EndConversation | None = None) -> Any:
    """Ends this side: the far side gets broker.end_dialog, or broker.error with the error's code and description
    (an end with an error is recorded in the node's log, as the operator's way out of a stuck conversation)."""
    end = end or EndConversation()
    recorded = (audit.action(key, f"end with error {end.error_code}", f"conversation {conversation_handle}")
                if end.error_code is not None else nullcontext(audit.Outcome()))
    with recorded as outcome:
        with db.begin() as connection:
            _sending_endpoint(connection, key, conversation_handle)
            broker.end_conversation(connection, conversation_handle, error_code=end.error_code,
                                    error_description=end.error_description)
            side = connection.execute(queries.QUERIES["endpoint"], {"handle": conversation_handle}).first()._asdict()
        outcome.done = f"ended, now {side['state']}"
    return side


@router.post("/{conversation_handle}/move", response_model=Conversation, summary="Move a conversation to another group",
             responses=error_responses(404, 409, *READS_BODY))
def move_conversation(conversation_handle: UUID, move: MoveConversation, key: Key, db: Database) -> Any:
    """Moves this side of the conversation, and its waiting messages, to another conversation group of its
    queue (Service Broker's MOVE CONVERSATION): from then on they are locked and received with that group.
    409 in-use while a lock holds either group."""
    with db.begin() as connection:
        require(key, f"receive:{visibility.conversation(connection, key, conversation_handle).queue_name}")
        broker.move_conversation(connection, conversation_handle, move.conversation_group)
        return connection.execute(queries.QUERIES["endpoint"], {"handle": conversation_handle}).first()._asdict()
