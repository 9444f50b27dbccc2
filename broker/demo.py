"""`broker demo`: a shop orders from a warehouse over many conversations; the guarantees are checked."""
import json
import threading
import time

from rich.console import Console
from rich.progress import Progress
from rich.table import Table
from sqlalchemy import create_engine, text

import broker
from broker.activation import run_activation

CATALOG = [
    ("message type", lambda c: broker.create_message_type(c, "order.line", "json")),
    ("message type", lambda c: broker.create_message_type(c, "order.confirmed", "empty")),
    ("contract", lambda c: broker.create_contract(c, "orders", {"order.line": "initiator",
                                                                "order.confirmed": "target"})),
    ("queue", lambda c: broker.create_queue(c, "shop_queue")),
    ("queue", lambda c: broker.create_queue(c, "warehouse_queue")),
    ("service", lambda c: broker.create_service(c, "//demo/shop", "shop_queue")),
    ("service", lambda c: broker.create_service(c, "//demo/warehouse", "warehouse_queue", ["orders"])),
]


def _warehouse(connection, batch):
    """Records each order line in the same transaction that consumes it, and confirms complete orders."""
    for message in batch:
        if message.message_type == "order.line":
            connection.execute(text("INSERT INTO order_lines VALUES (:conversation, :number, :line)"),
                               {"conversation": message.conversation_id, "number": message.message_sequence_number,
                                "line": message.json()["line"]})
            if message.json()["last"]:
                broker.send(connection, message.conversation_handle, "order.confirmed")
                broker.end_conversation(connection, message.conversation_handle)


def run_demo(database_url: str, console: Console, *, conversations: int, messages: int, readers: int) -> bool:
    engine = create_engine(database_url, pool_size=readers + 2)
    with engine.begin() as c:
        for _, define in CATALOG:
            define(c)
        c.execute(text("CREATE TABLE order_lines (conversation_id uuid, message_sequence_number bigint, line int)"))
    console.print("Defined message types, a contract, two queues and two services.")

    started = time.monotonic()
    stop = threading.Event()
    worker = threading.Thread(target=run_activation, args=(engine, "warehouse_queue", _warehouse, stop),
                              kwargs={"max_readers": readers, "max_messages": 50, "wait_ms": 200})
    worker.start()
    confirmed = 0
    with Progress(console=console, transient=True) as progress:
        sending = progress.add_task("shop sends orders", total=conversations)
        confirming = progress.add_task("warehouse confirms", total=conversations)
        for _ in range(conversations):
            with engine.begin() as c:
                handle = broker.begin_dialog(c, "//demo/shop", "//demo/warehouse", "orders")
                for line in range(1, messages + 1):
                    broker.send(c, handle, "order.line", json.dumps({"line": line, "last": line == messages}))
            progress.advance(sending)
        deadline = time.monotonic() + 120
        while confirmed < conversations and time.monotonic() < deadline:
            with engine.begin() as c:
                replies = broker.receive(c, "shop_queue", 100, wait_ms=200)
                for reply in replies:
                    if reply.message_type == "broker.end_dialog":
                        broker.end_conversation(c, reply.conversation_handle)
                        confirmed += 1
                        progress.advance(confirming)
    stop.set()
    worker.join()
    elapsed = time.monotonic() - started

    with engine.begin() as c:
        stored, distinct, out_of_order = c.execute(text(
            "SELECT count(*), count(DISTINCT (conversation_id, message_sequence_number)),"
            " count(*) FILTER (WHERE line <> message_sequence_number) FROM order_lines")).one()
        open_conversations = c.execute(text(
            "SELECT count(*) FROM broker.conversation_endpoints WHERE state <> 'closed'")).scalar_one()
        depth = c.execute(text("SELECT sum(depth) FROM broker.queue_status")).scalar_one()
    engine.dispose()

    sent = conversations * messages
    checks = [
        ("messages sent", sent, True),
        ("stored by the warehouse", stored, stored == sent),
        ("duplicates", stored - distinct, stored == distinct),
        ("out of order", out_of_order, out_of_order == 0),
        ("conversations confirmed and closed", confirmed, confirmed == conversations and open_conversations == 0),
        ("messages left in queues", depth, depth == 0),
    ]
    table = Table(title=f"{conversations} conversations, {readers} readers, {elapsed:.1f} s "
                        f"({sent / elapsed:,.0f} messages/s)")
    table.add_column("check")
    table.add_column("count", justify="right")
    table.add_column("", justify="center")
    for name, count, ok in checks:
        table.add_row(name, f"{count:,}", "[green]ok[/green]" if ok else "[red]FAILED[/red]")
    console.print(table)
    passed = all(ok for _, _, ok in checks)
    console.print("Every message arrived exactly once, in order." if passed else "[red]A guarantee failed.[/red]")
    console.print("Next: `broker psql` opens the broker's own database; README.md shows a session.")
    return passed
