"""Message bodies in JSON: a JSON value travels as "body", anything else as "body_base64"."""
import base64
import json
from typing import Any

from api.problems import Problem


def encode(body: Any, body_base64: str | None) -> bytes | None:
    """The bytes to store for a request's body or body_base64 (at most one of them)."""
    if body is not None and body_base64 is not None:
        raise Problem(422, "invalid-request", "Give body or body_base64, not both")
    if body_base64 is not None:
        try:
            return base64.b64decode(body_base64, validate=True)
        except ValueError as error:  # binascii.Error, or characters outside ASCII
            raise Problem(422, "invalid-request", "body_base64 is not valid base64", str(error)) from error
    return None if body is None else json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()


def decode(stored: bytes | None) -> dict[str, Any]:
    """{"body": value} when the stored bytes are UTF-8 JSON, else {"body_base64": ...}."""
    if stored is None:
        return {"body": None, "body_base64": None}
    try:
        return {"body": json.loads(stored.decode()), "body_base64": None}
    except (UnicodeDecodeError, ValueError):
        return {"body": None, "body_base64": base64.b64encode(stored).decode()}
