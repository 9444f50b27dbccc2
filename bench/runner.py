"""Runs the scenarios on throwaway databases and writes the results and charts."""
import os
import platform
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from bench import activation, cross_node, local, rabbitmq, rest, soak, spark_ingest
from bench.charts import write_charts
from bench.databases import BenchServer, bench_server, run_sql
from bench.nodes import TwoNodes
from bench.results import ScenarioResult, write_results

SETTINGS = "SELECT name, setting FROM pg_settings WHERE name IN ('fsync', 'synchronous_commit', 'server_version')"


@dataclass(frozen=True)
class Sizes:
    """How much each scenario moves: the full run, or a smoke run with --quick."""

    send: int
    receive: int
    transfer: int
    latency_s: float
    rest_per_client: int
    rabbitmq: int
    spark: int
    scale_points: tuple[int, ...]
    scale_messages: int
    backlog: int
    activation: int


FULL = Sizes(send=50_000, receive=20_000, transfer=50_000, latency_s=15, rest_per_client=500, rabbitmq=50_000,
             spark=200_000, scale_points=(1, 100, 10_000, 100_000), scale_messages=50_000, backlog=1_000_000,
             activation=20_000)
QUICK = Sizes(send=2_000, receive=1_000, transfer=2_000, latency_s=2, rest_per_client=20, rabbitmq=2_000,
              spark=20_000, scale_points=(1, 100, 500, 2_000), scale_messages=2_000, backlog=4_000,
              activation=1_000)


def _environment(database_url: str) -> dict:
    import pyspark

    settings = dict(run_sql(database_url, SETTINGS))
    return {"cpus": os.cpu_count(), "python": platform.python_version(), "pyspark": pyspark.__version__,
            "postgresql": settings["server_version"], "fsync": settings["fsync"],
            "synchronous_commit": settings["synchronous_commit"]}


def _scenarios(server: BenchServer, output: Path, sizes: Sizes, repetitions: int, pgmq_sql: Path | None,
               report: Callable[[str], None]) -> list[ScenarioResult]:
    log = output / "nodes.log"
    results = local.send(server, sizes.send, repetitions, report, pgmq_sql)
    for readers in (1, 4):
        results += local.receive(server, sizes.receive, repetitions, readers, report, pgmq_sql)
    with TwoNodes(server, log) as nodes:
        transfers = cross_node.transfer(nodes, 1_000, sizes.transfer, repetitions, report)
        results += transfers
        transfer = transfers[0].measured.median
        results.append(cross_node.latency(nodes, 1_000, sizes.latency_s, repetitions, report))
        results.append(cross_node.traced(nodes, 1_000, sizes.transfer, repetitions, report))
        results.append(cross_node.resend_window(nodes, 1_000, sizes.transfer, repetitions, report))
    results.append(activation.run(server, log, sizes.activation, repetitions, report))
    results.append(rest.run(server, log, 4, sizes.rest_per_client, report))
    peer = rabbitmq.run(sizes.rabbitmq, repetitions, report)
    if peer.measured:
        peer = replace(peer, met=transfer >= peer.measured.median,
                       details={**peer.details, "cross_node_transfer": transfer})
    results.append(peer)
    spark_database = server.database("ingest")
    results.append(spark_ingest.run(spark_database, sizes.spark, repetitions, report))
    results.append(spark_ingest.follow(server.database("follow"), sizes.spark // 10, repetitions, report))
    with TwoNodes(server, log) as nodes:
        results.append(cross_node.scale(nodes, list(sizes.scale_points), sizes.scale_messages, sizes.backlog, report))
    return results


def run_bench(output: Path, *, quick: bool, repetitions: int, soak_minutes: float | None, server_url: str | None,
              report: Callable[[str], None], pgmq_sql: Path | None = None, soak_rate: int = 1_000,
              soak_window_s: int | None = None, soak_hold: bool = True) -> list[ScenarioResult]:
    output.mkdir(parents=True, exist_ok=True)
    with bench_server(server_url) as server:
        environment = _environment(server.server_url)
        if environment["fsync"] != "on" or environment["synchronous_commit"] != "on":
            raise RuntimeError(f"the benchmark needs durable settings, the server has {environment}")
        if soak_minutes:
            with TwoNodes(server, output / "nodes.log") as nodes:
                results = [soak.run(nodes, soak_minutes, soak_rate, soak_window_s, soak_hold, report)]
        else:
            results = _scenarios(server, output, QUICK if quick else FULL, repetitions, pgmq_sql, report)
    write_results(results, output, environment)
    write_charts(results, output)
    return results
