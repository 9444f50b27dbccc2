"""One ingest run of a queue into a Parquet dataset, exactly once across crashes and reruns.

1. Lock (queue, output) for the run's session, and fix the range (checkpoint,
   high-water mark]: below the committed horizon, so no row can still appear in it.
2. If the dataset already holds a run starting at the checkpoint (a run killed
   after its commit, before its checkpoint), adopt it instead of writing again.
   A dataset that disagrees with the checkpoint (overlapping runs, runs past it)
   is refused.
3. Otherwise read the range over JDBC in partitions of nearly equal row counts,
   write Parquet into a staging directory and, if the session still holds the
   lock, rename it into the dataset (its files on disk first).
4. Advance the checkpoint (and with `consume`, delete the range) in one
   transaction, on the session that holds the lock, which the advance checks;
   then let the lock go, before the session closes.

A crash before step 3's rename leaves only staging files, removed by the next
run; a crash after it is step 2 of the next run.  A run whose lock's session
ends (see lock.py) stops without committing, since another run may hold it.
"""
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise

from sqlalchemy import create_engine
from sqlalchemy.pool import NullPool

from broker.names import NAME_PATTERN
from broker.spark_ingest import checkpoints
from broker.spark_ingest.dataset import Dataset, Run
from broker.spark_ingest.errors import IngestError
from broker.spark_ingest.jdbc import jdbc_connection
from broker.spark_ingest.lock import RunLock
from broker.spark_ingest.progress import Progress, ProgressReporter

OUTPUT_COLUMNS = ["queue_name", "queue_position", "conversation_id", "conversation_handle", "conversation_group_id",
                  "message_sequence_number", "service_name", "contract_name", "message_type", "body", "body_text",
                  "enqueued_at"]


@dataclass(frozen=True, slots=True)
class IngestSummary:
    queue: str
    output: str
    run: Run
    rows: int
    partitions: int
    seconds: float
    adopted: bool  # the run's output was already committed by a run killed before its checkpoint
    consumed: int

    @property
    def rows_per_second(self) -> float:
        return self.rows / self.seconds if self.seconds > 0 else 0.0

    def describe(self) -> str:
        if self.adopted:
            what = f"adopted run {self.run.run_id} ({self.rows:,} rows), committed earlier by a run that stopped"
        else:
            what = f"{self.rows:,} rows in {self.partitions} partitions, run {self.run.run_id}"
        consumed = f"; {self.consumed:,} rows consumed from the queue" if self.consumed else ""
        return (f"ingested queue {self.queue} into {self.output}: {what}, {self.seconds:.1f} s "
                f"({self.rows_per_second:,.0f} rows/s); checkpoint at position {self.run.up_to_position}{consumed}")


def _partition_predicates(queue: str, run: Run, plan: list[tuple[int, int]]) -> list[str]:
    """One WHERE clause per partition; together they cover (after, up_to] without gaps or overlaps."""
    if not re.fullmatch(NAME_PATTERN, queue):  # the pattern admits no quote: safe as a literal
        raise IngestError(f"{queue!r} is not a queue name")
    bounds = [run.after_position] + [last for last, _ in plan[:-1]] + [run.up_to_position]
    return [f"queue_name = '{queue}' AND queue_position > {low} AND queue_position <= {high}"
            for low, high in pairwise(bounds)]


def _write(spark, database_url: str, queue: str, dataset: Dataset, run: Run, plan: list[tuple[int, int]],
           fetch_size: int, lock: RunLock, on_progress: Callable[[Progress], None] | None) -> tuple[str, int]:
    """Writes the run into a staging directory: its location and the rows written."""
    from pyspark.sql import Observation
    from pyspark.sql import functions as F

    jdbc_url, properties = jdbc_connection(database_url, fetch_size)
    written = Observation("written")  # counts the rows as they are written: no second pass
    frame = (spark.read.jdbc(jdbc_url, "broker.destination_queue", predicates=_partition_predicates(queue, run, plan),
                             properties=properties)
             .withColumn("body_text", F.when(F.col("validation") == "json", F.decode("body", "UTF-8")))
             .select(*OUTPUT_COLUMNS)
             .observe(written, F.count(F.lit(1)).alias("rows")))
    staging = dataset.staging_location(run)
    job_group = f"broker-ingest {queue} {run.run_id}"
    spark.sparkContext.setJobGroup(job_group, f"ingest of queue {queue}, positions {run.run_id}")
    with lock.watched(on_loss=lambda: spark.sparkContext.cancelJobGroup(job_group)), \
            ProgressReporter(spark, job_group, len(plan), sum(rows for _, rows in plan),
                             on_progress or (lambda _: None)):
        frame.write.mode("errorifexists").parquet(staging)
    return staging, written.get["rows"]


def _run_to_adopt(dataset: Dataset, queue: str, checkpoint: int) -> Run | None:
    """The run at the checkpoint that a run killed before advancing it left in the dataset, if there is one.

    Refuses a dataset that disagrees with the checkpoint: runs that overlap hold some messages twice, and runs
    past the checkpoint, other than one starting at it, were not committed with this database's checkpoint."""
    runs = dataset.committed_runs()
    furthest = None
    for run in runs:
        if furthest and furthest.overlaps(run):
            raise IngestError(f"{dataset.uri} holds overlapping runs {furthest.run_id} and {run.run_id}: the "
                              f"positions they share are in the dataset twice; delete the directory of the run that "
                              f"the checkpoint of queue {queue!r} did not advance over (broker.ingests.last_run "
                              f"names the latest that it did), then run the ingest again")
        if furthest is None or run.up_to_position > furthest.up_to_position:
            furthest = run
    ahead = [run for run in runs if run.up_to_position > checkpoint]
    if ahead and (len(ahead) > 1 or ahead[0].after_position != checkpoint):
        raise IngestError(f"{dataset.uri} holds runs past the checkpoint at position {checkpoint} "
                          f"({', '.join(run.run_id for run in ahead)}): it does not belong with "
                          f"this database's checkpoint of queue {queue!r}")
    return ahead[0] if ahead else None


def ingest(spark, database_url: str, queue: str, output: str, *, partitions: int | None = None,
           consume: bool = False, fetch_size: int = 10_000,
           on_progress: Callable[[Progress], None] | None = None) -> IngestSummary:
    started = time.monotonic()
    dataset = Dataset(spark, output)
    engine = create_engine(database_url, poolclass=NullPool)
    try:
        with engine.connect() as session:
            lock = RunLock(session, queue, dataset.uri)
            lock.acquire()
            with lock.transaction() as connection:
                after, up_to = checkpoints.start(connection, queue, dataset.uri)
            dataset.clear_staging()
            run = _run_to_adopt(dataset, queue, after)
            adopted, plan = run is not None, []
            if adopted:
                rows = dataset.count(dataset.location(run))
                dataset.adopt(run)
            else:
                run, rows = Run(after, up_to), 0
                with lock.transaction() as connection:
                    plan = checkpoints.partitions(connection, queue, after, up_to,
                                                  partitions or 4 * spark.sparkContext.defaultParallelism)
                if plan:
                    staging, rows = _write(spark, database_url, queue, dataset, run, plan, fetch_size, lock,
                                           on_progress)
                    lock.verify()
                    dataset.commit(staging, run)
            with lock.explaining_failures(), lock.transaction() as connection:
                consumed = checkpoints.advance(connection, queue, dataset.uri, run.after_position,
                                               run.up_to_position, run.run_id, rows, consume)
            lock.release()
    finally:
        engine.dispose()
    return IngestSummary(queue, dataset.uri, run, rows, len(plan), time.monotonic() - started, adopted, consumed)
