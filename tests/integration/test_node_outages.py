"""A node whose database goes away and comes back, whose connections run out, or that fails a request:
a real `broker serve` process on a real PostgreSQL."""
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

import broker
from broker import migrate
from broker.cli.embedded import EmbeddedPostgres
from tests import factories
from tests.conftest import admin_execute
from tests.nodes import Node
from tests.rest import new_key

BEGIN = {"from_service": factories.SHOP, "to_service": factories.WAREHOUSE, "contract": factories.CONTRACT}
RECEIVE = "/v1/queues/warehouse_queue/receive"
TERMINATE_THE_NODES_SESSIONS = text(
    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
    " WHERE datname = current_database() AND pid <> pg_backend_pid()")


class Client:
    """The node's REST API with an admin key, over one pool of connections that threads share."""

    def __init__(self, node: Node, key: str):
        self.address = node.address
        self.http = httpx.Client(base_url=node.address, headers={"Authorization": f"Bearer {key}"},
                                 limits=httpx.Limits(max_connections=100))

    def post(self, path: str, json: dict, timeout_s: float = 10) -> httpx.Response:
        return self.http.post(path, json=json, timeout=timeout_s)

    def get(self, path: str, timeout_s: float = 10) -> httpx.Response:
        return self.http.get(path, timeout=timeout_s)

    def begin(self) -> str:
        response = self.post("/v1/conversations", BEGIN)
        assert response.status_code == 201, response.text
        return response.json()["conversation_handle"]

    def send(self, handle: str, body) -> httpx.Response:
        return self.post(f"/v1/conversations/{handle}/messages", {"message_type": "order.submit", "body": body},
                         timeout_s=30)


def _serving(node: Node) -> Client:
    node.start()
    return Client(node, new_key(node.engine, "admin"))


@pytest.fixture
def node(database_url, orders, tmp_path):
    node = Node("node", database_url, tmp_path)
    yield node
    node.stop()
    node.engine.dispose()


def assert_a_send_wakes_a_long_poll(client: Client, meanwhile=lambda: None) -> None:
    """A message sent 150 ms into a long poll (after whatever meanwhile does) comes back at once: by its
    notification, well before the reader's once-a-second look."""
    handle = client.begin()
    answer = {}

    def poll():
        started = time.monotonic()
        answer["response"] = client.post(RECEIVE, {"wait_ms": 5000})
        answer["elapsed_s"] = time.monotonic() - started

    poller = threading.Thread(target=poll)
    poller.start()
    time.sleep(0.15)
    meanwhile()
    assert client.send(handle, {"woken": True}).status_code == 201
    poller.join(timeout=15)
    response = answer["response"]
    assert response.status_code == 200, response.text
    assert response.json()["messages"][0]["body"] == {"woken": True}
    assert answer["elapsed_s"] < 0.9, f"the long poll took {answer['elapsed_s']:.2f} s"
    lock = response.json()["lock_token"]
    assert client.post(f"/v1/locks/{lock}/complete", {}).json() == {"completed": 1}


def assert_requests_answer(client: Client, count: int = 30) -> None:
    """Connections held open together, so that their sockets take every free descriptor number (a stale one
    included): each answered promptly."""
    connections = [httpx.Client(base_url=client.address, headers=client.http.headers, timeout=5)
                   for _ in range(count)]
    try:
        for connection in connections:
            assert connection.get("/healthz").status_code == 200
        for connection in connections:
            response = connection.get("/v1/queues")
            assert response.status_code == 200, response.text
    finally:
        for connection in connections:
            connection.close()


def assert_stops_cleanly(node: Node) -> None:
    """SIGTERM: the application shuts down, then the process ends by the signal it was sent."""
    node.stop()
    log = node.log.read_text()
    assert node.process.returncode in (-signal.SIGTERM, 128 + signal.SIGTERM), log[-3000:]
    assert "Traceback" not in log and "ERROR" not in log, log[-3000:]


def test_a_node_whose_database_sessions_are_terminated_works_as_before(node):
    client = _serving(node)

    def terminate_the_nodes_sessions():
        with node.engine.connect() as connection:
            assert connection.execute(TERMINATE_THE_NODES_SESSIONS).scalar_one() >= 1  # the listener among them
        time.sleep(0.2)

    assert_a_send_wakes_a_long_poll(client)
    terminate_the_nodes_sessions()
    for _ in range(2):
        assert_a_send_wakes_a_long_poll(client)
    assert_a_send_wakes_a_long_poll(client, meanwhile=terminate_the_nodes_sessions)  # a poll across it
    assert_requests_answer(client)
    assert_stops_cleanly(node)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["fast", "immediate"])
def test_a_node_whose_postgresql_restarts_works_as_before(mode, tmp_path):
    server = EmbeddedPostgres(tmp_path / "server").start()
    node = None
    try:
        migrate.upgrade(server.url())
        engine = create_engine(server.url())
        with engine.begin() as connection:
            factories.define_orders(connection)
        engine.dispose()
        node = Node("node", server.url(), tmp_path)
        client = _serving(node)
        assert_a_send_wakes_a_long_poll(client)

        server.stop(mode)
        node.engine.dispose()
        assert httpx.get(f"{node.address}/healthz", timeout=5).status_code == 200
        during = client.post(RECEIVE, {"wait_ms": 1000})
        assert during.status_code == 503 and during.headers["Retry-After"], during.text
        server.start()

        assert_a_send_wakes_a_long_poll(client)
        assert_requests_answer(client)
        assert_stops_cleanly(node)
    finally:
        if node is not None:
            node.stop()
            node.engine.dispose()
        server.stop()


def test_a_node_out_of_connections_answers_503_at_once_and_stays_live(node):
    """48 sends wait on a conversation that a SQL transaction holds for 3.5 s: those that find no free connection
    are answered 503 within seconds (not 500, not after 30 s), /healthz answers throughout, and the rest are
    applied once the lock is released."""
    client = _serving(node)
    handle = client.begin()
    answers = []
    with node.engine.connect() as holder, ThreadPoolExecutor(48) as senders:
        holder.begin()
        broker.send(holder, handle, "order.submit", b'{"held": true}')  # locks the conversation's endpoint

        def timed_send(n):
            started = time.monotonic()
            response = client.send(handle, {"n": n})
            answers.append((response, time.monotonic() - started))

        for n in range(48):
            senders.submit(timed_send, n)
        probes = []
        deadline = time.monotonic() + 3.5  # past the wait for a connection (2 s), short of the lock's (5 s)
        while time.monotonic() < deadline and len(probes) < 100:
            try:
                probes.append(httpx.get(f"{node.address}/healthz", timeout=1).status_code)
            except httpx.TimeoutException:
                probes.append("timed out")
            time.sleep(0.2)
        holder.rollback()
    assert probes and set(probes) == {200}, probes
    statuses = [response.status_code for response, _ in answers]
    assert set(statuses) == {201, 503}, statuses
    for response, elapsed_s in answers:
        if response.status_code == 503:
            assert response.headers["Retry-After"] and response.json()["type"] == "/problems/database-unavailable"
            assert elapsed_s < 6, f"a 503 took {elapsed_s:.1f} s"  # 2 s for a connection, a thread first at worst
    sent = node.scalar("SELECT send_sequence FROM broker.conversation_endpoints WHERE conversation_handle = :h",
                       h=handle)
    assert sent == statuses.count(201)  # every 503 applied nothing
    assert_stops_cleanly(node)


def test_a_row_locked_for_long_does_not_take_every_connection_for_as_long(node):
    """30 sends wait on a conversation that a SQL transaction holds for 12 s: each gives up its connection within
    seconds (503, nothing applied), so that a send on another conversation goes through long before the lock
    is released."""
    client = _serving(node)
    held, other = client.begin(), client.begin()
    with node.engine.connect() as holder, ThreadPoolExecutor(30) as senders:
        holder.begin()
        broker.send(holder, held, "order.submit", b'{"held": true}')
        started = time.monotonic()
        waiting = [senders.submit(client.send, held, {"n": n}) for n in range(30)]
        time.sleep(1)
        while (other_sent := client.send(other, {"other": True})).status_code != 201 \
                and time.monotonic() < started + 12:
            assert other_sent.status_code == 503, other_sent.text
            time.sleep(0.2)
        assert other_sent.status_code == 201 and time.monotonic() - started < 9
        statuses = [send.result().status_code for send in waiting]
        holder.rollback()
    assert set(statuses) == {503}, statuses
    assert node.scalar("SELECT send_sequence FROM broker.conversation_endpoints WHERE conversation_handle = :h",
                       h=held) == 0


def test_long_polls_hold_no_connection_while_they_wait(node):
    """More long polls than the node has connections (20 by default), and sends still go through at once."""
    client = _serving(node)
    handle = client.begin()
    with ThreadPoolExecutor(30) as pollers:
        polls = [pollers.submit(client.post, "/v1/queues/shop_queue/receive", {"wait_ms": 4000})
                 for _ in range(30)]
        time.sleep(1)
        for n in range(8):
            started = time.monotonic()
            assert client.send(handle, {"n": n}).status_code == 201
            assert time.monotonic() - started < 1
    assert [poll.result().status_code for poll in polls] == [204] * 30


def _with_password(url: str, user: str, password: str) -> str:
    return make_url(url).set(username=user, password=password).render_as_string(hide_password=False)


def test_every_500_is_logged_with_its_traceback_and_no_secret(database_url, engine, orders, tmp_path):
    password = "pw-never-logged-7f3a"
    role = f"node_{tmp_path.name[-8:].lower().replace('-', '_')}"
    admin_execute(database_url, f"CREATE ROLE {role} LOGIN SUPERUSER PASSWORD '{password}'")
    node = Node("node", _with_password(database_url, role, password), tmp_path)
    try:
        client = _serving(node)
        with engine.begin() as connection:  # an operator's mistake: a view the API reads goes away
            connection.execute(text("ALTER VIEW broker.queue_status RENAME TO queue_status_aside"))
        response = client.get("/v1/queues")
        assert response.status_code == 500 and response.json()["type"] == "/problems/internal-error"
        with engine.begin() as connection:  # and comes back with a column the API cannot take
            connection.execute(text("CREATE VIEW broker.queue_status AS SELECT queue_name, status, retention,"
                                    " poison_threshold, NULL::bigint AS depth, oldest_message_age, readers,"
                                    " dead_letters FROM broker.queue_status_aside"))
        response = client.get("/v1/queues")
        assert response.status_code == 500 and response.json()["type"] == "/problems/internal-error"
        assert "Traceback" not in response.text and password not in response.text
        handle = client.begin()
        with engine.begin() as connection:  # a function the API calls fails, naming another database
            connection.execute(text("ALTER FUNCTION broker.send(uuid, text, bytea, interval, timestamptz)"
                                    " RENAME TO send_aside"))
            connection.execute(text(  # with the parameters' names, which the API calls it by
                "CREATE FUNCTION broker.send(conversation_handle uuid, message_type text, body bytea,"
                " deliver_after interval, deliver_at timestamptz) RETURNS bigint LANGUAGE plpgsql AS $$ BEGIN"
                f" RAISE 'cannot reach postgresql://reports:{password}@10.0.0.9/reports"
                f" (host=10.0.0.9 password={password})'; END $$"))
        response = client.send(handle, {"card": "4111-1111-1111-1111"})
        assert response.status_code == 500 and response.json()["type"] == "/problems/internal-error"
        assert password not in response.text
        node.stop()
        log = node.log.read_text()
        assert log.count("GET /v1/queues answered 500: Traceback") == 2, log
        assert log.count(f"POST /v1/conversations/{handle}/messages answered 500: Traceback") == 1, log
        assert "UndefinedTable" in log and "ValidationError" in log, log
        assert "cannot reach postgresql://reports:***@10.0.0.9/reports (host=10.0.0.9 password=***" in log, log
        assert password not in log and "4111" not in log, log  # nor a statement's parameters
    finally:
        node.stop()
        node.engine.dispose()
        admin_execute(database_url, f"DROP ROLE {role}")
