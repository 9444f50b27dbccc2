"""Admission: who sends a request is settled from its headers, before its body is read.

A /v1 request and /metrics need a valid API key; a /transport request needs the headers of a
peer this node routes to, with a fresh timestamp.  Anything else is answered 401 at once, with
Connection: close, so that an outsider spends the node no more than its headers.  A peer's batch
in a wire version this node does not take is answered 415 the same way (broker.transport.wire).  The key is
handed on to the route (api.auth); a peer's signature over its body is checked once the body has
come (api.routes.transport).
"""
import hashlib
import time
from uuid import UUID

import anyio
from sqlalchemy.exc import DBAPIError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.requests import Request

from broker.api.problems import CLOSE, database_unavailable, problem
from broker import api_keys, queries
from broker.transport import signing, wire

KEY_SCHEME = "bearer "
# A peer found routed is let in without a look at the database for this long: a batch a second per lane
# would otherwise cost a query before its body is read.  A route dropped meanwhile takes its secrets with
# it, so the peer's signature is refused (api.routes.transport).
ROUTED_FOR_S = 1.0
# A key found live is let in without a look at the database for this long: a key revoked meanwhile stops working
# within it (docs/how-to/tls.md, "API keys").  Only live keys are kept, so an outsider cannot fill the cache.
KEY_KNOWN_FOR_S = 5.0
KEYS_KEPT = 1000


def needs_key(path: str) -> bool:
    return path.startswith("/v1/") or path == "/metrics"


def unauthorized():
    return problem(401, "unauthorized", "A valid API key is required",
                   "send it as 'Authorization: Bearer <key>'; create one with 'broker keys create'",
                   headers={"WWW-Authenticate": "Bearer", **CLOSE})


def unknown_peer(detail: str):
    return problem(401, "unknown-peer", "The request does not come from a peer of this node", detail,
                   headers=CLOSE)


def bad_signature(refusal: signing.BadSignature, headers: dict | None = None):
    return problem(401, "bad-signature", "The request is not signed by a known peer", str(refusal), headers=headers)


def unsupported_wire_version(content_type: str | None):
    """415 naming what was sent and what this node takes, with its versions as extension members (wire_version,
    the highest, as the previous releases named it; wire_versions, all), so that the sender can pick another."""
    return problem(415, "unsupported-wire-version", "The batch is in a wire version this node does not take",
                   f"the batch is sent as {wire.sent_as(content_type)}; this node takes "
                   f"{wire.in_words(wire.WIRE_VERSIONS)} ({wire.BATCH_MEDIA_TYPE}, or an earlier version "
                   "number): upgrade one of the two nodes so that they share a version", headers=CLOSE,
                   wire_version=wire.WIRE_VERSION, wire_versions=list(wire.WIRE_VERSIONS))


def peer_instance(request: Request) -> str | None:
    try:
        return str(UUID(request.headers.get(signing.INSTANCE_HEADER, "")))
    except ValueError:
        return None


class Admission:
    """Pure ASGI middleware, outside api.limits: nothing of the body is read before it lets a request in."""

    def __init__(self, app, engine, max_clock_skew_s: float):
        self.app = app
        self.engine = engine
        self.max_clock_skew_s = max_clock_skew_s
        self.routed_until: dict[str, float] = {}  # only instances found routed: as many as the routes name
        self.known_keys: dict[bytes, tuple[api_keys.ApiKey, float]] = {}  # by the presented key's SHA-256

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            request = Request(scope)
            try:
                refusal = await self._refusal(request)
            except (DBAPIError, PoolTimeout):
                refusal = database_unavailable("the node could not look up who sent the request")
            if refusal is not None:
                return await refusal(scope, receive, send)
        await self.app(scope, receive, send)

    async def _refusal(self, request: Request):
        """A response refusing the request, or None to let it in (with its key in request.state.api_key)."""
        path = request.url.path
        if needs_key(path):
            authorization = request.headers.get("authorization", "")
            if not authorization.lower().startswith(KEY_SCHEME):
                return unauthorized()
            key = await self._key(authorization[len(KEY_SCHEME):].strip())
            if key is None:
                return unauthorized()
            request.state.api_key = key
        elif path.startswith("/transport/"):
            instance = peer_instance(request)
            if instance is None:
                return unknown_peer(f"name your broker_instance in {signing.INSTANCE_HEADER}")
            try:
                signing.check_fresh(request.headers.get(signing.TIMESTAMP_HEADER),
                                    request.headers.get(signing.SIGNATURE_HEADER), self.max_clock_skew_s)
            except signing.BadSignature as refusal:
                return bad_signature(refusal, headers=CLOSE)
            if not await self._is_routed(instance):
                return unknown_peer(f"this node has no route to broker instance {instance}")
            content_type = request.headers.get("content-type")
            if path == signing.BATCHES_PATH and wire.taken_version(content_type) is None:
                return unsupported_wire_version(content_type)
        return None

    async def _key(self, presented: str) -> api_keys.ApiKey | None:
        """The live key presented, looked up in the database at most every KEY_KNOWN_FOR_S; None when unknown."""
        digest = hashlib.sha256(presented.encode()).digest()
        key, known_until = self.known_keys.get(digest, (None, 0.0))
        if known_until > time.monotonic():
            return key
        key = await anyio.to_thread.run_sync(self._verify, presented)
        if key is None:
            self.known_keys.pop(digest, None)
            return None
        if len(self.known_keys) >= KEYS_KEPT:
            self.known_keys.clear()
        self.known_keys[digest] = (key, time.monotonic() + KEY_KNOWN_FOR_S)
        return key

    def _verify(self, presented: str):
        with self.engine.connect() as connection:
            return api_keys.verify(connection, presented)

    async def _is_routed(self, instance: str) -> bool:
        if self.routed_until.get(instance, 0.0) > time.monotonic():
            return True
        if not await anyio.to_thread.run_sync(self._routed, instance):
            return False
        self.routed_until[instance] = time.monotonic() + ROUTED_FOR_S
        return True

    def _routed(self, instance: str) -> bool:
        with self.engine.connect() as connection:
            return connection.execute(queries.QUERIES["peer_is_routed"], {"instance": instance}).scalar_one()
