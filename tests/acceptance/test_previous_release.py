"""This release beside earlier ones, each installed from the git history into an environment of its own, on real
nodes: conversations begun on either side cross both ways, each message once and in order; one node is upgraded
while traffic flows both ways (its database migrated while the previous release serves it, then its process
replaced), losing, repeating and reordering nothing."""
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from sqlalchemy import text

from broker import migrate as this_release
from tests.conftest import _fresh_database
from tests.migrations import catalog
from tests.nodes import Node, serve_pair, stop_all
from tests.traffic import QUEUES, both_ways
from tests.releases import (PREVIOUS_RELEASE, PREVIOUS_REVISION, PREVIOUS_WIRE_VERSION, install,
                            installed_in, run)

pytestmark = pytest.mark.slow
REVISION = "SELECT version_num FROM public.broker_alembic_version"


@pytest.fixture(scope="module")
def previous_release(made_once):
    return installed_in(made_once("previous-release", lambda folder: install(PREVIOUS_RELEASE, folder)))


@pytest.fixture
def mixed_pair(request, admin_url, template_database, tmp_path, previous_release):
    """Nodes a (shop) and b (warehouse), serving; the one named by the parameter runs the previous release on a
    database that release migrated."""
    yield from _pair_with(request.param, previous_release, admin_url, template_database, tmp_path)


def _pair_with(older: str, release, admin_url, template_database, tmp_path):
    databases = {name: _fresh_database(admin_url, "template1" if name == older else template_database)
                 for name in "ab"}
    urls = {name: next(database) for name, database in databases.items()}
    run(release, "migrate", database_url=urls[older])
    nodes = {name: Node(name, urls[name], tmp_path) for name in "ab"}
    nodes[older].release = release
    serve_pair(nodes["a"], nodes["b"])
    yield nodes["a"], nodes["b"], nodes[older]
    stop_all(*nodes.values())
    for database in databases.values():
        next(database, None)


# The SQL API, which every release keeps: a node of any release is driven by the same statements.
BEGIN_DIALOG = text("SELECT broker.begin_dialog(:from_service, :to_service, 'orders')")
SEND = text("SELECT broker.send(:handle, 'order.note', :body)")
RECEIVE = text("SELECT conversation_handle, message_sequence_number, message_type FROM broker.receive(:queue, 100)")
END_CONVERSATION = text("SELECT broker.end_conversation(:handle)")


def receive_all(node, queue, count, timeout_s=60.0):
    """Receives in SQL until count messages came, committing each batch."""
    messages = []
    deadline = time.monotonic() + timeout_s
    while len(messages) < count and time.monotonic() < deadline:
        with node.engine.begin() as c:
            received = c.execute(RECEIVE, {"queue": queue}).all()
        messages += received
        if not received:
            time.sleep(0.1)
    assert len(messages) == count, f"{node.name} received {len(messages)} of {count}"
    return messages


def converse(sender, receiver, from_service, to_service, label):
    """Three conversations of ten messages each from sender, received in order; a reply and an end on each."""
    with sender.engine.begin() as c:
        handles = [c.execute(BEGIN_DIALOG, {"from_service": from_service, "to_service": to_service}).scalar_one()
                   for _ in range(3)]
        for i in range(30):
            c.execute(SEND, {"handle": handles[i % 3], "body": f"{label} {i}".encode()})
    by_conversation = {}
    for message in receive_all(receiver, QUEUES[to_service], 30):
        by_conversation.setdefault(message.conversation_handle, []).append(message)
    assert sorted(len(messages) for messages in by_conversation.values()) == [10, 10, 10]
    for messages in by_conversation.values():
        assert [m.message_sequence_number for m in messages] == list(range(1, 11))
    with receiver.engine.begin() as c:
        for handle in by_conversation:
            c.execute(SEND, {"handle": handle, "body": b"reply"})
            c.execute(END_CONVERSATION, {"handle": handle})
    replies = receive_all(sender, QUEUES[from_service], 6)
    assert sorted(m.message_type for m in replies) == ["broker.end_dialog"] * 3 + ["order.note"] * 3


@pytest.mark.parametrize("mixed_pair", ["a", "b"], indirect=True)
def test_a_node_of_the_previous_release_converses_with_this_one_both_ways(mixed_pair):
    a, b, previous = mixed_pair
    assert previous.scalar(REVISION) == PREVIOUS_REVISION
    assert httpx.get(f"{previous.address}/healthz", timeout=5).json()["wire_version"] == PREVIOUS_WIRE_VERSION
    assert [node.scalar(REVISION) for node in {a, b} - {previous}] == [this_release.head_revision()]
    converse(a, b, "shop", "warehouse", "from a")
    converse(b, a, "warehouse", "shop", "from b")


def _ready(node) -> httpx.Response:
    return httpx.get(f"{node.address}/readyz", timeout=10)


@pytest.mark.parametrize("mixed_pair", ["b"], indirect=True)
def test_one_node_upgraded_while_traffic_flows_both_ways_loses_repeats_and_reorders_nothing(mixed_pair, capsys):
    """b runs the previous release.  With messages flowing both ways all along: b's database is migrated by this
    release while b's previous release serves it, then b's process is replaced by this release's."""
    a, b, _ = mixed_pair
    with both_ways(a, b) as (to_b, to_a):  # the applications' databases never stop: no send or receive fails
        time.sleep(2)
        assert _ready(b).status_code == 200

        migrated_at = time.time()
        this_release.upgrade(b.database_url)  # while the previous release serves b, and traffic flows
        assert b.scalar(REVISION) == this_release.head_revision()
        # The previous release stays ready on a database migrated ahead of it: the revision still serves it.
        assert _ready(b).json() == {"status": "ready", "schema_revision": this_release.head_revision()}
        time.sleep(2)

        upgraded_at = time.time()
        b.stop()
        b.release = None
        b.start()
        assert _ready(b).json() == {"status": "ready", "schema_revision": this_release.head_revision()}
        time.sleep(3)
    with capsys.disabled():  # how long messages waited: before the migration, after it, and once b was replaced
        for name, traffic in (("a -> b", to_b), ("b -> a", to_a)):
            print(f"\n{name}: {len(traffic.waited)} messages, none lost, repeated or reordered; the longest wait "
                  f"{traffic.longest_wait_s(0, migrated_at):.2f} s before the migration, "
                  f"{traffic.longest_wait_s(migrated_at, upgraded_at):.2f} s while the previous release served the "
                  f"migrated database, {traffic.longest_wait_s(upgraded_at):.2f} s from the replacement of b's "
                  "process on")
    assert max(to_b.longest_wait_s(), to_a.longest_wait_s()) < 30


@pytest.mark.parametrize("mixed_pair", ["a"], indirect=True)
def test_this_releases_migrations_apply_while_a_node_of_the_previous_release_serves(mixed_pair):
    a, b, previous = mixed_pair
    with ThreadPoolExecutor(1) as traffic:
        flowing = traffic.submit(converse, a, b, "shop", "warehouse", "during")
        this_release.upgrade(a.database_url)
        flowing.result()
    assert a.scalar(REVISION) == this_release.head_revision()
    converse(a, b, "shop", "warehouse", "after, schema upgraded")
    converse(b, a, "warehouse", "shop", "back")


def test_a_database_the_previous_release_built_is_carried_over_to_what_this_release_builds(
        admin_url, previous_release):
    """The previous release's database goes on from its revision, and ends the same, catalog and functions, as a
    database this release builds."""
    built_before, built_now = _fresh_database(admin_url), _fresh_database(admin_url)
    before, now = next(built_before), next(built_now)
    run(previous_release, "migrate", database_url=before)
    this_release.upgrade(before)
    this_release.upgrade(now)
    assert not catalog.diff(catalog.snapshot(now), catalog.snapshot(before), ("built by this release", "carried over"))
    for database in (built_before, built_now):
        next(database, None)

