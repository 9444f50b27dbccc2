"""Batches bounded by bytes: a backlog of any size drains, whatever the far node's request limit."""
import json
import os
import socket
import subprocess
import sys
import time
from urllib.parse import urlsplit

import pytest

import broker
from broker.transport import signing, wire
from tests.nodes import wait_for

KB = 1000
# b is away while each test's backlog is committed, and the relay tries a node it could not reach again after at most
# a minute (broker.relay.backoff_s): the backlog starts to drain within that of b's coming back.
RELAY_RETRIES_WITHIN_S = 60


def _diagnose(node) -> tuple[int, list[dict]]:
    result = subprocess.run([sys.executable, "-m", "broker.cli", "diagnose", "--json"], capture_output=True,
                            text=True, timeout=120, env={**os.environ, "BROKER_DATABASE_URL": node.database_url})
    return result.returncode, json.loads(result.stdout)


def _send_while_b_is_down(a, b, conversations: int, messages: int, body_bytes: int) -> list:
    """Conversations from a to b, each with its messages of body_bytes committed while b is away."""
    b.stop()
    handles = []
    with a.engine.begin() as c:
        for _ in range(conversations):
            handle = broker.begin_dialog(c, "shop", "warehouse", "orders")
            broker.send_batch(c, [handle] * messages, "order.note",
                              [f"{i + 1:08d}".encode() * (body_bytes // 8) for i in range(messages)])
            handles.append(handle)
    return handles


def _assert_arrived_in_order(b, conversations: int, messages: int, body_bytes: int, drain_s: float) -> None:
    """Every message arrived on b, in order, within drain_s of the relay's first try after b came back."""
    arrived = b.receive_all("warehouse_queue", conversations * messages, timeout_s=RELAY_RETRIES_WITHIN_S + drain_s)
    by_conversation = {}
    for message in arrived:
        by_conversation.setdefault(message.conversation_id, []).append(message)
    assert len(by_conversation) == conversations
    for received in by_conversation.values():
        assert [m.message_sequence_number for m in received] == list(range(1, messages + 1))
        assert all(m.body == f"{m.message_sequence_number:08d}".encode() * (body_bytes // 8) for m in received)


@pytest.mark.slow
def test_a_backlog_larger_than_the_far_nodes_request_limit_drains(nodes):
    """1,000 messages of 70 KB (70 MB) waiting for a node that takes requests of at most 64 MiB."""
    a, b = nodes
    _send_while_b_is_down(a, b, 1, 1000, 70 * KB)
    b.start()
    _assert_arrived_in_order(b, 1, 1000, 70 * KB, drain_s=120)
    wait_for(lambda: a.scalar("SELECT count(*) FROM broker.transmission_queue_status") == 0, 30, "the acknowledgements")


def test_the_relay_learns_the_far_nodes_smaller_limit(nodes):
    a, b = nodes
    b.env["BROKER_MAX_BATCH_BYTES"] = str(1024 * 1024)
    _send_while_b_is_down(a, b, 100, 5, 20 * KB)  # 10 MB, in batches of the relay's default 8 MiB
    b.start()
    _assert_arrived_in_order(b, 100, 5, 20 * KB, drain_s=60)
    log = a.log.read_text()
    assert "refused a batch of" in log and "sending at most" in log
    assert "Traceback" not in log + b.log.read_text()


def test_a_message_larger_than_the_relays_batch_budget_travels_alone(nodes):
    a, b = nodes
    a.env["BROKER_RELAY_BATCH_BYTES"] = str(50 * KB)
    a.stop()
    a.start()
    _send_while_b_is_down(a, b, 3, 4, 120 * KB)
    b.start()
    _assert_arrived_in_order(b, 3, 4, 120 * KB, drain_s=60)


def test_a_message_the_far_node_never_takes_holds_back_its_conversation_alone(nodes):
    """The other conversations go on; diagnose names the cause and what to do."""
    a, b = nodes
    b.env["BROKER_MAX_BATCH_BYTES"] = str(256 * 1024)
    b.stop()
    with a.engine.begin() as c:
        stuck = broker.begin_dialog(c, "shop", "warehouse", "orders")
        broker.send(c, stuck, "order.note", b"x" * 300 * KB)
        broker.send(c, stuck, "order.note", b"after the large one")
    _send_while_b_is_down(a, b, 20, 3, 1 * KB)
    b.start()
    _assert_arrived_in_order(b, 20, 3, 1 * KB, drain_s=60)
    # the others may arrive before the lane has tried the large message on its own
    wait_for(lambda: "over that node's limit of 262144 bytes" in a.scalar(
        "SELECT string_agg(DISTINCT transmission_status, '; ') FROM broker.transmission_queue_status"
        " WHERE conversation_handle = :h", h=stuck), 30, "the large message refused on its own (HTTP 413)")
    wait_for(lambda: a.scalar("SELECT count(*) FROM broker.transmission_queue_status") == 2, 30,
             "the acknowledgements of everything but the two held back")
    code, findings = _diagnose(a)
    assert code == 1
    refusing = [f for f in findings if f["check"] == f"transmission to {b.address}"]
    assert refusing and refusing[0]["level"] == "error"
    assert "BROKER_MAX_BATCH_BYTES" in refusing[0]["advice"]


def test_a_request_cut_mid_body_is_a_warning_without_a_traceback(nodes):
    a, b = nodes
    address = urlsplit(b.address)
    head = (f"POST {signing.BATCHES_PATH} HTTP/1.1\r\nHost: b\r\nContent-Length: 1000000\r\n"
            f"Content-Type: {wire.BATCH_MEDIA_TYPE}\r\n{signing.INSTANCE_HEADER}: {a.instance}\r\n"
            f"{signing.TIMESTAMP_HEADER}: {int(time.time())}\r\n{signing.SIGNATURE_HEADER}: {'0' * 64}\r\n\r\n")
    for _ in range(3):  # admitted from its headers as a's, then cut
        with socket.create_connection((address.hostname, address.port), timeout=5) as cut:
            cut.sendall(head.encode() + b"\0" * 1000)
    wait_for(lambda: "went away before its request body ended" in b.log.read_text(), 10, "the warning")
    assert "Traceback" not in b.log.read_text()
    with a.engine.begin() as c:  # the node goes on as before
        handle = broker.begin_dialog(c, "shop", "warehouse", "orders")
        broker.send(c, handle, "order.note", b"still here")
    assert b.receive_all("warehouse_queue", 1)[0].body == b"still here"
