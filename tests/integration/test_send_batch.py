"""broker.send_batch: many messages in one statement, numbered and checked as broker.send numbers and checks them."""
import threading
from uuid import uuid4

import pytest
from sqlalchemy import text

import broker
from broker.errors import translated_errors
from tests.factories import SHOP, WAREHOUSE_QUEUE, begin, broker_table_counts, target_handle

FAR_AWAY = "far_away"


@pytest.fixture
def remote(engine, orders):
    """Three conversations with a service on another node (no relay runs: messages stay queued)."""
    with engine.begin() as c:
        broker.create_route(c, FAR_AWAY, "http://127.0.0.1:9/", uuid4(), "a-secret-of-16-chars")
        return [broker.begin_dialog(c, SHOP, FAR_AWAY, "orders") for _ in range(3)]


def _queued(connection):
    return [tuple(row) for row in connection.execute(text(
        "SELECT conversation_handle, message_sequence_number, convert_from(body, 'UTF8')"
        " FROM broker.transmission_queue ORDER BY conversation_handle, message_sequence_number"))]


def test_each_conversation_is_numbered_in_the_order_given(engine, remote):
    first, second, third = remote
    with engine.begin() as c:
        assert broker.send(c, second, "order.note", "before") == 1
        numbers = broker.send_batch(c, [first, second, first, third, first], "order.note", ["a", "b", "c", "d", "e"])
    assert numbers == [1, 2, 2, 1, 3]
    with engine.begin() as c:
        assert sorted(_queued(c)) == sorted([(first, 1, "a"), (first, 2, "c"), (first, 3, "e"), (second, 1, "before"),
                                             (second, 2, "b"), (third, 1, "d")])
        assert broker.send(c, first, "order.note", "after") == 4
        assert broker.send_batch(c, [], "order.note", []) == []


def test_local_conversations_are_delivered_in_the_sending_transaction(engine, orders):
    with engine.begin() as c:
        handles = [begin(c) for _ in range(2)]
        assert broker.send_batch(c, [handles[0], handles[1], handles[0]], "order.submit",
                                 ['{"n": 1}', '{"n": 2}', '{"n": 3}']) == [1, 1, 2]
    with engine.begin() as c:
        first_target = target_handle(c, handles[0])
        received = broker.receive(c, WAREHOUSE_QUEUE, 10) + broker.receive(c, WAREHOUSE_QUEUE, 10)
    assert sorted((m.conversation_handle == first_target, m.message_sequence_number, m.json()["n"]) for m in received) \
        == [(False, 1, 2), (True, 1, 1), (True, 2, 3)]


@pytest.mark.parametrize("case", ["closed conversation", "type the target sends", "body too large"])
def test_a_bad_message_refuses_the_whole_batch(engine, remote, case):
    first, second, third = remote
    with engine.begin() as c:
        if case == "closed conversation":
            broker.end_conversation(c, second)
        elif case == "body too large":
            c.execute(text("UPDATE broker.node SET max_message_bytes = 10"))
        before = broker_table_counts(c)
        sequences = c.execute(text("SELECT sum(send_sequence) FROM broker.endpoints")).scalar_one()
    message_type = "order.ack" if case == "type the target sends" else "order.note"
    body = "x" * 11 if case == "body too large" else None
    expected = {"closed conversation": broker.ConversationClosed, "type the target sends": broker.NotAllowed,
                "body too large": broker.MessageTooLarge}[case]
    with engine.connect() as c, pytest.raises(expected):
        broker.send_batch(c, [first, second, third], message_type, [None, None, body])
    with engine.begin() as c:
        assert broker_table_counts(c) == before
        assert c.execute(text("SELECT sum(send_sequence) FROM broker.endpoints")).scalar_one() == sequences


@pytest.mark.parametrize("handles,bodies,words", [
    (lambda r: [r[0], r[1]], ["only one"], "give one body per handle"),
    (lambda r: [r[0], None], None, "without NULL"),
], ids=["bodies of another length", "a NULL handle"])
def test_malformed_arguments_are_invalid(engine, remote, handles, bodies, words):
    with engine.connect() as c, pytest.raises(broker.InvalidArgument, match=words) as raised, translated_errors():
        c.execute(text("SELECT broker.send_batch(CAST(:handles AS uuid[]), 'order.note', CAST(:bodies AS bytea[]))"),
                  {"handles": [None if h is None else str(h) for h in handles(remote)],
                   "bodies": None if bodies is None else [b.encode() for b in bodies]})
    assert raised.value.sqlstate == "BR050"


def test_invariant_2_concurrent_batches_over_the_same_conversations_number_without_gaps(engine, remote):
    """Batches naming the conversations in opposite orders lock them in one order: no deadlock, no gap."""
    errors = []

    def sender(order) -> None:
        try:
            for _ in range(30):
                with engine.begin() as c:
                    broker.send_batch(c, order, "order.note", None)
        except Exception as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=sender, args=(order,)) for order in (remote, remote[::-1]) * 2]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    with engine.begin() as c:
        numbers = c.execute(text("SELECT conversation_handle, array_agg(message_sequence_number ORDER BY message_sequence_number)"
                                 " FROM broker.transmission_queue GROUP BY 1")).all()
    assert {handle: list(sequence) for handle, sequence in numbers} == {h: list(range(1, 121)) for h in remote}
