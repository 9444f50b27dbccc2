"""Browsing a queue's waiting messages over REST, and the node's record of what keys did (broker.api.audit)."""
import base64
import json
import logging
from datetime import datetime

import pytest
from sqlalchemy import text

import broker
from tests import factories
from tests.rest import ApiServer, new_key

BROWSE = "/v1/queues/warehouse_queue/messages"


@pytest.fixture
def api(database_url, orders):
    with ApiServer(database_url) as server:
        yield server


@pytest.fixture
def admin_key(engine):
    return new_key(engine, "admin", name="ops on call")


@pytest.fixture
def audit(caplog):
    caplog.set_level(logging.INFO, logger="broker.api.audit")
    return lambda: [record.getMessage() for record in caplog.records if record.name == "broker.api.audit"]


def _send(engine, *messages):
    """One new conversation with these (message_type, body) sent; the shop's handle."""
    with engine.begin() as connection:
        handle = factories.begin(connection)
        for message_type, body in messages:
            broker.send(connection, handle, message_type, body)
    return handle


def test_browsing_shows_waiting_messages_by_priority_then_age_and_neither_locks_nor_consumes(api, engine, admin_key):
    handle = _send(engine, ("order.submit", '{"sku": 1}'), ("order.note", "second"))
    with engine.begin() as connection:
        broker.send(connection, factories.begin(connection), "order.note", "third")
        target = factories.target_handle(connection, handle)
    with api.client(admin_key) as admin:
        first = admin.get(BROWSE).json()
        assert admin.get(BROWSE).json() == first  # looked at twice: nothing changed
        assert [m["body_preview"] for m in first] == ['{"sku": 1}', "second", "third"]
        assert [(m["conversation_handle"], m["sequence_number"], m["message_type"]) for m in first[:2]] == [
            (str(target), 1, "order.submit"), (str(target), 2, "order.note")]
        assert {(m["delivery_count"], m["locked_until"], m["body_truncated"]) for m in first} == {(0, None, False)}
        assert [m["body_preview"] for m in admin.get(BROWSE, params={"limit": 1, "offset": 1}).json()] == ["second"]
        lock = admin.post("/v1/queues/warehouse_queue/receive", json={"max_messages": 1}).json()
        locked = admin.get(BROWSE).json()
        assert [datetime.fromisoformat(m["locked_until"]) if m["locked_until"] else None for m in locked] == [
            datetime.fromisoformat(lock["lock_expires_at"]), None, None]  # one message of the group received
        assert [m["delivery_count"] for m in locked] == [1, 0, 0]
    with engine.begin() as connection:
        assert connection.execute(text("SELECT count(*) FROM broker.leases")).scalar() == 1  # the receive's alone
        assert len(broker.receive(connection, factories.WAREHOUSE_QUEUE, 10)) == 1  # the third: others are locked


def test_a_preview_is_the_first_kilobyte_with_the_whole_size(api, engine, admin_key):
    long_text = "é" * 1000  # 2,000 bytes: the 1,024th byte cuts a character in two
    _send(engine, ("order.note", long_text), ("order.note", b"\xff\x00binary" * 200), ("order.note", None),
          ("order.submit", json.dumps({"html": "<script>alert(1)</script>"})))
    with api.client(admin_key) as admin:
        cut, binary, empty, markup = admin.get(BROWSE).json()
    assert cut["body_bytes"] == 2000 and cut["body_truncated"] and cut["body_preview"] == "é" * 512
    assert cut["body_preview_base64"] is None
    assert binary["body_preview"] is None and binary["body_bytes"] == 1600 and binary["body_truncated"]
    assert base64.b64decode(binary["body_preview_base64"]) == (b"\xff\x00binary" * 200)[:1024]
    assert (empty["body_bytes"], empty["body_preview"], empty["body_preview_base64"]) == (None, None, None)
    assert markup["body_preview"] == '{"html": "<script>alert(1)</script>"}'  # as stored: escaping is the page's


def test_browsing_is_bounded_needs_the_admin_scope_and_names_an_unknown_queue(api, engine, admin_key):
    with api.client(admin_key) as admin:
        assert admin.get(BROWSE, params={"limit": 100}).status_code == 200
        for limit in (0, 101):
            response = admin.get(BROWSE, params={"limit": limit})
            assert response.status_code == 422 and response.json()["type"] == "/problems/invalid-request"
        unknown = admin.get("/v1/queues/no_such_queue/messages")
        assert unknown.status_code == 404 and unknown.json()["detail"] == "unknown queue 'no_such_queue'"
    with api.client(new_key(engine, "receive:warehouse_queue", name="reader")) as reader:
        refused = reader.get(BROWSE)
    assert refused.status_code == 403 and "needs admin" in refused.json()["detail"]


def test_every_operator_action_is_one_line_in_the_node_log_naming_the_key_never_its_secret(
        api, engine, admin_key, audit):
    key_id = admin_key.split("_")[1]
    stuck = _send(engine, ("order.note", "stuck"))
    with engine.begin() as connection:
        broker.alter_queue(connection, factories.WAREHOUSE_QUEUE, poison_threshold=1)
        poisoned = factories.target_handle(connection, _send(engine, ("order.note", "poison")))
    reader_key = new_key(engine, "receive:warehouse_queue", name="reader")
    with api.client(admin_key) as admin, api.client(reader_key) as reader:
        lock = reader.post("/v1/queues/warehouse_queue/receive", json={"conversation_handle": str(poisoned)}).json()
        assert reader.post(f"/v1/locks/{lock['lock_token']}/abandon").json() == {"quarantined": True}
        assert admin.get(BROWSE).status_code == 200
        assert admin.post("/v1/queues/warehouse_queue/dead-letters/resubmit",
                          json={"conversation_handle": str(poisoned)}).json() == {"resubmitted": 1}
        with engine.connect() as connection:
            conversing = factories.target_handle(connection, stuck)
        assert admin.post("/v1/queues/warehouse_queue/dead-letters/resubmit",
                          json={"conversation_handle": str(conversing)}).status_code == 409  # not in error
        assert admin.post(f"/v1/conversations/{stuck}/end",
                          json={"error_code": 42, "error_description": "stuck for a week"}).status_code == 200
        purged = admin.post("/v1/queues/warehouse_queue/purge").json()["purged"]
        assert admin.post("/v1/queues/warehouse_queue/dead-letters/purge", json={"older_than_s": 3600}).json() == {
            "purged": 0}
        assert reader.post("/v1/queues/warehouse_queue/purge").status_code == 403
        assert reader.post(f"/v1/locks/{lock['lock_token']}/complete").status_code == 409  # not an operator action
    who = f"key 'ops on call' ({key_id})"
    lines = audit()
    assert lines == [
        f"{who} browse queue 'warehouse_queue': waiting messages shown: 2",
        f"{who} resubmit the dead letters of conversation {poisoned} in queue 'warehouse_queue': "
        "dead letters put back in order: 1",
        f"{who} resubmit the dead letters of conversation {conversing} in queue 'warehouse_queue': "
        "refused, 409 conversation-state (BR020)",
        f"{who} end with error 42 conversation {stuck}: ended, now closed",
        f"{who} purge queue 'warehouse_queue': waiting messages deleted: {purged}",
        f"{who} purge the dead letters of queue 'warehouse_queue' dead-lettered over 3600 s ago: dead letters "
        "deleted: 0",
        f"key 'reader' ({reader_key.split('_')[1]}) purge queue 'warehouse_queue': refused, 403 forbidden",
    ]
    assert not any(admin_key.split("_", 2)[2] in line or reader_key.split("_", 2)[2] in line for line in lines)
