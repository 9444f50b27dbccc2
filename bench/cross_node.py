"""Cross-node scenarios: transfer throughput next to a bare relay, latency, and throughput at scale."""
import io
import select
import statistics
import struct
import threading
import time
import uuid
from collections.abc import Callable

import psycopg2
import psycopg2.extras

from bench import cpu, workload
from bench.databases import WalMeter
from bench.nodes import TwoNodes
from bench.otlp_sink import OtlpSink
from bench.results import Measurement, ScenarioResult, ratio_met

BARE_OUTBOX = ("CREATE TABLE IF NOT EXISTS bench_outbox (id bigserial PRIMARY KEY, conversation_id uuid NOT NULL,"
               " seq bigint NOT NULL, body bytea NOT NULL)")
BARE_INBOX = ("CREATE TABLE IF NOT EXISTS bench_inbox (id bigint PRIMARY KEY, conversation_id uuid NOT NULL,"
              " seq bigint NOT NULL, body bytea NOT NULL)")
BARE_INSERT = "INSERT INTO bench_outbox (conversation_id, seq, body) VALUES %s"
BARE_BATCH = "SELECT id, conversation_id, seq, body FROM bench_outbox ORDER BY id LIMIT 1000"
BARE_DELETE = "DELETE FROM bench_outbox WHERE id <= %s"
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


def _bare_relay(nodes: TwoNodes, conversations: int, messages: int, payloads: list) -> tuple[float, dict]:
    """The same traffic through a bare pipeline: multi-row INSERTs into an outbox table on A while a
    loop selects a batch, COPYs it into B, commits, deletes it from A and commits.  Returns its rate and its
    CPU a message in the groups of the broker's (bench.cpu)."""
    conversation_ids = [str(uuid.uuid4()) for _ in range(conversations)]
    sender = psycopg2.connect(nodes.a_url)
    source = psycopg2.connect(nodes.a_url)
    target = psycopg2.connect(nodes.b_url)
    try:
        for connection, create, table in ((source, BARE_OUTBOX, "bench_outbox"), (target, BARE_INBOX, "bench_inbox")):
            with connection.cursor() as cursor:
                cursor.execute(create)
                cursor.execute(f"TRUNCATE {table}")
            connection.commit()
        done_sending = threading.Event()
        roles = cpu.BareRoles(sender.get_backend_pid(), source.get_backend_pid(), target.get_backend_pid(),
                              nodes.a_url, threading.get_native_id())
        before = roles.times()

        def send() -> None:
            with sender.cursor() as cursor:
                for start in range(0, messages, workload.PER_TRANSACTION):
                    rows = [(conversation_ids[(start + i) % conversations], start + i, payloads[i])
                            for i in range(min(workload.PER_TRANSACTION, messages - start))]
                    psycopg2.extras.execute_values(cursor, BARE_INSERT, rows, page_size=len(rows))
                    sender.commit()
            done_sending.set()

        started = time.monotonic()
        sending = threading.Thread(target=send)
        sending.start()
        moved = 0
        deadline = started + 60 + messages / 500
        while moved < messages and time.monotonic() < deadline:
            with source.cursor() as cursor:
                cursor.execute(BARE_BATCH)
                rows = cursor.fetchall()
            source.rollback()
            if not rows:
                time.sleep(0.001)
                continue
            copy = io.StringIO("".join(f"{id_}\t{conversation}\t{seq}\t\\\\x{bytes(body).hex()}\n"
                                       for id_, conversation, seq, body in rows))
            with target.cursor() as cursor:
                cursor.copy_expert("COPY bench_inbox FROM STDIN", copy)
            target.commit()
            with source.cursor() as cursor:
                cursor.execute(BARE_DELETE, (rows[-1][0],))
            source.commit()
            moved += len(rows)
        sending.join()
        if moved < messages:
            raise RuntimeError(f"the bare relay moved {moved:,} of {messages:,} in time")
        rate = messages / (time.monotonic() - started)
        return rate, cpu.per_message_us(before, roles.times(), messages)
    finally:
        for connection in (sender, source, target):
            connection.close()


def transfer(nodes: TwoNodes, conversations: int, messages: int, repetitions: int,
             report: Callable[[str], None]) -> ScenarioResult:
    payloads = workload.bodies()
    handles, opened_per_s = open_conversations(nodes, conversations, payloads)
    _transfer(nodes, handles, min(messages, 5_000), payloads)  # warm the processes and caches
    nodes.clear_arrived()
    ours, bare, cpu_used, bare_cpu_used = [], [], [], []
    wal_bytes: dict[str, list[float]] = {"broker": [], "bare relay": []}
    roles = nodes.roles()
    wal = WalMeter(nodes.a_url)
    for repetition in range(1, repetitions + 1):
        (rate, bare_cpu), written = wal.written_during(lambda: _bare_relay(nodes, conversations, messages, payloads))
        bare.append(rate)
        bare_cpu_used.append(bare_cpu)
        wal_bytes["bare relay"].append(written / messages)
        before = roles.times()
        rate, written = wal.written_during(lambda: _transfer(nodes, handles, messages, payloads))
        ours.append(rate)
        wal_bytes["broker"].append(written / messages)
        cpu_used.append(cpu.per_message_us(before, roles.times(), messages))
        nodes.clear_arrived()
        report(f"cross-node transfer: repetition {repetition}/{repetitions}: bare relay {bare[-1]:,.0f} msgs/s, "
               f"broker {ours[-1]:,.0f} msgs/s, CPU {cpu_used[-1]['all']:.1f} µs a message (bare relay "
               f"{bare_cpu_used[-1]['all']:.1f}), WAL "
               f"{wal_bytes['broker'][-1]:,.0f} bytes a message (bare relay {wal_bytes['bare relay'][-1]:,.0f})")
    wal.close()
    cpu_us, bare_cpu_us = ({group: statistics.median(used[group] for used in runs) for group in runs[0]}
                           for runs in (cpu_used, bare_cpu_used))
    measured = Measurement(f"send_batch → relay → HTTP → accept, CPU {cpu_us['all']:.0f} µs a message over both "
                           "nodes", "msgs/s", ours)
    baseline = Measurement(f"bare relay: INSERT / SELECT, COPY, DELETE, CPU {bare_cpu_us['all']:.0f} µs a message",
                           "msgs/s", bare)
    return ScenarioResult("cross-node transfer", measured, baseline,
                          target="≥ 0.75 × baseline (and ≥ 1.0 × RabbitMQ: its row)",
                          met=ratio_met(measured, baseline, 0.75),
                          details={"conversations": conversations, "messages": messages,
                                   "per_transaction": workload.PER_TRANSACTION,
                                   "conversations_opened_per_s": opened_per_s,
                                   "cpu_us_per_message": cpu_us,
                                   "bare_relay_cpu_us_per_message": bare_cpu_us,
                                   # both nodes' databases, on one server
                                   "wal_bytes_per_message": {name: round(statistics.median(values))
                                                             for name, values in wal_bytes.items()},
                                   "measured": "over conversations already open on both nodes"})


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
