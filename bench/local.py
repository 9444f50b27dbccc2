"""One node: broker.send and broker.receive next to plain INSERTs and DELETE … SKIP LOCKED on a bare table."""
import threading
import time
import uuid
from collections.abc import Callable
from statistics import median
from pathlib import Path

import psycopg2
import psycopg2.extras

from bench import pgmq, workload
from bench.databases import BenchServer, WalMeter, run_sql
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
# The grouped scenario: a transaction of 100 sends 10 messages on each of 10 conversations.
GROUPED_CONVERSATIONS = 10
# The least a send to a local service writes with this queue table and each side's numbers: one statement that
# stores the messages in the far side's queue and moves both sides' numbers on, without any check of send_batch's
# (no lock taken first, no state, lifetime, contract, type or size judged).  What send_batch can reach at best.
# Each conversation is sent on from one side, as the bench sends.
LEAST_LOCAL_SEND = """
WITH given AS (
    SELECT m.handle, m.place, row_number() OVER (PARTITION BY m.handle ORDER BY m.place) AS nth,
           count(*) OVER (PARTITION BY m.handle) AS messages
    FROM unnest(%(handles)s::uuid[]) WITH ORDINALITY AS m(handle, place)
), sides AS MATERIALIZED (
    SELECT g.*, e.conversation_id, e.send_sequence, far.conversation_handle AS far_handle, far.queue_id,
           far.conversation_group_id, far.priority
    FROM given g
    JOIN broker.endpoints e ON e.conversation_handle = g.handle
    JOIN broker.endpoints far ON far.conversation_id = e.conversation_id AND far.is_initiator = NOT e.is_initiator
), stored AS (
    INSERT INTO broker.queue_messages (queue_id, queue_position, conversation_group_id, conversation_handle,
                                       conversation_id, message_sequence_number, message_type_id, body, priority)
    SELECT s.queue_id, (SELECT broker._next_queue_positions(count(*)::integer) FROM sides) + s.place - 1,
           s.conversation_group_id, s.far_handle, s.conversation_id, s.send_sequence + s.nth,
           (SELECT t.message_type_id FROM broker.message_types t WHERE t.name = 'bench.record'),
           (%(bodies)s::bytea[])[s.place], s.priority
    FROM sides s
)
UPDATE broker.endpoints e
SET send_sequence = e.send_sequence + CASE WHEN e.conversation_handle = s.handle THEN s.messages ELSE 0 END,
    receive_sequence = e.receive_sequence + CASE WHEN e.conversation_handle = s.far_handle THEN s.messages ELSE 0 END
FROM sides s
WHERE s.nth = 1 AND e.conversation_handle IN (s.handle, s.far_handle)
"""


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


def _pgmq_database(server: BenchServer, pgmq_sql: Path | None) -> str | None:
    if pgmq_sql is None:
        return None
    url = server.database("pgmq")
    pgmq.load(url, pgmq_sql)
    return url


def _each_transaction(statement: str, connection, handles: list[str], messages: int, payloads: list) -> None:
    """`messages` messages by the statement, a transaction of PER_TRANSACTION each: payloads[i] on handles[i]."""
    with connection.cursor() as cursor:
        for _ in range(0, messages, workload.PER_TRANSACTION):
            cursor.execute(statement, {"handles": handles, "bodies": payloads})
            connection.commit()


def _against(scenario: str, measured: Measurement, baseline: Measurement, least: float | None,
             details: dict) -> ScenarioResult:
    """The scenario against its baseline: a target of ≥ least ×, or, without least, the ratio reported."""
    if least is None:
        return ScenarioResult(scenario, measured, baseline, details=details)
    return ScenarioResult(scenario, measured, baseline, target=f"≥ {least} × baseline",
                          met=ratio_met(measured, baseline, least), details=details)


def _against_pgmq(scenario: str, measured: Measurement, baseline: Measurement | None, least: float | None,
                  details: dict) -> ScenarioResult:
    """The scenario against pgmq (as _against), or a skipped result saying why when pgmq's SQL was not given."""
    if baseline is None:
        return ScenarioResult(f"{scenario} vs pgmq", None, target=f"≥ {least} × baseline" if least else "report",
                              skipped=pgmq.SCENARIO_SKIPPED)
    return _against(f"{scenario} vs pgmq", measured, baseline, least, details)


def send(server: BenchServer, messages: int, repetitions: int, report: Callable[[str], None],
         pgmq_sql: Path | None = None) -> list[ScenarioResult]:
    """100 messages per transaction, to a remote service (into the transmission log) and to a service in
    the same database (into its queue), by broker.send_batch and by 100 calls of broker.send in one
    statement, against a multi-row INSERT of the same 100 rows into a bare table and, when its SQL is
    given, pgmq.send_batch of 100; a message on each of 100 conversations, and send_batch to the local service
    with 10 messages on each of 10.  Beside them, the least a send to the local service writes (LEAST_LOCAL_SEND),
    against send_batch's and pgmq's.  Each with the WAL it writes per message."""
    remote, local = (psycopg2.connect(_prepare(server, remote_receiver=remote)) for remote in (True, False))
    wal = WalMeter(server.server_url)
    pgmq_url = _pgmq_database(server, pgmq_sql)
    peer = psycopg2.connect(pgmq_url) if pgmq_url else None
    payloads, pgmq_payloads = workload.bodies(), pgmq.bodies()
    handles = {connection: workload.begin_conversations(connection, workload.PER_TRANSACTION)
               for connection in (remote, local)}
    grouped = workload.begin_conversations(local, GROUPED_CONVERSATIONS)
    least_handles = workload.begin_conversations(local, workload.PER_TRANSACTION)
    rates: dict[str, list[float]] = {}
    wal_bytes: dict[str, list[float]] = {}

    def measure(name: str, action: Callable[[], None]) -> float:
        rate, written = wal.written_during(lambda: _rate(action, messages))
        rates.setdefault(name, []).append(rate)
        wal_bytes.setdefault(name, []).append(written / messages)
        return rate

    try:
        for connection in (remote, local):  # warm up
            workload.send_round_robin(connection, handles[connection], 2_000, payloads)
        for repetition in range(1, repetitions + 1):
            line = [f"INSERT {measure('bare', lambda: _bare_insert(remote, messages, payloads)):,.0f}"]
            for target, connection in (("remote", remote), ("local", local)):
                line.append(f"send_batch to {target} {measure(f'batch {target}', lambda: workload.send_round_robin(connection, handles[connection], messages, payloads)):,.0f}")
                line.append(f"send to {target} {measure(f'send {target}', lambda: _each_transaction(SEND_ONE_BY_ONE, connection, handles[connection], messages, payloads)):,.0f}")
            line.append(f"send_batch to local, 10 a conversation {measure('batch local grouped', lambda: workload.send_round_robin(local, grouped, messages, payloads)):,.0f}")
            line.append(f"the least a local send writes {measure('least local', lambda: _each_transaction(LEAST_LOCAL_SEND, local, least_handles, messages, payloads)):,.0f}")
            if peer:
                line.append(f"pgmq.send_batch {measure('pgmq', lambda: pgmq.send(peer, messages, pgmq_payloads)):,.0f}")
            report(f"local send: repetition {repetition}/{repetitions} (msgs/s): {', '.join(line)}")
    finally:
        for connection in (remote, local, peer, wal):
            if connection:
                connection.close()
    bare = Measurement("multi-row INSERT of 100 into a bare table", "msgs/s", rates["bare"])
    peer_rate = Measurement("pgmq.send_batch of 100", "msgs/s", rates["pgmq"]) if peer else None
    details = {"messages": messages, "per_transaction": workload.PER_TRANSACTION, "message_bytes": workload.MESSAGE_BYTES,
               "conversations": workload.PER_TRANSACTION,
               "wal_bytes_per_message": {name: round(median(values)) for name, values in wal_bytes.items()}}
    remote_details = {**details, "far_side": "remote: into the transmission log"}
    local_details = {**details, "far_side": "local: into the service's queue"}
    batched, one_by_one = "broker.send_batch of 100", "100 broker.send calls in one statement"
    batch_local = Measurement(batched, "msgs/s", rates["batch local"])
    send_local = Measurement(one_by_one, "msgs/s", rates["send local"])
    least_local = Measurement("one statement of 100: stored in the queue, both sides' numbers moved, nothing "
                              "judged", "msgs/s", rates["least local"])
    return [
        _against("local send, broker.send_batch", Measurement(batched, "msgs/s", rates["batch remote"]), bare, 0.7,
                 remote_details),
        _against("local send, broker.send", Measurement(one_by_one, "msgs/s", rates["send remote"]), bare, 0.5,
                 remote_details),
        _against("send_batch to a local service", batch_local, bare, 0.7, local_details),
        _against_pgmq("send_batch to a local service", batch_local, peer_rate, 0.6, local_details),
        _against("send to a local service", send_local, bare, 0.7, local_details),
        _against_pgmq("send to a local service", send_local, peer_rate, 1.0, local_details),
        _against_pgmq("send_batch to a local service, 10 a conversation",
                      Measurement(f"broker.send_batch of 100, {GROUPED_CONVERSATIONS} conversations", "msgs/s",
                                  rates["batch local grouped"]), peer_rate, 0.8,
                      {**local_details, "conversations": GROUPED_CONVERSATIONS}),
        _against("send_batch to a local service vs the least a local send writes", batch_local, least_local, None,
                 local_details),
        _against_pgmq("the least a local send writes", least_local, peer_rate, None, local_details),
    ]


def _drain(url: str, statement: str, messages: int, readers: int, params: dict | None = None) -> float:
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
                    cursor.execute(statement, params)
                    count = _taken(cursor)
                    connection.commit()
                    with lock:
                        taken += count
        finally:
            connection.close()

    seconds = workload.run_at_once(read, readers)
    if taken < messages:
        raise RuntimeError(f"{readers} readers took {taken:,} of {messages:,} messages in time")
    return messages / seconds


def _taken(cursor) -> int:
    """How many messages a reader's statement took: its rows, or the count it answers."""
    rows = cursor.fetchall()
    return rows[0][0] if cursor.description[0].name == "count" else len(rows)


def receive(server: BenchServer, messages: int, repetitions: int, readers: int,
            report: Callable[[str], None], pgmq_sql: Path | None = None) -> list[ScenarioResult]:
    """broker.receive of up to 100 and commit, against DELETE … SKIP LOCKED … RETURNING batches of
    100 from a bare table and, when its SQL is given, pgmq.read of 100 and pgmq.delete of them in one
    transaction; all hold the same number of messages, ours in conversations of 100."""
    url = _prepare(server, remote_receiver=False)
    pgmq_url = _pgmq_database(server, pgmq_sql)
    connection = psycopg2.connect(url)
    peer = psycopg2.connect(pgmq_url) if pgmq_url else None
    payloads = workload.bodies()
    ours, bare, theirs = [], [], []
    try:
        for repetition in range(1, repetitions + 1):
            for handle in workload.begin_conversations(connection, messages // workload.PER_TRANSACTION):
                with connection.cursor() as cursor:
                    cursor.execute(SEND_TO_ONE, {"handle": handle, "bodies": payloads})
                connection.commit()
            _bare_insert(connection, messages, payloads)
            bare.append(_drain(url, BARE_TAKE, messages, readers))
            ours.append(_drain(url, RECEIVE, messages, readers))
            line = f"DELETE … SKIP LOCKED {bare[-1]:,.0f} msgs/s, broker.receive {ours[-1]:,.0f} msgs/s"
            if peer:
                pgmq.send(peer, messages, pgmq.bodies())
                theirs.append(_drain(pgmq_url, pgmq.READ_AND_DELETE, messages, readers, {"queue": pgmq.QUEUE}))
                line += f", pgmq read + delete {theirs[-1]:,.0f} msgs/s"
            report(f"local receive, {readers} readers: repetition {repetition}/{repetitions}: {line}")
    finally:
        for open_connection in (connection, peer):
            if open_connection:
                open_connection.close()
    scenario = f"local receive, {readers} reader{'s' if readers > 1 else ''}"
    measured = Measurement("broker.receive of 100 + commit", "msgs/s", ours)
    details = {"messages": messages, "readers": readers, "conversations_of": 100}
    return [_against(scenario, measured, Measurement("DELETE … SKIP LOCKED … RETURNING 100", "msgs/s", bare), 0.7,
                     details),
            _against_pgmq(scenario, measured,
                          Measurement("pgmq.read of 100 + pgmq.delete", "msgs/s", theirs) if peer else None, 0.9,
                          details)]
