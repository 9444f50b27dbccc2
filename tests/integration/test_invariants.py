"""The invariants of SPEC.md that hold inside one node, each proved against a real PostgreSQL."""
import itertools
import random
import threading
import time

import pytest
from sqlalchemy import text

import broker
from tests.factories import SHOP_QUEUE, WAREHOUSE_QUEUE, begin, target_handle


def test_invariant_1_durable_on_commit(engine, orders):
    with engine.begin() as c:
        handle = begin(c)
    with engine.connect() as c:
        broker.send(c, handle, "order.note", "rolled back")
        c.rollback()
    with engine.begin() as c:
        assert broker.receive(c, WAREHOUSE_QUEUE, 10) == []
        broker.send(c, handle, "order.note", "committed")
    with engine.begin() as c:
        [message] = broker.receive(c, WAREHOUSE_QUEUE, 10)
    assert (message.body, message.message_sequence_number) == (b"committed", 1)


def test_invariant_1_a_rolled_back_begin_dialog_leaves_nothing(engine, orders):
    with engine.connect() as c:
        begin(c)
        c.rollback()
    with engine.begin() as c:
        assert c.execute(text("SELECT count(*) FROM broker.endpoints")).scalar_one() == 0


def test_invariant_2_numbered_without_gaps_under_concurrent_senders(engine, orders):
    """Eight threads send on one conversation; a third of their transactions roll back."""
    with engine.begin() as c:
        handle = begin(c)
    committed = []
    lock = threading.Lock()

    def sender(seed: int) -> None:
        rng = random.Random(seed)
        for i in range(25):
            with engine.connect() as c:
                number = broker.send(c, handle, "order.note", f"{seed}-{i}")
                time.sleep(rng.random() / 500)
                if rng.random() < 1 / 3:
                    c.rollback()
                else:
                    c.commit()
                    with lock:
                        committed.append(number)

    threads = [threading.Thread(target=sender, args=(seed,)) for seed in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    with engine.begin() as c:
        received = broker.receive(c, WAREHOUSE_QUEUE, 1000)
    numbers = [m.message_sequence_number for m in received]
    assert sorted(committed) == list(range(1, len(committed) + 1))
    assert numbers == list(range(1, len(committed) + 1))


def test_invariant_3_accept_in_order_once_receive_returns_sequence_order(engine, orders):
    with engine.begin() as c:
        handles = [begin(c) for _ in range(3)]
    # Interleave sends across conversations, in separate transactions.
    for i in range(1, 21):
        with engine.begin() as c:
            for handle in handles:
                broker.send(c, handle, "order.note", f"{i}")
    seen: dict = {}
    while True:
        with engine.begin() as c:
            batch = broker.receive(c, WAREHOUSE_QUEUE, 7)
        if not batch:
            break
        for m in batch:
            seen.setdefault(m.conversation_id, []).append((m.message_sequence_number, m.body))
    assert len(seen) == 3
    for messages in seen.values():
        assert messages == [(i, str(i).encode()) for i in range(1, 21)]


def _interleavings(steps_a, steps_b):
    """Every order of two step sequences that keeps each sequence's own order."""
    n = len(steps_a) + len(steps_b)
    for positions in itertools.combinations(range(n), len(steps_a)):
        a, b = iter(steps_a), iter(steps_b)
        yield [next(a) if i in positions else next(b) for i in range(n)]


SCHEDULES = [
    (schedule, ends)
    for ends in itertools.product(["commit", "rollback"], repeat=2)
    for schedule in _interleavings([("A", "receive"), ("A", "end")], [("B", "receive"), ("B", "end")])
]


@pytest.mark.parametrize("conversations", [1, 2])
@pytest.mark.parametrize("schedule,ends", SCHEDULES, ids=lambda v: "-".join(map(str, v)) if isinstance(v, tuple) else None)
def test_invariant_5_one_reader_per_conversation_group(engine, orders, conversations, schedule, ends):
    """Two connections interleave receive and commit/rollback in every order: while both hold a
    receive, they never share a group, and what committed readers consumed is gone exactly once."""
    with engine.begin() as c:
        handles = [begin(c) for _ in range(conversations)]
        for handle in handles:
            for i in range(3):
                broker.send(c, handle, "order.note", str(i))
    connections = {"A": engine.connect(), "B": engine.connect()}
    end_of = dict(zip("AB", ends))
    received: dict[str, list] = {"A": [], "B": []}
    open_groups: dict[str, set] = {}
    consumed = []
    try:
        for reader, step in schedule:
            c = connections[reader]
            if step == "receive":
                received[reader] = broker.receive(c, WAREHOUSE_QUEUE, 10)
                groups = {m.conversation_group_id for m in received[reader]}
                for other, other_groups in open_groups.items():
                    assert not groups & other_groups, f"{reader} and {other} hold the same group"
                open_groups[reader] = groups
            else:
                if end_of[reader] == "commit":
                    c.commit()
                    consumed += [m.queue_position for m in received[reader]]
                else:
                    c.rollback()
                open_groups.pop(reader, None)
    finally:
        for c in connections.values():
            c.close()
    with engine.begin() as c:
        left = c.execute(text("SELECT queue_position FROM broker.queue_messages")).scalars().all()
    assert len(consumed) == len(set(consumed))
    assert sorted(consumed + list(left)) == sorted(set(consumed) | set(left))
    assert len(consumed) + len(left) == 3 * conversations


def test_invariant_5_a_locked_group_is_skipped_not_waited_for(engine, orders):
    with engine.begin() as c:
        first, second = begin(c), begin(c)
        broker.send(c, first, "order.note", "first")
        broker.send(c, second, "order.note", "second")
    with engine.connect() as a, engine.connect() as b:
        [got_a] = broker.receive(a, WAREHOUSE_QUEUE)
        started = time.monotonic()
        [got_b] = broker.receive(b, WAREHOUSE_QUEUE)
        assert time.monotonic() - started < 1
        assert got_a.conversation_group_id != got_b.conversation_group_id
        assert broker.receive(b, WAREHOUSE_QUEUE) == []  # b holds its group; a's is locked
        a.rollback()
        b.rollback()


def test_rollback_returns_messages(engine, orders):
    with engine.begin() as c:
        handle = begin(c)
        broker.send(c, handle, "order.note", "x")
    with engine.connect() as c:
        assert len(broker.receive(c, WAREHOUSE_QUEUE)) == 1
        c.rollback()
    with engine.begin() as c:
        [again] = broker.receive(c, WAREHOUSE_QUEUE)
        assert again.body == b"x"


def test_commit_consumes_messages(engine, orders):
    with engine.begin() as c:
        handle = begin(c)
        broker.send(c, handle, "order.note", "x")
    with engine.begin() as c:
        assert len(broker.receive(c, WAREHOUSE_QUEUE)) == 1
    with engine.begin() as c:
        assert broker.receive(c, WAREHOUSE_QUEUE) == []


def _read_committed_range(connection, after: int) -> list[int]:
    """What a bulk reader reads: positions above its checkpoint and below the committed horizon."""
    return connection.execute(text(
        "SELECT queue_position FROM broker.queue_messages"
        " WHERE queue_position > :after AND queue_position < broker.committed_position_horizon()"
        " ORDER BY queue_position"), {"after": after}).scalars().all()


def test_invariant_6_a_late_commit_is_never_below_what_a_reader_has_seen(engine, orders):
    """T1 sends first but commits last. A reader of "id > last seen" would skip T1's row;
    a reader bounded by the committed horizon waits for it."""
    with engine.begin() as c:
        handle_1, handle_2 = begin(c), begin(c)
    t1, t2 = engine.connect(), engine.connect()
    try:
        broker.send(t1, handle_1, "order.note", "early, committed late")
        broker.send(t2, handle_2, "order.note", "late, committed early")
        t2.commit()
        with engine.begin() as reader:
            naive_seen = reader.execute(text("SELECT max(queue_position) FROM broker.queue_messages")).scalar_one()
            assert _read_committed_range(reader, 0) == []
        t1.commit()
        with engine.begin() as reader:
            t1_position = reader.execute(text(
                "SELECT queue_position FROM broker.queue_messages WHERE body = 'early, committed late'")).scalar_one()
            assert t1_position < naive_seen  # what an id-based reader would have skipped
            assert len(_read_committed_range(reader, 0)) == 2
    finally:
        t1.close()
        t2.close()


def test_invariant_6_positions_never_skippable_under_concurrent_writers(engine, orders):
    """Writers hold their transactions open for random times and commit out of position order,
    while a bulk reader keeps reading above its checkpoint: it sees every row exactly once."""
    with engine.begin() as c:
        broker.alter_queue(c, WAREHOUSE_QUEUE, retention=True)
        handles = [begin(c) for _ in range(6)]
    stop = threading.Event()

    def writer(handle, seed):
        rng = random.Random(seed)
        for i in range(15):
            with engine.begin() as c:
                broker.send(c, handle, "order.note", f"{seed}-{i}")
                time.sleep(rng.random() * 0.03)

    read: list[int] = []

    def reader():
        checkpoint = 0
        while True:
            finished = stop.is_set()
            with engine.begin() as c:
                batch = _read_committed_range(c, checkpoint)
            read.extend(batch)
            checkpoint = max(batch, default=checkpoint)
            if finished:
                return
            time.sleep(0.002)

    writers = [threading.Thread(target=writer, args=(h, s)) for s, h in enumerate(handles)]
    reading = threading.Thread(target=reader)
    reading.start()
    for w in writers:
        w.start()
    for w in writers:
        w.join()
    stop.set()
    reading.join()
    with engine.begin() as c:
        everything = c.execute(text("SELECT queue_position FROM broker.queue_messages ORDER BY 1")).scalars().all()
    assert len(everything) == 6 * 15
    assert read == everything  # each row once, in position order, none skipped


def test_shop_queue_gets_replies_in_order(engine, orders):
    with engine.begin() as c:
        handle = begin(c)
        broker.send(c, handle, "order.submit", '{"sku": "A-1"}')
    with engine.begin() as c:
        [order] = broker.receive(c, WAREHOUSE_QUEUE)
        assert order.json() == {"sku": "A-1"}
        for i in range(5):
            broker.send(c, order.conversation_handle, "order.note", f"reply {i}")
        broker.send(c, order.conversation_handle, "order.ack")
    with engine.begin() as c:
        replies = broker.receive(c, SHOP_QUEUE, 100)
    assert [(m.message_sequence_number, m.message_type) for m in replies] == (
        [(i, "order.note") for i in range(1, 6)] + [(6, "order.ack")])
    assert all(m.conversation_handle == handle for m in replies)
    with engine.begin() as c:
        assert target_handle(c, handle) == order.conversation_handle
