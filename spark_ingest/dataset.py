"""The output dataset: one directory per committed run, named by its position range.

A run writes into `_incoming/` (Spark's readers skip names starting with "_")
and is committed by renaming that directory to `ingest_run=<after>-<up_to>`,
which a reader of the dataset sees as the `ingest_run` column.  The rename is
atomic on HDFS and local file systems, so a run is either wholly in the dataset
or not at all.  On a local file system (file:) the run's files and directories
are flushed to disk before the rename, and the directories the rename changed
after it, so that a run the checkpoint counts survives a power loss.  Goes
through Hadoop's FileSystem API, so the output may be any file system the
cluster can write (hdfs://, file://, ...).
"""
import os
import re
import uuid
from dataclasses import dataclass
from pathlib import Path

from broker.spark_ingest.errors import IngestError

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

    def overlaps(self, other: "Run") -> bool:
        return self.after_position < other.up_to_position and other.after_position < self.up_to_position


def _fsync(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


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
        return sorted((run for run in runs if run), key=lambda run: (run.after_position, run.up_to_position))

    def clear_staging(self) -> None:
        """Removes what killed runs left half-written."""
        self._fs.delete(self._child(STAGING), True)

    def staging_location(self, run: Run) -> str:
        return self._child(STAGING, f"{run.run_id}-{uuid.uuid4().hex}").toString()

    def location(self, run: Run) -> str:
        return self._child(RUN_PREFIX + run.run_id).toString()

    def _local(self, path) -> Path | None:
        """Where a path of a file: dataset is on this machine; None on other file systems."""
        return Path(path.toUri().getPath()) if self._fs.getScheme() == "file" else None

    def _sync_tree(self, path) -> None:
        """Flushes every file and directory under path to disk (on file: datasets)."""
        local = self._local(path)
        for folder, _, files in os.walk(local) if local else ():
            for name in files:
                _fsync(Path(folder, name))
            _fsync(Path(folder))

    def _sync_directory_entries(self) -> None:
        """Flushes the entries that runs add and remove: the dataset's root, its staging directory, and the
        directories above the root, which a first run may have created (on file: datasets)."""
        local = self._local(self._root)
        if local:
            for folder in [local / STAGING, local, *local.parents]:
                if folder.is_dir():
                    _fsync(folder)

    def commit(self, staging_location: str, run: Run) -> None:
        """Renames a run's staging directory into the dataset, unless a run there already covers some of its
        positions; durable when it returns."""
        taken = [other.run_id for other in self.committed_runs() if other.overlaps(run)]
        if taken:
            raise IngestError(f"{self.uri} already holds run {taken[0]}, which covers positions of run {run.run_id}: "
                              f"another run committed it, so this one stops without committing")
        staging, target = self._path(staging_location), self._child(RUN_PREFIX + run.run_id)
        self._sync_tree(staging)
        if not self._fs.rename(staging, target):
            raise IngestError(f"could not rename {staging_location} to {target.toString()}")
        self._sync_directory_entries()

    def adopt(self, run: Run) -> None:
        """Makes a run that a killed run committed durable, as commit would have."""
        self._sync_tree(self._child(RUN_PREFIX + run.run_id))
        self._sync_directory_entries()

    def count(self, location: str) -> int:
        """Rows in a run's Parquet files (read from their footers)."""
        return self._spark.read.parquet(location).count()
