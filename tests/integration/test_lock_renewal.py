"""Peek-lock leases renewed, and lost locks that say why: in SQL and over real HTTP (uvicorn)."""
import time
from datetime import datetime, timedelta, timezone
from uuid import uuid4

import pytest
from sqlalchemy import text

import broker
from tests import factories
from tests.rest import ApiServer, new_key

RECEIVE = "/v1/queues/warehouse_queue/receive"
SECONDS = timedelta(seconds=1)


def _lease(engine, lock_s: float = 30) -> list[broker.LockedMessage]:
    with engine.begin() as connection:
        return broker.receive_with_lock(connection, factories.WAREHOUSE_QUEUE, 10, lock_s * SECONDS)


def _lost(engine, call, *arguments) -> broker.LockLost:
    with pytest.raises(broker.LockLost) as lost, engine.begin() as connection:
        call(connection, *arguments)
    return lost.value


def _failed_attempts(engine) -> list[int]:
    with engine.connect() as connection:
        return connection.execute(text("SELECT failed_attempts FROM broker.queue_messages"
                                       " ORDER BY queue_position")).scalars().all()


def test_a_renewed_lock_outlives_its_first_expiry_and_counts_no_failure(engine, orders):
    factories.notes_waiting(engine, "one", "two")
    lease = _lease(engine, lock_s=0.5)
    token = lease[0].lock_token
    with engine.begin() as connection:
        renewed = broker.renew_lock(connection, token, 30 * SECONDS)
    assert renewed - lease[0].lock_expires_at > 25 * SECONDS
    time.sleep(0.7)
    assert _lease(engine) == []  # still held: no other reader gets the group
    assert _failed_attempts(engine) == [0, 0]
    with engine.begin() as connection:
        assert broker.complete_lock(connection, token) == 2
    assert [m.delivery_count for m in lease] == [1, 1]


def test_a_lock_can_be_renewed_again_and_again_and_shortened(engine, orders):
    factories.notes_waiting(engine, "one")
    token = _lease(engine)[0].lock_token
    for seconds in (60, 5, 0.4):
        with engine.begin() as connection:
            expires = broker.renew_lock(connection, token, seconds * SECONDS)
        assert abs((expires - datetime.now(timezone.utc)).total_seconds() - seconds) < 2
    time.sleep(0.5)
    [again] = _lease(engine)
    assert again.delivery_count == 2 and again.lock_token != token


@pytest.mark.parametrize("duration", [timedelta(0), -SECONDS, timedelta(days=1, seconds=1), None])
def test_a_renewal_out_of_range_is_refused_and_leaves_the_lock_as_it_was(engine, orders, duration):
    factories.notes_waiting(engine, "one")
    [message] = _lease(engine)
    with pytest.raises(broker.InvalidArgument, match="lock_duration must be positive and at most a day"), \
            engine.begin() as connection:
        broker.renew_lock(connection, message.lock_token, duration)
    with engine.connect() as connection:
        assert connection.execute(text("SELECT expires_at FROM broker.leases")).scalar_one() == message.lock_expires_at


def test_a_lost_lock_says_it_was_completed_abandoned_expired_or_is_unknown(engine, orders):
    factories.notes_waiting(engine, "one")
    completed = _lease(engine)[0].lock_token
    with engine.begin() as connection:
        broker.complete_lock(connection, completed)
    for call in (broker.complete_lock, broker.abandon_lock):
        lost = _lost(engine, call, completed)
        assert lost.reason == "completed" and "was completed at" in lost.message and "consumed" in lost.hint
    lost = _lost(engine, broker.renew_lock, completed, SECONDS)
    assert lost.reason == "completed"

    factories.notes_waiting(engine, "two")
    abandoned = _lease(engine)[0].lock_token
    with engine.begin() as connection:
        broker.abandon_lock(connection, abandoned)
    lost = _lost(engine, broker.renew_lock, abandoned, SECONDS)
    assert lost.reason == "abandoned" and "handed back" in lost.hint

    [expiring] = _lease(engine, lock_s=0.3)
    time.sleep(0.4)
    for call, *arguments in ((broker.renew_lock, 30 * SECONDS), (broker.complete_lock,)):
        lost = _lost(engine, call, expiring.lock_token, *arguments)  # not yet found expired by any reader
        assert lost.reason == "expired" and "renew a lock before it expires" in lost.hint
    [taken_over] = _lease(engine)  # the next reader ends the expired lease
    assert taken_over.delivery_count == 3
    lost = _lost(engine, broker.complete_lock, expiring.lock_token)
    assert lost.reason == "expired" and "it expired at" in lost.message

    lost = _lost(engine, broker.renew_lock, uuid4(), SECONDS)
    assert lost.reason == "unknown" and "never existed" in lost.message


def test_an_ingest_lock_error_has_no_lease_reason():
    assert broker.LockLost("queue orders is not locked by this session", "BR060").reason is None


def test_endings_are_forgotten_an_hour_after_they_were_recorded_a_few_at_a_time(engine, orders):
    with engine.begin() as connection:
        queue_id = connection.execute(text("SELECT queue_id FROM broker.queues WHERE name = :name"),
                                      {"name": factories.WAREHOUSE_QUEUE}).scalar_one()
        old = [uuid4() for _ in range(25)]
        connection.execute(text("INSERT INTO broker.ended_leases (lock_token, queue_id, how, ended_at, recorded_at)"
                                " SELECT token, :queue_id, 'completed', now() - interval '2 hours',"
                                " now() - interval '2 hours' FROM unnest(CAST(:tokens AS uuid[])) token"),
                           {"queue_id": queue_id, "tokens": [str(token) for token in old]})
    factories.notes_waiting(engine, "one")
    token = _lease(engine)[0].lock_token
    with engine.begin() as connection:
        broker.complete_lock(connection, token)
        kept = connection.execute(text("SELECT count(*) FILTER (WHERE recorded_at < now() - interval '1 hour'),"
                                       " count(*) FROM broker.ended_leases")).one()
    assert tuple(kept) == (15, 16)
    forgotten = [t for t in old if _lost(engine, broker.complete_lock, t).reason == "unknown"]
    assert len(forgotten) == 10
    assert _lost(engine, broker.complete_lock, token).reason == "completed"


def test_dropping_a_queue_forgets_its_endings(engine, orders):
    factories.notes_waiting(engine, "one")
    token = _lease(engine)[0].lock_token
    with engine.begin() as connection:
        broker.complete_lock(connection, token)
        connection.execute(text("DELETE FROM broker.queue_messages"))
        for service in (factories.SHOP, factories.WAREHOUSE):
            connection.execute(text("DELETE FROM broker.endpoints WHERE service_id ="
                                    " (SELECT service_id FROM broker.services WHERE name = :name)"), {"name": service})
            broker.drop_service(connection, service)
        broker.drop_queue(connection, factories.WAREHOUSE_QUEUE)
        assert connection.execute(text("SELECT count(*) FROM broker.ended_leases")).scalar_one() == 0


# Over REST


@pytest.fixture
def api(database_url, orders):
    with ApiServer(database_url) as server:
        yield server


@pytest.fixture
def receiver(api, engine):
    with api.client(new_key(engine, f"receive:{factories.WAREHOUSE_QUEUE}")) as client:
        yield client


def _lock_lost(response, reason: str) -> dict:
    assert response.status_code == 409, response.text
    assert response.headers["content-type"] == "application/problem+json"
    problem = response.json()
    assert problem["type"] == "/problems/lock-lost" and problem["sqlstate"] == "BR060"
    assert problem["reason"] == reason and problem["hint"]
    assert "Traceback" not in response.text
    return problem


def test_renew_over_rest_holds_the_lock_past_its_first_expiry(engine, receiver):
    factories.notes_waiting(engine, "one", "two")
    lock = receiver.post(RECEIVE, json={"max_messages": 10, "lock_s": 0.5}).json()
    renewed = receiver.post(f"/v1/locks/{lock['lock_token']}/renew", json={"lock_s": 30})
    assert renewed.status_code == 200, renewed.text
    assert renewed.json()["lock_token"] == lock["lock_token"]
    assert datetime.fromisoformat(renewed.json()["lock_expires_at"]) > datetime.fromisoformat(lock["lock_expires_at"])
    time.sleep(0.7)
    assert receiver.post(RECEIVE, json={}).status_code == 204
    assert receiver.post(f"/v1/locks/{lock['lock_token']}/complete").json() == {"completed": 2}
    assert _failed_attempts(engine) == []


def test_renew_over_rest_without_a_body_holds_for_thirty_seconds(engine, receiver):
    factories.notes_waiting(engine, "one")
    lock = receiver.post(RECEIVE, json={"lock_s": 1}).json()
    renewed = receiver.post(f"/v1/locks/{lock['lock_token']}/renew").json()
    remaining = datetime.fromisoformat(renewed["lock_expires_at"]) - datetime.now(timezone.utc)
    assert 25 < remaining.total_seconds() <= 31


def test_a_lost_lock_over_rest_says_why(engine, receiver):
    factories.notes_waiting(engine, "one")
    lock = receiver.post(RECEIVE, json={}).json()["lock_token"]
    assert receiver.post(f"/v1/locks/{lock}/complete").json() == {"completed": 1}
    for action in ("complete", "renew", "abandon"):  # a retry whose first answer was lost learns it was done
        _lock_lost(receiver.post(f"/v1/locks/{lock}/{action}"), "completed")
    factories.notes_waiting(engine, "two")
    lock = receiver.post(RECEIVE, json={}).json()["lock_token"]
    receiver.post(f"/v1/locks/{lock}/abandon")
    _lock_lost(receiver.post(f"/v1/locks/{lock}/renew", json={"lock_s": 10}), "abandoned")
    lock = receiver.post(RECEIVE, json={"lock_s": 0.3}).json()["lock_token"]
    time.sleep(0.4)
    problem = _lock_lost(receiver.post(f"/v1/locks/{lock}/renew"), "expired")
    assert "expired at" in problem["detail"]
    _lock_lost(receiver.post(f"/v1/locks/{uuid4()}/renew"), "unknown")


@pytest.mark.parametrize("body", [{"lock_s": 0}, {"lock_s": 86401}, {"lock_s": "long"}, {"lock_s": 5, "extra": 1},
                                  [1]])
def test_a_renewal_the_schema_refuses_leaves_the_lock_alone(engine, receiver, body):
    factories.notes_waiting(engine, "one")
    lock = receiver.post(RECEIVE, json={"lock_s": 30}).json()
    response = receiver.post(f"/v1/locks/{lock['lock_token']}/renew", json=body)
    assert response.status_code == 422 and response.headers["content-type"] == "application/problem+json"
    with engine.connect() as connection:
        expires = connection.execute(text("SELECT expires_at FROM broker.leases")).scalar_one()
    assert expires == datetime.fromisoformat(lock["lock_expires_at"])


def test_a_key_for_another_queue_can_neither_renew_a_lock_nor_learn_how_it_ended(api, engine, receiver):
    factories.notes_waiting(engine, "one")
    live = receiver.post(RECEIVE, json={}).json()["lock_token"]
    with api.client(new_key(engine, f"receive:{factories.SHOP_QUEUE}")) as stranger:
        assert stranger.post(f"/v1/locks/{live}/renew").json()["reason"] == "unknown"
        receiver.post(f"/v1/locks/{live}/complete")
        response = stranger.post(f"/v1/locks/{live}/renew")
        assert response.json()["reason"] == "unknown" and "was completed at" not in response.json()["detail"]
