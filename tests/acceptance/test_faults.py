"""Exactly-once-in-order under faults, proved by a history checker.

Node a sends thousands of messages on many conversations to node b while the
test SIGKILLs a's two node processes (API and relay each) and b's, crashes
b's PostgreSQL with an immediate stop, and routes a's traffic to b through a
proxy that cuts requests, drops responses after b has committed, and delays.
b's consumer records each message in b's own database in the transaction that
receives it.  Afterwards every conversation's committed sends must equal what
b recorded: each exactly once, in order, nothing extra, transmission queue empty.

Seeded: BROKER_FAULT_SEED repeats a run.
"""
import os
import random
import threading
import time

import pytest
from sqlalchemy import create_engine, text

import broker
from broker import migrate
from broker.cli.embedded import EmbeddedPostgres
from tests.chaos_proxy import ChaosProxy
from tests.conftest import _fresh_database
from tests.nodes import SECRET, Node, define_node, free_port, wait_for

CONVERSATIONS = 40
MESSAGES_PER_CONVERSATION = 60
FAULT_PERIOD_S = 30


def _send_all(a: Node, rng: random.Random, committed: dict) -> None:
    """Sends every message in transactions of 1 to 10, recording what committed."""
    with a.engine.begin() as c:
        handles = [broker.begin_dialog(c, "shop", "warehouse", "orders") for _ in range(CONVERSATIONS)]
    remaining = {h: MESSAGES_PER_CONVERSATION for h in handles}
    while remaining:
        chosen = rng.sample(sorted(remaining), min(len(remaining), rng.randint(1, 10)))
        sent = []
        with a.engine.begin() as c:
            for handle in chosen:
                body = f"{handle}:{MESSAGES_PER_CONVERSATION - remaining[handle] + 1}"
                sent.append((handle, broker.send(c, handle, "order.note", body), body))
        for handle, number, body in sent:
            committed.setdefault(handle, []).append((number, body))
            remaining[handle] -= 1
            if remaining[handle] == 0:
                del remaining[handle]
        time.sleep(rng.random() * 0.01)


def _consume(b_url: str, stop: threading.Event) -> None:
    """Records each received message in b's database, in the receiving transaction."""
    engine = create_engine(b_url, pool_pre_ping=True)
    while not stop.is_set():
        try:
            with engine.begin() as c:
                for m in broker.receive(c, "warehouse_queue", 50, wait_ms=200):
                    c.execute(text("INSERT INTO received_log VALUES (:conversation, :number, :type, :body)"),
                              {"conversation": m.conversation_id, "number": m.message_sequence_number,
                               "type": m.message_type, "body": m.body.decode() if m.body else None})
        except Exception:  # b's database is down: wait for it
            time.sleep(0.2)
    engine.dispose()


def _inject_faults(rng, nodes, b_server, stop, log):
    a, a2, b = nodes
    while not stop.is_set():
        time.sleep(rng.uniform(0.5, 2.0))
        fault = rng.choice(["kill a", "kill a2", "kill b", "crash b's PostgreSQL"])
        log.append(fault)
        if fault == "crash b's PostgreSQL":
            b_server.stop("immediate")
            time.sleep(rng.uniform(0.2, 1.5))
            b_server.start()
        else:
            node = {"kill a": a, "kill a2": a2, "kill b": b}[fault]
            node.kill()
            time.sleep(rng.uniform(0.1, 1.0))
            node.start()


@pytest.mark.slow
def test_exactly_once_in_order_under_kills_crashes_and_a_faulty_network(admin_url, template_database, tmp_path):
    seed = int(os.environ.get("BROKER_FAULT_SEED", "20261122"))
    rng = random.Random(seed)
    a_database = _fresh_database(admin_url, template_database)
    a_url = next(a_database)
    b_server = EmbeddedPostgres(tmp_path / "b-postgres").start()
    migrate.upgrade(b_server.url())
    a = Node("a", a_url, tmp_path)
    a2 = Node("a2", a_url, tmp_path)  # a second API and relay on a's database
    b = Node("b", b_server.url(), tmp_path, port=free_port())
    to_b = ChaosProxy(b.port, seed)
    to_a = ChaosProxy(a.port, seed + 1)
    define_node(a, "shop_queue", "shop")
    define_node(b, "warehouse_queue", "warehouse")
    with a.engine.begin() as c:
        broker.create_route(c, "warehouse", to_b.address, b.instance, SECRET)
    with b.engine.begin() as c:
        broker.create_route(c, "shop", to_a.address, a.instance, SECRET)
        c.execute(text("CREATE TABLE received_log (conversation_id uuid, number bigint, type text, body text)"))
    nodes = (a, a2, b)
    for node in nodes:
        node.start()

    committed: dict = {}
    stop_faults, stop_consumer = threading.Event(), threading.Event()
    faults: list[str] = []
    consumer = threading.Thread(target=_consume, args=(b_server.url(), stop_consumer))
    injector = threading.Thread(target=_inject_faults, args=(rng, nodes, b_server, stop_faults, faults))
    try:
        consumer.start()
        injector.start()
        started = time.monotonic()
        _send_all(a, random.Random(seed + 2), committed)
        time.sleep(max(0.0, FAULT_PERIOD_S - (time.monotonic() - started)))
        stop_faults.set()
        injector.join()
        to_b.enabled = to_a.enabled = False
        total = CONVERSATIONS * MESSAGES_PER_CONVERSATION
        wait_for(lambda: b.scalar("SELECT count(*) FROM received_log") >= total, 180, "b to record every message")
        wait_for(lambda: a.scalar("SELECT count(*) FROM broker.transmission_queue_status") == 0, 60, "a's queue to drain")
    finally:
        stop_faults.set()
        stop_consumer.set()
        consumer.join()
        for node in nodes:
            node.stop()

    with a.engine.connect() as c:
        conversation_of = dict(c.execute(text("SELECT conversation_handle, conversation_id FROM broker.endpoints")).all())
    with b.engine.connect() as c:
        recorded = c.execute(text("SELECT conversation_id, number, type, body FROM received_log ORDER BY ctid")).all()
    received: dict = {}
    for conversation, number, kind, body in recorded:
        assert kind == "order.note"
        received.setdefault(conversation, []).append((number, body))
    assert len(received) == CONVERSATIONS
    for handle, sends in committed.items():
        assert received[conversation_of[handle]] == sends, f"conversation {conversation_of[handle]}"
    checked = sum(len(s) for s in committed.values())
    print(f"\nseed {seed}: {checked} messages on {len(committed)} conversations checked exactly once in order; "
          f"faults: {len(faults)} ({', '.join(f'{faults.count(f)}x {f}' for f in sorted(set(faults)))}); "
          f"proxy to b: {dict(to_b.counts)}, proxy to a: {dict(to_a.counts)}")
    assert checked == CONVERSATIONS * MESSAGES_PER_CONVERSATION
    to_a.close()
    to_b.close()
    b_server.stop()
    next(a_database, None)
