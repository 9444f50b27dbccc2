"""This release and the previous one, installed from the git history, on two real nodes: conversations begun on
either side cross both ways, each message once and in order; and this release's migrations apply to a node of the
previous release while it serves."""
from concurrent.futures import ThreadPoolExecutor

import pytest

import broker
from broker import migrate as this_release
from tests.conftest import _fresh_database
from tests.migrations import catalog
from tests.nodes import Node, serve_pair, stop_all
from tests.releases import PREVIOUS_RELEASE, checkout, migrate

pytestmark = pytest.mark.slow
REVISION = "SELECT version_num FROM public.broker_alembic_version"


@pytest.fixture(scope="module")
def previous_release(tmp_path_factory):
    return checkout(PREVIOUS_RELEASE, tmp_path_factory.mktemp("previous-release"))


@pytest.fixture
def mixed_pair(request, admin_url, template_database, tmp_path, previous_release):
    """Nodes a (shop) and b (warehouse), serving; the one named by the parameter runs the previous release on a
    database that release migrated."""
    previous = request.param
    databases = {name: _fresh_database(admin_url, "template1" if name == previous else template_database)
                 for name in "ab"}
    urls = {name: next(database) for name, database in databases.items()}
    migrate(previous_release, urls[previous])
    nodes = {name: Node(name, urls[name], tmp_path) for name in "ab"}
    nodes[previous].release = previous_release
    serve_pair(nodes["a"], nodes["b"])
    yield nodes["a"], nodes["b"], nodes[previous]
    stop_all(*nodes.values())
    for database in databases.values():
        next(database, None)


def converse(sender, receiver, from_service, to_service, label):
    """Three conversations of ten messages each from sender, received in order; a reply and an end on each."""
    queues = {"shop": "shop_queue", "warehouse": "warehouse_queue"}
    with sender.engine.begin() as c:
        handles = [broker.begin_dialog(c, from_service, to_service, "orders") for _ in range(3)]
        for i in range(30):
            broker.send(c, handles[i % 3], "order.note", f"{label} {i}".encode())
    by_conversation = {}
    for message in receiver.receive_all(queues[to_service], 30):
        by_conversation.setdefault(message.conversation_handle, []).append(message)
    assert sorted(len(messages) for messages in by_conversation.values()) == [10, 10, 10]
    for messages in by_conversation.values():
        assert [m.message_sequence_number for m in messages] == list(range(1, 11))
    with receiver.engine.begin() as c:
        for handle in by_conversation:
            broker.send(c, handle, "order.note", b"reply")
            broker.end_conversation(c, handle)
    replies = sender.receive_all(queues[from_service], 6)
    assert sorted(m.message_type for m in replies) == ["broker.end_dialog"] * 3 + ["order.note"] * 3


@pytest.mark.parametrize("mixed_pair", ["a", "b"], indirect=True)
def test_a_node_of_the_previous_release_converses_with_this_one_both_ways(mixed_pair):
    a, b, previous = mixed_pair
    assert previous.scalar(REVISION) == "0028"
    assert {a, b} - {previous} == {node for node in (a, b) if node.scalar(REVISION) == this_release.head_revision()}
    converse(a, b, "shop", "warehouse", "from a")
    converse(b, a, "warehouse", "shop", "from b")


@pytest.mark.parametrize("mixed_pair", ["a"], indirect=True)
def test_this_releases_migrations_apply_while_a_node_of_the_previous_release_serves(mixed_pair):
    a, b, previous = mixed_pair
    with ThreadPoolExecutor(1) as traffic:
        flowing = traffic.submit(converse, a, b, "shop", "warehouse", "during")
        this_release.upgrade(a.database_url)
        flowing.result()
    assert a.scalar(REVISION) == this_release.head_revision()
    converse(a, b, "shop", "warehouse", "after, schema upgraded")
    with ThreadPoolExecutor(1) as traffic:  # b's messages to a, and a's replies, while a's process is upgraded
        flowing = traffic.submit(converse, b, a, "warehouse", "shop", "during the node's upgrade")
        a.stop()
        a.release = None
        a.start()
        flowing.result()
    converse(a, b, "shop", "warehouse", "after, node upgraded")
    converse(b, a, "warehouse", "shop", "back")


def test_a_database_the_previous_release_built_is_carried_over_to_what_this_release_builds(
        admin_url, previous_release):
    """The previous release's last revision is this release's baseline: its database goes on from there, and ends
    the same, catalog and functions, as a database this release builds."""
    built_before, built_now = _fresh_database(admin_url), _fresh_database(admin_url)
    before, now = next(built_before), next(built_now)
    migrate(previous_release, before)
    this_release.upgrade(before)
    this_release.upgrade(now)
    assert not catalog.diff(catalog.snapshot(now), catalog.snapshot(before), ("built by this release", "carried over"))
    for database in (built_before, built_now):
        next(database, None)
