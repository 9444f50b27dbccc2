"""The web console at /console (a static page, no build step) and what it shows: GET /v1/status, and
GET /v1/diagnose, the findings of `broker diagnose`."""
import base64
import hashlib
import re
from dataclasses import asdict
from datetime import datetime
from importlib import resources
from typing import Any, Literal
from uuid import UUID

from fastapi import APIRouter, Depends, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import HTMLResponse
from prometheus_client import Counter
from pydantic import BaseModel, Field

from broker.api.auth import require
from broker.api.deps import AdminKey, Database, Key, NodeSettings
from broker.api.problems import KEYED, error_responses
from broker.api.routes.queues import QueueStatus
from broker.api.types import known_query_parameters
from broker.diagnose import diagnose
from broker.status import node_status
from broker.metrics import RELAY_ACKNOWLEDGED, RELAY_FAILURES, RELAY_SENT
from broker.transport.addresses import client_for_peers

router = APIRouter()
CONSOLE_PAGE = resources.files("broker.api").joinpath("console.html").read_text()


def _inline_source(tag: str) -> str:
    """The page's one inline <script> or <style>, allowed by its hash and nothing else."""
    content = re.search(rf"<{tag}>(.*?)</{tag}>", CONSOLE_PAGE, re.S).group(1)
    return f"'sha256-{base64.b64encode(hashlib.sha256(content.encode()).digest()).decode()}'"


# The page runs its own script and talks to this node alone; no other page may frame it.
CONSOLE_HEADERS = {
    "Content-Security-Policy": f"default-src 'none'; script-src {_inline_source('script')}; "
                               f"style-src {_inline_source('style')}; connect-src 'self'; base-uri 'none'; "
                               "form-action 'none'; frame-ancestors 'none'",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


class Activation(BaseModel):
    """A queue's activated procedure (broker.activation_status): its readers now, and what its calls did."""

    queue_name: str
    procedure_name: str
    status: Literal["on", "off"]
    max_queue_readers: int
    execute_as: str
    readers: int
    activations: int
    failures: int
    last_failure: str | None
    last_failure_at: datetime | None


class EndpointCount(BaseModel):
    """The conversation endpoints of a service in one state."""

    service_name: str
    state: str
    endpoints: int
    oldest_created_at: datetime
    without_lifetime: int


class Backlog(BaseModel):
    """What waits in the transmission queue for one destination, and why (the status of its oldest message)."""

    destination: str
    messages: int
    conversations: int
    oldest_message_age_s: float
    attempts: int
    next_attempt_at: datetime
    status: str


class Ingest(BaseModel):
    """A Spark ingest's checkpoint, and its lag: the messages above the checkpoint and the oldest one's age."""

    queue_name: str
    output: str
    queue_position: int
    last_run: str | None
    rows_ingested: int
    runs: int
    updated_at: datetime
    lag_messages: int
    lag_s: float


class DeadLetter(BaseModel):
    queue_name: str
    conversation_id: UUID
    conversation_handle: UUID = Field(description="the quarantined side in this queue: resubmit with it")
    message_sequence_number: int
    message_type: str
    reason: str
    dead_lettered_at: datetime


class LostMessages(BaseModel):
    """Numbers of a conversation that a database going back to an earlier point lost (broker.lost_messages)."""

    conversation_id: UUID
    conversation_handle: UUID | None
    far_service: str
    far_broker_instance: UUID
    direction: Literal["received", "sent"]
    first_number: int
    last_number: int
    outcome: Literal["missing", "resent", "renumbered", "lost", "withheld"]
    found_at: datetime
    explanation: str


class RelayTotals(BaseModel):
    """The relay's counters in this process since it started."""

    sent_total: float
    acknowledged_total: float
    failures_total: float


class NodeStatus(BaseModel):
    version: str = Field(description="this node's release (pg-broker's version)")
    schema_revision: str | None = Field(description="the broker schema's Alembic revision")
    queues: list[QueueStatus]
    activation: list[Activation]
    conversations: list[EndpointCount]
    transmission_queue: list[Backlog]
    ingests: list[Ingest]
    dead_letters: list[DeadLetter]
    lost_messages: list[LostMessages]
    relay: RelayTotals


def _total(counter: Counter) -> float:
    return sum(sample.value for metric in counter.collect() for sample in metric.samples
               if sample.name.endswith("_total"))


@router.get("/v1/status", tags=["catalog"], responses=error_responses(*KEYED),
            dependencies=[Depends(known_query_parameters)], summary="What the node is doing: queues, activation, endpoints, transmission queue, ingests, dead letters, lost messages, relay")
async def get_status(key: AdminKey, db: Database) -> NodeStatus:
    def read() -> dict[str, Any]:
        with db.connect() as connection:
            return node_status(connection)

    report = await run_in_threadpool(read)
    relay = RelayTotals(sent_total=_total(RELAY_SENT), acknowledged_total=_total(RELAY_ACKNOWLEDGED),
                        failures_total=_total(RELAY_FAILURES))
    return NodeStatus(**report, relay=relay)


class Finding(BaseModel):
    """One check of `broker diagnose`, and what to do when it is not ok."""

    level: Literal["ok", "warning", "error"]
    check: str
    finding: str
    advice: str


@router.get("/v1/diagnose", tags=["catalog"], responses=error_responses(422, *KEYED),
            dependencies=[Depends(known_query_parameters)],
            summary="The findings of `broker diagnose`: this node's configuration, its relay and every peer")
async def get_diagnose(request: Request, key: Key, db: Database, settings: NodeSettings,
                       max_wait_s: float = Query(300.0, ge=0, le=10**9, description=(
                           "a message waiting longer than this for its destination node is an error"))
                       ) -> list[Finding]:
    require(key, "admin")

    def run() -> list[Finding]:
        with db.connect() as connection, client_for_peers(connection, 10, settings.tls_ca() or True) as client:
            findings = diagnose(connection, client, request.app.state.schema_head, max_wait_s=max_wait_s,
                                max_clock_skew_s=settings.max_clock_skew_s)
        return [Finding(**asdict(finding)) for finding in findings]

    return await run_in_threadpool(run)


@router.get("/console", include_in_schema=False, response_class=HTMLResponse)
def console() -> HTMLResponse:
    return HTMLResponse(CONSOLE_PAGE, headers=CONSOLE_HEADERS)
