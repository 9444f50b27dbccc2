"""Request size limits: a body over the limit gets 413 before any route sees it."""
from collections.abc import Callable

from api.problems import problem


class BodySizeLimit:
    """Pure ASGI middleware: reads the body up to limit_for(path) bytes, then hands it on."""

    def __init__(self, app, limit_for: Callable[[str], int]):
        self.app = app
        self.limit_for = limit_for

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.limit_for(scope["path"])
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > limit:
            return await self._too_large(limit, scope, receive, send)
        messages, size = [], 0
        while True:
            message = await receive()
            messages.append(message)
            size += len(message.get("body", b""))
            if size > limit:
                return await self._too_large(limit, scope, receive, send)
            if message["type"] != "http.request" or not message.get("more_body"):
                break

        async def replay():
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)

    @staticmethod
    async def _too_large(limit: int, scope, receive, send):
        response = problem(413, "too-large", "The request is larger than this node accepts",
                           f"the limit here is {limit} bytes")
        await response(scope, receive, send)
