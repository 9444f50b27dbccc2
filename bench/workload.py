"""The benchmark's catalog and its load: 1 KB messages sent with broker.send_batch in transactions of 100."""
import os
import secrets
import threading
import time
from collections.abc import Callable, Sequence

import psycopg2
from sqlalchemy import create_engine

from bench.databases import run_sql
from broker import queries

MESSAGE_BYTES = 1024
PER_TRANSACTION = 100

# Node A sends from bench_sender; bench_receiver lives on node B, or on A itself for local conversations.
DEFINE_TYPES = """
SELECT broker.create_message_type('bench.record', 'none');
SELECT broker.create_contract('bench', '{"bench.record": "initiator"}');
"""
DEFINE_SENDER = "SELECT broker.create_queue('bench_src'); SELECT broker.create_service('bench_sender', 'bench_src');"
DEFINE_RECEIVER = ("SELECT broker.create_queue('bench_dst');"
                   " SELECT broker.create_service('bench_receiver', 'bench_dst', ARRAY['bench']);")
ROUTE = "SELECT broker.create_route(%(service)s, %(address)s, %(instance)s, %(secret)s)"
BEGIN_CONVERSATIONS = ("SELECT broker.begin_dialog('bench_sender', 'bench_receiver', 'bench')"
                       " FROM generate_series(1, %(conversations)s)")
SEND_BATCH = "SELECT broker.send_batch(%(handles)s::uuid[], 'bench.record', %(bodies)s::bytea[])"
# As broker.send_batch from Python sends in a trace: under the setting broker.traceparent.
SEND_BATCH_TRACED = ("WITH traced AS MATERIALIZED (SELECT set_config('broker.traceparent', %(traceparent)s, true))"
                     f" {SEND_BATCH} FROM traced")


def bodies() -> list[psycopg2.Binary]:
    """PER_TRANSACTION distinct random bodies of MESSAGE_BYTES, reused for every transaction."""
    return [psycopg2.Binary(os.urandom(MESSAGE_BYTES)) for _ in range(PER_TRANSACTION)]


def define(database_url: str, *, sender: bool, receiver: bool) -> None:
    run_sql(database_url, DEFINE_TYPES + (DEFINE_SENDER if sender else "") + (DEFINE_RECEIVER if receiver else ""))


def route(database_url: str, service: str, address: str, instance: str, secret: str) -> None:
    run_sql(database_url, ROUTE, {"service": service, "address": address, "instance": instance, "secret": secret})


def instance_of(database_url: str) -> str:
    engine = create_engine(database_url)
    try:
        with engine.connect() as connection:
            return queries.broker_instance(connection)
    finally:
        engine.dispose()


def begin_conversations(connection, conversations: int) -> list[str]:
    with connection.cursor() as cursor:
        cursor.execute(BEGIN_CONVERSATIONS, {"conversations": conversations})
        handles = [str(row[0]) for row in cursor.fetchall()]
    connection.commit()
    return handles


def send_round_robin(connection, handles: Sequence[str], messages: int, payloads: list, first: int = 0,
                     traced: bool = False) -> None:
    """Sends `messages` messages over the conversations in turn, PER_TRANSACTION to a transaction.

    `first` continues the rotation where an earlier call stopped.  traced: each transaction's messages in a
    sampled trace of their own, as an application's request that sends them would give them.
    """
    with connection.cursor() as cursor:
        for start in range(first, first + messages, PER_TRANSACTION):
            count = min(PER_TRANSACTION, first + messages - start)
            batch = [handles[(start + i) % len(handles)] for i in range(count)]
            if traced:
                traceparent = f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"
                cursor.execute(SEND_BATCH_TRACED, {"handles": batch, "bodies": payloads[:count], "traceparent": traceparent})
            else:
                cursor.execute(SEND_BATCH, {"handles": batch, "bodies": payloads[:count]})
            connection.commit()


def run_at_once(work: Callable[[], None], threads: int) -> float:
    """Runs work in `threads` threads at once; returns the seconds until the last one ended."""
    running = [threading.Thread(target=work) for _ in range(threads)]
    started = time.monotonic()
    for thread in running:
        thread.start()
    for thread in running:
        thread.join()
    return time.monotonic() - started
