"""The node's HTTP application: the /v1 REST API, the node-to-node transport, probes and metrics."""
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from prometheus_client import CollectorRegistry
from sqlalchemy import create_engine, text
from sqlalchemy.exc import DataError, DBAPIError, OperationalError
from starlette.exceptions import HTTPException

from api.arrivals import Arrivals
from api.limits import BodySizeLimit
from api.problems import Problem, from_broker_error, from_problem, problem
from api.routes import catalog, console, conversations, health, queues, transport
from broker import migrate
from broker.errors import BrokerError
from broker.metrics import DatabaseCollector

DESCRIPTION = """
Exactly-once-in-order conversations between services, over HTTP.

* Authenticate with `Authorization: Bearer <key>`; keys come from `broker keys create` with scopes
  `admin`, `send:<service>` and `receive:<queue>`.
* **Exactly-once sending**: give each message its `sequence_number` (1, 2, 3, … per conversation)
  and retry freely after a timeout: the same number with the same content is stored once.
* **Exactly-once processing**: receive under a lock, apply each message in your own transaction
  together with the last `sequence_number` applied per `conversation_id`, skip what you applied
  already, then complete the lock. A crash before completing hands the messages out again.
* Errors are `application/problem+json` with a stable `type`.
"""


def create_app(database_url: str, *, max_request_bytes: int = 32 * 1024 * 1024,
               max_batch_bytes: int = 64 * 1024 * 1024, max_wait_ms: int = 60000) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        app.state.arrivals.close()
        app.state.engine.dispose()

    app = FastAPI(title="pg-broker node", version="0.1.0", description=DESCRIPTION, lifespan=lifespan)
    app.state.engine = create_engine(database_url, pool_size=16, max_overflow=16, pool_pre_ping=True)
    app.state.max_wait_ms = max_wait_ms
    app.state.arrivals = Arrivals(database_url)
    app.state.schema_head = migrate.head_revision()
    app.state.database_metrics = CollectorRegistry()
    app.state.database_metrics.register(DatabaseCollector(app.state.engine))
    with app.state.engine.connect() as connection:
        app.state.broker_instance = str(connection.execute(
            text("SELECT broker_instance FROM broker.node")).scalar_one())
    for router in (conversations.router, queues.router, catalog.router, health.router, transport.router,
                   console.router):
        app.include_router(router)
    app.add_middleware(BodySizeLimit, limit_for=lambda path: max_batch_bytes if path.startswith("/transport/")
                       else max_request_bytes)

    @app.exception_handler(Problem)
    async def raised_problem(request: Request, error: Problem):
        return from_problem(error)

    @app.exception_handler(BrokerError)
    async def broker_problem(request: Request, error: BrokerError):
        return from_broker_error(error)

    @app.exception_handler(DBAPIError)
    async def database_problem(request: Request, error: DBAPIError):
        if isinstance(error, DataError):  # a value PostgreSQL cannot take, e.g. out of its range
            return problem(400, "invalid-argument", "An argument is out of range or malformed",
                           str(error.orig).strip().splitlines()[0])
        if error.connection_invalidated or isinstance(error, OperationalError):  # lost, timed out, deadlocked
            return problem(503, "database-unavailable", "The database could not do it now; nothing was applied",
                           headers={"Retry-After": "1"})
        return problem(500, "internal-error", "The node could not handle the request; it was not applied")

    @app.exception_handler(HTTPException)
    async def http_problem(request: Request, error: HTTPException):
        return problem(error.status_code, "http-error", str(error.detail), headers=error.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_problem(request: Request, error: RequestValidationError):
        return problem(422, "invalid-request", "The request does not match the schema",
                       "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors()[:5]))

    @app.exception_handler(Exception)
    async def internal_problem(request: Request, error: Exception):
        return problem(500, "internal-error", "The node could not handle the request; it was not applied")

    return app
