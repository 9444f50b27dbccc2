"""A node whose database goes back to an earlier point, on real clusters: restored from a base backup, recovered
from archived WAL to a restore point, or failed over to a standby that had not received its primary's last
transactions.  Node a runs on the test server, node b on a cluster of its own.  Both sides find it within a batch
round trip, send again what the far side lost from the resend window, number past what the far side holds, and,
where the window no longer holds what was lost, end the conversation with broker.error -4 and say so."""
import json
import subprocess

import psycopg2
import pytest
from sqlalchemy import create_engine

import broker
from broker import migrate
from broker.cli.processes import start_broker, stop
from broker.spark_ingest import checkpoints
from tests import factories
from tests.clusters import Cluster
from tests.conftest import _fresh_database, admin_execute
from tests.integration.test_diagnose import _diagnose
from tests.nodes import Node, serve_pair, stop_all, wait_for

pytestmark = pytest.mark.slow

CONVERSATIONS = 3


@pytest.fixture
def pair(admin_url, template_database, tmp_path):
    """Node a (the shop) on the test server, node b (the warehouse) on a cluster of its own; both serving."""
    cluster = Cluster.initdb(tmp_path / "b-cluster", "b").start()
    admin_execute(cluster.url(), "CREATE DATABASE warehouse")
    migrate.upgrade(cluster.url("warehouse"))
    a_database = _fresh_database(admin_url, template_database)
    a, b = Node("a", next(a_database), tmp_path), Node("b", cluster.url("warehouse"), tmp_path)
    serve_pair(a, b)
    yield a, b, cluster
    stop_all(a, b)
    cluster.stop("immediate")
    next(a_database, None)


def send(node, handles, count, label):
    """count messages round the conversations, in one transaction: their bodies per conversation, in order."""
    sent = {handle: [] for handle in handles}
    with node.engine.begin() as c:
        for i in range(count):
            handle = handles[i % len(handles)]
            body = f"{label} {i}".encode()
            broker.send(c, handle, "order.note", body)
            sent[handle].append(body)
    return sent


def received(node, queue, count):
    """What arrives, per conversation id: the message types and bodies, in order of receipt."""
    by_conversation = {}
    for message in node.receive_all(queue, count, timeout_s=90):
        by_conversation.setdefault(message.conversation_id, []).append((message.message_type, message.body))
    return by_conversation


def drained(*nodes):
    wait_for(lambda: all(node.scalar("SELECT count(*) FROM broker.transmission_queue_status") == 0 for node in nodes), 60,
             "every message to be acknowledged")


def lost_messages(node):
    with node.engine.connect() as c:
        return sorted(tuple(row) for row in c.exec_driver_sql(
            "SELECT direction, outcome, first_number, last_number FROM broker.lost_messages"))


class Going:
    """How b's database goes back to the moment called 'before', as an operator would do it."""

    def __init__(self, how, cluster, tmp_path):
        self.how, self.cluster, self.tmp_path = how, cluster, tmp_path
        if how == "point in time":
            self.base = cluster.base_backup("base")
        elif how == "standby":
            self.standby = cluster.standby(tmp_path / "b-standby", "b-standby")

    def mark_before(self):
        if self.how == "base backup":
            self.backup = self.cluster.base_backup("before")
        elif self.how == "point in time":
            self.cluster.restore_point("before")
        else:  # the standby stops receiving here, once it has replayed everything so far
            with psycopg2.connect(self.cluster.url()) as primary, primary.cursor() as cursor:
                cursor.execute("SELECT pg_current_wal_insert_lsn()")  # asynchronous commits too
                lsn = cursor.fetchone()[0]
            wait_for(lambda: self._replayed(lsn), 30, "the standby to catch up")
            self.standby.stop("fast")

    def _replayed(self, lsn):
        with psycopg2.connect(self.standby.url()) as standby, standby.cursor() as cursor:
            cursor.execute("SELECT pg_last_wal_replay_lsn() >= %s::pg_lsn", (lsn,))
            return cursor.fetchone()[0]

    def go_back(self, b):
        """b's node stopped, its database taken back, and a node started on it at b's address."""
        b.stop()
        b.engine.dispose()
        if self.how == "base backup":
            server = self.cluster.restore(self.backup)
        elif self.how == "point in time":
            server = self.cluster.restore(self.base, to_restore_point="before")
        else:  # the primary is lost, and the standby that lags is promoted
            self.cluster.stop("immediate")
            server = self.standby.start()
            server.promote()
        node = Node("b", server.url("warehouse"), self.tmp_path, port=b.port)
        node.start()
        return node

    def stop(self):
        if self.how == "standby":
            self.standby.stop("immediate")


def conversations_begun(a, count):
    with a.engine.begin() as c:
        return [broker.begin_dialog(c, "shop", "warehouse", "orders") for _ in range(count)]


def conversation_ids(node, handles):
    with node.engine.connect() as c:
        return {handle: c.exec_driver_sql("SELECT conversation_id FROM broker.endpoints WHERE conversation_handle = %s",
                                          (handle,)).scalar_one() for handle in handles}


def handles_by_conversation(node, conversation_ids):
    with node.engine.connect() as c:
        return {conversation_id: c.exec_driver_sql(
                    "SELECT conversation_handle FROM broker.endpoints WHERE conversation_id = %s",
                    (conversation_id,)).scalar_one() for conversation_id in conversation_ids}


@pytest.mark.parametrize("how", ["base backup", "point in time", "standby"])
def test_a_receiver_that_went_back_gets_again_what_it_lost_and_its_replies_are_numbered_past(pair, tmp_path, how):
    a, b, cluster = pair
    going = Going(how, cluster, tmp_path)
    handles = conversations_begun(a, CONVERSATIONS)
    send(a, handles, 30, "before")
    b_handles = handles_by_conversation(b, received(b, "warehouse_queue", 30))
    send(b, list(b_handles.values()), 12, "reply before")
    received(a, "shop_queue", 12)
    drained(a, b)
    going.mark_before()

    after = send(a, handles, 99, "after")  # acknowledged by b, then lost with its database
    received(b, "warehouse_queue", 99)
    send(b, list(b_handles.values()), 30, "reply after")
    received(a, "shop_queue", 30)
    drained(a, b)
    try:
        b = going.go_back(b)
        later = send(a, handles, 30, "later")
        new_replies = send(b, list(b_handles.values()), 12, "new reply")

        # b gets exactly what it lost, in order, once, then what came later, and a notice per conversation that
        # its replies were numbered past what a holds.
        at_b = received(b, "warehouse_queue", 129 + CONVERSATIONS)
        for handle, conversation_id in conversation_ids(a, handles).items():
            assert [body for kind, body in at_b[conversation_id] if kind == "order.note"] == after[handle] + later[handle]
            assert [kind for kind, body in at_b[conversation_id]].count("broker.renumbered") == 1
        # a gets every new reply, behind a broker.renumbered that names the numbers it already held from before.
        at_a = received(a, "shop_queue", 12 + CONVERSATIONS)
        for conversation_id, b_handle in b_handles.items():
            assert at_a[conversation_id][0][0] == "broker.renumbered"
            notice = json.loads(at_a[conversation_id][0][1])
            assert (notice["first_number"], notice["last_number"], notice["next_number"]) == (5, 14, 16)
            assert [body for kind, body in at_a[conversation_id][1:]] == new_replies[b_handle]
        drained(a, b)
        assert lost_messages(a) == sorted([("sent", "resent", 11, 43)] * CONVERSATIONS
                                          + [("received", "renumbered", 5, 14)] * CONVERSATIONS)
        # b records the numbers it lost when a batch shows it the gap.  Whether one does depends on timing: a
        # batch that comes while b's application holds the conversation (sending its new replies) is answered
        # with what b holds, so a sends 11 to 43 again before anything past them and b never sees a gap; a's
        # record of the resend is then the only one.  Either way nothing on b stays missing or lost.
        b_lost = lost_messages(b)
        assert [row for row in b_lost if row[0] == "sent"] == [("sent", "renumbered", 5, 14)] * CONVERSATIONS
        assert {row for row in b_lost if row[0] == "received"} <= {("received", "resent", 11, 43)}
        for node in (a, b):
            code, findings = _diagnose(node)
            assert code == 0, [f for f in findings if f["level"] == "error"]
            assert sum(f["level"] == "warning" and "renumbered" in f["finding"] for f in findings) == CONVERSATIONS
    finally:
        b.stop()
        going.stop()


def test_a_receiver_that_went_back_gets_again_what_it_lost_though_nothing_more_is_sent_to_it(pair, tmp_path):
    """What b lost of conversations that a sends nothing more on (one waiting for b's answer, one a ended) is found
    by the relay's probe of the last number b acknowledged (broker.probe_conversation, every
    BROKER_RELAY_PROBE_INTERVAL_S, here 5 s), which shows that b went back: then every conversation with b is
    probed, and each gets again what b lost."""
    a, b, cluster = pair
    a.stop()
    a.env["BROKER_RELAY_PROBE_INTERVAL_S"] = "5"
    a.start()
    going = Going("base backup", cluster, tmp_path)
    [waiting_for_b] = conversations_begun(a, 1)
    send(a, [waiting_for_b], 1, "before")
    received(b, "warehouse_queue", 1)
    drained(a)
    going.mark_before()

    asked = send(a, [waiting_for_b], 1, "the question b must answer")
    with a.engine.begin() as c:
        ended = broker.begin_dialog(c, "shop", "warehouse", "orders")
        broker.send(c, ended, "order.note", b"fire and forget")
        broker.end_conversation(c, ended)
    received(b, "warehouse_queue", 3)
    drained(a)
    b = going.go_back(b)
    try:
        at_b = received(b, "warehouse_queue", 3)  # a sends nothing new
        ids = conversation_ids(a, [waiting_for_b, ended])
        assert at_b[ids[waiting_for_b]] == [("order.note", body) for body in asked[waiting_for_b]]
        assert [kind for kind, _ in at_b[ids[ended]]] == ["order.note", "broker.end_dialog"]
        assert at_b[ids[ended]][0][1] == b"fire and forget"
        drained(a)
        # a records what b took again when it applies b's answer, a moment after b's commit; the messages were
        # acknowledged before b went back, so nothing waits on a meanwhile (drained does not wait for it).
        wait_for(lambda: len(lost_messages(a)) == 2, 30, "a to apply the answers that took the probes again")
        assert lost_messages(a) == [("sent", "resent", 1, 2), ("sent", "resent", 2, 2)]
        with b.engine.connect() as c:
            assert c.exec_driver_sql("SELECT state FROM broker.endpoints WHERE conversation_id = %s",
                                     (ids[ended],)).scalar_one() == "disconnected_inbound"
    finally:
        b.stop()


def test_a_node_that_went_back_to_before_a_conversation_ended_is_told_it_ended_when_it_sends_on_it(pair, tmp_path):
    """b goes back to before the conversation ended on both sides and a forgot it: what b's application sends on it
    reaches a's tombstone, which refuses the numbers it never took before the end, so b's side ends with
    broker.error -3 saying so, instead of being acknowledged into nothing."""
    a, b, cluster = pair
    with a.engine.begin() as c:
        c.exec_driver_sql("UPDATE broker.node SET closed_endpoint_retention = '0'")
    going = Going("base backup", cluster, tmp_path)
    [handle] = conversations_begun(a, 1)
    send(a, [handle], 1, "the order")
    [b_handle] = handles_by_conversation(b, received(b, "warehouse_queue", 1)).values()
    drained(a)
    going.mark_before()

    send(b, [b_handle], 1, "the reply")
    received(a, "shop_queue", 1)
    with a.engine.begin() as c:
        broker.end_conversation(c, handle)
    received(b, "warehouse_queue", 1)
    with b.engine.begin() as c:
        broker.end_conversation(c, b_handle)
    wait_for(lambda: a.scalar("SELECT count(*) FROM broker.forgotten_conversations") == 1, 30, "a to forget it")
    b = going.go_back(b)
    try:
        send(b, [b_handle], 1, "sent after b went back")
        [(kind, body)] = [m for m in received(b, "warehouse_queue", 2).popitem()[1] if m[0] == "broker.error"]
        assert json.loads(body)["code"] == -3
        assert "ended on the receiving node after message 2" in json.loads(body)["description"]
        with b.engine.connect() as c:
            assert c.exec_driver_sql("SELECT state FROM broker.endpoints WHERE conversation_handle = %s",
                                     (b_handle,)).scalar_one() == "error"
        with a.engine.begin() as c:
            assert broker.receive(c, "shop_queue", 10) == []
    finally:
        b.stop()


def test_a_node_that_went_back_to_before_it_began_a_conversation_is_found_when_the_far_side_replies(pair, tmp_path):
    """b begins a conversation and sends on it, then goes back to before it began: a's reply is refused as an
    unknown conversation, and a, which received b's messages on it, ends its side with broker.error -4 and records
    what b lost of it, rather than a plain refusal."""
    a, b, cluster = pair
    going = Going("base backup", cluster, tmp_path)
    going.mark_before()
    with b.engine.begin() as c:
        handle = broker.begin_dialog(c, "warehouse", "shop", "orders")
        for n in range(3):
            broker.send(c, handle, "order.note", f"b's message {n}")
    at_a = received(a, "shop_queue", 3)
    drained(b)
    b = going.go_back(b)
    try:
        [a_handle] = handles_by_conversation(a, at_a).values()
        send(a, [a_handle], 1, "a's reply")
        [(kind, body)] = received(a, "shop_queue", 1).popitem()[1]
        assert kind == "broker.error" and json.loads(body)["code"] == -4
        assert "went back to before it began" in json.loads(body)["description"]
        assert lost_messages(a) == [("sent", "lost", 1, 1)]
        code, findings = _diagnose(a)
        assert code == 1 and any("broker.error -4" in f["finding"] for f in findings if f["level"] == "error")
    finally:
        b.stop()


def test_what_the_resend_window_no_longer_holds_ends_the_conversation_on_both_sides_and_is_never_silent(pair,
                                                                                                       tmp_path):
    a, b, cluster = pair
    with a.engine.begin() as c:
        c.exec_driver_sql("UPDATE broker.node SET resend_window = '0'")
    going = Going("base backup", cluster, tmp_path)
    handles = conversations_begun(a, CONVERSATIONS)
    send(a, handles, 30, "before")
    received(b, "warehouse_queue", 30)
    drained(a, b)
    going.mark_before()
    send(a, handles, 30, "after")
    received(b, "warehouse_queue", 30)
    drained(a, b)
    b = going.go_back(b)
    try:
        send(a, handles, 3, "later")
        errors = received(b, "warehouse_queue", CONVERSATIONS)
        for messages in list(errors.values()) + list(received(a, "shop_queue", CONVERSATIONS).values()):
            [(kind, body)] = messages
            assert kind == "broker.error"
            assert json.loads(body)["code"] == -4
            assert "messages 11 to 20" in json.loads(body)["description"]
        assert lost_messages(a) == [("sent", "lost", 11, 20)] * CONVERSATIONS
        assert lost_messages(b) == [("received", "lost", 11, 20)] * CONVERSATIONS
        for node in (a, b):
            code, findings = _diagnose(node)
            assert code == 1
            lost = [f for f in findings if f["level"] == "error" and f["check"].startswith("conversation ")]
            assert len(lost) == CONVERSATIONS
            assert all("messages 11 to 20" in f["finding"] and "broker.error -4" in f["finding"] for f in lost)
    finally:
        b.stop()


@pytest.fixture
def both_on_clusters(tmp_path):
    """Node a (the shop) and node b (the warehouse), each on a cluster of its own, each routing to the other; both
    serving.  Yields a function that takes one node back to a base backup of its cluster (stopped, restored, and
    started again at its address), with the nodes and their clusters."""
    clusters = {name: Cluster.initdb(tmp_path / f"{name}-cluster", name).start() for name in "ab"}
    databases = {"a": "shop", "b": "warehouse"}
    for name, cluster in clusters.items():
        admin_execute(cluster.url(), f"CREATE DATABASE {databases[name]}")
        migrate.upgrade(cluster.url(databases[name]))
    nodes = {name: Node(name, clusters[name].url(databases[name]), tmp_path) for name in "ab"}
    serve_pair(nodes["a"], nodes["b"])

    def taken_back(name, backup):
        nodes[name].stop()
        nodes[name].engine.dispose()
        server = clusters[name].restore(backup)
        nodes[name] = Node(name, server.url(databases[name]), tmp_path, port=nodes[name].port)
        nodes[name].start()
        return nodes[name]

    yield taken_back, nodes, clusters
    stop_all(*nodes.values())
    for cluster in clusters.values():
        cluster.stop("immediate")


def test_both_nodes_taken_back_to_the_same_moment_go_on_from_there_with_nothing_to_heal(both_on_clusters):
    """Both restored from base backups taken at the same quiet moment agree on every conversation as it was then,
    and go on without any loss found."""
    taken_back, nodes, clusters = both_on_clusters
    a, b = nodes["a"], nodes["b"]
    handles = conversations_begun(a, CONVERSATIONS)
    send(a, handles, 30, "before")
    received(b, "warehouse_queue", 30)
    drained(a, b)
    backups = {name: cluster.base_backup("before") for name, cluster in clusters.items()}
    send(a, handles, 30, "after")  # lost on both sides alike
    received(b, "warehouse_queue", 30)
    drained(a, b)
    a, b = (taken_back(name, backups[name]) for name in "ab")
    later = send(a, handles, 30, "later")
    at_b = received(b, "warehouse_queue", 30)
    for handle, conversation_id in conversation_ids(a, handles).items():
        assert at_b[conversation_id] == [("order.note", body) for body in later[handle]]
    drained(a, b)
    for node in (a, b):
        assert lost_messages(node) == []
        code, findings = _diagnose(node)
        assert code == 0, [f for f in findings if f["level"] != "ok"]


def exchange(a, b, from_a, from_b, label):
    """Two messages on each conversation each node began, both ways, received and acknowledged: what each node's
    application got, by conversation id."""
    sent_by_a, sent_by_b = send(a, from_a, 2 * len(from_a), label), send(b, from_b, 2 * len(from_b), label)
    at_b, at_a = received(b, "warehouse_queue", 2 * len(from_a)), received(a, "shop_queue", 2 * len(from_b))
    drained(a, b)
    return sent_by_a, sent_by_b, at_a, at_b


def renumbered(notice_body):
    notice = json.loads(notice_body)
    return notice["first_number"], notice["last_number"], notice["next_number"]


def test_both_nodes_taken_back_to_different_moments_with_traffic_both_ways(both_on_clusters):
    """a goes back to a moment before b does, and messages flowed both ways before, between and after those
    moments.  Each message is delivered once and in order, or named: b holds a's messages of the second exchange,
    which a no longer knows, so a's new ones are numbered past them behind a broker.renumbered notice; a lost b's
    messages of the second exchange, which b sends again from its resend window before its new ones.  The third
    exchange came after both moments: kept by neither database, nor was the work that sent it, and not reported."""
    taken_back, nodes, clusters = both_on_clusters
    a, b = nodes["a"], nodes["b"]
    from_a = conversations_begun(a, 2)
    with b.engine.begin() as c:
        from_b = [broker.begin_dialog(c, "warehouse", "shop", "orders") for _ in range(2)]
    exchange(a, b, from_a, from_b, "first")
    a_backup = clusters["a"].base_backup("a")
    _, second_by_b, _, _ = exchange(a, b, from_a, from_b, "second")
    b_backup = clusters["b"].base_backup("b")
    exchange(a, b, from_a, from_b, "third")
    a, b = taken_back("a", a_backup), taken_back("b", b_backup)

    fourth_by_a, fourth_by_b = send(a, from_a, 6, "fourth"), send(b, from_b, 6, "fourth")  # three on each
    at_b = received(b, "warehouse_queue", 6 + len(from_a))
    for handle, conversation_id in conversation_ids(a, from_a).items():
        (kind, notice), *rest = at_b[conversation_id]
        assert kind == "broker.renumbered" and renumbered(notice) == (3, 4, 6)
        assert rest == [("order.note", body) for body in fourth_by_a[handle]]
    at_a = received(a, "shop_queue", 4 + 6 + len(from_a))  # a's own notices of its renumbering come to it too
    for handle, conversation_id in conversation_ids(b, from_b).items():
        assert at_a[conversation_id] == [("order.note", body) for body in second_by_b[handle] + fourth_by_b[handle]]
    drained(a, b)
    assert lost_messages(a) == sorted([("sent", "renumbered", 3, 4)] * len(from_a)
                                      + [("received", "resent", 3, 4)] * len(from_b))
    assert lost_messages(b) == sorted([("received", "renumbered", 3, 4)] * len(from_a)
                                      + [("sent", "resent", 3, 4)] * len(from_b))
    for node in (a, b):
        code, findings = _diagnose(node)
        assert code == 0, [f for f in findings if f["level"] == "error"]


def test_a_sender_taken_back_is_numbered_past_what_its_receiver_holds_before_anything_new_is_delivered(
        both_on_clusters):
    """b holds later numbers of some of a's conversations than a, taken back, remembers, and none of the others;
    b's application holds two of them (one of each kind) while the first batches after the restore arrive.  a's new
    messages on the first kind come after a broker.renumbered notice, once and in order; on the second kind they
    simply follow.  Nothing new is delivered before the notice, or out of order, and a deletes nothing on an
    answer given while b's application held the conversation."""
    taken_back, nodes, clusters = both_on_clusters
    a, b = nodes["a"], nodes["b"]
    handles = conversations_begun(a, 4)
    ids = conversation_ids(a, handles)
    send(a, handles, 8, "before")
    received(b, "warehouse_queue", 8)
    drained(a)
    backup = clusters["a"].base_backup("before")
    send(a, handles[:2], 4, "lost by a")  # b holds numbers 3 and 4 of the first two conversations
    received(b, "warehouse_queue", 4)
    drained(a)
    a = taken_back("a", backup)

    b_handles = handles_by_conversation(b, ids.values())
    held = [ids[handles[0]], ids[handles[2]]]
    application = b.engine.connect()
    transaction = application.begin()
    for conversation_id in held:  # b's application replies on them, in a transaction it keeps open
        broker.send(application, b_handles[conversation_id], "order.note", b"a reply")
    try:
        after = send(a, handles, 12, "after")
        wait_for(lambda: len(lost_messages(a)) == 2, 30, "a to number past what b holds")
        assert lost_messages(a) == [("sent", "renumbered", 3, 4)] * 2
        wait_for(lambda: a.scalar("SELECT count(*) FROM broker.transmission_queue_status"
                                  " WHERE transmission_status LIKE 'the far node holds it back%'") > 0, 30,
                 "b to answer that its application holds a conversation")
    finally:
        transaction.commit()
        application.close()
    at_b = received(b, "warehouse_queue", 12 + 2)
    for n, handle in enumerate(handles):
        arrived = at_b[ids[handle]]
        if n < 2:
            (kind, notice), *arrived = arrived
            assert kind == "broker.renumbered" and renumbered(notice) == (3, 4, 6)
        assert arrived == [("order.note", body) for body in after[handle]]
    received(a, "shop_queue", 2 + 2)  # the replies, and a's own notices
    drained(a, b)
    code, findings = _diagnose(a)
    assert code == 0, [f for f in findings if f["level"] == "error"]
    assert sum(f["level"] == "warning" and "renumbered" in f["finding"] for f in findings) == 2


def test_a_database_restored_by_pg_dump_into_a_cluster_behind_it_makes_its_new_positions_after_its_old_ones(
        tmp_path):
    """Queue positions are made of transaction ids, and a new cluster's are behind those of the cluster a dump came
    from: a message sent after the restore would take a position below the ingest's checkpoint, and no bulk
    reader would ever see it.  The node's relay finds that when it starts and makes positions go on after the old
    ones (broker.continue_queue_positions)."""
    old, new = (Cluster.initdb(tmp_path / name, name).start() for name in ("old", "new"))
    try:
        admin_execute(old.url(), "CREATE DATABASE shop")
        migrate.upgrade(old.url("shop"))
        for _ in range(3000):  # the old cluster has lived longer than the new one
            old.query("SELECT pg_current_xact_id()")
        engine = create_engine(old.url("shop"))
        with engine.begin() as c:
            factories.define_orders(c)
            handle = factories.begin(c)
            for n in range(3):
                broker.send(c, handle, "order.note", f"before the dump {n}".encode())
        with engine.connect() as c:  # an ingest took them
            assert checkpoints.try_lock(c, factories.WAREHOUSE_QUEUE, "lake")
            after, up_to = checkpoints.start(c, factories.WAREHOUSE_QUEUE, "lake")
            checkpoints.advance(c, factories.WAREHOUSE_QUEUE, "lake", after, up_to, "run-1", 3, consume=False)
            c.commit()
        engine.dispose()
        dump = tmp_path / "shop.dump"
        subprocess.run([str(old.bin_dir / "pg_dump"), "-Fc", "-f", str(dump), old.url("shop")], check=True)
        migrate.upgrade(new.url())  # the broker's roles, which a dump of one database does not carry
        admin_execute(new.url(), "CREATE DATABASE shop")
        subprocess.run([str(new.bin_dir / "pg_restore"), "--exit-on-error", "-d", new.url("shop"), str(dump)],
                       check=True)
        restored = create_engine(new.url("shop"))
        with restored.connect() as c:
            checkpoint = c.exec_driver_sql("SELECT queue_position FROM broker.ingest_checkpoints").scalar_one()
            assert c.exec_driver_sql("SELECT broker._queue_position_now()").scalar_one() < checkpoint

        relay = start_broker(new.url("shop"), tmp_path / "relay.log", "relay")
        try:
            wait_for(lambda: new.query("SELECT xid_offset FROM broker.queue_position_base", database="shop")[0][0] > 0,
                     30, "the relay to make positions go on after the old ones")
        finally:
            stop(relay)
        assert "restored into a cluster whose transaction ids are behind" in (tmp_path / "relay.log").read_text()
        with restored.begin() as c:
            broker.send(c, handle, "order.note", b"after the restore")
        with restored.connect() as c:
            [position] = c.exec_driver_sql("SELECT queue_position FROM broker.queue_messages WHERE body = %s",
                                           (b"after the restore",)).scalars()
            assert position > checkpoint
            assert checkpoints.try_lock(c, factories.WAREHOUSE_QUEUE, "lake")
            after, up_to = checkpoints.start(c, factories.WAREHOUSE_QUEUE, "lake")
            assert after == checkpoint and up_to >= position
            assert checkpoints.lag(c, factories.WAREHOUSE_QUEUE, "lake")[0] == 1
        restored.dispose()
    finally:
        old.stop("immediate")
        new.stop("immediate")
