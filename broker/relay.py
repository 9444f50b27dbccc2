"""The relay: carries committed messages from the transmission log to the nodes that own their services.

Per destination node it reads the log from where its lane's cursor stands
(broker.next_batch), applies the signed acknowledgements in one transaction,
and moves on only what the peer acknowledged after its commit.  The conversations are split by handle
into lanes that send at once, each with a batch of its own in flight, so the
two databases and the network work side by side.  Several relays may run
against one database: a session advisory lock per destination and lane lets
one of them at a time talk to a destination for a lane, so a conversation's
messages never go out of order or from two relays at once; a relay keeps its
locks while it runs, and one that dies releases them with its connections,
for another to take over.

A batch travels as PostgreSQL's binary COPY format of broker.transport_message
rows: the sending database writes it and the receiving one reads it, with no
per-message work in Python on either side.  It is sent in the highest wire version
both nodes take (broker.transport.wire), as the destination's /healthz names them: known
for a while, and asked again when the destination refuses a batch's version (415).  A
destination that shares no version with this node refuses every batch, and the messages
wait, retried with backoff, until one node is upgraded.
"""
import io
import logging
import random
import threading
import time
import uuid
from datetime import timedelta

import httpx
import psycopg2
from psycopg2.errors import LockNotAvailable
from sqlalchemy import create_engine
from sqlalchemy.exc import DataError, DBAPIError

from broker import queries, timers, tracing
from broker.listening import listen
from broker.metrics import RELAY_ACKNOWLEDGED, RELAY_BATCH_SECONDS, RELAY_FAILURES, RELAY_SENT
from broker.transport import wire
from broker.transport.addresses import CheckedConnections, checked_client
from broker.transport.sending import (BatchTooLarge, SignatureRefused, TransportFailure, UnsupportedWireVersion,
                                      peer_wire_versions, post_batch)

log = logging.getLogger(__name__)

LANES = 2
IDLE_WAKE_S = 1.0
# Routes change seldom: a lane looks at them again after this long, not in every cycle.
DESTINATIONS_REFRESH_S = 1.0
# Closes and acknowledgements forget old closed endpoints as they happen; on a
# quiet node the relay does it now and then, so none outstays its retention.
# Acknowledged messages past the resend window are forgotten at the same pace, and
# messages that waited longer than their peer remembers are withheld.
FORGET_EVERY_S = 60.0
FORGET_AT_ONCE = 50_000


# A message that a destination refuses as too large on its own is tried again this often (its limit may be raised).
OVERSIZED_RETRY_S = 60.0
# The wire version a destination takes is asked again this often: it may have been upgraded meanwhile.
WIRE_VERSION_KNOWN_FOR_S = 300.0
# A destination that refused the routes' secret and took another is signed for under that one this long, before
# the routes' is tried again (it may hold it by then).
FALLBACK_SECRET_FOR_S = 60.0
# A lane's next batch for a destination, by the wire version it is sent in (broker.transport.wire).
NEXT_BATCH = {4: queries.QUERIES["next_batch_v4"], 3: queries.QUERIES["next_batch_v3"]}


def smaller_batch_bytes(refused_bytes: int, limit_bytes: int | None) -> int:
    """The byte budget after a batch of refused_bytes was refused as too large: within the limit the
    destination gave (less a sixteenth for the estimate's slack), or else half the refused batch."""
    if limit_bytes and limit_bytes < refused_bytes:
        return limit_bytes - limit_bytes // 16
    return refused_bytes // 2


def backoff_s(failures_in_a_row: int) -> float:
    """1 s after the first failure, doubling to a 60 s cap, with jitter so relays do not retry in step."""
    return min(60.0, 2.0 ** (failures_in_a_row - 1)) * random.uniform(0.5, 1.0)


def lane_bounds(lane: int, lanes: int) -> tuple[int, int]:
    """The first and last conversation handle of a lane, as integers: an equal share of the uuid space."""
    share = 2**128 // lanes
    return lane * share, 2**128 - 1 if lane == lanes - 1 else (lane + 1) * share - 1


def lane_digits(lane: int, lanes: int) -> set[str]:
    """The first hex digits of the handles in a lane: a new message's notification carries its handle's."""
    first, last = lane_bounds(lane, lanes)
    return {f"{digit:x}" for digit in range(16) if digit << 124 <= last and first <= (digit + 1 << 124) - 1}


class Relay:
    def __init__(self, database_url: str, *, batch_messages: int = 1000, batch_bytes: int = 8 * 1024 * 1024,
                 timeout_s: float = 30.0, tls_ca_file: str | None = None, lanes: int = LANES,
                 probe_interval_s: float = 60.0):
        """probe_interval_s: how often a destination is asked whether it still holds the last number it
        acknowledged of a conversation a lane sent to lately (broker.probe_conversation), so that a database
        that went back is found with nothing more to send to it."""
        self.database_url = database_url
        self.probe_interval_s = probe_interval_s
        self.engine = create_engine(database_url, pool_size=lanes, pool_pre_ping=True)
        self.lanes = [Lane(self, lane, lanes, CheckedConnections(), timeout_s, tls_ca_file or True)
                      for lane in range(lanes)]
        self.batch_messages, self.batch_bytes = batch_messages, batch_bytes
        # Per destination address: the wire version to send it, and until when that is known.
        self.wire_versions: dict[str, tuple[int, float]] = {}
        # Per destination address: another secret than the routes' that it took a batch under, and until when to
        # sign with that one first.
        self.fallback_secrets: dict[str, tuple[str, float]] = {}

    def secrets_to_sign_with(self, destination) -> list[str]:
        """The secrets held for a destination in the order to try them: the routes' first, unless the destination
        refused it lately and took another; then those being rotated in or out."""
        held = [destination.peer_secret, *destination.other_secrets]
        fallback, until = self.fallback_secrets.get(destination.address, (None, 0.0))
        first = fallback if fallback in held and time.monotonic() < until else destination.peer_secret
        return [first] + [secret for secret in held if secret != first]

    def took_secret(self, destination, secret: str) -> None:
        if secret == destination.peer_secret:
            self.fallback_secrets.pop(destination.address, None)
        else:
            self.fallback_secrets[destination.address] = (secret, time.monotonic() + FALLBACK_SECRET_FOR_S)

    def wire_version(self, client: httpx.Client, address: str) -> int:
        """The wire version to send the destination: the highest both take, as its /healthz names them (asked
        once in a while, not in every cycle), or this node's own when it did not answer."""
        version, known_until = self.wire_versions.get(address, (wire.WIRE_VERSION, 0.0))
        if time.monotonic() >= known_until:  # this node's own, when it does not answer: a refusal corrects it
            version = wire.version_for(peer_wire_versions(client, address)) or wire.WIRE_VERSION
            self.wire_versions[address] = (version, time.monotonic() + WIRE_VERSION_KNOWN_FOR_S)
        return version

    def refused_version(self, address: str, refused: int, theirs: tuple[int, ...]) -> bool:
        """Learns the versions a destination named when it refused a batch of version refused; whether another
        version shared with it is now to be tried."""
        version = wire.version_for(theirs)
        if version is None or version == refused:
            self.wire_versions.pop(address, None)  # asked again before the next attempt
            return False
        self.wire_versions[address] = (version, time.monotonic() + WIRE_VERSION_KNOWN_FOR_S)
        log.warning("%s takes %s: sending it wire version %d", address, wire.in_words(theirs), version)
        return True

    def run(self, stop: threading.Event) -> None:
        """Relays until stop is set: one thread per lane, and one that wakes them on notifications."""
        threads = [threading.Thread(target=lane.run, args=(stop,), name=f"relay lane {lane.index}", daemon=True)
                   for lane in self.lanes]
        threads.append(threading.Thread(target=self._wake_lanes, args=(stop,), name="relay listener", daemon=True))
        threads.append(threading.Thread(target=timers.fire_due_events, args=(self.engine, stop), name="timers", daemon=True))
        threads.append(threading.Thread(target=timers.count_unreported_rollbacks, args=(self.engine, stop),
                                        name="rollback counter", daemon=True))
        threads.append(threading.Thread(target=timers.report_dead_letters, args=(self.engine, stop),
                                        name="dead letter reporter", daemon=True))
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        self.engine.dispose()

    def _wake_lanes(self, stop: threading.Event) -> None:
        """Wakes the lane of each newly committed message (an empty payload wakes them all).

        A database that goes away is waited for; every lane is woken when listening starts again,
        for whatever was committed meanwhile.
        """
        listen(self.database_url, queries.QUERIES["listen_for_transmissions"].text, stop,
               lambda payloads: self._wake({""} if payloads is None else payloads), "new messages")

    def _wake(self, payloads: set[str]) -> None:
        for lane in self.lanes:
            if "" in payloads or payloads & lane.digits:
                lane.wake.set()


class Lane:
    """The conversations of one share of the handle space, for every destination.

    A lane keeps one database session: it holds the lane's lock for each destination it talks to
    (another relay takes over when this session ends), reads its batches and applies the answers.
    """

    def __init__(self, relay: Relay, index: int, lanes: int, connections: CheckedConnections, timeout_s: float,
                 verify):
        self.relay, self.index, self.connections = relay, index, connections
        self.client = checked_client(connections, timeout_s, verify)
        first, last = lane_bounds(index, lanes)
        self.first_handle, self.last_handle = str(uuid.UUID(int=first)), str(uuid.UUID(int=last))
        self.digits = lane_digits(index, lanes)
        self.wake = threading.Event()
        self.connection = None
        self.locked: set[str] = set()
        self.failures_in_a_row: dict[str, int] = {}
        self.retry_at: dict[str, float] = {}
        # Per destination that refused a batch as too large: the byte budget learned from it.
        self.learned_batch_bytes: dict[str, int] = {}
        # Per destination: a conversation side of the last batch it answered, and when to ask about it.
        self.probes: dict[str, tuple[tuple[str, bool], float]] = {}
        self.forget_at = 0.0
        self.destinations: list = []
        self.destinations_at = 0.0
        self.instance: str | None = None

    def run(self, stop: threading.Event) -> None:
        """Relays until stop is set, woken by the listener or by a due retry.

        A database that goes away (restart, crash, cut connection) is waited for, not fatal.
        """
        try:
            while not stop.is_set():
                try:
                    self.wake.clear()  # before the batches are read: a message committed after wakes again
                    self.wake.wait(self.run_once())
                except (psycopg2.Error, DBAPIError) as error:
                    log.warning("database unavailable (%s); retrying in a second", str(error).splitlines()[0])
                    self._disconnect()
                    stop.wait(1)
                except Exception:
                    log.exception("relay cycle failed; retrying in a second")
                    self._disconnect()
                    stop.wait(1)
        finally:
            self._disconnect()
            self.client.close()

    def _disconnect(self) -> None:
        """Ends the lane's session, and with it the locks it held."""
        if self.connection is not None:
            try:
                self.connection.close()
            except DBAPIError:
                pass
        self.connection = None
        self.locked.clear()
        self.destinations_at = 0.0

    def run_once(self) -> float:
        """Sends every due message of the lane; returns how long to wait before a retry is due."""
        if self.connection is None:
            self.connection = self.relay.engine.connect()
        connection = self.connection
        if self.index == 0 and time.monotonic() >= self.forget_at:
            self._continue_queue_positions()
            queries.call(connection, "forget_closed_endpoints")
            queries.call(connection, "withhold_what_peers_forgot")
            passed_over = queries.call(connection, "retry_passed_over").scalars().all()
            connection.commit()
            if passed_over:
                log.warning("the reading passed over %d conversation sides that wait (first %s): they are sent "
                            "again by number", len(passed_over), passed_over[0])
            # The resend window keeps up with any rate: a transaction of its own for each FORGET_AT_ONCE forgotten.
            while queries.call(connection, "forget_acknowledged_messages",
                               max_messages=FORGET_AT_ONCE).scalar_one() >= FORGET_AT_ONCE:
                connection.commit()
            connection.commit()
            self.forget_at = time.monotonic() + FORGET_EVERY_S
        if time.monotonic() >= self.destinations_at:
            self.instance = queries.broker_instance(connection)
            self.destinations = connection.execute(queries.QUERIES["destinations"]).all()
            self.connections.allow_metadata_addresses = connection.execute(
                queries.QUERIES["metadata_addresses_allowed"]).scalar_one()
            connection.commit()
            self.destinations_at = time.monotonic() + DESTINATIONS_REFRESH_S
        idle_s = IDLE_WAKE_S
        for destination in self.destinations:
            wait_s = self.retry_at.get(destination.address, 0.0) - time.monotonic()
            if wait_s > 0:
                idle_s = min(idle_s, wait_s)
            elif self._holds_lock(destination.address):
                self._probe(destination.address)
                self._relay_to(destination)
        return idle_s

    def _probe(self, address: str) -> None:
        """Every probe interval, asks the destination again for the last number it acknowledged of a conversation
        side of its last answered batch; the batches that follow carry the question."""
        side, due_at = self.probes.get(address, (None, 0.0))
        if side is not None and time.monotonic() >= due_at:
            queries.call(self.connection, "probe_conversation", casts={"conversation": "uuid"},
                         conversation=side[0], sender_is_initiator=side[1])
            self.connection.commit()
            self.probes[address] = (side, time.monotonic() + self.relay.probe_interval_s)

    def _continue_queue_positions(self) -> None:
        """Makes new queue positions come after every earlier one in a database restored into a cluster whose
        transaction ids are behind its own (broker.continue_queue_positions); tried again a minute later when the
        transactions that made positions did not end within its wait."""
        try:
            added = queries.call(self.connection, "continue_queue_positions").scalar_one()
            self.connection.commit()
        except DBAPIError as error:
            self.connection.rollback()
            if not isinstance(error.orig, LockNotAvailable):
                raise
            log.warning("queue positions are behind this database's: not raised yet, as transactions that make "
                        "them did not end within 5 s; trying again in a minute")
            return
        if added:
            log.warning("this database was restored into a cluster whose transaction ids are behind its own: queue "
                        "positions now go on after its earlier ones (%d transaction ids added)", added)

    def _holds_lock(self, address: str) -> bool:
        """Whether this lane talks to the destination: it holds the lock, or has just taken it."""
        if address not in self.locked:
            locked = self.connection.execute(queries.QUERIES["try_lane_lock"], {"address": address, "lane": self.index})
            if locked.scalar_one():
                self.locked.add(address)
            self.connection.commit()
        return address in self.locked

    def _relay_to(self, destination) -> None:
        """Sends batches until one comes out less than full: the lane's due messages for the destination
        are sent (a message committed since wakes the lane by its notification)."""
        address = destination.address
        while True:
            max_bytes = self.learned_batch_bytes.get(address, self.relay.batch_bytes)
            version = self.relay.wire_version(self.client, address)
            batch, messages = self._next_batch(address, max_bytes, version)
            if not messages:
                return
            started = time.monotonic()
            RELAY_SENT.labels(address).inc(messages)
            try:
                with tracing.handed_on(batch, "transmit", "client", {"server.address": address}) as batch:
                    answer = self._post(destination, batch, version)
                    delivered = self._apply_answer(destination, batch, answer)
            except UnsupportedWireVersion as refusal:
                RELAY_FAILURES.labels(address).inc()
                if self.relay.refused_version(address, version, refusal.versions):
                    continue
                self._record_failure(address, str(refusal))
                return
            except BatchTooLarge as refusal:
                RELAY_FAILURES.labels(address).inc()
                self._refused_as_too_large(address, refusal, batch, messages)
                continue
            except TransportFailure as failure:
                RELAY_FAILURES.labels(address).inc()
                self._record_failure(address, str(failure))
                return
            self.failures_in_a_row.pop(address, None)
            self.retry_at.pop(address, None)
            RELAY_BATCH_SECONDS.labels(address).observe(time.monotonic() - started)
            RELAY_ACKNOWLEDGED.labels(address).inc(delivered)
            if delivered == 0 or (messages < self.relay.batch_messages and len(batch) < max_bytes // 2):
                return  # all sent, or nothing new taken: wait for the next wake rather than spin

    def _post(self, destination, batch: bytes, version: int) -> str:
        """Posts the batch under each secret held for the destination in turn, until one is not refused (401): so
        the steps of a secret's rotation may come in any order on the two nodes, as long as they share a secret
        (docs/how-to/rotate-a-secret.md)."""
        secrets = self.relay.secrets_to_sign_with(destination)
        for tried, secret in enumerate(secrets, 1):
            try:
                answer = post_batch(self.client, destination, self.instance, batch, version, secret)
            except SignatureRefused:
                if tried == len(secrets):
                    raise
                continue
            self.relay.took_secret(destination, secret)
            return answer

    def _next_batch(self, address: str, max_bytes: int, version: int) -> tuple[bytes, int]:
        """The lane's next batch for the destination, in binary COPY format of that wire version, and how many
        messages it holds: at most the relay's count, and max_bytes unless its first message alone is larger."""
        batch = io.BytesIO()
        with self.connection.begin(), self.connection.connection.cursor() as cursor:  # a transaction of its own
            cursor.copy_expert(queries.with_values(cursor, NEXT_BATCH[version], {
                "address": address, "max_messages": self.relay.batch_messages, "max_bytes": max_bytes,
                "first": self.first_handle, "last": self.last_handle}), batch)
            messages = cursor.rowcount
        return batch.getvalue(), messages

    def _apply_answer(self, destination, batch: bytes, answer: str) -> int:
        """Applies the destination's answer to the batch it answers, in one transaction; returns how many
        messages it acknowledged.  The answer settles only the messages the batch carried: at most the highest
        number it carried of each conversation (see broker.apply_transport_results)."""
        sides = wire.last_numbers(batch)
        try:
            with self.connection.begin():
                delivered = queries.call(
                    self.connection, "apply_transport_results",
                    casts={"answer": "jsonb", "sent_conversations": "uuid[]", "sent_by_initiator": "boolean[]",
                           "last_sent": "bigint[]"}, answer=answer,
                    sent_conversations=queries.array_literal(conversation for conversation, _ in sides),
                    sent_by_initiator=queries.array_literal(by_initiator for _, by_initiator in sides),
                    last_sent=queries.array_literal(sides.values())).scalar_one()
        except DataError as error:  # the results are not what a transport answer holds: nothing was applied
            raise TransportFailure(f"the answer from {destination.address} is malformed: "
                                   f"{str(error.orig).strip().splitlines()[0]}") from error
        if delivered:
            _, due_at = self.probes.get(destination.address, (None, time.monotonic() + self.relay.probe_interval_s))
            self.probes[destination.address] = (next(reversed(sides)), due_at)
        return delivered

    def _refused_as_too_large(self, address: str, refusal: BatchTooLarge, batch: bytes, messages: int) -> None:
        """Learns a smaller byte budget for the destination, or, when a message alone was refused, holds its
        conversation back (its later messages wait behind it) and lets the others go on."""
        if messages > 1:
            self.learned_batch_bytes[address] = smaller_batch_bytes(len(batch), refusal.limit_bytes)
            log.warning("%s refused a batch of %d messages and %d bytes as too large; sending at most %d bytes "
                        "a batch", address, messages, len(batch), self.learned_batch_bytes[address])
            return
        conversation_id, is_initiator = wire.first_conversation(batch)
        handle = self.connection.execute(queries.QUERIES["endpoint_handle"], {
            "conversation_id": conversation_id, "is_initiator": is_initiator}).scalar_one()
        limit = f" of {refusal.limit_bytes} bytes" if refusal.limit_bytes else ""
        reason = (f"{address} answered HTTP 413: the message alone is {len(batch)} bytes in a batch, over that "
                  f"node's limit{limit}")
        log.warning("conversation %s: %s; retrying in %.0f s", handle, reason, OVERSIZED_RETRY_S)
        queries.call(self.connection, "record_transport_failure", destination=address, first_handle=handle,
                     last_handle=handle, reason=reason, retry_after=timedelta(seconds=OVERSIZED_RETRY_S))
        self.connection.commit()

    def _record_failure(self, address: str, reason: str) -> None:
        failures = self.failures_in_a_row[address] = self.failures_in_a_row.get(address, 0) + 1
        retry_after = backoff_s(failures)
        self.retry_at[address] = time.monotonic() + retry_after
        log.warning("%s; retrying in %.1f s", reason, retry_after)
        queries.call(self.connection, "record_transport_failure", destination=address,
                     first_handle=self.first_handle, last_handle=self.last_handle, reason=reason,
                     retry_after=timedelta(seconds=retry_after))
        self.connection.commit()
