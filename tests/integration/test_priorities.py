"""Conversation priorities, as Service Broker's BROKER PRIORITY: each side takes the priority of the most specific
match when it is created; receive hands out the groups of the highest priority first and the relay sends a
destination's messages of the highest priority first, and neither ever breaks a conversation's order."""
import uuid

import pytest
from sqlalchemy import text

import broker
from tests.factories import CONTRACT, SHOP, WAREHOUSE, WAREHOUSE_QUEUE, begin, target_handle
from tests.nodes import SECRET, wait_for

RUSH, SLOW = "warehouse_rush", "warehouse_slow"
FAR_NODE = "http://far.example:8080"


def _priority(connection, handle) -> int:
    return connection.execute(text("SELECT priority FROM broker.conversation_endpoints"
                                   " WHERE conversation_handle = :h"), {"h": handle}).scalar_one()


@pytest.fixture
def lanes(engine, orders):
    """Two more services on the warehouse queue: one whose conversations are rushed, one whose wait."""
    with engine.begin() as connection:
        broker.create_service(connection, RUSH, WAREHOUSE_QUEUE, [CONTRACT])
        broker.create_service(connection, SLOW, WAREHOUSE_QUEUE, [CONTRACT])
        broker.create_broker_priority(connection, "rushed", 9, local_service=RUSH)
        broker.create_broker_priority(connection, "unhurried", 2, local_service=SLOW)


def _conversation(connection, to_service, *bodies):
    handle = broker.begin_dialog(connection, SHOP, to_service, CONTRACT)
    for body in bodies:
        broker.send(connection, handle, "order.note", body)
    return handle


def test_receive_hands_out_the_highest_priority_first_each_conversation_in_order(engine, lanes):
    with engine.begin() as connection:
        _conversation(connection, SLOW, "slow 1", "slow 2")
        _conversation(connection, WAREHOUSE, "plain 1", "plain 2")
        _conversation(connection, RUSH, "rush 1", "rush 2")
    received = []
    while True:
        with engine.begin() as connection:
            batch = broker.receive(connection, WAREHOUSE_QUEUE, 1)
        if not batch:
            break
        received += [m.body.decode() for m in batch]
    assert received == ["rush 1", "rush 2", "plain 1", "plain 2", "slow 1", "slow 2"]


def test_a_group_is_received_whole_in_conversation_order_whatever_its_conversations_priorities(engine, lanes):
    with engine.begin() as connection:
        slow = _conversation(connection, SLOW, "slow 1")
        related = broker.begin_dialog(connection, SHOP, RUSH, CONTRACT)
        broker.send(connection, related, "order.note", "rush 1")
        broker.send(connection, slow, "order.note", "slow 2")
        group = connection.execute(text("SELECT conversation_group_id FROM broker.conversation_endpoints"
                                        " WHERE conversation_handle = :h"), {"h": target_handle(connection, slow)}
                                   ).scalar_one()
        broker.move_conversation(connection, target_handle(connection, related), group)
    with engine.begin() as connection:
        bodies = {}
        for m in broker.receive(connection, WAREHOUSE_QUEUE, None):
            bodies.setdefault(m.service_name, []).append(m.body.decode())
    assert bodies == {SLOW: ["slow 1", "slow 2"], RUSH: ["rush 1"]}


def test_each_side_takes_the_most_specific_match_when_it_is_created_and_keeps_it(engine, orders):
    with engine.begin() as connection:
        broker.create_broker_priority(connection, "anything", 3)
        broker.create_broker_priority(connection, "orders", 6, contract=CONTRACT)
        broker.create_broker_priority(connection, "orders-to-warehouse", 7, contract=CONTRACT,
                                      remote_service=WAREHOUSE)
        broker.create_broker_priority(connection, "warehouse-orders", 8, contract=CONTRACT,
                                      local_service=WAREHOUSE)
        handle = begin(connection)
        # The shop's side matches "orders-to-warehouse"; the warehouse's side, where it is the local service,
        # the more specific "warehouse-orders" (a local service weighs more than a remote one).
        assert (_priority(connection, handle), _priority(connection, target_handle(connection, handle))) == (7, 8)
        broker.drop_broker_priority(connection, "orders-to-warehouse")
        broker.drop_broker_priority(connection, "warehouse-orders")
        assert _priority(connection, handle) == 7
        later = begin(connection)
        assert (_priority(connection, later), _priority(connection, target_handle(connection, later))) == (6, 6)
        broker.drop_broker_priority(connection, "orders")
        broker.drop_broker_priority(connection, "anything")
        assert _priority(connection, begin(connection)) == 5


@pytest.mark.parametrize("call, code, words", [
    ("SELECT broker.create_broker_priority('p', 0)", "BR050", "priority must be 1 to 10, got 0"),
    ("SELECT broker.create_broker_priority('p', 11)", "BR050", "priority must be 1 to 10, got 11"),
    ("SELECT broker.create_broker_priority('p', NULL)", "BR050", "priority must be 1 to 10, got NULL"),
    ("SELECT broker.create_broker_priority(NULL, 5)", "BR050", "broker priority name must not be null"),
    ("SELECT broker.create_broker_priority('p q', 5)", "BR050", "invalid broker priority name"),
    ("SELECT broker.create_broker_priority('p', 5, contract => 'a''b')", "BR050", "invalid contract name"),
    ("SELECT broker.create_broker_priority('p', 5, local_service => 'broker.x')", "BR050", "reserved"),
    ("SELECT broker.create_broker_priority('taken', 4)", "BR040", "already exists"),
    ("SELECT broker.create_broker_priority('same-match', 4, contract => 'orders')", "BR040", "already exists"),
    ("SELECT broker.drop_broker_priority('nothing')", "BR005", "unknown broker priority 'nothing'"),
])
def test_bad_priorities_are_refused_and_change_nothing(engine, orders, call, code, words):
    with engine.begin() as connection:
        broker.create_broker_priority(connection, "taken", 4, contract=CONTRACT)
    with engine.connect() as connection:
        with pytest.raises(Exception) as refused:
            connection.execute(text(call))
        assert refused.value.orig.pgcode == code and words in str(refused.value.orig)
        connection.rollback()
        assert connection.execute(text("SELECT name, priority FROM broker.broker_priorities")).all() == [("taken", 4)]


def test_the_relay_sends_a_destinations_messages_of_the_highest_priority_first(engine, orders):
    """broker.transport_batch is what the relay sends: the highest priority first, each conversation's
    numbers in order, and the cut at max_messages or max_bytes takes the rest in the next batch."""
    with engine.begin() as connection:
        for service in ("remote_plain", "remote_rush"):
            broker.create_route(connection, service, FAR_NODE, uuid.uuid4(), "a-secret-of-sixteen-chars")
        broker.create_contract(connection, "remote_orders", {"order.note": "any"})
        broker.create_broker_priority(connection, "rushed", 10, remote_service="remote_rush")
        broker.create_broker_priority(connection, "unhurried", 1, contract="remote_orders")
        sent = {}
        for service, contract in (("remote_plain", "remote_orders"), ("remote_plain", CONTRACT),
                                  ("remote_rush", CONTRACT)):
            handle = broker.begin_dialog(connection, SHOP, service, contract)
            for n in (1, 2, 3):
                broker.send(connection, handle, "order.note", f"{service} {contract} {n}")
            sent[_priority(connection, handle)] = handle
    assert sorted(sent) == [1, 5, 10]

    def batch(max_messages, max_bytes=10**9):
        with engine.connect() as connection:
            return [(bytes(r.body).decode(), r.sequence_number) for r in connection.execute(text(
                "SELECT * FROM broker.transport_batch(:address, :n, :bytes, :first, :last)"),
                {"address": FAR_NODE, "n": max_messages, "bytes": max_bytes, "first": str(uuid.UUID(int=0)),
                 "last": str(uuid.UUID(int=2**128 - 1))})]

    everything = batch(100)
    assert everything == [(f"{service} {contract} {n}", n)
                          for service, contract in (("remote_rush", CONTRACT), ("remote_plain", CONTRACT),
                                                    ("remote_plain", "remote_orders"))
                          for n in (1, 2, 3)]
    assert batch(4) == everything[:4]
    assert batch(100, max_bytes=300) == everything[:len(batch(100, max_bytes=300))]
    assert 1 <= len(batch(100, max_bytes=300)) < 9


def test_a_quarantined_high_priority_conversation_goes_back_with_its_priority(engine, lanes):
    with engine.begin() as connection:
        rush = _conversation(connection, RUSH, "rush 1")
        _conversation(connection, WAREHOUSE, "plain 1")
        side = target_handle(connection, rush)
    with engine.begin() as connection:
        broker.dead_letter_conversation(connection, side, "cannot do it now")
    with engine.begin() as connection:
        assert broker.resubmit_dead_letters(connection, WAREHOUSE_QUEUE, side) == 1
    with engine.begin() as connection:
        assert [m.body for m in broker.receive(connection, WAREHOUSE_QUEUE, 1)] == [b"rush 1"]


def test_two_nodes_each_side_by_its_own_priorities(nodes):
    a, b = nodes
    with b.engine.begin() as c:
        broker.create_service(c, RUSH, "warehouse_queue", ["orders"])
        broker.create_broker_priority(c, "rushed", 9, local_service=RUSH)
    with a.engine.begin() as c:
        warehouse_route = c.execute(text("SELECT address, broker_instance FROM broker.routes")).one()
        broker.create_route(c, RUSH, warehouse_route.address, warehouse_route.broker_instance,
                            SECRET)
    b.stop()
    with a.engine.begin() as c:
        broker.create_broker_priority(c, "to-rush", 8, remote_service=RUSH)
        plain = broker.begin_dialog(c, "shop", "warehouse", "orders")
        rush = broker.begin_dialog(c, "shop", RUSH, "orders")
        for handle in (plain, rush):
            for n in (1, 2):
                broker.send(c, handle, "order.submit", f'{{"n": {n}}}')
        assert (_priority(c, plain), _priority(c, rush)) == (5, 8)
    b.start()
    wait_for(lambda: b.scalar("SELECT depth FROM broker.queue_status WHERE queue_name = 'warehouse_queue'") == 4,
             30, "all four messages to arrive")
    received = []
    for _ in range(4):
        with b.engine.begin() as c:
            received += [(m.service_name, m.json()["n"]) for m in broker.receive(c, "warehouse_queue", 1)]
    assert received == [(RUSH, 1), (RUSH, 2), ("warehouse", 1), ("warehouse", 2)]
    with b.engine.connect() as c:
        assert sorted(c.execute(text("SELECT service_name, priority FROM broker.conversation_endpoints")).all()) \
            == [("warehouse", 5), (RUSH, 9)]

