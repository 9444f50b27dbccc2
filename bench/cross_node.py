"""Cross-node scenarios: transfer throughput next to a bare relay, latency, and throughput at scale."""
import io
import select
import statistics
import struct
import threading
import time
import uuid
from collections.abc import Callable

import httpx
import psycopg2
import psycopg2.extras
from sqlalchemy.engine import make_url

from bench import bare_api, cpu, workload
from bench.databases import WalMeter
from bench.nodes import TwoNodes, start_bare_api
from bench.otlp_sink import OtlpSink
from bench.results import Measurement, ScenarioResult, ratio_met
from broker.cli.processes import stop
from broker.transport import signing

BARE_OUTBOX = ("CREATE TABLE IF NOT EXISTS bench_outbox (id bigserial PRIMARY KEY, conversation_id uuid NOT NULL,"
               " seq bigint NOT NULL, body bytea NOT NULL)")
BARE_INBOX = ("CREATE TABLE IF NOT EXISTS bench_inbox (id bigint PRIMARY KEY, conversation_id uuid NOT NULL,"
              " seq bigint NOT NULL, body bytea NOT NULL)")
BARE_INSERT = "INSERT INTO bench_outbox (conversation_id, seq, body) VALUES %s"
BARE_BATCH = "SELECT id, conversation_id, seq, body FROM bench_outbox ORDER BY id LIMIT 1000"
BARE_DELETE = "DELETE FROM bench_outbox WHERE id <= %s"
# The numbered relay over HTTP: the least that numbering each conversation costs, a row of its number on each node,
# with the hop a node makes (bench.bare_api takes its batches).
NUMBERS_SENT = ("CREATE TABLE IF NOT EXISTS bench_sent (conversation_id uuid PRIMARY KEY, sent bigint NOT NULL)"
                " WITH (fillfactor = 70)")
NUMBERS_RECEIVED = ("CREATE TABLE IF NOT EXISTS bench_received (conversation_id uuid PRIMARY KEY,"
                    " received bigint NOT NULL) WITH (fillfactor = 70)")
# A sends: each conversation's messages take its next numbers, and its row moves on, in one statement.
NUMBERED_INSERT = """
WITH given AS (
    SELECT g.k, g.conversation_id, g.body, row_number() OVER (PARTITION BY g.conversation_id ORDER BY g.k) AS nth
    FROM unnest(%(conversations)s::uuid[], %(bodies)s::bytea[]) WITH ORDINALITY AS g(conversation_id, body, k)
), moved AS (
    UPDATE bench_sent s SET sent = s.sent + g.messages
    FROM (SELECT conversation_id, count(*) AS messages FROM given GROUP BY conversation_id) g
    WHERE s.conversation_id = g.conversation_id
    RETURNING s.conversation_id, s.sent - g.messages AS before
)
INSERT INTO bench_outbox (conversation_id, seq, body)
SELECT g.conversation_id, m.before + g.nth, g.body FROM given g JOIN moved m USING (conversation_id) ORDER BY g.k
"""
# Its batches, as the broker's relay reads them: binary COPY, up to the last of the next 1,000.
LAST_OF_BATCH = "SELECT max(id), count(*) FROM (SELECT id FROM bench_outbox ORDER BY id LIMIT 1000) b"
NUMBERED_BATCH = ("COPY (SELECT id, conversation_id, seq, body FROM bench_outbox WHERE id <= %s ORDER BY id)"
                  " TO STDOUT (FORMAT binary)")
# A batch of no rows, in that format: the endpoint's pool connects before a measurement.
EMPTY_BATCH = b"PGCOPY\n\xff\r\n\x00" + bytes(8) + struct.pack(">h", -1)
NUMBERED_RELAY_NAME = "bench numbered relay"
ENDPOINT_BACKENDS = "SELECT pid FROM pg_stat_activity WHERE application_name = %s"
SET_RESEND_WINDOW = "UPDATE broker.node SET resend_window = %s"
RECEIVE_TIMED = "SELECT body, extract(epoch FROM enqueued_at) FROM broker.receive('bench_dst', 100)"
# The scale target: the slowest point of the curve within this factor of the fastest.
SCALE_FLAT_WITHIN = 1.5
# This machine class commits about 2,500 single-row transactions a second to its disk: the
# latency load comes in transactions of 10 (100 commits a second) so that commits do not queue.
LATENCY_BATCH = 10
# A backlog of waiting messages in B's destination queue, written straight into the table: a
# consumer far behind, without spending minutes sending it.
BACKLOG = """
WITH dialog AS (SELECT conversation_group_id, conversation_handle, conversation_id, queue_id
                FROM broker.endpoints LIMIT 1)
INSERT INTO broker.queue_messages (queue_id, queue_position, conversation_group_id, conversation_handle,
                                   conversation_id, message_sequence_number, message_type_id, body)
SELECT d.queue_id, broker._next_queue_position(), d.conversation_group_id, d.conversation_handle,
       d.conversation_id, 1000000 + i,
       (SELECT message_type_id FROM broker.message_types WHERE name = 'bench.record'), %(body)s
FROM dialog d, generate_series(1, %(messages)s) i
"""


def open_conversations(nodes: TwoNodes, conversations: int, payloads: list) -> tuple[list[str], float]:
    """Begins conversations on A and opens them on B with a first message each, then empties B's queue.

    Returns their handles and how many were opened per second (begun, sent, accepted and acknowledged).
    """
    started = time.monotonic()
    handles = workload.begin_conversations(nodes.a, conversations)
    _transfer(nodes, handles, conversations, payloads, at_least_per_s=200)
    opened_per_s = conversations / (time.monotonic() - started)
    nodes.clear_arrived()
    return handles, opened_per_s


def _transfer(nodes: TwoNodes, handles: list[str], messages: int, payloads: list, at_least_per_s: int = 500,
              traced: bool = False) -> float:
    """msgs/s from the first send to the last acknowledgement, the relay running throughout; a minute
    plus the time that at_least_per_s allows is given before it fails."""
    arrived_before = nodes.arrived()
    started = time.monotonic()
    workload.send_round_robin(nodes.a, handles, messages, payloads, traced=traced)
    nodes.wait_until_delivered(arrived_before + messages, timeout_s=60 + messages / at_least_per_s)
    return messages / (time.monotonic() - started)


def _bare_relay(nodes: TwoNodes, conversations: int, messages: int, payloads: list,
                numbered_at: tuple[str, int] | None = None) -> tuple[float, dict]:
    """The same traffic through a bare pipeline: multi-row INSERTs into an outbox table on A while a
    loop selects a batch, COPYs it into B, commits, deletes it from A and commits.  Returns its rate and its
    CPU a message in the groups of the broker's (bench.cpu).

    numbered_at: the address and process id of a numbered relay's endpoint (bench.bare_api): each conversation's
    messages are numbered as they are sent, from a row of its own on A, and the loop reads each batch as binary
    COPY, signs it and posts it there, where B stores it and moves a row of its own for each conversation on, only
    where the batch's numbers begin right after it (else the run fails); the loop checks the answer's signature
    and then deletes the batch from A.  The least that the guarantees' numbering costs with the hop a node makes,
    without anything else the broker does."""
    conversation_ids = [str(uuid.uuid4()) for _ in range(conversations)]
    sender = psycopg2.connect(nodes.a_url)
    source = psycopg2.connect(nodes.a_url)
    target = psycopg2.connect(nodes.b_url)
    client = httpx.Client(timeout=60)
    try:
        for connection, messages_table, numbers_table in (
                (source, ("bench_outbox", BARE_OUTBOX), ("bench_sent", NUMBERS_SENT)),
                (target, ("bench_inbox", BARE_INBOX), ("bench_received", NUMBERS_RECEIVED))):
            with connection.cursor() as cursor:
                for table, create in (messages_table, numbers_table):
                    cursor.execute(create)
                    cursor.execute(f"TRUNCATE {table}")
                if numbered_at:
                    cursor.execute(f"INSERT INTO {numbers_table[0]} SELECT unnest(%s::uuid[]), 0", (conversation_ids,))
            connection.commit()
        done_sending = threading.Event()
        if numbered_at:
            address, api = numbered_at
            _post_batch(client, address, EMPTY_BATCH)  # its pool connected: its backend is counted
            with target.cursor() as cursor:
                cursor.execute(ENDPOINT_BACKENDS, (NUMBERED_RELAY_NAME,))
                target_backends = tuple(pid for (pid,) in cursor.fetchall())
            target.rollback()
        else:
            target_backends, api = (target.get_backend_pid(),), None
        roles = cpu.BareRoles(sender.get_backend_pid(), source.get_backend_pid(), target_backends,
                              nodes.a_url, threading.get_native_id(), api)
        before = roles.times()

        def send() -> None:
            with sender.cursor() as cursor:
                for start in range(0, messages, workload.PER_TRANSACTION):
                    rows = [(conversation_ids[(start + i) % conversations], start + i, payloads[i])
                            for i in range(min(workload.PER_TRANSACTION, messages - start))]
                    if numbered_at:
                        cursor.execute(NUMBERED_INSERT, {"conversations": [row[0] for row in rows],
                                                         "bodies": [row[2] for row in rows]})
                    else:
                        psycopg2.extras.execute_values(cursor, BARE_INSERT, rows, page_size=len(rows))
                    sender.commit()
            done_sending.set()

        started = time.monotonic()
        sending = threading.Thread(target=send)
        sending.start()
        moved = 0
        deadline = started + 60 + messages / 500
        while moved < messages and time.monotonic() < deadline:
            if numbered_at:
                last, taken = _numbered_batch(source, client, address)
            else:
                last, taken = _bare_batch(source, target)
            if not taken:
                time.sleep(0.001)
                continue
            with source.cursor() as cursor:
                cursor.execute(BARE_DELETE, (last,))
            source.commit()
            moved += taken
        sending.join()
        if moved < messages:
            raise RuntimeError(f"the bare relay moved {moved:,} of {messages:,} in time")
        rate = messages / (time.monotonic() - started)
        return rate, cpu.per_message_us(before, roles.times(), messages)
    finally:
        client.close()
        for connection in (sender, source, target):
            connection.close()


def _bare_batch(source, target) -> tuple[int | None, int]:
    """The bare relay's next batch from A into B, committed there: the last id it took, and how many."""
    with source.cursor() as cursor:
        cursor.execute(BARE_BATCH)
        rows = cursor.fetchall()
    source.rollback()
    if not rows:
        return None, 0
    copy = io.StringIO("".join(f"{id_}\t{conversation}\t{seq}\t\\\\x{bytes(body).hex()}\n"
                               for id_, conversation, seq, body in rows))
    with target.cursor() as cursor:
        cursor.copy_expert("COPY bench_inbox FROM STDIN", copy)
    target.commit()
    return rows[-1][0], len(rows)


def _numbered_batch(source, client: httpx.Client, address: str) -> tuple[int | None, int]:
    """The numbered relay's next batch from A, posted to its endpoint and answered: the last id it took, and how
    many."""
    batch = io.BytesIO()
    with source.cursor() as cursor:
        cursor.execute(LAST_OF_BATCH)
        last, taken = cursor.fetchone()
        if taken:
            cursor.copy_expert(cursor.mogrify(NUMBERED_BATCH, (last,)).decode(), batch)
    source.rollback()
    if taken:
        _post_batch(client, address, batch.getvalue())
    return last, taken


def _post_batch(client: httpx.Client, address: str, batch: bytes) -> None:
    """Posts a batch to the numbered relay's endpoint, signed as a node signs it, and checks that the answer is
    signed as the answer to it."""
    headers = signing.signed_headers(bare_api.BATCH_SECRET, "bench", bare_api.BATCH_PURPOSE, batch)
    answer = client.post(f"{address}{bare_api.BATCHES_PATH}", content=batch, headers=headers)
    if answer.status_code == 409:
        raise RuntimeError("the numbered relay took a batch out of order")
    answer.raise_for_status()
    signing.check_answer(bare_api.BATCH_SECRET, answer.headers, headers[signing.SIGNATURE_HEADER], answer.content)


def transfer(nodes: TwoNodes, conversations: int, messages: int, repetitions: int,
             report: Callable[[str], None]) -> list[ScenarioResult]:
    """The transfer against the bare relay (the target), and against the numbered relay over HTTP (reported): what
    the broker spends beyond the least that numbering each conversation costs with the hop a node makes.  The three
    alternate on the same nodes; the numbered relay's endpoint (bench.bare_api) serves B's database meanwhile."""
    payloads = workload.bodies()
    handles, opened_per_s = open_conversations(nodes, conversations, payloads)
    _transfer(nodes, handles, min(messages, 5_000), payloads)  # warm the processes and caches
    nodes.clear_arrived()
    endpoint_url = make_url(nodes.b_url).update_query_dict({"application_name": NUMBERED_RELAY_NAME})
    endpoint, endpoint_address = start_bare_api(endpoint_url.render_as_string(hide_password=False), nodes.log)
    rates: dict[str, list[float]] = {"broker": [], "bare relay": [], "numbered relay over HTTP": []}
    cpu_used: dict[str, list[dict]] = {name: [] for name in rates}
    wal_bytes: dict[str, list[float]] = {name: [] for name in rates}
    roles = nodes.roles()
    wal = WalMeter(nodes.a_url)

    def measure(name: str, run: Callable[[], tuple[float, dict]]) -> None:
        (rate, used), written = wal.written_during(run)
        rates[name].append(rate)
        cpu_used[name].append(used)
        wal_bytes[name].append(written / messages)

    def broker() -> tuple[float, dict]:
        before = roles.times()
        rate = _transfer(nodes, handles, messages, payloads)
        return rate, cpu.per_message_us(before, roles.times(), messages)

    try:
        for repetition in range(1, repetitions + 1):
            measure("bare relay", lambda: _bare_relay(nodes, conversations, messages, payloads))
            measure("numbered relay over HTTP", lambda: _bare_relay(nodes, conversations, messages, payloads,
                                                                    (endpoint_address, endpoint.pid)))
            measure("broker", broker)
            nodes.clear_arrived()
            report(f"cross-node transfer: repetition {repetition}/{repetitions}: "
                   + ", ".join(f"{name} {rates[name][-1]:,.0f} msgs/s, CPU {cpu_used[name][-1]['all']:.1f} µs and "
                               f"WAL {wal_bytes[name][-1]:,.0f} bytes a message" for name in rates))
    finally:
        stop(endpoint)
        wal.close()
    cpu_us = {name: {group: statistics.median(used[group] for used in runs) for group in runs[0]}
              for name, runs in cpu_used.items()}
    measured = Measurement(f"send_batch → relay → HTTP → accept, CPU {cpu_us['broker']['all']:.0f} µs a message over "
                           "both nodes", "msgs/s", rates["broker"])
    bare = Measurement(f"bare relay: INSERT / SELECT, COPY, DELETE, CPU {cpu_us['bare relay']['all']:.0f} µs a "
                       "message", "msgs/s", rates["bare relay"])
    numbered = Measurement(f"a relay numbering each conversation on both nodes, its batches signed and posted to "
                           f"FastAPI, CPU {cpu_us['numbered relay over HTTP']['all']:.0f} µs a message", "msgs/s",
                           rates["numbered relay over HTTP"])
    details = {"conversations": conversations, "messages": messages, "per_transaction": workload.PER_TRANSACTION,
               "measured": "over conversations already open on both nodes"}
    return [ScenarioResult("cross-node transfer", measured, bare,
                           target="≥ 0.75 × baseline (and ≥ 1.0 × RabbitMQ: its row)",
                           met=ratio_met(measured, bare, 0.75),
                           details={**details, "conversations_opened_per_s": opened_per_s,
                                    "cpu_us_per_message": cpu_us["broker"],
                                    "bare_relay_cpu_us_per_message": cpu_us["bare relay"],
                                    "numbered_relay_over_http_cpu_us_per_message": cpu_us["numbered relay over HTTP"],
                                    # both nodes' databases, on one server
                                    "wal_bytes_per_message": {name: round(statistics.median(values))
                                                              for name, values in wal_bytes.items()}}),
            ScenarioResult("cross-node transfer vs a numbered relay over HTTP", measured, numbered, details=details)]


def traced(nodes: TwoNodes, conversations: int, messages: int, repetitions: int,
           report: Callable[[str], None]) -> ScenarioResult:
    """The transfer with traces on: the relay and the API export their spans over OTLP (to a sink here) and
    each sending transaction's messages are a sampled trace of their own; against the transfer with traces
    off, the two alternated on the same nodes."""
    payloads = workload.bodies()
    handles, _ = open_conversations(nodes, conversations, payloads)
    off, on = [], []
    with OtlpSink() as sink:
        tracing_on = {"BROKER_TRACING": "otlp", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": sink.endpoint}
        for repetition in range(1, repetitions + 1):
            for settings, traced_now, rates in (({}, False, off), (tracing_on, True, on)):
                nodes.restart(settings)
                _transfer(nodes, handles, min(messages, 5_000), payloads, traced=traced_now)  # warm up
                nodes.clear_arrived()
                rates.append(_transfer(nodes, handles, messages, payloads, traced=traced_now))
                nodes.clear_arrived()
            report(f"cross-node transfer traced: repetition {repetition}/{repetitions}: untraced {off[-1]:,.0f} "
                   f"msgs/s, traced {on[-1]:,.0f} msgs/s")
        nodes.restart({})  # flushes the last spans
        spans = sink.spans
    measured = Measurement("traced: spans exported over OTLP", "msgs/s", on)
    baseline = Measurement("untraced, same nodes, alternated", "msgs/s", off)
    return ScenarioResult("cross-node transfer, traced", measured, baseline, target="≥ 0.95 × untraced",
                          met=measured.median / baseline.median >= 0.95,
                          details={"conversations": conversations, "messages": messages,
                                   "messages_per_trace": workload.PER_TRANSACTION, "spans_exported": spans})


def resend_window(nodes: TwoNodes, conversations: int, messages: int, repetitions: int,
                  report: Callable[[str], None]) -> ScenarioResult:
    """The transfer keeping what B acknowledged for A's resend window (the default, 24 hours) against the same
    transfer keeping nothing (resend_window 0), the two alternated on the same nodes, each from the log its window
    keeps (TwoNodes.forget_acknowledged)."""
    payloads = workload.bodies()
    handles, _ = open_conversations(nodes, conversations, payloads)
    without, kept = [], []
    for repetition in range(1, repetitions + 1):
        for window, rates in (("0", without), ("24 hours", kept)):
            with nodes.a.cursor() as cursor:
                cursor.execute(SET_RESEND_WINDOW, (window,))
            nodes.a.commit()
            nodes.forget_acknowledged()
            rates.append(_transfer(nodes, handles, messages, payloads))
            nodes.clear_arrived()
        report(f"cross-node transfer, resend window: repetition {repetition}/{repetitions}: without "
               f"{without[-1]:,.0f} msgs/s, keeping 24 hours {kept[-1]:,.0f} msgs/s")
    measured = Measurement("keeping acknowledged messages for 24 hours", "msgs/s", kept)
    baseline = Measurement("resend window 0, same nodes, alternated", "msgs/s", without)
    return ScenarioResult("cross-node transfer, resend window", measured, baseline, target="≥ 0.97 × without",
                          met=ratio_met(measured, baseline, 0.97),
                          details={"conversations": conversations, "messages": messages})


def _latencies(nodes: TwoNodes, rate: int, seconds: float) -> tuple[list[float], list[float], float]:
    """Messages offered at `rate` per second on A, in transactions of LATENCY_BATCH messages on one
    of 10 conversations in turn; two readers on B, woken by LISTEN, receive them.  Each latency runs
    from the commit of the message's send to the return of the receive that hands it out (it is
    visible to receive then; the reader's own commit follows).  The time to arrive (the start of
    B's transaction that stores it) is noted too.  Returns both, sorted, in ms, and the rate sent."""
    handles = workload.begin_conversations(nodes.a, 10)
    committed: dict[int, float] = {}
    received: list[tuple[int, float, float]] = []  # (message number, enqueued on B, returned by receive)
    total = int(rate * seconds) // LATENCY_BATCH * LATENCY_BATCH
    stop = threading.Event()
    padding = bytes(workload.MESSAGE_BYTES - 8)

    def read() -> None:
        listener = psycopg2.connect(nodes.b_url)
        listener.autocommit = True
        listener.cursor().execute("LISTEN broker_queue")
        reader = psycopg2.connect(nodes.b_url)
        while not stop.is_set():
            with reader.cursor() as cursor:
                cursor.execute(RECEIVE_TIMED)
                rows = cursor.fetchall()
            seen = time.time()
            reader.commit()
            received.extend((struct.unpack("q", bytes(body[:8]))[0], float(enqueued_at), seen) for body, enqueued_at in rows)
            if not rows and select.select([listener], [], [], 0.1)[0]:
                listener.poll()
                listener.notifies.clear()
        listener.close()
        reader.close()

    readers = [threading.Thread(target=read) for _ in range(2)]
    for reader in readers:
        reader.start()
    started = time.monotonic()
    try:
        with nodes.a.cursor() as cursor:
            for first in range(0, total, LATENCY_BATCH):
                pause = started + first / rate - time.monotonic()
                if pause > 0:
                    time.sleep(pause)
                numbers = range(first, first + LATENCY_BATCH)
                cursor.execute(workload.SEND_BATCH, {
                    "handles": [handles[first // LATENCY_BATCH % len(handles)]] * LATENCY_BATCH,
                    "bodies": [psycopg2.Binary(struct.pack("q", number) + padding) for number in numbers]})
                nodes.a.commit()
                committed.update(dict.fromkeys(numbers, time.time()))  # wall clock, as the database's
        offered_s = time.monotonic() - started
        deadline = time.monotonic() + 30
        while len(received) < total and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        stop.set()
        for reader in readers:
            reader.join()
    if len(received) < total:
        raise RuntimeError(f"only {len(received):,} of {total:,} messages arrived within 30 s")
    measured = [entry for entry in received if entry[0] >= total // 10]  # the first tenth warms up
    ordered = sorted((seen - committed[number]) * 1000 for number, _, seen in measured)
    arrived = sorted((enqueued - committed[number]) * 1000 for number, enqueued, _ in measured)
    return ordered, arrived, total / offered_s


def _percentile(ordered: list[float], share: float) -> float:
    return ordered[int(len(ordered) * share)]


def latency(nodes: TwoNodes, rate: int, seconds: float, repetitions: int,
            report: Callable[[str], None]) -> ScenarioResult:
    """The latencies of `repetitions` runs of `seconds` each: the target must hold in every run."""
    p50s, p99s, arrived_p50s, arrived_p99s, every = [], [], [], [], []
    for repetition in range(1, repetitions + 1):
        ordered, arrived, sent_per_s = _latencies(nodes, rate, seconds)
        p50s.append(_percentile(ordered, 0.5))
        p99s.append(_percentile(ordered, 0.99))
        arrived_p50s.append(_percentile(arrived, 0.5))
        arrived_p99s.append(_percentile(arrived, 0.99))
        every += ordered
        report(f"cross-node latency: repetition {repetition}/{repetitions}: p50 {p50s[-1]:.1f} ms, "
               f"p99 {p99s[-1]:.1f} ms at {sent_per_s:,.0f} msgs/s sent")
    every.sort()
    return ScenarioResult("cross-node latency (p50; p99 in details)", Measurement("commit → receive, p50", "ms", p50s),
                          target="p50 ≤ 5 ms and p99 ≤ 25 ms in every run",
                          met=max(p50s) <= 5 and max(p99s) <= 25,
                          details={"p50_ms": p50s, "p99_ms": p99s, "p999_ms": _percentile(every, 0.999),
                                   "offered_msgs_per_s": rate, "per_transaction": LATENCY_BATCH,
                                   "seconds_per_run": seconds,
                                   "arrived_p50_ms": arrived_p50s, "arrived_p99_ms": arrived_p99s,
                                   "mean_ms": statistics.fmean(every)},
                          series={"latencies_ms": [round(value, 3) for value in every]})


def scale(nodes: TwoNodes, points: list[int], messages: int, backlog: int,
          report: Callable[[str], None]) -> ScenarioResult:
    """Transfer throughput over more and more open conversations, then with a backlog waiting on B."""
    payloads = workload.bodies()
    curve = []
    handles: list[str] = []
    for conversations in points:
        handles, opened_per_s = open_conversations(nodes, conversations, payloads)
        count = max(messages, conversations)
        rate = _transfer(nodes, handles, count, payloads)
        nodes.clear_arrived()
        curve.append({"label": f"{conversations:,}", "conversations": conversations, "msgs_per_s": rate,
                      "conversations_opened_per_s": opened_per_s})
        report(f"scale: {conversations:,} conversations (opened at {opened_per_s:,.0f}/s), {count:,} messages: "
               f"{rate:,.0f} msgs/s")
    with nodes.b.cursor() as cursor:
        cursor.execute(BACKLOG, {"body": payloads[0], "messages": backlog})
        cursor.execute("VACUUM ANALYZE broker.queue_messages")
    count = max(messages, points[-1])
    rate = _transfer(nodes, handles, count, payloads)
    curve.append({"label": f"{points[-1]:,} + {backlog:,} backlog", "conversations": points[-1], "msgs_per_s": rate})
    report(f"scale: {points[-1]:,} conversations over a backlog of {backlog:,}: {rate:,.0f} msgs/s")
    rates = [point["msgs_per_s"] for point in curve]
    flat = max(rates) <= SCALE_FLAT_WITHIN * min(rates)
    return ScenarioResult("cross-node at scale (min of the curve)",
                          Measurement("transfer, slowest point", "msgs/s", [min(rates)]),
                          target=f"flat within {SCALE_FLAT_WITHIN - 1:.0%}", met=flat,
                          details={"curve": curve, "max_over_min": max(rates) / min(rates),
                                   "backlog": f"{backlog:,} messages waiting in B's destination queue",
                                   "measured": "over conversations already open on both nodes"},
                          series={"scale": curve})
