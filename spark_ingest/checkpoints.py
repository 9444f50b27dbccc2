"""The SQL an ingest run calls: one function per SQL function of broker/sql/functions/13_ingest.sql."""
from sqlalchemy import Connection

from broker import queries
from broker.errors import translated_errors


def try_lock(connection: Connection, queue: str, output: str) -> bool:
    """A session lock on (queue, output), held until the connection closes."""
    with translated_errors():
        return queries.call(connection, "try_lock_ingest", queue=queue, output=output).scalar_one()


def holds_lock(connection: Connection, queue: str, output: str) -> bool:
    """Whether this connection's session still holds the lock on (queue, output)."""
    with translated_errors():
        return queries.call(connection, "holds_ingest_lock", queue=queue, output=output).scalar_one()


def start(connection: Connection, queue: str, output: str) -> tuple[int, int]:
    """The checkpoint and the high-water mark: the run reads the positions in (after, up_to]."""
    with translated_errors():
        row = queries.select_from(connection, "start_ingest", queue=queue, output=output).one()
    return row.after_position, row.up_to_position


def partitions(connection: Connection, queue: str, after: int, up_to: int, count: int) -> list[tuple[int, int]]:
    """Up to `count` consecutive ranges of nearly equal size: (last position, rows) of each."""
    with translated_errors():
        rows = queries.select_from(connection, "ingest_partitions", queue=queue, after_position=after,
                                   up_to_position=up_to, partitions=count)
        return [(row.last_position, row.row_count) for row in rows]


def advance(connection: Connection, queue: str, output: str, after: int, up_to: int, run: str, rows: int,
            consume: bool) -> int:
    """Moves the checkpoint from after to up_to (and with consume deletes the range); the rows deleted.

    Refused (LockLost) unless this connection's session holds the lock on (queue, output)."""
    with translated_errors():
        return queries.call(connection, "advance_ingest_checkpoint", queue=queue, output=output,
                            after_position=after, up_to_position=up_to, run=run, rows_ingested=rows,
                            consume=consume).scalar_one()


def lag(connection: Connection, queue: str, output: str) -> tuple[int, float] | None:
    """The messages above the checkpoint of (queue, output) and the age of the oldest in seconds; None before
    its first run."""
    with translated_errors():
        row = connection.execute(queries.QUERIES["ingest_lag"], {"queue": queue, "output": output}).one_or_none()
    return None if row is None else (row.lag_messages, row.lag_s)
