"""Messages waiting for a destination that is down, however many, cost the batches for the other
destinations nothing (a batch reads its own destination's messages and no others), and each
failed attempt to reach it costs one row, not one per waiting message.

What a batch reads is counted by PostgreSQL's own statistics (index entries and table rows read),
not timed; that a failure rewrites no message is seen in their row versions."""
import uuid

from sqlalchemy import text

import broker
from tests import factories
from tests.nodes import wait_for

NORTH, SOUTH = "http://127.0.0.1:1", "http://127.0.0.1:2"
ALL_HANDLES = ("00000000-0000-0000-0000-000000000000", "ffffffff-ffff-ffff-ffff-ffffffffffff")
RECORD_FAILURE = text("SELECT broker.record_transport_failure(:destination, :first, :last, 'connection refused',"
                      " CAST(:retry_after AS interval))")
ROW_VERSIONS = text("SELECT array_agg(ctid::text ORDER BY conversation_handle, message_sequence_number)"
                    " FROM broker.transmission_log")
BATCH = text("SELECT conversation_id, sequence_number FROM broker.transport_batch(:destination, 1000, 8388608,"
             " :first, :last)")
ROWS_READ = text(
    "SELECT (SELECT coalesce(sum(idx_tup_read), 0) FROM pg_stat_user_indexes"
    "        WHERE schemaname = 'broker' AND relname = 'transmission_log')"
    "     + (SELECT coalesce(seq_tup_read, 0) FROM pg_stat_user_tables"
    "        WHERE schemaname = 'broker' AND relname = 'transmission_log')")


def _rows_read(engine) -> int:
    """Index entries and table rows read from the transmission queue, as far as the statistics know."""
    with engine.connect() as connection:
        connection.execute(text("SELECT pg_stat_clear_snapshot()"))
        return connection.execute(ROWS_READ).scalar_one()


def _conversations(connection, service: str, address: str, count: int) -> list[uuid.UUID]:
    broker.create_route(connection, service, address, uuid.uuid4(), "a secret of thirty-two characters")
    return [broker.begin_dialog(connection, factories.SHOP, service, factories.CONTRACT) for _ in range(count)]


def _waiting_for_north_and_south(engine) -> list[uuid.UUID]:
    """2,000 messages on 20 conversations with north, which is down, and 6 on 2 with south; returns north's."""
    with engine.begin() as c:
        north = _conversations(c, "north", NORTH, 20)
        south = _conversations(c, "south", SOUTH, 2)
        for _ in range(20):
            broker.send_batch(c, north * 5, "order.note", [b"waiting for a peer that is down"] * 100)
        broker.send_batch(c, south * 3, "order.note", [b"for a peer that is up"] * 6)
    return north


def _batch(connection, destination: str) -> list[tuple[uuid.UUID, int]]:
    return connection.execute(BATCH, {"destination": destination, "first": ALL_HANDLES[0],
                                      "last": ALL_HANDLES[1]}).all()


def test_a_batch_reads_only_its_own_destinations_messages(engine, orders):
    _waiting_for_north_and_south(engine)
    before = _rows_read(engine)
    with engine.begin() as c:
        batch = _batch(c, SOUTH)
        c.execute(text("SELECT pg_stat_force_next_flush()"))
    read = wait_for(lambda: _rows_read(engine) - before, 10, "the batch's reads to reach the statistics")
    assert sorted(number for _, number in batch) == [1, 1, 2, 2, 3, 3]
    assert read < 100, f"a batch of 6 messages read {read} rows of a transmission queue holding 2,006"


def test_a_failure_is_recorded_once_for_its_destination_not_on_every_waiting_message(engine, orders):
    north = _waiting_for_north_and_south(engine)
    with engine.begin() as c:
        before = c.execute(ROW_VERSIONS).scalar_one()
        for _ in range(3):
            c.execute(RECORD_FAILURE, {"destination": NORTH, "first": ALL_HANDLES[0], "last": ALL_HANDLES[1],
                                       "retry_after": "1 hour"})
    with engine.begin() as c:
        assert c.execute(ROW_VERSIONS).scalar_one() == before  # not one message rewritten
        assert c.execute(text("SELECT count(*) FROM broker.transmission_failures")).scalar_one() == 1
        shown = c.execute(text("SELECT to_service, attempts, transmission_status, next_attempt_at > now()"
                               " FROM broker.transmission_queue_status")).all()
        assert len(shown) == 2006
        assert {(service, attempts, status.split(" (")[0], later) for service, attempts, status, later in shown} == {
            ("north", 3, "connection refused", True), ("south", 0, "waiting for its first transmission", False)}
        assert all("(attempt 3, next at " in status for service, _, status, _ in shown if service == "north")
        assert _batch(c, NORTH) == []  # waiting for the retry
        assert len(_batch(c, SOUTH)) == 6  # other destinations go on

        c.execute(RECORD_FAILURE, {"destination": NORTH, "first": ALL_HANDLES[0], "last": ALL_HANDLES[1],
                                   "retry_after": "0 s"})
    with engine.begin() as c:
        assert len(_batch(c, NORTH)) == 1000  # due again: as many as the relay takes in a batch
        c.execute(RECORD_FAILURE, {"destination": NORTH, "first": north[0], "last": north[0], "retry_after": "1 hour"})
    with engine.begin() as c:  # one conversation held back alone (its message is too large for the far node)
        held_back = c.execute(text("SELECT conversation_id FROM broker.endpoints WHERE conversation_handle = :h"),
                              {"h": north[0]}).scalar_one()
        batch = _batch(c, NORTH)
        assert len(batch) == 1000 and held_back not in {conversation for conversation, _ in batch}
        attempts = dict(c.execute(text("SELECT conversation_handle = :h, min(attempts) FROM broker.transmission_queue_status"
                                       " WHERE to_service = 'north' GROUP BY 1"), {"h": north[0]}).all())
        assert attempts == {True: 1, False: 4}


def test_the_failures_of_an_address_no_longer_routed_to_are_forgotten(engine, orders):
    with engine.begin() as c:
        _conversations(c, "north", NORTH, 1)
        c.execute(RECORD_FAILURE, {"destination": NORTH, "first": ALL_HANDLES[0], "last": ALL_HANDLES[1],
                                   "retry_after": "1 hour"})
        broker.drop_route(c, "north")
        broker.create_route(c, "north", SOUTH, uuid.uuid4(), "a secret of thirty-two characters")
        c.execute(RECORD_FAILURE, {"destination": SOUTH, "first": ALL_HANDLES[0], "last": ALL_HANDLES[1],
                                   "retry_after": "1 hour"})
        assert c.execute(text("SELECT address FROM broker.transmission_failures")).scalars().all() == [SOUTH]
