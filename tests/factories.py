"""Catalog and conversation factories shared by the tests."""
from uuid import UUID

from sqlalchemy import Connection, Engine, text

import broker

# The shop (initiator) orders from the warehouse (target).
CONTRACT = "orders"
SHOP, WAREHOUSE = "shop", "warehouse"
SHOP_QUEUE, WAREHOUSE_QUEUE = "shop_queue", "warehouse_queue"


def define_orders(connection: Connection) -> None:
    broker.create_message_type(connection, "order.submit", "json")
    broker.create_message_type(connection, "order.note")
    broker.create_message_type(connection, "order.ack", "empty")
    broker.create_contract(connection, CONTRACT, {"order.submit": "initiator", "order.ack": "target", "order.note": "any"})
    broker.create_queue(connection, SHOP_QUEUE)
    broker.create_queue(connection, WAREHOUSE_QUEUE)
    broker.create_service(connection, SHOP, SHOP_QUEUE)
    broker.create_service(connection, WAREHOUSE, WAREHOUSE_QUEUE, [CONTRACT])


def begin(connection: Connection, **options) -> UUID:
    return broker.begin_dialog(connection, SHOP, WAREHOUSE, CONTRACT, **options)


def notes_waiting(engine: Engine, *bodies: str) -> UUID:
    """A new conversation with these order.note bodies sent, committed; the shop's handle."""
    with engine.begin() as connection:
        handle = begin(connection)
        for body in bodies:
            broker.send(connection, handle, "order.note", body)
    return handle


def target_handle(connection: Connection, initiator_handle: UUID) -> UUID:
    return connection.execute(text(
        "SELECT t.conversation_handle FROM broker.conversation_endpoints t"
        " JOIN broker.conversation_endpoints i USING (conversation_id)"
        " WHERE i.conversation_handle = :h AND NOT t.is_initiator"), {"h": initiator_handle}).scalar_one()


def endpoint_state(connection: Connection, handle: UUID) -> str:
    return connection.execute(text("SELECT state FROM broker.conversation_endpoints WHERE conversation_handle = :h"),
                              {"h": handle}).scalar_one()


def broker_table_counts(connection: Connection) -> dict[str, int]:
    """Row counts of every broker table: a cheap fingerprint of what was written."""
    tables = connection.execute(text(
        "SELECT tablename FROM pg_tables WHERE schemaname = 'broker' ORDER BY 1")).scalars().all()
    return {t: connection.execute(text(f"SELECT count(*) FROM broker.{t}")).scalar_one() for t in tables}
