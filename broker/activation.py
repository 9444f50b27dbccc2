"""Activation: readers that call an application's handler for each batch inside its receive transaction.

The handler runs in the same transaction as the receive, so its own writes
and the consumption of the messages commit together, or not at all.  When a
handler raises, the transaction rolls back, the messages come back, and the
failure is counted against the message that caused it; at the queue's poison
threshold its conversation is quarantined (broker.report_processing_failure).
"""
import logging
import threading
from collections.abc import Callable
from uuid import UUID

from sqlalchemy import Connection, Engine

from broker.core import ReceivedMessage, receive, report_processing_failure

log = logging.getLogger(__name__)

Handler = Callable[[Connection, list[ReceivedMessage]], None]


def process_batch(engine: Engine, queue: str, handler: Handler, *, max_messages: int = 100, wait_ms: int = 1000,
                  conversation_group: UUID | None = None) -> int:
    """Receives one batch and hands it to the handler; returns how many messages were consumed."""
    with engine.connect() as connection:
        messages = receive(connection, queue, max_messages, conversation_group=conversation_group, wait_ms=wait_ms)
        if not messages:
            connection.rollback()
            return 0
        group = messages[0].conversation_group_id
        try:
            handler(connection, messages)
            connection.commit()
            return len(messages)
        except Exception as error:  # the handler's failure is data here, not a crash
            connection.rollback()
            failure = f"{type(error).__name__}: {error}"
    if len(messages) > 1:
        # Take the group one message at a time, so the failure is counted
        # against the message that causes it, not the batch's first.
        consumed = 0
        for _ in messages:
            handled = process_batch(engine, queue, handler, max_messages=1, wait_ms=0, conversation_group=group)
            if handled == 0:
                break
            consumed += handled
        return consumed
    log.warning("processing message %s of conversation %s failed: %s",
                messages[0].message_sequence_number, messages[0].conversation_id, failure)
    with engine.begin() as connection:
        if report_processing_failure(connection, queue, group, failure):
            log.error("conversation %s quarantined: its messages are in broker.dead_letters",
                      messages[0].conversation_id)
    return 0


def run_activation(engine: Engine, queue: str, handler: Handler, stop: threading.Event, *, max_readers: int = 1,
                   max_messages: int = 100, wait_ms: int = 1000) -> None:
    """Runs max_readers concurrent readers until stop is set; each holds one conversation group at a time."""

    def reader() -> None:
        while not stop.is_set():
            try:
                process_batch(engine, queue, handler, max_messages=max_messages, wait_ms=wait_ms)
            except Exception:
                log.exception("reader of queue %s failed; retrying in a second", queue)
                stop.wait(1)

    readers = [threading.Thread(target=reader, name=f"activation-{queue}-{i}", daemon=True)
               for i in range(max_readers)]
    for thread in readers:
        thread.start()
    for thread in readers:
        thread.join()
