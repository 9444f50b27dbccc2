"""Internal activation: messages through a queue's activated procedure, called by `broker serve`, against the
same work done by Python readers (broker.activation.run_activation).  The work: receive up to 100 messages and
record each one's length in a table, in the receive's transaction."""
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psycopg2
from sqlalchemy import Connection, create_engine, text

from bench import workload
from bench.databases import BenchServer, run_sql
from bench.nodes import serve_api
from bench.results import Measurement, ScenarioResult
from broker.activation import run_activation
from broker.cli.processes import stop
from broker.core import ReceivedMessage

READERS = 4
DEFINE_WORK = """
CREATE TABLE bench_done (body_bytes integer NOT NULL);
CREATE PROCEDURE bench_activated(queue text)
LANGUAGE sql AS $$
    INSERT INTO bench_done SELECT octet_length(body) FROM broker.receive(queue, 100)
$$;
DO $$
BEGIN
    CREATE ROLE bench_activation NOLOGIN;
EXCEPTION WHEN duplicate_object THEN
    NULL;
END $$;
GRANT broker_application TO bench_activation;
GRANT INSERT ON bench_done TO bench_activation;
"""
SET_ACTIVATION = ("SELECT broker.set_queue_activation('bench_dst', 'bench_activated', %(readers)s, %(on)s,"
                  " 'bench_activation')")
SEND_TO_ONE = ("SELECT count(broker.send(%(handle)s, 'bench.record', body))"
               " FROM unnest(%(bodies)s::bytea[]) AS m(body)")
DONE = "SELECT count(*) FROM bench_done"
FORGET_DONE = "TRUNCATE bench_done"
RECORD_DONE = text("INSERT INTO bench_done SELECT octet_length(body) FROM unnest(CAST(:bodies AS bytea[])) AS b(body)")


def _python_work(connection: Connection, messages: list[ReceivedMessage]) -> None:
    connection.execute(RECORD_DONE, {"bodies": [message.body for message in messages]})


def _fill(url: str, messages: int) -> None:
    """messages waiting in bench_dst, in conversations of 100; nothing done yet."""
    connection = psycopg2.connect(url)
    try:
        payloads = workload.bodies()
        for handle in workload.begin_conversations(connection, messages // workload.PER_TRANSACTION):
            with connection.cursor() as cursor:
                cursor.execute(SEND_TO_ONE, {"handle": handle, "bodies": payloads})
            connection.commit()
    finally:
        connection.close()
    run_sql(url, FORGET_DONE)


def _until_done(url: str, messages: int, started: float) -> float:
    """msgs/s from started until the table records every message."""
    deadline = started + 60 + messages / 100
    while run_sql(url, DONE)[0][0] < messages:
        if time.monotonic() > deadline:
            raise RuntimeError(f"activation did not do {messages:,} messages in time")
        time.sleep(0.01)
    return messages / (time.monotonic() - started)


def _activated(url: str, messages: int) -> float:
    _fill(url, messages)
    started = time.monotonic()
    run_sql(url, SET_ACTIVATION, {"readers": READERS, "on": True})
    try:
        return _until_done(url, messages, started)
    finally:
        run_sql(url, SET_ACTIVATION, {"readers": READERS, "on": False})


def _in_python(url: str, messages: int) -> float:
    _fill(url, messages)
    engine = create_engine(url, pool_size=READERS)
    halt = threading.Event()
    readers = threading.Thread(target=run_activation, args=(engine, "bench_dst", _python_work, halt),
                               kwargs={"max_readers": READERS, "max_messages": 100, "wait_ms": 100})
    started = time.monotonic()
    readers.start()
    try:
        return _until_done(url, messages, started)
    finally:
        halt.set()
        readers.join()
        engine.dispose()


def run(server: BenchServer, log: Path, messages: int, repetitions: int,
        report: Callable[[str], None]) -> ScenarioResult:
    """The activated procedure with READERS readers against run_activation with as many, on one database and the
    same backlog each time (conversations of 100)."""
    url = server.database("activation")
    workload.define(url, sender=True, receiver=True)
    run_sql(url, DEFINE_WORK)
    run_sql(url, SET_ACTIVATION, {"readers": READERS, "on": False})
    node, _ = serve_api(url, log)
    activated, python = [], []
    try:
        for repetition in range(1, repetitions + 1):
            activated.append(_activated(url, messages))
            python.append(_in_python(url, messages))
            report(f"activation: repetition {repetition}/{repetitions}: activated procedure "
                   f"{activated[-1]:,.0f} msgs/s, run_activation {python[-1]:,.0f} msgs/s")
    finally:
        stop(node)
    return ScenarioResult("activated procedure vs run_activation",
                          Measurement(f"broker serve calling a procedure, {READERS} readers", "msgs/s", activated),
                          Measurement(f"run_activation in Python, {READERS} readers", "msgs/s", python),
                          details={"messages": messages, "readers": READERS, "conversations_of": 100})
