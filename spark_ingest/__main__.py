"""python -m spark_ingest (or spark-submit spark_ingest/__main__.py): one ingest run, progress on stderr."""
import argparse
import sys
from pathlib import Path

from broker.errors import BrokerError
from broker.settings import Settings
from broker.spark_ingest.errors import IngestError
from broker.spark_ingest.jdbc import spark_session
from broker.spark_ingest.job import ingest
from broker.spark_ingest.progress import Progress


def _print_progress(progress: Progress) -> None:
    print(f"ingest: {progress.partitions_done}/{progress.partitions} partitions, ~{progress.rows_done:,} of "
          f"{progress.rows:,} rows, {progress.rows_per_second:,.0f} rows/s", file=sys.stderr, flush=True)


def parser() -> argparse.ArgumentParser:
    settings = Settings()
    arguments = argparse.ArgumentParser(
        prog="spark_ingest",
        description="Ingest a broker queue's committed messages into a Parquet dataset, exactly once: each run "
                    "reads the positions above the last checkpoint up to a high-water mark fixed at its start.")
    arguments.add_argument("--queue", required=True, help="the queue to ingest")
    arguments.add_argument("--output", required=True, help="the dataset's location (a path or a Hadoop URI)")
    arguments.add_argument("--database-url", default=settings.database_url, required=settings.database_url is None,
                           help="the broker's database (default: BROKER_DATABASE_URL)")
    arguments.add_argument("--consume", action="store_true",
                           help="delete the ingested rows from the queue when the checkpoint commits")
    arguments.add_argument("--partitions", type=int,
                           help="JDBC reads, each a range of equal row count (default: 4 per core)")
    arguments.add_argument("--fetch-size", type=int, default=10_000, help="rows per JDBC fetch")
    arguments.add_argument("--master", help="Spark master URL (default: spark-submit's, else local[*])")
    arguments.add_argument("--jdbc-driver", type=Path, default=settings.jdbc_driver,
                           help="PostgreSQL JDBC driver jar (default: BROKER_JDBC_DRIVER, Debian's "
                                "/usr/share/java/postgresql.jar, the Maven and Ivy caches, else a download)")
    return arguments


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.partitions is not None and args.partitions < 1 or args.fetch_size < 1:
        print("spark_ingest: --partitions and --fetch-size must be at least 1", file=sys.stderr)
        return 2
    try:
        spark = spark_session(args.master, args.jdbc_driver)
        summary = ingest(spark, args.database_url, args.queue, args.output, partitions=args.partitions,
                         consume=args.consume, fetch_size=args.fetch_size, on_progress=_print_progress)
    except (BrokerError, IngestError) as error:
        print(f"spark_ingest: {error}", file=sys.stderr)
        return 1
    print(summary.describe())
    return 0


if __name__ == "__main__":
    sys.exit(main())
