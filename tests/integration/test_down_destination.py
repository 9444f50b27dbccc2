"""Messages waiting for a destination that is down, however many, cost the batches for the other
destinations nothing: a batch reads its own destination's messages and no others.

What a batch reads is counted by PostgreSQL's own statistics (index entries and table rows read),
not timed."""
import uuid

from sqlalchemy import text

import broker
from tests import factories
from tests.nodes import wait_for

NORTH, SOUTH = "http://127.0.0.1:1", "http://127.0.0.1:2"
ALL_HANDLES = ("00000000-0000-0000-0000-000000000000", "ffffffff-ffff-ffff-ffff-ffffffffffff")
BATCH = text("SELECT conversation_id, sequence_number FROM broker.transport_batch(:destination, 1000, 8388608,"
             " :first, :last)")
ROWS_READ = text(
    "SELECT (SELECT coalesce(sum(idx_tup_read), 0) FROM pg_stat_user_indexes"
    "        WHERE schemaname = 'broker' AND relname = 'transmission_queue')"
    "     + (SELECT coalesce(seq_tup_read, 0) FROM pg_stat_user_tables"
    "        WHERE schemaname = 'broker' AND relname = 'transmission_queue')")


def _rows_read(engine) -> int:
    """Index entries and table rows read from the transmission queue, as far as the statistics know."""
    with engine.connect() as connection:
        connection.execute(text("SELECT pg_stat_clear_snapshot()"))
        return connection.execute(ROWS_READ).scalar_one()


def _conversations(connection, service: str, address: str, count: int) -> list[uuid.UUID]:
    broker.create_route(connection, service, address, uuid.uuid4(), "a secret of thirty-two characters")
    return [broker.begin_dialog(connection, factories.SHOP, service, factories.CONTRACT) for _ in range(count)]


def test_a_batch_reads_only_its_own_destinations_messages(engine, orders):
    with engine.begin() as c:
        north = _conversations(c, "north", NORTH, 20)
        south = _conversations(c, "south", SOUTH, 2)
        for _ in range(20):
            broker.send_batch(c, north * 5, "order.note", [b"waiting for a peer that is down"] * 100)
        broker.send_batch(c, south * 3, "order.note", [b"for a peer that is up"] * 6)
    before = _rows_read(engine)
    with engine.begin() as c:
        batch = c.execute(BATCH, {"destination": SOUTH, "first": ALL_HANDLES[0], "last": ALL_HANDLES[1]}).all()
        c.execute(text("SELECT pg_stat_force_next_flush()"))
    read = wait_for(lambda: _rows_read(engine) - before, 10, "the batch's reads to reach the statistics")
    assert sorted(number for _, number in batch) == [1, 1, 2, 2, 3, 3]
    assert read < 100, f"a batch of 6 messages read {read} rows of a transmission queue holding 2,006"
