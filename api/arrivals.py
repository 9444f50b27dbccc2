"""Wakes REST readers that wait for a queue: LISTEN broker_queue, whose payload is the queue's id.

One connection per process listens; it is opened on first use and again after
it breaks, and a broken listener wakes every waiter so that each looks again.
"""
import asyncio
import logging
from contextlib import contextmanager

import psycopg2
from fastapi.concurrency import run_in_threadpool

log = logging.getLogger(__name__)

CHANNEL = "broker_queue"


class Arrivals:
    def __init__(self, database_url: str):
        self.database_url = database_url
        self.connection = None
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
        """Makes sure the listening connection is open; a failure leaves readers to their periodic look."""
        async with self.opening:
            if self.connection is not None:
                return
            try:
                self.connection = await run_in_threadpool(self._connect)
            except psycopg2.Error as error:
                log.warning("cannot listen for arrivals (%s)", str(error).splitlines()[0])
                return
            asyncio.get_running_loop().add_reader(self.connection.fileno(), self._on_readable)

    def _connect(self):
        connection = psycopg2.connect(self.database_url, connect_timeout=5)
        connection.autocommit = True
        connection.cursor().execute(f"LISTEN {CHANNEL}")
        return connection

    def _on_readable(self) -> None:
        try:
            self.connection.poll()
        except psycopg2.Error:
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
        if self.connection is not None:
            asyncio.get_running_loop().remove_reader(self.connection.fileno())
            self.connection.close()
            self.connection = None
