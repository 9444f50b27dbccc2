"""`broker demo`: two nodes on embedded databases order from each other across the HTTP relay.

A's shop orders from B's warehouse and B's shop from A's; halfway through the sending,
A's relay is killed (SIGKILL) and started again.  Once everything has arrived, Spark
ingests both warehouse queues into Parquet; then the warehouses consume every order line
in order, confirm and end, and the shops end on the confirmation.  The summary shows
that each guarantee held.
"""
import json
import secrets
import signal
import subprocess
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.progress import Progress
from rich.table import Table
from sqlalchemy import Engine, TextClause, create_engine, text

import broker
from broker import migrate, queries
from broker.activation import run_activation
from broker.cli.embedded import EmbeddedPostgres
from broker.cli.processes import answers, free_port, start_broker, stop

LINE, CONFIRMED, CONTRACT = "order.line", "order.confirmed", "orders"
# The warehouse application's own table: each order line it consumed, recorded in the consuming transaction.
CREATE_ORDER_LINES = text("CREATE TABLE order_lines (conversation_id uuid, message_sequence_number bigint, line int)")
RECORD_ORDER_LINE = text("INSERT INTO order_lines VALUES (:conversation, :number, :line)")
COUNT_STORED = text("SELECT count(*), count(DISTINCT (conversation_id, message_sequence_number)),"
                    " count(*) FILTER (WHERE line <> message_sequence_number) FROM order_lines")


@dataclass
class DemoNode:
    name: str
    database_url: str
    port: int
    engine: Engine
    instance: str
    api: subprocess.Popen | None = None
    relay: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def service(self, role: str) -> str:
        return f"//demo/{self.name}/{role}"

    def read(self, query: TextClause):
        """The one value the query reads, on a connection of its own."""
        with self.engine.connect() as connection:
            return connection.execute(query).scalar_one()


def _wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.1)


def _stop_processes(node: DemoNode) -> None:
    """Stops the node's API and its relay as they are now (the demo starts A's relay again)."""
    stop(node.api)
    stop(node.relay)


def _define(node: DemoNode, peer: DemoNode, secret: str) -> None:
    with node.engine.begin() as c:
        broker.create_message_type(c, LINE, "json")
        broker.create_message_type(c, CONFIRMED, "empty")
        broker.create_contract(c, CONTRACT, {LINE: "initiator", CONFIRMED: "target"})
        broker.create_queue(c, "shop_queue")
        broker.create_queue(c, "warehouse_queue")
        broker.create_service(c, node.service("shop"), "shop_queue")
        broker.create_service(c, node.service("warehouse"), "warehouse_queue", [CONTRACT])
        for role in ("shop", "warehouse"):
            broker.create_route(c, peer.service(role), peer.address, peer.instance, secret)
        c.execute(CREATE_ORDER_LINES)


def _warehouse(connection, batch) -> None:
    """Records each order line in the transaction that consumes it; confirms and ends on the last."""
    for message in batch:
        if message.message_type == LINE:
            connection.execute(RECORD_ORDER_LINE,
                               {"conversation": message.conversation_id, "number": message.message_sequence_number,
                                "line": message.json()["line"]})
            if message.json()["last"]:
                broker.send(connection, message.conversation_handle, CONFIRMED)
                broker.end_conversation(connection, message.conversation_handle)


def _shop(connection, batch) -> None:
    for message in batch:
        if message.message_type == "broker.end_dialog":
            broker.end_conversation(connection, message.conversation_handle)


def _send_orders(a: DemoNode, b: DemoNode, conversations: int, messages: int, log: Path, console: Console) -> int:
    """Alternates A→B and B→A conversations; kills A's relay at a third and restarts it at two thirds."""
    kills = 0
    with Progress(console=console, transient=True) as progress:
        sending = progress.add_task("sending orders in both directions", total=conversations)
        for i in range(conversations):
            if i == conversations // 3:
                a.relay.send_signal(signal.SIGKILL)
                a.relay.wait()
                kills += 1
                console.print("  killed node a's relay (SIGKILL)")
            if i == 2 * conversations // 3:
                waiting = a.read(queries.QUERIES["waiting_to_transmit"])
                a.relay = start_broker(a.database_url, log, "relay")
                console.print(f"  started node a's relay again, with {waiting} messages waiting for it")
            sender, receiver = (a, b) if i % 2 == 0 else (b, a)
            with sender.engine.begin() as c:
                handle = broker.begin_dialog(c, sender.service("shop"), receiver.service("warehouse"), CONTRACT)
                for line in range(1, messages + 1):
                    broker.send(c, handle, LINE, json.dumps({"line": line, "last": line == messages}))
            progress.advance(sending)
    return kills


def _ingest(nodes: list[DemoNode], lake: Path, console: Console) -> dict[str, int]:
    from broker.spark_ingest.jdbc import spark_session
    from broker.spark_ingest.job import ingest

    console.print("Spark ingests both warehouse queues (local[2])…")
    spark = spark_session("local[2]")
    try:
        rows = {}
        for node in nodes:
            summary = ingest(spark, node.database_url, "warehouse_queue", str(lake / node.name))
            frame = spark.read.parquet(str(lake / node.name))
            distinct = frame.select("conversation_id", "message_sequence_number").distinct().count()
            rows[node.name] = summary.rows if distinct == summary.rows else -1
            console.print(f"  node {node.name}: {summary.rows:,} rows in {summary.seconds:.1f} s")
        return rows
    finally:
        spark.stop()


def _consume(nodes: list[DemoNode], conversations: int, console: Console) -> None:
    stop = threading.Event()
    workers = [threading.Thread(target=run_activation, args=(node.engine, queue, handler, stop),
                                kwargs={"max_readers": 2, "max_messages": 50, "wait_ms": 200})
               for node in nodes for queue, handler in (("warehouse_queue", _warehouse), ("shop_queue", _shop))]
    for worker in workers:
        worker.start()
    try:
        with Progress(console=console, transient=True) as progress:
            closing = progress.add_task("consuming in order, confirming and ending", total=2 * conversations)
            deadline = time.monotonic() + 180
            while time.monotonic() < deadline:
                open_endpoints = sum(node.read(queries.QUERIES["open_endpoints"]) for node in nodes)
                progress.update(closing, completed=2 * conversations - open_endpoints)
                if open_endpoints == 0:
                    break
                time.sleep(0.2)
    finally:
        stop.set()
        for worker in workers:
            worker.join()


def run_demo(folder: Path, console: Console, *, conversations: int, messages: int) -> bool:
    log = folder / "nodes.log"
    with ExitStack() as cleanup:
        nodes = []
        for name in ("a", "b"):
            server = cleanup.enter_context(EmbeddedPostgres(folder / name))
            migrate.upgrade(server.url())
            engine = create_engine(server.url(), pool_size=6)
            cleanup.callback(engine.dispose)
            with engine.connect() as c:
                instance = queries.broker_instance(c)
            nodes.append(DemoNode(name, server.url(), free_port(), engine, instance))
        a, b = nodes
        secret = secrets.token_urlsafe(24)
        _define(a, b, secret)
        _define(b, a, secret)
        for node in nodes:
            node.api = start_broker(node.database_url, log, "serve", "--no-relay", "--no-migrate", "--port", str(node.port))
            node.relay = start_broker(node.database_url, log, "relay")
            cleanup.callback(_stop_processes, node)
        for node in nodes:
            _wait_for(lambda n=node: answers(n.address), 30, f"node {node.name} to answer")
        console.print(f"Two nodes on embedded PostgreSQL: a at {a.address}, b at {b.address}; each defines a "
                      "contract, two queues and two services, and routes to the other.")

        started = time.monotonic()
        kills = _send_orders(a, b, conversations, messages, log, console)
        _wait_for(lambda: all(node.read(queries.QUERIES["waiting_to_transmit"]) == 0 for node in nodes), 120,
                  "the transmission queues to drain")
        relayed_s = time.monotonic() - started
        ingested = _ingest(nodes, folder / "lake", console)
        _consume(nodes, conversations, console)

        arriving = {"a": conversations // 2 * messages, "b": (conversations + 1) // 2 * messages}
        stored, open_endpoints = {}, {}
        for node in nodes:
            with node.engine.connect() as c:
                stored[node.name] = c.execute(COUNT_STORED).one()
                open_endpoints[node.name] = c.execute(queries.QUERIES["open_endpoints"]).scalar_one()
        rows = [
            ("order lines sent", arriving, arriving),
            ("stored by the warehouse", {n: stored[n][0] for n in "ab"}, arriving),
            ("duplicates", {n: stored[n][0] - stored[n][1] for n in "ab"}, {"a": 0, "b": 0}),
            ("out of order", {n: stored[n][2] for n in "ab"}, {"a": 0, "b": 0}),
            ("ingested by Spark, once each", ingested, arriving),
            ("endpoints still open", open_endpoints, {"a": 0, "b": 0}),
        ]
        table = Table(title=f"{conversations} conversations of {messages} order lines, relayed in {relayed_s:.1f} s")
        table.add_column("check")
        for column in ("to node a", "to node b", ""):
            table.add_column(column, justify="right")
        checks = [values == expected for _, values, expected in rows]
        for (label, values, _), ok in zip(rows, checks):
            table.add_row(label, f"{values['a']:,}", f"{values['b']:,}",
                          "[green]ok[/green]" if ok else "[red]FAILED[/red]")
        console.print(table)
        console.print(f"Node a's relay was killed {kills} time and restarted; nothing was lost or repeated.")
    passed = all(checks)
    console.print("Every message arrived exactly once, in order, and Spark ingested each once."
                  if passed else "[red]A guarantee failed.[/red]")
    console.print("Next: `broker status` and `broker diagnose` on a node of your own (`broker serve`), "
                  "and docs/explanation/architecture.md for the message path.")
    return passed
