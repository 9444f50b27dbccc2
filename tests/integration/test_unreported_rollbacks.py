"""A SQL reader that rolls back its receive and never reports the failure: the node counts it, from the trace the
rollback leaves on the message's row, so that the reader does not loop forever; a reader that reports is never
counted twice, and one that holds the group or commits is left alone."""
import threading
import time

import pytest
from sqlalchemy import text

import broker
from tests.factories import WAREHOUSE_QUEUE, notes_waiting
from tests.nodes import wait_for

COUNT_NOW = text("SELECT broker.count_unreported_rollbacks(grace => interval '0')")
COUNT_AFTER_AN_HOUR = text("SELECT broker.count_unreported_rollbacks(grace => interval '1 hour')")


def _attempts(engine) -> list[int]:
    with engine.connect() as connection:
        return list(connection.execute(text("SELECT failed_attempts FROM broker.queue_messages ORDER BY queue_position"))
                    .scalars())


def _receive_and_roll_back(engine, max_messages=1):
    with engine.connect() as connection:
        received = broker.receive(connection, WAREHOUSE_QUEUE, max_messages)
        connection.rollback()
    return received


def _count(engine, statement=COUNT_NOW) -> int:
    with engine.begin() as connection:
        return connection.execute(statement).scalar_one()


def test_a_reader_that_keeps_rolling_back_ends_its_conversation_in_the_dead_letters(engine, orders):
    with engine.begin() as connection:
        broker.alter_queue(connection, WAREHOUSE_QUEUE, poison_threshold=3)
    notes_waiting(engine, "poison", "after it")
    for attempt in (1, 2, 3):
        [message] = _receive_and_roll_back(engine)
        assert message.body == b"poison"
        assert _count(engine) == 1
    notes_waiting(engine, "fine")
    with engine.connect() as connection:
        letters = connection.execute(text("SELECT body, reason FROM broker.dead_letters ORDER BY dead_letter_id")).all()
    assert [bytes(body) for body, _ in letters] == [b"poison", b"after it"]
    assert "its reader rolled back without calling broker.report_processing_failure" in letters[0].reason
    with engine.begin() as connection:
        assert [m.body for m in broker.receive(connection, WAREHOUSE_QUEUE, 10)] == [b"fine"]


def test_a_rollback_is_counted_once_and_the_head_of_the_group_only(engine, orders):
    notes_waiting(engine, "1", "2", "3")
    assert len(_receive_and_roll_back(engine, max_messages=3)) == 3
    assert _count(engine) == 1
    assert _count(engine) == 0
    assert _attempts(engine) == [1, 0, 0]


def test_a_reader_that_reports_its_failure_within_the_grace_is_not_counted_again(engine, orders):
    notes_waiting(engine, "bad")
    [message] = _receive_and_roll_back(engine)
    assert _count(engine, COUNT_AFTER_AN_HOUR) == 0  # seen, and remembered
    with engine.begin() as connection:
        broker.report_processing_failure(connection, WAREHOUSE_QUEUE, message.conversation_group_id, "bad input")
    assert _count(engine) == 0
    assert _attempts(engine) == [1]
    # It fails again, and reports again before the node's second look: a new failure count, nothing counted twice.
    _receive_and_roll_back(engine)
    assert _count(engine, COUNT_AFTER_AN_HOUR) == 0
    with engine.begin() as connection:
        broker.report_processing_failure(connection, WAREHOUSE_QUEUE, message.conversation_group_id, "bad input")
    assert _count(engine) == 0
    assert _attempts(engine) == [2]


def test_a_head_seen_rolled_back_is_counted_only_after_the_grace(engine, orders):
    notes_waiting(engine, "bad")
    _receive_and_roll_back(engine)
    with engine.begin() as connection:
        assert connection.execute(text(
            "SELECT broker.count_unreported_rollbacks(grace => interval '0.3 seconds')")).scalar_one() == 0
    time.sleep(0.4)
    with engine.begin() as connection:
        assert connection.execute(text(
            "SELECT broker.count_unreported_rollbacks(grace => interval '0.3 seconds')")).scalar_one() == 1
    assert _attempts(engine) == [1]


def test_a_reader_still_at_work_or_one_that_commits_is_left_alone(engine, orders):
    notes_waiting(engine, "slow work")
    with engine.connect() as reader:
        assert broker.receive(reader, WAREHOUSE_QUEUE, 1)
        assert _count(engine) == 0  # the reader holds the group: its delete is in progress
        reader.rollback()
    with engine.connect() as holder:  # a reader that rolled back and holds the group again is not counted under it
        holder.execute(text("SELECT broker.get_conversation_group(:q)"), {"q": WAREHOUSE_QUEUE})
        assert _count(engine) == 0
        holder.rollback()
    assert _count(engine) == 1
    with engine.begin() as connection:
        assert broker.receive(connection, WAREHOUSE_QUEUE, 1)
    assert _count(engine) == 0
    assert _attempts(engine) == []


def test_a_reader_that_holds_the_group_most_of_the_time_is_counted_once_it_lets_go(engine, orders):
    """Each receive of a slow reader is still at work whenever the node looks: that its predecessor's has gone
    without taking the message is what counts, and the node waits for the group as a reader does."""
    notes_waiting(engine, "slow poison")
    first = engine.connect()
    assert broker.receive(first, WAREHOUSE_QUEUE, 1)
    assert _count(engine) == 0  # at work
    first.rollback()
    with engine.connect() as second:
        assert broker.receive(second, WAREHOUSE_QUEUE, 1)
        counting = threading.Thread(target=lambda: counted.append(_count(engine)))
        counted = []
        counting.start()
        time.sleep(0.3)
        assert counted == []  # waiting for the group
        second.rollback()
        counting.join(5)
    first.close()
    assert counted == [1]
    assert _attempts(engine) == [1]


def test_a_rollback_of_a_retention_queue_is_counted_and_a_committed_one_is_not(engine, orders):
    with engine.begin() as connection:
        broker.alter_queue(connection, WAREHOUSE_QUEUE, retention=True)
    notes_waiting(engine, "kept")
    _receive_and_roll_back(engine)
    assert _count(engine) == 1
    with engine.begin() as connection:
        assert broker.receive(connection, WAREHOUSE_QUEUE, 1)
    assert _count(engine) == 0


@pytest.mark.parametrize("arguments, message", [
    ("max_messages => NULL", "max_messages must not be null"),
    ("max_messages => -1", "max_messages must be zero or more, got -1"),
    ("grace => NULL", "grace must be zero or more, got NULL"),
    ("grace => interval '-1 s'", "grace must be zero or more, got -00:00:01"),
])
def test_bad_arguments_are_refused(engine, orders, arguments, message):
    """A negative grace would count a rollback that just happened; a NULL one would silently count nothing."""
    notes_waiting(engine, "just rolled back")
    _receive_and_roll_back(engine)
    with engine.connect() as connection:
        with pytest.raises(Exception) as refused:
            connection.execute(text(f"SELECT broker.count_unreported_rollbacks({arguments})"))
        assert refused.value.orig.pgcode == "BR050"
        assert message in refused.value.orig.diag.message_primary
    assert _attempts(engine) == [0]


def test_a_running_node_ends_a_readers_endless_rollbacks(nodes):
    """The warehouse node's own timers count what a SQL reader that never reports leaves behind."""
    a, b = nodes
    with b.engine.begin() as c:
        broker.alter_queue(c, "warehouse_queue", poison_threshold=2)
    with a.engine.begin() as c:
        handle = broker.begin_dialog(c, "shop", "warehouse", "orders")
        broker.send(c, handle, "order.submit", '{"sku": "poison"}')
    wait_for(lambda: b.scalar("SELECT depth FROM broker.queue_status WHERE queue_name = 'warehouse_queue'") == 1,
             30, "the message to arrive")
    rollbacks = 0
    deadline = time.monotonic() + 30
    while b.scalar("SELECT count(*) FROM broker.dead_letters") == 0 and time.monotonic() < deadline:
        with b.engine.connect() as reader:
            if broker.receive(reader, "warehouse_queue", 1):
                rollbacks += 1
            reader.rollback()
        time.sleep(0.05)
    assert b.scalar("SELECT count(*) FROM broker.dead_letters") == 1, f"still looping after {rollbacks} rollbacks"
    wait_for(lambda: a.scalar("SELECT state FROM broker.conversation_endpoints") == "error", 30,
             "the shop to learn that its conversation ended in error")
