"""Hygiene: closed conversations leave nothing behind once their retention has passed."""
import threading
import time
from datetime import timedelta

import pytest
from sqlalchemy import text

import broker
from tests.factories import SHOP_QUEUE, WAREHOUSE_QUEUE, begin

# What a conversation may leave in the broker's tables.
STATE_TABLES = ["endpoints", "conversation_groups", "queue_messages", "transmission_log", "numbered_sends",
                "leases", "forgotten_conversations"]

# The warehouse takes what arrived on the given conversation groups and ends
# its side of each conversation whose end is among it.
RECEIVE_AND_END = text(
    "SELECT count(broker.end_conversation(m.conversation_handle))"
    " FROM unnest(CAST(:groups AS uuid[])) g, LATERAL broker.receive('warehouse_queue', 10, g) m"
    " WHERE m.message_type = 'broker.end_dialog'")
WAREHOUSE_GROUPS = text("SELECT conversation_group_id FROM broker.endpoints WHERE NOT is_initiator")


def _receive_and_end_all(engine, per_transaction: int) -> None:
    with engine.connect() as c:
        groups = [str(group) for group in c.execute(WAREHOUSE_GROUPS).scalars()]
    for start in range(0, len(groups), per_transaction):
        with engine.begin() as c:
            c.execute(RECEIVE_AND_END, {"groups": groups[start:start + per_transaction]})


# The shop's side of fire-and-forget: begin, send, end, in one transaction per batch.
FIRE_AND_FORGET = """
DO $$
DECLARE
    handle uuid;
BEGIN
    FOR i IN 1..{conversations} LOOP
        handle := broker.begin_dialog('shop', 'warehouse', 'orders');
        PERFORM broker.send(handle, 'order.note', convert_to('order ' || i, 'UTF8'));
        PERFORM broker.end_conversation(handle);
    END LOOP;
END $$"""


def _counts(engine) -> dict[str, int]:
    with engine.connect() as c:
        return {table: c.execute(text(f"SELECT count(*) FROM broker.{table}")).scalar_one() for table in STATE_TABLES}


def _endpoint_counts(engine) -> set[tuple]:
    with engine.connect() as c:
        return {tuple(row) for row in c.execute(text(
            "SELECT service_name, state, endpoints FROM broker.endpoint_counts"))}


def _set_retention(engine, retention: str) -> None:
    with engine.begin() as c:
        c.execute(text("UPDATE broker.node SET closed_endpoint_retention = CAST(:r AS interval)"), {"r": retention})


def test_closed_endpoints_stay_for_the_retention_then_are_forgotten(engine, orders):
    with engine.begin() as c:
        c.execute(text(FIRE_AND_FORGET.format(conversations=3)))
    _receive_and_end_all(engine, 10)
    # Closed, and kept for the default half hour: the counts show them.
    assert _endpoint_counts(engine) == {("shop", "closed", 3), ("warehouse", "closed", 3)}

    _set_retention(engine, "0")
    with engine.begin() as c:
        assert c.execute(text("SELECT broker.forget_closed_endpoints()")).scalar_one() == 6
    assert _endpoint_counts(engine) == set()
    assert _counts(engine) == dict.fromkeys(STATE_TABLES, 0)


def test_each_close_forgets_what_is_past_the_retention(engine, orders):
    _set_retention(engine, "0")
    with engine.begin() as c:
        c.execute(text(FIRE_AND_FORGET.format(conversations=5)))
    _receive_and_end_all(engine, 10)
    assert _counts(engine) == dict.fromkeys(STATE_TABLES, 0)


def test_a_conversation_abandoned_by_its_far_side_ends_on_its_lifetime_and_is_forgotten(engine, orders):
    _set_retention(engine, "0")
    with engine.begin() as c:
        handle = begin(c, lifetime=timedelta(milliseconds=200))
        broker.send(c, handle, "order.note", "nobody will answer")
    time.sleep(0.3)
    # The warehouse never looks at it; the shop's next receive fires the lifetime.
    with engine.begin() as c:
        [notice] = broker.receive(c, SHOP_QUEUE, 10)
        assert notice.message_type == "broker.error" and "lifetime expired" in notice.json()["description"]
        broker.end_conversation(c, handle)
    with engine.begin() as c:
        warehouse_side = broker.receive(c, WAREHOUSE_QUEUE, 10)
        assert sorted(m.message_type for m in warehouse_side) == ["broker.error", "order.note"]
        broker.end_conversation(c, warehouse_side[0].conversation_handle)
    assert _counts(engine) == dict.fromkeys(STATE_TABLES, 0)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_10000_fire_and_forget_conversations_leave_no_endpoint_state(engine, orders):
    """Two senders in transactions of 1,000 conversations, then a receiver in transactions of 500."""
    _set_retention(engine, "0")

    def send(rounds: int) -> None:
        for _ in range(rounds):
            with engine.begin() as c:
                c.execute(text(FIRE_AND_FORGET.format(conversations=1000)))

    senders = [threading.Thread(target=send, args=(5,)) for _ in range(2)]
    for thread in senders:
        thread.start()
    for thread in senders:
        thread.join()
    assert _endpoint_counts(engine) == {("shop", "disconnected_outbound", 10_000),
                                        ("warehouse", "disconnected_inbound", 10_000)}
    with engine.connect() as c:
        assert c.execute(text("SELECT depth FROM broker.queue_status WHERE queue_name = 'warehouse_queue'")
                         ).scalar_one() == 20_000  # each conversation's message and its end
    _receive_and_end_all(engine, 500)
    assert _counts(engine) == dict.fromkeys(STATE_TABLES, 0)
    assert _endpoint_counts(engine) == set()
