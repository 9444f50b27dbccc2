"""Conversation life: ending, errors, cleanup, timers, lifetimes, groups, waiting, retention, status views."""
import json
import threading
import time
from datetime import timedelta
from uuid import uuid4

import pytest
from sqlalchemy import text

import broker
from tests.factories import SHOP_QUEUE, WAREHOUSE_QUEUE, begin, endpoint_state, target_handle


def _types(messages):
    return [m.message_type for m in messages]


def test_end_dialog_reaches_the_far_side_after_everything_sent_and_both_sides_close(engine, orders):
    with engine.begin() as c:
        handle = begin(c)
        broker.send(c, handle, "order.note", "last words")
        broker.end_conversation(c, handle)
        assert endpoint_state(c, handle) == "disconnected_outbound"
    with engine.begin() as c:
        messages = broker.receive(c, WAREHOUSE_QUEUE, 10)
        assert _types(messages) == ["order.note", "broker.end_dialog"]
        target = messages[0].conversation_handle
        assert endpoint_state(c, target) == "disconnected_inbound"
        with pytest.raises(broker.ConversationClosed, match="disconnected inbound"):
            with c.begin_nested():
                broker.send(c, target, "order.note", "too late")
        broker.end_conversation(c, target)
    with engine.begin() as c:
        assert endpoint_state(c, handle) == endpoint_state(c, target) == "closed"
        assert broker.receive(c, SHOP_QUEUE, 10) == []  # the initiator had ended: nothing more to read


def test_end_with_error_delivers_broker_error_with_code_and_description(engine, orders):
    with engine.begin() as c:
        handle = begin(c)
        target = target_handle(c, handle)
        broker.end_conversation(c, target, error_code=4711, error_description="out of stock")
        assert endpoint_state(c, target) == "closed"
    with engine.begin() as c:
        [error] = broker.receive(c, SHOP_QUEUE, 10)
        assert error.message_type == "broker.error"
        assert error.json() == {"code": 4711, "description": "out of stock"}
        assert endpoint_state(c, handle) == "error"
        broker.end_conversation(c, handle)
        assert endpoint_state(c, handle) == "closed"


def test_end_with_cleanup_removes_the_endpoint_without_telling_the_far_side(engine, orders):
    with engine.begin() as c:
        handle = begin(c)
        broker.send(c, handle, "order.note", "x")
        target = target_handle(c, handle)
        broker.end_conversation(c, target, cleanup=True)
        assert endpoint_state(c, target) == "closed"
        assert endpoint_state(c, handle) == "conversing"
        assert broker.receive(c, WAREHOUSE_QUEUE, 10) == []


def test_conversation_timer_delivers_dialog_timer(engine, orders):
    with engine.begin() as c:
        handle = begin(c)
        broker.begin_conversation_timer(c, handle, timedelta(milliseconds=200))
    with engine.begin() as c:
        assert broker.receive(c, SHOP_QUEUE) == []
    with engine.begin() as c:
        [timer] = broker.receive(c, SHOP_QUEUE, wait_ms=3000)
        assert (timer.message_type, timer.message_sequence_number, timer.conversation_handle) == (
            "broker.dialog_timer", 0, handle)
    with engine.begin() as c:
        assert broker.receive(c, SHOP_QUEUE, wait_ms=300) == []  # fired once


def test_lifetime_expiry_ends_the_conversation_with_broker_error_on_both_sides(engine, orders):
    with engine.begin() as c:
        handle = begin(c, lifetime=timedelta(milliseconds=300))
        broker.send(c, handle, "order.note", "x")
        target = target_handle(c, handle)
    time.sleep(0.4)
    with engine.begin() as c:
        shop_side = broker.receive(c, SHOP_QUEUE, 10)
        warehouse_side = broker.receive(c, WAREHOUSE_QUEUE, 10)
    assert _types(shop_side)[-1:] == ["broker.error"]
    assert "broker.error" in _types(warehouse_side)
    assert "lifetime expired" in shop_side[-1].json()["description"]
    with engine.begin() as c:
        assert endpoint_state(c, handle) == endpoint_state(c, target) == "error"
        with pytest.raises(broker.ConversationClosed):
            broker.send(c, handle, "order.note", "y")


def test_related_conversations_share_a_group_and_are_locked_together(engine, orders):
    with engine.begin() as c:
        broker.create_queue(c, "hub_queue")
        broker.create_service(c, "hub", "hub_queue", ["orders"])
        first = begin(c)
        group = c.execute(text("SELECT conversation_group_id FROM broker.endpoints WHERE conversation_handle = :h"),
                          {"h": first}).scalar_one()
        second = begin(c, related_conversation_group=group)
        for handle in (first, second):
            broker.send(c, target_handle(c, handle), "order.note", "reply")
    with engine.connect() as a, engine.connect() as b:
        got = broker.receive(a, SHOP_QUEUE, 10)
        assert {m.conversation_handle for m in got} == {first, second}
        assert {m.conversation_group_id for m in got} == {group}
        assert broker.receive(b, SHOP_QUEUE, 10) == []
        a.rollback()
        b.rollback()


def test_get_conversation_group_locks_it_for_a_later_receive(engine, orders):
    with engine.begin() as c:
        begin_a, begin_b = begin(c), begin(c)
        broker.send(c, begin_a, "order.note", "a")
        broker.send(c, begin_b, "order.note", "b")
    with engine.connect() as a, engine.connect() as b:
        group = broker.get_conversation_group(a, WAREHOUSE_QUEUE)
        assert group is not None
        assert broker.receive(b, WAREHOUSE_QUEUE, 10, conversation_group=group) == []
        [mine] = broker.receive(a, WAREHOUSE_QUEUE, 10, conversation_group=group)
        assert mine.conversation_group_id == group
        a.commit()
        b.rollback()
    with engine.connect() as c:
        assert broker.get_conversation_group(c, SHOP_QUEUE) is None


def test_receive_waits_for_a_message_and_returns_when_it_commits(engine, orders):
    with engine.begin() as c:
        handle = begin(c)

    def send_later():
        time.sleep(0.3)
        with engine.begin() as c:
            broker.send(c, handle, "order.note", "late")

    started = time.monotonic()  # before the sender starts: a loaded machine may run it first, for a while
    threading.Thread(target=send_later).start()
    with engine.begin() as c:
        [message] = broker.receive(c, WAREHOUSE_QUEUE, wait_ms=5000)
    waited = time.monotonic() - started
    assert message.body == b"late"
    assert 0.3 <= waited < 4  # it waited for the send, and returned at its commit, not at wait_ms


def test_receive_with_nothing_there_waits_wait_ms_then_returns_empty(engine, orders):
    started = time.monotonic()
    with engine.begin() as c:
        assert broker.receive(c, WAREHOUSE_QUEUE, wait_ms=300) == []
    assert 0.28 < time.monotonic() - started < 2


def test_retention_keeps_received_messages_until_the_conversation_closes(engine, orders):
    with engine.begin() as c:
        broker.alter_queue(c, WAREHOUSE_QUEUE, retention=True)
        handle = begin(c)
        broker.send(c, handle, "order.note", "kept")
    with engine.begin() as c:
        [message] = broker.receive(c, WAREHOUSE_QUEUE)
    with engine.begin() as c:
        assert broker.receive(c, WAREHOUSE_QUEUE) == []
        received_at = c.execute(text("SELECT received_at FROM broker.queue_messages")).scalar_one()
        assert received_at is not None
        broker.end_conversation(c, message.conversation_handle)
        assert c.execute(text("SELECT count(*) FROM broker.queue_messages WHERE queue_id = "
                              "(SELECT queue_id FROM broker.queues WHERE name = :q)"),
                         {"q": WAREHOUSE_QUEUE}).scalar_one() == 0


def test_disabled_queue_refuses_receive_and_local_send(engine, orders):
    with engine.begin() as c:
        handle = begin(c)
        broker.alter_queue(c, WAREHOUSE_QUEUE, enabled=False)
    with engine.begin() as c:
        with pytest.raises(broker.QueueDisabled) as refused:
            broker.receive(c, WAREHOUSE_QUEUE)
        assert refused.value.sqlstate == "BR030" and "alter_queue" in refused.value.hint
    with engine.begin() as c:
        with pytest.raises(broker.QueueDisabled):
            broker.send(c, handle, "order.note", "x")
    with engine.begin() as c:
        broker.alter_queue(c, WAREHOUSE_QUEUE, enabled=True)
        broker.send(c, handle, "order.note", "x")


def test_queue_status_shows_depth_age_and_readers(engine, orders):
    with engine.begin() as c:
        handle = begin(c)
        for i in range(3):
            broker.send(c, handle, "order.note", str(i))
        begin(c)
    with engine.connect() as reader, engine.connect() as observer:
        broker.receive(reader, WAREHOUSE_QUEUE, 1)
        row = observer.execute(text("SELECT * FROM broker.queue_status WHERE queue_name = :q"),
                               {"q": WAREHOUSE_QUEUE}).mappings().one()
        assert (row["status"], row["depth"], row["readers"]) == ("enabled", 3, 1)
        assert row["oldest_message_age"] >= timedelta(0)
        reader.commit()
        row = observer.execute(text("SELECT * FROM broker.queue_status WHERE queue_name = :q"),
                               {"q": WAREHOUSE_QUEUE}).mappings().one()
        assert (row["depth"], row["readers"]) == (2, 0)


def test_remote_send_waits_in_the_transmission_queue(engine, orders):
    with engine.begin() as c:
        broker.create_route(c, "far_away", "http://127.0.0.1:9/", uuid4(), "a-secret-of-16-chars")
        handle = broker.begin_dialog(c, "shop", "far_away", "orders")
        assert broker.send(c, handle, "order.submit", json.dumps({"sku": 1})) == 1
        broker.end_conversation(c, handle)
    with engine.begin() as c:
        rows = c.execute(text("SELECT to_service, message_sequence_number, message_type, transmission_status"
                              " FROM broker.transmission_queue_status ORDER BY 2")).all()
    assert [tuple(r) for r in rows] == [
        ("far_away", 1, "order.submit", "waiting for its first transmission"),
        ("far_away", 2, "broker.end_dialog", "waiting for its first transmission"),
    ]
