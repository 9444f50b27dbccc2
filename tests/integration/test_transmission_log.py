"""The transmission log: a message is appended once, its acknowledgement moves a watermark and deletes and copies
nothing, the relay reads it by position from a cursor per lane, and what the log keeps within resend_window is the
resend window.  As in test_agreement, the two nodes are two databases and the relay's and the far node's work is
done as they do it, without servers, so that a transaction can stay open at the very moment a case needs."""
from sqlalchemy import text

import broker
from tests import factories
from tests.integration.test_agreement import (  # noqa: F401 (fixture)
    FIRST_HANDLE, LAST_HANDLE, WAREHOUSE_ADDRESS, carry, carry_all, shop_and_warehouse)

LOG_ROWS = "SELECT count(*) FROM broker.transmission_log"
WAITING = "SELECT count(*) FROM broker.transmission_queue_status"


def delivered(b) -> list[str]:
    """The bodies b's application receives, group after group."""
    bodies = []
    with b.engine.begin() as c:
        while messages := broker.receive(c, factories.WAREHOUSE_QUEUE, None):
            bodies += [m.body.decode() for m in messages]
    return bodies


def _begin(a, count: int) -> list:
    with a.engine.begin() as c:
        return [broker.begin_dialog(c, factories.SHOP, factories.WAREHOUSE, factories.CONTRACT) for _ in range(count)]


def test_an_acknowledgement_moves_a_watermark_and_the_log_keeps_the_message_for_the_resend_window(
        shop_and_warehouse):
    a, b = shop_and_warehouse
    [handle] = _begin(a, 1)
    with a.engine.begin() as c:
        for n in (1, 2, 3):
            broker.send(c, handle, "order.note", f"note {n}")
    carry_all(a, b)
    assert delivered(b) == ["note 1", "note 2", "note 3"]
    assert a.scalar(WAITING) == 0
    assert a.scalar(LOG_ROWS) == 3  # kept where they were written
    assert a.scalar("SELECT acknowledged_sequence FROM broker.transmission_progress") == 3
    assert a.scalar("SELECT count(*) FROM broker.acknowledged_messages") == 0
    with a.engine.begin() as c:
        assert c.execute(text("SELECT broker.forget_acknowledged_messages()")).scalar_one() == 0  # within the window
        c.execute(text("UPDATE broker.transmission_log SET enqueued_at = now() - interval '25 hours'"
                       " WHERE message_sequence_number < 3"))
        assert c.execute(text("SELECT broker.forget_acknowledged_messages(1)")).scalar_one() == 1
        assert c.execute(text("SELECT broker.forget_acknowledged_messages(1)")).scalar_one() == 1
        assert c.execute(text("SELECT broker.forget_acknowledged_messages(1)")).scalar_one() == 0
    assert a.scalar("SELECT min(message_sequence_number) FROM broker.transmission_log") == 3


def test_a_message_not_acknowledged_stays_however_old(shop_and_warehouse):
    a, _ = shop_and_warehouse
    [handle] = _begin(a, 1)
    with a.engine.begin() as c:
        broker.send(c, handle, "order.note", "the far node never answered")
        c.execute(text("UPDATE broker.transmission_log SET enqueued_at = now() - interval '25 hours'"))
        assert c.execute(text("SELECT broker.forget_acknowledged_messages()")).scalar_one() == 0
    assert a.scalar(WAITING) == 1


def test_a_transaction_that_commits_after_later_batches_is_not_passed_over(shop_and_warehouse):
    """The open transaction takes its log position first; others commit after it and their batches are sent and
    answered, each answer moving the lane's cursor; only then does it commit.  Its message is sent all the same."""
    a, b = shop_and_warehouse
    early, *later = _begin(a, 4)
    with a.engine.connect() as open_transaction:
        broker.send(open_transaction, early, "order.note", "positioned first, committed last")
        for n, handle in enumerate(later):
            with a.engine.begin() as c:
                broker.send(c, handle, "order.note", f"committed {n}")
            assert carry(a, b) is not None
            assert carry(a, b) is None  # nothing more: the cursor may move on
        assert a.scalar("SELECT min(read_position) FROM broker.transmission_cursors") < a.scalar(
            "SELECT min(position) FROM broker.transmission_log WHERE conversation_handle <> :h", h=early)
        open_transaction.commit()
    carry_all(a, b)
    assert sorted(delivered(b)) == [
        "committed 0", "committed 1", "committed 2", "positioned first, committed last"]
    assert a.scalar(WAITING) == 0


def test_a_transaction_younger_than_every_ended_one_is_not_passed_over(shop_and_warehouse):
    """The open transaction takes its id and its log position while no transaction ends after it, so a snapshot
    taken then reckons it among those still to come (its id is past the snapshot's xmax), not among those running;
    batches read meanwhile, each ending a transaction younger than it, must still not move the cursor past it."""
    a, b = shop_and_warehouse
    [handle] = _begin(a, 1)
    with a.engine.connect() as open_transaction:
        broker.send(open_transaction, handle, "order.note", "positioned while the batches were read")
        assert carry(a, b) is None
        assert carry(a, b) is None
        open_transaction.commit()
    carry_all(a, b)
    assert delivered(b) == ["positioned while the batches were read"]
    assert a.scalar(WAITING) == 0


def test_the_cursor_moves_past_what_was_acknowledged_once_no_transaction_can_write_below_it(shop_and_warehouse):
    a, b = shop_and_warehouse
    handles = _begin(a, 3)
    for round_ in range(3):
        with a.engine.begin() as c:
            broker.send_batch(c, handles, "order.note", [f"round {round_}"] * 3)
        carry_all(a, b)
    carry(a, b)  # an empty batch moves the cursor at once
    assert a.scalar("SELECT read_position FROM broker.transmission_cursors") == a.scalar(
        "SELECT max(position) FROM broker.transmission_log")
    assert len(delivered(b)) == 9


def test_an_idle_lanes_poll_writes_nothing_and_the_next_message_is_read(shop_and_warehouse):
    """A lane polls every second: once its cursor stands at the log's end it takes no transaction id (so writes no
    WAL) until a message comes."""
    a, b = shop_and_warehouse
    [handle] = _begin(a, 1)
    with a.engine.begin() as c:
        broker.send(c, handle, "order.note", "before the lane fell idle")
    carry_all(a, b)
    assert carry(a, b) is None and carry(a, b) is None  # the cursor moves to the log's end
    cursor_row = "SELECT xmin::text FROM broker.transmission_cursors"
    written = a.scalar(cursor_row)
    with a.engine.begin() as c:
        assert c.execute(text("SELECT count(*) FROM broker.next_batch(:address, 1000, 8388608, :first, :last)"),
                         {"address": WAREHOUSE_ADDRESS, "first": FIRST_HANDLE, "last": LAST_HANDLE}).scalar_one() == 0
        assert c.execute(text("SELECT pg_current_xact_id_if_assigned()")).scalar_one() is None
    assert a.scalar(cursor_row) == written
    with a.engine.begin() as c:
        broker.send(c, handle, "order.note", "after")
    carry_all(a, b)
    assert delivered(b) == ["before the lane fell idle", "after"]


def test_a_message_the_reading_passed_over_is_found_and_sent_by_number(shop_and_warehouse):
    """Were the cursor ever past a message that is neither acknowledged nor waiting for a retry, the relay's minute
    finds its conversation side and sends it by number; a side that waits as it should is left alone."""
    a, b = shop_and_warehouse
    passed_over, waiting = _begin(a, 2)
    with a.engine.begin() as c:
        broker.send(c, waiting, "order.note", "read in its turn")
    assert carry(a, b) is not None
    with a.engine.begin() as c:
        broker.send(c, passed_over, "order.note", "behind the cursor")
        broker.send(c, waiting, "order.note", "waits in its turn")
        c.execute(text("INSERT INTO broker.transmission_retries (conversation_handle, to_service, priority,"
                       " next_attempt_at) SELECT conversation_handle, far_service, priority, now() + interval '1 day'"
                       " FROM broker.endpoints WHERE conversation_handle = :h"), {"h": waiting})
        # the fault: the cursor past a message it was never sent
        c.execute(text("UPDATE broker.transmission_cursors SET read_position = (SELECT max(position)"
                       " FROM broker.transmission_log)"))
    assert carry(a, b) is None
    with a.engine.begin() as c:
        assert c.execute(text("SELECT broker.retry_passed_over()")).scalars().all() == [passed_over]
        assert c.execute(text("SELECT broker.retry_passed_over()")).all() == []  # once
    assert carry(a, b) is not None
    assert delivered(b) == ["read in its turn", "behind the cursor"]
    assert a.scalar(WAITING) == 1  # the other side's retry is a day away


def test_a_lanes_read_takes_what_lies_past_its_cursor_not_what_the_log_keeps(shop_and_warehouse):
    """The reading is planned once, whatever the values: its plan must not read the log by the lane's range of
    handles, which holds every message the log keeps of the lane's conversations."""
    a, b = shop_and_warehouse
    handles = _begin(a, 20)
    for _ in range(100):
        with a.engine.begin() as c:
            broker.send_batch(c, handles, "order.note", ["kept for the resend window"] * len(handles))
    carry_all(a, b)
    with a.engine.begin() as c:
        c.execute(text("ANALYZE broker.transmission_log"))  # as autovacuum does: the planner knows what the log keeps
        broker.send(c, handles[0], "order.note", "the one message past the cursor")
    with a.engine.begin() as c:
        assert c.execute(text("SELECT count(*) FROM broker.next_batch(:address, 1000, 8388608, :first, :last)"),
                         {"address": WAREHOUSE_ADDRESS, "first": FIRST_HANDLE, "last": LAST_HANDLE}).scalar_one() == 1
        index_entries_read = c.execute(text(
            "SELECT sum(pg_stat_get_xact_tuples_returned(indexrelid)) FROM pg_index"
            " WHERE indrelid = 'broker.transmission_log'::regclass")).scalar_one()
        c.rollback()
    assert a.scalar(LOG_ROWS) == 2001
    assert index_entries_read < 100
