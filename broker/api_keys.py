"""API keys for the REST API: created from the CLI, kept as SHA-256 hashes, each with scopes.

A key reads "bk_<key_id>_<secret>". Scopes: "admin" (everything), "send:<service>"
(begin, send on and end that service's conversations), "receive:<queue>" (receive
from that queue and complete or abandon its locks).
"""
import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass

from sqlalchemy import Connection

from broker import queries
from broker.names import NAME_PATTERN

SCOPE = re.compile(rf"admin|(send|receive):{NAME_PATTERN}")
KEY = re.compile(r"bk_([0-9a-f]{12})_([A-Za-z0-9_-]{43})")



@dataclass(frozen=True)
class ApiKey:
    key_id: str
    name: str
    scopes: tuple[str, ...]

    def allows(self, scope: str) -> bool:
        return "admin" in self.scopes or scope in self.scopes


def _sha256(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()


def create(connection: Connection, name: str, scopes: list[str]) -> str:
    """Stores a new key and returns it in full: the only time its secret is shown."""
    bad = [scope for scope in scopes if not SCOPE.fullmatch(scope)]
    if not scopes or bad:
        raise ValueError(f"invalid scope {bad[0]!r}" if bad else "give at least one scope")
    key_id, secret = secrets.token_hex(6), secrets.token_urlsafe(32)
    connection.execute(queries.QUERIES["insert_api_key"], {"key_id": key_id, "name": name,
                                                           "secret_sha256": _sha256(secret), "scopes": scopes})
    return f"bk_{key_id}_{secret}"


def verify(connection: Connection, presented: str) -> ApiKey | None:
    """The live key that presented is, or None."""
    match = KEY.fullmatch(presented)
    if not match:
        return None
    key_id, secret = match.groups()
    row = connection.execute(queries.QUERIES["live_api_key"], {"key_id": key_id}).first()
    if row is None or not hmac.compare_digest(bytes(row.secret_sha256), _sha256(secret)):
        return None
    return ApiKey(key_id, row.name, tuple(row.scopes))


