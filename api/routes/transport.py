"""Node-to-node endpoints: HTTP in front of broker.transport, each signed both ways with the secret
the two nodes share.

POST /transport/v1/batches: messages from other nodes, acknowledged after our commit
(broker.transport.receiving).  The body is sent as the media type of this node's wire version;
api.admission refuses any other before the body is read.
POST /transport/v1/describe: what this node offers a peer, for `broker diagnose` on the peer
(broker.transport.describe).
"""
from collections.abc import Callable

import psycopg2
from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response

from broker.api.admission import bad_signature, peer_instance
from broker.api.problems import database_unavailable, problem
from broker.transport import describe, receiving, signing, wire

router = APIRouter()


async def _answer(request: Request, kind: str, take: Callable) -> Response:
    """Hands the request's body to take(engine, our_instance, peer_instance, headers, body), which checks the
    peer's signature and returns the secret and the answer; the answer goes back signed as the answer to this
    request."""
    instance = peer_instance(request)  # admitted: a peer this node routes to (api.admission)
    body = await request.body()  # at most the route's limit: see api.limits
    ours = request.app.state.broker_instance

    def answer() -> Response:
        try:
            secret, answer = take(request.app.state.engine, ours, instance, request.headers, body)
        except signing.BadSignature as refusal:
            return bad_signature(refusal)
        except receiving.Malformed as error:
            return problem(400, kind, "The body is not what this endpoint takes", str(error))
        except psycopg2.OperationalError:
            return database_unavailable()
        headers = signing.answer_headers(secret, ours, request.headers[signing.SIGNATURE_HEADER], answer)
        return Response(answer, media_type=wire.JSON_MEDIA_TYPE, headers=headers)

    return await run_in_threadpool(answer)


@router.post(signing.BATCHES_PATH, include_in_schema=False)
async def receive_batch(request: Request) -> Response:
    return await _answer(request, "malformed-batch", receiving.accept_batch)


@router.post(signing.DESCRIBE_PATH, include_in_schema=False)
async def describe_node(request: Request) -> Response:
    return await _answer(request, "malformed-request", describe.answer)
