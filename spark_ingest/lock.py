"""A run's lock on (queue, output), and the database session that holds it.

The lock is a session advisory lock (broker.try_lock_ingest): it lasts exactly as
long as its session.  A session that is killed, cut off, or ended by the server
takes the lock with it, and the run is not told, while another run may now take
the lock.  So the run does all of its SQL on this one session, checks the lock
there before it renames anything into the dataset (and the checkpoint's advance
checks it again, in its transaction), and while Spark writes, checks it every
few seconds, which also keeps the session from looking idle to a firewall.
"""
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from sqlalchemy import Connection
from sqlalchemy.exc import DBAPIError, SQLAlchemyError

from broker import queries
from broker.spark_ingest import checkpoints
from broker.spark_ingest.errors import IngestError

WATCH_INTERVAL_S = 5.0


def _session_ended(error: SQLAlchemyError) -> str:
    """Why a call on the session failed, in one line: the driver's message when there is one."""
    cause = getattr(error, "orig", None) or error
    lines = str(cause).strip().splitlines()
    return f"its database session ended: {lines[0] if lines else type(cause).__name__}"


class RunLock:
    def __init__(self, session: Connection, queue: str, output: str):
        self._session = session
        self._queue = queue
        self._output = output
        self._session_in_use = threading.Lock()  # the watch and the run take turns on the session
        self._lost_because: str | None = None  # once lost, a lock stays lost, for the reason first seen

    @contextmanager
    def transaction(self) -> Iterator[Connection]:
        """A transaction on the lock's session.  A run killed before it commits leaves nothing of it; a session
        found ended took the lock with it."""
        try:
            with self._session_in_use, self._session.begin():
                yield self._session
        except DBAPIError as error:
            if error.connection_invalidated and self._lost_because is None:
                self._lost_because = _session_ended(error)
            raise

    def acquire(self) -> None:
        with self.transaction() as session:
            if not checkpoints.try_lock(session, self._queue, self._output):
                raise IngestError(f"another ingest of queue {self._queue!r} into {self._output} is running")
            session.execute(queries.QUERIES["no_idle_session_timeout"])

    def release(self) -> None:
        """Lets the lock go on the session that holds it, at the end of a run (queries.sql: release_run_lock).  The
        run has committed by then: a session found ended took the lock with it, and is no failure of the run."""
        try:
            with self.transaction() as session:
                session.execute(queries.QUERIES["release_run_lock"])
        except DBAPIError:
            pass

    def verify(self) -> None:
        """Raises IngestError unless this session still holds the lock."""
        if self._lost_because is None:
            try:
                with self.transaction() as session:
                    if not checkpoints.holds_lock(session, self._queue, self._output):
                        self._lost_because = "its database session no longer holds it"
            except SQLAlchemyError as error:
                self._lost_because = self._lost_because or _session_ended(error)
        if self._lost_because is not None:
            raise IngestError(f"the ingest of queue {self._queue!r} into {self._output} lost its lock "
                              f"({self._lost_because}): another run may hold it now, so this one stops without "
                              f"committing; run the ingest again")

    @contextmanager
    def explaining_failures(self) -> Iterator[None]:
        """A block that fails once the lock is lost raises that, not its own error."""
        try:
            yield
        except Exception:
            self.verify()
            raise

    @contextmanager
    def watched(self, on_loss: Callable[[], None]) -> Iterator[None]:
        """Checks the lock every few seconds while the block runs, and calls on_loss (to stop the block's work)
        when it is gone; a block that fails once the lock is lost raises that, not its own error."""
        stop = threading.Event()

        def watch() -> None:
            while not stop.wait(WATCH_INTERVAL_S):
                try:
                    self.verify()
                except IngestError:
                    on_loss()
                    return

        watcher = threading.Thread(target=watch, name="ingest-lock-watch", daemon=True)
        watcher.start()
        try:
            with self.explaining_failures():
                yield
        finally:
            stop.set()
            watcher.join()
