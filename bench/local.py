"""One node: broker.send and broker.receive next to plain INSERTs and DELETE … SKIP LOCKED on a bare table."""
import threading
import time
import uuid
from collections.abc import Callable

import psycopg2
import psycopg2.extras

from bench import workload
from bench.databases import BenchServer, run_sql
from bench.results import Measurement, ScenarioResult, ratio_met

BARE_TABLE = ("CREATE TABLE bench_bare (id bigserial PRIMARY KEY, conversation_id uuid NOT NULL, seq bigint NOT NULL,"
              " body bytea NOT NULL)")
BARE_INSERT = "INSERT INTO bench_bare (conversation_id, seq, body) VALUES %s"
# The locking subquery as a CTE, which runs once: written as "id IN (SELECT ... FOR UPDATE SKIP LOCKED)"
# it can be planned as a semi-join that locks its rows again for every row of the table.
BARE_TAKE = ("WITH next AS (SELECT id FROM bench_bare ORDER BY id LIMIT 100 FOR UPDATE SKIP LOCKED)"
             " DELETE FROM bench_bare b USING next WHERE b.id = next.id RETURNING b.body")
RECEIVE = "SELECT body FROM broker.receive('bench_dst', 100)"
SEND_ONE_BY_ONE = ("SELECT count(broker.send(handle, 'bench.record', body))"
                   " FROM unnest(%(handles)s::uuid[], %(bodies)s::bytea[]) AS m(handle, body)")
SEND_TO_ONE = ("SELECT count(broker.send(%(handle)s, 'bench.record', body))"
               " FROM unnest(%(bodies)s::bytea[]) AS m(body)")


def _bare_insert(connection, messages: int, payloads: list) -> None:
    conversation = str(uuid.uuid4())
    with connection.cursor() as cursor:
        for start in range(0, messages, workload.PER_TRANSACTION):
            rows = [(conversation, start + i, payload) for i, payload in enumerate(payloads)]
            psycopg2.extras.execute_values(cursor, BARE_INSERT, rows, page_size=len(rows))
            connection.commit()


def _rate(action: Callable[[], None], messages: int) -> float:
    started = time.monotonic()
    action()
    return messages / (time.monotonic() - started)


def _prepare(server: BenchServer, *, remote_receiver: bool) -> str:
    url = server.database("local")
    workload.define(url, sender=True, receiver=not remote_receiver)
    if remote_receiver:  # no relay runs: sent messages stay in the transmission queue
        workload.route(url, "bench_receiver", "http://127.0.0.1:1", str(uuid.uuid4()), "no relay runs in this database")
    run_sql(url, BARE_TABLE)
    return url


def _send_one_by_one(connection, handles: list[str], messages: int, payloads: list) -> None:
    with connection.cursor() as cursor:
        for _ in range(0, messages, workload.PER_TRANSACTION):
            cursor.execute(SEND_ONE_BY_ONE, {"handles": handles, "bodies": payloads})
            connection.commit()


def send(server: BenchServer, messages: int, repetitions: int, report: Callable[[str], None]) -> list[ScenarioResult]:
    """100 messages to a remote service per transaction, by broker.send_batch and by 100 calls of
    broker.send in one statement, against a multi-row INSERT of the same 100 rows into a bare table."""
    connection = psycopg2.connect(_prepare(server, remote_receiver=True))
    payloads = workload.bodies()
    handles = workload.begin_conversations(connection, workload.PER_TRANSACTION)
    batched, one_by_one, bare = [], [], []
    try:
        workload.send_round_robin(connection, handles, 2_000, payloads)  # warm up
        for repetition in range(1, repetitions + 1):
            bare.append(_rate(lambda: _bare_insert(connection, messages, payloads), messages))
            batched.append(_rate(lambda: workload.send_round_robin(connection, handles, messages, payloads), messages))
            one_by_one.append(_rate(lambda: _send_one_by_one(connection, handles, messages, payloads), messages))
            report(f"local send: repetition {repetition}/{repetitions}: INSERT {bare[-1]:,.0f} msgs/s, "
                   f"broker.send_batch {batched[-1]:,.0f} msgs/s, broker.send {one_by_one[-1]:,.0f} msgs/s")
    finally:
        connection.close()
    baseline = Measurement("multi-row INSERT of 100 into a bare table", "msgs/s", bare)
    details = {"messages": messages, "per_transaction": workload.PER_TRANSACTION, "message_bytes": workload.MESSAGE_BYTES,
               "conversations": workload.PER_TRANSACTION, "far_side": "remote: into the transmission queue"}
    results = []
    for scenario, label, rates in (("local send, broker.send_batch", "broker.send_batch of 100", batched),
                                   ("local send, broker.send", "100 broker.send calls in one statement", one_by_one)):
        measured = Measurement(label, "msgs/s", rates)
        results.append(ScenarioResult(scenario, measured, baseline, target="≥ 0.7 × baseline",
                                      met=ratio_met(measured, baseline, 0.7), details=details))
    return results


def _drain(url: str, statement: str, messages: int, readers: int) -> float:
    """msgs/s of `readers` connections taking batches and committing until `messages` are taken."""
    taken = 0
    lock = threading.Lock()
    deadline = time.monotonic() + 60 + messages / 200

    def read() -> None:
        nonlocal taken
        connection = psycopg2.connect(url)
        try:
            with connection.cursor() as cursor:
                while taken < messages and time.monotonic() < deadline:
                    cursor.execute(statement)
                    count = len(cursor.fetchall())
                    connection.commit()
                    with lock:
                        taken += count
        finally:
            connection.close()

    seconds = workload.run_at_once(read, readers)
    if taken < messages:
        raise RuntimeError(f"{readers} readers took {taken:,} of {messages:,} messages in time")
    return messages / seconds


def receive(server: BenchServer, messages: int, repetitions: int, readers: int,
            report: Callable[[str], None]) -> ScenarioResult:
    """broker.receive of up to 100 and commit, against DELETE … SKIP LOCKED … RETURNING batches of
    100 from a bare table; both hold the same messages, in conversations of 100."""
    url = _prepare(server, remote_receiver=False)
    connection = psycopg2.connect(url)
    payloads = workload.bodies()
    ours, bare = [], []
    try:
        for repetition in range(1, repetitions + 1):
            for handle in workload.begin_conversations(connection, messages // workload.PER_TRANSACTION):
                with connection.cursor() as cursor:
                    cursor.execute(SEND_TO_ONE, {"handle": handle, "bodies": payloads})
                connection.commit()
            _bare_insert(connection, messages, payloads)
            bare.append(_drain(url, BARE_TAKE, messages, readers))
            ours.append(_drain(url, RECEIVE, messages, readers))
            report(f"local receive, {readers} readers: repetition {repetition}/{repetitions}: "
                   f"DELETE … SKIP LOCKED {bare[-1]:,.0f} msgs/s, broker.receive {ours[-1]:,.0f} msgs/s")
    finally:
        connection.close()
    measured = Measurement("broker.receive of 100 + commit", "msgs/s", ours)
    baseline = Measurement("DELETE … SKIP LOCKED … RETURNING 100", "msgs/s", bare)
    return ScenarioResult(f"local receive, {readers} reader{'s' if readers > 1 else ''}", measured, baseline,
                          target="≥ 0.7 × baseline", met=ratio_met(measured, baseline, 0.7),
                          details={"messages": messages, "readers": readers, "conversations_of": 100})
