"""Traffic for tests: messages sent without pause between two real nodes while a test changes something under
them, and what arrived checked: none lost, none repeated, none reordered, and how long each waited."""
import threading
import time
from collections import defaultdict
from contextlib import contextmanager

from sqlalchemy import text
from sqlalchemy.exc import DBAPIError

import broker
from tests.nodes import wait_for

QUEUES = {"shop": "shop_queue", "warehouse": "warehouse_queue"}  # of each service in tests.nodes.serve_pair
CONVERSATION_ID = text("SELECT conversation_id FROM broker.conversation_endpoints WHERE conversation_handle = :handle")
# What the sending node still holds for its far node, and why: said when what was sent does not all arrive.
WAITING_TO_TRANSMIT = text("SELECT transmission_status, count(*) FROM broker.transmission_queue_status"
                           " GROUP BY transmission_status")


class Traffic:
    """Messages sent without pause from one node's service to the other's, on a few conversations, each with its
    send time, and received as they come: what each conversation got, in order, and how long each message
    waited between its send and its receive."""

    def __init__(self, sender, receiver, from_service, to_service, conversations=4):
        self.sender, self.receiver = sender, receiver
        self.from_service, self.to_service = from_service, to_service
        with sender.engine.begin() as c:
            self.handles = [broker.begin_dialog(c, from_service, to_service, "orders") for _ in range(conversations)]
        self.sent: dict = defaultdict(list)  # conversation id: bodies in the order sent
        self.received: dict = defaultdict(list)  # conversation id: (sequence number, body) in the order received
        self.waited: list[tuple[float, float]] = []  # (sent at, seconds waited)
        self.stop = threading.Event()
        self.failures: list[str] = []
        self.threads = [threading.Thread(target=self._send, daemon=True),
                        threading.Thread(target=self._receive, daemon=True)]
        for thread in self.threads:
            thread.start()

    def _send(self):
        number = 0
        with self.sender.engine.connect() as c:
            ids = {handle: c.execute(CONVERSATION_ID, {"handle": handle}).scalar_one() for handle in self.handles}
        while not self.stop.is_set():
            handle = self.handles[number % len(self.handles)]
            body = f"{number} {time.time():.6f}"
            try:
                with self.sender.engine.begin() as c:
                    broker.send(c, handle, "order.note", body.encode())
                self.sent[ids[handle]].append(body)
                number += 1
            except Exception as error:  # a send the database did not take: not sent, and said so
                self.failures.append(f"send: {error}")
                time.sleep(0.2)
            time.sleep(0.01)

    def _receive(self):
        # A send under way when stop is set still commits and counts: the receiving thread goes on until the
        # sending thread has ended, not until it has caught up with what was counted so far.
        while not self.stop.is_set() or self.threads[0].is_alive() or self.missing():
            try:
                with self.receiver.engine.begin() as c:
                    messages = broker.receive(c, QUEUES[self.to_service], 100, wait_ms=200)
            except Exception as error:  # rolled back: the messages come again
                self.failures.append(f"receive: {error}")
                time.sleep(0.2)
                continue
            now = time.time()
            for message in messages:
                body = message.body.decode()
                self.received[message.conversation_id].append((message.message_sequence_number, body))
                sent_at = float(body.split()[1])
                self.waited.append((sent_at, now - sent_at))
            if self.stop.is_set() and not messages:
                time.sleep(0.1)

    def missing(self) -> int:
        return sum(len(bodies) for bodies in self.sent.values()) - sum(len(got) for got in self.received.values())

    def finish(self, timeout_s=90):
        self.stop.set()
        self.threads[0].join()
        try:
            wait_for(lambda: self.missing() <= 0, timeout_s, f"{self.to_service} to receive everything sent")
        except AssertionError as timed_out:
            try:
                with self.sender.engine.connect() as c:
                    holds = [tuple(row) for row in c.execute(WAITING_TO_TRANSMIT)]
            except DBAPIError as error:  # the timeout is the failure; its database gone says why, not instead
                holds = f"unknown (its database: {str(error.orig).strip().splitlines()[0]})"
            raise AssertionError(f"{timed_out}: {self.missing()} missing; the sending node holds {holds}") from None
        self.threads[1].join()

    def longest_wait_s(self, sent_from: float = 0.0, sent_until: float = float("inf")) -> float:
        """The longest a message sent in that span of time (time.time()) waited between its send and its receive."""
        return max((waited for sent_at, waited in self.waited if sent_from <= sent_at < sent_until), default=0.0)

    def check(self):
        """Every message once, in order, with the body sent: none lost, none repeated, none reordered."""
        for conversation, bodies in self.sent.items():
            got = self.received[conversation]
            assert [number for number, _ in got] == list(range(1, len(bodies) + 1)), conversation
            assert [body for _, body in got] == bodies, conversation


@contextmanager
def both_ways(a, b):
    """Traffic from a's shop to b's warehouse and back, flowing while the block runs; once it ends, everything
    sent has arrived, once and in order, and no send or receive failed."""
    to_b, to_a = Traffic(a, b, "shop", "warehouse"), Traffic(b, a, "warehouse", "shop")
    try:
        yield to_b, to_a
    finally:
        for traffic in (to_b, to_a):
            traffic.finish()
    for traffic in (to_b, to_a):
        traffic.check()
        assert not traffic.failures, traffic.failures[:3]
