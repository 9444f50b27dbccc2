"""Two nodes for the cross-node scenarios: A sends through its relay, B takes the batches in its API.

Each node is a database on the benchmark's server and real processes on it: A's relay
runs as `broker relay`, B's transport endpoint as `broker serve --no-relay`.
"""
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import psutil
import psycopg2

from sqlalchemy.engine import make_url

from bench import workload
from bench.cpu import Roles
from bench.databases import BenchServer
from broker.cli.processes import answers, free_port, start_broker, stop
from broker.relay import FORGET_AT_ONCE

WAITING_TO_TRANSMIT = "SELECT count(*) FROM broker.transmission_queue_status"
# Whether a conversation side has numbers its far node has not acknowledged: a look at each conversation, not at
# each message (the transmission log keeps what was acknowledged).
ANY_WAITING_TO_TRANSMIT = ("SELECT EXISTS (SELECT FROM broker.endpoints e"
                           " LEFT JOIN broker.transmission_progress p ON p.conversation_handle = e.conversation_handle"
                           " WHERE NOT e.far_is_local AND e.send_sequence > coalesce(p.acknowledged_sequence, 0))")
ARRIVED = "SELECT count(*) FROM broker.queue_messages"
FORGET_ACKNOWLEDGED = "SELECT broker.forget_acknowledged_messages(%(at_once)s)"


def serve_api(database_url: str, log: Path, port: int | None = None, settings: dict[str, str] | None = None
              ) -> tuple[subprocess.Popen, str]:
    """`broker serve --no-relay` on the port (a free one by default), once it answers; returns the process and
    its address."""
    port = port or free_port()
    process = start_broker(database_url, log, "serve", "--no-relay", "--no-migrate", "--port", str(port),
                           settings=settings)
    return _answering(process, f"http://127.0.0.1:{port}", f"the API on {database_url}", log)


def _answering(process: subprocess.Popen, address: str, what: str, log: Path) -> tuple[subprocess.Popen, str]:
    """The process and its address, once its /healthz answers; stopped, and an error, if it does not in 30 s."""
    deadline = time.monotonic() + 30
    while not answers(address):
        if time.monotonic() > deadline or process.poll() is not None:
            process.terminate()
            raise RuntimeError(f"{what} did not start; see {log}")
        time.sleep(0.1)
    return process, address


def start_bare_api(database_url: str, log: Path) -> tuple[subprocess.Popen, str]:
    """The bare endpoints (bench.bare_api) on a free port, once they answer; returns the process and its address."""
    port = free_port()
    with log.open("ab") as out:
        process = subprocess.Popen([sys.executable, "-m", "bench.bare_api", str(port)], stdout=out,
                                   stderr=subprocess.STDOUT, env={**os.environ, "BROKER_DATABASE_URL": database_url})
    return _answering(process, f"http://127.0.0.1:{port}", f"the bare API on {database_url}", log)


class TwoNodes:
    def __init__(self, server: BenchServer, log: Path):
        self.a_url = server.database("a")
        self.b_url = server.database("b")
        self.log = log
        self.relay: subprocess.Popen | None = None
        self.api: subprocess.Popen | None = None
        workload.define(self.a_url, sender=True, receiver=False)
        workload.define(self.b_url, sender=False, receiver=True)
        self.a = psycopg2.connect(self.a_url)  # the sender
        # The benchmark's own look at each node, apart from the sender: not either node's work (bench.cpu).
        self.watching_a = psycopg2.connect(self.a_url)
        self.watching_a.autocommit = True
        self.b = psycopg2.connect(self.b_url)
        self.b.autocommit = True

    def __enter__(self) -> "TwoNodes":
        self.api, self.address = serve_api(self.b_url, self.log)
        address = self.address
        secret = secrets.token_urlsafe(24)
        workload.route(self.a_url, "bench_receiver", address, workload.instance_of(self.b_url), secret)
        workload.route(self.b_url, "bench_sender", "http://127.0.0.1:1", workload.instance_of(self.a_url), secret)
        self.start_relay()
        # One message through, so that scenarios start with the relay up and connected.
        workload.send_round_robin(self.a, workload.begin_conversations(self.a, 1), 1, workload.bodies())
        self.wait_until_delivered(1, timeout_s=60)
        self.clear_arrived()
        return self

    def __exit__(self, *exc_info) -> None:
        stop(self.relay)
        stop(self.api)
        for connection in (self.a, self.watching_a, self.b):
            connection.close()

    def start_relay(self, settings: dict[str, str] | None = None) -> None:
        self.relay = start_broker(self.a_url, self.log, "relay", settings=settings)

    def restart(self, settings: dict[str, str]) -> None:
        """Runs the relay and the API again with these settings, the API on the same address."""
        stop(self.relay)
        stop(self.api)
        self.api, _ = serve_api(self.b_url, self.log, int(self.address.rsplit(":", 1)[1]), settings)
        self.start_relay(settings)

    def roles(self) -> Roles:
        """The processes of the two nodes, for their CPU time (bench.cpu)."""
        return Roles(self.a.get_backend_pid(), (self.watching_a.get_backend_pid(), self.b.get_backend_pid()),
                     self.a_url, make_url(self.a_url).database, make_url(self.b_url).database, self.relay.pid,
                     self.api.pid)

    def rss_mb(self) -> dict[str, float]:
        """Resident memory of the relay and API processes."""
        return {name: psutil.Process(process.pid).memory_info().rss / 2**20
                for name, process in (("relay", self.relay), ("api", self.api))}

    def waiting(self) -> int:
        with self.watching_a.cursor() as cursor:
            cursor.execute(WAITING_TO_TRANSMIT)
            return cursor.fetchone()[0]

    def any_waiting(self) -> bool:
        with self.watching_a.cursor() as cursor:
            cursor.execute(ANY_WAITING_TO_TRANSMIT)
            return cursor.fetchone()[0]

    def arrived(self) -> int:
        with self.b.cursor() as cursor:
            cursor.execute(ARRIVED)
            return cursor.fetchone()[0]

    def forget_acknowledged(self) -> None:
        """Forgets on A what its resend window lets it forget now, as its relay does once a minute, and vacuums the
        log: so that a measurement starts from the log its window keeps, not from what those before it sent, and
        does not pay for their forgetting (nor for the vacuum after it) at whatever point of it a minute ends."""
        with self.watching_a.cursor() as cursor:
            forgotten = FORGET_AT_ONCE
            while forgotten >= FORGET_AT_ONCE:
                cursor.execute(FORGET_ACKNOWLEDGED, {"at_once": FORGET_AT_ONCE})
                forgotten = cursor.fetchone()[0]
            cursor.execute("VACUUM broker.transmission_log")

    def clear_arrived(self) -> None:
        """Empties B's queue between measurements, and vacuums it so that the next one does not pay
        for the dead rows this bulk delete leaves (a consumer's steady deletes are vacuumed as they go)."""
        with self.b.cursor() as cursor:
            cursor.execute("DELETE FROM broker.queue_messages")
            cursor.execute("VACUUM broker.queue_messages")

    def wait_until_delivered(self, expected_arrived: int, timeout_s: float) -> None:
        """Until the transmission queue is empty and B holds expected_arrived messages.  Whether anything waits is
        looked at every 20 ms, or ten times as long as the look took (it reads every conversation); B's messages
        are counted only once nothing does, so that the looking costs the nodes little."""
        deadline = time.monotonic() + timeout_s
        while True:
            looked_at = time.monotonic()
            if not self.any_waiting() and self.arrived() >= expected_arrived:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the relay did not deliver within {timeout_s:.0f} s: {self.waiting():,} waiting, "
                                   f"{self.arrived():,} of {expected_arrived:,} arrived; see {self.log}")
            time.sleep(max(0.02, 10 * (time.monotonic() - looked_at)))
