"""`broker diagnose` against two real nodes: a healthy pair, then one broken part at a time."""
import json
import os
import subprocess
import sys
from uuid import uuid4

import broker
from tests.nodes import SECRET, free_port


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
