"""Node-to-node endpoints, each signed both ways with the secret the two nodes share.

POST /transport/v1/batches: messages from other nodes, acknowledged after our commit.
POST /transport/v1/describe: what this node offers a peer (its services, their queues and
contracts, and its routes back to the peer), for `broker diagnose` on the peer.
"""
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
DESCRIBE_SERVICES = text(
    "SELECT s.name, q.name AS queue, q.is_enabled AS queue_enabled,"
    " coalesce(array_agg(c.name ORDER BY c.name) FILTER (WHERE c.name IS NOT NULL), '{}') AS contracts"
    " FROM broker.services s JOIN broker.queues q USING (queue_id)"
    " LEFT JOIN broker.service_contracts sc USING (service_id)"
    " LEFT JOIN broker.contracts c ON c.contract_id = sc.contract_id"
    " WHERE s.name = ANY(:names) GROUP BY s.name, q.name, q.is_enabled")
DESCRIBE_CONTRACTS = text(
    "SELECT c.name, jsonb_object_agg(mt.name, jsonb_build_object('sent_by', cmt.sent_by,"
    " 'validation', mt.validation)) AS message_types"
    " FROM broker.contracts c JOIN broker.contract_message_types cmt USING (contract_id)"
    " JOIN broker.message_types mt USING (message_type_id)"
    " WHERE c.name = ANY(:names) GROUP BY c.name")
ROUTES_TO_PEER = text("SELECT service_name FROM broker.routes WHERE broker_instance = :instance ORDER BY 1")


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


async def _signed_request(request: Request, model: type[BaseModel], malformed: str):
    """(the peer's instance id, the secret its signature is good under, the parsed body), or the
    401 or 400 to answer.  `malformed` names the problem type for a body that does not parse."""
    body = await request.body()  # at most max_batch_bytes: see api.limits
    try:
        instance = str(UUID(request.headers.get(signing.INSTANCE_HEADER, "")))
    except ValueError:
        return problem(401, "unknown-peer", "the request does not name a broker instance")

    def secrets() -> list[str]:
        with request.app.state.engine.connect() as connection:
            return list(connection.execute(SECRETS_OF_PEER, {"instance": instance}).scalars())

    try:
        secret = signing.matching_secret(await run_in_threadpool(secrets),
                                         request.headers.get(signing.TIMESTAMP_HEADER),
                                         request.headers.get(signing.SIGNATURE_HEADER), body)
    except signing.BadSignature as refusal:
        return problem(401, "bad-signature", "the request is not signed by a known peer", str(refusal))
    try:
        return instance, secret, model.model_validate_json(body)
    except ValidationError as error:
        return problem(400, malformed, "the body is not what this endpoint takes", str(error.errors()[:3]))


def _signed_answer(request: Request, secret: str, answer: bytes) -> Response:
    headers = signing.signed_headers(secret, request.app.state.broker_instance, answer)
    return Response(answer, media_type="application/json", headers=headers)


@router.post("/transport/v1/batches", include_in_schema=False)
async def receive_batch(request: Request) -> Response:
    signed = await _signed_request(request, TransportBatch, "malformed-batch")
    if isinstance(signed, Response):
        return signed
    instance, secret, _ = signed
    batch = (await request.body()).decode()  # checked against TransportBatch: stored as sent

    def accept() -> bytes:
        with request.app.state.engine.begin() as connection:
            answer = connection.execute(ACCEPT_BATCH, {"instance": instance, "batch": batch}).scalar_one()
        return json.dumps(answer).encode()  # after the commit: acknowledge only what is durable

    return _signed_answer(request, secret, await run_in_threadpool(accept))


class DescribeRequest(BaseModel):
    services: list[str]
    contracts: list[str]


@router.post("/transport/v1/describe", include_in_schema=False)
async def describe(request: Request) -> Response:
    signed = await _signed_request(request, DescribeRequest, "malformed-request")
    if isinstance(signed, Response):
        return signed
    instance, secret, asked = signed

    def describe_catalog() -> bytes:
        with request.app.state.engine.connect() as connection:
            services = {row.name: {"queue": row.queue, "queue_enabled": row.queue_enabled,
                                   "contracts": list(row.contracts)}
                        for row in connection.execute(DESCRIBE_SERVICES, {"names": asked.services})}
            contracts = dict(connection.execute(DESCRIBE_CONTRACTS, {"names": asked.contracts}).all())
            routes = list(connection.execute(ROUTES_TO_PEER, {"instance": instance}).scalars())
        return json.dumps({"broker_instance": request.app.state.broker_instance, "services": services,
                           "contracts": contracts, "routes_to_you": routes}).encode()

    return _signed_answer(request, secret, await run_in_threadpool(describe_catalog))
