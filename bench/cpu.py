"""CPU time per message, per process, over a cross-node transfer: where the two nodes spend it.

Every process of both nodes is counted: the relay and the API (with any children), and every process of the
PostgreSQL server the two databases live on, grouped by what it serves: the sender's backend, A's other
backends (the relay's lanes), B's backends (the API's accepts), and the server's own processes (WAL writer,
checkpointer, ...).  The load generator's Python and the benchmark's own sessions that watch the nodes are not
part of either node and are left out.
"""
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import psutil
import psycopg2

# The groups, in the order they are reported.
GROUPS = ("sender's backend", "A's relay-lane backends", "B's accepting backends", "PostgreSQL's own processes",
          "relay (Python)", "API (Python)")


BACKENDS = "SELECT pid, datname FROM pg_stat_activity WHERE datname IS NOT NULL"


@dataclass(frozen=True)
class Roles:
    """The processes of the two nodes: the sender's backend, the benchmark's own backends (left out), A's database
    (by its URL) and B's database name, the relay and the API."""
    sender_backend: int
    watching_backends: tuple[int, ...]
    a_url: str
    a_database: str
    b_database: str
    relay: int
    api: int

    def times(self) -> dict[tuple[str, int], float]:
        """CPU seconds (user and system) each process alive now has used so far, by its group and pid."""
        databases = _backends(self.a_url)
        groups = {self.a_database: GROUPS[1], self.b_database: GROUPS[2]}

        def group_of(pid: int) -> str | None:
            if pid in self.watching_backends:
                return None
            return GROUPS[0] if pid == self.sender_backend else groups.get(databases.get(pid), GROUPS[3])

        used = _server_times(self.sender_backend, group_of)
        for group, pid in ((GROUPS[4], self.relay), (GROUPS[5], self.api)):
            process = psutil.Process(pid)
            for member in (process, *process.children(recursive=True)):
                used[group, member.pid] = _seconds(member)
        return used


@dataclass(frozen=True)
class BareRoles:
    """The bare relays' processes, in the groups of the broker's: the sender's backend, the backend reading and
    deleting on A, the backends writing into B, the server's own processes, the benchmark's thread that moves the
    batches (the relay), and the process of the endpoint that takes them over HTTP (the API), when there is one.
    The nodes' backends, idle meanwhile, are left out."""
    sender_backend: int
    source_backend: int
    target_backends: tuple[int, ...]
    a_url: str
    relay_thread: int
    api: int | None = None

    def times(self) -> dict[tuple[str, int], float]:
        """CPU seconds each of them has used so far, by its group and pid (the relay: its thread id)."""
        backends = _backends(self.a_url)
        named = {self.sender_backend: GROUPS[0], self.source_backend: GROUPS[1],
                 **dict.fromkeys(self.target_backends, GROUPS[2])}
        used = _server_times(self.sender_backend,
                             lambda pid: named.get(pid, GROUPS[3] if pid not in backends else None))
        [relay] = [thread for thread in psutil.Process().threads() if thread.id == self.relay_thread]
        used[GROUPS[4], self.relay_thread] = relay.user_time + relay.system_time
        if self.api is not None:
            used[GROUPS[5], self.api] = _seconds(psutil.Process(self.api))
        return used


def _server_times(sender_backend: int, group_of: Callable[[int], str | None]) -> dict[tuple[str, int], float]:
    """CPU seconds each process of the server has used so far, by the group group_of gives its pid (None: left
    out) and its pid; a process that ends while it is read is left out."""
    used = {}
    for process in psutil.Process(sender_backend).parent().children():
        group = group_of(process.pid)
        if group:
            try:
                used[group, process.pid] = _seconds(process)
            except psutil.NoSuchProcess:
                continue
    return used


def _backends(database_url: str) -> dict[int, str]:
    """Each backend's database, read on a connection that ends before the processes are read."""
    connection = psycopg2.connect(database_url)
    try:
        with connection.cursor() as cursor:
            cursor.execute(BACKENDS)
            return dict(cursor.fetchall())
    finally:
        connection.close()


def _seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def per_message_us(before: dict, after: dict, messages: int) -> dict[str, float]:
    """µs of CPU per message in each group, and in all, between two readings of Roles.times (a process that
    started in between counts from its start; one that ended in between is not counted)."""
    used = Counter()
    for (group, pid), seconds in after.items():
        used[group] += seconds - before.get((group, pid), 0.0)
    per_message = {group: used[group] * 1e6 / messages for group in GROUPS}
    return {**per_message, "all": sum(per_message.values())}
