"""Node-to-node endpoints, each signed both ways with the secret the two nodes share.

A request counts only when it is signed for its method, its endpoint, its media type and this
node's broker_instance; the answer is signed as the answer to that request (see broker.signing).

POST /transport/v1/batches: messages from other nodes, acknowledged after our commit.  The
body is PostgreSQL's binary COPY format of broker.transport_message rows (see broker.relay),
sent as the media type of this node's wire version (broker.wire; api.admission refuses any
other before the body is read): it goes straight into a temporary table by COPY, and
PostgreSQL's own input checks refuse anything malformed.
POST /transport/v1/describe: what this node offers a peer (its services, their queues and
contracts, and its routes back to the peer), for `broker diagnose` on the peer.
"""
import io
import json

import psycopg2
from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError
from sqlalchemy import text

from api.admission import bad_signature, peer_instance
from api.problems import database_unavailable, problem
from broker import signing, wire
from broker.sessions import with_temporary_table

router = APIRouter()

SECRETS_OF_PEER = text("SELECT DISTINCT peer_secret FROM broker.routes WHERE broker_instance = :instance")
# The batch's rows live for one transaction in a temporary table of the session.
STAGE_BATCH = text(
    "CREATE TEMPORARY TABLE IF NOT EXISTS incoming_transport_batch OF broker.transport_message"
    " (conversation_id WITH OPTIONS NOT NULL, sender_is_initiator WITH OPTIONS NOT NULL,"
    "  sequence_number WITH OPTIONS NOT NULL, message_type WITH OPTIONS NOT NULL) ON COMMIT DELETE ROWS")
COPY_BATCH = "COPY pg_temp.incoming_transport_batch FROM STDIN (FORMAT binary)"
ACCEPT_BATCH = text("SELECT broker.accept_transport_batch(:instance)::text")
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


def _secret_of_signer(connection, request: Request, path: str, media_type: str, instance: str,
                      body: bytes) -> str:
    """The secret the request is signed under, for this endpoint of this node and the media type it takes
    there; raises signing.BadSignature when no peer signed it so."""
    purpose = signing.request_purpose(request.method, path, media_type, request.app.state.broker_instance)
    return signing.matching_secret(list(connection.execute(SECRETS_OF_PEER, {"instance": instance}).scalars()),
                                   request.headers.get(signing.TIMESTAMP_HEADER),
                                   request.headers.get(signing.SIGNATURE_HEADER), purpose, body)


def _malformed(kind: str, detail: str) -> Response:
    return problem(400, kind, "The body is not what this endpoint takes", detail)


def _signed_answer(request: Request, secret: str, answer: bytes) -> Response:
    """The answer, signed as the answer to this request (whose signature has been checked)."""
    purpose = signing.answer_purpose(request.headers[signing.SIGNATURE_HEADER])
    headers = signing.signed_headers(secret, request.app.state.broker_instance, purpose, answer)
    return Response(answer, media_type=wire.JSON_MEDIA_TYPE, headers=headers)


@router.post(signing.BATCHES_PATH, include_in_schema=False)
async def receive_batch(request: Request) -> Response:
    # admitted: a peer this node routes to, sending this node's wire version (api.admission)
    instance = peer_instance(request)
    batch = await request.body()  # at most max_batch_bytes: see api.limits

    def accept() -> Response:
        """Checks the signature, stores the batch and commits, in one transaction."""
        try:
            with request.app.state.engine.connect() as connection, \
                    with_temporary_table(connection, "incoming_transport_batch", STAGE_BATCH).begin():
                secret = _secret_of_signer(connection, request, signing.BATCHES_PATH, wire.BATCH_MEDIA_TYPE,
                                           instance, batch)
                with connection.connection.cursor() as cursor:
                    cursor.copy_expert(COPY_BATCH, io.BytesIO(batch))
                answer = connection.execute(ACCEPT_BATCH, {"instance": instance}).scalar_one()
        except signing.BadSignature as refusal:
            return bad_signature(refusal)
        except (psycopg2.DataError, psycopg2.IntegrityError) as error:  # PostgreSQL's input checks refused it
            return _malformed("malformed-batch", str(error).strip().splitlines()[0])
        except psycopg2.OperationalError:
            return database_unavailable()
        # after the commit: acknowledge only what is durable
        return _signed_answer(request, secret, answer.encode())

    return await run_in_threadpool(accept)


class DescribeRequest(BaseModel):
    services: list[str]
    contracts: list[str]


@router.post(signing.DESCRIBE_PATH, include_in_schema=False)
async def describe(request: Request) -> Response:
    instance = peer_instance(request)  # admitted: a peer this node routes to (api.admission)
    body = await request.body()

    def describe_catalog() -> Response:
        with request.app.state.engine.connect() as connection:
            try:
                secret = _secret_of_signer(connection, request, signing.DESCRIBE_PATH, wire.JSON_MEDIA_TYPE,
                                           instance, body)
            except signing.BadSignature as refusal:
                return bad_signature(refusal)
            try:
                asked = DescribeRequest.model_validate_json(body)
            except ValidationError as error:
                return _malformed("malformed-request", str(error.errors()[:3]))
            services = {row.name: {"queue": row.queue, "queue_enabled": row.queue_enabled,
                                   "contracts": list(row.contracts)}
                        for row in connection.execute(DESCRIBE_SERVICES, {"names": asked.services})}
            contracts = dict(connection.execute(DESCRIBE_CONTRACTS, {"names": asked.contracts}).all())
            routes = list(connection.execute(ROUTES_TO_PEER, {"instance": instance}).scalars())
        return _signed_answer(request, secret, json.dumps({
            "broker_instance": request.app.state.broker_instance, "services": services,
            "contracts": contracts, "routes_to_you": routes}).encode())

    return await run_in_threadpool(describe_catalog)
