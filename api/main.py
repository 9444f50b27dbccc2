"""The node's HTTP application: health checks and the node-to-node transport."""
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from sqlalchemy import create_engine, text
from starlette.exceptions import HTTPException

from api.problems import problem
from api.routes import transport


def create_app(database_url: str, *, max_batch_bytes: int = 64 * 1024 * 1024) -> FastAPI:
    app = FastAPI(title="pg-broker node", version="0.1.0")
    app.state.engine = create_engine(database_url, pool_size=8, pool_pre_ping=True)
    app.state.max_batch_bytes = max_batch_bytes
    with app.state.engine.connect() as connection:
        app.state.broker_instance = str(connection.execute(
            text("SELECT broker_instance FROM broker.node")).scalar_one())
    app.include_router(transport.router)

    @app.get("/healthz")
    def healthz() -> dict:
        return {"status": "ok", "broker_instance": app.state.broker_instance}

    @app.exception_handler(HTTPException)
    async def http_problem(request: Request, error: HTTPException):
        return problem(error.status_code, "http-error", str(error.detail))

    @app.exception_handler(RequestValidationError)
    async def validation_problem(request: Request, error: RequestValidationError):
        return problem(422, "invalid-request", "the request does not match the schema", str(error.errors()[:3]))

    @app.exception_handler(Exception)
    async def internal_problem(request: Request, error: Exception):
        return problem(500, "internal-error", "the node could not handle the request; it was not applied")

    return app
