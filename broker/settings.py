"""One settings object, read from BROKER_* environment variables, for the CLI, Alembic and the API."""
from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from broker.transport import signing


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="BROKER_", use_attribute_docstrings=True)

    database_url: str | None = None
    """A PostgreSQL URL; when unset the broker runs its own embedded server."""
    data_dir: Path = Path.home() / ".broker"
    """Where the embedded server keeps its data: `pgdata`, with its log `pgdata/postgresql.log`."""
    tls_ca_file: Path | None = None
    """The CA bundle the relay trusts for https:// routes (default: the system's)."""
    max_request_bytes: int = Field(32 * 1024 * 1024, gt=0)
    """REST API: the largest request body (413 above it)."""
    max_wait_ms: int = Field(60000, ge=0, le=60000)
    """REST API: the longest a receive may wait for a message."""
    api_connections: int = Field(20, gt=0, le=1000)
    """REST API: the most database connections it holds."""
    api_connection_wait_s: float = Field(2.0, gt=0, le=60)
    """REST API: how long a request waits for a database connection while all are in use, before it is
    answered 503 with Retry-After."""
    request_head_timeout_s: float = Field(10.0, gt=0)
    """HTTP: the longest a client may take to send a request's head (its request line and headers), from the
    connection's opening or the previous response; then the connection is closed."""
    request_timeout_s: float = Field(30.0, gt=0)
    """HTTP: the longest a client let in (a valid key, a routed peer) may then take to send the body; then 408,
    and closed."""
    max_connections: int = Field(1000, gt=0)
    """HTTP: the most connections served at once; then 503."""
    max_batch_bytes: int = Field(64 * 1024 * 1024, gt=0)
    """Transport: the largest batch this node accepts from a peer; larger ones get 413 naming the limit.  Keep it
    above `max_message_bytes` plus a few KB, or the largest messages cannot arrive."""
    relay_batch_messages: int = Field(1000, gt=0)
    """Transport: the most messages the relay puts in one batch."""
    relay_batch_bytes: int = Field(8 * 1024 * 1024, gt=0)
    """Transport: the most bytes of bodies the relay puts in one batch (it learns a smaller limit from a peer that
    refuses a batch as too large)."""
    relay_probe_interval_s: float = Field(60.0, gt=0, le=86400)
    """Transport: how often the relay sends a destination again the last number it acknowledged of a conversation
    it sent to lately, to ask whether it still holds it: a database that went back is found within this long."""
    max_clock_skew_s: float = Field(signing.DEFAULT_MAX_CLOCK_SKEW_S, gt=0, le=86400)
    """Transport: how far a peer's clock may be from this node's before its requests are refused (replays of a
    request are harmless within it: duplicates are discarded); then 401.  Set it alike on both nodes."""
    tracing: Literal["off", "console", "otlp"] = "off"
    """Where `broker serve` and `broker relay` export the spans of each message's journey: `console` (stdout, one
    JSON object a line) or `otlp` (over HTTP to `OTEL_EXPORTER_OTLP_ENDPOINT`, `http://localhost:4318` by
    default); needs the `tracing` extra."""
    jdbc_driver: Path | None = None
    """Spark ingest: the PostgreSQL JDBC driver jar (default: looked for in the usual places)."""

    def tls_ca(self) -> str | None:
        """tls_ca_file as httpx and the relay take it: None for the system's CAs."""
        return str(self.tls_ca_file) if self.tls_ca_file else None

