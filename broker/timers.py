"""Conversation timers and lifetimes, fired when they fall due.

A receive fires the due events of its own queue as it looks for messages, but
a conversation whose queue nobody is reading would keep an expired lifetime:
still conversing, still sending.  A running node fires every queue's due
events a few times a second, in a thread of its relay.
"""
import logging
import threading

from sqlalchemy import Engine, text
from sqlalchemy.exc import DBAPIError

log = logging.getLogger(__name__)

FIRE_EVERY_S = 0.25
FIRE_DUE_EVENTS = text("SELECT broker.fire_due_events()")


def fire_due_events(engine: Engine, stop: threading.Event) -> None:
    """Fires due timers and lifetimes every FIRE_EVERY_S until stop is set; a database that goes away is waited for."""
    while not stop.wait(FIRE_EVERY_S):
        try:
            with engine.begin() as connection:
                connection.execute(FIRE_DUE_EVENTS)
        except DBAPIError as error:
            log.warning("cannot fire due timers and lifetimes (%s); retrying in a second", str(error).splitlines()[0])
            stop.wait(1)
