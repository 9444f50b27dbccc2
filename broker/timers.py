"""Work a running node does by the clock: conversation timers and lifetimes, and the rollbacks readers did not report.

A receive fires the due events of its own queue as it looks for messages, but
a conversation whose queue nobody is reading would keep an expired lifetime:
still conversing, still sending.  A running node fires every queue's due
events a few times a second, in a thread of its relay.  Another thread counts,
once a second, a failure for each message whose receive rolled back without a
report (broker.count_unreported_rollbacks), so that a SQL reader that keeps
rolling back ends in the dead letters instead of looping forever; it may wait
for a reader's group, so it has a thread of its own.
"""
import logging
import threading
from collections.abc import Callable

from sqlalchemy import Engine, text
from sqlalchemy.exc import DBAPIError

log = logging.getLogger(__name__)

FIRE_EVERY_S = 0.25
COUNT_ROLLBACKS_EVERY_S = 1.0
MOST_COUNTED_AT_ONCE = 100
FIRE_DUE_EVENTS = text("SELECT broker.fire_due_events()")
COUNT_UNREPORTED_ROLLBACKS = text("SELECT broker.count_unreported_rollbacks()")


def _every(interval_s: float, engine: Engine, stop: threading.Event, work: Callable[[Engine], None],
           what: str) -> None:
    """Runs work every interval_s until stop is set; a database that goes away is waited for."""
    while not stop.wait(interval_s):
        try:
            work(engine)
        except DBAPIError as error:
            log.warning("cannot %s (%s); retrying in a second", what, str(error).splitlines()[0])
            stop.wait(1)


def _fire(engine: Engine) -> None:
    with engine.begin() as connection:
        connection.execute(FIRE_DUE_EVENTS)


def _count_rollbacks(engine: Engine) -> None:
    counted = 0
    while counted < MOST_COUNTED_AT_ONCE:  # one a transaction: waiting for one group never holds another
        with engine.begin() as connection:
            if not connection.execute(COUNT_UNREPORTED_ROLLBACKS).scalar_one():
                break
        counted += 1
    if counted:
        log.warning("counted a processing failure for %d messages whose readers rolled back without calling "
                    "broker.report_processing_failure", counted)


def fire_due_events(engine: Engine, stop: threading.Event) -> None:
    """Fires due timers and lifetimes every FIRE_EVERY_S until stop is set."""
    _every(FIRE_EVERY_S, engine, stop, _fire, "fire due timers and lifetimes")


def count_unreported_rollbacks(engine: Engine, stop: threading.Event) -> None:
    """Counts the rollbacks that readers did not report every COUNT_ROLLBACKS_EVERY_S until stop is set."""
    _every(COUNT_ROLLBACKS_EVERY_S, engine, stop, _count_rollbacks, "count unreported rollbacks")
