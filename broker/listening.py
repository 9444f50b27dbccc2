"""A session that LISTENs for a node's notifications, in a thread of its own, for as long as the node runs."""
import logging
import select
import threading
from collections.abc import Callable

import psycopg2

log = logging.getLogger(__name__)
# How often a listener with nothing to read looks whether it was told to stop: so that a node stops at once.
STOP_CHECK_S = 0.1


def listen(database_url: str, listen_statement: str, stop: threading.Event,
           notified: Callable[[set[str] | None], None], what: str) -> None:
    """Calls notified with the payloads of the notifications that come, until stop is set; with None when
    listening starts or starts again, and when it ends: anything may have been committed meanwhile.  A database
    that goes away is waited for; `what` names the notifications in the warning that says so."""
    while not stop.is_set():
        listener = None
        try:
            listener = psycopg2.connect(database_url)
            listener.autocommit = True
            listener.cursor().execute(listen_statement)
            notified(None)
            while not stop.is_set():
                if select.select([listener], [], [], STOP_CHECK_S)[0]:
                    listener.poll()
                    payloads = {notification.payload for notification in listener.notifies}
                    listener.notifies.clear()
                    if payloads:
                        notified(payloads)
        except psycopg2.Error as error:
            log.warning("cannot listen for %s (%s); retrying in a second", what, str(error).splitlines()[0])
            stop.wait(1)
        finally:
            if listener is not None:
                listener.close()
    notified(None)
