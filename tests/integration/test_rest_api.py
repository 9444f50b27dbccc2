"""The /v1 REST API over real HTTP (uvicorn) on a real database."""
import base64
import json
import socket
import threading
import time
from urllib.parse import urlsplit

import pytest
from sqlalchemy import text

import broker
from broker.api import admission
from broker import migrate, queries
from tests import factories
from tests.nodes import wait_for
from tests.rest import ApiServer, new_key

BEGIN = {"from_service": factories.SHOP, "to_service": factories.WAREHOUSE, "contract": factories.CONTRACT}
RECEIVE = "/v1/queues/warehouse_queue/receive"


@pytest.fixture
def api(database_url, orders):
    with ApiServer(database_url, max_request_bytes=64 * 1024) as server:
        yield server


@pytest.fixture
def admin(api, engine):
    with api.client(new_key(engine, "admin")) as client:
        yield client


def _begin(client) -> str:
    response = client.post("/v1/conversations", json=BEGIN)
    assert response.status_code == 201, response.text
    return response.json()["conversation_handle"]


def _send(client, handle, body, number=None, message_type="order.submit"):
    request = {"message_type": message_type, "body": body}
    if number is not None:
        request["sequence_number"] = number
    return client.post(f"/v1/conversations/{handle}/messages", json=request)


def _is_problem(response, status, kind):
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/problem+json"
    problem = response.json()
    assert problem["type"] == f"/problems/{kind}" and problem["status"] == status and problem["title"]
    assert "Traceback" not in response.text
    return problem


def test_a_conversation_begins_sends_receives_completes_and_ends(admin):
    handle = _begin(admin)
    conversation = admin.get(f"/v1/conversations/{handle}").json()
    assert conversation["state"] == "conversing" and conversation["service_name"] == "shop"
    assert _send(admin, handle, {"sku": "A-1"}).json() == {"sequence_number": 1, "duplicate": False}
    raw = bytes(range(256))
    response = admin.post(f"/v1/conversations/{handle}/messages",
                          json={"message_type": "order.note", "body_base64": base64.b64encode(raw).decode()})
    assert response.status_code == 201 and response.json()["sequence_number"] == 2

    received = admin.post(RECEIVE, json={"max_messages": 10, "lock_s": 30}).json()
    messages = received["messages"]
    assert [(m["sequence_number"], m["message_type"], m["delivery_count"]) for m in messages] == [
        (1, "order.submit", 1), (2, "order.note", 1)]
    assert messages[0]["body"] == {"sku": "A-1"} and messages[0]["body_base64"] is None
    assert base64.b64decode(messages[1]["body_base64"]) == raw
    assert messages[0]["conversation_id"] == conversation["conversation_id"]
    assert admin.post(f"/v1/locks/{received['lock_token']}/complete").json() == {"completed": 2}
    assert admin.get("/v1/queues/warehouse_queue").json()["depth"] == 0

    target = messages[0]["conversation_handle"]
    assert admin.post(f"/v1/conversations/{target}/end").json()["state"] == "disconnected_outbound"
    end = admin.post(RECEIVE.replace("warehouse", "shop"), json={}).json()
    assert [m["message_type"] for m in end["messages"]] == ["broker.end_dialog"]
    assert admin.post(f"/v1/conversations/{handle}/end", json={}).json()["state"] == "closed"


def test_an_idempotent_send_can_be_retried_without_a_duplicate(admin, engine):
    handle = _begin(admin)
    first = _send(admin, handle, {"n": 1}, number=1)
    retry = _send(admin, handle, {"n": 1}, number=1)
    assert first.status_code == retry.status_code == 201
    assert first.json() == {"sequence_number": 1, "duplicate": False}
    assert retry.json() == {"sequence_number": 1, "duplicate": True}
    conflict = _is_problem(_send(admin, handle, {"n": "other"}, number=1), 409, "sequence-conflict")
    assert conflict["expected_sequence_number"] == 2 and conflict["sqlstate"] == "BR021"
    assert _is_problem(_send(admin, handle, {"n": 3}, number=3), 409, "sequence-conflict")[
        "expected_sequence_number"] == 2
    assert _send(admin, handle, {"n": 2}, number=2).json() == {"sequence_number": 2, "duplicate": False}
    with engine.connect() as connection:
        assert connection.execute(text("SELECT count(*) FROM broker.queue_messages")).scalar() == 2


def _batch(handles_and_numbers, body=None):
    return {"messages": [{"conversation_handle": handle, "sequence_number": number, "message_type": "order.note",
                          "body": body if body is not None else {"n": number}}
                         for handle, number in handles_and_numbers]}


def test_many_numbered_messages_go_in_one_request_all_or_none_and_once(admin, engine):
    first, second = _begin(admin), _begin(admin)
    batch = _batch([(first, 1), (second, 1), (first, 2)])
    sent = admin.post("/v1/messages", json=batch)
    assert sent.status_code == 200, sent.text
    assert sent.json() == {"messages": [{"sequence_number": n, "duplicate": False} for n in (1, 1, 2)]}
    again = admin.post("/v1/messages", json=_batch([(first, 2), (first, 3)]))  # a retry that goes on
    assert again.json() == {"messages": [{"sequence_number": 2, "duplicate": True},
                                         {"sequence_number": 3, "duplicate": False}]}
    with engine.connect() as connection:
        before = connection.execute(text("SELECT count(*) FROM broker.queue_messages")).scalar()
    out_of_turn = _is_problem(admin.post("/v1/messages", json=_batch([(second, 2), (first, 9)])), 409,
                              "sequence-conflict")
    assert out_of_turn["expected_sequence_number"] == 4
    other_content = admin.post("/v1/messages", json=_batch([(second, 2), (second, 1)], body={"changed": True}))
    assert _is_problem(other_content, 409, "sequence-conflict")["expected_sequence_number"] == 3
    with engine.connect() as connection:  # nothing of a refused batch stays, not even its first message
        assert connection.execute(text("SELECT count(*) FROM broker.queue_messages")).scalar() == before
    assert admin.post("/v1/messages", json=_batch([(second, 2)])).json()["messages"][0]["duplicate"] is False


def test_a_batch_needs_send_scope_for_every_conversation_and_known_conversations(api, admin, engine):
    shop = _begin(admin)
    with engine.begin() as c:
        broker.create_queue(c, "ledger_queue")
        broker.create_service(c, "ledger", "ledger_queue")
        ledger = broker.begin_dialog(c, "ledger", factories.WAREHOUSE, factories.CONTRACT)
    with api.client(new_key(engine, "send:shop")) as client:
        assert client.post("/v1/messages", json=_batch([(shop, 1)])).status_code == 200
        hidden = _is_problem(client.post("/v1/messages", json=_batch([(shop, 2), (str(ledger), 1)])), 404,
                             "unknown-object")  # the ledger's side: one the key may not see is unknown to it
        assert hidden["detail"] == f"unknown conversation {ledger}"
        unknown = _is_problem(client.post("/v1/messages", json=_batch([(shop, 2), ("0" * 8 + "-0000-4000-8000-" + "0" * 12, 1)])),
                              404, "unknown-object")
        assert "unknown conversation" in unknown["detail"]
    for bad in ({"messages": []}, {"messages": [{"conversation_handle": shop, "message_type": "order.note"}]},
                {**_batch([(shop, 2)]), "extra": 1}):
        _is_problem(admin.post("/v1/messages", json=bad), 422, "invalid-request")
    messages = admin.get("/openapi.json").json()["components"]["schemas"]["SendMessages"]["properties"]["messages"]
    assert messages["maxItems"] == 1000  # (1,001 of them are larger than this node's 64 KiB requests)


def test_a_retry_after_a_lost_response_is_stored_once(api, engine):
    """The client's connection goes after the commit, before it reads the answer; it sends again."""
    key = new_key(engine, "admin")
    with api.client(key) as client:
        handle = _begin(client)
    body = json.dumps({"message_type": "order.submit", "body": {"n": 1}, "sequence_number": 1}).encode()
    address = urlsplit(api.url)
    with socket.create_connection((address.hostname, address.port), timeout=10) as impatient:
        impatient.sendall(f"POST /v1/conversations/{handle}/messages HTTP/1.1\r\nHost: node\r\n"
                          f"Authorization: Bearer {key}\r\nContent-Type: application/json\r\n"
                          f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        with api.client(key) as client:
            wait_for(lambda: client.get("/v1/queues/warehouse_queue").json()["depth"] == 1, 10,
                     "the send to commit")  # committed; the answer is never read
    with api.client(key) as client:
        assert _send(client, handle, {"n": 1}, number=1).json() == {"sequence_number": 1, "duplicate": True}
        assert client.get("/v1/queues/warehouse_queue").json()["depth"] == 1


def test_receive_waits_for_an_arrival_and_answers_204_when_none_comes(admin):
    started = time.monotonic()
    assert admin.post(RECEIVE, json={"wait_ms": 300}).status_code == 204
    assert time.monotonic() - started >= 0.3
    handle = _begin(admin)
    threading.Timer(0.2, lambda: _send(admin, handle, {"late": True})).start()
    started = time.monotonic()
    response = admin.post(RECEIVE, json={"wait_ms": 10000})
    # Woken by the arrival's notification, well before the once-a-second look.
    assert response.status_code == 200 and time.monotonic() - started < 0.9
    assert response.json()["messages"][0]["body"] == {"late": True}


def test_an_expired_lock_hands_the_messages_out_again(admin):
    handle = _begin(admin)
    for n in (1, 2):
        _send(admin, handle, {"n": n})
    first = admin.post(RECEIVE, json={"max_messages": 10, "lock_s": 0.5}).json()
    assert admin.post(RECEIVE, json={"wait_ms": 0}).status_code == 204  # held by the lock
    time.sleep(0.6)
    again = admin.post(RECEIVE, json={"max_messages": 10, "wait_ms": 2000}).json()
    assert [(m["sequence_number"], m["delivery_count"]) for m in again["messages"]] == [(1, 2), (2, 2)]
    _is_problem(admin.post(f"/v1/locks/{first['lock_token']}/complete"), 409, "lock-lost")
    assert admin.post(f"/v1/locks/{again['lock_token']}/complete").json() == {"completed": 2}


def test_a_live_lock_keeps_sql_readers_off_the_group(admin, engine):
    handle = _begin(admin)
    _send(admin, handle, {"n": 1})
    lock = admin.post(RECEIVE, json={"lock_s": 30}).json()
    with engine.begin() as connection:
        assert broker.receive(connection, factories.WAREHOUSE_QUEUE, 10) == []
    admin.post(f"/v1/locks/{lock['lock_token']}/abandon")
    with engine.begin() as connection:
        assert [m.message_sequence_number for m in broker.receive(connection, factories.WAREHOUSE_QUEUE, 10)] == [1]


def test_abandons_count_toward_the_poison_threshold(admin, engine):
    with engine.begin() as connection:
        broker.alter_queue(connection, factories.WAREHOUSE_QUEUE, poison_threshold=3)
    handle = _begin(admin)
    _send(admin, handle, {"poison": True})
    outcomes = []
    for delivery in (1, 2, 3):
        lock = admin.post(RECEIVE, json={}).json()
        assert lock["messages"][0]["delivery_count"] == delivery
        outcomes.append(admin.post(f"/v1/locks/{lock['lock_token']}/abandon").json()["quarantined"])
    assert outcomes == [False, False, True]
    assert admin.post(RECEIVE.replace("warehouse", "shop"), json={}).json()["messages"][0][
        "message_type"] == "broker.error"
    assert admin.get(f"/v1/conversations/{handle}").json()["state"] == "error"
    assert admin.get("/v1/queues/warehouse_queue").json()["dead_letters"] == 1


def test_expired_locks_count_toward_the_poison_threshold(admin, engine):
    with engine.begin() as connection:
        broker.alter_queue(connection, factories.WAREHOUSE_QUEUE, poison_threshold=2)
    handle = _begin(admin)
    _send(admin, handle, {"poison": True})
    for delivery in (1, 2):
        lock = admin.post(RECEIVE, json={"lock_s": 0.2, "wait_ms": 2000}).json()
        assert lock["messages"][0]["delivery_count"] == delivery
        time.sleep(0.3)  # the reader "crashes": the lock runs out
    # The second expiry quarantined the conversation: its side here gets the broker.error notice instead.
    notice = admin.post(RECEIVE, json={"wait_ms": 0}).json()["messages"]
    assert [(m["message_type"], m["sequence_number"]) for m in notice] == [("broker.error", 0)]
    assert admin.get("/v1/queues/warehouse_queue").json()["dead_letters"] == 1
    assert admin.get(f"/v1/conversations/{handle}").json()["state"] == "error"


def test_concurrent_receivers_never_share_a_group(api, engine, admin):
    conversations, per_conversation = 20, 5
    for _ in range(conversations):
        handle = _begin(admin)
        for n in range(1, per_conversation + 1):
            _send(admin, handle, {"n": n})
    key = new_key(engine, "receive:warehouse_queue")
    held: set[str] = set()
    guard = threading.Lock()
    overlaps, seen = [], {}

    def reader():
        with api.client(key) as client:
            while True:
                response = client.post(RECEIVE, json={"max_messages": 2, "wait_ms": 300, "lock_s": 30})
                if response.status_code == 204:
                    return
                messages = response.json()["messages"]
                group = messages[0]["conversation_group_id"]
                with guard:
                    if group in held:
                        overlaps.append(group)
                    held.add(group)
                    for m in messages:
                        seen.setdefault(m["conversation_id"], []).append(m["sequence_number"])
                time.sleep(0.01)  # "processing" while holding the group
                with guard:
                    held.discard(group)
                assert client.post(f"/v1/locks/{response.json()['lock_token']}/complete").status_code == 200

    readers = [threading.Thread(target=reader) for _ in range(4)]
    for thread in readers:
        thread.start()
    for thread in readers:
        thread.join(timeout=120)
    assert overlaps == []
    assert len(seen) == conversations
    assert all(numbers == list(range(1, per_conversation + 1)) for numbers in seen.values())


def test_keys_are_checked_on_every_route(api, engine, admin):
    handle = _begin(admin)
    lock = (_send(admin, handle, {"n": 1}), admin.post(RECEIVE, json={}).json())[1]["lock_token"]
    routes = [("post", "/v1/conversations", BEGIN), ("get", f"/v1/conversations/{handle}", None),
              ("post", f"/v1/conversations/{handle}/messages", {"message_type": "order.note"}),
              ("post", f"/v1/conversations/{handle}/end", {}), ("post", RECEIVE, {}),
              ("post", f"/v1/locks/{lock}/complete", None), ("post", f"/v1/locks/{lock}/abandon", None),
              ("post", f"/v1/locks/{lock}/renew", None), ("get", "/v1/queues", None),
              ("post", f"/v1/conversations/{handle}/move", {"conversation_group": handle}),
              ("post", "/v1/queues/warehouse_queue/purge", None),
              ("get", "/v1/queues/warehouse_queue/dead-letters", None),
              ("get", "/v1/queues/warehouse_queue/messages", None),
              ("post", "/v1/queues/warehouse_queue/dead-letters/purge", None),
              ("post", "/v1/queues/warehouse_queue/dead-letters/resubmit", {"conversation_handle": handle}),
              ("post", f"/v1/locks/{lock}/dead-letter", {"conversation_handle": handle, "reason": "x"}),
              ("get", f"/v1/locks/{lock}/state", None), ("put", f"/v1/locks/{lock}/state", {"state": 1}),
              ("get", "/v1/queues/warehouse_queue", None),
              ("get", "/v1/transmission-queue", None), ("get", "/v1/message-types", None),
              ("get", "/v1/contracts", None), ("get", "/v1/services", None), ("get", "/v1/routes", None),
              ("get", "/v1/broker-priorities", None), ("get", "/v1/diagnose", None), ("get", "/metrics", None)]
    revoked = new_key(engine, "admin")
    with engine.begin() as connection:
        queries.revoke_api_key(connection, revoked.split("_")[1])
    forged = revoked[:-4] + "AAAA"
    for presented in (None, "not-a-key", forged, revoked):
        with api.client(presented) as client:
            for method, path, body in routes:
                response = client.request(method, path, json=body)
                _is_problem(response, 401, "unauthorized")
                assert response.headers["www-authenticate"] == "Bearer"
    with api.client(new_key(engine, "send:someone-else", "receive:elsewhere")) as stranger:
        for method, path, body in routes:  # a handle or lock of another scope is as unknown (test_unseen_objects)
            refused = stranger.request(method, path, json=body)
            if handle in path or path.endswith("/dead-letter"):  # a dead-letter's handle is looked at first
                _is_problem(refused, 404, "unknown-object")
            elif lock in path:
                assert _is_problem(refused, 409, "lock-lost")["reason"] == "unknown"
            else:
                _is_problem(refused, 403, "forbidden")
    with engine.connect() as connection:
        assert connection.execute(text("SELECT count(*) FROM broker.leases")).scalar() == 1  # nothing applied


def test_scopes_grant_exactly_their_service_or_queue(api, engine):
    with api.client(new_key(engine, "send:shop")) as sender:
        handle = _begin(sender)
        assert _send(sender, handle, {"n": 1}).status_code == 201
        _is_problem(sender.post(RECEIVE, json={}), 403, "forbidden")
        _is_problem(sender.get("/v1/queues"), 403, "forbidden")
    with api.client(new_key(engine, "receive:warehouse_queue", "send:warehouse")) as receiver:
        lock = receiver.post(RECEIVE, json={}).json()
        target = lock["messages"][0]["conversation_handle"]
        assert receiver.post(f"/v1/locks/{lock['lock_token']}/complete").status_code == 200
        assert receiver.get(f"/v1/conversations/{target}").status_code == 200
        _is_problem(receiver.get(f"/v1/conversations/{handle}"), 404, "unknown-object")  # the shop's side
        assert receiver.post(f"/v1/conversations/{target}/end").status_code == 200


def test_no_api_key_reaches_the_transport_endpoint(api, engine):
    with api.client(new_key(engine, "admin")) as client:
        response = client.post("/transport/v1/batches", json={"conversations": []})
    _is_problem(response, 401, "unknown-peer")


def test_bad_requests_get_a_problem_and_change_nothing(admin, engine):
    handle = _begin(admin)
    with engine.connect() as connection:
        before = factories.broker_table_counts(connection)
    cases = [
        (admin.post("/v1/conversations", json={**BEGIN, "to_service": "nowhere"}), 404, "unknown-object"),
        (admin.post("/v1/conversations", json={**BEGIN, "contract": 7}), 422, "invalid-request"),
        (admin.post("/v1/conversations", content=b"{not json", headers={"content-type": "application/json"}),
         422, "invalid-request"),
        (admin.post(f"/v1/conversations/{handle}/messages",
                    json={"message_type": "order.submit", "body_base64": base64.b64encode(b"not json").decode()}),
         422, "validation-failed"),
        (_send(admin, handle, None, message_type="order.ack"), 422, "not-allowed"),  # the target's to send
        (_send(admin, handle, {"n": 1}, message_type="no.such.type"), 404, "unknown-object"),
        (admin.post(f"/v1/conversations/{handle}/messages",
                    json={"message_type": "order.note", "body": 1, "body_base64": "AA=="}), 422, "invalid-request"),
        (admin.post(f"/v1/conversations/{handle}/messages",
                    json={"message_type": "order.note", "body_base64": "%%%"}), 422, "invalid-request"),
        (admin.post(f"/v1/conversations/{handle}/messages",
                    json={"message_type": "order.note", "body_base64": "\u00d5\u00e9=="}), 422, "invalid-request"),
        (admin.get("/v1/conversations/not-a-uuid"), 422, "invalid-request"),
        (admin.get("/v1/conversations/00000000-0000-0000-0000-000000000000"), 404, "unknown-object"),
        (admin.post("/v1/queues/nowhere/receive", json={}), 404, "unknown-object"),
        (admin.post(RECEIVE, json={"max_messages": 0}), 422, "invalid-request"),
        (admin.post(f"/v1/conversations/{handle}/end", json={"error_code": 1}), 400, "invalid-argument"),
        (admin.post("/v1/locks/00000000-0000-0000-0000-000000000000/complete"), 409, "lock-lost"),
        (admin.get("/v1/no-such-route"), 404, "http-error"),
    ]
    for response, status, kind in cases:
        _is_problem(response, status, kind)
    with engine.connect() as connection:
        assert factories.broker_table_counts(connection) == before


def test_a_closed_conversation_refuses_sends_with_409(admin):
    handle = _begin(admin)
    admin.post(f"/v1/conversations/{handle}/end", json={"error_code": 7, "error_description": "gave up"})
    problem = _is_problem(_send(admin, handle, {"n": 1}), 409, "conversation-state")
    assert problem["sqlstate"] == "BR020"


def test_a_request_over_the_size_limit_gets_413(admin):
    handle = _begin(admin)
    big = {"message_type": "order.note", "body": "x" * 70_000}
    _is_problem(admin.post(f"/v1/conversations/{handle}/messages", json=big), 413, "too-large")

    def chunks():
        for _ in range(70):
            yield b"x" * 1000

    chunked = admin.post(f"/v1/conversations/{handle}/messages", content=chunks(),
                         headers={"content-type": "application/json"})
    _is_problem(chunked, 413, "too-large")
    assert admin.get(f"/v1/conversations/{handle}").json()["send_sequence"] == 0


def test_cors_is_off(admin):
    response = admin.options("/v1/queues", headers={"Origin": "https://evil.example",
                                                    "Access-Control-Request-Method": "GET"})
    assert "access-control-allow-origin" not in response.headers
    assert "access-control-allow-origin" not in admin.get("/v1/queues", headers={"Origin": "https://x"}).headers


def test_catalog_and_status_routes(admin, engine):
    handle = _begin(admin)
    _send(admin, handle, {"n": 1})
    with engine.begin() as connection:
        broker.create_service(connection, "remote-billing", factories.SHOP_QUEUE)
        broker.drop_service(connection, "remote-billing")
        broker.create_route(connection, "billing", "http://127.0.0.1:9", "6d1d5f36-1a51-4b8e-9d3f-2f4b4b7f9c11",
                            "a-secret-of-sixteen-chars")
        remote = broker.begin_dialog(connection, factories.SHOP, "billing", factories.CONTRACT)
        broker.send(connection, remote, "order.note", b"to billing")
        broker.create_broker_priority(connection, "billing-first", 9, remote_service="billing")
    assert {"name": "order.submit", "validation": "json"} in admin.get("/v1/message-types").json()
    assert admin.get("/v1/contracts").json() == [{"name": "orders", "message_types": {
        "order.ack": "target", "order.note": "any", "order.submit": "initiator"}}]
    assert {"name": "warehouse", "queue": "warehouse_queue", "contracts": ["orders"]} in admin.get("/v1/services").json()
    routes = admin.get("/v1/routes")
    assert routes.json()[0]["address"] == "http://127.0.0.1:9" and "a-secret" not in routes.text
    assert admin.get("/v1/broker-priorities").json() == [{"name": "billing-first", "priority": 9, "contract_name": None,
                                                          "local_service_name": None, "remote_service_name": "billing"}]
    assert admin.get(f"/v1/conversations/{remote}").json()["priority"] == 5  # created before the priority
    waiting = admin.get("/v1/transmission-queue").json()
    assert [(w["to_service"], w["message_sequence_number"]) for w in waiting] == [("billing", 1)]
    queues = {q["queue_name"]: q for q in admin.get("/v1/queues").json()}
    assert queues["warehouse_queue"]["depth"] == 1 and queues["warehouse_queue"]["oldest_message_age_s"] >= 0
    metrics = admin.get("/metrics")
    assert metrics.headers["content-type"].startswith("text/plain")
    for line in ['broker_queue_depth{queue="warehouse_queue"} 1.0',
                 'broker_transmission_queue_messages{destination="http://127.0.0.1:9"} 1.0',
                 "broker_transmission_queue_oldest_age_seconds", "broker_relay_messages_sent_total",
                 "broker_api_messages_received_total"]:
        assert line in metrics.text


def test_a_key_revoked_while_in_use_stops_working_within_its_bound(api, engine):
    key = new_key(engine, "admin")
    with api.client(key) as client:
        assert client.get("/v1/queues").status_code == 200  # looked up, and kept for KEY_KNOWN_FOR_S
        with engine.begin() as connection:
            queries.revoke_api_key(connection, key.split("_")[1])
        revoked_at = time.monotonic()
        wait_for(lambda: client.get("/v1/queues").status_code == 401, admission.KEY_KNOWN_FOR_S + 5,
                 "the revoked key to be refused")
        assert time.monotonic() - revoked_at <= admission.KEY_KNOWN_FOR_S + 1
        assert client.get("/v1/queues").status_code == 401  # and from then on


def test_readiness_follows_the_database_and_the_schema(api, engine):
    with api.client() as anyone:
        health = anyone.get("/healthz")
        assert health.status_code == 200 and health.json()["version"] == broker.__version__
        assert anyone.get("/readyz").json() == {"status": "ready", "schema_revision": migrate.head_revision()}
        with engine.begin() as connection:
            connection.execute(text("UPDATE public.broker_alembic_version SET version_num = '0001'"))
        problem = _is_problem(anyone.get("/readyz"), 503, "not-ready")
        assert "broker migrate" in problem["detail"]
        with engine.begin() as connection:
            connection.execute(text("UPDATE public.broker_alembic_version SET version_num = :head"), {"head": migrate.head_revision()})
        assert anyone.get("/readyz").status_code == 200
        # At the head, readiness compares the function files too: a database whose functions are not this node's.
        with engine.begin() as connection:
            connection.execute(text("UPDATE broker.function_files SET sha256 = '\\x00' WHERE file_name = '05_send.sql'"))
        problem = _is_problem(anyone.get("/readyz"), 503, "not-ready")
        assert "other versions of 05_send.sql: run 'broker migrate'" in problem["detail"]
        migrate.upgrade(engine.url.render_as_string(hide_password=False))
        assert anyone.get("/readyz").status_code == 200

        # A later release's functions at the same revision: ready while they still serve this release
        # (broker.function_release), and this release's migrate leaves them as they are.
        with engine.begin() as connection:
            connection.execute(text("UPDATE broker.function_release SET release = '99.0.0', serves_from = :ours"),
                               {"ours": broker.__version__})
            connection.execute(text("UPDATE broker.function_files SET sha256 = '\\x00' WHERE file_name = '05_send.sql'"))
        assert anyone.get("/readyz").json() == {"status": "ready", "schema_revision": migrate.head_revision()}
        with engine.begin() as connection:
            connection.execute(text("UPDATE broker.function_release SET serves_from = '99.0.0'"))
        migrate.upgrade(engine.url.render_as_string(hide_password=False))
        problem = _is_problem(anyone.get("/readyz"), 503, "not-ready")
        assert problem["detail"] == ("the database holds the functions of release 99.0.0, which serve releases from "
                                     f"99.0.0 on; this node is of release {broker.__version__}: upgrade this node")
        with engine.begin() as connection:
            connection.execute(text("UPDATE broker.function_release SET release = '0.0.1'"))
        migrate.upgrade(engine.url.render_as_string(hide_password=False))
        assert anyone.get("/readyz").status_code == 200

        # Migrated ahead by the next release, whose revisions only add: ready, until a revision removes what this
        # release needs (broker.oldest_serving_revision).
        later = f"{int(migrate.head_revision()) + 1:04d}"
        with engine.begin() as connection:
            connection.execute(text("UPDATE public.broker_alembic_version SET version_num = :later"), {"later": later})
        assert anyone.get("/readyz").json() == {"status": "ready", "schema_revision": later}
        with engine.begin() as connection:
            connection.execute(text(f"CREATE OR REPLACE FUNCTION broker.oldest_serving_revision() RETURNS text"
                                    f" LANGUAGE sql IMMUTABLE AS $$ SELECT '{later}' $$"))
            connection.execute(text("UPDATE broker.function_files SET sha256 = '\\x00'"
                                    " WHERE file_name = '15_compatibility.sql'"))
        problem = _is_problem(anyone.get("/readyz"), 503, "not-ready")
        assert problem["detail"] == (f"the database is at revision {later}, which serves releases from revision "
                                     f"{later} on; this node's release needs {migrate.head_revision()}: upgrade this node")
        with engine.begin() as connection:
            connection.execute(text("UPDATE public.broker_alembic_version SET version_num = :head"),
                               {"head": migrate.head_revision()})
        migrate.upgrade(engine.url.render_as_string(hide_password=False))
        assert anyone.get("/readyz").status_code == 200


def test_the_openapi_document_shows_every_route_with_examples(api):
    with api.client() as anyone:
        assert anyone.get("/docs").status_code == 200
        document = anyone.get("/openapi.json").json()
    paths = set(document["paths"])
    assert {"/v1/conversations", "/v1/conversations/{conversation_handle}",
            "/v1/conversations/{conversation_handle}/messages", "/v1/conversations/{conversation_handle}/end",
            "/v1/queues/{queue}/receive", "/v1/locks/{lock_token}/complete", "/v1/locks/{lock_token}/abandon",
            "/v1/locks/{lock_token}/renew", "/v1/conversations/{conversation_handle}/move",
            "/v1/queues/{queue}/purge", "/v1/queues", "/v1/queues/{queue}", "/v1/transmission-queue",
            "/v1/message-types", "/v1/contracts", "/v1/services", "/v1/routes", "/healthz", "/readyz",
            "/metrics", "/v1/locks/{lock_token}/state", "/v1/locks/{lock_token}/dead-letter",
            "/v1/queues/{queue}/dead-letters", "/v1/queues/{queue}/dead-letters/resubmit",
            "/v1/queues/{queue}/dead-letters/purge", "/v1/queues/{queue}/messages", "/v1/broker-priorities",
            "/v1/diagnose"} <= paths
    assert not any(path.startswith("/transport") for path in paths)
    schemas = document["components"]["schemas"]
    for model in ("BeginConversation", "SendMessage", "ReceiveRequest", "RenewRequest", "MoveConversation",
                  "EndConversation"):
        assert schemas[model].get("examples"), model
    # Named operations, and every error the one ProblemDetails component (a generated client is
    # exercised in test_openapi_client.py).
    operations = [operation for methods in document["paths"].values() for operation in methods.values()]
    assert {"begin_conversation", "send_message", "receive", "complete_lock", "renew_lock"} <= {
        o["operationId"] for o in operations}
    problem_json = {"application/problem+json": {"schema": {"$ref": "#/components/schemas/ProblemDetails"}}}
    for operation in operations:
        assert operation["tags"], operation["operationId"]
        assert all(response["content"] == problem_json for status, response in operation["responses"].items()
                   if int(status) >= 400), operation["operationId"]
