"""Nodes for tests: a database and a real `broker serve` process on it."""
import os
import subprocess
import sys
import time

import httpx
from sqlalchemy import create_engine, text

import broker
from broker.cli.processes import free_port

SECRET = "shared-secret-between-a-and-b"
MESSAGE_TYPES = [("order.submit", "json"), ("order.note", "none"), ("order.ack", "empty")]
CONTRACTS = {"orders": {"order.submit": "initiator", "order.ack": "target", "order.note": "any"},
             "audit": {"order.note": "any"}}
# Polled while a node starts (HTTP or HTTPS, any certificate): one client, whose TLS context is made once (httpx.get
# makes one a call, 18 ms of CPU), keeping no connection open to count against a node's limit.
LIVENESS = httpx.Client(timeout=1, verify=False, limits=httpx.Limits(max_keepalive_connections=0))


def wait_for(predicate, timeout_s=30.0, what="the condition", *, interval_s=0.05, ended=None):
    """Polls predicate until it returns something true, and returns that.  `ended`, when given, is asked each time
    whether what is awaited can no longer come (a process that stopped): it returns why, or None."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        reason = ended() if ended else None
        if reason:
            raise AssertionError(f"{reason}, before {what}")
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(interval_s)


class Node:
    """A database and the `broker serve` process (API + relay) on it."""

    def __init__(self, name, database_url, log_dir, port=None, tls=None):
        """tls: {"cert": path, "key": path, "ca": path or None} to serve HTTPS and trust that CA."""
        self.name = name
        self.database_url = database_url
        self.engine = create_engine(database_url, pool_pre_ping=True)
        self.port = port or free_port()
        self.tls = tls
        self.address = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        self.log = log_dir / f"{name}.log"
        self.process = None
        self.env: dict[str, str] = {}  # settings for the process, e.g. {"BROKER_MAX_BATCH_BYTES": "1048576"}
        self.release = None  # an earlier release to run (tests.releases.Release), or None for this one
        with self.engine.connect() as c:
            self.instance = c.execute(text("SELECT broker_instance FROM broker.node")).scalar_one()

    def start(self):
        self.launch()
        self.wait_until_up()

    def launch(self):
        """Starts the process, without waiting for it to answer."""
        env = {**os.environ, **self.env, "BROKER_DATABASE_URL": self.database_url}
        python = self.release.python if self.release else sys.executable
        command = [str(python), "-m", "broker.cli", "serve", "--port", str(self.port), "--no-migrate"]
        if self.tls:
            command += ["--tls-cert", str(self.tls["cert"]), "--tls-key", str(self.tls["key"])]
            if self.tls["ca"]:
                env["BROKER_TLS_CA_FILE"] = str(self.tls["ca"])
        with open(self.log, "a") as log:
            self.process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                            cwd=self.release.home if self.release else None)

    def wait_until_up(self):
        wait_for(self._healthy, 60, f"node {self.name} to answer /healthz")  # a loaded machine starts it slowly

    def _healthy(self):
        if self.process.poll() is not None:
            raise AssertionError(f"node {self.name} exited: {self.log.read_text()[-2000:]}")
        try:
            return LIVENESS.get(f"{self.address}/healthz").status_code == 200  # liveness only
        except httpx.HTTPError:
            return False

    def stop(self):
        self.terminate()
        if self.process:
            self.process.wait(timeout=20)

    def terminate(self):
        """Asks the process to stop, without waiting for it to."""
        if self.process and self.process.poll() is None:
            self.process.terminate()

    def kill(self):
        """SIGKILL: the process gets no chance to finish anything."""
        if self.process and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=20)

    def receive_all(self, queue, count, timeout_s=30.0):
        """Receives until `count` messages arrived, committing each batch."""
        messages = []
        deadline = time.monotonic() + timeout_s
        while len(messages) < count and time.monotonic() < deadline:
            with self.engine.begin() as c:
                messages += broker.receive(c, queue, 100, wait_ms=200)
        assert len(messages) == count, f"{self.name} received {len(messages)} of {count}"
        return messages

    def scalar(self, sql, **params):
        with self.engine.connect() as c:
            return c.execute(text(sql), params).scalar_one()


def define_node(node, queue, service):
    with node.engine.begin() as c:
        for name, validation in MESSAGE_TYPES:
            broker.create_message_type(c, name, validation)
        for name, types in CONTRACTS.items():
            broker.create_contract(c, name, types)
        broker.create_queue(c, queue)
        broker.create_service(c, service, queue, ["orders"])


def serve_pair(a, b):
    """Node a made the shop and node b the warehouse, each routing to the other, both started."""
    define_node(a, "shop_queue", "shop")
    define_node(b, "warehouse_queue", "warehouse")
    with a.engine.begin() as c:
        broker.create_route(c, "warehouse", b.address, b.instance, SECRET)
    with b.engine.begin() as c:
        broker.create_route(c, "shop", a.address, a.instance, SECRET)
    for node in (a, b):  # the two start side by side
        node.launch()
    for node in (a, b):
        node.wait_until_up()


def stop_all(*nodes):
    for node in nodes:
        node.terminate()
    for node in nodes:
        node.stop()
        node.engine.dispose()


def two_nodes(admin_url, template_database, tmp_path, tls=(None, None)):
    """Node a (the shop) and node b (the warehouse), each routing to the other, both serving."""
    from tests.conftest import _fresh_database

    databases = [_fresh_database(admin_url, template_database) for _ in range(2)]
    a, b = (Node(name, next(db), tmp_path, tls=node_tls) for name, db, node_tls in zip("ab", databases, tls))
    serve_pair(a, b)
    yield a, b
    stop_all(a, b)
    for db in databases:
        next(db, None)
