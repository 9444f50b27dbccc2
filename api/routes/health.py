"""Probes and metrics: /healthz (the process is up), /readyz (database reachable, and its schema serves this
node: at this node's head revision with its functions, or at a later revision that still serves this release),
/metrics (Prometheus text; needs an admin key).

/healthz runs on the event loop and touches no database: it answers at once while every thread and
database connection is busy, so that a node that is only slow is not taken for dead."""
from uuid import UUID

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
from pydantic import BaseModel, Field
from sqlalchemy.exc import DBAPIError

from broker.api.deps import AdminKey, Database
from broker.api.problems import KEYED, error_responses, problem
from broker import __version__, migrate, queries, schema
from broker.transport import wire

router = APIRouter(tags=["operations"])

class Health(BaseModel):
    status: str = Field(examples=["ok"])
    version: str = Field(description="this node's release (pg-broker's version)", examples=["0.2.0"])
    broker_instance: UUID = Field(description="this node's identity, as its peers' routes name it")
    wire_version: int = Field(description="the highest version of the batches this node sends and takes")
    wire_versions: list[int] = Field(description="every version of the batches this node takes and sends: a peer "
                                                 "sends it the highest of these that the peer speaks too")


class Readiness(BaseModel):
    status: str = Field(examples=["ready"])
    schema_revision: str = Field(description="the broker schema's Alembic revision: the head this node needs, or a "
                                             "later one that still serves it (a node upgraded one at a time)")


@router.get("/healthz", summary="Liveness")
async def healthz(request: Request) -> Health:
    return Health(status="ok", version=__version__, broker_instance=request.app.state.broker_instance,
                  wire_version=wire.WIRE_VERSION, wire_versions=list(wire.WIRE_VERSIONS))


@router.get("/readyz", summary="Readiness: the database answers and its schema serves this node",
            response_model=Readiness, responses=error_responses(500, 503))
def readyz(request: Request, db: Database) -> Readiness | Response:
    """Ready at this node's head revision with its function files as they are, or with a later release's functions
    that still serve this node's release (broker.function_release), or at a later revision whose functions still
    serve it (broker.oldest_serving_revision): the database was migrated for the next release, whose revisions only
    add, and this node goes on until it is upgraded."""
    head = request.app.state.schema_head
    try:
        with db.connect() as connection:
            version = connection.execute(queries.QUERIES["schema_revision"]).scalar()
            later = migrate.is_later(version, head)
            functions = schema.applied_function_checksums(connection) if version == head else None
            release = connection.execute(queries.QUERIES["function_release"]).one_or_none() if version == head else None
            oldest_served = queries.call(connection, "oldest_serving_revision").scalar_one() if later else None
    except DBAPIError as error:
        return problem(503, "not-ready", "The database is unreachable", str(error.orig).strip()[:300])
    if later:
        if migrate.is_later(oldest_served, head):
            return problem(503, "not-ready", "The database no longer serves this release",
                           f"the database is at revision {version}, which serves releases from revision "
                           f"{oldest_served} on; this node's release needs {head}: upgrade this node")
        return Readiness(status="ready", schema_revision=version)
    if version != head:
        return problem(503, "not-ready", "The broker schema is not at head",
                       f"the database is at revision {version}, this node needs {head}: run 'broker migrate'")
    if release and schema.is_later_release(release.release, __version__):
        if schema.is_later_release(release.serves_from, __version__):
            return problem(503, "not-ready", "The database no longer serves this release",
                           f"the database holds the functions of release {release.release}, which serve releases "
                           f"from {release.serves_from} on; this node is of release {__version__}: upgrade this node")
        return Readiness(status="ready", schema_revision=version)
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
