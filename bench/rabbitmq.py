"""The peer: RabbitMQ with the guarantees closest to ours, when a server answers on 127.0.0.1:5672.

A durable queue, persistent messages, publisher confirms and manual consumer acks; a publisher and
a consumer run at once, and the rate runs from the first publish to the last ack. The publisher
keeps up to WINDOW messages unconfirmed on an asynchronous connection, as a publisher that cares for
throughput does: pika's BlockingChannel waits for the confirm of every publish, a round trip and a
disk sync per message, which would measure that wait rather than RabbitMQ.
"""
import os
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pika
import pika.exceptions
from pika.adapters.blocking_connection import BlockingChannel

from bench.results import Measurement, ScenarioResult

HOST, PORT = "127.0.0.1", 5672
SCENARIO = "RabbitMQ publish + consume"
TARGET = "cross-node transfer ≥ this"
MESSAGE_BYTES = 1_024
WINDOW = 1_000
PREFETCH = 1_000
ACK_EVERY = 100
TIMEOUT_S = 120


def _parameters() -> pika.ConnectionParameters:
    return pika.ConnectionParameters(HOST, PORT, credentials=pika.PlainCredentials("guest", "guest"),
                                     connection_attempts=1, socket_timeout=3, stack_timeout=5,
                                     blocked_connection_timeout=TIMEOUT_S)


def _connect() -> pika.BlockingConnection:
    return pika.BlockingConnection(_parameters())


def _on_channel(action: Callable[[BlockingChannel], object]) -> None:
    connection = _connect()
    try:
        action(connection.channel())
    finally:
        connection.close()


def _reason(error: Exception) -> str:
    """The cause pika wraps, e.g. "AMQPConnectorSocketConnectError: ConnectionRefusedError(111, ...)"."""
    cause = error.args[0] if isinstance(error, pika.exceptions.AMQPError) and error.args else error
    return cause if isinstance(cause, str) else repr(cause)


class _Publisher:
    """Publishes persistent messages with confirms, up to WINDOW of them unconfirmed at a time."""

    def __init__(self, queue: str, messages: int):
        self.queue, self.messages = queue, messages
        self.body = os.urandom(MESSAGE_BYTES)
        self.properties = pika.BasicProperties(delivery_mode=pika.DeliveryMode.Persistent)
        self.published = 0
        self.unconfirmed: set[int] = set()
        self.first_publish: float | None = None
        self.failure: str | None = None
        self.channel = None
        self.connection = pika.SelectConnection(
            _parameters(), on_open_callback=lambda connection: connection.channel(on_open_callback=self._on_channel),
            on_open_error_callback=lambda _, error: self._finish(f"could not connect: {error}"),
            on_close_callback=self._on_close)

    def run(self, deadline: float) -> float:
        """Returns the time of the first publish once every message is confirmed."""
        ioloop = self.connection.ioloop
        ioloop.call_later(max(0.0, deadline - time.monotonic()),
                          lambda: self._finish(f"not every message confirmed within {TIMEOUT_S} s"))
        ioloop.start()
        ioloop.close()
        if self.failure:
            raise RuntimeError(f"publishing to RabbitMQ failed: {self.failure}")
        return self.first_publish

    def _done(self) -> bool:
        return self.published == self.messages and not self.unconfirmed

    def _on_channel(self, channel) -> None:
        self.channel = channel
        channel.confirm_delivery(self._on_confirm)
        self.first_publish = time.monotonic()
        self._publish_more()

    def _publish_more(self) -> None:
        while self.published < self.messages and len(self.unconfirmed) < WINDOW:
            self.channel.basic_publish("", self.queue, self.body, properties=self.properties)
            self.published += 1
            self.unconfirmed.add(self.published)

    def _on_confirm(self, frame) -> None:
        method = frame.method
        if isinstance(method, pika.spec.Basic.Nack):
            self._finish(f"RabbitMQ refused message {method.delivery_tag}")
            return
        if method.multiple:
            self.unconfirmed = {tag for tag in self.unconfirmed if tag > method.delivery_tag}
        else:
            self.unconfirmed.discard(method.delivery_tag)
        if self._done():
            self._finish(None)
        else:
            self._publish_more()

    def _on_close(self, _, reason: Exception) -> None:
        self._finish(None if self._done() else f"connection closed: {reason}")

    def _finish(self, failure: str | None) -> None:
        self.failure = self.failure or failure
        if self.connection.is_closed:
            self.connection.ioloop.stop()
        elif not self.connection.is_closing:
            self.connection.close()


def _consume(queue: str, messages: int, deadline: float) -> float:
    """Receives `messages` with manual acks; returns the time of the last ack."""
    connection = _connect()
    try:
        channel = connection.channel()
        channel.basic_qos(prefetch_count=PREFETCH)
        deliveries = channel.consume(queue, inactivity_timeout=1)
        received = 0
        while received < messages:
            if time.monotonic() > deadline:
                raise RuntimeError(f"RabbitMQ delivered {received:,} of {messages:,} messages within {TIMEOUT_S} s")
            method, _, _ = next(deliveries)
            if method is None:
                continue
            received += 1
            if received % ACK_EVERY == 0 or received == messages:
                channel.basic_ack(method.delivery_tag, multiple=True)
        acked = time.monotonic()
        channel.cancel()
        return acked
    finally:
        connection.close()


def _rate(messages: int) -> float:
    """msgs/s through a fresh durable queue, from the first publish to the last ack."""
    queue = f"broker-bench-{uuid.uuid4().hex[:12]}"
    _on_channel(lambda channel: channel.queue_declare(queue, durable=True))
    try:
        deadline = time.monotonic() + TIMEOUT_S
        with ThreadPoolExecutor(max_workers=2) as pool:
            consumed = pool.submit(_consume, queue, messages, deadline)
            published = pool.submit(lambda: _Publisher(queue, messages).run(deadline))
            first_publish = published.result()
            last_ack = consumed.result()
        return messages / (last_ack - first_publish)
    finally:
        _on_channel(lambda channel: channel.queue_delete(queue))


def run(messages: int, repetitions: int, report: Callable[[str], None]) -> ScenarioResult:
    try:
        connection = _connect()
    except (pika.exceptions.AMQPError, OSError) as error:
        return ScenarioResult(SCENARIO, None, target=TARGET,
                              skipped=f"no RabbitMQ server answered on {HOST}:{PORT} ({_reason(error)})")
    # BlockingConnection has no public view of what the server announced when the connection opened.
    server = (connection._impl.server_properties or {}).get("version")
    connection.close()
    rates = []
    for repetition in range(1, repetitions + 1):
        rates.append(_rate(messages))
        report(f"rabbitmq: repetition {repetition}/{repetitions}: {rates[-1]:,.0f} msgs/s")
    return ScenarioResult(SCENARIO, Measurement("durable queue, persistent, confirms, manual acks", "msgs/s", rates),
                          target=TARGET,
                          details={"messages": messages, "message_bytes": MESSAGE_BYTES, "server": server,
                                   "publisher": f"SelectConnection, confirms, up to {WINDOW:,} unconfirmed "
                                                "(BlockingChannel would wait for each confirm)",
                                   "consumer": f"BlockingConnection, prefetch {PREFETCH:,}, "
                                               f"ack every {ACK_EVERY} (multiple) and the last"})
