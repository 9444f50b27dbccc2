"""The broker's exceptions, one per class of mistake, each tied to the SQLSTATEs the SQL API raises."""
from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy.exc import DBAPIError


class BrokerError(Exception):
    """A mistake the broker refused, with its SQLSTATE and, when there is one, a hint."""

    sqlstates: tuple[str, ...] = ()

    def __init__(self, message: str, sqlstate: str, hint: str | None = None, detail: str | None = None):
        super().__init__(message)
        self.message = message
        self.sqlstate = sqlstate
        self.hint = hint
        self.detail = detail


class UnknownObject(BrokerError):
    """An unknown service, message type, contract, queue, conversation or route."""

    sqlstates = ("BR001", "BR002", "BR003", "BR004", "BR005", "BR006")


class NotAllowed(BrokerError):
    """The contract does not allow this message type in this direction, or the target refuses the contract."""

    sqlstates = ("BR010", "BR011")


class ValidationFailed(BrokerError):
    """The body fails its message type's validation."""

    sqlstates = ("BR012",)


class ConversationClosed(BrokerError):
    """The conversation is not in a state that allows this (ended, closed, in error)."""

    sqlstates = ("BR020",)


class SequenceConflict(BrokerError):
    """A numbered send out of turn, or a number reused with another content."""

    sqlstates = ("BR021",)

    @property
    def expected_sequence_number(self) -> int:
        return int(self.detail)


class QueueDisabled(BrokerError):
    sqlstates = ("BR030",)


class AlreadyExists(BrokerError):
    sqlstates = ("BR040",)


class InUse(BrokerError):
    sqlstates = ("BR041",)


class InvalidArgument(BrokerError):
    """A NULL, out-of-range or malformed argument."""

    sqlstates = ("BR050",)


class MessageTooLarge(InvalidArgument):
    """A message body bigger than the node's limit."""

    sqlstates = ("BR051",)


class LockLost(BrokerError):
    """A lease that expired, was completed or abandoned, or never existed; or an ingest checkpoint advanced by
    a session that does not hold the run's lock."""

    sqlstates = ("BR060",)
    REASONS = ("expired", "completed", "abandoned", "purged", "dead_lettered", "unknown")

    @property
    def reason(self) -> str | None:
        """Why a lease's lock was lost: one of REASONS (None for an ingest lock)."""
        return self.detail if self.detail in self.REASONS else None


class CheckpointMoved(BrokerError):
    """An ingest run found its checkpoint moved by another run."""

    sqlstates = ("BR070",)


class ActivationRefused(BrokerError):
    """A queue activation whose procedure is not a PROCEDURE taking the queue's name, or whose role may not run
    it (unknown, a superuser, or without EXECUTE on it or on broker.receive)."""

    sqlstates = ("BR080", "BR081")


def _descendants(cls: type[BrokerError]) -> list[type[BrokerError]]:
    return [d for sub in cls.__subclasses__() for d in (sub, *_descendants(sub))]


BY_SQLSTATE: dict[str, type[BrokerError]] = {code: cls for cls in _descendants(BrokerError) for code in cls.sqlstates}


@contextmanager
def translated_errors() -> Iterator[None]:
    """Turns the SQL API's errors into BrokerError subclasses; other errors pass through."""
    try:
        yield
    except DBAPIError as error:
        diag = getattr(error.orig, "diag", None)
        sqlstate = getattr(error.orig, "pgcode", None)
        cls = BY_SQLSTATE.get(sqlstate or "")
        if cls is None or diag is None:
            raise
        raise cls(diag.message_primary, sqlstate, diag.message_hint, diag.message_detail) from error
