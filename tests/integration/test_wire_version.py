"""The wire has a version: a node takes batches of its own wire version and the one before it, refuses any other
from the request's headers, sends each peer the highest version both take (learning it again from a refusal), and
a relay facing a node that shares no version keeps its messages and says why."""
import json
import time
import uuid
from datetime import UTC, datetime
from types import SimpleNamespace

import httpx
import pytest

import broker
from broker.transport import signing, wire
from tests.nodes import SECRET, wait_for
from tests.peers import ScriptedPeer, json_answer
from tests.integration.test_bounded_requests import MIB, _headers_only
from tests.integration.test_diagnose import _diagnose
from tests.integration.test_transport import _batch, _encode, _post, _stored

OTHER_VERSION = 5
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def other_version_node(instance) -> ScriptedPeer:
    """A node of wire version 5: /healthz names it, and every batch is refused as a node of that version
    refuses one of ours."""
    def answer(request):
        if request.method == "GET":
            return json_answer(200, {"status": "ok", "broker_instance": str(instance), "wire_version": OTHER_VERSION})
        return json_answer(415, {
            "type": "/problems/unsupported-wire-version", "status": 415,
            "title": "The batch is in a wire version this node does not take",
            "detail": f"the batch is sent as wire version 4; this node takes wire version {OTHER_VERSION}",
            "wire_version": OTHER_VERSION}, media_type="application/problem+json")

    return ScriptedPeer(answer)


@pytest.mark.parametrize("content_type,sent", [
    (None, "no Content-Type"),
    ("application/json", "(wire version 1)"),
    (wire.BATCH_TYPE, "(no wire version)"),
    (f"{wire.BATCH_TYPE}; version={OTHER_VERSION}", f"(wire version {OTHER_VERSION})"),
    (f"{wire.BATCH_TYPE}; version=1", "(wire version 1)"),
    (f"{wire.BATCH_TYPE}; version=2", "(wire version 2)"),
], ids=["none", "JSON", "unversioned", "version 5", "version 1", "version 2"])
def test_a_batch_in_another_wire_version_is_refused_before_its_body_is_read(shared_nodes, content_type, sent):
    a, b = shared_nodes
    peer = {signing.INSTANCE_HEADER: str(a.instance), signing.TIMESTAMP_HEADER: str(int(time.time())),
            signing.SIGNATURE_HEADER: "0" * 64}
    started = time.monotonic()
    status, answer = _headers_only(b, signing.BATCHES_PATH, peer, 48 * MIB, content_type)
    assert time.monotonic() - started < 5  # answered without waiting for the 48 MiB
    assert status == 415 and "connection: close" in answer and "content-type: application/problem+json" in answer
    problem = json.loads(answer[answer.rindex("\n{") + 1:])
    assert problem["type"] == "/problems/unsupported-wire-version" and problem["wire_version"] == wire.WIRE_VERSION
    assert problem["wire_versions"] == [3, 4]
    assert sent in problem["detail"] and "this node takes wire versions 3 and 4" in problem["detail"]
    assert b.scalar("SELECT count(*) FROM broker.endpoints") == 0


def test_the_media_type_is_matched_as_media_types_are_and_is_signed(nodes):
    a, b = nodes
    health = httpx.get(f"{b.address}/healthz", timeout=5).json()
    assert health["wire_version"] == wire.WIRE_VERSION and health["wire_versions"] == [3, 4]
    conversation = uuid.uuid4()
    spelled = f'Application/Vnd.PG-Broker.Batch ; Version="{wire.WIRE_VERSION}"'
    first = _post(b, a, _encode(b, _batch(conversation, [1])), headers={"Content-Type": spelled})
    assert first.status_code == 200

    second = _encode(b, _batch(conversation, [2]))
    purpose = signing.request_purpose("POST", signing.BATCHES_PATH, f"{wire.BATCH_TYPE}; version={OTHER_VERSION}",
                                      str(b.instance))
    signed_for_another = {"Content-Type": wire.BATCH_MEDIA_TYPE,
                          **signing.signed_headers(SECRET, str(a.instance), purpose, second)}
    refused = httpx.post(f"{b.address}{signing.BATCHES_PATH}", content=second, headers=signed_for_another, timeout=30)
    assert refused.status_code == 401 and refused.json()["type"] == "/problems/bad-signature"
    assert [tuple(row) for row in _stored(b)] == [(1, "1")]
    assert _post(b, a, second).status_code == 200  # the same batch, signed for what it is
    assert [tuple(row) for row in _stored(b)] == [(1, "1"), (2, "2")]


def test_a_relay_facing_another_wire_version_keeps_its_messages_and_diagnose_says_what_to_do(nodes):
    a, b = nodes
    far = other_version_node(b.instance)
    try:
        with a.engine.begin() as c:
            broker.drop_route(c, "warehouse")
            broker.create_route(c, "warehouse", far.address, b.instance, SECRET)
            handle = broker.begin_dialog(c, "shop", "warehouse", "orders")
            for line in (1, 2, 3):
                broker.send(c, handle, "order.note", str(line))
        wait_for(lambda: a.scalar("SELECT min(attempts) FROM broker.transmission_queue_status") >= 2, 30,
                 "the relay to try again after its backoff")
        assert [r.method for r in far.requests[:2]] == ["GET", "POST"]  # its /healthz, then a batch
        assert far.requests[1].headers["Content-Type"] == wire.BATCH_MEDIA_TYPE
        assert a.scalar("SELECT count(*) FROM broker.transmission_queue_status") == 3
        status = a.scalar("SELECT min(transmission_status) FROM broker.transmission_queue_status")
        assert f"{far.address} speaks another wire version (HTTP 415)" in status
        assert f"it takes wire version {OTHER_VERSION}, this node sends wire versions 3 and 4" in status

        code, findings = _diagnose(a)
        assert code == 1
        errors = {f["check"]: f for f in findings if f["level"] == "error"}
        node = errors[f"node {far.address}"]
        assert f"speaks wire version {OTHER_VERSION}, this node wire versions 3 and 4" in node["finding"]
        assert "upgrade one of the two nodes" in node["advice"]
        transmission = errors[f"transmission to {far.address}"]
        assert "another wire version" in transmission["finding"]
        assert "upgrade one of the two nodes" in transmission["advice"]
    finally:
        far.close()

    with a.engine.begin() as c:  # the same version again: nothing was lost
        broker.drop_route(c, "warehouse")
        broker.create_route(c, "warehouse", b.address, b.instance, SECRET)
    assert [m.body for m in b.receive_all("warehouse_queue", 3, timeout_s=60)] == [b"1", b"2", b"3"]


VERSION_3_ROWS = ("(conversation_id, sender_is_initiator, from_service, to_service, contract, expires_at,"
                  " sequence_number, message_type, body, traceparent)")


def test_a_batch_of_the_previous_wire_version_is_taken_without_message_ids(nodes):
    a, b = nodes
    conversation = uuid.uuid4()
    version_3 = f"{wire.BATCH_TYPE}; version=3"
    body = _encode(b, _batch(conversation, [1, 2]))
    assert _post(b, a, body, headers={"Content-Type": version_3}).status_code == 401  # signed as version 4
    body = _encode(b, [(*row, TRACEPARENT) for row in _batch(conversation, [1, 2])], columns=VERSION_3_ROWS)
    purpose = signing.request_purpose("POST", signing.BATCHES_PATH, version_3, str(b.instance))
    answer = httpx.post(f"{b.address}{signing.BATCHES_PATH}", content=body, timeout=30, headers={
        "Content-Type": version_3, **signing.signed_headers(SECRET, str(a.instance), purpose, body)})
    assert answer.status_code == 200, answer.text
    assert [tuple(row) for row in _stored(b)] == [(1, "1"), (2, "2")]
    assert b.scalar("SELECT count(traceparent) FROM broker.queue_messages") == 2
    assert b.scalar("SELECT count(received_message_id) FROM broker.endpoints") == 0


def older_node_in_front_of(node) -> ScriptedPeer:
    """A node that takes wire version 3 only, though its /healthz names version 4 (it was downgraded since, say):
    a batch of version 4 is refused with a 415 naming version 3, and one of version 3 goes to the real node."""
    def answer(request):
        if request.method == "GET":
            return json_answer(200, {"status": "ok", "broker_instance": str(node.instance), "wire_version": 4})
        if wire.taken_version(request.headers["Content-Type"]) != 3:
            return json_answer(415, {"type": "/problems/unsupported-wire-version", "status": 415,
                                     "title": "The batch is in a wire version this node does not take",
                                     "detail": "this node takes wire version 3", "wire_version": 3,
                                     "wire_versions": [3]}, media_type="application/problem+json")
        forwarded = httpx.post(f"{node.address}{request.path}", content=request.body, timeout=30,
                               headers={name: request.headers[name] for name in (
                                   "Content-Type", signing.INSTANCE_HEADER, signing.TIMESTAMP_HEADER,
                                   signing.SIGNATURE_HEADER)})
        return forwarded.status_code, {name: forwarded.headers[name] for name in forwarded.headers if
                                       name.lower() in ("content-type", "x-broker-instance", "x-broker-timestamp",
                                                        "x-broker-signature")}, forwarded.content

    return ScriptedPeer(answer)


def test_a_relay_refused_for_its_wire_version_sends_the_version_the_refusal_names(nodes):
    a, b = nodes
    with older_node_in_front_of(b) as older:
        with a.engine.begin() as c:
            broker.drop_route(c, "warehouse")
            broker.create_route(c, "warehouse", older.address, b.instance, SECRET)
            handle = broker.begin_dialog(c, "shop", "warehouse", "orders")
            for line in (1, 2, 3):
                broker.send(c, handle, "order.note", str(line), traceparent=TRACEPARENT)
        received = b.receive_all("warehouse_queue", 3, timeout_s=30)
        assert [(m.body, m.traceparent) for m in received] == [(b"1", TRACEPARENT), (b"2", TRACEPARENT),
                                                                (b"3", TRACEPARENT)]
        assert b.scalar("SELECT count(received_message_id) FROM broker.endpoints") == 0  # version 3 has no ids
        versions = [wire.version_of(r.headers["Content-Type"]) for r in older.requests if r.method == "POST"]
        assert versions[:2] == ["4", "3"] and set(versions[1:]) == {"3"}  # refused once, then version 3 at once
        wait_for(lambda: a.scalar("SELECT count(*) FROM broker.transmission_queue_status") == 0, 30, "the acknowledgements")


def test_the_highest_number_of_each_conversation_side_is_read_from_a_batch_of_either_version(engine):
    """What an answer to a batch may settle (broker.apply_transport_results), read as the relay reads it: the
    rows' fields stepped over by their lengths, a NULL's included, whatever the version."""
    first, second = uuid.uuid4(), uuid.uuid4()
    rows = [(*row, None) for row in (*_batch(first, [1, 2, 3]), *_batch(second, [7], body=b"x" * 70_000))]
    rows.append((str(first), False, "warehouse", "shop", "orders", datetime.now(UTC), 5, None, "order.reply", b"",
                 TRACEPARENT))
    expected = {(first.hex, True): 3, (second.hex, True): 7, (first.hex, False): 5}
    database = SimpleNamespace(engine=engine)
    for columns in ("", VERSION_3_ROWS):
        assert wire.last_numbers(_encode(database, rows, columns=columns)) == expected
