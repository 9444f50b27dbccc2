"""Work a running node does by the clock: conversation timers and lifetimes, and the rollbacks readers did not report.

A receive fires the due events of its own queue as it looks for messages, but
a conversation whose queue nobody is reading would keep an expired lifetime:
still conversing, still sending.  A running node fires every queue's due
events a few times a second, in a thread of its relay.  Another thread counts,
once a second, a failure for each message whose receive rolled back without a
report (broker.count_unreported_rollbacks), so that a SQL reader that keeps
rolling back ends in the dead letters instead of looping forever; it may wait
for a reader's group, so it has a thread of its own.  A node that traces
reports each new dead letter in its message's trace, once a second: messages
are dead-lettered by SQL, in many ways, and this sees them all.
"""
import logging
import threading
from collections.abc import Callable

from sqlalchemy import Engine
from sqlalchemy.exc import DBAPIError

from broker import queries, tracing

log = logging.getLogger(__name__)

FIRE_EVERY_S = 0.25
COUNT_ROLLBACKS_EVERY_S = 1.0
REPORT_DEAD_LETTERS_EVERY_S = 1.0
MOST_COUNTED_AT_ONCE = 100
def _every(interval_s: float, engine: Engine, stop: threading.Event, work: Callable[[Engine], None],
           what: str) -> None:
    """Runs work every interval_s until stop is set."""
    while not stop.wait(interval_s):
        _once(engine, stop, work, what)


def _once(engine: Engine, stop: threading.Event, work: Callable[[Engine], None], what: str) -> None:
    """Runs work; a database that goes away is waited for."""
    try:
        work(engine)
    except DBAPIError as error:
        log.warning("cannot %s (%s); retrying in a second", what, str(error).splitlines()[0])
        stop.wait(1)


def _fire(engine: Engine) -> None:
    with engine.begin() as connection:
        queries.call(connection, "fire_due_events")


def _count_rollbacks(engine: Engine) -> None:
    counted = 0
    while counted < MOST_COUNTED_AT_ONCE:  # one a transaction: waiting for one group never holds another
        with engine.begin() as connection:
            if not queries.call(connection, "count_unreported_rollbacks").scalar_one():
                break
        counted += 1
    if counted:
        log.warning("counted a processing failure for %d messages whose readers rolled back without calling "
                    "broker.report_processing_failure", counted)


def fire_due_events(engine: Engine, stop: threading.Event) -> None:
    """Fires due timers and lifetimes every FIRE_EVERY_S until stop is set."""
    _every(FIRE_EVERY_S, engine, stop, _fire, "fire due timers and lifetimes")


def report_dead_letters(engine: Engine, stop: threading.Event) -> None:
    """While this process traces, reports the dead letters made since it started, every
    REPORT_DEAD_LETTERS_EVERY_S until stop is set (broker.tracing.dead_lettered)."""
    if not tracing.enabled():
        return
    reported_up_to: int | None = None

    def report(engine: Engine) -> None:
        nonlocal reported_up_to
        with engine.connect() as connection:
            if reported_up_to is None:
                reported_up_to = connection.execute(queries.QUERIES["last_dead_letter"]).scalar_one()
                return
            letters = connection.execute(queries.QUERIES["traced_dead_letters_after"],
                                         {"after": reported_up_to}).all()
        if letters:
            tracing.dead_lettered(letters)
            reported_up_to = letters[-1].dead_letter_id

    _once(engine, stop, report, "read the dead letters to report")  # what comes from now on, however soon
    _every(REPORT_DEAD_LETTERS_EVERY_S, engine, stop, report, "read the dead letters to report")


def count_unreported_rollbacks(engine: Engine, stop: threading.Event) -> None:
    """Counts the rollbacks that readers did not report every COUNT_ROLLBACKS_EVERY_S until stop is set."""
    _every(COUNT_ROLLBACKS_EVERY_S, engine, stop, _count_rollbacks, "count unreported rollbacks")
