"""Processes of a node started by the demo and the benchmark: `broker` commands on a database,
listening on a free port of 127.0.0.1."""
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import httpx


# The ports free_port has handed out.
_HANDED_OUT: set[int] = set()
# Where free_port draws from: up to the system's ephemeral ports (Linux says where they begin).
PORTS_FROM = 10_000
EPHEMERAL_PORTS = Path("/proc/sys/net/ipv4/ip_local_port_range")


def free_port() -> int:
    """A port of 127.0.0.1 that nothing listens on, and that this process has not handed out before.  It is drawn at
    random below the system's ephemeral ports: one of those (what binding port 0 gives) may be taken by any outgoing
    connection on the machine before the process it was meant for has bound it."""
    first_ephemeral = int(EPHEMERAL_PORTS.read_text().split()[0]) if EPHEMERAL_PORTS.exists() else 32_768
    while True:
        port = random.randrange(PORTS_FROM, max(first_ephemeral, PORTS_FROM + 1_000))
        if port in _HANDED_OUT:
            continue
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:  # in use
                continue
        _HANDED_OUT.add(port)
        return port


def start_broker(database_url: str, log: Path, *command: str, settings: dict[str, str] | None = None
                 ) -> subprocess.Popen:
    """`broker COMMAND` on the database, with these environment variables besides, its output appended to log."""
    with log.open("ab") as out:
        return subprocess.Popen([sys.executable, "-m", "broker.cli", *command], stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, **(settings or {}), "BROKER_DATABASE_URL": database_url})


# Asks whether a node answers, polled while it starts: one client, whose TLS context is made once (httpx.get makes
# one a call, 18 ms of CPU where a call of a client costs 0.1), and which keeps no connection open to the node.
_LIVENESS = httpx.Client(timeout=1, limits=httpx.Limits(max_keepalive_connections=0))


def answers(address: str) -> bool:
    """Whether the node's API at address is up (its liveness probe answers)."""
    try:
        return _LIVENESS.get(f"{address}/healthz").status_code == 200
    except httpx.HTTPError:
        return False


def stop(process: subprocess.Popen | None) -> None:
    if process is not None and process.poll() is None:
        process.terminate()
        process.wait(20)
