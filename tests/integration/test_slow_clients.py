"""A client that sends its request slowly is cut off in time, and a node serves a bounded number of
connections: against a real `broker serve`."""
import socket
import time
from urllib.parse import urlsplit

import httpx
import pytest

from tests.nodes import Node
from tests.rest import new_key


@pytest.fixture
def node(database_url, tmp_path):
    node = Node("a", database_url, tmp_path)
    node.env.update({"BROKER_REQUEST_TIMEOUT_S": "2", "BROKER_MAX_CONNECTIONS": "40"})
    node.start()
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
