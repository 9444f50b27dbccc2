"""Request limits: a body over the size limit gets 413, one that does not come in time 408, and a /v1
JSON body nested too deep or holding too many values 422, before any route sees it (and so before
FastAPI builds its Python objects).  A body sent to a path that no route serves gets 404 before it is
read: a peer whose route has a path prefix that reaches the node itself learns that its address is
wrong, not that its batches are too large."""
import asyncio
import logging
import re
from collections.abc import Callable
from itertools import accumulate

import anyio

from broker.api.admission import needs_key
from broker.api.problems import CLOSE, problem

log = logging.getLogger(__name__)
# What a JSON request may hold: as deep as most parsers take (System.Text.Json's default), and values enough
# for any message meant as JSON; larger documents travel as body_base64.
MAX_JSON_DEPTH = 64
MAX_JSON_VALUES = 100_000
ESCAPE = re.compile(rb"\\.", re.DOTALL)
STRING = re.compile(rb'"[^"]*"')
NOT_A_BRACKET = bytes(sorted(set(range(256)) - set(b"[]{}")))


class RequestLimits:
    """Pure ASGI middleware: reads the body up to limit_for(path) bytes within timeout_s, then hands it on;
    served(scope) says whether a route serves the request's path."""

    def __init__(self, app, limit_for: Callable[[str], int], served: Callable[[dict], bool], timeout_s: float):
        self.app = app
        self.limit_for = limit_for
        self.served = served
        self.timeout_s = timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.limit_for(scope["path"])
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if limit == 0 and declared not in (b"", b"0") and not self.served(scope):
            return await problem(404, "http-error", "Not Found",
                                 f"this node serves no {scope['method']} {scope['path'][:200]!r}: check the address "
                                 "the request was sent to (a route's path prefix needs a proxy in front of the node "
                                 "that takes it away)", headers=CLOSE)(scope, receive, send)
        if declared.isdigit() and int(declared) > limit:
            return await self._too_large(limit, scope, receive, send)
        messages, size = [], 0
        deadline = asyncio.get_running_loop().time() + self.timeout_s
        while True:
            try:
                message = await asyncio.wait_for(receive(), deadline - asyncio.get_running_loop().time())
            except TimeoutError:
                log.warning("%s %r: the request body did not come within %s s (%d bytes came)",
                            scope["method"], scope["path"], self.timeout_s, size)
                return await problem(408, "request-timeout", "The request did not come in time",
                                     f"a request's body must arrive within {self.timeout_s} s here",
                                     headers=CLOSE)(scope, receive, send)
            messages.append(message)
            size += len(message.get("body", b""))
            if size > limit:
                return await self._too_large(limit, scope, receive, send)
            if message["type"] == "http.disconnect":
                # An ordinary network event (a client gone, a connection cut): nothing to answer.
                log.warning("%s %r: the client went away before its request body ended (%d bytes came)",
                            scope["method"], scope["path"], size)
                return
            if not message.get("more_body"):
                break

        body = b"".join(message.get("body", b"") for message in messages)
        messages = [{"type": "http.request", "body": body, "more_body": False}]  # one copy of the body, not two
        if needs_key(scope["path"]) and _may_hold_too_much(body):
            refusal = await anyio.to_thread.run_sync(json_refusal, body)
            if refusal:
                return await problem(422, "invalid-request", "The request does not match the schema",
                                     refusal)(scope, receive, send)

        async def replay():
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)

    @staticmethod
    async def _too_large(limit: int, scope, receive, send):
        """413 with the limit as an extension member, so that a sender can learn it."""
        response = problem(413, "too-large", "The request is larger than this node accepts",
                           f"the limit here is {limit} bytes", headers=CLOSE, limit_bytes=limit)
        await response(scope, receive, send)


def _may_hold_too_much(body: bytes) -> bool:
    """A bound counted at memory speed: every bracket and comma, in strings or not."""
    containers = body.count(b"[") + body.count(b"{")
    return containers > MAX_JSON_DEPTH or containers + body.count(b",") >= MAX_JSON_VALUES


def json_refusal(body: bytes) -> str | None:
    """Why a JSON text holds too much, counted on its bytes with its strings left out; None when it does not."""
    bare = STRING.sub(b"", ESCAPE.sub(b"", body))
    brackets = bare.translate(None, delete=NOT_A_BRACKET)
    depth = max(accumulate(1 if bracket in b"[{" else -1 for bracket in brackets), default=0)
    if depth > MAX_JSON_DEPTH:
        return f"the JSON is nested {depth} levels deep; at most {MAX_JSON_DEPTH} are taken"
    values = len(brackets) // 2 + bare.count(b",") + 1
    if values > MAX_JSON_VALUES:
        return (f"the JSON holds {values} values; at most {MAX_JSON_VALUES} are taken: send a larger document "
                "as body_base64")
    return None
