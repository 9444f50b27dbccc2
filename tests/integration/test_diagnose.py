"""`broker diagnose` against two real nodes: a healthy pair, then one broken part at a time."""
import glob
import json
import os
import re
import subprocess
import sys
import time
from uuid import uuid4

import httpx
import pytest

import broker
from broker.transport import signing, wire
from tests.nodes import SECRET, free_port, wait_for
from tests.peers import ScriptedPeer, json_answer
from tests.rest import new_key


# libfaketime (Debian's faketime): a node started with it keeps a clock off by FAKETIME seconds.
FAKETIME = next(iter(glob.glob("/usr/lib/*/faketime/libfaketime.so.1")), "libfaketime is not installed")


def _diagnose(node, *options: str) -> tuple[int, list[dict]]:
    return _diagnose_url(node.database_url, *options)


def _diagnose_url(database_url: str, *options: str) -> tuple[int, list[dict]]:
    result = subprocess.run([sys.executable, "-m", "broker.cli", "diagnose", "--json", *options], capture_output=True,
                            text=True, timeout=120, env={**os.environ, "BROKER_DATABASE_URL": database_url})
    return result.returncode, json.loads(result.stdout)


def _errors(findings: list[dict]) -> dict[str, dict]:
    return {finding["check"]: finding for finding in findings if finding["level"] == "error"}


def _diagnose_over_rest(node, *query: str) -> list[dict]:
    """GET /v1/diagnose, what the console shows."""
    answer = httpx.get(f"{node.address}/v1/diagnose?{'&'.join(query)}", timeout=60,
                       headers={"Authorization": f"Bearer {new_key(node.engine, 'admin')}"})
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_a_healthy_pair_of_nodes_has_nothing_to_report(nodes):
    a, b = nodes
    # A conversation begun from a service that accepts no contract: only the target must accept it.
    with a.engine.begin() as c:
        broker.create_service(c, "kiosk", "shop_queue", [])
        handle = broker.begin_dialog(c, "kiosk", "warehouse", "orders")
        broker.send(c, handle, "order.note", b"from the kiosk")
    with b.engine.begin() as c:
        broker.create_route(c, "kiosk", a.address, a.instance, SECRET)
    assert [m.body for m in b.receive_all("warehouse_queue", 1)] == [b"from the kiosk"]
    for node, peer, service in ((a, b, "warehouse"), (b, a, "shop")):
        code, findings = _diagnose(node)
        assert code == 0, findings
        assert {finding["level"] for finding in findings} == {"ok"}
        checks = {finding["check"]: finding["finding"] for finding in findings}
        assert f"answers as instance {peer.instance} (pg-broker {broker.__version__}), signs both ways" \
            in checks[f"node {peer.address}"]
        assert checks["schema"].endswith(f"for pg-broker {broker.__version__}")
        assert checks[f"service {service}"] == f"on {peer.address}, accepts orders"
        assert [(f["level"], f["check"]) for f in _diagnose_over_rest(node)] == [(f["level"], f["check"])
                                                                               for f in findings]


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
    errors = sum(finding["level"] == "error" for finding in findings)
    assert ("1 problem found" if errors == 1 else f"{errors} problems found") in table.stdout


def _send_notes(node, count: int) -> None:
    with node.engine.begin() as c:
        handle = broker.begin_dialog(c, "shop", "warehouse", "orders")
        for n in range(count):
            broker.send(c, handle, "order.note", f"note {n}")


def test_messages_that_nobody_relays_are_found_with_what_to_start(nodes):
    """The node's `broker serve` (and with it its relay) is down: its messages wait, and diagnose says so."""
    a, b = nodes
    a.stop()
    _send_notes(a, 3)
    code, findings = _diagnose(a)
    assert code == 1
    unrelayed = _errors(findings)[f"relay to {b.address}"]
    assert unrelayed["finding"] == "3 messages wait for it and no relay is running for it"
    assert "broker serve" in unrelayed["advice"] and "broker relay" in unrelayed["advice"]
    code, findings = _diagnose(b)  # b has nothing waiting: only that a does not answer
    assert list(_errors(findings)) == [f"node {a.address}"]

    a.start()
    b.receive_all("warehouse_queue", 3)
    wait_for(lambda: a.scalar("SELECT count(*) FROM broker.transmission_queue_status") == 0, what="the acknowledgements")
    code, findings = _diagnose(a)
    assert code == 0, _errors(findings)


def test_diagnose_exits_1_while_a_message_has_waited_longer_than_the_threshold(nodes):
    a, b = nodes
    b.stop()
    _send_notes(a, 2)
    wait_for(lambda: a.scalar("SELECT count(*) FROM broker.transmission_failures") > 0, what="a failed attempt")
    time.sleep(1.5)
    code, findings = _diagnose(a, "--max-wait", "600")
    assert f"waiting for {b.address}" not in _errors(findings)
    code, findings = _diagnose(a, "--max-wait", "1")
    assert code == 1
    waited = _errors(findings)[f"waiting for {b.address}"]
    assert waited["finding"].startswith("2 messages have waited longer than 1 s, the oldest ")
    assert waited["advice"] == "start that node ('broker serve'), or fix the routes' address"
    assert _errors(_diagnose_over_rest(a, "max_wait_s=1"))[f"waiting for {b.address}"]["advice"] == waited["advice"]


def _skew_clock(node, offset_s: str, **settings: str) -> None:
    """Restarts the node with its clock off by the offset (its database keeps the true time)."""
    node.stop()
    node.env = {"LD_PRELOAD": FAKETIME, "FAKETIME": offset_s, "FAKETIME_DONT_FAKE_MONOTONIC": "1", **settings}
    node.start()


def test_a_batch_the_far_node_accepts_is_acknowledged_at_a_skew_just_past_the_limit(nodes):
    """b's clock is 300.6 s behind and it accepts up to 302 s: each batch a sends is accepted and committed
    there, and a takes the signed answer, however old its timestamp looks, so nothing is resent forever."""
    a, b = nodes
    _skew_clock(b, "-300.6", BROKER_MAX_CLOCK_SKEW_S="302")
    _send_notes(a, 5)
    assert [m.body for m in b.receive_all("warehouse_queue", 5)] == [f"note {n}".encode() for n in range(5)]
    wait_for(lambda: a.scalar("SELECT count(*) FROM broker.transmission_queue_status") == 0, what="the acknowledgements")

    code, findings = _diagnose(a)  # a accepts at most 300 s: b's own batches would be refused here
    clock = _errors(findings)[f"node {b.address}"]
    assert re.fullmatch(r"its clock is 30[01]\.\d s from ours, more than the 300 s this node accepts: "
                        r"its batches to this node are refused", clock["finding"]), clock
    assert clock["advice"] == "keep the clocks in sync (NTP), or raise BROKER_MAX_CLOCK_SKEW_S on both nodes"


def test_a_clock_past_the_limit_gets_clock_advice_wherever_it_is_the_cause(nodes):
    a, b = nodes
    _skew_clock(b, "+400")
    _send_notes(a, 1)
    wait_for(lambda: a.scalar("SELECT count(*) FROM broker.transmission_failures") > 0, what="a refused batch")
    code, findings = _diagnose(a)
    assert code == 1
    for check in (f"node {b.address}", f"transmission to {b.address}"):
        finding = _errors(findings).get(check) or next(f for f in findings if f["check"] == check)
        assert re.search(r"the timestamp is 4\d\d\.\d s away from this node's clock \(at most 300 s allowed\)",
                         finding["finding"]), finding
        assert finding["advice"].startswith("keep the clocks in sync (NTP)"), finding


@pytest.mark.parametrize("status, advice", [
    (500, "that node fails: look at its log"), (503, "that node fails: look at its log"),
    (404, "fix the routes' address"), (418, "see the checks of that node's routes below")])
def test_a_destination_that_keeps_refusing_is_an_error_with_advice_whatever_the_cause(nodes, status, advice):
    a, _ = nodes
    with ScriptedPeer(lambda request: json_answer(status, {"title": "no"})) as peer:
        with a.engine.begin() as c:
            broker.create_route(c, "elsewhere", peer.address, uuid4(), SECRET)
            broker.send(c, broker.begin_dialog(c, "shop", "elsewhere", "orders"), "order.note", "x")
        wait_for(lambda: a.scalar("SELECT max(attempts) FROM broker.transmission_queue_status") >= 3, 30,
                 "three refused attempts")
        code, findings = _diagnose(a)
    assert code == 1
    refusing = _errors(findings)[f"transmission to {peer.address}"]
    assert f"answered HTTP {status}" in refusing["finding"] and advice in refusing["advice"]


@pytest.mark.parametrize("offset_s, level", [("+30", "warning"), ("-120", "error")])
def test_a_database_clock_off_from_the_nodes_is_found(database_url, offset_s, level):
    """The database's clock sets conversation lifetimes, timers and delivery times, which peers read by their own
    clocks: diagnose, run with its clock off from the database's, finds it (a warning, an error past a minute)."""
    result = subprocess.run([sys.executable, "-m", "broker.cli", "diagnose", "--json"], capture_output=True,
                            text=True, timeout=120,
                            env={**os.environ, "BROKER_DATABASE_URL": database_url, "LD_PRELOAD": FAKETIME,
                                 "FAKETIME": offset_s, "FAKETIME_DONT_FAKE_MONOTONIC": "1"})
    [clock] = [f for f in json.loads(result.stdout) if f["check"] == "database clock"]
    assert clock["level"] == level and "keep the database server's clock in sync" in clock["advice"]
    assert ("ahead of" if offset_s.startswith("-") else "behind") in clock["finding"]
    assert result.returncode == (1 if level == "error" else 0)
    assert "database clock" not in {f["check"] for f in _diagnose_url(database_url)[1]}  # in step: nothing said
