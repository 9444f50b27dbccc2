"""POST /transport/v1/batches: messages from other nodes, acknowledged after our commit."""
import json
from uuid import UUID

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError
from sqlalchemy import text

from api.problems import problem
from broker import signing

router = APIRouter()

SECRETS_OF_PEER = text("SELECT DISTINCT peer_secret FROM broker.routes WHERE broker_instance = :instance")
ACCEPT_BATCH = text("SELECT broker.accept_transport_batch(:instance, CAST(:batch AS jsonb))")


class TransportMessage(BaseModel):
    sequence_number: int
    message_type: str
    body: str | None = None


class TransportConversation(BaseModel):
    conversation_id: UUID
    sender_is_initiator: bool
    from_service: str
    to_service: str
    contract: str
    expires_at: str | None = None
    messages: list[TransportMessage]


class TransportBatch(BaseModel):
    conversations: list[TransportConversation]


@router.post("/transport/v1/batches", include_in_schema=False)
async def receive_batch(request: Request) -> Response:
    engine = request.app.state.engine
    body = await request.body()  # at most max_batch_bytes: see api.limits
    try:
        instance = str(UUID(request.headers.get(signing.INSTANCE_HEADER, "")))
    except ValueError:
        return problem(401, "unknown-peer", "the request does not name a broker instance")

    def secrets() -> list[str]:
        with engine.connect() as connection:
            return list(connection.execute(SECRETS_OF_PEER, {"instance": instance}).scalars())

    try:
        secret = signing.matching_secret(await run_in_threadpool(secrets),
                                         request.headers.get(signing.TIMESTAMP_HEADER),
                                         request.headers.get(signing.SIGNATURE_HEADER), body)
    except signing.BadSignature as refusal:
        return problem(401, "bad-signature", "the request is not signed by a known peer", str(refusal))
    try:
        batch = TransportBatch.model_validate_json(body)
    except ValidationError as error:
        return problem(400, "malformed-batch", "the batch is not a valid transport batch", str(error.errors()[:3]))

    def accept() -> bytes:
        with engine.begin() as connection:
            answer = connection.execute(ACCEPT_BATCH, {"instance": instance,
                                                       "batch": batch.model_dump_json()}).scalar_one()
        return json.dumps(answer).encode()  # after the commit: acknowledge only what is durable

    answer = await run_in_threadpool(accept)
    headers = signing.signed_headers(secret, request.app.state.broker_instance, answer)
    return Response(answer, media_type="application/json", headers=headers)
