"""Spark ingest: `broker ingest` of N 1 KB messages against a plain spark.read.jdbc → Parquet of the same rows; and
how soon a batch lands with `broker ingest --follow` against a one-shot `broker ingest` started for it."""
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from sqlalchemy import Engine, create_engine, text

from bench.results import Measurement, ScenarioResult, ratio_met
from broker.spark_ingest.jdbc import jdbc_connection, spark_session
from broker.spark_ingest.job import ingest

QUEUE = "bench_ingest_queue"

# The catalog, and N messages of 1 KB sent in transactions of 100, in the server.
DEFINE_CATALOG = """
SELECT broker.create_message_type('bench.record', 'none');
SELECT broker.create_contract('bench.ingest', '{"bench.record": "initiator"}');
SELECT broker.create_queue('bench_ingest_source');
SELECT broker.create_queue('bench_ingest_queue');
SELECT broker.create_service('bench_ingest_sender', 'bench_ingest_source');
SELECT broker.create_service('bench_ingest_receiver', 'bench_ingest_queue', ARRAY['bench.ingest']);
"""
SEND_A_CONVERSATION = """
SELECT broker.send(h.handle, 'bench.record', convert_to(lpad(i::text, 1024, 'x'), 'UTF8'))
FROM (SELECT broker.begin_dialog('bench_ingest_sender', 'bench_ingest_receiver', 'bench.ingest') AS handle) h,
     generate_series(1, :messages) i
"""
QUEUE_BOUNDS = """
SELECT min(queue_position), max(queue_position), count(*)
FROM broker.queue_messages WHERE queue_id = (SELECT queue_id FROM broker.queues WHERE name = :queue)
"""
FORGET_CHECKPOINTS = "DELETE FROM broker.ingest_checkpoints"
# Whether anything of the queue is not yet in the dataset: no run yet, or a message above the checkpoint.  Asked
# every 20 ms while a batch lands, so it stops at the first such message instead of counting them.
NOT_ALL_INGESTED = """
SELECT NOT EXISTS (SELECT FROM broker.ingest_checkpoints c WHERE c.output = :output)
       OR EXISTS (SELECT FROM broker.ingest_checkpoints c
                  JOIN broker.queue_messages m ON m.queue_id = c.queue_id AND m.queue_position > c.queue_position
                  WHERE c.output = :output)
"""
BROKER = Path(sys.executable).parent / "broker"


def load(engine: Engine, messages: int, report: Callable[[str], None]) -> None:
    with engine.begin() as connection:
        connection.exec_driver_sql(DEFINE_CATALOG)
    for sent in range(0, messages, 100):
        with engine.begin() as connection:
            connection.execute(text(SEND_A_CONVERSATION), {"messages": 100})
        if sent % 20_000 == 0:
            report(f"spark ingest: loading {messages:,} messages, {sent:,} sent")


def run(database_url: str, messages: int, repetitions: int, report: Callable[[str], None]) -> ScenarioResult:
    engine = create_engine(database_url)
    try:
        return _measure(engine, database_url, messages, repetitions, report)
    finally:
        engine.dispose()


def _measure(engine: Engine, database_url: str, messages: int, repetitions: int,
             report: Callable[[str], None]) -> ScenarioResult:
    load(engine, messages, report)
    with engine.connect() as connection:
        low, high, count = connection.execute(text(QUEUE_BOUNDS), {"queue": QUEUE}).one()
    spark = spark_session("local[2]")
    partitions = 4 * spark.sparkContext.defaultParallelism
    jdbc_url, properties = jdbc_connection(database_url, 10_000)
    folder = Path(tempfile.mkdtemp(prefix="broker-bench-ingest-"))

    def plain_read() -> float:
        target = folder / "plain"
        shutil.rmtree(target, ignore_errors=True)
        started = time.monotonic()
        (spark.read.jdbc(jdbc_url, f"(SELECT * FROM broker.destination_queue WHERE queue_name = '{QUEUE}') q",
                         column="queue_position", lowerBound=low, upperBound=high + 1, numPartitions=partitions,
                         properties=properties)
         .write.parquet(str(target)))
        return count / (time.monotonic() - started)

    def broker_ingest() -> float:
        target = folder / "ingest"
        shutil.rmtree(target, ignore_errors=True)
        with engine.begin() as connection:
            connection.execute(text(FORGET_CHECKPOINTS))
        started = time.monotonic()
        summary = ingest(spark, database_url, QUEUE, str(target), partitions=partitions)
        if summary.rows != count:
            raise RuntimeError(f"the ingest wrote {summary.rows:,} rows of {count:,}")
        return count / (time.monotonic() - started)

    try:
        plain_read(), broker_ingest()  # warm the JVM, the JDBC driver and the Parquet writer
        plain, ours = [], []
        for repetition in range(1, repetitions + 1):
            plain.append(plain_read())
            ours.append(broker_ingest())
            report(f"spark ingest: repetition {repetition}/{repetitions}: plain read {plain[-1]:,.0f} rows/s, "
                   f"broker ingest {ours[-1]:,.0f} rows/s")
    finally:
        spark.stop()
        shutil.rmtree(folder, ignore_errors=True)
    measured = Measurement("broker ingest", "rows/s", ours)
    baseline = Measurement("spark.read.jdbc → Parquet", "rows/s", plain)
    return ScenarioResult("Spark ingest", measured, baseline, target="≥ 0.8 × baseline",
                          met=ratio_met(measured, baseline, 0.8),
                          details={"messages": count, "message_bytes": 1024, "master": "local[2]",
                                   "partitions": partitions})


def follow(database_url: str, batch: int, repetitions: int, report: Callable[[str], None]) -> ScenarioResult:
    """A batch of `batch` messages committed in one transaction, then the time until it is in a dataset: of a
    `broker ingest --follow` already running (woken by the commit, its Spark started), against a one-shot
    `broker ingest` started at the commit, as a scheduler starts one (Spark's start included)."""
    engine = create_engine(database_url)
    folder = Path(tempfile.mkdtemp(prefix="broker-bench-follow-"))
    environment = {**os.environ, "BROKER_DATABASE_URL": database_url}
    command = [str(BROKER), "ingest", "--master", "local[2]", "--queue", QUEUE]
    log = (folder / "follow.log").open("wb")
    following = None
    try:
        load(engine, 0, report)  # the catalog
        following = subprocess.Popen([*command, "--output", str(folder / "follow"), "--follow"], env=environment,
                                     stdout=log, stderr=subprocess.STDOUT)

        def waiting() -> bool:
            if following.poll() is not None:
                raise RuntimeError(f"broker ingest --follow ended: see its log {folder / 'follow.log'}")
            with engine.connect() as connection:
                return connection.execute(text(NOT_ALL_INGESTED), {"output": f"file:{folder / 'follow'}"}).scalar()

        def send_batch() -> float:
            with engine.begin() as connection:
                connection.execute(text(SEND_A_CONVERSATION), {"messages": batch})
            return time.monotonic()

        def landed_by_follow() -> float:
            committed = send_batch()
            while waiting():
                time.sleep(0.02)
            return batch / (time.monotonic() - committed)

        def landed_by_one_shot() -> float:
            following.send_signal(signal.SIGSTOP)  # not woken by this batch: the one-shot run has the CPUs
            try:
                committed = send_batch()
                subprocess.run([*command, "--output", str(folder / "one-shot")], env=environment, check=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                rate = batch / (time.monotonic() - committed)
            finally:
                following.send_signal(signal.SIGCONT)
            while waiting():  # the follow takes the batch too, before the next measurement
                time.sleep(0.02)
            return rate

        deadline = time.monotonic() + 300
        while waiting():  # Spark started and the first (empty) run done
            if time.monotonic() > deadline:
                raise RuntimeError("broker ingest --follow did not start within 300 s")
            time.sleep(0.1)
        landed_by_follow()  # warm the JDBC driver and the Parquet writer
        ours, one_shot = [], []
        for repetition in range(1, repetitions + 1):
            ours.append(landed_by_follow())
            one_shot.append(landed_by_one_shot())
            report(f"spark ingest --follow: repetition {repetition}/{repetitions}: a batch of {batch:,} in the "
                   f"dataset at {ours[-1]:,.0f} rows/s with --follow, {one_shot[-1]:,.0f} rows/s by a one-shot run")
    finally:
        if following is not None:
            following.send_signal(signal.SIGTERM)  # stops between runs
            following.wait(timeout=120)
        log.close()
        engine.dispose()
        shutil.rmtree(folder, ignore_errors=True)
    measured = Measurement("broker ingest --follow", "rows/s", ours)
    baseline = Measurement("one-shot broker ingest per batch", "rows/s", one_shot)
    return ScenarioResult("Spark ingest --follow, a batch from commit to dataset", measured, baseline,
                          target="> baseline", met=ratio_met(measured, baseline, 1.0),
                          details={"batch_messages": batch, "message_bytes": 1024, "master": "local[2]"})
