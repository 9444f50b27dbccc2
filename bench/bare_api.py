"""The REST baseline: a bare FastAPI endpoint that does one INSERT and a commit per request, through the pool
and the server a node uses (the same engine settings, uvicorn with the same protocol), and nothing else: no
key, no conversation, no numbering.  `broker bench` runs it beside the node's POST
/v1/conversations/{handle}/messages, a message a request.

    python -m bench.bare_api PORT   (the database in BROKER_DATABASE_URL)
"""
import base64
import os
import sys

import uvicorn
from fastapi import FastAPI
from pydantic import BaseModel
from sqlalchemy import text

from broker.api import connections
from broker.api.main import api_engine
from broker.settings import Settings

CREATE_TABLE = text("CREATE TABLE IF NOT EXISTS bench_bare_messages"
                    " (message_id bigserial PRIMARY KEY, body bytea, enqueued_at timestamptz NOT NULL DEFAULT now())")
INSERT = text("INSERT INTO bench_bare_messages (body) VALUES (:body) RETURNING message_id")


class Message(BaseModel):
    body_base64: str


def create_app(database_url: str, settings: Settings) -> FastAPI:
    engine = api_engine(database_url, settings)
    with engine.begin() as connection:
        connection.execute(CREATE_TABLE)
    app = FastAPI()

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"status": "ok"}

    @app.post("/messages")
    def insert(message: Message) -> dict:
        with engine.begin() as connection:
            return {"message_id": connection.execute(INSERT, {"body": base64.b64decode(message.body_base64)})
                    .scalar_one()}

    return app


def main() -> None:
    settings = Settings()
    uvicorn.run(create_app(os.environ["BROKER_DATABASE_URL"], settings), host="127.0.0.1", port=int(sys.argv[1]),
                log_level="warning", http=connections.protocol(settings.request_head_timeout_s),
                limit_concurrency=settings.max_connections)


if __name__ == "__main__":
    main()
