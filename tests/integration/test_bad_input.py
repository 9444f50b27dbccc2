"""Bad input gets its SQLSTATE and a clear message, and writes nothing."""
from datetime import timedelta
from uuid import uuid4

import pytest
from sqlalchemy import text

import broker
from tests.factories import (SHOP, WAREHOUSE, WAREHOUSE_QUEUE, begin, broker_table_counts, define_orders,
                             target_handle)

HOSTILE_NAMES = [
    "q'; DROP SCHEMA broker CASCADE; --",
    'q"); DROP TABLE broker.queues; --',
    "name with spaces",
    "x" * 129,
    "",
    "broker.mine",
    "tab\tname",
    "ünïcode",
]


@pytest.fixture
def orders_defined(rolled_back):
    """The orders catalog, in the test's transaction."""
    define_orders(rolled_back)
    return rolled_back


CASES = {
    # name: (call, exception, sqlstate, words in the message)
    "unknown from_service": (lambda c, h: broker.begin_dialog(c, "nobody", WAREHOUSE, "orders"),
                             broker.UnknownObject, "BR001", "unknown service 'nobody'"),
    "unknown to_service": (lambda c, h: broker.begin_dialog(c, SHOP, "nowhere", "orders"),
                           broker.UnknownObject, "BR001", "no local service and no route"),
    "unknown contract": (lambda c, h: broker.begin_dialog(c, SHOP, WAREHOUSE, "nope"),
                         broker.UnknownObject, "BR003", "unknown contract"),
    "contract not accepted": (lambda c, h: broker.begin_dialog(c, WAREHOUSE, SHOP, "orders"),
                              broker.NotAllowed, "BR011", "does not accept contract"),
    "unknown message type": (lambda c, h: broker.send(c, h, "order.nope", "x"),
                             broker.UnknownObject, "BR002", "unknown message type"),
    "unknown conversation": (lambda c, h: broker.send(c, uuid4(), "order.note", "x"),
                             broker.UnknownObject, "BR005", "unknown conversation"),
    "unknown queue": (lambda c, h: broker.receive(c, "no_queue"), broker.UnknownObject, "BR004", "unknown queue"),
    "unknown route": (lambda c, h: broker.drop_route(c, "nowhere"), broker.UnknownObject, "BR006", "no route"),
    "initiator sends a target's type": (lambda c, h: broker.send(c, h, "order.ack"),
                                        broker.NotAllowed, "BR010", "does not let the initiator send"),
    "target sends an initiator's type": (lambda c, h: broker.send(c, target_handle(c, h), "order.submit", "{}"),
                                         broker.NotAllowed, "BR010", "does not let the target send"),
    "user sends a system type": (lambda c, h: broker.send(c, h, "broker.end_dialog"),
                                 broker.NotAllowed, "BR010", "sent by the broker itself"),
    "invalid JSON": (lambda c, h: broker.send(c, h, "order.submit", "{not json"),
                     broker.ValidationFailed, "BR012", "requires a JSON body"),
    "invalid UTF-8 for JSON": (lambda c, h: broker.send(c, h, "order.submit", b"\xff\xfe"),
                               broker.ValidationFailed, "BR012", "requires a JSON body"),
    "NULL JSON body": (lambda c, h: broker.send(c, h, "order.submit", None),
                       broker.ValidationFailed, "BR012", "got NULL"),
    "body on an empty type": (lambda c, h: broker.send(c, target_handle(c, h), "order.ack", "x"),
                              broker.ValidationFailed, "BR012", "must have an empty body"),
    "NULL handle": (lambda c, h: broker.send(c, None, "order.note", "x"),
                    broker.InvalidArgument, "BR050", "conversation_handle must not be null"),
    "NULL message type": (lambda c, h: broker.send(c, h, None, "x"),
                          broker.InvalidArgument, "BR050", "message type must not be null"),
    "NULL queue name": (lambda c, h: broker.create_queue(c, None), broker.InvalidArgument, "BR050", "must not be null"),
    "oversized body": (lambda c, h: broker.send(c, h, "order.note", b"x" * 2001),
                       broker.MessageTooLarge, "BR051", "exceeds the limit of 2000 bytes"),
    "max_messages zero": (lambda c, h: broker.receive(c, WAREHOUSE_QUEUE, 0),
                          broker.InvalidArgument, "BR050", "max_messages must be at least 1"),
    "negative wait": (lambda c, h: broker.receive(c, WAREHOUSE_QUEUE, wait_ms=-2),
                      broker.InvalidArgument, "BR050", "wait_ms must be -1 (wait until a message comes) or more"),
    "receive by a conversation of another queue": (
        lambda c, h: broker.receive(c, WAREHOUSE_QUEUE, conversation_handle=h),
        broker.UnknownObject, "BR005", "in queue 'warehouse_queue'"),
    "related conversation and group both": (lambda c, h: begin(c, related_conversation=h,
                                                               related_conversation_group=uuid4()),
                                            broker.InvalidArgument, "BR050", "not both"),
    "unknown related conversation": (lambda c, h: begin(c, related_conversation=uuid4()),
                                     broker.UnknownObject, "BR005", "unknown conversation"),
    "negative lifetime": (lambda c, h: begin(c, lifetime=timedelta(seconds=-1)),
                          broker.InvalidArgument, "BR050", "lifetime must be positive"),
    "negative timer": (lambda c, h: broker.begin_conversation_timer(c, h, timedelta(seconds=-1)),
                       broker.InvalidArgument, "BR050", "timeout must be zero or positive"),
    "error code without description": (lambda c, h: broker.end_conversation(c, h, error_code=1),
                                       broker.InvalidArgument, "BR050", "give both or neither"),
    "unknown validation": (lambda c, h: broker.create_message_type(c, "t1", "xml"),
                           broker.InvalidArgument, "BR050", "unknown validation"),
    "bad contract direction": (lambda c, h: broker.create_contract(c, "c1", {"order.note": "both"}),
                               broker.InvalidArgument, "BR050", "sent by must be"),
    "contract with unknown type": (lambda c, h: broker.create_contract(c, "c1", {"nope": "any"}),
                                   broker.UnknownObject, "BR002", "unknown message type"),
    "empty contract": (lambda c, h: broker.create_contract(c, "c1", {}),
                       broker.InvalidArgument, "BR050", "non-empty JSON object"),
    "duplicate queue": (lambda c, h: broker.create_queue(c, WAREHOUSE_QUEUE),
                        broker.AlreadyExists, "BR040", "already exists"),
    "duplicate service": (lambda c, h: broker.create_service(c, SHOP, WAREHOUSE_QUEUE),
                          broker.AlreadyExists, "BR040", "already exists"),
    "drop a queue in use": (lambda c, h: broker.drop_queue(c, WAREHOUSE_QUEUE),
                            broker.InUse, "BR041", "used by a service"),
    "drop a service with open conversations": (lambda c, h: broker.drop_service(c, SHOP),
                                               broker.InUse, "BR041", "open conversations"),
    "drop a type in use": (lambda c, h: broker.drop_message_type(c, "order.note"),
                           broker.InUse, "BR041", "used by a contract"),
    "route to a non-URL": (lambda c, h: broker.create_route(c, "far", "file:///etc/passwd", uuid4(), "a-secret-of-16-chars"),
                           broker.InvalidArgument, "BR050", "http:// or https:// URL"),
    "short route secret": (lambda c, h: broker.create_route(c, "far", "http://127.0.0.1:9", uuid4(), "short"),
                           broker.InvalidArgument, "BR050", "at least 16 characters"),
    "poison threshold zero": (lambda c, h: broker.create_queue(c, "q0", poison_threshold=0),
                              broker.InvalidArgument, "BR050", "poison_threshold must be at least 1"),
    "send on a closed conversation": (lambda c, h: broker.send(c, h, "order.note", "x"),
                                      broker.ConversationClosed, "BR020", "disconnected outbound"),
    "end an ended conversation": (lambda c, h: broker.end_conversation(c, h),
                                  broker.ConversationClosed, "BR020", "already ended"),
}

NEEDS_CLOSED = {"send on a closed conversation", "end an ended conversation"}


@pytest.mark.parametrize("case", CASES)
def test_bad_input_gets_its_sqlstate_and_writes_nothing(orders_defined, case):
    call, exception, sqlstate, words = CASES[case]
    c = orders_defined
    handle = begin(c)
    if case in NEEDS_CLOSED:
        broker.end_conversation(c, handle)
    c.execute(text("UPDATE broker.node SET max_message_bytes = 2000"))
    before = broker_table_counts(c)
    with pytest.raises(exception) as raised, c.begin_nested():
        call(c, handle)
    assert raised.value.sqlstate == sqlstate
    assert words in raised.value.message
    assert broker_table_counts(c) == before


@pytest.mark.parametrize("name", HOSTILE_NAMES)
@pytest.mark.parametrize("create", [
    lambda c, n: broker.create_queue(c, n),
    lambda c, n: broker.create_message_type(c, n),
    lambda c, n: broker.create_service(c, n, WAREHOUSE_QUEUE),
    lambda c, n: broker.create_contract(c, n, {"order.note": "any"}),
], ids=["queue", "message_type", "service", "contract"])
def test_hostile_names_are_refused_and_harmless(orders_defined, create, name):
    before = broker_table_counts(orders_defined)
    with pytest.raises(broker.InvalidArgument) as raised, orders_defined.begin_nested():
        create(orders_defined, name)
    assert raised.value.sqlstate == "BR050"
    assert broker_table_counts(orders_defined) == before


def test_names_are_data_never_sql(engine, orders):
    """A valid name that looks like SQL is stored and used as plain text."""
    with engine.begin() as c:
        broker.create_queue(c, "q--1/drop")
        broker.create_service(c, "svc/@#:x", "q--1/drop", ["orders"])
        handle = broker.begin_dialog(c, SHOP, "svc/@#:x", "orders")
        broker.send(c, handle, "order.note", "'; DROP SCHEMA broker; --")
    with engine.begin() as c:
        [message] = broker.receive(c, "q--1/drop")
    assert message.body == b"'; DROP SCHEMA broker; --"
    assert message.service_name == "svc/@#:x"
