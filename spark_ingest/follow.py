"""`broker ingest --follow`: ingest runs one after another in one SparkSession, each soon after messages commit to
the queue, until SIGTERM or SIGINT.

Each round is a run exactly as job.ingest does it, with its own lock, range and checkpoint, so a follow killed at
any instant leaves every message in the dataset once, as any run does.  Between rounds the follow's own session
waits for the queue's notification (broker._enqueue notifies channel broker_queue with the queue's id as the
enqueuing transaction commits), or at most the interval, which also catches rows that a long transaction
elsewhere held above a run's high-water mark.  A round starts only when messages wait above the checkpoint, so a
wake-up for nothing costs one query and no Spark job.
"""
import logging
import os
import select
import signal
import time

import psycopg2
from sqlalchemy import create_engine
from sqlalchemy.pool import NullPool

from broker import queries
from broker.spark_ingest import checkpoints
from broker.spark_ingest.dataset import Dataset
from broker.spark_ingest.job import ingest

log = logging.getLogger(__name__)


class StopSignals:
    """SIGTERM and SIGINT while in use: the first asks the follow to stop after the run in progress, a second
    one stops it at once (KeyboardInterrupt; that run commits nothing and the next run reads it again).

    Each signal also writes a byte to `wakeup` (signal.set_wakeup_fd), which the wait between rounds watches."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.requested = False
        self.wakeup, self._wakeup_writer = os.pipe()
        os.set_blocking(self.wakeup, False)
        os.set_blocking(self._wakeup_writer, False)

    def _handle(self, signum: int, _frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        log.info("%s: stopping after the run in progress (a second signal stops at once)",
                 signal.Signals(signum).name)

    def __enter__(self) -> "StopSignals":
        self._previous = {signum: signal.signal(signum, self._handle) for signum in self.SIGNALS}
        self._previous_wakeup = signal.set_wakeup_fd(self._wakeup_writer)
        return self

    def __exit__(self, *exc_info: object) -> None:
        signal.set_wakeup_fd(self._previous_wakeup)
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        os.close(self.wakeup)
        os.close(self._wakeup_writer)


class QueueWatch:
    """The follow's session between runs: listens for the queue's arrivals and reads the ingest's lag.  Opened
    again on the next round after it breaks (which wakes the wait, so that the round looks at once)."""

    def __init__(self, database_url: str, queue: str, output: str):
        self._engine = create_engine(database_url, poolclass=NullPool, isolation_level="AUTOCOMMIT")
        self._queue = queue
        self._output = output
        self._session = None
        self._queue_id: str | None = None  # the notifications' payload

    def open(self) -> None:
        """Listens from now on: a message committed after this wakes the next wait."""
        if self._session is None:
            self._session = self._engine.connect()
            self._session.execute(queries.QUERIES["listen_for_arrivals"])
            queue_id = self._session.execute(queries.QUERIES["queue_id"], {"queue": self._queue}).scalar()
            self._queue_id = None if queue_id is None else str(queue_id)

    def lag(self) -> tuple[int, float] | None:
        return checkpoints.lag(self._session, self._queue, self._output)

    def wait(self, timeout_s: float, wakeup: int) -> None:
        """Until a notification for the queue, timeout_s, or a byte on wakeup.  Notifications that came in while
        the session ran a query (the lag after a run) are waiting in its list already, not on its socket."""
        listening = self._session.connection.driver_connection
        deadline = time.monotonic() + timeout_s
        while not self._arrived(listening) and (left := deadline - time.monotonic()) > 0:
            readable, _, _ = select.select([wakeup, listening], [], [], left)
            if wakeup in readable:
                os.read(wakeup, 512)
                return
            if readable:
                try:
                    listening.poll()
                except psycopg2.Error as error:  # the session broke: the next round opens another and looks
                    log.warning("stopped listening for arrivals (%s); listening again",
                                (str(error).strip() or type(error).__name__).splitlines()[0])
                    self.close()
                    return

    def _arrived(self, listening) -> bool:
        arrived = any(notice.payload == self._queue_id for notice in listening.notifies)
        listening.notifies.clear()
        return arrived

    def close(self) -> None:
        if self._session is not None:
            self._session.close()
            self._session = None

    def dispose(self) -> None:
        self.close()
        self._engine.dispose()


def follow(spark, database_url: str, queue: str, output: str, stop: StopSignals, *, interval_s: float,
           partitions: int | None = None, consume: bool = False, fetch_size: int = 10_000) -> int:
    """Runs a round whenever messages wait above the checkpoint, until stop is requested: the rounds run."""
    uri = Dataset(spark, output).uri
    watch = QueueWatch(database_url, queue, uri)
    rounds = 0
    log.info("following queue %s into %s: a run whenever messages commit, at least every %g s while some wait; "
             "SIGTERM or Ctrl-C stops after the run in progress", queue, uri, interval_s)
    try:
        while not stop.requested:
            watch.open()
            waiting = watch.lag()
            if waiting is None or waiting[0] > 0:
                summary = ingest(spark, database_url, queue, uri, partitions=partitions, consume=consume,
                                 fetch_size=fetch_size)
                rounds += 1
                messages, seconds = watch.lag()
                log.info("round %d: %s; lag %s messages, oldest %.1f s", rounds, summary.describe(),
                         f"{messages:,}", seconds)
            if not stop.requested:
                watch.wait(interval_s, stop.wakeup)
    finally:
        watch.dispose()
    log.info("stopped after %d rounds", rounds)
    return rounds
