"""`broker diagnose` against two real nodes: a healthy pair, then one broken part at a time."""
import json
import os
import subprocess
import sys
from uuid import uuid4

import pytest

import broker
from broker.transport import signing, wire
from tests.nodes import SECRET, free_port
from tests.peers import ScriptedPeer, json_answer


def _diagnose(node) -> tuple[int, list[dict]]:
    result = subprocess.run([sys.executable, "-m", "broker.cli", "diagnose", "--json"], capture_output=True,
                            text=True, timeout=120, env={**os.environ, "BROKER_DATABASE_URL": node.database_url})
    return result.returncode, json.loads(result.stdout)


def test_a_healthy_pair_of_nodes_has_nothing_to_report(nodes):
    a, b = nodes
    for node, peer, service in ((a, b, "warehouse"), (b, a, "shop")):
        code, findings = _diagnose(node)
        assert code == 0, findings
        assert {finding["level"] for finding in findings} == {"ok"}
        checks = {finding["check"]: finding["finding"] for finding in findings}
        assert f"answers as instance {peer.instance}, signs both ways" in checks[f"node {peer.address}"]
        assert checks[f"service {service}"] == f"on {peer.address}, accepts orders"


def test_every_broken_part_is_found_with_what_to_do(nodes):
    a, b = nodes
    dead = f"http://127.0.0.1:{free_port()}"
    with b.engine.begin() as c:
        broker.create_contract(c, "billing", {"order.note": "initiator"})
        broker.create_service(c, "ledger", "warehouse_queue", ["billing"])
        broker.alter_queue(c, "warehouse_queue", enabled=False)
    with a.engine.begin() as c:
        broker.create_contract(c, "billing", {"order.note": "any"})
        broker.create_route(c, "ledger", b.address, b.instance, SECRET)
        broker.create_route(c, "absent", b.address, b.instance, SECRET)
        broker.create_route(c, "nowhere", dead, uuid4(), SECRET)
        impostor = uuid4()
        broker.create_route(c, "impostor", b.address, impostor, SECRET)
        broker.create_route(c, "stranger", b.address, b.instance, "not-the-secret-b-knows")
        broker.alter_queue(c, "shop_queue", enabled=False)

    code, findings = _diagnose(a)
    assert code == 1
    problems = [(f["check"], f["finding"]) for f in findings if f["level"] == "error"]
    expected = [
        ("queue shop_queue", "disabled (0 dead letters)"),
        (f"node {dead}", "does not answer"),
        (f"node {b.address}", f"is instance {b.instance}, the routes to it say {impostor}"),
        (f"node {b.address}", "refuses our signature: the signature does not match any secret"),
        ("service absent", f"{b.address} has no service absent"),
        ("service warehouse", f"its queue warehouse_queue on {b.address} is disabled"),
        ("contract billing", 'differs: here {"order.note": {"sent_by": "any"'),
    ]
    for check, finding in expected:
        assert any(c == check and finding in f for c, f in problems), (check, finding, problems)
    assert all(f["advice"] for f in findings if f["level"] == "error")
    assert len(problems) == len(expected) + 1  # and ledger's queue, which is warehouse_queue


def hostile_peer(instance: str, description: bytes) -> ScriptedPeer:
    """A peer holding the shared secret that answers describe with signed nonsense."""
    def answer(request):
        if request.method == "GET":
            return json_answer(200, {"status": "ok", "broker_instance": instance, "wire_version": wire.WIRE_VERSION})
        purpose = signing.answer_purpose(request.headers[signing.SIGNATURE_HEADER])
        return 200, signing.signed_headers(SECRET, instance, purpose, description), description

    return ScriptedPeer(answer)


@pytest.mark.parametrize("description", [b'{"services": [], "contracts": "\\u001b]8;;http://evil\\u001b\\\\"}',
                                         b"not json at all \x1b[2J", b'[1, 2, 3]'])
def test_a_peer_that_describes_itself_in_nonsense_is_a_finding_not_a_crash(database_url, engine, orders, description):
    instance = str(uuid4())
    with hostile_peer(instance, description) as peer:
        with engine.begin() as c:
            broker.create_route(c, "far", peer.address, instance, SECRET)
        code, findings = _diagnose_url(database_url)
        table = subprocess.run([sys.executable, "-m", "broker.cli", "diagnose"], capture_output=True, text=True,
                               timeout=120, env={**os.environ, "BROKER_DATABASE_URL": database_url})
    assert code == 1
    [malformed] = [f for f in findings if f["check"] == f"node {peer.address}" and f["level"] == "error"]
    assert "malformed" in malformed["finding"] and malformed["advice"]
    assert table.returncode == 1 and "\x1b" not in table.stdout and "Traceback" not in table.stderr


def _diagnose_url(database_url: str) -> tuple[int, list[dict]]:
    result = subprocess.run([sys.executable, "-m", "broker.cli", "diagnose", "--json"], capture_output=True,
                            text=True, timeout=120, env={**os.environ, "BROKER_DATABASE_URL": database_url})
    return result.returncode, json.loads(result.stdout)
