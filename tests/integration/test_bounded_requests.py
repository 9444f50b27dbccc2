"""Nobody makes a node spend much more than they send: against a real `broker serve`, whose peak memory is
read from /proc."""
import json
import socket
import time
import uuid
from urllib.parse import urlsplit

import httpx
import pytest
from sqlalchemy import text

import broker
from broker.transport import signing
from tests.factories import WAREHOUSE_QUEUE, begin, define_orders
from tests.nodes import Node, stop_all
from tests.rest import new_key

MIB = 1024 * 1024
RECEIVE = f"/v1/queues/{WAREHOUSE_QUEUE}/receive"


def _serving(database_url, log_dir):
    """A node of the orders catalog, serving, with an admin key and a conversation begun."""
    node = Node("a", database_url, log_dir)
    with node.engine.begin() as c:
        define_orders(c)
    node.start()
    node.key = new_key(node.engine, "admin")
    with node.engine.begin() as c:
        node.handle = begin(c)
    yield node
    stop_all(node)


@pytest.fixture
def node(database_url, tmp_path):
    """A node of its own: for a test that stores something or reads the node's peak memory."""
    yield from _serving(database_url, tmp_path)


@pytest.fixture(scope="module")
def shared_node(shared_database_url, tmp_path_factory):
    """A node that the module's tests of requests refused before anything is read or stored share."""
    yield from _serving(shared_database_url, tmp_path_factory.mktemp("shared_node"))


def _peak_memory_bytes(node) -> int:
    """The process's peak resident memory so far (VmHWM)."""
    status = open(f"/proc/{node.process.pid}/status").read()
    return int(next(line for line in status.splitlines() if line.startswith("VmHWM:")).split()[1]) * 1024


def _answer_until_closed(connection: socket.socket) -> bytes:
    """What the node writes on the connection until it closes it (a reset counts as closed)."""
    answer = b""
    try:
        while chunk := connection.recv(65536):
            answer += chunk
    except ConnectionResetError:
        pass
    return answer


def _headers_only(node, path: str, headers: dict[str, str], declared_bytes: int,
                  content_type: str | None = "application/json") -> tuple[int, str]:
    """The status and the raw answer to a request that declares a body and sends none of it."""
    address = urlsplit(node.address)
    lines = [f"POST {path} HTTP/1.1", "Host: node", *([f"Content-Type: {content_type}"] if content_type else []),
             f"Content-Length: {declared_bytes}", *(f"{name}: {value}" for name, value in headers.items())]
    with socket.create_connection((address.hostname, address.port), timeout=10) as connection:
        connection.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        answer = _answer_until_closed(connection)  # the node answers and closes without waiting for the body
    head, _, body = answer.decode().partition("\r\n\r\n")
    return int(head.split()[1]), head.lower() + "\n" + body


def _post_raw(node, path: str, body: bytes, key: str | None) -> httpx.Response | None:
    """POST a body; None when the node closed the connection before taking all of it (as it may after
    refusing it)."""
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    try:
        return httpx.post(f"{node.address}{path}", content=body, headers=headers, timeout=60)
    except (httpx.WriteError, httpx.RemoteProtocolError, httpx.ReadError):
        return None


@pytest.mark.parametrize("authorization", [None, "Bearer not-a-key", "Bearer bk_000000000000_" + "A" * 43])
def test_a_request_without_a_valid_key_is_refused_before_its_body_is_read(shared_node, authorization):
    headers = {"Authorization": authorization} if authorization else {}
    status, answer = _headers_only(shared_node, f"/v1/conversations/{shared_node.handle}/messages", headers,
                                   48 * MIB)
    assert status == 401 and "connection: close" in answer and "/problems/unauthorized" in answer


def test_an_unsigned_transport_request_is_refused_before_its_body_is_read(shared_node):
    fresh = {signing.TIMESTAMP_HEADER: str(int(time.time())), signing.SIGNATURE_HEADER: "0" * 64}
    cases = [({}, "unknown-peer"),
             ({signing.INSTANCE_HEADER: str(uuid.uuid4()), **fresh}, "unknown-peer"),  # no route to it here
             ({signing.INSTANCE_HEADER: str(uuid.uuid4())}, "bad-signature")]
    for headers, kind in cases:
        status, answer = _headers_only(shared_node, signing.BATCHES_PATH, headers, 48 * MIB)
        assert status == 401 and "connection: close" in answer and f"/problems/{kind}" in answer


def test_a_large_body_without_a_key_costs_the_node_nothing(node):
    before = _peak_memory_bytes(node)
    body = b"[" + b"{}," * (8 * MIB // 3) + b"{}]"
    for _ in range(3):
        answer = _post_raw(node, f"/v1/conversations/{node.handle}/messages", body, key=None)
        assert answer is None or answer.status_code == 401
    assert _peak_memory_bytes(node) - before < 16 * MIB
    assert httpx.get(f"{node.address}/healthz", timeout=5).status_code == 200


# The padding that follows goes on without a space or a line end: it stays part of the header's value, or of the
# request's target, and the head stays well-formed however the node's reads cut it.
@pytest.mark.parametrize("head", [b"GET /healthz HTTP/1.1\r\nX-Padding: ", b"GET /" + b"a" * 64 * 1024],
                         ids=["a header that never ends", "a request line of 64 KiB"])
def test_a_head_over_16_kib_is_refused_before_the_node_keeps_more_of_it(node, head):
    """A head that goes on, a KiB at a time (a header after a short request line, or a request line of 64 KiB,
    that never ends): answered 400 and closed once the head is past 16 KiB, long before the client has sent all
    it would."""
    before = _peak_memory_bytes(node)
    address = urlsplit(node.address)
    with socket.create_connection((address.hostname, address.port), timeout=10) as connection:
        connection.sendall(head)
        sent = len(head)
        try:
            while sent < 8 * MIB:
                connection.sendall(b"p" * 1024)
                sent += 1024
                time.sleep(0.001 if sent % (64 * 1024) else 0.05)
        except OSError:  # closed by the node
            pass
        answer = _answer_until_closed(connection)
    assert sent < MIB, f"the node took {sent} bytes of a head"
    assert answer.startswith(b"HTTP/1.1 400") and b"over 16384 bytes" in answer, answer[:300]
    assert _peak_memory_bytes(node) - before < 16 * MIB
    assert httpx.get(f"{node.address}/healthz", timeout=5).status_code == 200


@pytest.mark.parametrize("padding", [16 * 1024, 200 * 1024], ids=["17 KiB", "201 KiB"])
def test_a_head_over_16_kib_sent_in_one_write_is_refused(shared_node, padding):
    """The whole head at once, just past 16 KiB and far past it: answered 400 saying why, as one sent a KiB at a
    time is, and the node goes on serving."""
    address = urlsplit(shared_node.address)
    with socket.create_connection((address.hostname, address.port), timeout=10) as connection:
        connection.sendall(b"GET /healthz HTTP/1.1\r\nHost: node\r\nX-Padding: " + b"p" * padding + b"\r\n\r\n")
        answer = _answer_until_closed(connection)
    assert answer.startswith(b"HTTP/1.1 400") and b"over 16384 bytes" in answer, answer[:300]
    assert httpx.get(f"{shared_node.address}/healthz", headers={"X-Padding": "p" * 15 * 1024},
                     timeout=5).status_code == 200


@pytest.mark.parametrize("body,limit", [
    (b'{"message_type": "order.note", "body": ' + b"[" * 64 + b"]" * 64 + b"}", "at most 64"),
    (b'{"message_type": "order.note", "body": [' + b"{}," * (8 * MIB // 3) + b"{}]}", "at most 100000"),
    (b'{"message_type": "order.note", "body": [' + b"1," * 100_000 + b"1]}", "at most 100000"),
], ids=["nested 65 deep", "8 MiB of objects", "100,001 numbers"])
def test_json_that_holds_too_much_is_refused_before_it_is_parsed(node, body, limit):
    before = _peak_memory_bytes(node)
    answer = _post_raw(node, f"/v1/conversations/{node.handle}/messages", body, node.key)
    assert answer.status_code == 422 and limit in answer.json()["detail"]
    assert _peak_memory_bytes(node) - before < len(body) * 3 + 16 * MIB
    assert node.scalar("SELECT count(*) FROM broker.queue_messages") == 0


def test_json_within_the_limits_goes_and_comes_back_as_sent(node):
    deepest = json.loads("[" * 63 + "]" * 63)
    many = list(range(99_990))
    with httpx.Client(base_url=node.address, headers={"Authorization": f"Bearer {node.key}"}, timeout=30) as client:
        for body in (deepest, many):
            sent = client.post(f"/v1/conversations/{node.handle}/messages",
                               json={"message_type": "order.note", "body": body})
            assert sent.status_code == 201, sent.text
        received = client.post(RECEIVE, json={"max_messages": 10}).json()
    assert [m["body"] for m in received["messages"]] == [deepest, many]


def _send_by_sql(node, *bodies: bytes) -> None:
    with node.engine.begin() as c:
        for body in bodies:
            broker.send(c, node.handle, "order.note", body)


def test_any_stored_body_is_received_and_nothing_fails_after_a_lease_is_taken(node):
    """Bodies sent through SQL that no REST sender could have sent: each comes back, as JSON where every
    parser takes it and in base64 otherwise."""
    deep = ("[" * 400 + "]" * 400).encode()
    spaced = b' {"sku" :  "A-1"}\n'
    _send_by_sql(node, deep, spaced, b"NaN", b'{"n": Infinity}', b"\xef\xbb\xbf{}", "\"\u2028\"".encode())
    with httpx.Client(base_url=node.address, headers={"Authorization": f"Bearer {node.key}"}, timeout=30) as client:
        answer = client.post(RECEIVE, json={"max_messages": 10})
    assert answer.status_code == 200, answer.text
    messages = answer.json()["messages"]
    assert messages[0]["body"] == json.loads(deep) and messages[1]["body"] == {"sku": "A-1"}
    assert [m["body_base64"] is not None for m in messages] == [False, False, True, True, True, False]
    assert messages[5]["body"] == "\u2028"


def test_a_receive_stops_at_its_byte_budget(node):
    _send_by_sql(node, *[bytes([65 + i]) * 300_000 for i in range(5)])
    with httpx.Client(base_url=node.address, headers={"Authorization": f"Bearer {node.key}"}, timeout=30) as client:
        refused = client.post(RECEIVE, json={"max_bytes": 0})
        assert refused.status_code == 422 and "max_bytes" in refused.json()["detail"]
        first = client.post(RECEIVE, json={"max_messages": 10, "max_bytes": 700_000}).json()
        assert [m["sequence_number"] for m in first["messages"]] == [1, 2]
        client.post(f"/v1/locks/{first['lock_token']}/complete")
        alone = client.post(RECEIVE, json={"max_messages": 10, "max_bytes": 1}).json()
        assert [m["sequence_number"] for m in alone["messages"]] == [3]  # the first always comes
        client.post(f"/v1/locks/{alone['lock_token']}/complete")
        rest = client.post(RECEIVE, json={"max_messages": 10}).json()  # the default budget: 4 MiB
        assert [m["sequence_number"] for m in rest["messages"]] == [4, 5]
    with node.engine.connect() as c:
        assert c.execute(text("SELECT count(*) FROM broker.leases")).scalar() == 1


def test_receiving_a_large_json_body_costs_about_its_size(node):
    body = json.dumps([{"sku": f"A-{i}", "quantity": i} for i in range(200_000)]).encode()
    assert len(body) > 6 * MIB
    _send_by_sql(node, body)
    before = _peak_memory_bytes(node)
    with httpx.Client(base_url=node.address, headers={"Authorization": f"Bearer {node.key}"}, timeout=30) as client:
        answer = client.post(RECEIVE, json={})
    assert answer.status_code == 200 and len(answer.json()["messages"][0]["body"]) == 200_000
    assert _peak_memory_bytes(node) - before < 8 * len(body)
