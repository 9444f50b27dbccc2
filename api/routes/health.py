"""Probes and metrics: /healthz (the process is up), /readyz (database reachable, schema at head and its
functions this node's),
/metrics (Prometheus text; needs an admin key).

/healthz runs on the event loop and touches no database: it answers at once while every thread and
database connection is busy, so that a node that is only slow is not taken for dead."""
from uuid import UUID

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
from pydantic import BaseModel, Field
from sqlalchemy.exc import DBAPIError

from api.deps import AdminKey, Database
from api.problems import KEYED, error_responses, problem
from broker import queries, schema
from broker.transport import wire

router = APIRouter(tags=["operations"])

class Health(BaseModel):
    status: str = Field(examples=["ok"])
    broker_instance: UUID = Field(description="this node's identity, as its peers' routes name it")
    wire_version: int = Field(description="the version of the batches this node sends and takes")


class Readiness(BaseModel):
    status: str = Field(examples=["ready"])
    schema_revision: str = Field(description="the broker schema's Alembic revision, the head this node needs")


@router.get("/healthz", summary="Liveness")
async def healthz(request: Request) -> Health:
    return Health(status="ok", broker_instance=request.app.state.broker_instance, wire_version=wire.WIRE_VERSION)


@router.get("/readyz", summary="Readiness: the database answers and its schema is at head",
            response_model=Readiness, responses=error_responses(500, 503))
def readyz(request: Request, db: Database) -> Readiness | Response:
    head = request.app.state.schema_head
    try:
        with db.connect() as connection:
            version = queries.schema_revision(connection)
            functions = schema.applied_function_checksums(connection) if version == head else None
    except DBAPIError as error:
        return problem(503, "not-ready", "The database is unreachable", str(error.orig).strip()[:300])
    if version != head:
        return problem(503, "not-ready", "The broker schema is not at head",
                       f"the database is at revision {version}, this node needs {head}: run 'broker migrate'")
    ours = request.app.state.function_checksums
    differing = sorted(name for name in ours if ours[name] != functions.get(name))
    if differing:
        return problem(503, "not-ready", "The broker schema's functions are not this node's",
                       f"the database holds other versions of {', '.join(differing)}: run 'broker migrate'")
    return Readiness(status="ready", schema_revision=version)


@router.get("/metrics", summary="Prometheus metrics", response_class=Response,
            responses={200: {"content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}}},
                       **error_responses(*KEYED)})
def metrics(request: Request, key: AdminKey) -> Response:
    exposition = generate_latest(REGISTRY) + generate_latest(request.app.state.database_metrics)
    return Response(exposition, media_type=CONTENT_TYPE_LATEST)
