"""Errors as application/problem+json (RFC 9457), each class with a stable type.

The broker's SQLSTATE classes map one to one onto problem types, so an HTTP
client sees the same classes of mistake a SQL client does; "sqlstate" is kept
as an extension member.
"""
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from broker import errors

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
    detail: str | None = Field(None, examples=["unknown queue 'orders'"])
    sqlstate: str | None = Field(None, examples=["BR004"])
    hint: str | None = None
    expected_sequence_number: int | None = Field(None, description="with sequence-conflict: the number that comes next")


class Problem(Exception):
    """Raised anywhere in a request to answer with a problem."""

    def __init__(self, status: int, kind: str, title: str, detail: str | None = None, headers: dict | None = None,
                 **extensions):
        super().__init__(title)
        self.status, self.kind, self.title, self.detail = status, kind, title, detail
        self.headers, self.extensions = headers, extensions


def problem(status: int, kind: str, title: str, detail: str | None = None, headers: dict | None = None,
            **extensions) -> JSONResponse:
    body = {"type": f"/problems/{kind}", "title": title, "status": status}
    if detail:
        body["detail"] = detail
    body.update({name: value for name, value in extensions.items() if value is not None})
    return JSONResponse(body, status_code=status, media_type="application/problem+json", headers=headers)


def from_problem(error: Problem) -> JSONResponse:
    return problem(error.status, error.kind, error.title, error.detail, error.headers, **error.extensions)


def from_broker_error(error: errors.BrokerError) -> JSONResponse:
    status, kind, title = BY_ERROR_CLASS[type(error)]
    expected = error.expected_sequence_number if isinstance(error, errors.SequenceConflict) else None
    return problem(status, kind, title, error.message, sqlstate=error.sqlstate, hint=error.hint,
                   expected_sequence_number=expected)


# Every /v1 route may answer with these; listed in the OpenAPI document.  A
# lost lock is a 409: the lease is no longer in a state that allows this.
RESPONSES = {status: {"content": {"application/problem+json": {"schema": ProblemDetails.model_json_schema()}},
                      "description": description}
             for status, description in [
                 (400, "Invalid argument"), (401, "No valid API key"), (403, "The key lacks the scope"),
                 (404, "Unknown object"), (409, "Conflict with the current state"),
                 (413, "Request too large"),
                 (422, "Request does not match the schema or the contract"),
                 (503, "The database is unavailable; retry")]}
