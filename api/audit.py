"""The node's record of what API keys did to its queues and conversations: one INFO line an action, on the
logger "broker.api.audit", whoever the client (the console, a script, the CLI over REST).

A line names the key (its name and id, never its secret), the action, what it acted on and how it ended:
what it did, or why it was refused.  A request refused before the route runs (no valid key, a request off the
schema) acted on nothing and is not recorded here."""
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from broker.api.problems import BY_ERROR_CLASS, Problem
from broker.api_keys import ApiKey
from broker.errors import BrokerError

log = logging.getLogger(__name__)


@dataclass
class Outcome:
    """What the action did, in words, set by the route once it is done (and committed)."""

    done: str = "done"


@contextmanager
def action(key: ApiKey, what: str, target: str) -> Iterator[Outcome]:
    """Records the action on exit: with the outcome the block set, or as refused or failed when it raised.  The
    line holds no text a client chose but the key's name, written as a Python literal (control characters
    escaped); a refusal is told by its status and problem type, whose detail the client was answered."""
    who = f"key {key.name!r} ({key.key_id})"
    outcome = Outcome()
    try:
        yield outcome
    except Problem as error:
        log.info("%s %s %s: refused, %s %s", who, what, target, error.status, error.kind)
        raise
    except BrokerError as error:
        status, kind, _ = BY_ERROR_CLASS[type(error)]
        log.info("%s %s %s: refused, %s %s (%s)", who, what, target, status, kind, error.sqlstate)
        raise
    except Exception as error:
        log.info("%s %s %s: failed, %s", who, what, target, type(error).__name__)
        raise
    log.info("%s %s %s: %s", who, what, target, outcome.done)
