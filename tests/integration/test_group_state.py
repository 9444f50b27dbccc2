"""State kept per conversation group, read and written by the reader that holds the group: in SQL, in the
receive transaction or under a lease, and over real HTTP (uvicorn)."""
import threading
from datetime import timedelta
from uuid import uuid4

import pytest
from sqlalchemy import text

import broker
from tests.factories import WAREHOUSE_QUEUE, notes_waiting
from tests.rest import ApiServer, new_key

RECEIVE = f"/v1/queues/{WAREHOUSE_QUEUE}/receive"


def test_state_is_kept_with_the_messages_it_goes_with(engine, orders):
    notes_waiting(engine, "1", "2", "3")
    with engine.begin() as connection:
        [first] = broker.receive(connection, WAREHOUSE_QUEUE, 1)
        group = first.conversation_group_id
        assert broker.get_conversation_group_state(connection, group) is None
        broker.set_conversation_group_state(connection, group, {"applied": 1, "note": "ünïcode"})
    with engine.connect() as connection:  # a reader that rolls back leaves both its messages and the state
        [second] = broker.receive(connection, WAREHOUSE_QUEUE, 1)
        broker.set_conversation_group_state(connection, group, {"applied": 2})
        connection.rollback()
    with engine.begin() as connection:
        [again] = broker.receive(connection, WAREHOUSE_QUEUE, 1)
        assert again.message_sequence_number == 2
        assert broker.get_conversation_group_state(connection, group) == {"applied": 1, "note": "ünïcode"}
        broker.set_conversation_group_state(connection, group, [2, None, True])
    with engine.begin() as connection:
        broker.receive(connection, WAREHOUSE_QUEUE, 1)
        assert broker.get_conversation_group_state(connection, group) == [2, None, True]
        broker.set_conversation_group_state(connection, group, None)
        assert broker.get_conversation_group_state(connection, group) is None


def test_a_reader_that_does_not_hold_the_group_cannot_touch_its_state(engine, orders):
    notes_waiting(engine, "1")
    with engine.connect() as holder, engine.connect() as other:
        [message] = broker.receive(holder, WAREHOUSE_QUEUE, 1)
        for call in (lambda: broker.get_conversation_group_state(other, message.conversation_group_id),
                     lambda: broker.set_conversation_group_state(other, message.conversation_group_id, 1)):
            with pytest.raises(broker.InUse, match="held by another reader"):
                call()
            other.rollback()
        holder.rollback()


def test_reading_state_holds_the_group_until_the_transaction_ends(engine, orders):
    notes_waiting(engine, "1")
    with engine.begin() as connection:
        group = connection.execute(text("SELECT conversation_group_id FROM broker.queue_messages")).scalar_one()
    with engine.connect() as holder:
        broker.get_conversation_group_state(holder, group)
        with engine.begin() as reader:
            assert broker.receive(reader, WAREHOUSE_QUEUE, 10) == []
        holder.commit()
    with engine.begin() as reader:
        assert len(broker.receive(reader, WAREHOUSE_QUEUE, 10)) == 1


def test_state_under_a_lease_takes_its_token(engine, orders):
    notes_waiting(engine, "1")
    with engine.begin() as connection:
        [leased] = broker.receive_with_lock(connection, WAREHOUSE_QUEUE, 1, timedelta(seconds=30))
    group, token = leased.conversation_group_id, leased.lock_token
    with pytest.raises(broker.InUse, match="held by a lock"), engine.begin() as connection:
        broker.set_conversation_group_state(connection, group, 1)
    with engine.begin() as connection:
        broker.set_conversation_group_state(connection, group, {"step": "leased"}, token)
        assert broker.get_conversation_group_state(connection, group, token) == {"step": "leased"}
        broker.complete_lock(connection, token)
    with pytest.raises(broker.LockLost) as lost, engine.begin() as connection:
        broker.get_conversation_group_state(connection, group, token)
    assert lost.value.reason == "completed"
    with engine.begin() as connection:
        assert broker.get_conversation_group_state(connection, group) == {"step": "leased"}


@pytest.mark.parametrize("group, error, words", [
    (None, broker.InvalidArgument, "conversation_group must not be null"),
    (uuid4(), broker.UnknownObject, "unknown conversation group")])
def test_state_of_no_group_is_refused(engine, orders, group, error, words):
    with pytest.raises(error, match=words), engine.begin() as connection:
        broker.set_conversation_group_state(connection, group, 1)


def test_state_larger_than_a_message_is_refused(engine, orders):
    notes_waiting(engine, "1")
    with engine.begin() as connection:
        limit = connection.execute(text("SELECT max_message_bytes FROM broker.node")).scalar_one()
    with pytest.raises(broker.MessageTooLarge), engine.begin() as connection:
        [message] = broker.receive(connection, WAREHOUSE_QUEUE, 1)
        broker.set_conversation_group_state(connection, message.conversation_group_id, "x" * limit)


def test_two_readers_of_one_group_never_lose_an_update(engine, orders):
    """Each reader adds its message to a count kept in the state: the group lock serialises them."""
    notes_waiting(engine, *[str(n) for n in range(40)])
    errors = []

    def reader():
        try:
            while True:
                with engine.begin() as connection:
                    messages = broker.receive(connection, WAREHOUSE_QUEUE, 1, wait_ms=200)
                    if not messages:
                        return
                    group = messages[0].conversation_group_id
                    count = broker.get_conversation_group_state(connection, group) or 0
                    broker.set_conversation_group_state(connection, group, count + 1)
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=reader) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert errors == []
    with engine.connect() as connection:
        assert connection.execute(text("SELECT state FROM broker.conversation_group_state")).scalar_one() == 40


def test_state_over_rest_goes_with_the_lock(database_url, orders, engine):
    notes_waiting(engine, "1", "2")
    with ApiServer(database_url) as api, api.client(new_key(engine, f"receive:{WAREHOUSE_QUEUE}")) as client, \
            api.client(new_key(engine, "receive:shop_queue")) as stranger:
        token = client.post(RECEIVE, json={"max_messages": 1}).json()["lock_token"]
        assert client.get(f"/v1/locks/{token}/state").json() == {"state": None}
        assert client.put(f"/v1/locks/{token}/state", json={"state": {"step": 1}}).json() == {"state": {"step": 1}}
        assert stranger.get(f"/v1/locks/{token}/state").json()["reason"] == "unknown"  # another queue's lock
        assert client.put(f"/v1/locks/{token}/state", json={"step": 1}).status_code == 422
        refused = client.delete(f"/v1/locks/{token}/state")
        assert refused.status_code == 405 and refused.headers["allow"] == "GET, PUT"
        assert "takes GET, PUT" in refused.json()["detail"]
        client.post(f"/v1/locks/{token}/complete")
        lost = client.get(f"/v1/locks/{token}/state")
        assert lost.status_code == 409 and lost.json()["reason"] == "completed"
        token = client.post(RECEIVE, json={"max_messages": 1}).json()["lock_token"]
        assert client.get(f"/v1/locks/{token}/state").json() == {"state": {"step": 1}}
