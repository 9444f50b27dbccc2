"""Request limits: a body over the size limit gets 413, and one that does not come in time 408, before
any route sees it."""
import asyncio
import logging
from collections.abc import Callable

from api.problems import problem

log = logging.getLogger(__name__)
# A request refused before its body was read: the connection cannot carry another, so it ends.
CLOSE = {"Connection": "close"}


class RequestLimits:
    """Pure ASGI middleware: reads the body up to limit_for(path) bytes within timeout_s, then hands it on."""

    def __init__(self, app, limit_for: Callable[[str], int], timeout_s: float):
        self.app = app
        self.limit_for = limit_for
        self.timeout_s = timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.limit_for(scope["path"])
        declared = dict(scope["headers"]).get(b"content-length", b"")
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

        async def replay():
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)

    @staticmethod
    async def _too_large(limit: int, scope, receive, send):
        """413 with the limit as an extension member, so that a sender can learn it."""
        response = problem(413, "too-large", "The request is larger than this node accepts",
                           f"the limit here is {limit} bytes", headers=CLOSE, limit_bytes=limit)
        await response(scope, receive, send)
