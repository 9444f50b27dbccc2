"""A receiver takes numbers past what it holds only where its sender agrees on what it holds: a batch that begins
right after it, or that carries the number it holds last with the id of the message it holds under that number.
Otherwise it takes nothing of that conversation and answers with what it holds, and the sender, which can tell
whether its database went back, numbers its messages past it before any of them is delivered.  Every answer says
what it acknowledges against (held, held_message_id), and a sender deletes nothing on an answer that shows its
database went back.

The two nodes here are two databases, and the relay's and the far node's work is done as they do it (the relay's
batch by COPY, the far node's broker.transport.receiving.accept_batch, the relay's answer applied), without
servers, so that an answer can be lost or a conversation held at the very moment a case needs.  A sender's
database goes back by a copy of the database taken before (CREATE DATABASE ... TEMPLATE): a restore of a backup."""
import io
import json
import time

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.pool import NullPool

import broker
from broker import queries, relay
from broker.transport import receiving, signing, wire
from tests import factories
from tests.conftest import _fresh_database, admin_execute, with_database
from tests.nodes import define_node

SECRET = "secret-shared-by-shop-and-warehouse"
WAREHOUSE_ADDRESS = "http://warehouse.invalid"
FIRST_HANDLE, LAST_HANDLE = "00000000-0000-0000-0000-000000000000", "ffffffff-ffff-ffff-ffff-ffffffffffff"


class Database:
    """A node's database: its engine, re-made when the database is taken back to a copy."""

    def __init__(self, admin_url, name):
        self.admin_url, self.name = admin_url, name
        self.engine = create_engine(with_database(admin_url, name), poolclass=NullPool)
        self.instance = self.scalar("SELECT broker_instance FROM broker.node")

    def scalar(self, sql, **params):
        with self.engine.connect() as c:
            return c.execute(text(sql), params).scalar()

    def backup(self) -> str:
        """A copy of the database as it is now, as a base backup keeps it."""
        copy = f"{self.name}_backup"
        self.engine.dispose()
        admin_execute(self.admin_url, f"CREATE DATABASE {copy} TEMPLATE {self.name}")
        return copy

    def restore(self, copy: str) -> None:
        """The database is now the copy: everything since it was taken is gone."""
        self.engine.dispose()
        admin_execute(self.admin_url, f"DROP DATABASE {self.name} WITH (FORCE)",
                      f"ALTER DATABASE {copy} RENAME TO {self.name}")
        self.engine = create_engine(with_database(self.admin_url, self.name), poolclass=NullPool)


@pytest.fixture
def shop_and_warehouse(admin_url, template_database):
    """The shop's database (a) and the warehouse's (b), each routing to the other; no server runs."""
    databases = [_fresh_database(admin_url, template_database) for _ in "ab"]
    a, b = (Database(admin_url, make_url(next(database)).database) for database in databases)
    define_node(a, factories.SHOP_QUEUE, factories.SHOP)
    define_node(b, factories.WAREHOUSE_QUEUE, factories.WAREHOUSE)
    with a.engine.begin() as c:
        broker.create_route(c, factories.WAREHOUSE, WAREHOUSE_ADDRESS, b.instance, SECRET)
    with b.engine.begin() as c:
        broker.create_route(c, factories.SHOP, "http://shop.invalid", a.instance, SECRET)
    yield a, b
    for database in (a, b):
        database.engine.dispose()
    for database in databases:
        next(database, None)


def carry(a, b, *, max_messages=1000, answer_lost=False, version=wire.WIRE_VERSION) -> dict | None:
    """One batch from a's relay to b, taken by b as its node takes a batch; b's answer applied by a unless it is
    lost on the way.  The answer's result for each conversation side, by conversation id; None when nothing
    was due."""
    batch = io.BytesIO()
    with a.engine.connect() as c:  # one session reads the batch and applies its answer, as a relay lane does
        with c.begin(), c.connection.cursor() as cursor:
            cursor.copy_expert(queries.with_values(cursor, relay.NEXT_BATCH[version], {
                "address": WAREHOUSE_ADDRESS, "max_messages": max_messages, "max_bytes": 8 << 20,
                "first": FIRST_HANDLE, "last": LAST_HANDLE}), batch)
            carried = cursor.rowcount
        if not carried:
            return None
        batch = batch.getvalue()
        media_type = wire.media_type(version)
        purpose = signing.request_purpose("POST", signing.BATCHES_PATH, media_type, str(b.instance))
        headers = {"content-type": media_type, **signing.signed_headers(SECRET, str(a.instance), purpose, batch)}
        _, answer = receiving.accept_batch(b.engine, str(b.instance), str(a.instance), headers, batch)
        if not answer_lost:
            sides = wire.last_numbers(batch)
            with c.begin():
                queries.call(c, "apply_transport_results", casts={"answer": "jsonb", "sent_conversations": "uuid[]"},
                             answer=answer.decode(), sent_conversations=[conversation for conversation, _ in sides],
                             sent_by_initiator=[i for _, i in sides], last_sent=list(sides.values()))
    return {result["conversation_id"]: result for result in json.loads(answer)["results"]}


def carry_all(a, b, **options):
    """Batches until a has nothing left to send (a side held back is due again within a second)."""
    deadline = time.monotonic() + 30
    while a.scalar("SELECT count(*) FROM broker.transmission_queue_status"):
        assert time.monotonic() < deadline, "a's transmission queue did not drain"
        if carry(a, b, **options) is None:
            time.sleep(0.1)


def send_notes(a, handle, *bodies):
    with a.engine.begin() as c:
        for body in bodies:
            broker.send(c, handle, "order.note", body)


def delivered(b):
    """What b's application receives, in order: message type and body."""
    with b.engine.begin() as c:
        return [(m.message_type, m.body.decode() if m.message_type == "order.note" else json.loads(m.body))
                for m in broker.receive(c, factories.WAREHOUSE_QUEUE, None)]


def held_by_b(b):
    return b.scalar("SELECT receive_sequence FROM broker.endpoints WHERE NOT is_initiator")


def lost_messages(database):
    with database.engine.connect() as c:
        return [tuple(row) for row in c.execute(text(
            "SELECT direction, outcome, first_number, last_number FROM broker.lost_messages ORDER BY found_at"))]


@pytest.fixture
def b_holds_what_a_forgot(shop_and_warehouse):
    """b holds messages 1 to 6 of a conversation a began; a's database goes back to when it had sent 1 to 4, and
    a's application sends four new messages, numbered 5 to 8 again."""
    a, b = shop_and_warehouse
    with a.engine.begin() as c:
        handle = factories.begin(c)
    send_notes(a, handle, "old 1", "old 2", "old 3", "old 4")
    carry_all(a, b)
    copy = a.backup()
    send_notes(a, handle, "old 5", "old 6")
    carry_all(a, b)
    assert held_by_b(b) == 6
    a.restore(copy)
    send_notes(a, handle, "new 1", "new 2", "new 3", "new 4")
    return a, b, handle


def assert_renumbered_past_what_b_held(a, b):
    """b's application gets its old messages, the notice, then every new one once and in order; both record it."""
    got = delivered(b)
    assert got[:6] + got[7:] == [("order.note", f"old {n}") for n in range(1, 7)] + [
        ("order.note", f"new {n}") for n in range(1, 5)]
    kind, notice = got[6]
    assert kind == "broker.renumbered"
    assert (notice["first_number"], notice["last_number"], notice["next_number"]) == (5, 6, 8)
    assert lost_messages(a) == [("sent", "renumbered", 5, 6)]
    assert b.scalar("SELECT max(message_sequence_number) FROM broker.queue_messages") is None  # all received
    assert held_by_b(b) == 11


def test_a_restored_sender_is_numbered_past_what_its_receiver_holds_before_anything_new_is_taken(
        b_holds_what_a_forgot):
    a, b, _ = b_holds_what_a_forgot
    [result] = carry(a, b).values()  # new 1 to 4 as numbers 5 to 8, where b holds 5 and 6 from before
    assert (result["held"], result["acknowledged"]) == (6, 6) and result["held_message_id"]
    assert held_by_b(b) == 6  # nothing taken: 7 and 8 are a's new 3 and 4
    carry_all(a, b)
    assert_renumbered_past_what_b_held(a, b)


def test_the_first_answer_after_a_restore_lost_on_the_way_leaves_the_disagreement_as_it_was(b_holds_what_a_forgot):
    """a has now sent numbers 5 to 8 once more: only the id of b's number 6 tells b that its 6 is not a's."""
    a, b, _ = b_holds_what_a_forgot
    carry(a, b, answer_lost=True)
    assert a.scalar("SELECT transmitted_sequence FROM broker.transmission_progress") == 8
    [result] = carry(a, b, answer_lost=True).values()
    assert (result["held"], result["acknowledged"]) == (6, 6)
    assert held_by_b(b) == 6
    carry_all(a, b)
    assert_renumbered_past_what_b_held(a, b)


@pytest.mark.parametrize("held_back", ["application holds it", "queue disabled"])
def test_a_receiver_that_holds_a_conversation_back_answers_what_it_holds(b_holds_what_a_forgot, held_back):
    """Its answer acknowledges what it held before, which a restored sender must not take for its new
    messages: a numbers them past it, deleting nothing."""
    a, b, _ = b_holds_what_a_forgot
    holder = b.engine.connect()
    try:
        if held_back == "application holds it":  # b's application replies in a transaction still open
            transaction = holder.begin()
            broker.send(holder, b.scalar("SELECT conversation_handle FROM broker.endpoints"), "order.note", "reply")
        else:
            with b.engine.begin() as c:
                broker.alter_queue(c, factories.WAREHOUSE_QUEUE, enabled=False)
        [result] = carry(a, b).values()
        assert (result["held"], result["acknowledged"]) == (6, 6)
        assert ("waiting" in result) == (held_back == "application holds it")
        assert a.scalar("SELECT count(*) FROM broker.transmission_queue_status") == 5  # the notice and new 1 to 4
        assert lost_messages(a) == [("sent", "renumbered", 5, 6)]
    finally:
        if held_back == "application holds it":
            transaction.commit()
        holder.close()
        with b.engine.begin() as c:
            broker.alter_queue(c, factories.WAREHOUSE_QUEUE, enabled=True)
    carry_all(a, b)
    assert_renumbered_past_what_b_held(a, b)


def test_a_refusal_says_what_the_receiver_held_and_acknowledges_no_more(shop_and_warehouse):
    """A conversation refused answers in the same terms as any other: what b held before (held), which is all it
    acknowledges; a's side ends with broker.error, and a moves past nothing b did not take."""
    a, b = shop_and_warehouse
    with a.engine.begin() as c:
        handle = factories.begin(c)
    send_notes(a, handle, "1", "2")
    carry_all(a, b)
    with b.engine.begin() as c:  # b now takes smaller bodies than a sends
        c.execute(text("UPDATE broker.node SET max_message_bytes = 100"))
    send_notes(a, handle, "3" * 200)
    [result] = carry(a, b).values()
    assert (result["held"], result["acknowledged"], result["refused"]["sqlstate"]) == (2, 2, "BR051")
    assert held_by_b(b) == 2
    assert a.scalar("SELECT acknowledged_sequence FROM broker.transmission_progress") == 2
    assert a.scalar("SELECT state FROM broker.endpoints") == "error"


def test_a_restored_sender_with_nothing_more_to_send_is_found_by_its_probe(shop_and_warehouse):
    """The relay asks every minute for the last number b acknowledged (broker.probe_conversation): b holds more
    than a restored a transmitted, and a says so to its application before it sends anything on it."""
    a, b = shop_and_warehouse
    with a.engine.begin() as c:
        handle = factories.begin(c)
    send_notes(a, handle, "old 1")
    carry_all(a, b)
    copy = a.backup()
    send_notes(a, handle, "old 2")
    carry_all(a, b)
    a.restore(copy)
    with a.engine.begin() as c:
        conversation = c.execute(text("SELECT conversation_id FROM broker.endpoints")).scalar_one()
        assert queries.call(c, "probe_conversation", casts={"conversation": "uuid"}, conversation=conversation,
                            sender_is_initiator=True).scalar() == 1
    [result] = carry(a, b).values()
    assert result["held"] == 2
    assert lost_messages(a) == [("sent", "renumbered", 2, 2)]
    with a.engine.begin() as c:
        [notice] = broker.receive(c, factories.SHOP_QUEUE, None)
    assert notice.message_type == "broker.renumbered" and json.loads(notice.body)["next_number"] == 4


def test_a_receiver_that_took_a_batch_whose_answer_was_lost_acknowledges_it_again_and_takes_nothing_twice(
        shop_and_warehouse):
    """Without any restore: the ids of the messages b holds tell it that a's batch is the same again, also when
    a's next batch ends before what b holds (it carries fewer messages), and a deletes what b acknowledged."""
    a, b = shop_and_warehouse
    with a.engine.begin() as c:
        handle = factories.begin(c)
    send_notes(a, handle, *(f"note {n}" for n in range(1, 6)))
    carry(a, b, answer_lost=True)
    assert held_by_b(b) == 5
    [result] = carry(a, b, max_messages=2).values()  # 1 and 2: b holds 5, whose id a checks
    assert (result["held"], result["acknowledged"]) == (5, 5)
    assert a.scalar("SELECT min(message_sequence_number) FROM broker.transmission_queue_status") == 3
    send_notes(a, handle, "note 6")
    carry_all(a, b)
    assert delivered(b) == [("order.note", f"note {n}") for n in range(1, 7)]
    assert lost_messages(a) == lost_messages(b) == []


def test_a_batch_of_the_previous_wire_version_overlapping_what_is_held_is_acknowledged_not_taken(
        shop_and_warehouse):
    """Version 3 carries no ids: a batch that does not begin right after what b holds is not taken past it (the
    sender acknowledges what b held, and sends the rest after it)."""
    a, b = shop_and_warehouse
    with a.engine.begin() as c:
        handle = factories.begin(c)
    send_notes(a, handle, "note 1", "note 2")
    carry(a, b, answer_lost=True, version=3)
    send_notes(a, handle, "note 3")
    [result] = carry(a, b, version=3).values()
    assert (result["held"], result["acknowledged"]) == (2, 2) and "held_message_id" not in result
    carry_all(a, b, version=3)
    assert delivered(b) == [("order.note", f"note {n}") for n in range(1, 4)]
