"""Peers are kept apart: a peer holding a valid route and secret of its own can touch only its own
conversations, open conversations only from services routed to it, and neither its answers nor
requests captured on their way to one node count for anything else."""
import json
import uuid

import httpx
import pytest
from sqlalchemy import create_engine, text

import broker
from broker.transport import signing, wire
from tests.conftest import _fresh_database
from tests.nodes import SECRET, Node, define_node, wait_for
from tests.peers import ScriptedPeer, json_answer
from tests.integration.test_transport import _encode, message_id

ROGUE_SECRET = "the-rogue-peers-own-secret"
NOT_LISTENING = "http://127.0.0.1:9"


def _signed_request(secret: str, sender, destination, path: str, body: bytes, media_type: str | None = None
                    ) -> dict[str, str]:
    """The headers a node puts on a request to the node whose broker_instance is destination: with the media
    type that the endpoint takes, unless another is given."""
    media_type = media_type or (wire.BATCH_MEDIA_TYPE if path == signing.BATCHES_PATH else wire.JSON_MEDIA_TYPE)
    purpose = signing.request_purpose("POST", path, media_type, str(destination))
    return {"Content-Type": media_type, **signing.signed_headers(secret, str(sender), purpose, body)}


def _signed_answer(secret: str, instance: str, request_headers, body: bytes) -> dict[str, str]:
    """The headers a node puts on its answer to the request with request_headers."""
    return signing.signed_headers(secret, instance, signing.answer_purpose(request_headers[signing.SIGNATURE_HEADER]),
                                  body)


def _route_rogue(b):
    """A second peer of b: its own broker_instance and secret, and a route on b to its service 'rogue'."""
    instance = uuid.uuid4()
    with b.engine.begin() as c:
        broker.create_route(c, "rogue", NOT_LISTENING, instance, ROGUE_SECRET)
    return instance


@pytest.fixture
def rogue(nodes):
    return _route_rogue(nodes[1])


@pytest.fixture(scope="module")
def shared_rogue(shared_nodes):
    return _route_rogue(shared_nodes[1])


def _rows(conversation_id, numbers, *, sender_is_initiator=True, from_service="shop", to_service="warehouse",
          message_type="order.note"):
    """Messages of one conversation as rows of broker.wire_message."""
    return [(str(conversation_id), sender_is_initiator, from_service, to_service, "orders", None, n,
             message_id(conversation_id, n), message_type, json.dumps({"line": n}).encode()) for n in numbers]


def _post_as_rogue(b, rogue, rows) -> dict:
    """Posts a batch to b as the rogue peer, signed with its own valid secret; returns b's results by conversation."""
    body = _encode(b, rows)
    response = httpx.post(f"{b.address}{signing.BATCHES_PATH}", content=body, timeout=30,
                          headers=_signed_request(ROGUE_SECRET, rogue, b.instance, signing.BATCHES_PATH, body))
    assert response.status_code == 200, response.text
    return {(r["conversation_id"], r["sender_is_initiator"]): r for r in response.json()["results"]}


def _state(node):
    """What a peer must not change: every endpoint with its state and numbers, the stored messages, the tombstones."""
    with node.engine.connect() as c:
        endpoints = c.execute(text("SELECT conversation_handle, conversation_id, is_initiator, state, receive_sequence,"
                                   " far_broker_instance FROM broker.endpoints ORDER BY 1")).all()
        messages = c.execute(text("SELECT queue_position, message_sequence_number, message_type_id"
                                  " FROM broker.queue_messages ORDER BY 1")).all()
        tombstones = c.execute(text("SELECT * FROM broker.forgotten_conversations ORDER BY 1, 2")).all()
    return endpoints, messages, tombstones


def _conversation_id(node, handle):
    return node.scalar("SELECT conversation_id FROM broker.endpoints WHERE conversation_handle = :h", h=handle)


def _arrived(node, conversation):
    return node.scalar("SELECT count(*) FROM broker.queue_messages WHERE conversation_id = :c", c=conversation)


def _a_to_b(a, b, messages=2):
    """A conversation from a's shop to b's warehouse with its first messages arrived at b; its conversation id."""
    with a.engine.begin() as c:
        handle = broker.begin_dialog(c, "shop", "warehouse", "orders")
        for n in range(1, messages + 1):
            broker.send(c, handle, "order.note", json.dumps({"line": n}))
    conversation = _conversation_id(a, handle)
    wait_for(lambda: _arrived(b, conversation) == messages, 30, "b to get them")
    return conversation


def _b_to_a(a, b):
    with b.engine.begin() as c:
        handle = broker.begin_dialog(c, "warehouse", "shop", "orders")
        broker.send(c, handle, "order.note", "{}")
    conversation = _conversation_id(b, handle)
    wait_for(lambda: _arrived(a, conversation) == 1, 30, "a to get it")
    return conversation


def _local_at_b(a, b):
    with b.engine.begin() as c:
        handle = broker.begin_dialog(c, "warehouse", "warehouse", "orders")
        broker.send(c, handle, "order.note", "{}")
    return _conversation_id(b, handle)


def _forgotten_at_b(a, b):
    """A conversation from a that both sides closed and forgot: b keeps its tombstone, for a."""
    for node in (a, b):
        with node.engine.begin() as c:
            c.execute(text("UPDATE broker.node SET closed_endpoint_retention = '0'"))
    conversation = _a_to_b(a, b, messages=1)
    handle = "SELECT conversation_handle FROM broker.endpoints WHERE conversation_id = :c"
    with a.engine.begin() as c:
        broker.end_conversation(c, c.execute(text(handle), {"c": conversation}).scalar_one())
    wait_for(lambda: _arrived(b, conversation) == 2, 30, "b to get the end")
    with b.engine.begin() as c:
        at_b = c.execute(text(handle), {"c": conversation}).scalar_one()
        assert len(broker.receive(c, "warehouse_queue", 10, conversation_handle=at_b)) == 2
        broker.end_conversation(c, at_b)
    for node in (a, b):
        wait_for(lambda: node.scalar("SELECT count(*) FROM broker.endpoints WHERE conversation_id = :c",
                                     c=conversation) == 0, 30, f"{node.name} to forget")
    return conversation


# (how the conversation comes to be known at b, the side the rogue peer claims to speak for)
FOREIGN = {
    "a's conversation, as its initiator": (_a_to_b, True),
    "a's conversation, as its target": (_a_to_b, False),
    "b's conversation with a, as its target": (_b_to_a, False),
    "b's conversation with a, as its initiator": (_b_to_a, True),
    "b's local conversation, as its initiator": (_local_at_b, True),
    "b's local conversation, as its target": (_local_at_b, False),
    "a's forgotten conversation, as its initiator": (_forgotten_at_b, True),
}


@pytest.mark.parametrize("known,sender_is_initiator", FOREIGN.values(), ids=FOREIGN.keys())
@pytest.mark.parametrize("message_type", ["order.note", "broker.end_dialog"])
def test_a_peer_cannot_touch_a_conversation_that_is_not_its_own(shared_nodes, shared_rogue, known,
                                                                 sender_is_initiator, message_type):
    a, b = shared_nodes
    conversation = known(a, b)
    before = _state(b)
    results = _post_as_rogue(b, shared_rogue, _rows(conversation, [1, 2, 3], sender_is_initiator=sender_is_initiator,
                                             message_type=message_type))
    # refused as unknown, as a conversation that does not exist is: no number, no state told
    assert results == {(str(conversation), sender_is_initiator): {
        "conversation_id": str(conversation), "sender_is_initiator": sender_is_initiator, "acknowledged": 0,
        "refused": {"sqlstate": "BR005", "reason": f"unknown conversation {conversation}"}}}
    assert _state(b) == before


def test_the_conversation_a_peer_meddled_with_goes_on_with_its_own_peer(nodes, rogue):
    a, b = nodes
    conversation = _a_to_b(a, b)
    _post_as_rogue(b, rogue, _rows(conversation, [3], message_type="broker.end_dialog"))
    with a.engine.begin() as c:
        broker.send(c, c.execute(text("SELECT conversation_handle FROM broker.endpoints")).scalar_one(),
                    "order.note", json.dumps({"line": 3}))
    at_b = b.receive_all("warehouse_queue", 3)
    assert [(m.message_sequence_number, m.message_type, m.json()) for m in at_b] == [
        (n, "order.note", {"line": n}) for n in (1, 2, 3)]
    assert b.scalar("SELECT state FROM broker.endpoints") == "conversing"
    wait_for(lambda: a.scalar("SELECT count(*) FROM broker.transmission_queue_status") == 0, 30, "a's queue to drain")


@pytest.mark.parametrize("message_type", ["order.note", "order.submit", "broker.end_dialog"])
def test_a_peer_opens_conversations_only_from_services_routed_to_it(shared_nodes, shared_rogue, message_type):
    """order.note is opened in bulk, order.submit (validated) and broker.end_dialog one by one."""
    a, b = shared_nodes
    posing_as_a, unrouted, its_own = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    results = _post_as_rogue(b, shared_rogue, _rows(posing_as_a, [1], from_service="shop", message_type=message_type)
                             + _rows(unrouted, [1], from_service="nobody", message_type=message_type)
                             + _rows(its_own, [1], from_service="rogue", message_type=message_type))
    for refused in (posing_as_a, unrouted):
        result = results[(str(refused), True)]
        assert result["refused"]["sqlstate"] == "BR006" and "broker instance" in result["refused"]["reason"]
        assert b.scalar("SELECT count(*) FROM broker.endpoints WHERE conversation_id = :c", c=refused) == 0
    assert results[(str(its_own), True)]["acknowledged"] == 1 and "refused" not in results[(str(its_own), True)]
    assert b.scalar("SELECT far_service FROM broker.endpoints WHERE conversation_id = :c", c=its_own) == "rogue"
    assert b.scalar("SELECT count(*) FROM broker.queue_messages WHERE conversation_id = :c", c=its_own) == 1


@pytest.mark.parametrize("message_type", ["order.note", "order.submit"])
def test_a_conversation_whose_lifetime_ends_past_the_year_9999_is_refused_and_opens_nothing(shared_nodes, shared_rogue,
                                                                                           message_type):
    """No client's datetime reads such a time back (status and lists would fail on it): a peer that sends one, as a
    release before this one could, has the conversation refused (BR050), in bulk (order.note) or one by one."""
    _, b = shared_nodes
    conversation = uuid.uuid4()
    [row] = _rows(conversation, [1], from_service="rogue", message_type=message_type)
    ending = "9999-12-31T23:59:59-14:00"  # the year 10000 in UTC
    result = _post_as_rogue(b, shared_rogue, [row[:5] + (ending,) + row[6:]])[(str(conversation), True)]
    assert result["refused"]["sqlstate"] == "BR050" and "before the year 10000" in result["refused"]["reason"]
    assert b.scalar("SELECT count(*) FROM broker.endpoints WHERE conversation_id = :c", c=conversation) == 0


# The relay's side: what a peer answers applies only to the batch it answers.


@pytest.mark.parametrize("verdict", [{"acknowledged": 3}, {"acknowledged": 3, "refused": {"sqlstate": "BR011",
                                     "reason": "refused by the rogue"}}, {"acknowledged": 0, "waiting": "not now"}],
                         ids=["acknowledged", "refused", "held back"])
def test_a_peers_answer_cannot_settle_another_peers_conversation(nodes, verdict):
    a, b = nodes
    b.stop()  # b's messages wait in a's transmission queue
    instance = str(uuid.uuid4())
    forged = []

    def answer(request):
        content = json.dumps({"broker_instance": instance, "results": forged}).encode()
        return 200, _signed_answer(ROGUE_SECRET, instance, request.headers, content), content

    peer = ScriptedPeer(answer)
    try:
        with a.engine.begin() as c:
            broker.create_route(c, "rogue", peer.address, instance, ROGUE_SECRET)
        with a.engine.begin() as c:
            for_b = broker.begin_dialog(c, "shop", "warehouse", "orders")
            for n in (1, 2, 3):
                broker.send(c, for_b, "order.note", json.dumps({"line": n}))
            for_rogue = broker.begin_dialog(c, "shop", "rogue", "orders")
            broker.send(c, for_rogue, "order.note", "{}")
            ids = dict(c.execute(text("SELECT conversation_handle, conversation_id::text FROM broker.endpoints")).all())
            forged += [{"conversation_id": ids[for_rogue], "sender_is_initiator": True, "acknowledged": 1},
                       {"conversation_id": ids[for_b], "sender_is_initiator": True, **verdict}]
        wait_for(lambda: a.scalar("SELECT count(*) FROM broker.transmission_queue_status"
                                  " WHERE conversation_handle = :h", h=for_rogue) == 0, 30,
                 "the rogue's answer for its own conversation to be applied")
    finally:
        peer.close()
    with a.engine.connect() as c:
        waiting = c.execute(text("SELECT message_sequence_number, transmission_status FROM broker.transmission_queue_status"
                                 " WHERE conversation_handle = :h ORDER BY 1"), {"h": for_b}).all()
    assert [n for n, _ in waiting] == [1, 2, 3]
    assert not any("holds it back" in (status or "") for _, status in waiting)
    assert a.scalar("SELECT state FROM broker.endpoints WHERE conversation_handle = :h", h=for_b) == "conversing"
    b.start()
    assert [(m.message_sequence_number, m.json()) for m in b.receive_all("warehouse_queue", 3)] == [
        (n, {"line": n}) for n in (1, 2, 3)]


@pytest.mark.parametrize("results", [[{"conversation_id": "not a conversation"}], "not a list", [["not", "an object"]]],
                         ids=["bad conversation id", "results not a list", "result not an object"])
def test_a_malformed_answer_is_a_failure_of_that_peer_alone(nodes, results):
    a, b = nodes
    instance = str(uuid.uuid4())

    def answer(request):
        content = json.dumps({"broker_instance": instance, "results": results}).encode()
        return 200, _signed_answer(ROGUE_SECRET, instance, request.headers, content), content

    peer = ScriptedPeer(answer)
    try:
        with a.engine.begin() as c:
            broker.create_route(c, "rogue", peer.address, instance, ROGUE_SECRET)
            broker.send(c, broker.begin_dialog(c, "shop", "rogue", "orders"), "order.note", "{}")
        status = wait_for(lambda: a.scalar("SELECT min(transmission_status) FROM broker.transmission_queue_status"
                                           " WHERE to_service = 'rogue' AND attempts > 0"), 30,
                          "the malformed answer to be recorded as a failure")
        assert f"the answer from {peer.address} is malformed" in status
        _a_to_b(a, b, messages=3)  # the other peer's conversations go on
    finally:
        peer.close()


def test_an_answer_counts_only_for_the_request_it_answers(nodes):
    """Between a and b, something replays b's signed answer to an earlier batch for every later one."""
    a, b = nodes
    first_answer = []

    def replay(request):
        if request.method == "GET":  # the relay asks which wire versions b takes
            return json_answer(200, httpx.get(f"{b.address}/healthz", timeout=5).json())
        if first_answer:
            return first_answer[0]
        forwarded = httpx.post(f"{b.address}{signing.BATCHES_PATH}", content=request.body, timeout=30,
                               headers={name: value for name, value in request.headers.items()
                                        if name.startswith("X-Broker") or name.lower() == "content-type"})
        first_answer.append((forwarded.status_code, {name: value for name, value in forwarded.headers.items()
                                                     if name.lower().startswith("x-broker")}, forwarded.content))
        return first_answer[0]

    proxy = ScriptedPeer(replay)
    try:
        with a.engine.begin() as c:
            broker.drop_route(c, "warehouse")
            broker.create_route(c, "warehouse", proxy.address, b.instance, SECRET)
            handle = broker.begin_dialog(c, "shop", "warehouse", "orders")
            broker.send(c, handle, "order.note", json.dumps({"line": 1}))
        wait_for(lambda: a.scalar("SELECT count(*) FROM broker.transmission_queue_status") == 0, 30, "the first answer")
        with a.engine.begin() as c:
            broker.send(c, handle, "order.note", json.dumps({"line": 2}))
        status = wait_for(lambda: a.scalar("SELECT min(transmission_status) FROM broker.transmission_queue_status"
                                           " WHERE attempts > 0"), 30, "the replayed answer to be refused")
        assert "not signed by the peer" in status
    finally:
        proxy.close()
    with a.engine.begin() as c:
        broker.drop_route(c, "warehouse")
        broker.create_route(c, "warehouse", b.address, b.instance, SECRET)
    assert [m.message_sequence_number for m in b.receive_all("warehouse_queue", 2, timeout_s=60)] == [1, 2]


# What a request is signed for: the method, the endpoint and the node it goes to.


@pytest.fixture
def third_node(nodes, admin_url, template_database, tmp_path):
    """Node c: like b, and sharing a's secret, with a route to a's shop."""
    a, _ = nodes
    database = _fresh_database(admin_url, template_database)
    url = next(database)
    engine = create_engine(url)
    with engine.begin() as c:  # an instance of its own, unlike a copy of the template
        c.execute(text("UPDATE broker.node SET broker_instance = gen_random_uuid()"))
    engine.dispose()
    c_node = Node("c", url, tmp_path)
    define_node(c_node, "warehouse_queue", "warehouse")
    with c_node.engine.begin() as c:
        broker.create_route(c, "shop", a.address, a.instance, SECRET)
    c_node.start()
    yield c_node
    c_node.stop()
    c_node.engine.dispose()
    next(database, None)


def test_a_request_captured_on_its_way_to_one_node_is_refused_at_another(nodes, third_node):
    a, b = nodes
    body = _encode(b, _rows(uuid.uuid4(), [1]))
    headers = _signed_request(SECRET, a.instance, b.instance, signing.BATCHES_PATH, body)
    elsewhere = httpx.post(f"{third_node.address}{signing.BATCHES_PATH}", content=body, headers=headers, timeout=30)
    assert elsewhere.status_code == 401 and elsewhere.json()["type"] == "/problems/bad-signature"
    assert third_node.scalar("SELECT count(*) FROM broker.endpoints") == 0
    at_b = httpx.post(f"{b.address}{signing.BATCHES_PATH}", content=body, headers=headers, timeout=30)
    assert at_b.status_code == 200

    asked = json.dumps({"services": ["warehouse"], "contracts": ["orders"]}).encode()
    headers = _signed_request(SECRET, a.instance, b.instance, signing.DESCRIBE_PATH, asked)
    elsewhere = httpx.post(f"{third_node.address}{signing.DESCRIBE_PATH}", content=asked, headers=headers, timeout=30)
    assert elsewhere.status_code == 401 and "warehouse" not in elsewhere.text
    assert httpx.post(f"{b.address}{signing.DESCRIBE_PATH}", content=asked, headers=headers,
                      timeout=30).status_code == 200


def test_a_request_signed_for_one_endpoint_is_refused_at_another(shared_nodes):
    a, b = shared_nodes
    conversation = uuid.uuid4()
    body = _encode(b, _rows(conversation, [1]))
    headers = _signed_request(SECRET, a.instance, b.instance, signing.DESCRIBE_PATH, body, wire.BATCH_MEDIA_TYPE)
    response = httpx.post(f"{b.address}{signing.BATCHES_PATH}", content=body, headers=headers, timeout=30)
    assert response.status_code == 401 and response.json()["type"] == "/problems/bad-signature"
    assert b.scalar("SELECT count(*) FROM broker.endpoints WHERE conversation_id = :c", c=conversation) == 0


def test_a_signed_describe_request_with_a_name_postgresql_cannot_hold_is_malformed_not_a_failure(shared_nodes):
    a, b = shared_nodes
    asked = json.dumps({"services": ["ware\u0000house"], "contracts": []}).encode()
    headers = _signed_request(SECRET, a.instance, b.instance, signing.DESCRIBE_PATH, asked)
    response = httpx.post(f"{b.address}{signing.DESCRIBE_PATH}", content=asked, headers=headers, timeout=30)
    assert response.status_code == 400 and response.json()["type"] == "/problems/malformed-request"
