"""MOVE CONVERSATION and purging a queue: in SQL, over real HTTP (uvicorn), and from the command line."""
import os
import subprocess
import sys
import threading
import time
from datetime import timedelta
from uuid import uuid4

import pytest
from sqlalchemy import text

import broker
from tests.factories import SHOP_QUEUE, WAREHOUSE_QUEUE, begin, target_handle
from tests.rest import ApiServer, new_key


def _replied(engine, replies: int = 2):
    """A conversation of the shop's, in a group of its own, with the warehouse's replies waiting for the shop."""
    with engine.begin() as connection:
        handle = begin(connection)
        for n in range(1, replies + 1):
            broker.send(connection, target_handle(connection, handle), "order.note", f"{n}")
    return handle


def _group(engine, handle):
    with engine.connect() as connection:
        return connection.execute(text("SELECT conversation_group_id FROM broker.conversation_endpoints"
                                       " WHERE conversation_handle = :h"), {"h": handle}).scalar_one()


def test_a_moved_conversation_is_received_with_its_new_group_in_order(engine, orders):
    first, second = _replied(engine), _replied(engine, replies=3)
    with engine.begin() as connection:
        broker.move_conversation(connection, second, _group(engine, first))
    assert _group(engine, second) == _group(engine, first)
    with engine.begin() as connection:
        received = broker.receive(connection, SHOP_QUEUE, None)
    assert {m.conversation_group_id for m in received} == {_group(engine, first)}
    assert sorted((m.conversation_handle == second, m.message_sequence_number) for m in received) == [
        (False, 1), (False, 2), (True, 1), (True, 2), (True, 3)]
    assert [m.message_sequence_number for m in received if m.conversation_handle == second] == [1, 2, 3]


def test_a_conversation_moves_to_a_group_that_is_made_for_it(engine, orders):
    handle = _replied(engine)
    group = uuid4()
    with engine.begin() as connection:
        broker.move_conversation(connection, handle, group)
        broker.move_conversation(connection, handle, group)  # already there: nothing to do
    with engine.begin() as connection:
        received = broker.receive(connection, SHOP_QUEUE, 10, conversation_group=group)
    assert [m.message_sequence_number for m in received] == [1, 2]


@pytest.mark.parametrize("case", ["another queue's group", "unknown conversation", "no group"])
def test_a_move_that_cannot_be_made_is_refused_and_changes_nothing(engine, orders, case):
    handle = _replied(engine)
    with engine.begin() as connection:
        warehouse_group = _group(engine, target_handle(connection, handle))
    calls = {"another queue's group": (handle, warehouse_group, broker.InvalidArgument, "belongs to another queue"),
             "unknown conversation": (uuid4(), uuid4(), broker.UnknownObject, "unknown conversation"),
             "no group": (handle, None, broker.InvalidArgument, "conversation_group must not be null")}
    moved, group, error, words = calls[case]
    before = _group(engine, handle)
    with pytest.raises(error, match=words), engine.begin() as connection:
        broker.move_conversation(connection, moved, group)
    assert _group(engine, handle) == before


def test_a_move_waits_for_the_reader_that_holds_the_group(engine, orders):
    first, second = _replied(engine), _replied(engine)
    moved = threading.Event()
    with engine.connect() as reader:
        assert broker.receive(reader, SHOP_QUEUE, 10, conversation_handle=first)

        def move():
            with engine.begin() as connection:
                broker.move_conversation(connection, second, _group(engine, first))
            moved.set()

        mover = threading.Thread(target=move)
        mover.start()
        time.sleep(0.5)
        assert not moved.is_set()  # the reader's transaction holds the group
        reader.commit()
    mover.join(timeout=10)
    assert moved.is_set() and _group(engine, second) == _group(engine, first)


def test_a_move_is_refused_while_a_lease_holds_either_group(engine, orders):
    first, second = _replied(engine), _replied(engine)
    with engine.begin() as connection:
        [lease, _] = broker.receive_with_lock(connection, SHOP_QUEUE, 10, timedelta(seconds=30),
                                              conversation_handle=first)
    for handle, group in ((second, _group(engine, first)), (first, uuid4())):
        with pytest.raises(broker.InUse, match="while a lock holds"), engine.begin() as connection:
            broker.move_conversation(connection, handle, group)
    with engine.begin() as connection:
        broker.complete_lock(connection, lease.lock_token)
        broker.move_conversation(connection, second, _group(engine, first))


def test_purge_deletes_what_waits_ends_the_locks_and_the_conversations_go_on(engine, orders):
    handles = [_replied(engine, replies=3) for _ in range(3)]
    with engine.begin() as connection:
        [lease, *_] = broker.receive_with_lock(connection, SHOP_QUEUE, 10, timedelta(seconds=30))
        assert broker.purge_queue(connection, SHOP_QUEUE) == 9
        assert broker.purge_queue(connection, SHOP_QUEUE) == 0
    with pytest.raises(broker.LockLost) as lost, engine.begin() as connection:
        broker.complete_lock(connection, lease.lock_token)
    assert lost.value.reason == "purged" and "purged" in lost.value.message
    with engine.begin() as connection:
        assert broker.receive(connection, SHOP_QUEUE, None) == []
        broker.send(connection, target_handle(connection, handles[0]), "order.note", "after the purge")
    with engine.begin() as connection:
        [after] = broker.receive(connection, SHOP_QUEUE, None)
    assert (after.message_sequence_number, after.body) == (4, b"after the purge")


def test_purge_keeps_what_retention_keeps_and_the_other_queues(engine, orders):
    with engine.begin() as connection:
        broker.alter_queue(connection, SHOP_QUEUE, retention=True)
    _replied(engine, replies=2)
    with engine.begin() as connection:
        broker.receive(connection, SHOP_QUEUE, 1)
        handle = begin(connection)
        broker.send(connection, handle, "order.note", "for the warehouse")
        assert broker.purge_queue(connection, SHOP_QUEUE) == 1
        kept = connection.execute(text("SELECT count(*) FROM broker.queue_messages q JOIN broker.queues USING"
                                       " (queue_id) WHERE name = :name"), {"name": SHOP_QUEUE}).scalar_one()
        assert kept == 1
        assert [m.body for m in broker.receive(connection, WAREHOUSE_QUEUE, 10)] == [b"for the warehouse"]


def test_purge_of_an_unknown_queue_is_refused(engine, orders):
    with pytest.raises(broker.UnknownObject, match="unknown queue"), engine.begin() as connection:
        broker.purge_queue(connection, "no_such_queue")


# Over REST and from the command line


@pytest.fixture
def api(database_url, orders):
    with ApiServer(database_url) as server:
        yield server


def test_rest_moves_a_conversation_with_the_receive_scope(api, engine):
    first, second = _replied(engine), _replied(engine)
    with api.client(new_key(engine, f"receive:{SHOP_QUEUE}")) as receiver, \
            api.client(new_key(engine, f"receive:{WAREHOUSE_QUEUE}")) as stranger:
        request = {"conversation_group": str(_group(engine, first))}
        assert stranger.post(f"/v1/conversations/{second}/move", json=request).status_code == 404  # not its queue
        moved = receiver.post(f"/v1/conversations/{second}/move", json=request)
        assert moved.status_code == 200, moved.text
        assert moved.json()["conversation_group_id"] == request["conversation_group"]
        with engine.begin() as connection:
            warehouse_group = _group(engine, target_handle(connection, first))
        refused = receiver.post(f"/v1/conversations/{second}/move", json={"conversation_group": str(warehouse_group)})
        assert refused.status_code == 400 and refused.json()["type"] == "/problems/invalid-argument"
        assert receiver.post(f"/v1/conversations/{second}/move", json={"group": "x"}).status_code == 422


def test_rest_purges_a_queue_with_the_admin_scope(api, engine):
    _replied(engine, replies=4)
    with api.client(new_key(engine, f"receive:{SHOP_QUEUE}")) as receiver, \
            api.client(new_key(engine, "admin")) as admin:
        assert receiver.post(f"/v1/queues/{SHOP_QUEUE}/purge").status_code == 403
        assert admin.post(f"/v1/queues/{SHOP_QUEUE}/purge").json() == {"purged": 4}
        assert admin.post("/v1/queues/no_such_queue/purge").status_code == 404


def _cli(database_url, *args, stdin=""):
    return subprocess.run([sys.executable, "-m", "broker.cli", *args], input=stdin, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "BROKER_DATABASE_URL": database_url})


def test_the_purge_command_asks_first_unless_told_yes(engine, orders, database_url):
    _replied(engine, replies=2)
    refused = _cli(database_url, "purge", SHOP_QUEUE, stdin="n\n")
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    with engine.connect() as connection:
        assert connection.execute(text("SELECT count(*) FROM broker.queue_messages")).scalar_one() == 2
    done = _cli(database_url, "purge", SHOP_QUEUE, "--yes")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"purged 2 messages from '{SHOP_QUEUE}'"
    unknown = _cli(database_url, "purge", "no_such_queue", "--yes")
    assert unknown.returncode == 1 and unknown.stderr.count("\n") == 1 and "unknown queue" in unknown.stderr
