"""The node's HTTP application: the /v1 REST API, the node-to-node transport, probes and metrics."""
from contextlib import asynccontextmanager
from http import HTTPStatus

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from prometheus_client import CollectorRegistry
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.exc import DataError, DBAPIError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.exceptions import HTTPException
from starlette.routing import Match

from broker.api.admission import Admission, needs_key
from broker.api.arrivals import Arrivals
from broker.api.limits import RequestLimits
from broker.api.problems import (InternalErrors, Problem, ProblemDetails, database_unavailable, from_broker_error,
                          from_problem, internal_error, problem)
from broker.api.routes import catalog, console, conversations, health, queues, transport
from broker import __version__, migrate, queries, schema
from broker.settings import Settings
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

# A database that does not answer a connection attempt within this long is unavailable (503).
CONNECT_TIMEOUT_S = 5


def create_app(database_url: str, settings: Settings) -> FastAPI:
    """The node's application on database_url, configured by settings (read once, where the node starts; the
    routes take them as api.deps.NodeSettings)."""
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        # Routes that use the database run in threads: twice as many threads as connections lets as many
        # requests wait for a connection (and be answered 503 in time) as use one.
        limiter = anyio.to_thread.current_default_thread_limiter()
        limiter.total_tokens = max(limiter.total_tokens, 2 * settings.api_connections)
        yield
        app.state.arrivals.close()
        app.state.engine.dispose()

    app = FastAPI(title="pg-broker node", version=__version__, description=DESCRIPTION, lifespan=lifespan,
                  generate_unique_id_function=_operation_id)
    app.openapi = lambda: _openapi(app)
    app.state.engine = api_engine(database_url, settings)
    app.state.settings = settings
    app.state.arrivals = Arrivals(database_url)
    app.state.schema_head = migrate.head_revision()
    app.state.function_checksums = schema.function_checksums()
    app.state.database_metrics = CollectorRegistry()
    app.state.database_metrics.register(DatabaseCollector(app.state.engine))
    with app.state.engine.connect() as connection:
        app.state.broker_instance = queries.broker_instance(connection)
    for router in (conversations.router, conversations.messages_router, queues.router, catalog.router, health.router,
                   transport.router, console.router):
        app.include_router(router)
    app.add_middleware(RequestLimits, limit_for=lambda path: body_limit(settings, path),
                       served=lambda scope: _serves(app, scope), timeout_s=settings.request_timeout_s)
    # outside RequestLimits: before the body is read
    app.add_middleware(Admission, engine=app.state.engine, max_clock_skew_s=settings.max_clock_skew_s)
    app.add_middleware(InternalErrors)

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
            return database_unavailable()
        return internal_error(request.method, request.url.path, error)

    @app.exception_handler(PoolTimeout)
    async def no_connection_free(request: Request, error: PoolTimeout):
        return database_unavailable(f"all {settings.api_connections} of the node's database connections are in use")

    @app.exception_handler(HTTPException)
    async def http_problem(request: Request, error: HTTPException):
        """Starlette's own refusals: no such route, a method the route does not take. Starlette's Allow names
        the methods of the first route at the path only; a path served by several routes allows them all."""
        where = f"{request.method} {request.url.path}"
        headers = error.headers
        if error.status_code == 405:
            headers = {**(headers or {}), "Allow": _methods_at(app, request)}
        detail = {404: f"this node serves no {where}",
                  405: f"{where} is not served; {request.url.path} takes {(headers or {}).get('Allow')}"
                  }.get(error.status_code, f"{where}: {error.detail}")
        return problem(error.status_code, "http-error", HTTPStatus(error.status_code).phrase, detail,
                       headers=headers)

    @app.exception_handler(UnicodeEncodeError)
    async def unstorable_text(request: Request, error: UnicodeEncodeError):
        """Text that JSON can carry but UTF-8 cannot (a lone surrogate such as \\ud800), found as it is stored."""
        return problem(422, "invalid-request", "The request does not match the schema",
                       "the request holds text that is not valid Unicode (a lone surrogate such as \\ud800); "
                       "nothing was applied")

    @app.exception_handler(RequestValidationError)
    async def validation_problem(request: Request, error: RequestValidationError):
        return problem(422, "invalid-request", "The request does not match the schema",
                       "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors()[:5]))

    return app


def _serves(app: FastAPI, scope: dict) -> bool:
    """Whether a route serves the request's path, with any method."""
    return any(route.matches(scope)[0] != Match.NONE for route in app.router.routes)


def _methods_at(app: FastAPI, request: Request) -> str:
    """The methods of every route whose path matches the request's."""
    methods = {method for route in app.router.routes if route.matches(request.scope)[0] != Match.NONE
               for method in getattr(route, "methods", None) or ()}
    return ", ".join(sorted(methods))


def _operation_id(route: APIRoute) -> str:
    """A route's operationId is its function's name (send_message), which generated clients name their calls by;
    FastAPI's default adds the path and method (send_message_v1_conversations_conversation_handle_messages_post)."""
    return route.name


def body_limit(settings: Settings, path: str) -> int:
    """The most bytes of body a request to path may send: a peer's batch, a request with an API key, and none
    to a route that needs neither (probes, the console page, the OpenAPI document take no body), so that the
    node reads no body from a client that has not been let in (api.admission)."""
    if path.startswith("/transport/"):
        return settings.max_batch_bytes
    return settings.max_request_bytes if needs_key(path) else 0


def _openapi(app: FastAPI) -> dict:
    """FastAPI's document, with the ProblemDetails schema that every error response refers to
    (api.problems.error_responses)."""
    if app.openapi_schema is None:
        FastAPI.openapi(app)["components"]["schemas"]["ProblemDetails"] = ProblemDetails.model_json_schema()
    return app.openapi_schema


def api_engine(database_url: str, settings: Settings) -> Engine:
    """The pool the API's requests share.  Statement parameters stay out of error messages (and so out of the
    log): they hold message bodies."""
    engine = create_engine(database_url, pool_size=settings.api_connections, max_overflow=0,
                           pool_timeout=settings.api_connection_wait_s, pool_pre_ping=True, hide_parameters=True,
                           connect_args={"connect_timeout": CONNECT_TIMEOUT_S})
    event.listen(engine, "connect", _limit_lock_waits)
    return engine


def _limit_lock_waits(dbapi_connection, _record) -> None:
    with dbapi_connection.cursor() as cursor:
        cursor.execute(queries.QUERIES["limit_lock_waits"].text)
    dbapi_connection.commit()
