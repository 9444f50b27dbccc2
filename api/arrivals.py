"""Wakes REST readers that wait for a queue: LISTEN broker_queue, whose payload is the queue's id.

One connection per process listens; it is opened on first use and again on the
next wait after it breaks (the database restarted, or the session was ended).
Opening it and losing it both wake every waiter, so that each looks again for
what arrived while nobody listened.
"""
import asyncio
import logging
from contextlib import contextmanager

import psycopg2
from fastapi.concurrency import run_in_threadpool

from broker import queries

log = logging.getLogger(__name__)


class Arrivals:
    def __init__(self, database_url: str):
        self.database_url = database_url
        self.connection = None
        self.descriptor: int | None = None  # the connection's socket, as the event loop watches it
        self.waiters: dict[str, set[asyncio.Event]] = {}
        self.opening = asyncio.Lock()

    @contextmanager
    def subscription(self, queue_id: int):
        """An event set whenever a transaction that enqueued to the queue commits, from now on."""
        event = asyncio.Event()
        waiters = self.waiters.setdefault(str(queue_id), set())
        waiters.add(event)
        try:
            yield event
        finally:
            waiters.discard(event)
            if not waiters:
                self.waiters.pop(str(queue_id), None)

    async def listen(self) -> None:
        """Makes sure the listening connection is open, or being opened by another reader (which may take the
        connection timeout when the database does not answer); until it is, readers look once a second."""
        if self.connection is not None or self.opening.locked():
            return
        async with self.opening:
            try:
                connection = await run_in_threadpool(self._connect)
            except psycopg2.Error as error:
                log.warning("cannot listen for arrivals (%s)", _first_line(error))
                return
            self.connection, self.descriptor = connection, connection.fileno()
            asyncio.get_running_loop().add_reader(self.descriptor, self._on_readable)
            self._wake(list(self.waiters))

    def _connect(self):
        connection = psycopg2.connect(self.database_url, connect_timeout=5)
        connection.autocommit = True
        connection.cursor().execute(queries.QUERIES["listen_for_arrivals"].text)
        return connection

    def _on_readable(self) -> None:
        try:
            self.connection.poll()
        except psycopg2.Error as error:
            log.warning("stopped listening for arrivals (%s); listening again on the next wait", _first_line(error))
            self.close()
            self._wake(list(self.waiters))
            return
        self._wake({notice.payload for notice in self.connection.notifies})
        self.connection.notifies.clear()

    def _wake(self, queue_ids) -> None:
        for queue_id in queue_ids:
            for event in self.waiters.get(queue_id, ()):
                event.set()

    def close(self) -> None:
        """Stops watching the socket by the number it had when opened (a connection that broke has closed it,
        and the number is soon another socket's), then closes the connection if it is still open."""
        if self.connection is not None:
            asyncio.get_running_loop().remove_reader(self.descriptor)
            self.connection.close()
            self.connection = self.descriptor = None


def _first_line(error: psycopg2.Error) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]
