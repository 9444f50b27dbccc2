"""Dead letters to manage: a reader dead-letters a conversation with a reason, an admin browses them, puts a
quarantined conversation's back in order, or purges them. In SQL, over real HTTP (uvicorn) and from the
command line."""
import os
import subprocess
import sys
from datetime import timedelta
from uuid import uuid4

import pytest
from sqlalchemy import text

import broker
from broker import queries
from tests.factories import SHOP_QUEUE, WAREHOUSE_QUEUE, begin, endpoint_state, notes_waiting, target_handle
from tests.rest import ApiServer, new_key


def _letters(engine, queue=WAREHOUSE_QUEUE):
    with engine.connect() as connection:
        return connection.execute(queries.QUERIES["dead_letters"],
                                  {"queue": queue, "limit": 100, "offset": 0, "max_bytes": 2**20}).all()


def _warehouse_side(engine):
    with engine.connect() as connection:
        return connection.execute(text("SELECT conversation_handle FROM broker.queue_messages LIMIT 1")).scalar_one()


def test_a_reader_that_rolled_back_dead_letters_the_conversation_with_its_reason(engine, orders):
    handle = notes_waiting(engine, "bad", "after")
    notes_waiting(engine, "fine")
    with engine.connect() as connection:
        [first, _] = broker.receive(connection, WAREHOUSE_QUEUE, 10)
        connection.rollback()  # the messages come back
        assert broker.dead_letter_conversation(connection, first.conversation_handle, "unknown sku 'ü'") == 2
        connection.commit()
    letters = _letters(engine)
    assert [(d.message_sequence_number, bytes(d.body), d.reason) for d in letters] == [
        (1, b"bad", "dead-lettered by its reader: unknown sku 'ü'"),
        (2, b"after", "conversation quarantined after message 1")]
    with engine.begin() as connection:
        assert endpoint_state(connection, first.conversation_handle) == "error"
        assert endpoint_state(connection, handle) == "error"
        [error] = broker.receive(connection, SHOP_QUEUE, 10)
        assert error.json()["code"] == -2 and "dead-lettered by its reader: unknown sku" in error.json()["description"]
        assert [m.body for m in broker.receive(connection, WAREHOUSE_QUEUE, 10)] == [b"fine"]  # the queue flows


def test_dead_lettering_needs_the_group_and_a_waiting_message_and_a_reason(engine, orders):
    notes_waiting(engine, "one")
    side = _warehouse_side(engine)
    with engine.connect() as holder, engine.connect() as other:
        broker.receive(holder, WAREHOUSE_QUEUE, 10)
        with pytest.raises(broker.InUse, match="held by another reader"):
            broker.dead_letter_conversation(other, side, "no")
        other.rollback()
        with pytest.raises(broker.ConversationClosed, match="no message waiting to dead-letter") as nothing:
            broker.dead_letter_conversation(holder, side, "consumed already")  # this transaction took them
        assert nothing.value.hint == "roll back the receive first: the messages come back"
        holder.rollback()
    for reason in ("", None, "x" * 4001):
        with pytest.raises(broker.InvalidArgument, match="reason must be 1 to 4000 characters"), \
                engine.begin() as connection:
            broker.dead_letter_conversation(connection, side, reason)
    with pytest.raises(broker.UnknownObject), engine.begin() as connection:
        broker.dead_letter_conversation(connection, uuid4(), "no such conversation")
    assert _letters(engine) == []


def test_a_lease_dead_letters_one_conversation_and_hands_the_others_back(engine, orders):
    with engine.begin() as connection:
        first = begin(connection)
        second = begin(connection, related_conversation=first)
        for handle, body in ((first, "bad"), (second, "good")):
            broker.send(connection, target_handle(connection, handle), "order.note", body)
    with engine.begin() as connection:
        leased = broker.receive_with_lock(connection, SHOP_QUEUE, 10, timedelta(seconds=30))
    bad = next(m for m in leased if m.body == b"bad")
    with engine.begin() as connection:
        assert broker.dead_letter_conversation(connection, bad.conversation_handle, "cannot parse",
                                               bad.lock_token) == 1
    with pytest.raises(broker.LockLost) as lost, engine.begin() as connection:
        broker.complete_lock(connection, bad.lock_token)
    assert lost.value.reason == "dead_lettered"
    with engine.begin() as connection:
        [other_lease, *_] = broker.receive_with_lock(connection, SHOP_QUEUE, 10, timedelta(seconds=30))
        lone = begin(connection)
        broker.send(connection, target_handle(connection, lone), "order.note", "elsewhere")
    with pytest.raises(broker.InvalidArgument, match="holds another conversation group"), \
            engine.begin() as connection:
        broker.dead_letter_conversation(connection, lone, "not this lock's", other_lease.lock_token)
    with engine.begin() as connection:
        broker.abandon_lock(connection, other_lease.lock_token)
    with engine.begin() as connection:
        again = broker.receive(connection, SHOP_QUEUE, 10)
    assert [(m.body, m.message_type) for m in again if m.message_type == "order.note"] == [(b"good", "order.note")]


def test_resubmit_puts_a_quarantined_conversations_letters_back_in_order(engine, orders):
    with engine.begin() as connection:
        broker.alter_queue(connection, WAREHOUSE_QUEUE, poison_threshold=1)
    notes_waiting(engine, "1", "2", "3")
    side = _warehouse_side(engine)
    with engine.connect() as connection:
        [message, *_] = broker.receive(connection, WAREHOUSE_QUEUE, 10)
        connection.rollback()
        assert broker.report_processing_failure(connection, WAREHOUSE_QUEUE, message.conversation_group_id, "boom")
        connection.commit()
    assert len(_letters(engine)) == 3
    with engine.begin() as connection:
        assert broker.resubmit_dead_letters(connection, WAREHOUSE_QUEUE, side) == 3
        assert broker.resubmit_dead_letters(connection, WAREHOUSE_QUEUE, side) == 0
    assert _letters(engine) == []
    with engine.begin() as connection:
        received = broker.receive(connection, WAREHOUSE_QUEUE, None)
    assert [(m.message_sequence_number, m.body, m.message_type) for m in received][:3] == [
        (1, b"1", "order.note"), (2, b"2", "order.note"), (3, b"3", "order.note")]
    assert received[-1].message_type == "broker.error"  # the quarantine's notice after them
    with engine.begin() as connection:
        broker.end_conversation(connection, side)
    with pytest.raises(broker.ConversationClosed, match="only one in error"), engine.begin() as connection:
        broker.resubmit_dead_letters(connection, WAREHOUSE_QUEUE, side)
    with pytest.raises(broker.UnknownObject), engine.begin() as connection:
        broker.resubmit_dead_letters(connection, SHOP_QUEUE, side)


@pytest.mark.parametrize("reader", ["sql", "lease"])
def test_resubmitted_messages_come_before_the_error_that_ended_their_conversation(engine, orders, reader):
    """They were sent, and had arrived, before the conversation failed: the notice of the failure is received
    after the last message that had arrived when it was raised, so a reader that ends a conversation on its
    broker.error (as readers do) has processed every resubmitted message by then."""
    notes_waiting(engine, "1", "2", "3")
    side = _warehouse_side(engine)
    with engine.connect() as connection:
        if reader == "sql":
            broker.receive(connection, WAREHOUSE_QUEUE, 10)
            connection.rollback()
            lock_token = None
        else:
            [*_, last] = broker.receive_with_lock(connection, WAREHOUSE_QUEUE, 10, timedelta(seconds=30))
            lock_token = last.lock_token
            connection.commit()
        assert broker.dead_letter_conversation(connection, side, "cannot apply it yet", lock_token) == 3
        connection.commit()
    with engine.begin() as connection:
        assert broker.resubmit_dead_letters(connection, WAREHOUSE_QUEUE, side) == 3
    with engine.begin() as connection:
        if reader == "sql":
            received = broker.receive(connection, WAREHOUSE_QUEUE, None)
        else:
            received = broker.receive_with_lock(connection, WAREHOUSE_QUEUE, 10, timedelta(seconds=30))
    assert [(m.message_sequence_number, m.message_type) for m in received] == [
        (1, "order.note"), (2, "order.note"), (3, "order.note"), (0, "broker.error")]
    assert b"message 1 was dead-lettered by its reader: cannot apply it yet" in received[-1].body


def test_purge_deletes_a_queues_dead_letters_or_the_old_ones(engine, orders):
    for body in ("a", "b"):
        notes_waiting(engine, body)
    for side in _sides(engine):
        with engine.begin() as connection:
            broker.dead_letter_conversation(connection, side, "purge me")
    with engine.begin() as connection:
        connection.execute(text("UPDATE broker.dead_letters SET dead_lettered_at = now() - interval '2 days'"
                                " WHERE body = 'a'"))
        assert broker.purge_dead_letters(connection, WAREHOUSE_QUEUE, timedelta(days=1)) == 1
        assert broker.purge_dead_letters(connection, SHOP_QUEUE) == 0
        assert broker.purge_dead_letters(connection, WAREHOUSE_QUEUE) == 1
    with pytest.raises(broker.UnknownObject), engine.begin() as connection:
        broker.purge_dead_letters(connection, "no_such_queue")


def _sides(engine):
    with engine.connect() as connection:
        return connection.execute(text("SELECT DISTINCT conversation_handle FROM broker.queue_messages")
                                  ).scalars().all()


def test_dead_letters_over_rest(database_url, orders, engine):
    notes_waiting(engine, '{"sku": 1}', "\x00\xff")
    with ApiServer(database_url) as api, api.client(new_key(engine, f"receive:{WAREHOUSE_QUEUE}")) as reader, \
            api.client(new_key(engine, "admin")) as admin:
        lock = reader.post(f"/v1/queues/{WAREHOUSE_QUEUE}/receive", json={}).json()
        side = lock["messages"][0]["conversation_handle"]
        moved = reader.post(f"/v1/locks/{lock['lock_token']}/dead-letter",
                            json={"conversation_handle": side, "reason": "<b>bad</b>"})
        assert moved.json() == {"dead_lettered": 2}
        letters = reader.get(f"/v1/queues/{WAREHOUSE_QUEUE}/dead-letters").json()
        assert [(d["sequence_number"], d["reason"]) for d in letters] == [
            (1, "dead-lettered by its reader: <b>bad</b>"), (2, "conversation quarantined after message 1")]
        assert letters[0]["body"] == {"sku": 1} and letters[1]["body"] is None and letters[1]["body_base64"]
        assert reader.get(f"/v1/queues/{WAREHOUSE_QUEUE}/dead-letters?limit=1&offset=1").json()[0][
            "sequence_number"] == 2
        # Bodies of 10 and 3 bytes (UTF-8): as many letters as come to max_bytes, and the first whatever its size.
        listed = {max_bytes: len(reader.get(f"/v1/queues/{WAREHOUSE_QUEUE}/dead-letters?max_bytes={max_bytes}").json())
                  for max_bytes in (1, 12, 13)}
        assert listed == {1: 1, 12: 1, 13: 2}
        assert reader.get(f"/v1/queues/{WAREHOUSE_QUEUE}/dead-letters?max_bytes=0").status_code == 422
        assert reader.get("/v1/queues/no_such_queue/dead-letters").status_code == 403
        assert admin.get("/v1/queues/no_such_queue/dead-letters").status_code == 404
        assert reader.post(f"/v1/queues/{WAREHOUSE_QUEUE}/dead-letters/resubmit",
                           json={"conversation_handle": side}).status_code == 403
        assert admin.post(f"/v1/queues/{WAREHOUSE_QUEUE}/dead-letters/resubmit",
                          json={"conversation_handle": side}).json() == {"resubmitted": 2}
        lock = reader.post(f"/v1/queues/{WAREHOUSE_QUEUE}/receive", json={}).json()
        reader.post(f"/v1/locks/{lock['lock_token']}/dead-letter", json={"conversation_handle": side, "reason": "x"})
        assert admin.post(f"/v1/queues/{WAREHOUSE_QUEUE}/dead-letters/purge", json={"older_than_s": 3600}
                          ).json() == {"purged": 0}
        purged = admin.post(f"/v1/queues/{WAREHOUSE_QUEUE}/dead-letters/purge").json()
        assert purged == {"purged": 3}  # the two resubmitted, and the quarantine's notice that waited behind them
        refused = reader.post(f"/v1/locks/{uuid4()}/dead-letter", json={"conversation_handle": side, "reason": "x"})
        assert refused.status_code == 409 and refused.json()["reason"] == "unknown"


def _cli(database_url, *args, stdin=""):
    return subprocess.run([sys.executable, "-m", "broker.cli", *args], input=stdin, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "BROKER_DATABASE_URL": database_url, "COLUMNS": "200"})


def test_the_dead_letters_command_shows_and_purges(engine, orders, database_url):
    notes_waiting(engine, "one")
    with engine.begin() as connection:
        broker.dead_letter_conversation(connection, _warehouse_side(engine), "\x1b[31mred\x1b[0m")
    shown = _cli(database_url, "dead-letters", WAREHOUSE_QUEUE)
    assert shown.returncode == 0, shown.stderr
    assert "order.note" in shown.stdout and "\x1b" not in shown.stdout and "\\x1b[31mred" in shown.stdout
    assert _cli(database_url, "dead-letters", WAREHOUSE_QUEUE, "--purge", stdin="n\n").returncode == 1
    purged = _cli(database_url, "dead-letters", WAREHOUSE_QUEUE, "--purge", "--yes")
    assert purged.stdout.strip() == f"purged 1 dead letters of '{WAREHOUSE_QUEUE}'"
    assert "no dead letters" in _cli(database_url, "dead-letters", WAREHOUSE_QUEUE).stdout
    unknown = _cli(database_url, "dead-letters", "no_such_queue")
    assert unknown.returncode == 2 and "unknown queue" in unknown.stderr
