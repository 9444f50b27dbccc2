"""Delayed and scheduled delivery: a message held until its delivery time keeps its sequence number and its
conversation's order (nothing sent after it is handed out before it), locally, across two real nodes, and
over real HTTP."""
import time
from datetime import datetime, timedelta, timezone

import pytest
from sqlalchemy import text

import broker
from broker import queries
from tests.factories import SHOP_QUEUE, WAREHOUSE_QUEUE, begin
from tests.nodes import wait_for
from tests.rest import ApiServer, new_key

SECOND = timedelta(seconds=1)


def _received(engine, queue=WAREHOUSE_QUEUE) -> list[tuple[int, bytes]]:
    with engine.begin() as connection:
        return [(m.message_sequence_number, m.body) for m in broker.receive(connection, queue, None)]


def _all_received(engine, queue=WAREHOUSE_QUEUE) -> list[tuple[int, bytes]]:
    received = []
    while batch := _received(engine, queue):
        received += batch
    return received


def test_a_held_message_and_those_after_it_wait_for_its_time_and_others_do_not(engine, orders):
    sent = time.monotonic()  # before the send, whose delivery time counts from the send itself, not the commit
    with engine.begin() as connection:
        held, other = begin(connection), begin(connection)
        assert broker.send(connection, held, "order.note", "first", deliver_after=1.5 * SECOND) == 1
        assert broker.send(connection, held, "order.note", "second") == 2
        broker.send(connection, other, "order.note", "not held")
    assert _received(engine) == [(1, b"not held")]
    assert _received(engine) == []
    with engine.begin() as connection:
        waiting = connection.execute(queries.QUERIES["transmission_queue"], {"limit": 10, "offset": 0})
        [(message_type, status)] = {(r.message_type, r.transmission_status.split(",")[0]) for r in waiting}
        assert (message_type, status) == ("order.note", "held until its delivery time")
    with engine.begin() as connection:
        arrived = broker.receive(connection, WAREHOUSE_QUEUE, None, wait_ms=5000)
    assert time.monotonic() - sent >= 1.4
    assert [(m.message_sequence_number, m.body) for m in arrived] == [(1, b"first"), (2, b"second")]
    with engine.connect() as connection:
        assert connection.execute(text("SELECT count(*) FROM broker.transmission_queue_status")).scalar_one() == 0
        assert connection.execute(text("SELECT held_until FROM broker.endpoints"
                                       " WHERE conversation_handle = :h"), {"h": held}).scalar_one() is None


def test_a_batch_after_a_held_message_waits_behind_it_and_goes_in_bulk_once_it_is_delivered(engine, orders):
    with engine.begin() as connection:
        handle = begin(connection)
        broker.send(connection, handle, "order.note", "held", deliver_at=datetime.now(timezone.utc) + SECOND)
        assert broker.send_batch(connection, [handle, handle], "order.note", [b"a", b"b"]) == [2, 3]
    assert _received(engine) == []
    with engine.begin() as connection:
        assert broker.receive(connection, WAREHOUSE_QUEUE, None, wait_ms=5000)
    with engine.begin() as connection:
        assert broker.send_batch(connection, [handle], "order.note", [b"c"]) == [4]
    assert _received(engine) == [(4, b"c")]


def test_the_node_delivers_held_messages_without_a_reader(engine, orders):
    with engine.begin() as connection:
        handle = begin(connection)
        broker.send(connection, handle, "order.note", "held", deliver_after=0.2 * SECOND)
    time.sleep(0.3)
    with engine.begin() as connection:
        assert connection.execute(text("SELECT broker.fire_due_events()")).scalar_one() == 1
        assert connection.execute(text("SELECT depth FROM broker.queue_status WHERE queue_name = :q"),
                                  {"q": WAREHOUSE_QUEUE}).scalar_one() == 1


def test_a_delivery_time_past_or_now_is_no_hold(engine, orders):
    with engine.begin() as connection:
        handle = begin(connection)
        broker.send(connection, handle, "order.note", "past", deliver_at=datetime(2000, 1, 1, tzinfo=timezone.utc))
        broker.send(connection, handle, "order.note", "now", deliver_after=timedelta(0))
    assert _received(engine) == [(1, b"past"), (2, b"now")]


def test_an_ending_waits_behind_what_is_held_and_an_error_drops_it(engine, orders):
    with engine.begin() as connection:
        ended, failed = begin(connection), begin(connection)
        for handle in (ended, failed):
            broker.send(connection, handle, "order.note", "held", deliver_after=SECOND)
        broker.end_conversation(connection, ended)
        broker.end_conversation(connection, failed, error_code=7, error_description="cancelled")
    with engine.begin() as connection:
        [error] = broker.receive(connection, WAREHOUSE_QUEUE, None)
        assert error.message_type == "broker.error" and error.json()["code"] == 7
    with engine.begin() as connection:
        arrived = broker.receive(connection, WAREHOUSE_QUEUE, None, wait_ms=5000)
    assert [m.message_type for m in arrived] == ["order.note", "broker.end_dialog"]


@pytest.mark.parametrize("delivery, words", [
    ("deliver_after => interval '1 s', deliver_at => now()", "not both"),
    ("deliver_at => 'infinity'", "must be finite"),
    ("deliver_after => 'infinity'", "must be finite"),
    # Python's datetime, psycopg2's and the REST API's, reads no year past 9999: status and lists would fail on it.
    ("deliver_at => '9999-12-31T23:59:59-14:00'", "before the year 10000 UTC"),
    ("deliver_after => interval '8000 years'", "before the year 10000 UTC")])
def test_a_delivery_time_that_makes_no_sense_is_refused(engine, orders, delivery, words):
    with engine.begin() as connection:
        handle = begin(connection)
    with pytest.raises(Exception, match=words), engine.begin() as connection:
        connection.execute(text(f"SELECT broker.send(:h, 'order.note', NULL, {delivery})"), {"h": handle})
    with pytest.raises(broker.InvalidArgument, match="not both"), engine.begin() as connection:
        broker.send(connection, handle, "order.note", "x", deliver_after=SECOND, deliver_at=datetime.now(timezone.utc))


def test_a_timer_or_a_lifetime_that_ends_past_the_year_9999_is_refused(engine, orders):
    with engine.begin() as connection:
        handle = begin(connection)
    with pytest.raises(broker.InvalidArgument, match="a timer must be finite and before the year 10000 UTC"), \
            engine.begin() as connection:
        broker.begin_conversation_timer(connection, handle, timedelta(days=365 * 8000))
    with pytest.raises(broker.InvalidArgument, match="the end of a lifetime must be finite and before the year"), \
            engine.begin() as connection:
        begin(connection, lifetime=timedelta(days=365 * 8000))


def test_status_and_diagnose_tell_held_messages_from_stuck_ones(engine, orders):
    with engine.begin() as connection:
        broker.send(connection, begin(connection), "order.note", "held", deliver_after=60 * SECOND)
        [destination] = connection.execute(queries.QUERIES["transmission_by_destination"])
        assert (destination.destination, destination.messages) == ("(this node)", 1)
        assert destination.status.startswith("held until its delivery time")
        assert connection.execute(queries.QUERIES["unrouted_services"]).all() == []


def test_a_reply_held_by_the_target_keeps_the_reply_order(engine, orders):
    with engine.begin() as connection:
        handle = begin(connection)
        broker.send(connection, handle, "order.submit", '{"n": 1}')
    with engine.begin() as connection:
        [request] = broker.receive(connection, WAREHOUSE_QUEUE, 1)
        broker.send(connection, request.conversation_handle, "order.note", "later", deliver_after=0.5 * SECOND)
        broker.send(connection, request.conversation_handle, "order.ack")
    assert _received(engine, SHOP_QUEUE) == []
    with engine.begin() as connection:
        replies = broker.receive(connection, SHOP_QUEUE, None, wait_ms=5000)
    assert [m.message_type for m in replies] == ["order.note", "order.ack"]


def test_held_messages_cross_to_another_node_in_order(nodes):
    a, b = nodes
    sent = time.monotonic()  # before the send, whose delivery time counts from the send itself, not the commit
    with a.engine.begin() as c:
        handle = broker.begin_dialog(c, "shop", "warehouse", "orders")
        broker.send(c, handle, "order.submit", '{"n": 1}', deliver_after=2 * SECOND)
        broker.send(c, handle, "order.submit", '{"n": 2}')
        other = broker.begin_dialog(c, "shop", "warehouse", "orders")
        broker.send(c, other, "order.submit", '{"n": 0}')
    assert [m.json() for m in b.receive_all("warehouse_queue", 1)] == [{"n": 0}]
    time.sleep(1)
    assert a.scalar("SELECT count(*) FROM broker.transmission_queue_status") == 2  # still held on a
    arrived = b.receive_all("warehouse_queue", 2)
    assert time.monotonic() - sent >= 1.9
    assert [(m.message_sequence_number, m.json()) for m in arrived] == [(1, {"n": 1}), (2, {"n": 2})]
    wait_for(lambda: a.scalar("SELECT count(*) FROM broker.transmission_queue_status") == 0, 30, "a's queue to drain")


def test_rest_sends_a_held_message_numbered_or_not(database_url, orders, engine):
    with engine.begin() as connection:
        handle = begin(connection)
    with ApiServer(database_url) as api, api.client(new_key(engine, "admin")) as client:
        path = f"/v1/conversations/{handle}/messages"
        held = client.post(path, json={"message_type": "order.note", "body": "held", "deliver_after_s": 0.5})
        assert held.status_code == 201 and held.json()["sequence_number"] == 1
        at = (datetime.now(timezone.utc) + timedelta(seconds=0.5)).isoformat()
        numbered = {"message_type": "order.note", "body": "numbered", "sequence_number": 2, "deliver_at": at}
        assert client.post(path, json=numbered).json() == {"sequence_number": 2, "duplicate": False}
        assert client.post(path, json=numbered).json() == {"sequence_number": 2, "duplicate": True}
        assert client.post(path, json={"message_type": "order.note", "deliver_at": "2026-01-01T00:00:00"}
                           ).status_code == 422  # a time without its zone
        both = client.post(path, json={"message_type": "order.note", "deliver_after_s": 1, "deliver_at": at})
        assert both.status_code == 400 and "not both" in both.json()["detail"]
        batch = client.post("/v1/messages", json={"messages": [
            {"conversation_handle": str(handle), "sequence_number": 3, "message_type": "order.note",
             "deliver_after_s": 1}]})
        assert batch.status_code == 422  # a batch holds nothing
    assert _received(engine) == []
    arrived = []  # each is delivered when its own time comes, which may be in two firings of the timers
    deadline = time.monotonic() + 10
    while len(arrived) < 2 and time.monotonic() < deadline:
        with engine.begin() as connection:
            arrived += broker.receive(connection, WAREHOUSE_QUEUE, None, wait_ms=1000)
    assert [m.body for m in arrived] == [b'"held"', b'"numbered"']
