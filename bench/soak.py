"""Steadiness: cross-node traffic at a steady rate for minutes, a reader consuming on B, and (unless told
not to) a transaction held open through the middle third: the classic cause of queue-table bloat.  Both
nodes' databases share one server, so the transaction holds back the vacuum of A's tables as well: its
xid is in every snapshot taken on that server."""
import statistics
import threading
import time
from collections.abc import Callable

import psycopg2

from bench import workload
from bench.databases import run_sql
from bench.nodes import TwoNodes
from bench.results import Measurement, ScenarioResult

DEAD_TUPLES = ("SELECT coalesce(sum(n_dead_tup), 0)::bigint FROM pg_stat_user_tables"
               " WHERE schemaname = 'broker' AND relname IN ('queue_messages', 'transmission_log')")
RECEIVE = "SELECT count(*) FROM broker.receive('bench_dst', 100)"
# What the sending node's log retains (the resend window and what waits), from the statistics: a count(*)
# over millions of rows every few seconds would weigh on what it measures.
RETAINED_LOG = ("SELECT n_live_tup, pg_total_relation_size(relid) FROM pg_stat_user_tables"
                " WHERE schemaname = 'broker' AND relname = 'transmission_log'")
SET_RESEND_WINDOW = "UPDATE broker.node SET resend_window = make_interval(secs => %(seconds)s)"
# A sample every 5 s, or twelve over a shorter run.
SAMPLE_EVERY_S = 5.0
SAMPLES_AT_LEAST = 12


def _dead_tuples(*urls: str) -> int:
    return sum(run_sql(url, DEAD_TUPLES)[0][0] for url in urls)


def _consume(url: str, stop: threading.Event) -> None:
    connection = psycopg2.connect(url)
    with connection.cursor() as cursor:
        while not stop.is_set():
            cursor.execute(RECEIVE)
            taken = cursor.fetchone()[0]
            connection.commit()
            if not taken:
                stop.wait(0.05)
    connection.close()


def run(nodes: TwoNodes, minutes: float, rate: int, window_s: int | None, hold: bool,
        report: Callable[[str], None]) -> ScenarioResult:
    if window_s is not None:
        run_sql(nodes.a_url, SET_RESEND_WINDOW, {"seconds": window_s})
    payloads = workload.bodies()
    handles = workload.begin_conversations(nodes.a, 1_000)
    stop = threading.Event()
    consumers = [threading.Thread(target=_consume, args=(nodes.b_url, stop)) for _ in range(2)]
    for consumer in consumers:
        consumer.start()
    held = psycopg2.connect(nodes.b_url)  # the long transaction: a snapshot held on B
    duration_s = minutes * 60
    started = time.monotonic()
    sample_every_s = min(SAMPLE_EVERY_S, duration_s / SAMPLES_AT_LEAST)
    samples, sent, next_sample, holding = [], 0, started + sample_every_s, False
    try:
        while (now := time.monotonic()) - started < duration_s:
            if hold and not holding and now - started >= duration_s / 3 and now - started < 2 * duration_s / 3:
                held.cursor().execute("SELECT txid_current(), count(*) FROM broker.queue_messages")
                holding = True
            elif holding and now - started >= 2 * duration_s / 3:
                held.rollback()
                holding = False
            due = int((now - started) * rate)
            if sent < due:
                count = min(workload.PER_TRANSACTION, due - sent)
                workload.send_round_robin(nodes.a, handles, count, payloads, first=sent)
                sent += count
            else:
                time.sleep(0.005)
            if now >= next_sample:
                delivered = sent - nodes.waiting()  # acknowledged by B
                rss = nodes.rss_mb()
                [(log_rows, log_bytes)] = run_sql(nodes.a_url, RETAINED_LOG)
                samples.append({"t_s": round(now - started, 1), "delivered": delivered, "holding": holding,
                                "log_rows": log_rows, "log_mb": round(log_bytes / 2**20, 1),
                                "dead_tuples": _dead_tuples(nodes.a_url, nodes.b_url),
                                "relay_rss_mb": round(rss["relay"], 1), "api_rss_mb": round(rss["api"], 1)})
                next_sample += sample_every_s
                report(f"soak: {samples[-1]['t_s']:.0f} s, {delivered:,} delivered, "
                       f"{samples[-1]['dead_tuples']:,} dead tuples{' (transaction held open)' if holding else ''}, "
                       f"A's log {log_rows:,} rows ({samples[-1]['log_mb']:,.0f} MB), "
                       f"relay {rss['relay']:.0f} MB, API {rss['api']:.0f} MB")
    finally:
        held.close()
        stop.set()
        for consumer in consumers:
            consumer.join()
    for before, sample in zip(samples, samples[1:]):
        sample["msgs_per_s"] = (sample["delivered"] - before["delivered"]) / (sample["t_s"] - before["t_s"])
    curve = samples[1:]
    quarter = max(1, len(curve) // 4)
    start_rate = statistics.median(s["msgs_per_s"] for s in curve[:quarter])
    end_rate = statistics.median(s["msgs_per_s"] for s in curve[-quarter:])
    growth = {name: curve[-1][f"{name}_rss_mb"] / curve[0][f"{name}_rss_mb"] - 1 for name in ("relay", "api")}
    # Bounded: once the long transaction has ended, vacuum brings the dead rows back down, below half
    # their peak or to where they were before the transaction began, whichever is higher.
    peak_dead = max(s["dead_tuples"] for s in curve)
    before_hold = max([s["dead_tuples"] for s in curve if s["t_s"] < duration_s / 3] or [0])
    bounded = curve[-1]["dead_tuples"] <= max(peak_dead / 2, before_hold)
    met = abs(end_rate / start_rate - 1) <= 0.2 and max(growth.values()) < 0.1 and bounded
    return ScenarioResult(
        f"soak, {minutes:g} min at {rate:,} msgs/s offered", Measurement("delivered, end of run", "msgs/s", [end_rate]),
        Measurement("delivered, start of run", "msgs/s", [start_rate]),
        target="throughput within 20% of its start, memory growth < 10%, dead tuples bounded", met=met,
        details={"rss_growth": growth, "resend_window_s": window_s, "log_rows_at_end": curve[-1]["log_rows"],
                 "log_rows_peak": max(s["log_rows"] for s in curve), "peak_dead_tuples": peak_dead,
                 "dead_tuples_before_the_hold": before_hold,
                 "dead_tuples_at_end": curve[-1]["dead_tuples"], "dead_tuples_bounded": bounded,
                 "long_transaction": "held open on B through the middle third" if hold else "none"},
        series={"soak": curve})

