"""The output dataset: one directory per committed run, named by its position range.

A run writes into `_incoming/` (Spark's readers skip names starting with "_")
and is committed by renaming that directory to `ingest_run=<after>-<up_to>`,
which a reader of the dataset sees as the `ingest_run` column.  The rename is
atomic on HDFS and local file systems, so a run is either wholly in the dataset
or not at all.  Goes through Hadoop's FileSystem API, so the output may be any
file system the cluster can write (hdfs://, file://, ...).
"""
import re
import uuid
from dataclasses import dataclass

from spark_ingest.errors import IngestError

RUN_PREFIX = "ingest_run="
STAGING = "_incoming"
_RUN_NAME = re.compile(re.escape(RUN_PREFIX) + r"(\d+)-(\d+)")


@dataclass(frozen=True, slots=True)
class Run:
    """A run's range of queue positions: (after_position, up_to_position]."""

    after_position: int
    up_to_position: int

    @property
    def run_id(self) -> str:
        return f"{self.after_position}-{self.up_to_position}"

    @classmethod
    def from_directory_name(cls, name: str) -> "Run | None":
        match = _RUN_NAME.fullmatch(name)
        return cls(int(match[1]), int(match[2])) if match else None


class Dataset:
    def __init__(self, spark, output: str):
        self._spark = spark
        jvm = spark.sparkContext._jvm
        self._path = jvm.org.apache.hadoop.fs.Path
        given = self._path(output)
        self._fs = given.getFileSystem(spark.sparkContext._jsc.hadoopConfiguration())
        self._root = self._fs.makeQualified(given)
        # The dataset's fully qualified location, which names its checkpoint.
        self.uri = self._root.toString()

    def _child(self, *names: str):
        path = self._root
        for name in names:
            path = self._path(path, name)
        return path

    def committed_runs(self) -> list[Run]:
        if not self._fs.exists(self._root):
            return []
        runs = (Run.from_directory_name(status.getPath().getName()) for status in self._fs.listStatus(self._root))
        return sorted((run for run in runs if run), key=lambda run: run.after_position)

    def clear_staging(self) -> None:
        """Removes what killed runs left half-written."""
        self._fs.delete(self._child(STAGING), True)

    def staging_location(self, run: Run) -> str:
        return self._child(STAGING, f"{run.run_id}-{uuid.uuid4().hex}").toString()

    def location(self, run: Run) -> str:
        return self._child(RUN_PREFIX + run.run_id).toString()

    def commit(self, staging_location: str, run: Run) -> None:
        target = self._child(RUN_PREFIX + run.run_id)
        if self._fs.exists(target):
            raise IngestError(f"{target.toString()} already exists")
        if not self._fs.rename(self._path(staging_location), target):
            raise IngestError(f"could not rename {staging_location} to {target.toString()}")

    def count(self, location: str) -> int:
        """Rows in a run's Parquet files (read from their footers)."""
        return self._spark.read.parquet(location).count()
