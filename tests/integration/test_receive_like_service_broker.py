"""Receive as Service Broker users write it: by conversation handle, the whole locked group (RECEIVE
without TOP), waiting until a message comes (WAITFOR without TIMEOUT), and conversations related by
handle in begin_dialog. In SQL and over real HTTP."""
import threading
import time
from datetime import timedelta

import pytest
from sqlalchemy import text

import broker
from tests import factories
from tests.factories import SHOP_QUEUE, WAREHOUSE_QUEUE, begin, target_handle
from tests.rest import ApiServer, new_key


def _related_pair(engine) -> tuple:
    """Two of the shop's conversations in one group, the second related to the first by its handle, and the
    warehouse's replies on both waiting in the shop's queue: first's 1, 2 and second's 1, 2, 3."""
    with engine.begin() as connection:
        first = begin(connection)
        second = begin(connection, related_conversation=first)
        for handle, replies in ((first, 2), (second, 3)):
            for n in range(1, replies + 1):
                broker.send(connection, target_handle(connection, handle), "order.note", f"{n}")
    return first, second


def _group_of(engine, handle):
    with engine.connect() as connection:
        return connection.execute(text("SELECT conversation_group_id FROM broker.conversation_endpoints"
                                       " WHERE conversation_handle = :h"), {"h": handle}).scalar_one()


def test_a_conversation_related_by_handle_joins_its_group(engine, orders):
    first, second = _related_pair(engine)
    assert _group_of(engine, first) == _group_of(engine, second)
    with engine.begin() as connection:
        received = broker.receive(connection, SHOP_QUEUE, None)
    assert {m.conversation_group_id for m in received} == {_group_of(engine, first)}


def test_a_conversation_in_another_queue_cannot_be_related(engine, orders):
    with engine.begin() as connection:
        warehouse_side = target_handle(connection, begin(connection))
    with pytest.raises(broker.InvalidArgument, match="belongs to another queue"), engine.begin() as connection:
        begin(connection, related_conversation=warehouse_side)


def test_receive_by_conversation_handle_hands_out_that_conversation_alone_and_locks_its_group(engine, orders):
    first, second = _related_pair(engine)
    with engine.connect() as reader, engine.connect() as other:
        received = broker.receive(reader, SHOP_QUEUE, 10, conversation_handle=second)
        assert [(m.conversation_handle, m.message_sequence_number, m.body) for m in received] == [
            (second, 1, b"1"), (second, 2, b"2"), (second, 3, b"3")]
        assert broker.receive(other, SHOP_QUEUE, 10) == []  # the group is held, first's replies with it
        other.rollback()
        reader.commit()
    with engine.begin() as connection:
        rest = broker.receive(connection, SHOP_QUEUE, 10)
    assert [(m.conversation_handle, m.message_sequence_number) for m in rest] == [(first, 1), (first, 2)]


def test_receive_by_handle_and_group_must_agree(engine, orders):
    first, second = _related_pair(engine)
    group = _group_of(engine, first)
    with engine.begin() as connection:
        both = broker.receive(connection, SHOP_QUEUE, 1, conversation_group=group, conversation_handle=first)
    assert [(m.conversation_handle, m.message_sequence_number) for m in both] == [(first, 1)]
    with engine.begin() as connection:
        lone = begin(connection)
    with pytest.raises(broker.InvalidArgument, match="is not in conversation group"), engine.begin() as connection:
        broker.receive(connection, SHOP_QUEUE, 1, conversation_group=group, conversation_handle=lone)


def test_receive_without_a_limit_takes_the_whole_locked_group_in_order(engine, orders):
    first, second = _related_pair(engine)
    with engine.begin() as connection:
        other = begin(connection)
        broker.send(connection, target_handle(connection, other), "order.note", "other group")
    with engine.begin() as connection:
        received = broker.receive(connection, SHOP_QUEUE, None)
    by_conversation = {}
    for m in received:
        by_conversation.setdefault(m.conversation_handle, []).append(m.message_sequence_number)
    assert by_conversation == {first: [1, 2], second: [1, 2, 3]}
    with engine.begin() as connection:
        assert [m.body for m in broker.receive(connection, SHOP_QUEUE, None)] == [b"other group"]


def _receive_in_thread(engine, **options) -> tuple[threading.Thread, list]:
    outcome = []

    def run():
        with engine.begin() as connection:
            started = time.monotonic()
            outcome.append((broker.receive(connection, **options), time.monotonic() - started))

    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome


def test_wait_minus_one_waits_until_a_message_comes(engine, orders):
    thread, outcome = _receive_in_thread(engine, queue=WAREHOUSE_QUEUE, max_messages=10, wait_ms=-1)
    time.sleep(1.5)
    assert outcome == []  # still waiting
    with engine.begin() as connection:
        broker.send(connection, begin(connection), "order.note", "at last")
    thread.join(timeout=10)
    [(received, waited)] = outcome
    assert [m.body for m in received] == [b"at last"] and waited >= 1.5


def test_wait_minus_one_by_handle_waits_for_that_conversation_though_its_group_has_others(engine, orders):
    first, second = _related_pair(engine)
    with engine.begin() as connection:
        assert len(broker.receive(connection, SHOP_QUEUE, 10, conversation_handle=second)) == 3
    thread, outcome = _receive_in_thread(engine, queue=SHOP_QUEUE, max_messages=10, wait_ms=-1,
                                         conversation_handle=second)
    time.sleep(1)
    assert outcome == []
    with engine.begin() as connection:
        broker.send(connection, target_handle(connection, second), "order.note", "4")
    thread.join(timeout=10)
    [(received, _)] = outcome
    assert [(m.conversation_handle, m.message_sequence_number) for m in received] == [(second, 4)]


def test_a_wait_without_end_is_bounded_by_the_statement_timeout(engine, orders):
    with pytest.raises(Exception, match="statement timeout"), engine.begin() as connection:
        connection.execute(text("SET LOCAL statement_timeout = '300ms'"))
        broker.receive(connection, WAREHOUSE_QUEUE, wait_ms=-1)


def test_get_conversation_group_waits_without_end_too(engine, orders):
    outcome = []

    def run():
        with engine.begin() as connection:
            outcome.append(broker.get_conversation_group(connection, WAREHOUSE_QUEUE, wait_ms=-1))

    thread = threading.Thread(target=run)
    thread.start()
    time.sleep(0.5)
    assert outcome == []
    with engine.begin() as connection:
        handle = begin(connection)
        broker.send(connection, handle, "order.note", "x")
        target = target_handle(connection, handle)
    thread.join(timeout=10)
    assert outcome == [_group_of(engine, target)]


def test_receive_with_lock_by_conversation_handle(engine, orders):
    first, second = _related_pair(engine)
    with engine.begin() as connection:
        leased = broker.receive_with_lock(connection, SHOP_QUEUE, 10, timedelta(seconds=30),
                                          conversation_handle=first)
    assert [(m.conversation_handle, m.message_sequence_number) for m in leased] == [(first, 1), (first, 2)]
    with engine.begin() as connection:
        assert broker.receive(connection, SHOP_QUEUE, 10, conversation_handle=second) == []  # the lease holds it
        assert broker.complete_lock(connection, leased[0].lock_token) == 2
        assert [m.message_sequence_number for m in broker.receive(connection, SHOP_QUEUE, 10)] == [1, 2, 3]


# Over REST


@pytest.fixture
def admin(database_url, orders, engine):
    with ApiServer(database_url) as server, server.client(new_key(engine, "admin")) as client:
        yield client


def test_rest_relates_a_conversation_by_handle_and_receives_by_handle(engine, admin):
    begin_request = {"from_service": factories.SHOP, "to_service": factories.WAREHOUSE,
                     "contract": factories.CONTRACT}
    first = admin.post("/v1/conversations", json=begin_request).json()
    second = admin.post("/v1/conversations", json={**begin_request,
                                                   "related_conversation": first["conversation_handle"]}).json()
    assert second["conversation_group_id"] == first["conversation_group_id"]
    for conversation in (first, second):
        with engine.begin() as connection:
            broker.send(connection, target_handle(connection, conversation["conversation_handle"]),
                        "order.note", "reply")
    received = admin.post(f"/v1/queues/{SHOP_QUEUE}/receive",
                          json={"conversation_handle": second["conversation_handle"]}).json()
    assert [m["conversation_handle"] for m in received["messages"]] == [second["conversation_handle"]]
    unknown = admin.post(f"/v1/queues/{WAREHOUSE_QUEUE}/receive",
                         json={"conversation_handle": first["conversation_handle"]})
    assert unknown.status_code == 404 and unknown.json()["sqlstate"] == "BR005"
