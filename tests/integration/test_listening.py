"""broker.listening: the relay's and the activator's LISTEN session, against a real PostgreSQL whose end of it is
cut and comes back."""
import queue
import threading

import psycopg2
import pytest

from broker.listening import listen

CHANNEL = "broker_queue"


def _notify(database_url: str, payload: str) -> None:
    connection = psycopg2.connect(database_url)
    try:
        connection.autocommit = True
        connection.cursor().execute("SELECT pg_notify(%s, %s)", (CHANNEL, payload))
    finally:
        connection.close()


def _cut_listeners(database_url: str) -> int:
    """Terminates the sessions that listen on CHANNEL; how many there were."""
    connection = psycopg2.connect(database_url)
    try:
        connection.autocommit = True
        with connection.cursor() as cursor:
            cursor.execute("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                           " WHERE datname = current_database() AND query = %s", (f"LISTEN {CHANNEL}",))
            return cursor.fetchone()[0]
    finally:
        connection.close()


@pytest.fixture
def listening(database_url):
    """A listen() running in a thread: what it was called with, in order, and its stop."""
    calls: queue.Queue = queue.Queue()
    stop = threading.Event()
    thread = threading.Thread(target=listen, args=(database_url, f"LISTEN {CHANNEL}", stop, calls.put,
                                                   "arrivals"), daemon=True)
    thread.start()
    yield calls
    stop.set()
    thread.join(timeout=10)
    assert not thread.is_alive()
    assert calls.get(timeout=1) is None  # the last call: anything may have come since


def test_payloads_come_after_a_first_call_that_says_anything_may_have_come(database_url, listening):
    assert listening.get(timeout=10) is None
    _notify(database_url, "7")
    assert listening.get(timeout=10) == {"7"}


def test_a_cut_session_is_listened_on_again_and_says_anything_may_have_come_meanwhile(database_url, listening,
                                                                                     caplog):
    assert listening.get(timeout=10) is None
    assert _cut_listeners(database_url) == 1
    assert listening.get(timeout=10) is None  # listening again, after a second's wait
    assert "cannot listen for arrivals" in caplog.text
    _notify(database_url, "8")
    assert listening.get(timeout=10) == {"8"}
