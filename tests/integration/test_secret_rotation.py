"""The secret two nodes share, rotated while messages flow both ways, as docs/how-to/rotate-a-secret.md says: the new
secret added on both nodes, then switched to on each, then the old one retired on each; no batch is refused at any
step, no message waits, and `broker diagnose` says at each step which secret the peer signs with.  Steps out of turn
stall nothing either while the two nodes share a secret."""
import re
import time

import httpx
import pytest

import broker
from tests.integration.test_diagnose import _diagnose
from tests.nodes import wait_for
from tests.rest import new_key
from tests.traffic import both_ways

NEW_SECRET = "the-secret-a-and-b-share-from-now-on"
# The longest a message may wait from its send to its receive while the secret changes.  A refused batch is what
# would hold messages back (its relay retries after 1 s, then 2, then 4), and the relays' failure counts show any;
# this bound catches a stall without one, with room for a machine that runs four test processes on two cores (a
# message waited over 5 s there, neither relay logging a failure).
LONGEST_WAIT_S = 15


def _findings(node, check: str) -> list[dict]:
    code, findings = _diagnose(node)
    return [finding for finding in findings if finding["check"] == check]


def _refused_batches(node) -> float:
    """How many batches the node's relay has had refused or not answered, from its /metrics."""
    metrics = httpx.get(f"{node.address}/metrics", timeout=10,
                        headers={"Authorization": f"Bearer {new_key(node.engine, 'admin')}"}).text
    return sum(float(value) for value in re.findall(r"^broker_relay_failures_total\{.*\} (\S+)$", metrics, re.M))


def _on_both(a, b, step):
    for node, peer in ((a, b), (b, a)):
        with node.engine.begin() as c:
            step(c, peer.instance)
        time.sleep(1.5)  # batches go both ways between the steps


def test_a_secret_rotated_while_messages_flow_both_ways_refuses_and_stalls_nothing(nodes):
    a, b = nodes
    with both_ways(a, b) as flowing:
        time.sleep(1)
        check = f"secret of {b.address}"
        before = _findings(a, check)
        assert [f["level"] for f in before] == ["ok"]
        assert before[0]["finding"].startswith("signs its batches with the routes' secret (last at ")

        _on_both(a, b, lambda c, peer: broker.add_peer_secret(c, peer, NEW_SECRET))
        added = _findings(a, check)
        assert added[0]["finding"].startswith("signs its batches with the routes' secret")
        assert added[1]["level"] == "warning" and added[1]["finding"].startswith("a new secret is added")
        assert f"broker.switch_peer_secret('{b.instance}')" in added[1]["advice"]

        with a.engine.begin() as c:
            broker.switch_peer_secret(c, b.instance)
        # a signs with the new secret, which b takes; b still signs with the old one, which a takes
        wait_for(lambda: _findings(b, f"secret of {a.address}")[0]["finding"].startswith(
            "signs its batches with the new secret, not yet switched to"), 30, "b to see a sign with the new secret")
        old_in_use = wait_for(lambda: [f for f in _findings(a, check) if f["level"] == "warning"], 30,
                              "a to warn that b still signs with the old secret")
        assert old_in_use[0]["finding"].startswith("still signs its batches with the old secret")

        with b.engine.begin() as c:
            broker.switch_peer_secret(c, a.instance)
        switched = wait_for(lambda: (lambda findings: findings if findings[0]["level"] == "ok" else None)(
            _findings(a, check)), 30, "a to see b sign with the new secret")
        assert switched[0]["finding"].startswith("signs its batches with the routes' secret")
        assert switched[1]["finding"].startswith("the old secret, switched from at")
        assert f"broker.retire_peer_secret('{b.instance}')" in switched[1]["finding"]

        retired = []
        _on_both(a, b, lambda c, peer: retired.append(broker.retire_peer_secret(c, peer)))
        assert retired == [1, 1]
        assert [f["level"] for f in _findings(a, check)] == ["ok"]
        with a.engine.begin() as c:
            assert broker.retire_peer_secret(c, b.instance) == 0  # nothing more to retire
        time.sleep(1)
    assert _refused_batches(a) == _refused_batches(b) == 0
    longest = max(traffic.longest_wait_s() for traffic in flowing)
    assert longest < LONGEST_WAIT_S, f"a message stalled for {longest:.1f} s"


def test_a_rotation_step_out_of_turn_is_refused_with_what_to_do(nodes):
    a, b = nodes
    with a.engine.begin() as c, pytest.raises(broker.InvalidArgument, match="no new secret is added"):
        broker.switch_peer_secret(c, b.instance)
    with a.engine.begin() as c, pytest.raises(broker.InvalidArgument, match="at least 16 characters"):
        broker.add_peer_secret(c, b.instance, "short")
    with a.engine.begin() as c, pytest.raises(broker.AlreadyExists, match="already"):
        broker.add_peer_secret(c, b.instance, "shared-secret-between-a-and-b")
    with a.engine.begin() as c, pytest.raises(broker.UnknownObject, match="no route goes to broker instance"):
        broker.add_peer_secret(c, a.instance, NEW_SECRET)


def test_the_steps_in_any_order_on_the_two_nodes_stall_nothing_while_the_nodes_share_a_secret(nodes):
    """a adds and switches before b holds the new secret, and retires the old one before b switches: each relay
    signs under the other secret it holds when one is refused, so every message goes on at once."""
    a, b = nodes
    with both_ways(a, b) as flowing:
        with a.engine.begin() as c:
            broker.add_peer_secret(c, b.instance, NEW_SECRET)
            broker.switch_peer_secret(c, b.instance)  # b does not take the new secret yet
        time.sleep(1.5)
        with b.engine.begin() as c:
            broker.add_peer_secret(c, a.instance, NEW_SECRET)
        with a.engine.begin() as c:
            assert broker.retire_peer_secret(c, b.instance) == 1  # b still signs with the old one
        time.sleep(1.5)
        with b.engine.begin() as c:
            broker.switch_peer_secret(c, a.instance)
            assert broker.retire_peer_secret(c, a.instance) == 1
        time.sleep(1.5)
    assert all(traffic.longest_wait_s() < LONGEST_WAIT_S for traffic in flowing), "a message stalled"


def test_nodes_that_share_no_secret_keep_their_messages_until_they_do(nodes):
    a, b = nodes
    with a.engine.begin() as c:
        broker.add_peer_secret(c, b.instance, NEW_SECRET)
        broker.switch_peer_secret(c, b.instance)
        broker.retire_peer_secret(c, b.instance)  # too early: b never held the new secret
    with b.engine.begin() as c:
        handle = broker.begin_dialog(c, "warehouse", "shop", "orders")
        broker.send(c, handle, "order.note", "signed with the secret a retired")
    status = wait_for(lambda: b.scalar("SELECT min(transmission_status) FROM broker.transmission_queue_status"
                                       " WHERE attempts > 0"), 30, "the refusal")
    assert "HTTP 401" in status
    with b.engine.begin() as c:
        broker.add_peer_secret(c, a.instance, NEW_SECRET)  # shared again: b's relay signs under it once refused
    assert [m.body for m in a.receive_all("shop_queue", 1, timeout_s=60)] == [b"signed with the secret a retired"]


def test_diagnose_in_a_step_out_of_turn_signs_as_the_relay_does_and_says_what_the_peer_lacks(nodes):
    """a switched to a secret that b does not hold yet: a's relay goes on under the old one, and so does a's
    diagnose, which warns (not an error) that b takes only the old secret and says to add the new one there."""
    a, b = nodes
    with a.engine.begin() as c:
        broker.add_peer_secret(c, b.instance, NEW_SECRET)
        broker.switch_peer_secret(c, b.instance)
    code, findings = _diagnose(a)
    assert code == 0, [finding for finding in findings if finding["level"] == "error"]
    [lacking] = [finding for finding in _findings(a, f"node {b.address}") if "secret" in finding["finding"]]
    assert lacking["level"] == "warning"
    assert "refuses the routes' secret" in lacking["finding"]
    assert f"broker.add_peer_secret('{a.instance}'" in lacking["advice"]
    assert NEW_SECRET not in str(findings)
