"""Message bodies in JSON: a JSON value travels as "body", anything else as "body_base64"."""
import base64
import json
from typing import Any

from broker.api.problems import Problem


def encode(body: Any, body_base64: str | None) -> bytes | None:
    """The bytes to store for a request's body or body_base64 (at most one of them)."""
    if body is not None and body_base64 is not None:
        raise Problem(422, "invalid-request", "Give body or body_base64, not both",
                      "body carries a JSON value, body_base64 any bytes; a message has one body")
    if body_base64 is not None:
        try:
            return base64.b64decode(body_base64, validate=True)
        except ValueError as error:  # binascii.Error, or characters outside ASCII
            raise Problem(422, "invalid-request", "body_base64 is not valid base64", str(error)) from error
    return None if body is None else json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()


def json_text(stored: bytes) -> str | None:
    """The stored bytes as JSON text to send on as they are, or None when they are not UTF-8 JSON that every
    parser takes.  Checked by parsing, but never serialised again: a body goes out as it came in, at any
    depth, without a second copy of its values."""
    try:
        text = stored.decode()
        json.loads(text, object_pairs_hook=_nothing, parse_int=_nothing, parse_float=_nothing,
                   parse_constant=_not_json)
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    return text


def _nothing(_value) -> None:
    """Parsed, and dropped at once: the check keeps no object's members and no number."""


def _not_json(constant: str):
    raise ValueError(f"{constant} is not JSON")  # NaN, Infinity and -Infinity, which Python's parser takes


def as_members(stored: bytes | None) -> str:
    """A body as the members "body" and "body_base64" of a JSON object, without its braces."""
    text = None if stored is None else json_text(stored)
    if stored is None or text is not None:
        return f'"body":{text or "null"},"body_base64":null'
    return f'"body":null,"body_base64":"{base64.b64encode(stored).decode()}"'
