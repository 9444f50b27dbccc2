"""The relay: carries committed messages from the transmission queue to the nodes that own their services.

Per destination node it sends the lowest waiting numbers of each conversation,
applies the signed acknowledgements in one transaction, and deletes only what
the peer acknowledged after its commit.  Several relays may run against one
database: a session advisory lock per destination lets one of them at a time
talk to a destination, so a conversation's messages never go out of order or
from two relays at once, and a relay that dies releases it with its connection.
"""
import json
import logging
import random
import select
import threading
import time
from datetime import timedelta

import httpx
import psycopg2
from sqlalchemy import create_engine, text
from sqlalchemy.exc import DBAPIError

from broker import signing
from broker.metrics import RELAY_ACKNOWLEDGED, RELAY_BATCH_SECONDS, RELAY_FAILURES, RELAY_SENT

log = logging.getLogger(__name__)

NOTIFY_CHANNEL = "broker_transmission_queue"
IDLE_WAKE_S = 1.0
# Closes and acknowledgements forget old closed endpoints as they happen; on a
# quiet node the relay does it now and then, so none outstays its retention.
FORGET_EVERY_S = 60.0

DESTINATIONS = text(
    "SELECT address, broker_instance, peer_secret, next_attempt_at <= now() AS due,"
    " greatest(extract(epoch FROM next_attempt_at - now()), 0) AS due_in_s"
    " FROM broker.transport_destinations ORDER BY next_attempt_at")
OUR_INSTANCE = text("SELECT broker_instance FROM broker.node")
# The batch as JSON text, sent as it is, and how many messages it carries.
NEXT_BATCH = text(
    "SELECT batch::text AS body, (SELECT count(*) FROM json_array_elements(batch -> 'conversations') c,"
    " json_array_elements(c -> 'messages')) AS messages"
    " FROM broker.transport_batch(:address, :max_messages) batch")
APPLY_ANSWER = text("SELECT broker.apply_transport_results(CAST(:answer AS jsonb))")
RECORD_FAILURE = text("SELECT broker.record_transport_failure(:address, :reason, :retry_after)")
LOCK_DESTINATION = text("SELECT pg_try_advisory_lock(1651663724, hashtext(:address))")
UNLOCK_DESTINATION = text("SELECT pg_advisory_unlock(1651663724, hashtext(:address))")
FORGET_CLOSED_ENDPOINTS = text("SELECT broker.forget_closed_endpoints()")


class TransportFailure(Exception):
    """A destination did not take a batch; the message says why, in words for transmission_status."""


def backoff_s(failures_in_a_row: int) -> float:
    """1 s after the first failure, doubling to a 60 s cap, with jitter so relays do not retry in step."""
    return min(60.0, 2.0 ** (failures_in_a_row - 1)) * random.uniform(0.5, 1.0)


class Relay:
    def __init__(self, database_url: str, *, batch_size: int = 1000, timeout_s: float = 30.0,
                 tls_ca_file: str | None = None):
        self.database_url = database_url
        self.engine = create_engine(database_url, pool_size=2, pool_pre_ping=True)
        self.client = httpx.Client(timeout=timeout_s, verify=tls_ca_file or True)
        self.batch_size = batch_size
        self.failures_in_a_row: dict[str, int] = {}
        self.delivered = 0
        self.forget_at = 0.0
        self.instance: str | None = None

    def run(self, stop: threading.Event) -> None:
        """Relays until stop is set, woken by notifications of new messages or by a due retry.

        A database that goes away (restart, crash, cut connection) is waited for, not fatal.
        """
        listener = None
        try:
            while not stop.is_set():
                try:
                    listener = listener or self._listen()
                    idle_s = self.run_once()
                    if idle_s > 0 and select.select([listener], [], [], idle_s)[0]:
                        listener.poll()
                        listener.notifies.clear()
                except (psycopg2.Error, DBAPIError) as error:
                    log.warning("database unavailable (%s); retrying in a second", str(error).splitlines()[0])
                    if listener is not None:
                        listener.close()
                        listener = None
                    stop.wait(1)
                except Exception:
                    log.exception("relay cycle failed; retrying in a second")
                    stop.wait(1)
        finally:
            if listener is not None:
                listener.close()
            self.client.close()
            self.engine.dispose()

    def _listen(self):
        listener = psycopg2.connect(self.database_url)
        listener.autocommit = True
        listener.cursor().execute(f"LISTEN {NOTIFY_CHANNEL}")
        return listener

    def run_once(self) -> float:
        """Sends to every destination that is due; returns how long to wait before anything else is due."""
        if time.monotonic() >= self.forget_at:
            with self.engine.begin() as connection:
                connection.execute(FORGET_CLOSED_ENDPOINTS)
            self.forget_at = time.monotonic() + FORGET_EVERY_S
        with self.engine.connect() as connection:
            self.instance = self.instance or str(connection.execute(OUR_INSTANCE).scalar_one())
            destinations = connection.execute(DESTINATIONS).all()
        sent_something = False
        idle_s = IDLE_WAKE_S
        for destination in destinations:
            if destination.due:
                sent_something |= self._relay_to(destination, self.instance)
            else:
                idle_s = min(idle_s, float(destination.due_in_s))
        return 0.0 if sent_something else idle_s

    def _relay_to(self, destination, instance: str) -> bool:
        address = destination.address
        with self.engine.connect() as lock:
            if not lock.execute(LOCK_DESTINATION, {"address": address}).scalar_one():
                return False  # another relay is talking to it
            lock.commit()
            try:
                while True:
                    with self.engine.connect() as connection:
                        batch = connection.execute(NEXT_BATCH, {"address": address,
                                                                "max_messages": self.batch_size}).one()
                    if not batch.messages:
                        return True
                    started = time.monotonic()
                    RELAY_SENT.labels(address).inc(batch.messages)
                    try:
                        answer = self._post(destination, instance, batch.body.encode())
                    except TransportFailure as failure:
                        RELAY_FAILURES.labels(address).inc()
                        self._record_failure(address, str(failure))
                        return True
                    self.failures_in_a_row.pop(address, None)
                    with self.engine.begin() as connection:
                        delivered = connection.execute(APPLY_ANSWER, {"answer": json.dumps(answer)}).scalar_one()
                    RELAY_BATCH_SECONDS.labels(address).observe(time.monotonic() - started)
                    RELAY_ACKNOWLEDGED.labels(address).inc(delivered)
                    self.delivered += delivered
                    if delivered == 0:
                        return True  # nothing new was taken: wait for the next wake rather than spin
            finally:
                lock.execute(UNLOCK_DESTINATION, {"address": address})
                lock.commit()

    def _post(self, destination, instance: str, body: bytes) -> dict:
        url = f"{destination.address}/transport/v1/batches"
        try:
            response = self.client.post(url, content=body, headers={
                "Content-Type": "application/json", **signing.signed_headers(destination.peer_secret, instance, body)})
        except httpx.HTTPError as error:
            raise TransportFailure(f"cannot reach {destination.address}: {type(error).__name__}: {error}") from error
        if response.status_code != 200:
            detail = response.text[:300] if "json" in response.headers.get("content-type", "") else ""
            raise TransportFailure(f"{destination.address} answered HTTP {response.status_code} {detail}".strip())
        try:
            signing.matching_secret([destination.peer_secret], response.headers.get(signing.TIMESTAMP_HEADER),
                                    response.headers.get(signing.SIGNATURE_HEADER), response.content)
        except signing.BadSignature as error:
            raise TransportFailure(f"the answer from {destination.address} is not signed by the peer: {error}") from error
        answer = response.json()
        if answer.get("broker_instance") != str(destination.broker_instance):
            raise TransportFailure(f"{destination.address} is broker instance {answer.get('broker_instance')}, "
                                   f"the route expects {destination.broker_instance}")
        return answer

    def _record_failure(self, address: str, reason: str) -> None:
        failures = self.failures_in_a_row[address] = self.failures_in_a_row.get(address, 0) + 1
        retry_after = timedelta(seconds=backoff_s(failures))
        log.warning("%s; retrying in %.1f s", reason, retry_after.total_seconds())
        with self.engine.begin() as connection:
            connection.execute(RECORD_FAILURE, {"address": address, "reason": reason, "retry_after": retry_after})
