"""Bare FastAPI endpoints through the pool and the server a node uses (the same engine settings, uvicorn with the
same protocol), doing nothing else than what they say:

- POST /messages, the REST baseline: one INSERT and a commit per request; no key, no conversation, no numbering.
  `broker bench` runs it beside the node's POST /v1/conversations/{handle}/messages, a message a request.
- POST /batches, the receiving end of the numbered relay over HTTP (bench.cross_node): a batch of bench_outbox
  rows in PostgreSQL's binary COPY format, signed with HMAC-SHA256, copied into a temporary table and stored in
  bench_inbox, each conversation's row of bench_received moved on where the batch's numbers come next, in one
  transaction; the answer, signed, is each conversation's last number.  A batch with a conversation whose numbers
  do not come next is refused whole (409), as the relay never sends one.

    python -m bench.bare_api PORT   (the database in BROKER_DATABASE_URL)
"""
import base64
import io
import os
import sys

import uvicorn
from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response
from pydantic import BaseModel
from sqlalchemy import text

from broker.api import connections
from broker.api.main import api_engine
from broker.settings import Settings
from broker.transport import signing

CREATE_TABLE = text("CREATE TABLE IF NOT EXISTS bench_bare_messages"
                    " (message_id bigserial PRIMARY KEY, body bytea, enqueued_at timestamptz NOT NULL DEFAULT now())")
INSERT = text("INSERT INTO bench_bare_messages (body) VALUES (:body) RETURNING message_id")
# The numbered relay's: both ends sign with it as two nodes do (broker.transport.signing), a benchmark's secret
# on one machine, for a batch posted to this path.
BATCH_SECRET = "bench: the secret both ends of the numbered relay share"
BATCHES_PATH = "/batches"
BATCH_PURPOSE = signing.request_purpose("POST", BATCHES_PATH, "application/octet-stream", "bench")
STAGE_BATCH = text("CREATE TEMPORARY TABLE IF NOT EXISTS bench_batch (id bigint, conversation_id uuid, seq bigint,"
                   " body bytea) ON COMMIT DELETE ROWS")
COPY_BATCH = "COPY pg_temp.bench_batch FROM STDIN (FORMAT binary)"
TAKE_BATCH = text("""
WITH stored AS (
    INSERT INTO bench_inbox SELECT * FROM pg_temp.bench_batch
), ranges AS (
    SELECT conversation_id, min(seq) AS first, max(seq) AS last, count(*) AS messages
    FROM pg_temp.bench_batch GROUP BY conversation_id
), moved AS (
    UPDATE bench_received r SET received = b.last
    FROM ranges b
    WHERE r.conversation_id = b.conversation_id AND r.received = b.first - 1 AND b.last - b.first + 1 = b.messages
    RETURNING r.conversation_id, r.received
)
SELECT (SELECT count(*) FROM ranges) AS conversations, (SELECT count(*) FROM moved) AS moved,
       (SELECT coalesce(json_agg(json_build_object('conversation_id', m.conversation_id, 'acknowledged', m.received)),
                        '[]') FROM moved m)::text AS results
""")



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

    @app.post(BATCHES_PATH)
    async def take_batch(request: Request) -> Response:
        batch = await request.body()

        def take() -> Response:
            try:
                signing.matching_secret([BATCH_SECRET], request.headers.get(signing.TIMESTAMP_HEADER),
                                        request.headers.get(signing.SIGNATURE_HEADER), BATCH_PURPOSE, batch)
            except signing.BadSignature:
                return Response(status_code=401)
            with engine.connect() as connection:
                connection.execute(STAGE_BATCH)
                with connection.connection.cursor() as cursor:
                    cursor.copy_expert(COPY_BATCH, io.BytesIO(batch))
                taken = connection.execute(TAKE_BATCH).one()
                if taken.moved < taken.conversations:
                    connection.rollback()
                    return Response("a conversation's numbers do not come next", status_code=409)
                connection.commit()
            return Response(taken.results, media_type="application/json",
                            headers=signing.answer_headers(BATCH_SECRET, "bench", request.headers[
                                signing.SIGNATURE_HEADER], taken.results.encode()))

        return await run_in_threadpool(take)

    return app


def main() -> None:
    settings = Settings()
    uvicorn.run(create_app(os.environ["BROKER_DATABASE_URL"], settings), host="127.0.0.1", port=int(sys.argv[1]),
                log_level="warning", http=connections.protocol(settings.request_head_timeout_s),
                limit_concurrency=settings.max_connections)


if __name__ == "__main__":
    main()
