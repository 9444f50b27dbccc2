"""Internal activation: a running node calls each activated queue's procedure while the queue has messages.

broker.set_queue_activation declares the procedure (broker/sql/functions/17_activation.sql).  The supervisor
looks at the activated queues when a message arrives in one of them (LISTEN broker_queue: an arrival in another
queue costs nothing more) and every POLL_S besides, on a connection it keeps.  For a queue
with messages waiting and no reader in this process, it starts one at once; while messages still wait and no
reader found nothing to take for GROW_AFTER_S, it starts another, up to max_queue_readers.

A reader is a thread with a connection of its own that holds one of the queue's reader slots (the readers of all
nodes on the database together hold at most max_queue_readers) and calls broker.call_activated_procedure, each call
in a transaction of its own, committed when the call ends.  What a procedure that raises did is rolled back, and
its failure is counted against the message it left in the same call, which backs the message's group off: the
queue's other groups go first for a while (broker._back_off).  The reader pauses FAILURE_PAUSE_S after a failure,
so as not to call a procedure that keeps failing at once again when nothing else waits.  An error that ends the
call's transaction is counted by broker.count_unreported_rollbacks, as any reader's rollback is.  A reader stops
once a call finds no conversation group with messages that no other reader holds, and its connection closes with
it.

What the calls did (committed, rolled back, the last failure) is added to broker.queue_activation every
RECORD_EVERY_S, for `broker status`, /metrics and the console.
"""
import logging
import threading
import time
from dataclasses import dataclass

from sqlalchemy import create_engine
from sqlalchemy.exc import DBAPIError
from sqlalchemy.pool import NullPool

from broker import queries
from broker.listening import listen
from broker.masking import visible

log = logging.getLogger(__name__)

POLL_S = 0.5
SUPERVISE_AT_MOST_EVERY_S = 0.05  # a burst of arrivals wakes the supervisor once, not once a message
GROW_AFTER_S = 0.5
FAILURE_PAUSE_S = 0.25
RECORD_EVERY_S = 1.0
LAST_FAILURE_CHARS = 1000


@dataclass
class Tally:
    """Calls of a queue's procedure since they were last recorded."""
    activations: int = 0
    failures: int = 0
    last_failure: str | None = None


class Activator:
    def __init__(self, database_url: str):
        self.database_url = database_url
        self.engine = create_engine(database_url, poolclass=NullPool)  # a reader's connection closes with it
        self.watching = create_engine(database_url, pool_size=1, max_overflow=0, pool_pre_ping=True)
        # The ids of the activated queues, as the notification of an arrival names them.
        self.activated: frozenset[str] = frozenset()
        self.lock = threading.Lock()
        self.readers: dict[str, list[threading.Thread]] = {}
        # Per queue: when a reader last started, or last found nothing to take (or ended).
        self.settled_at: dict[str, float] = {}
        self.tallies: dict[str, Tally] = {}
        self.arrived = threading.Event()

    def run(self, stop: threading.Event) -> None:
        """Supervises the activated queues until stop is set, then waits for the readers' calls in progress."""
        listener = threading.Thread(target=self._listen, args=(stop,), name="activation listener", daemon=True)
        listener.start()
        recorded_at = time.monotonic()
        while not stop.is_set():
            self.arrived.wait(POLL_S)
            self.arrived.clear()
            if stop.is_set():
                break
            try:
                self._supervise(stop)
            except DBAPIError as error:
                log.warning("cannot look at the activated queues (%s); retrying in a second",
                            str(error.orig).splitlines()[0])
                stop.wait(1)
            if time.monotonic() - recorded_at >= RECORD_EVERY_S:
                self._record()
                recorded_at = time.monotonic()
            stop.wait(SUPERVISE_AT_MOST_EVERY_S)
        listener.join()
        for threads in list(self.readers.values()):
            for thread in threads:
                thread.join()
        self._record()
        self.engine.dispose()
        self.watching.dispose()

    def _supervise(self, stop: threading.Event) -> None:
        with self.watching.connect() as connection:
            queues = queries.select_from(connection, "activated_queues").all()
        self.activated = frozenset(str(queue.queue_id) for queue in queues)
        now = time.monotonic()
        with self.lock:
            for queue in queues:
                running = [thread for thread in self.readers.get(queue.queue_name, ()) if thread.is_alive()]
                self.readers[queue.queue_name] = running
                if not queue.messages_waiting or len(running) >= queue.max_queue_readers:
                    continue
                if running and now - self.settled_at.get(queue.queue_name, 0.0) < GROW_AFTER_S:
                    continue
                reader = threading.Thread(target=self._read, args=(queue.queue_name, stop),
                                          name=f"activation {queue.queue_name} {len(running)}", daemon=True)
                running.append(reader)
                self.settled_at[queue.queue_name] = now
                reader.start()

    def _read(self, queue: str, stop: threading.Event) -> None:
        """Calls the queue's procedure until a call finds nothing to take, holding a reader slot meanwhile."""
        try:
            with self.engine.connect() as connection:
                slot = queries.call(connection, "take_activation_slot", queue=queue).scalar()
                connection.commit()
                while slot is not None and not stop.is_set():
                    try:
                        failure = connection.execute(queries.QUERIES["activate"],
                                                     {"queue": queue, "slot": slot}).scalar_one()
                        connection.commit()
                    except DBAPIError as error:
                        connection.rollback()
                        if error.connection_invalidated:
                            raise
                        diagnostics = getattr(error.orig, "diag", None)
                        failure = (diagnostics.message_primary if diagnostics and diagnostics.message_primary
                                   else str(error.orig).splitlines()[0])
                    if failure is None:
                        break
                    if failure:
                        self._failed(queue, failure)
                        stop.wait(FAILURE_PAUSE_S)
                    else:
                        self._succeeded(queue)
        except DBAPIError as error:
            log.warning("a reader of queue %s stopped (%s)", queue, str(error.orig).splitlines()[0])
        finally:
            with self.lock:
                self.settled_at[queue] = time.monotonic()

    def _failed(self, queue: str, failure: str) -> None:
        reason = failure[:LAST_FAILURE_CHARS]
        log.warning("the activated procedure of queue %s failed and was rolled back: %s", queue, visible(reason))
        with self.lock:
            tally = self.tallies.setdefault(queue, Tally())
            tally.failures += 1
            tally.last_failure = reason

    def _succeeded(self, queue: str) -> None:
        with self.lock:
            self.tallies.setdefault(queue, Tally()).activations += 1

    def _record(self) -> None:
        """Adds what the calls did since the last time to the queues' totals; kept for the next time when the
        database does not answer."""
        with self.lock:
            tallies, self.tallies = self.tallies, {}
        try:
            with self.watching.begin() as connection:
                for queue, tally in tallies.items():
                    connection.execute(queries.QUERIES["record_activations"], {
                        "queue": queue, "activations": tally.activations, "failures": tally.failures,
                        "last_failure": tally.last_failure})
        except DBAPIError as error:
            log.warning("cannot record the activations (%s)", str(error.orig).splitlines()[0])
            with self.lock:
                for queue, tally in tallies.items():
                    kept = self.tallies.setdefault(queue, Tally())
                    kept.activations += tally.activations
                    kept.failures += tally.failures
                    kept.last_failure = kept.last_failure or tally.last_failure

    def _listen(self, stop: threading.Event) -> None:
        """Wakes the supervisor whenever a message arrives in an activated queue; a database that goes away is
        waited for."""
        listen(self.database_url, queries.QUERIES["listen_for_arrivals"].text, stop, self._arrived,
               "arrivals")

    def _arrived(self, queues: set[str] | None) -> None:
        """Wakes the supervisor for arrivals in activated queues, or for anything (None)."""
        if queues is None or queues & self.activated:
            self.arrived.set()
