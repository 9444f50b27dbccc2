"""A client that sends its request slowly is cut off in time, and a node serves a bounded number of
connections: against a real `broker serve`."""
import socket
import time
from urllib.parse import urlsplit

import httpx
import pytest

from tests.nodes import Node
from tests.rest import new_key


# The head's deadline by default, as docs/how-to/run-as-a-service.md ("Slow clients") states it.
HEAD_DEADLINE_S = 10


def _serving(database_url, log_dir, **env):
    node = Node("a", database_url, log_dir)
    node.env.update(env)
    node.start()
    return node


@pytest.fixture
def node(database_url, tmp_path):
    node = _serving(database_url, tmp_path, BROKER_REQUEST_HEAD_TIMEOUT_S="2", BROKER_REQUEST_TIMEOUT_S="2",
                    BROKER_MAX_CONNECTIONS="40")
    yield node
    node.stop()
    node.engine.dispose()


@pytest.fixture
def default_node(database_url, tmp_path):
    node = _serving(database_url, tmp_path)
    yield node
    node.stop()
    node.engine.dispose()


def _connect(node) -> socket.socket:
    address = urlsplit(node.address)
    return socket.create_connection((address.hostname, address.port), timeout=10)


def _closed_within(connection: socket.socket, seconds: float) -> bool:
    """Whether the server closed the connection (after any answer) within the time."""
    connection.settimeout(seconds)
    try:
        while connection.recv(4096):
            pass
        return True
    except (TimeoutError, ConnectionResetError) as error:
        return isinstance(error, ConnectionResetError)


def _answer_until_closed(connection: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (the head and the body may come apart);
    raises TimeoutError if it does not close."""
    answer = b""
    while chunk := connection.recv(4096):
        answer += chunk
    return answer


def test_a_client_that_trickles_its_headers_is_cut_off(node):
    trickling = [_connect(node) for _ in range(25)]
    started = time.monotonic()
    for _ in range(8):  # a byte every half second from each: never a whole request
        for connection in trickling:
            try:
                connection.send(b"G")
            except OSError:
                pass
        time.sleep(0.5)
    assert all(_closed_within(connection, 3) for connection in trickling)
    assert time.monotonic() - started < 10
    assert httpx.get(f"{node.address}/healthz", timeout=5).status_code == 200


# What 25 outsiders trickle, every 2 s, after what they send at first: a header line, or a byte of a body that
# the node must not wait for (no key, or a route that takes none).
TRICKLES = [
    (b"GET /v1/queues HTTP/1.1\r\nHost: a\r\n", b"X-Slow: 1\r\n"),
    (b"POST /healthz HTTP/1.1\r\nHost: a\r\nContent-Length: 100000\r\n\r\n", b"x"),
    (b"POST /no-such-route HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n", b"1\r\nx\r\n"),
    (b"POST /v1/conversations HTTP/1.1\r\nHost: a\r\nContent-Length: 100000\r\n\r\n", b"x"),
]


@pytest.mark.slow
def test_outsiders_that_trickle_a_head_or_a_body_are_cut_off_within_the_heads_deadline(default_node):
    """Whatever an outsider trickles, and however slowly, its connection is closed within the head's deadline
    (10 s by default) of its opening, and the node answers others meanwhile."""
    opened = time.monotonic()
    trickling = {}
    for n in range(25):
        first, _ = TRICKLES[n % len(TRICKLES)]
        connection = _connect(default_node)
        connection.sendall(first)
        connection.setblocking(False)
        trickling[connection] = n % len(TRICKLES)
    closed_after = {}
    answered_meanwhile = None
    next_trickle = opened + 2
    while trickling and time.monotonic() - opened < HEAD_DEADLINE_S + 5:
        trickle_now = time.monotonic() >= next_trickle
        for connection, kind in list(trickling.items()):
            if _closed_now(connection):
                closed_after[kind] = max(closed_after.get(kind, 0), time.monotonic() - opened)
                del trickling[connection]
                connection.close()
            elif trickle_now:
                try:
                    connection.send(TRICKLES[kind][1])
                except OSError:  # closed since: seen on the next look
                    pass
        if trickle_now:
            next_trickle += 2
        if answered_meanwhile is None and time.monotonic() - opened > 4:
            answered_meanwhile = httpx.get(f"{default_node.address}/healthz", timeout=5).status_code
        time.sleep(0.2)
    assert not trickling, f"{len(trickling)} connections still open after {HEAD_DEADLINE_S + 5} s"
    assert max(closed_after.values()) < HEAD_DEADLINE_S + 1.5, closed_after
    assert answered_meanwhile == 200


def _closed_now(connection: socket.socket) -> bool:
    """Whether the server has closed the connection (reading whatever it answered first)."""
    try:
        while connection.recv(65536):
            pass
        return True
    except BlockingIOError:
        return False
    except OSError:
        return True


def test_a_body_that_does_not_come_in_time_gets_408(node):
    """From a client with a valid key: one without gets 401 before its body is waited for."""
    key = new_key(node.engine, "admin")
    connection = _connect(node)
    connection.sendall(f"POST /v1/conversations HTTP/1.1\r\nHost: a\r\nContent-Type: application/json\r\n"
                       f"Authorization: Bearer {key}\r\nContent-Length: 1000\r\n\r\n".encode() + b'{"from_service"')
    connection.settimeout(6)
    answer = _answer_until_closed(connection)
    assert answer.startswith(b"HTTP/1.1 408") and b"/problems/request-timeout" in answer
    assert "the request body did not come within 2.0 s" in node.log.read_text()


def test_connections_past_the_limit_get_503_and_the_node_recovers(node):
    held = [_connect(node) for _ in range(45)]  # idle: each is cut off after 2 s
    try:
        crowded = httpx.get(f"{node.address}/healthz", timeout=5)
    finally:
        for connection in held:
            connection.close()
    assert crowded.status_code == 503
    assert httpx.get(f"{node.address}/healthz", timeout=5).status_code == 200
