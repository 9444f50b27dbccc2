"""Processes of a node started by the demo and the benchmark: `broker` commands on a database,
listening on a free port of 127.0.0.1."""
import os
import socket
import subprocess
import sys
from pathlib import Path

import httpx


# The ports free_port has handed out.
_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A port of 127.0.0.1 that nothing listens on, and that this process has not handed out before: the
    system may give a port it just freed again, before the process it was meant for has bound it."""
    while True:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


def start_broker(database_url: str, log: Path, *command: str, settings: dict[str, str] | None = None
                 ) -> subprocess.Popen:
    """`broker COMMAND` on the database, with these environment variables besides, its output appended to log."""
    with log.open("ab") as out:
        return subprocess.Popen([sys.executable, "-m", "broker.cli", *command], stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, **(settings or {}), "BROKER_DATABASE_URL": database_url})


def answers(address: str) -> bool:
    """Whether the node's API at address is up (its liveness probe answers)."""
    try:
        return httpx.get(f"{address}/healthz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def stop(process: subprocess.Popen | None) -> None:
    if process is not None and process.poll() is None:
        process.terminate()
        process.wait(20)
