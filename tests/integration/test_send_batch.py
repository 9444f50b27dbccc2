"""broker.send_batch: many messages in one statement, numbered and checked as broker.send numbers and checks them."""
import random
import threading
from uuid import uuid4

import pytest
from sqlalchemy import text

import broker
from broker.errors import translated_errors
from tests.factories import SHOP, WAREHOUSE_QUEUE, begin, broker_table_counts, target_handle

FAR_AWAY = "far_away"


def _at_once(engine, actions, transactions: int = 30) -> list[Exception]:
    """Each action in a thread of its own, in `transactions` transactions one after another; what they raised."""
    errors = []

    def run(action) -> None:
        try:
            for _ in range(transactions):
                with engine.begin() as c:
                    action(c)
        except Exception as error:  # returned to the test
            errors.append(error)

    threads = [threading.Thread(target=run, args=(action,)) for action in actions]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return errors


@pytest.fixture
def remote(engine, orders):
    """Three conversations with a service on another node (no relay runs: messages stay queued)."""
    with engine.begin() as c:
        broker.create_route(c, FAR_AWAY, "http://127.0.0.1:9/", uuid4(), "a-secret-of-16-chars")
        return [broker.begin_dialog(c, SHOP, FAR_AWAY, "orders") for _ in range(3)]


def _queued(connection):
    return [tuple(row) for row in connection.execute(text(
        "SELECT conversation_handle, message_sequence_number, convert_from(body, 'UTF8')"
        " FROM broker.transmission_log ORDER BY conversation_handle, message_sequence_number"))]


def test_each_conversation_is_numbered_in_the_order_given(engine, remote):
    first, second, third = remote
    with engine.begin() as c:
        assert broker.send(c, second, "order.note", "before") == 1
        numbers = broker.send_batch(c, [first, second, first, third, first], "order.note", ["a", "b", "c", "d", "e"])
    assert numbers == [1, 2, 2, 1, 3]
    with engine.begin() as c:
        assert sorted(_queued(c)) == sorted([(first, 1, "a"), (first, 2, "c"), (first, 3, "e"), (second, 1, "before"),
                                             (second, 2, "b"), (third, 1, "d")])
        assert broker.send(c, first, "order.note", "after") == 4
        assert broker.send_batch(c, [], "order.note", []) == []


def test_local_conversations_are_delivered_in_the_sending_transaction(engine, orders):
    with engine.begin() as c:
        handles = [begin(c) for _ in range(2)]
        assert broker.send_batch(c, [handles[0], handles[1], handles[0]], "order.submit",
                                 ['{"n": 1}', '{"n": 2}', '{"n": 3}']) == [1, 1, 2]
    with engine.begin() as c:
        first_target = target_handle(c, handles[0])
        received = broker.receive(c, WAREHOUSE_QUEUE, 10) + broker.receive(c, WAREHOUSE_QUEUE, 10)
    assert sorted((m.conversation_handle == first_target, m.message_sequence_number, m.json()["n"]) for m in received) \
        == [(False, 1, 2), (True, 1, 1), (True, 2, 3)]


@pytest.mark.parametrize("case", ["closed conversation", "type the target sends", "body too large"])
def test_a_bad_message_refuses_the_whole_batch(engine, remote, case):
    first, second, third = remote
    with engine.begin() as c:
        if case == "closed conversation":
            broker.end_conversation(c, second)
        elif case == "body too large":
            c.execute(text("UPDATE broker.node SET max_message_bytes = 10"))
        before = broker_table_counts(c)
        sequences = c.execute(text("SELECT sum(send_sequence) FROM broker.endpoints")).scalar_one()
    message_type = "order.ack" if case == "type the target sends" else "order.note"
    body = "x" * 11 if case == "body too large" else None
    expected = {"closed conversation": broker.ConversationClosed, "type the target sends": broker.NotAllowed,
                "body too large": broker.MessageTooLarge}[case]
    with engine.connect() as c, pytest.raises(expected):
        broker.send_batch(c, [first, second, third], message_type, [None, None, body])
    with engine.begin() as c:
        assert broker_table_counts(c) == before
        assert c.execute(text("SELECT sum(send_sequence) FROM broker.endpoints")).scalar_one() == sequences


@pytest.mark.parametrize("handles,bodies,words", [
    (lambda r: [r[0], r[1]], ["only one"], "give one body per handle"),
    (lambda r: [r[0], None], None, "without NULL"),
], ids=["bodies of another length", "a NULL handle"])
def test_malformed_arguments_are_invalid(engine, remote, handles, bodies, words):
    with engine.connect() as c, pytest.raises(broker.InvalidArgument, match=words) as raised, translated_errors():
        c.execute(text("SELECT broker.send_batch(CAST(:handles AS uuid[]), 'order.note', CAST(:bodies AS bytea[]))"),
                  {"handles": [None if h is None else str(h) for h in handles(remote)],
                   "bodies": None if bodies is None else [b.encode() for b in bodies]})
    assert raised.value.sqlstate == "BR050"


def test_invariant_2_concurrent_batches_over_the_same_conversations_number_without_gaps(engine, remote):
    """Batches naming the conversations in opposite orders lock them in one order: no deadlock, no gap."""
    assert _at_once(engine, [lambda c, order=order: broker.send_batch(c, order, "order.note", None)
                             for order in (remote, remote[::-1]) * 2]) == []
    with engine.begin() as c:
        numbers = c.execute(text("SELECT conversation_handle, array_agg(message_sequence_number ORDER BY message_sequence_number)"
                                 " FROM broker.transmission_log GROUP BY 1")).all()
    assert {handle: list(sequence) for handle, sequence in numbers} == {h: list(range(1, 121)) for h in remote}


QUEUED_AT_THE_FAR_SIDE = text(
    "SELECT e.conversation_handle AS sender, m.message_sequence_number, convert_from(m.body, 'UTF8') AS body,"
    " q.name AS queue, m.conversation_group_id = far.conversation_group_id AS in_far_group, m.notice_after,"
    " m.delivery_count, m.received_at"
    " FROM broker.queue_messages m JOIN broker.queues q USING (queue_id)"
    " JOIN broker.endpoints far ON far.conversation_handle = m.conversation_handle"
    " JOIN broker.endpoints e ON e.conversation_id = m.conversation_id AND e.is_initiator <> far.is_initiator"
    " WHERE e.conversation_handle = ANY(:handles) ORDER BY m.queue_position")
SEQUENCES = text("SELECT conversation_handle, send_sequence, receive_sequence, state FROM broker.endpoints"
                 " WHERE conversation_id IN (SELECT conversation_id FROM broker.endpoints"
                 "                           WHERE conversation_handle = ANY(:handles))")


def _local_pairs(connection, count: int) -> list[tuple]:
    """count local conversations: (initiator handle, target handle) each."""
    return [(handle, target_handle(connection, handle)) for handle in (begin(connection) for _ in range(count))]


def _outcome(connection, pairs, relabel: dict) -> tuple:
    """What a series of sends left behind, with handles relabelled so that two series can be compared."""
    handles = [h for pair in pairs for h in pair]
    rows = [(relabel[r.sender], *tuple(r)[1:]) for r in connection.execute(QUEUED_AT_THE_FAR_SIDE, {"handles": handles})]
    sequences = sorted((relabel[r.conversation_handle], *tuple(r)[1:])
                       for r in connection.execute(SEQUENCES, {"handles": handles}))
    return rows, sequences


def test_a_batch_to_local_far_sides_leaves_what_broker_send_leaves(engine, orders):
    """Both directions of one conversation, repeated handles and several queues in one batch: the same
    numbers, queue rows (order, groups, queues) and endpoint sequences as one broker.send per message."""
    with engine.begin() as c:
        batched, one_by_one = _local_pairs(c, 3), _local_pairs(c, 3)
    script = [(0, 0, "a"), (1, 0, "b"), (0, 1, "c"), (0, 0, "d"), (2, 0, "e"), (0, 1, "f"), (1, 1, "g")]
    with engine.begin() as c:
        numbers = broker.send_batch(c, [batched[p][side] for p, side, _ in script], "order.note",
                                    [body for _, _, body in script])
    with engine.begin() as c:
        assert numbers == [broker.send(c, one_by_one[p][side], "order.note", body) for p, side, body in script]
    assert numbers == [1, 1, 1, 2, 1, 2, 1]
    relabel = {h: (p, side) for pairs in (batched, one_by_one) for p, pair in enumerate(pairs) for side, h in enumerate(pair)}
    with engine.begin() as c:
        assert _outcome(c, batched, relabel) == _outcome(c, one_by_one, relabel)
        received = [(m.conversation_handle, m.message_sequence_number, m.body.decode())
                    for m in broker.receive(c, WAREHOUSE_QUEUE, 10)]
    first_target = batched[0][1]
    assert received == [(first_target, 1, "a"), (first_target, 2, "d")]  # the oldest group, in order


def test_a_batch_to_a_disabled_local_queue_is_refused_whole(engine, orders):
    with engine.begin() as c:
        pairs = _local_pairs(c, 2)
        broker.alter_queue(c, WAREHOUSE_QUEUE, enabled=False)
        before = broker_table_counts(c)
    with engine.connect() as c, pytest.raises(broker.QueueDisabled):
        broker.send_batch(c, [pairs[0][0], pairs[1][1], pairs[1][0]], "order.note", None)
    with engine.begin() as c:
        assert broker_table_counts(c) == before


def test_invariant_2_batches_and_replies_on_local_conversations_never_deadlock_or_skip(engine, orders):
    """Batches naming local conversations in opposite orders, beside single sends from the target side (each
    locks one conversation, the initiator's endpoint first): no deadlock, every number once, none skipped."""
    with engine.begin() as c:
        pairs = _local_pairs(c, 3)
    initiators, targets = [i for i, _ in pairs], [t for _, t in pairs]
    assert _at_once(engine, [lambda c: broker.send_batch(c, initiators, "order.note", None),
                             lambda c: broker.send_batch(c, initiators[::-1] + targets, "order.note", None),
                             *[lambda c, t=t: broker.send(c, t, "order.note") for t in targets]]) == []
    with engine.begin() as c:
        rows = c.execute(QUEUED_AT_THE_FAR_SIDE, {"handles": initiators + targets}).all()
    by_sender = {}
    for row in rows:
        by_sender.setdefault(row.sender, []).append(row.message_sequence_number)
    # queue positions follow transaction ids, not the order in which waiting transactions got the locks
    # (as when an application wrote before it sent); receive hands a conversation out by its numbers
    assert {h: sorted(numbers) for h, numbers in by_sender.items()} == {
        **{h: list(range(1, 61)) for h in initiators}, **{h: list(range(1, 61)) for h in targets}}


def _apply_numbered(engine, messages, one_by_one: bool):
    """The batch through broker.send_numbered_batch, or through broker.send_numbered one message at a time in one
    transaction: what each returned, or the refusal (its SQLSTATE and expected number)."""
    try:
        with engine.begin() as c:
            if one_by_one:
                return [broker.send_numbered(c, *message) for message in messages]
            return broker.send_numbered_batch(c, messages)
    except broker.SequenceConflict as conflict:
        return conflict.sqlstate, conflict.expected_sequence_number, "out of turn" in str(conflict)


def test_a_numbered_batch_is_judged_as_numbered_sends_one_after_another(engine, orders, remote):
    """Random batches (the next numbers, repeats within the batch and of what was stored, other contents, numbers
    out of turn; plain and validated types; local and remote far sides) give the same answers, refusals and
    stored messages through send_numbered_batch as through send_numbered in turn."""
    rng = random.Random(20261123)
    with engine.begin() as c:
        local = [begin(c) for _ in range(4)]
        more_remote = [broker.begin_dialog(c, SHOP, FAR_AWAY, "orders") for _ in range(2)]
    twins = list(zip(local[:2] + remote[:1], local[2:] + more_remote[:1]))  # (batched, one by one)
    sent = [0] * len(twins)
    for step in range(60):
        plan = []
        for _ in range(rng.randint(1, 8)):
            i = rng.randrange(len(twins))
            number = max(1, sent[i] + 1 + rng.choice([0, 0, 0, 1, -1, -2, 2]))
            message_type, body = rng.choice([("order.note", f"n{number}"), ("order.note", "other"),
                                             ("order.submit", f'{{"n": {number}}}')])
            plan.append((i, number, message_type, body))
            sent[i] = max(sent[i], number)
        batched = _apply_numbered(engine, [(twins[i][0], n, t, b) for i, n, t, b in plan], one_by_one=False)
        in_turn = _apply_numbered(engine, [(twins[i][1], n, t, b) for i, n, t, b in plan], one_by_one=True)
        assert batched == in_turn, (step, plan)
        with engine.begin() as c:
            sent = [c.execute(text("SELECT send_sequence FROM broker.endpoints WHERE conversation_handle = :h"),
                              {"h": h}).scalar_one() for h, _ in twins]
    with engine.begin() as c:
        stored = {h: c.execute(text(
            "SELECT array_agg((n, t, b) ORDER BY n)::text FROM ("
            " SELECT message_sequence_number n, message_type_id t, body b FROM broker.queue_messages m"
            "  JOIN broker.endpoints far ON far.conversation_handle = m.conversation_handle"
            "  JOIN broker.endpoints e ON e.conversation_id = far.conversation_id AND e.is_initiator"
            "  WHERE e.conversation_handle = :h"
            " UNION ALL SELECT message_sequence_number, message_type_id, body FROM broker.transmission_log"
            "  WHERE conversation_handle = :h) s"), {"h": h}).scalar_one() for pair in twins for h in pair}
    assert all(stored[a] == stored[b] and stored[a] for a, b in twins)
    assert sum(sent) > 20
