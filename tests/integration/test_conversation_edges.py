"""Conversation edges: leases that never wedge a queue, work cancelled by an error dropped, lifetimes and
timers that take effect when they fall due, notices after the messages they follow, error codes kept for the
broker."""
import threading
import time
from datetime import timedelta

import pytest
from sqlalchemy import text

import broker
from tests import factories
from tests.factories import SHOP_QUEUE, WAREHOUSE_QUEUE, begin, endpoint_state, target_handle
from tests.nodes import wait_for
from tests.rest import ApiServer, new_key

BEGIN = {"from_service": factories.SHOP, "to_service": factories.WAREHOUSE, "contract": factories.CONTRACT}
RECEIVE = "/v1/queues/warehouse_queue/receive"


@pytest.fixture
def admin(database_url, engine, orders):
    with ApiServer(database_url) as server, server.client(new_key(engine, "admin")) as client:
        yield client


def _order(message):
    return message.message_sequence_number, message.message_type


def _fire_due_events(engine, queue):
    """A look at the queue fires its due timers and lifetimes; the transaction commits them."""
    with engine.begin() as c:
        broker.get_conversation_group(c, queue)


# One bad lease must never wedge a queue.


def test_a_lease_that_expires_on_a_conversation_it_quarantines_leaves_the_queue_working(admin, engine):
    handle = admin.post("/v1/conversations", json=BEGIN).json()["conversation_handle"]
    ended = admin.post(f"/v1/conversations/{handle}/end", json={"error_code": 7, "error_description": "gone"})
    assert ended.status_code == 200, ended.text
    for _ in range(4):  # the default poison threshold is 5
        token = admin.post(RECEIVE, json={"lock_s": 30}).json()["lock_token"]
        assert admin.post(f"/v1/locks/{token}/abandon").json() == {"quarantined": False}
    assert admin.post(RECEIVE, json={"lock_s": 1}).status_code == 200
    time.sleep(1.2)

    # The fifth failure (the expiry) quarantines the conversation when the next reader ends the lease.
    for _ in range(3):
        response = admin.post(RECEIVE, json={"wait_ms": 0})
        assert response.status_code == 204, response.text
    with engine.connect() as c:
        [reason] = c.execute(text("SELECT reason FROM broker.dead_letters")).scalars().all()
        assert "the lock expired before it was completed" in reason
        assert c.execute(text("SELECT count(*) FROM broker.leases")).scalar_one() == 0

    fresh = admin.post("/v1/conversations", json=BEGIN).json()["conversation_handle"]
    admin.post(f"/v1/conversations/{fresh}/messages", json={"message_type": "order.note", "body": "next"})
    received = admin.post(RECEIVE, json={"wait_ms": 1000})
    assert received.status_code == 200, received.text
    assert [m["body"] for m in received.json()["messages"]] == ["next"]


def test_the_next_group_is_handed_out_when_an_expired_lease_empties_the_head_group(engine, orders):
    """The expiry quarantines the head conversation (already ended by an error, so it gets no notice):
    its group is left empty, and the reader gets the next group rather than an error."""
    with engine.begin() as c:
        broker.alter_queue(c, WAREHOUSE_QUEUE, poison_threshold=1)
        cancelled, healthy = begin(c), begin(c)
        broker.end_conversation(c, cancelled, error_code=1, error_description="cancelled")
        broker.send(c, healthy, "order.note", "fine")
    with engine.begin() as c:
        [first] = broker.receive_with_lock(c, WAREHOUSE_QUEUE, 10, timedelta(milliseconds=100))
        assert first.message_type == "broker.error"
    time.sleep(0.2)
    with engine.begin() as c:
        [second] = broker.receive_with_lock(c, WAREHOUSE_QUEUE, 10, timedelta(seconds=30))
        assert second.body == b"fine"
        assert broker.receive_with_lock(c, WAREHOUSE_QUEUE, 10, timedelta(seconds=30)) == []
    with engine.connect() as c:
        assert c.execute(text("SELECT message_type FROM broker.dead_letters")).scalars().all() == ["broker.error"]


# END CONVERSATION WITH ERROR drops what has not left the transmission queue.


def _waiting(node):
    with node.engine.connect() as c:
        return [tuple(row) for row in c.execute(text(
            "SELECT message_sequence_number, message_type FROM broker.transmission_queue_status"
            " ORDER BY message_sequence_number"))]


def test_ending_with_an_error_drops_the_messages_not_transmitted_yet(nodes):
    a, b = nodes
    b.stop()
    with a.engine.begin() as c:
        handle = broker.begin_dialog(c, "shop", "warehouse", "orders")
        broker.send(c, handle, "order.submit", '{"order": 1}')
        broker.send(c, handle, "order.submit", '{"order": 2}')
    with a.engine.begin() as c:
        broker.end_conversation(c, handle, error_code=500, error_description="cancelled")
    assert _waiting(a) == [(3, "broker.error")]
    b.start()
    [error] = b.receive_all("warehouse_queue", 1, timeout_s=30)
    assert (error.message_sequence_number, error.message_type) == (3, "broker.error")
    assert error.json() == {"code": 500, "description": "cancelled"}
    with b.engine.begin() as c:
        assert broker.receive(c, "warehouse_queue", 10, wait_ms=500) == []
        assert endpoint_state(c, error.conversation_handle) == "error"
    wait_for(lambda: not _waiting(a), 30, "the error to be acknowledged")


def test_a_lifetime_that_expires_drops_the_messages_not_transmitted_yet(nodes):
    a, b = nodes
    with a.engine.begin() as c:
        handle = broker.begin_dialog(c, "shop", "warehouse", "orders", lifetime=timedelta(minutes=10))
        broker.send(c, handle, "order.note", "first")
    [first] = b.receive_all("warehouse_queue", 1, timeout_s=15)
    b.stop()
    with a.engine.begin() as c:
        broker.send(c, handle, "order.note", "second, cancelled by the expiry")
    # The lifetime ends now at a, rather than a few seconds after it began: how long the steps above take
    # depends on the machine's load, and the second send must fall within it.
    with a.engine.begin() as c:
        c.execute(text("UPDATE broker.endpoints SET expires_at = now() WHERE conversation_handle = :h"), {"h": handle})
    wait_for(lambda: a.scalar("SELECT state FROM broker.endpoints WHERE conversation_handle = :h", h=handle) == "error",
             10, "the lifetime to expire at a")
    assert _waiting(a) == [(3, "broker.error")]
    b.start()
    # a's error: b's side of the conversation has most of its lifetime left
    at_b = b.receive_all("warehouse_queue", 1, timeout_s=15)
    assert [m.message_type for m in at_b] == ["broker.error"]
    with b.engine.begin() as c:
        assert broker.receive(c, "warehouse_queue", 10, wait_ms=500) == []
    wait_for(lambda: not _waiting(a), 30, "the error to be acknowledged")
    assert b.scalar("SELECT receive_sequence FROM broker.endpoints WHERE conversation_handle = :h",
                    h=first.conversation_handle) == 3


# Lifetimes and timers take effect when they fall due.


def test_a_lifetime_ends_both_sides_on_time_without_a_reader(nodes):
    a, b = nodes
    with a.engine.begin() as c:
        handle = broker.begin_dialog(c, "shop", "warehouse", "orders", lifetime=timedelta(seconds=1))
        broker.send(c, handle, "order.note", "in time")
    wait_for(lambda: b.scalar("SELECT count(*) FROM broker.endpoints"), 15, "the conversation to reach b")
    time.sleep(1.5)
    assert a.scalar("SELECT state FROM broker.endpoints") == "error"
    assert b.scalar("SELECT state FROM broker.endpoints") == "error"
    with a.engine.begin() as c, pytest.raises(broker.ConversationClosed):
        broker.send(c, handle, "order.note", "too late")


def test_a_send_past_the_lifetime_is_refused_on_both_sides_before_the_expiry_fires(nodes):
    a, b = nodes
    with a.engine.begin() as c:
        handle = broker.begin_dialog(c, "shop", "warehouse", "orders", lifetime=timedelta(seconds=8))
        broker.send(c, handle, "order.note", "in time")
    [message] = b.receive_all("warehouse_queue", 1, timeout_s=15)
    a.stop()
    b.stop()  # no node fires the expiry: only the sends look at the lifetime
    time.sleep(max(a.scalar("SELECT extract(epoch FROM max(expires_at) - clock_timestamp())::float"
                            " FROM broker.endpoints"), 0) + 0.2)
    for node, conversation in ((a, handle), (b, message.conversation_handle)):
        with node.engine.begin() as c:
            assert endpoint_state(c, conversation) == "conversing"
            with pytest.raises(broker.ConversationClosed, match="lifetime expired"):
                broker.send(c, conversation, "order.note", "too late")
        with node.engine.begin() as c, pytest.raises(broker.ConversationClosed, match="lifetime expired"):
            broker.send_batch(c, [conversation], "order.note", ["too late"])
    assert a.scalar("SELECT count(*) FROM broker.transmission_queue_status") == 0


def test_a_local_send_past_the_lifetime_is_refused(engine, orders):
    with engine.begin() as c:
        handle = begin(c, lifetime=timedelta(milliseconds=200))
        target = target_handle(c, handle)
    time.sleep(0.3)
    for side in (handle, target):
        with engine.begin() as c, pytest.raises(broker.ConversationClosed, match="lifetime expired"):
            broker.send(c, side, "order.note", "too late")


def test_a_conversation_timer_fires_on_a_running_node_without_a_reader(nodes):
    a, _ = nodes
    with a.engine.begin() as c:
        handle = broker.begin_dialog(c, "shop", "warehouse", "orders")
        broker.begin_conversation_timer(c, handle, timedelta(milliseconds=300))
    time.sleep(1.0)
    assert a.scalar("SELECT timer_at IS NULL FROM broker.endpoints WHERE conversation_handle = :h", h=handle)
    assert a.scalar("SELECT depth FROM broker.queue_status WHERE queue_name = 'shop_queue'") == 1


# A local notice comes after the messages that were waiting in its conversation.


def test_a_dialog_timer_comes_after_the_replies_waiting_before_it(engine, orders):
    with engine.begin() as c:
        handle = begin(c)
        target = target_handle(c, handle)
        broker.begin_conversation_timer(c, handle, timedelta(0))
        broker.send(c, target, "order.note", "rep 1")
        broker.send(c, target, "order.note", "rep 2")
    _fire_due_events(engine, SHOP_QUEUE)
    with engine.begin() as c:
        broker.send(c, target, "order.note", "rep 3")
    with engine.begin() as c:
        received = broker.receive(c, SHOP_QUEUE, 10)
    assert [_order(m) for m in received] == [(1, "order.note"), (2, "order.note"), (0, "broker.dialog_timer"),
                                             (3, "order.note")]


def test_an_expiry_notice_comes_after_the_waiting_replies_also_over_rest(admin, engine):
    with engine.begin() as c:
        handle = begin(c, lifetime=timedelta(milliseconds=200))
        target = target_handle(c, handle)
        broker.send(c, handle, "order.note", "req 1")
        broker.send(c, handle, "order.note", "req 2")
    time.sleep(0.3)
    _fire_due_events(engine, WAREHOUSE_QUEUE)
    received = admin.post(RECEIVE, json={"max_messages": 10}).json()["messages"]
    assert [(m["sequence_number"], m["message_type"]) for m in received] == [
        (1, "order.note"), (2, "order.note"), (0, "broker.error")]
    assert received[0]["conversation_handle"] == str(target)


# Error codes of 0 and below belong to the broker.


@pytest.mark.parametrize("code", [0, -1, -2, -3, -2**31])
def test_an_error_code_of_zero_or_below_is_refused(admin, engine, code):
    with engine.begin() as c:
        handle = begin(c)
    with engine.begin() as c, pytest.raises(broker.InvalidArgument, match="belong to the broker|must be positive"):
        broker.end_conversation(c, handle, error_code=code, error_description="mine")
    response = admin.post(f"/v1/conversations/{handle}/end", json={"error_code": code, "error_description": "mine"})
    assert response.status_code == 400 and response.json()["type"] == "/problems/invalid-argument"
    with engine.connect() as c:
        assert endpoint_state(c, handle) == "conversing"


def test_fire_due_events_ends_expired_lifetimes_of_every_queue(engine, orders):
    with engine.begin() as c:
        handle = begin(c, lifetime=timedelta(milliseconds=100))
        target = target_handle(c, handle)
    time.sleep(0.2)
    with engine.begin() as c:
        assert c.execute(text("SELECT broker.fire_due_events()")).scalar_one() == 1
    with engine.connect() as c:
        assert endpoint_state(c, handle) == endpoint_state(c, target) == "error"


def test_a_quarantine_and_an_ending_of_the_same_conversation_do_not_deadlock(engine, orders):
    """The quarantine locks the conversation before its messages, as every other writer does: here it
    waits for a transaction that holds the conversation and then ends it, rather than deadlocking."""
    with engine.begin() as c:
        broker.alter_queue(c, WAREHOUSE_QUEUE, poison_threshold=1)
        handle = begin(c)
        target = target_handle(c, handle)
        broker.send(c, handle, "order.note", "poison")
    with engine.begin() as c:
        [leased] = broker.receive_with_lock(c, WAREHOUSE_QUEUE, 10, timedelta(seconds=30))
    outcome = {}

    def abandon():
        try:
            with engine.begin() as c:
                outcome["quarantined"] = broker.abandon_lock(c, leased.lock_token)
        except Exception as error:  # noqa: BLE001 - the test reports whatever it was
            outcome["error"] = error

    with engine.begin() as c:
        broker.send(c, target, "order.note", "reply")  # holds the conversation until this commits
        abandoning = threading.Thread(target=abandon)
        abandoning.start()
        time.sleep(0.5)  # the abandon now waits for the conversation
        broker.end_conversation(c, target)
    abandoning.join(timeout=30)
    assert "error" not in outcome, outcome.get("error")
    with engine.connect() as c:
        assert endpoint_state(c, target) == "disconnected_outbound"
        assert c.execute(text("SELECT count(*) FROM broker.queue_messages WHERE conversation_handle = :h"),
                         {"h": target}).scalar_one() == 0
