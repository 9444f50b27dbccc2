"""Progress of a run's Spark job, from the status tracker, reported to a callback every second or so."""
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Progress:
    partitions_done: int
    partitions: int
    rows_done: int  # estimated from the partitions done: they are planned to be of equal size
    rows: int
    seconds: float

    @property
    def rows_per_second(self) -> float:
        return self.rows_done / self.seconds if self.seconds > 0 else 0.0


class ProgressReporter:
    """Reports the tasks of a job group while it runs; use as a context manager around the job."""

    def __init__(self, spark, job_group: str, partitions: int, rows: int,
                 report: Callable[[Progress], None], interval_s: float = 1.0):
        self._tracker = spark.sparkContext.statusTracker()
        self._job_group = job_group
        self._partitions = partitions
        self._rows = rows
        self._report = report
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ingest-progress", daemon=True)
        self._started = time.monotonic()

    def _tasks_done(self) -> int:
        done = 0
        for job_id in self._tracker.getJobIdsForGroup(self._job_group):
            job = self._tracker.getJobInfo(job_id)
            for stage_id in job.stageIds if job else ():
                stage = self._tracker.getStageInfo(stage_id)
                done += stage.numCompletedTasks if stage else 0
        return min(done, self._partitions)

    def _snapshot(self, done: int) -> Progress:
        rows_done = self._rows * done // self._partitions if self._partitions else 0
        return Progress(done, self._partitions, rows_done, self._rows, time.monotonic() - self._started)

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self._report(self._snapshot(self._tasks_done()))

    def __enter__(self) -> "ProgressReporter":
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()
