"""Poison messages: a message whose processing keeps failing is quarantined; the queue keeps flowing."""
import threading
from datetime import timedelta

from sqlalchemy import text

import broker
from broker.activation import process_batch, run_activation
from tests.factories import SHOP_QUEUE, WAREHOUSE_QUEUE, begin, endpoint_state, target_handle
from tests.nodes import wait_for


def _failing_on(body):
    def handler(connection, messages):
        for message in messages:
            if message.body == body:
                raise ValueError(f"cannot process {body!r}")
    return handler


def test_report_processing_failure_quarantines_at_the_threshold(engine, orders):
    with engine.begin() as c:
        broker.alter_queue(c, WAREHOUSE_QUEUE, poison_threshold=3)
        handle = begin(c)
        for body in ("poison", "after"):
            broker.send(c, handle, "order.note", body)
    for attempt in range(1, 4):
        with engine.connect() as c:
            [message, _] = broker.receive(c, WAREHOUSE_QUEUE, 10)
            c.rollback()
        with engine.begin() as c:
            quarantined = broker.report_processing_failure(c, WAREHOUSE_QUEUE, message.conversation_group_id, "boom")
        assert quarantined == (attempt == 3)
    with engine.begin() as c:
        letters = c.execute(text("SELECT message_sequence_number, failed_attempts, reason FROM broker.dead_letters"
                                 " ORDER BY message_sequence_number")).all()
        assert [(n, f) for n, f, _ in letters] == [(1, 3), (2, 0)]
        assert "processing failed 3 times; last failure: boom" in letters[0].reason
        assert endpoint_state(c, handle) == "error"
        assert endpoint_state(c, message.conversation_handle) == "error"
        [error] = broker.receive(c, SHOP_QUEUE, 10)
        assert error.message_type == "broker.error" and error.json()["code"] == -2
        [notice] = broker.receive(c, WAREHOUSE_QUEUE, 10)
        assert (notice.message_type, notice.message_sequence_number) == ("broker.error", 0)


def test_a_group_whose_processing_failed_is_passed_over_while_another_waits(engine, orders):
    """A SQL reader's failure, reported, backs the group off: the next receive takes the group behind it, and the
    failed one again once no other group waits, back-off or not."""
    with engine.begin() as c:
        poison, other = begin(c), begin(c)
        broker.send(c, poison, "order.note", "poison")
        for body in ("other 1", "other 2"):
            broker.send(c, other, "order.note", body)
    with engine.connect() as c:
        [message] = broker.receive(c, WAREHOUSE_QUEUE, 10)
        c.rollback()
    assert message.body == b"poison"
    with engine.begin() as c:
        assert not broker.report_processing_failure(c, WAREHOUSE_QUEUE, message.conversation_group_id, "boom")
        backed_off = c.execute(text("SELECT backed_off_until - clock_timestamp() FROM broker.conversation_groups"
                                    " WHERE conversation_group_id = :g"), {"g": message.conversation_group_id})
        assert timedelta(seconds=0.5) < backed_off.scalar_one() < timedelta(seconds=1)
    with engine.begin() as c:
        assert [m.body for m in broker.receive(c, WAREHOUSE_QUEUE, 10)] == [b"other 1", b"other 2"]
    with engine.begin() as c:
        assert [m.body for m in broker.receive(c, WAREHOUSE_QUEUE, 10)] == [b"poison"]


def test_a_failure_is_counted_against_the_message_that_causes_it(engine, orders):
    with engine.begin() as c:
        handle = begin(c)
        for body in ("good", "poison", "after"):
            broker.send(c, handle, "order.note", body)
    handled = []

    def handler(connection, messages):
        _failing_on(b"poison")(connection, messages)
        handled.extend(m.body for m in messages)

    assert process_batch(engine, WAREHOUSE_QUEUE, handler, wait_ms=0) == 1
    assert handled == [b"good"]
    with engine.begin() as c:
        counts = c.execute(text("SELECT convert_from(body, 'UTF8'), failed_attempts FROM broker.queue_messages"
                                " ORDER BY message_sequence_number")).all()
    assert [tuple(r) for r in counts] == [("poison", 1), ("after", 0)]


def test_activation_quarantines_a_poison_conversation_while_others_flow(engine, orders):
    with engine.begin() as c:
        handles = [begin(c) for _ in range(6)]
        for i in range(10):
            for n, handle in enumerate(handles):
                broker.send(c, handle, "order.note", "poison" if (n, i) == (0, 4) else f"{n}:{i}")
    handled: dict = {}
    lock = threading.Lock()

    def handler(connection, messages):
        _failing_on(b"poison")(connection, messages)
        connection.execute(text("SELECT 1"))  # the handler's own work, in the receive transaction
        with lock:
            for m in messages:
                handled.setdefault(m.conversation_id, []).append((m.message_sequence_number, m.body))

    stop = threading.Event()
    worker = threading.Thread(target=run_activation, args=(engine, WAREHOUSE_QUEUE, handler, stop),
                              kwargs={"max_readers": 3, "max_messages": 4, "wait_ms": 100})
    worker.start()
    try:
        wait_for(lambda: _depth(engine) == 0, 60, "the queue to drain", interval_s=0.1)
    finally:
        stop.set()
    worker.join()

    with engine.begin() as c:
        poisoned_conversation = c.execute(text(
            "SELECT conversation_id FROM broker.endpoints WHERE conversation_handle = :h"),
            {"h": handles[0]}).scalar_one()
        letters = c.execute(text("SELECT message_sequence_number, reason FROM broker.dead_letters"
                                 " ORDER BY message_sequence_number")).all()
        assert endpoint_state(c, target_handle(c, handles[0])) == "error"
    assert [n for n, _ in letters] == list(range(5, 11))
    assert "processing failed 5 times" in letters[0].reason
    for n, handle in enumerate(handles[1:], start=1):
        with engine.begin() as c:
            conversation = c.execute(text("SELECT conversation_id FROM broker.endpoints"
                                          " WHERE conversation_handle = :h"), {"h": handle}).scalar_one()
        assert handled[conversation] == [(i + 1, f"{n}:{i}".encode()) for i in range(10)]
    poisoned = handled[poisoned_conversation]
    assert poisoned[:4] == [(i + 1, f"0:{i}".encode()) for i in range(4)]
    [(number, notice)] = poisoned[4:]  # then only the local broker.error notice
    assert number == 0 and b'"code": -2' in notice


def _depth(engine) -> int:
    with engine.begin() as c:
        return c.execute(text("SELECT depth FROM broker.queue_status WHERE queue_name = :q"),
                         {"q": WAREHOUSE_QUEUE}).scalar_one()
