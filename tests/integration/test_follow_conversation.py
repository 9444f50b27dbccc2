"""One conversation's life on each of two real nodes, as `broker status --conversation` and
GET /v1/conversations/{handle}/messages show it: what it sent and received, and why each message waits."""
import json
import os
import subprocess
import sys
from uuid import uuid4

import httpx

import broker
from broker.status import MESSAGES_LISTED, conversation_life
from tests.nodes import wait_for
from tests.rest import new_key


def _status(node, handle, *options: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "broker.cli", "status", "--conversation", str(handle), *options],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "BROKER_DATABASE_URL": node.database_url, "COLUMNS": "200"})


def _life(node, handle) -> dict:
    result = _status(node, handle, "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def _summary(life: dict) -> tuple:
    return (life["sent"], life["sent_and_gone"], life["arrived"], life["arrived_and_received"],
            [(m["direction"], m["sequence_number"], m["message_type"]) for m in life["messages"]])


def test_a_conversation_is_followed_from_the_send_to_the_receive_on_both_nodes(nodes):
    a, b = nodes
    b.stop()
    with a.engine.begin() as c:
        handle = broker.begin_dialog(c, "shop", "warehouse", "orders")
        for n in range(3):
            broker.send(c, handle, "order.note", f"note {n}")

    wait_for(lambda: all("cannot reach" in m["status"] for m in _life(a, handle)["messages"]), 30,
             "the failed transmissions to show")
    assert _summary(_life(a, handle)) == (3, 0, 0, 0, [("sent", n, "order.note") for n in (1, 2, 3)])

    b.start()
    wait_for(lambda: _life(a, handle)["sent_and_gone"] == 3, 60, "the acknowledgements")
    assert _summary(_life(a, handle)) == (3, 3, 0, 0, [])
    table = _status(a, handle).stdout
    assert "Sent 3: 3 acknowledged by the far node, 0 waiting here" in table and "Messages on this node: none" in table

    conversation_id = _life(a, handle)["conversation"]["conversation_id"]
    far_side = b.scalar("SELECT conversation_handle FROM broker.conversation_endpoints"
                        " WHERE conversation_id = :id AND NOT is_initiator", id=conversation_id)
    life = _life(b, far_side)
    assert _summary(life) == (0, 0, 3, 0, [("arrived", n, "order.note") for n in (1, 2, 3)])
    assert {m["status"] for m in life["messages"]} == {"waiting for a reader"}
    with b.engine.begin() as c:
        assert len(broker.receive(c, "warehouse_queue", 2)) == 2
    over_rest = httpx.get(f"{b.address}/v1/conversations/{far_side}/messages", timeout=10,
                          headers={"Authorization": f"Bearer {new_key(b.engine, 'receive:warehouse_queue')}"})
    assert over_rest.status_code == 200, over_rest.text
    assert _summary(over_rest.json()) == _summary(_life(b, far_side)) == (0, 0, 3, 2, [("arrived", 3, "order.note")])



def test_an_unknown_conversation_is_one_line_and_a_404(nodes):
    a, _ = nodes
    unknown = uuid4()
    result = _status(a, unknown)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"no conversation {unknown} on this node" in " ".join(result.stderr.split())
    answer = httpx.get(f"{a.address}/v1/conversations/{unknown}/messages", timeout=10,
                       headers={"Authorization": f"Bearer {new_key(a.engine, 'admin')}"})
    assert answer.status_code == 404 and answer.json()["detail"] == f"unknown conversation {unknown}"


def test_a_conversation_holding_more_than_it_lists_counts_the_rest(engine, orders, database_url):
    """Following a side lists its first MESSAGES_LISTED messages and counts the rest, so that a side with a long
    backlog is followed in bounded memory, by the node and by whoever asks."""
    with engine.begin() as c:
        handle = orders.begin(c)
        c.exec_driver_sql("SELECT broker.send(%s, 'order.note', 'x') FROM generate_series(1, %s)",
                          (str(handle), MESSAGES_LISTED + 5))
        far_side = c.exec_driver_sql("SELECT conversation_handle FROM broker.endpoints WHERE NOT is_initiator"
                                     ).scalar_one()
    with engine.connect() as c:
        life = conversation_life(c, far_side)
    assert (life["arrived"], life["arrived_and_received"]) == (MESSAGES_LISTED + 5, 0)
    assert [m["sequence_number"] for m in life["messages"]] == list(range(1, MESSAGES_LISTED + 1))
    assert life["messages_not_listed"] == 5
    table = subprocess.run([sys.executable, "-m", "broker.cli", "status", "--conversation", str(far_side)],
                           capture_output=True, text=True, timeout=60,
                           env={**os.environ, "BROKER_DATABASE_URL": database_url, "COLUMNS": "200"}).stdout
    assert "… and 5 more on this node, not listed." in table
