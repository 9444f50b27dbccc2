"""One settings object, read from BROKER_* environment variables, for the CLI, Alembic and the API."""
from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from broker.transport import signing


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="BROKER_")

    # A PostgreSQL URL; when unset the broker runs its own embedded server.
    database_url: str | None = None
    # Where the embedded server keeps its data (a pgdata folder inside).
    data_dir: Path = Path.home() / ".broker"
    # CA bundle the relay trusts for https:// routes (default: the system's).
    tls_ca_file: Path | None = None
    # REST API: the largest request body, and the longest a receive may wait.
    max_request_bytes: int = Field(32 * 1024 * 1024, gt=0)
    max_wait_ms: int = Field(60000, ge=0, le=60000)
    # REST API: the most database connections it holds, and how long a request waits for one when all are
    # in use before it is answered 503 with Retry-After.
    api_connections: int = Field(20, gt=0, le=1000)
    api_connection_wait_s: float = Field(2.0, gt=0, le=60)
    # HTTP: the longest a client may take to send a request's head (then the connection is closed), and then the
    # body of a request let in (then 408, and closed), and the most connections served at once (then 503).
    request_head_timeout_s: float = Field(10.0, gt=0)
    request_timeout_s: float = Field(30.0, gt=0)
    max_connections: int = Field(1000, gt=0)
    # Transport: the largest batch this node accepts from a peer, and the most messages and bytes its relay
    # puts in one batch (it learns a smaller limit from a peer that refuses a batch as too large).
    max_batch_bytes: int = Field(64 * 1024 * 1024, gt=0)
    relay_batch_messages: int = Field(1000, gt=0)
    relay_batch_bytes: int = Field(8 * 1024 * 1024, gt=0)
    # Transport: how often the relay sends a destination again the last number it acknowledged of a conversation
    # it sent to lately, to ask whether it still holds it (a database that went back is found within this long).
    relay_probe_interval_s: float = Field(60.0, gt=0, le=86400)
    # Transport: how far a peer's clock may be from this node's before its requests are refused (replays of a
    # request are harmless within it: duplicates are discarded).  The same on both nodes, like the secret.
    max_clock_skew_s: float = Field(signing.DEFAULT_MAX_CLOCK_SKEW_S, gt=0, le=86400)
    # Traces (broker/tracing.py): where a node exports its spans, "console" (stdout) or "otlp" (see the
    # OTEL_EXPORTER_OTLP_* variables); needs the tracing extra.
    tracing: Literal["off", "console", "otlp"] = "off"
    # Spark ingest: the PostgreSQL JDBC driver jar (default: looked for, see spark_ingest/jdbc.py).
    jdbc_driver: Path | None = None

    def tls_ca(self) -> str | None:
        """tls_ca_file as httpx and the relay take it: None for the system's CAs."""
        return str(self.tls_ca_file) if self.tls_ca_file else None

