"""Runs the scenarios on a throwaway database and writes the results."""
import os
import platform
import tempfile
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg2
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from broker import migrate
from broker.bench import spark_ingest
from broker.bench.results import ScenarioResult, write_results
from broker.embedded import EmbeddedPostgres


@contextmanager
def throwaway_database(server_url: str | None) -> Iterator[str]:
    """A fresh, migrated database: on the given server (created and dropped), else on an embedded one."""
    if server_url is None:
        with tempfile.TemporaryDirectory(prefix="broker-bench-") as folder, EmbeddedPostgres(Path(folder)) as server:
            migrate.upgrade(server.url())
            yield server.url()
        return
    name = f"broker_bench_{uuid.uuid4().hex[:12]}"
    admin = psycopg2.connect(server_url)
    admin.autocommit = True
    try:
        with admin.cursor() as cursor:
            cursor.execute(f"CREATE DATABASE {name}")
        url = make_url(server_url).set(database=name).render_as_string(hide_password=False)
        migrate.upgrade(url)
        yield url
    finally:
        with admin.cursor() as cursor:
            cursor.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        admin.close()


def _environment(engine) -> dict:
    import pyspark

    with engine.connect() as connection:
        settings = dict(connection.execute(text(
            "SELECT name, setting FROM pg_settings WHERE name IN ('fsync', 'synchronous_commit', 'server_version')")
        ).all())
    return {"cpus": os.cpu_count(), "python": platform.python_version(), "pyspark": pyspark.__version__,
            "postgresql": settings["server_version"], "fsync": settings["fsync"],
            "synchronous_commit": settings["synchronous_commit"]}


def run_bench(output: Path, *, quick: bool, repetitions: int, server_url: str | None,
              report: Callable[[str], None]) -> list[ScenarioResult]:
    with throwaway_database(server_url) as database_url:
        engine = create_engine(database_url)
        try:
            environment = _environment(engine)
            if environment["fsync"] != "on" or environment["synchronous_commit"] != "on":
                raise RuntimeError(f"the benchmark needs durable settings, the server has {environment}")
            results = [spark_ingest.run(engine, database_url, 20_000 if quick else 200_000, repetitions, report)]
        finally:
            engine.dispose()
    write_results(results, output, environment)
    return results
