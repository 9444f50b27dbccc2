"""Two nodes, each a real `broker serve` process on its own database, conversing over HTTP."""
import io
import json
import time
import uuid
from datetime import timedelta

import httpx
import pytest
import trustme
import psycopg2.extras
from sqlalchemy import text

import broker
from broker.transport import signing, wire
from tests.chaos_proxy import ChaosProxy
from tests.nodes import CONTRACTS, MESSAGE_TYPES, SECRET, two_nodes, wait_for


@pytest.fixture
def tls_nodes(admin_url, template_database, tmp_path):
    """Two HTTPS nodes; a trusts the CA that signed b's certificate, b does not trust a's."""
    ca = trustme.CA()
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    tls = []
    for name, trusted_ca in (("a", ca_file), ("b", None)):
        certificate = ca.issue_cert("127.0.0.1")
        cert, key = tmp_path / f"{name}.pem", tmp_path / f"{name}.key"
        certificate.cert_chain_pems[0].write_to_path(str(cert))
        certificate.private_key_pem.write_to_path(str(key))
        tls.append({"cert": cert, "key": key, "ca": trusted_ca})
    yield from two_nodes(admin_url, template_database, tmp_path, tls=tls)


def _by_conversation(messages):
    grouped = {}
    for m in messages:
        grouped.setdefault(m.conversation_id, []).append(m)
    return grouped


def test_conversations_cross_in_both_directions_and_end_on_both_sides(nodes):
    a, b = nodes
    with a.engine.begin() as c:
        from_a = [broker.begin_dialog(c, "shop", "warehouse", "orders") for _ in range(20)]
        for handle in from_a:
            for i in range(10):
                broker.send(c, handle, "order.submit", json.dumps({"line": i + 1}))
    with b.engine.begin() as c:
        from_b = broker.begin_dialog(c, "warehouse", "shop", "orders")
        broker.send(c, from_b, "order.submit", '{"line": 1}')
        broker.end_conversation(c, from_b)

    at_b = _by_conversation(b.receive_all("warehouse_queue", 200))
    assert len(at_b) == 20
    for messages in at_b.values():
        assert [(m.message_sequence_number, m.json()["line"]) for m in messages] == [(i, i) for i in range(1, 11)]
    with b.engine.begin() as c:
        for messages in at_b.values():
            broker.send(c, messages[0].conversation_handle, "order.ack")
            broker.end_conversation(c, messages[0].conversation_handle)

    at_a = _by_conversation(a.receive_all("shop_queue", 20 * 2 + 2))
    for conversation, messages in at_a.items():
        kinds = [m.message_type for m in messages]
        if kinds[0] == "order.submit":  # the conversation b began
            assert kinds == ["order.submit", "broker.end_dialog"]
        else:
            assert kinds == ["order.ack", "broker.end_dialog"]
            assert [m.message_sequence_number for m in messages] == [1, 2]
    with a.engine.begin() as c:
        for messages in at_a.values():
            broker.end_conversation(c, messages[0].conversation_handle)
    for node in (a, b):
        wait_for(lambda: node.scalar("SELECT count(*) FROM broker.transmission_queue_status") == 0, 30,
                 f"{node.name}'s transmission queue to drain")
        assert node.scalar("SELECT count(*) FROM broker.conversation_endpoints WHERE state <> 'closed'") == 0


def test_an_error_ending_crosses_to_the_far_node(nodes):
    a, b = nodes
    with a.engine.begin() as c:
        handle = broker.begin_dialog(c, "shop", "warehouse", "orders")
        broker.send(c, handle, "order.note", "hello")
    [message] = b.receive_all("warehouse_queue", 1)
    with b.engine.begin() as c:
        broker.end_conversation(c, message.conversation_handle, error_code=409, error_description="no stock")
    [error] = a.receive_all("shop_queue", 1)
    assert (error.message_type, error.json()) == ("broker.error", {"code": 409, "description": "no stock"})


def test_a_refused_contract_ends_the_conversation_with_broker_error_at_the_sender(nodes):
    a, b = nodes
    with a.engine.begin() as c:
        handle = broker.begin_dialog(c, "shop", "warehouse", "audit")
        broker.send(c, handle, "order.note", "not welcome")
    [error] = a.receive_all("shop_queue", 1)
    assert error.message_type == "broker.error"
    assert error.json()["code"] == -3 and "does not accept contract" in error.json()["description"]
    assert a.scalar("SELECT count(*) FROM broker.transmission_queue_status") == 0
    assert b.scalar("SELECT count(*) FROM broker.endpoints") == 0


def test_a_peer_down_for_a_while_gets_everything_in_order_when_it_returns(nodes):
    a, b = nodes
    b.stop()
    with a.engine.begin() as c:
        handles = [broker.begin_dialog(c, "shop", "warehouse", "orders") for _ in range(30)]
    for i in range(10):
        with a.engine.begin() as c:
            for handle in handles:
                broker.send(c, handle, "order.note", str(i + 1))
    status = wait_for(lambda: a.scalar("SELECT min(transmission_status) FROM broker.transmission_queue_status"
                                       " WHERE attempts > 0"), 15, "a failed attempt to be recorded")
    assert "cannot reach" in status and "next at" in status
    b.start()
    at_b = _by_conversation(b.receive_all("warehouse_queue", 300, timeout_s=60))
    for messages in at_b.values():
        assert [(m.message_sequence_number, m.body) for m in messages] == [(i, str(i).encode()) for i in range(1, 11)]
    wait_for(lambda: a.scalar("SELECT count(*) FROM broker.transmission_queue_status") == 0, 30, "the queue to drain")
    assert a.scalar("SELECT count(*) FROM broker.transmission_failures") == 0  # answered: the failures are gone


def test_a_lifetime_that_ends_while_the_peer_is_down_gives_broker_error_on_both_sides(nodes):
    a, b = nodes
    with a.engine.begin() as c:
        handle = broker.begin_dialog(c, "shop", "warehouse", "orders", lifetime=timedelta(seconds=4))
        broker.send(c, handle, "order.note", "first")
    wait_for(lambda: b.scalar("SELECT count(*) FROM broker.queue_messages") == 1, 15, "the first message")
    b.stop()
    with a.engine.begin() as c:
        broker.send(c, handle, "order.note", "second, never delivered")
    [error_at_a] = a.receive_all("shop_queue", 1, timeout_s=15)
    assert error_at_a.message_type == "broker.error" and "lifetime expired" in error_at_a.json()["description"]
    b.start()
    at_b = b.receive_all("warehouse_queue", 2, timeout_s=15)
    # The message that was waiting comes first, then one broker.error: b's own notice of the expiry,
    # or a's error if it arrives first (a dropped "second" at the expiry and numbered its error 3).
    assert [m.message_type for m in at_b] == ["order.note", "broker.error"]
    assert "lifetime expired" in at_b[1].json()["description"]
    wait_for(lambda: a.scalar("SELECT count(*) FROM broker.transmission_queue_status") == 0, 30, "the queue to drain")


# Hostile input posted straight to the transport endpoint.


def message_id(conversation_id, number) -> str:
    """The id a sender gives its message of that number: the same each time it is sent."""
    return str(uuid.uuid5(uuid.UUID(str(conversation_id)), str(number)))


def _batch(conversation_id, numbers, *, to_service="warehouse", message_type="order.note", body=None):
    """One conversation's messages from shop, as rows of broker.wire_message."""
    return [(str(conversation_id), True, "shop", to_service, "orders", None, n, message_id(conversation_id, n),
             message_type, body or str(n).encode()) for n in numbers]


def _encode(node, rows, row_type="broker.wire_message", columns="") -> bytes:
    """Rows in the transport's wire format, written by PostgreSQL's COPY as a relay's database writes them: their
    columns given as "(a, b)", or all."""
    connection = node.engine.raw_connection()
    try:
        with connection.cursor() as cursor:
            cursor.execute(f"CREATE TEMPORARY TABLE batch OF {row_type}")
            psycopg2.extras.execute_values(cursor, "INSERT INTO batch VALUES %s", rows)
            encoded = io.BytesIO()
            cursor.copy_expert(f"COPY batch {columns} TO STDOUT (FORMAT binary)", encoded)
        connection.rollback()
    finally:
        connection.close()
    return encoded.getvalue()


def _signed(secret, sender_instance, node, body: bytes) -> dict[str, str]:
    """The headers of a batch request to node, as a peer with sender_instance signs it."""
    purpose = signing.request_purpose("POST", signing.BATCHES_PATH, wire.BATCH_MEDIA_TYPE, str(node.instance))
    signed = signing.signed_headers(secret, str(sender_instance), purpose, body)
    return {"Content-Type": wire.BATCH_MEDIA_TYPE, **signed}


def _post(node, sender, body: bytes, *, secret=SECRET, headers=None):
    return httpx.post(f"{node.address}/transport/v1/batches", content=body,
                      headers={**_signed(secret, sender.instance, node, body), **(headers or {})}, timeout=30)


def _stored(node):
    with node.engine.connect() as c:
        return c.execute(text("SELECT message_sequence_number, convert_from(body, 'UTF8') FROM broker.queue_messages"
                              " ORDER BY message_sequence_number")).all()


def test_duplicated_reordered_and_gapped_batches_store_each_message_once_in_order(nodes):
    a, b = nodes
    conversation = uuid.uuid4()
    first = _post(b, a, _encode(b, _batch(conversation, [2, 1, 1, 3, 5])))
    assert first.status_code == 200
    assert first.json()["results"][0]["acknowledged"] == 3  # 5 is past a gap: refused, to be resent
    body = _encode(b, _batch(conversation, [1, 2, 3, 4, 5]))
    assert _post(b, a, body).json()["results"][0]["acknowledged"] == 5
    replay = _post(b, a, body)  # the same request again
    assert replay.json()["results"][0]["acknowledged"] == 5
    assert [tuple(r) for r in _stored(b)] == [(n, str(n)) for n in range(1, 6)]
    signing.matching_secret([SECRET], first.headers[signing.TIMESTAMP_HEADER], first.headers[signing.SIGNATURE_HEADER],
                            signing.answer_purpose(first.request.headers[signing.SIGNATURE_HEADER]), first.content)


def test_of_a_number_repeated_in_a_batch_the_first_is_kept(nodes):
    a, b = nodes
    conversation = uuid.uuid4()
    rows = [*_batch(conversation, [1], body=b"first"), *_batch(conversation, [2, 1], body=b"second")]
    assert _post(b, a, _encode(b, rows)).json()["results"][0]["acknowledged"] == 2
    assert [tuple(r) for r in _stored(b)] == [(1, "first"), (2, "second")]


def test_one_bad_conversation_does_not_spoil_the_batch(nodes):
    a, b = nodes
    good, unknown, invalid = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    batch = (_batch(good, [1]) + _batch(unknown, [1], to_service="nobody")
             + _batch(invalid, [1], message_type="order.submit", body=b"{oops"))
    answer = _post(b, a, _encode(b, batch)).json()
    results = {r["conversation_id"]: r for r in answer["results"]}
    assert results[str(good)]["acknowledged"] == 1 and "refused" not in results[str(good)]
    assert results[str(unknown)]["refused"]["sqlstate"] == "BR001"
    assert results[str(invalid)]["refused"]["sqlstate"] == "BR012"
    assert [tuple(r) for r in _stored(b)] == [(1, "1")]


@pytest.mark.parametrize("tamper,reason", [
    (lambda body: {signing.SIGNATURE_HEADER: "0" * 64}, "does not match"),
    (lambda body: {signing.TIMESTAMP_HEADER: str(int(time.time()) - 3600)}, "away from this node's clock"),
    (lambda body: {signing.SIGNATURE_HEADER: ""}, "not signed"),
], ids=["wrong signature", "stale timestamp", "unsigned"])
def test_requests_not_signed_by_a_known_peer_are_refused(shared_nodes, tamper, reason):
    a, b = shared_nodes
    body = _encode(b, _batch(uuid.uuid4(), [1]))
    response = _post(b, a, body, headers=tamper(body))
    assert response.status_code == 401
    assert response.headers["content-type"] == "application/problem+json"
    assert response.json()["type"] == "/problems/bad-signature" and reason in response.json()["detail"]
    assert _stored(b) == []


def test_a_body_truncated_after_signing_is_refused(shared_nodes):
    a, b = shared_nodes
    body = _encode(b, _batch(uuid.uuid4(), [1, 2, 3]))
    response = httpx.post(f"{b.address}/transport/v1/batches", content=body[:-10],
                          headers=_signed(SECRET, a.instance, b, body))
    assert response.status_code == 401
    assert _stored(b) == []


def test_a_request_from_an_unknown_instance_or_with_the_wrong_secret_is_refused(shared_nodes):
    a, b = shared_nodes
    body = _encode(b, _batch(uuid.uuid4(), [1]))
    assert _post(b, a, body, secret="some-other-secret-value").status_code == 401
    stranger = httpx.post(f"{b.address}/transport/v1/batches", content=body,
                          headers=_signed(SECRET, uuid.uuid4(), b, body))
    assert stranger.status_code == 401
    assert _stored(b) == []


def test_a_peer_whose_route_is_dropped_is_refused_at_once(nodes):
    """The node lets a peer it found routed in without a query for a second; a route dropped meanwhile
    takes its secret with it, so the very next batch is refused all the same."""
    a, b = nodes
    first = _post(b, a, _encode(b, _batch(uuid.uuid4(), [1])))
    assert first.status_code == 200
    with b.engine.begin() as c:
        broker.drop_route(c, "shop")
    refused = _post(b, a, _encode(b, _batch(uuid.uuid4(), [1])))
    assert refused.status_code == 401
    assert refused.json()["type"] in ("/problems/bad-signature", "/problems/unknown-peer")
    assert len(_stored(b)) == 1


@pytest.mark.parametrize("malformed", [
    lambda b: b"{not json",
    lambda b: b"",
    lambda b: _encode(b, _batch(uuid.uuid4(), [1, 2, 3]))[:-40],
    lambda b: _encode(b, [(str(uuid.uuid4()), str(uuid.uuid4()), True, 1, 1, str(uuid.uuid4()), 1)],
                      "broker._batch_conversation"),
    lambda b: _encode(b, [(str(uuid.uuid4()), True, "shop", "warehouse", "orders", None, None, None, "order.note",
                           b"1")]),
], ids=["not COPY", "empty", "truncated", "other columns", "no sequence number"])
def test_malformed_batches_get_a_problem_and_store_nothing(shared_nodes, malformed):
    a, b = shared_nodes
    response = _post(b, a, malformed(b))
    assert response.status_code == 400
    assert response.json()["type"] == "/problems/malformed-batch"
    assert _stored(b) == []


def test_a_huge_body_from_a_peer_gets_413(shared_nodes):
    a, b = shared_nodes
    response = _post(b, a, b"x" * (65 * 1024 * 1024))
    assert response.status_code == 413
    assert response.json()["type"] == "/problems/too-large"


def test_nodes_serve_tls_and_a_relay_refuses_a_peer_it_cannot_verify(tls_nodes):
    a, b = tls_nodes
    with a.engine.begin() as c:
        handle = broker.begin_dialog(c, "shop", "warehouse", "orders")
        broker.send(c, handle, "order.note", "over TLS")
    [message] = b.receive_all("warehouse_queue", 1)
    assert message.body == b"over TLS"
    with b.engine.begin() as c:
        broker.send(c, message.conversation_handle, "order.note", "reply")
    status = wait_for(lambda: b.scalar("SELECT min(transmission_status) FROM broker.transmission_queue_status"
                                       " WHERE attempts > 0"), 15, "b's failed attempt to be recorded")
    assert "CERTIFICATE_VERIFY_FAILED" in status
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{b.port}/healthz", timeout=2)  # plain HTTP to the TLS port


def _forgotten_now(node) -> int:
    """The endpoints the node holds once it has forgotten those closed past their retention, as its relay does every
    minute."""
    with node.engine.begin() as c:
        c.execute(text("SELECT broker.forget_closed_endpoints()"))
        return c.execute(text("SELECT count(*) FROM broker.endpoints")).scalar_one()


def test_a_forgotten_conversation_sent_again_is_acknowledged_not_reopened(nodes):
    """The peer's first messages arrive again after both sides closed and forgot: a retry after an outage."""
    a, b = nodes
    for node in nodes:
        with node.engine.begin() as c:
            c.execute(text("UPDATE broker.node SET closed_endpoint_retention = '0'"))
    with a.engine.begin() as c:
        handle = broker.begin_dialog(c, "shop", "warehouse", "orders")
        broker.send(c, handle, "order.note", "once")
        broker.end_conversation(c, handle)
        conversation = c.execute(text("SELECT conversation_id FROM broker.endpoints")).scalar_one()
    wait_for(lambda: b.scalar("SELECT count(*) FROM broker.queue_messages") == 2, 30, "b to get the conversation")
    with b.engine.begin() as c:
        messages = broker.receive(c, "warehouse_queue", 10)
        broker.end_conversation(c, messages[0].conversation_handle)
    # Each side forgets its endpoint as it closes or as its last message is acknowledged, whichever comes last; when
    # the two commit at once, neither sees the other and the relay's sweep, every minute, forgets it: swept here.
    for node in nodes:
        wait_for(lambda: _forgotten_now(node) == 0, 30, "both sides to forget")
    assert b.scalar("SELECT count(*) FROM broker.forgotten_conversations") == 1

    replay = _batch(conversation, [1], body=b"once")
    replay.append((str(conversation), True, "shop", "warehouse", "orders", None, 2, message_id(conversation, 2),
                   "broker.end_dialog", None))
    answer = _post(b, a, _encode(b, replay))
    assert answer.status_code == 200 and answer.json()["results"][0]["acknowledged"] == 2
    assert b.scalar("SELECT count(*) FROM broker.endpoints") == 0
    assert _stored(b) == []


def test_a_conversation_unknown_here_is_opened_only_from_its_first_number(nodes):
    """Its first messages are missing here (this database went back): recorded, answered as waiting, and taken
    once they are sent again; a broker.error across the numbers its sender dropped still opens it."""
    a, b = nodes
    conversation = uuid.uuid4()
    answer = _post(b, a, _encode(b, _batch(conversation, [5, 6]))).json()["results"][0]
    assert (answer["acknowledged"], answer["held"]) == (0, 0)
    assert "messages 1 to 4 of the conversation are missing here" in answer["waiting"]
    assert b.scalar("SELECT count(*) FROM broker.endpoints") == 0
    missing = "SELECT outcome FROM broker.lost_messages WHERE direction = 'received' AND first_number = 1"
    assert b.scalar(missing + " AND last_number = 4") == "missing"

    assert _post(b, a, _encode(b, _batch(conversation, range(1, 7)))).json()["results"][0]["acknowledged"] == 6
    assert [n for n, _ in _stored(b)] == [1, 2, 3, 4, 5, 6]
    assert b.scalar(missing) == "resent"

    ended = uuid.uuid4()
    error = _batch(ended, [3], message_type="broker.error", body=b'{"code": 7, "description": "cancelled"}')
    assert _post(b, a, _encode(b, error)).json()["results"][0]["acknowledged"] == 3
    assert b.scalar("SELECT state FROM broker.endpoints WHERE conversation_id = :c", c=ended) == "error"


def test_accepting_a_batch_never_waits_for_a_conversation_an_application_holds(nodes):
    """An application on b holds one conversation (it sent on it) while a's batch for two arrives: the other is
    taken at once, the held one waits without a deadlock, and it arrives once the application commits."""
    a, b = nodes
    with a.engine.begin() as c:  # two in the same relay lane, so that one batch carries both
        begun = [broker.begin_dialog(c, "shop", "warehouse", "orders") for _ in range(5)]
        handles = [h for h in begun if h.hex[0] < "8"][:2] if sum(h.hex[0] < "8" for h in begun) >= 2 else \
                  [h for h in begun if h.hex[0] >= "8"][:2]
        for handle in handles:
            broker.send(c, handle, "order.note", "first")
    arrived = {m.conversation_id: m.conversation_handle for m in b.receive_all("warehouse_queue", 2)}
    held, free = sorted(arrived)  # the application holds the one whose id comes first, which the batch locks first
    with b.engine.connect() as application:
        transaction = application.begin()
        broker.send(application, arrived[held], "order.note", "a reply, not committed yet")
        with a.engine.begin() as c:
            for handle in handles:
                broker.send(c, handle, "order.note", "second")
        [other] = b.receive_all("warehouse_queue", 1)
        assert (other.conversation_id, other.body) == (free, b"second")
        wait_for(lambda: "an application transaction holds the conversation here" in a.scalar(
            "SELECT string_agg(transmission_status, ' ') FROM broker.transmission_queue_status"), 30,
            "a to say that the conversation waits")
        for _ in range(20):  # and the node's own sessions never wait for the application's lock meanwhile
            assert b.scalar("SELECT count(*) FROM pg_stat_activity"
                            " WHERE datname = current_database() AND wait_event_type = 'Lock'") == 0
            time.sleep(0.05)
        broker.send(application, arrived[free], "order.note", "another reply")  # locks the other one too
        transaction.commit()
    [last] = b.receive_all("warehouse_queue", 1)
    assert (last.conversation_id, last.body) == (held, b"second")
    assert "deadlock" not in b.log.read_text()


def test_messages_that_waited_longer_than_the_peer_remembers_are_withheld_not_sent_as_new(nodes):
    """A message a has held unacknowledged for longer than b keeps its tombstones might open a conversation that b
    ended and forgot.  a stops that conversation instead, says so, and tells b: b, which was only down, takes the
    error across the numbers withheld rather than waiting for them for ever."""
    from tests.integration.test_diagnose import _diagnose

    a, b = nodes
    with a.engine.begin() as c:
        handle = broker.begin_dialog(c, "shop", "warehouse", "orders")
        broker.send(c, handle, "order.note", "delivered")
    b.receive_all("warehouse_queue", 1)
    wait_for(lambda: a.scalar("SELECT count(*) FROM broker.transmission_queue_status") == 0, 30, "the acknowledgement")
    assert a.scalar("SELECT tombstone_retention FROM broker.peer_retention WHERE broker_instance = :b",
                    b=b.instance) == timedelta(days=90)
    b.stop()
    with a.engine.begin() as c:
        for body in ("held back", "and this"):
            broker.send(c, handle, "order.note", body)
        c.execute(text("UPDATE broker.transmission_log SET enqueued_at = now() - interval '90 days'"))
    with a.engine.begin() as c:
        assert c.execute(text("SELECT broker.withhold_what_peers_forgot()")).scalar_one() == 1
    assert a.scalar("SELECT string_agg(message_type, ',') FROM broker.transmission_queue_status") == "broker.error"
    with a.engine.connect() as c:
        letters = c.execute(text("SELECT message_sequence_number, convert_from(body, 'UTF8'), reason, queue_position"
                                 " FROM broker.dead_letters ORDER BY 1")).all()
    assert [(n, body, position) for n, body, _, position in letters] == [(2, "held back", 0), (3, "and this", 0)]
    assert "waited longer than the far node remembers ended conversations" in letters[0][2]
    with a.engine.begin() as c:
        [notice] = broker.receive(c, "shop_queue", 10)
    assert notice.message_type == "broker.error" and notice.json()["code"] == -5
    code, findings = _diagnose(a)
    assert code == 1
    [withheld] = [f for f in findings if f["check"].startswith("conversation ")]
    assert withheld["level"] == "error" and "messages 2 to 3 waited longer" in withheld["finding"]
    b.start()
    [error] = b.receive_all("warehouse_queue", 1, timeout_s=60)
    assert error.message_type == "broker.error" and error.json()["code"] == -5
    assert "messages 2 to 3 were not sent" in error.json()["description"]
    assert b.scalar("SELECT state FROM broker.endpoints WHERE conversation_id = :id", id=error.conversation_id) == "error"


def test_a_peer_never_heard_from_is_taken_to_forget_after_the_shortest_retention_a_node_keeps(engine):
    """None of the peer's answers came back, so its tombstone_retention is not known: it may keep a day, the least a
    node keeps, and what waited longer than that (less the margin) is withheld."""
    with engine.begin() as c:
        for name, validation in MESSAGE_TYPES:
            broker.create_message_type(c, name, validation)
        broker.create_contract(c, "orders", CONTRACTS["orders"])
        broker.create_queue(c, "shop_queue")
        broker.create_service(c, "shop", "shop_queue")
        broker.create_route(c, "warehouse", "http://warehouse.invalid", uuid.uuid4(), SECRET)
        handle = broker.begin_dialog(c, "shop", "warehouse", "orders")
        broker.send(c, handle, "order.note", "sent when the peer was new")
    withhold = text("SELECT broker.withhold_what_peers_forgot()")
    with engine.begin() as c:
        c.execute(text("UPDATE broker.transmission_log SET enqueued_at = now() - interval '22 hours 50 minutes'"))
        assert c.execute(withhold).scalar_one() == 0
        c.execute(text("UPDATE broker.transmission_log SET enqueued_at = now() - interval '23 hours 10 minutes'"))
        assert c.execute(withhold).scalar_one() == 1
        [notice] = broker.receive(c, "shop_queue", 10)
    assert notice.message_type == "broker.error" and notice.json()["code"] == -5
    assert "tombstone_retention, 1 day" in notice.json()["description"]
    with engine.connect() as c:
        assert c.execute(text("SELECT count(*) FROM broker.dead_letters")).scalar_one() == 1


def test_a_peer_whose_answers_were_all_lost_gets_no_duplicates_after_it_forgot(nodes):
    """Every answer of a new peer is lost on the way back: b took the messages, its application replied and ended,
    b forgot the conversations; b is down, two days pass, b is back.  a never heard b's retention, so it takes b to
    keep the least a node keeps (a day): it withholds what waited longer, and b's application gets nothing twice."""
    a, b = nodes
    answers_lost = ChaosProxy(b.port, 0, cut_request=0, drop_response=1, delay=0)
    with a.engine.begin() as c:
        broker.drop_route(c, "warehouse")
        broker.create_route(c, "warehouse", answers_lost.address, b.instance, SECRET)
    with b.engine.begin() as c:
        c.execute(text("UPDATE broker.node SET tombstone_retention = '1 day', closed_endpoint_retention = '0'"))
    with a.engine.begin() as c:
        handles = [broker.begin_dialog(c, "shop", "warehouse", "orders") for _ in range(4)]
        for handle in handles:
            for n in range(5):
                broker.send(c, handle, "order.note", f"note {n}")
    arrived = b.receive_all("warehouse_queue", 20)
    with b.engine.begin() as c:
        for conversation in {m.conversation_handle for m in arrived}:
            broker.send(c, conversation, "order.note", "thanks")
            broker.end_conversation(c, conversation)
    wait_for(lambda: a.scalar("SELECT count(*) FROM broker.queue_messages") == 8, 30, "b's replies and ends at a")
    b.stop()
    with b.engine.begin() as c:  # two days on, b has forgotten the conversations
        c.execute(text("UPDATE broker.forgotten_conversations SET forgotten_at = now() - interval '2 days'"))
        c.execute(text("SELECT broker.forget_closed_endpoints()"))
        assert c.execute(text("SELECT count(*) FROM broker.forgotten_conversations")).scalar_one() == 0
    assert a.scalar("SELECT count(*) FROM broker.peer_retention") == 0
    assert a.scalar("SELECT count(*) FROM broker.transmission_queue_status") == 20  # not one answer came back
    with a.engine.begin() as c:
        c.execute(text("UPDATE broker.transmission_log SET enqueued_at = now() - interval '2 days'"))
        assert c.execute(text("SELECT broker.withhold_what_peers_forgot()")).scalar_one() == 4
    answers_lost.enabled = False
    b.start()
    wait_for(lambda: a.scalar("SELECT count(*) FROM broker.transmission_queue_status") == 0, 60,
             "b to acknowledge the errors")
    with b.engine.begin() as c:
        again = broker.receive(c, "warehouse_queue", 100, wait_ms=1000)
    assert [m for m in again if m.message_type == "order.note"] == []
    assert b.scalar("SELECT count(*) FROM broker.endpoints WHERE state = 'conversing'") == 0
    assert a.scalar("SELECT count(*) FROM broker.dead_letters WHERE queue_position = 0") == 20


def test_a_probe_of_an_old_acknowledged_message_is_asked_now_and_never_withheld(nodes):
    """The relay asks a quiet peer again for the last number it acknowledged (broker.probe_conversation).  The
    question is new, however old its message: while the peer is down it waits like any message sent now, and is not
    withheld as one that waited longer than the peer remembers; once the peer is back it acknowledges a duplicate."""
    a, b = nodes
    with b.engine.begin() as c:
        c.execute(text("UPDATE broker.node SET tombstone_retention = '1 day'"))
    with a.engine.begin() as c:
        handle = broker.begin_dialog(c, "shop", "warehouse", "orders")
        broker.send(c, handle, "order.note", "acknowledged a day ago")
    b.receive_all("warehouse_queue", 1)
    wait_for(lambda: a.scalar("SELECT count(*) FROM broker.transmission_queue_status") == 0, 30, "the acknowledgement")
    b.stop()
    with a.engine.begin() as c:
        c.execute(text("UPDATE broker.transmission_log SET enqueued_at = now() - interval '23 hours 30 minutes'"))
        conversation = c.execute(text("SELECT conversation_id FROM broker.endpoints WHERE conversation_handle = :h"),
                                 {"h": handle}).scalar_one()
        assert c.execute(text("SELECT broker.probe_conversation(:c, true)"), {"c": conversation}).scalar_one() == 1
        assert c.execute(text("SELECT broker.withhold_what_peers_forgot()")).scalar_one() == 0
    assert a.scalar("SELECT state FROM broker.endpoints WHERE conversation_handle = :h", h=handle) == "conversing"
    b.start()
    wait_for(lambda: a.scalar("SELECT count(*) FROM broker.transmission_retries") == 0, 30,
             "the duplicate's acknowledgement")
    assert a.scalar("SELECT count(*) FROM broker.transmission_log") == 1
    assert a.scalar("SELECT count(*) FROM broker.lost_messages") == 0
    with b.engine.begin() as c:
        assert broker.receive(c, "warehouse_queue", 10) == []
