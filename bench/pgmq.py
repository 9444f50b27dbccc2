"""The peer in one database: pgmq, loaded from its SQL file when the user gives one (never shipped with
the bench), measured with the same harness, bodies and transaction sizes as ours.

pgmq keeps no order per conversation and no exactly-once between databases; it is the speed to match.
Its bodies are jsonb, so each message is a JSON string of MESSAGE_BYTES characters.
"""
import json
import os
from pathlib import Path

import psycopg2

from bench import workload

SCENARIO_SKIPPED = ("no pgmq SQL given: pass --pgmq-sql (or BROKER_BENCH_PGMQ_SQL) with pgmq's extension script, "
                    "pgmq.sql, to measure it")
QUEUE = "bench"
SEND_BATCH = "SELECT count(*) FROM pgmq.send_batch(%(queue)s, %(bodies)s::jsonb[])"
# A reader's transaction: read (lock for vt seconds) up to 100 and delete them, as a consumer that processes
# within its transaction does.
READ_AND_DELETE = ("WITH read AS (SELECT msg_id FROM pgmq.read(%(queue)s, 30, 100))"
                   " SELECT count(*) FROM pgmq.delete(%(queue)s, ARRAY(SELECT msg_id FROM read))")


def load(database_url: str, sql_file: Path) -> None:
    """pgmq's functions in the database (as its README shows, without installing an extension), and a queue."""
    script = sql_file.read_text().replace("@extschema@", "pgmq")
    connection = psycopg2.connect(database_url)
    try:
        with connection, connection.cursor() as cursor:
            cursor.execute("CREATE SCHEMA IF NOT EXISTS pgmq")
            cursor.execute(script)
            cursor.execute("SELECT pgmq.create(%(queue)s)", {"queue": QUEUE})
    finally:
        connection.close()


def bodies() -> list[str]:
    """PER_TRANSACTION distinct JSON strings of MESSAGE_BYTES characters."""
    return [json.dumps(os.urandom(workload.MESSAGE_BYTES // 2).hex()[:workload.MESSAGE_BYTES - 2])
            for _ in range(workload.PER_TRANSACTION)]


def send(connection, messages: int, payloads: list[str]) -> None:
    with connection.cursor() as cursor:
        for _ in range(0, messages, workload.PER_TRANSACTION):
            cursor.execute(SEND_BATCH, {"queue": QUEUE, "bodies": payloads})
            connection.commit()

