"""Errors as application/problem+json (RFC 9457), each class with a stable type.

The broker's SQLSTATE classes map one to one onto problem types, so an HTTP
client sees the same classes of mistake a SQL client does; "sqlstate" is kept
as an extension member.  A failure of the node itself answers 500 and is logged
with its traceback.
"""
import logging
import traceback
from typing import Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from broker import errors
from broker.masking import mask_passwords

log = logging.getLogger(__name__)
# A request refused before its body was read: the connection cannot carry another, so it ends.
CLOSE = {"Connection": "close"}
PROBLEM_JSON = "application/problem+json"

# status, type, title
BY_ERROR_CLASS: dict[type[errors.BrokerError], tuple[int, str, str]] = {
    errors.UnknownObject: (404, "unknown-object", "No such object"),
    errors.NotAllowed: (422, "not-allowed", "The contract does not allow this"),
    errors.ValidationFailed: (422, "validation-failed", "The body fails its message type's validation"),
    errors.ConversationClosed: (409, "conversation-state", "The conversation's state does not allow this"),
    errors.SequenceConflict: (409, "sequence-conflict", "The sequence number is out of turn or reused"),
    errors.QueueDisabled: (409, "queue-disabled", "The queue is disabled"),
    errors.AlreadyExists: (409, "already-exists", "The name is taken"),
    errors.InUse: (409, "in-use", "The object is still in use"),
    errors.InvalidArgument: (400, "invalid-argument", "An argument is missing, out of range or malformed"),
    errors.MessageTooLarge: (413, "too-large", "The message is larger than the node accepts"),
    errors.LockLost: (409, "lock-lost", "The lock expired, was completed or abandoned, or never existed"),
}


class ProblemDetails(BaseModel):
    """An RFC 9457 problem: "type" names the class of mistake and never changes."""

    type: str = Field(examples=["/problems/unknown-object"])
    title: str = Field(examples=["No such object"])
    status: int = Field(examples=[404])
    detail: str = Field(examples=["unknown queue 'orders'"], description="what happened in this case, in words")
    sqlstate: str | None = Field(None, examples=["BR004"])
    hint: str | None = None
    expected_sequence_number: int | None = Field(None, description="with sequence-conflict: the number that comes next")
    limit_bytes: int | None = Field(None, description="with too-large for a request: the node's limit")
    reason: Literal["expired", "completed", "abandoned", "purged", "dead_lettered", "unknown"] | None = Field(
        None, description="with lock-lost: why the lock was lost (unknown: it never existed, or ended more than an "
                          "hour ago)")


class Problem(Exception):
    """Raised anywhere in a request to answer with a problem."""

    def __init__(self, status: int, kind: str, title: str, detail: str, headers: dict | None = None, **extensions):
        super().__init__(title)
        self.status, self.kind, self.title, self.detail = status, kind, title, detail
        self.headers, self.extensions = headers, extensions


def problem(status: int, kind: str, title: str, detail: str, headers: dict | None = None,
            **extensions) -> JSONResponse:
    """The response for a problem: every one says in its detail what happened in this case."""
    body = {"type": f"/problems/{kind}", "title": title, "status": status, "detail": detail}
    body.update({name: value for name, value in extensions.items() if value is not None})
    return JSONResponse(body, status_code=status, media_type=PROBLEM_JSON, headers=headers)


def database_unavailable(detail: str = "the node lost its database connection, or a statement timed out or "
                                        "deadlocked; retry") -> JSONResponse:
    """503 with Retry-After: the database could not do it now, and nothing was applied."""
    return problem(503, "database-unavailable", "The database could not do it now; nothing was applied", detail,
                   headers={"Retry-After": "1"})


def from_problem(error: Problem) -> JSONResponse:
    return problem(error.status, error.kind, error.title, error.detail, error.headers, **error.extensions)


def from_broker_error(error: errors.BrokerError) -> JSONResponse:
    status, kind, title = BY_ERROR_CLASS[type(error)]
    expected = error.expected_sequence_number if isinstance(error, errors.SequenceConflict) else None
    reason = error.reason if isinstance(error, errors.LockLost) else None
    return problem(status, kind, title, error.message, sqlstate=error.sqlstate, hint=error.hint,
                   expected_sequence_number=expected, reason=reason)


def internal_error(method: str, path: str, error: Exception) -> JSONResponse:
    """The 500 for a request the node failed, logged with its traceback: the frames without their local
    variables, and passwords masked."""
    trace = "".join(traceback.format_exception(error))
    log.error("%s %s answered 500: %s", method, path, mask_passwords(trace))
    return problem(500, "internal-error", "The node could not handle the request; it was not applied",
                   "the node's log tells what failed; retrying may not help")


class InternalErrors:
    """Pure ASGI middleware: an exception that no handler turned into a response answers 500 (while the
    response has not begun) and is logged once, by internal_error."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        responding = False

        async def send_noting_the_start(message):
            nonlocal responding
            responding = responding or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_noting_the_start)
        except Exception as error:
            response = internal_error(scope["method"], scope["path"], error)
            if not responding:
                await response(scope, receive, send)


# What each error status means in the OpenAPI document; every one answers a ProblemDetails.
ERRORS = {
    400: "An argument the broker refuses, or a body that is not JSON", 401: "No valid API key",
    403: "The key lacks the scope",
    404: "Unknown object", 408: "The request body did not come in time",
    409: "Conflict with the current state (a lost lock is one: the lease no longer allows this)",
    413: "Request too large", 422: "Request does not match the schema or the contract",
    500: "The node failed; nothing was applied", 503: "The database is unavailable; retry",
}
# What every route with an API key may answer: no valid key (before the body is read), a key without the scope,
# a failure of the node, the database unavailable.
KEYED = (401, 403, 500, 503)
# What a route that reads a body may answer besides: the body not JSON, too slow, too large, or off the schema.
READS_BODY = (400, 408, 413, 422)


def error_responses(*statuses: int) -> dict[int, dict]:
    """An operation's documented errors, each referring to the one ProblemDetails schema (a component that
    api.main adds to the document), so that a generated client parses every one into the same model."""
    schema = {"$ref": "#/components/schemas/ProblemDetails"}
    return {status: {"description": ERRORS[status], "content": {PROBLEM_JSON: {"schema": schema}}}
            for status in statuses}
