"""The benchmark's databases: fresh, migrated ones on one server, dropped afterwards."""
import tempfile
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import TypeVar

import psycopg2
from sqlalchemy.engine import make_url

from broker import migrate
from broker.cli.embedded import EmbeddedPostgres

T = TypeVar("T")


class WalMeter:
    """How many bytes of WAL the server writes while an action runs: what a way of sending costs in writes.  Every
    database of the benchmark is on one server and one scenario runs at a time, so this is the whole server's."""

    def __init__(self, url: str):
        self.connection = psycopg2.connect(url)
        self.connection.autocommit = True

    def written_during(self, action: Callable[[], T]) -> tuple[T, int]:
        with self.connection.cursor() as cursor:
            cursor.execute("SELECT pg_current_wal_insert_lsn()")
            (before,) = cursor.fetchone()
            result = action()
            cursor.execute("SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), %s)", (before,))
            return result, int(cursor.fetchone()[0])

    def close(self) -> None:
        self.connection.close()


class BenchServer:
    """Creates databases broker_bench_* on a server and drops them when closed."""

    def __init__(self, server_url: str):
        self.server_url = server_url
        self.created: list[str] = []

    def database(self, label: str) -> str:
        """A new database migrated to head; returns its URL."""
        name = f"broker_bench_{label}_{uuid.uuid4().hex[:8]}"
        self._admin(f"CREATE DATABASE {name}")
        self.created.append(name)
        url = make_url(self.server_url).set(database=name).render_as_string(hide_password=False)
        migrate.upgrade(url)
        return url

    def close(self) -> None:
        for name in self.created:
            self._admin(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")

    def _admin(self, statement: str) -> None:
        admin = psycopg2.connect(self.server_url)
        try:
            admin.autocommit = True
            with admin.cursor() as cursor:
                cursor.execute(statement)
        finally:
            admin.close()


def run_sql(database_url: str, statement: str, params: dict | None = None) -> list[tuple]:
    """Runs the statement on a connection and in a transaction of its own; returns its rows."""
    connection = psycopg2.connect(database_url)
    try:
        with connection, connection.cursor() as cursor:
            cursor.execute(statement, params)
            return cursor.fetchall() if cursor.description else []
    finally:
        connection.close()


@contextmanager
def bench_server(server_url: str | None) -> Iterator[BenchServer]:
    """The given server, or an embedded PostgreSQL in a temporary folder."""
    with ExitStack() as stack:
        if server_url is None:
            folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="broker-bench-"))
            server_url = stack.enter_context(EmbeddedPostgres(Path(folder))).url()
        bench = BenchServer(server_url)
        stack.callback(bench.close)
        yield bench
