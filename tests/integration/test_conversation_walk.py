"""A seeded random walk over the edges of conversations, SQL and REST readers mixed: begin (with and
without a lifetime), send, receive and commit or roll back, lease, complete, abandon, let a lease expire,
end (with and without an error), poison.  Whatever the walk does, no queue answers 500, no call fails with
anything but the broker's own refusals, each conversation's messages are consumed once each and in order,
and every message sent is consumed, dead-lettered with a reason, or still waiting."""
import random
import time
from collections import defaultdict
from datetime import timedelta

import pytest
from sqlalchemy import text

import broker
from tests import factories
from tests.factories import SHOP_QUEUE, WAREHOUSE_QUEUE
from tests.rest import ApiServer, new_key

RECEIVE = "/v1/queues/warehouse_queue/receive"
BEGIN = {"from_service": factories.SHOP, "to_service": factories.WAREHOUSE, "contract": factories.CONTRACT}
CONVERSATION_ID = text("SELECT conversation_id FROM broker.endpoints WHERE conversation_handle = :h")
DEAD_LETTERS = text("SELECT conversation_id, message_sequence_number, reason FROM broker.dead_letters"
                    " WHERE message_type = 'order.note'")
WAITING = text("SELECT m.conversation_id, m.message_sequence_number FROM broker.queue_messages m"
               " JOIN broker.message_types t USING (message_type_id)"
               " JOIN broker.queues q USING (queue_id)"
               " WHERE q.name = 'warehouse_queue' AND t.name = 'order.note' AND m.received_at IS NULL")


class Walk:
    """The walk's state: what was sent, what was consumed, the leases held."""

    def __init__(self, seed: int, engine, client):
        self.rng = random.Random(seed)
        self.engine, self.client = engine, client
        self.open: list = []  # initiator handles that may still send
        self.sent: dict = defaultdict(set)  # conversation id -> numbers of the order.note messages sent
        self.consumed: dict = defaultdict(list)  # conversation id -> numbers consumed, in the order consumed
        self.notes_consumed: set = set()  # (conversation id, number) of the order.note messages consumed
        self.leases: list = []  # (lock token, [(conversation id, number, message type)])

    # Calls that may be refused, never fail otherwise.

    def sql(self, call):
        try:
            with self.engine.begin() as c:
                return call(c)
        except broker.BrokerError as refused:
            return refused

    def rest(self, method: str, url: str, **options):
        response = self.client.request(method, url, **options)
        assert response.status_code < 500, f"{method} {url}: {response.status_code} {response.text}"
        return response

    def consume(self, messages) -> None:
        """Messages consumed by a commit or a completed lease: each once, in order within its conversation."""
        for conversation_id, number, message_type in messages:
            if number == 0:  # a local notice
                continue
            seen = self.consumed[conversation_id]
            assert not seen or number > seen[-1], f"conversation {conversation_id}: {number} after {seen}"
            seen.append(number)
            if message_type == "order.note":
                self.notes_consumed.add((conversation_id, number))

    # The steps.

    def begin(self) -> None:
        lifetime_s = self.rng.choice([None, None, 0.5, 1.5])
        if self.rng.random() < 0.5:
            handle = self.sql(lambda c: factories.begin(
                c, lifetime=timedelta(seconds=lifetime_s) if lifetime_s else None))
        else:
            response = self.rest("POST", "/v1/conversations", json={**BEGIN, "lifetime_s": 1 if lifetime_s else None})
            handle = response.json()["conversation_handle"]
        self.open.append(handle)

    def send(self) -> None:
        if not self.open:
            return self.begin()
        handle = self.rng.choice(self.open)
        with self.engine.connect() as c:
            conversation_id = str(c.execute(CONVERSATION_ID, {"h": handle}).scalar_one())
        for _ in range(self.rng.randint(1, 3)):
            if self.rng.random() < 0.5:
                number = self.sql(lambda c: broker.send(c, handle, "order.note", "note"))
                refused = isinstance(number, broker.BrokerError)
            else:
                response = self.rest("POST", f"/v1/conversations/{handle}/messages",
                                     json={"message_type": "order.note", "body": "note"})
                refused, number = response.status_code != 201, response.json().get("sequence_number")
            if refused:
                self.open.remove(handle)  # ended, or past its lifetime
                return
            self.sent[conversation_id].add(number)

    def receive_and_commit(self) -> None:
        messages = self.sql(lambda c: broker.receive(c, WAREHOUSE_QUEUE, self.rng.randint(1, 5)))
        self.consume([(str(m.conversation_id), m.message_sequence_number, m.message_type) for m in messages])

    def receive_and_fail(self) -> None:
        """A SQL reader whose processing fails: it rolls back and reports the failure, as activation does."""
        with self.engine.connect() as c:
            messages = broker.receive(c, WAREHOUSE_QUEUE, self.rng.randint(1, 5))
            c.rollback()
        if messages:
            self.sql(lambda c: broker.report_processing_failure(c, WAREHOUSE_QUEUE, messages[0].conversation_group_id,
                                                                "the handler failed"))

    def lease(self) -> None:
        response = self.rest("POST", RECEIVE, json={"max_messages": self.rng.randint(1, 5),
                                                    "lock_s": self.rng.choice([0.2, 0.5, 30])})
        if response.status_code == 200:
            received = response.json()
            self.leases.append((received["lock_token"], [
                (m["conversation_id"], m["sequence_number"], m["message_type"]) for m in received["messages"]]))

    def complete(self) -> None:
        if self.leases:
            token, messages = self.leases.pop(self.rng.randrange(len(self.leases)))
            response = self.rest("POST", f"/v1/locks/{token}/complete")
            if response.status_code == 200:
                assert response.json()["completed"] == len(messages)
                self.consume(messages)
            else:
                assert response.json()["type"] == "/problems/lock-lost"

    def abandon(self) -> None:
        if self.leases:
            token, _ = self.leases.pop(self.rng.randrange(len(self.leases)))
            response = self.rest("POST", f"/v1/locks/{token}/abandon")
            assert response.status_code == 200 or response.json()["type"] == "/problems/lock-lost"

    def let_time_pass(self) -> None:
        time.sleep(self.rng.choice([0.1, 0.3]))

    def end(self) -> None:
        if not self.open:
            return
        handle = self.open.pop(self.rng.randrange(len(self.open)))
        ending = self.rng.choice([{}, {"error_code": self.rng.randint(1, 999), "error_description": "cancelled"}])
        if self.rng.random() < 0.5:
            self.sql(lambda c: broker.end_conversation(c, handle, **ending))
        else:
            self.rest("POST", f"/v1/conversations/{handle}/end", json=ending)

    def read_the_initiators_queue(self) -> None:
        self.sql(lambda c: broker.receive(c, SHOP_QUEUE, 10))

    STEPS = {"begin": 2, "send": 6, "receive_and_commit": 3, "receive_and_fail": 2, "lease": 4, "complete": 3,
             "abandon": 2, "let_time_pass": 1, "end": 1, "read_the_initiators_queue": 1}

    def step(self) -> None:
        name = self.rng.choices(list(self.STEPS), weights=list(self.STEPS.values()))[0]
        getattr(self, name)()

    # The invariant.

    def check_every_message_is_accounted_for(self) -> None:
        with self.engine.connect() as c:
            dead = c.execute(DEAD_LETTERS).all()
            waiting = {(str(conversation_id), number) for conversation_id, number in c.execute(WAITING)}
        assert all(reason for _, _, reason in dead)
        dead_lettered = {(str(conversation_id), number) for conversation_id, number, _ in dead}
        sent = {(conversation_id, number) for conversation_id, numbers in self.sent.items() for number in numbers}
        assert not (self.notes_consumed & dead_lettered) and not (self.notes_consumed & waiting)
        assert not (dead_lettered & waiting)
        assert self.notes_consumed | dead_lettered | waiting == sent


def _walk(database_url, engine, seed: int, max_steps: int, max_s: float) -> Walk:
    with engine.begin() as c:
        broker.alter_queue(c, WAREHOUSE_QUEUE, poison_threshold=3)
    with ApiServer(database_url) as server, server.client(new_key(engine, "admin")) as client:
        walk = Walk(seed, engine, client)
        deadline = time.monotonic() + max_s
        for _ in range(max_steps):
            if time.monotonic() > deadline:
                break
            walk.step()
        walk.check_every_message_is_accounted_for()
        # Then every lease ends and the queue is drained: nothing is left waiting, and nothing was lost.
        while walk.leases:
            walk.complete() if walk.rng.random() < 0.5 else walk.abandon()
        for _ in range(1000):
            messages = walk.sql(lambda c: broker.receive(c, WAREHOUSE_QUEUE, 100))
            if not messages:
                break
            walk.consume([(str(m.conversation_id), m.message_sequence_number, m.message_type) for m in messages])
        walk.check_every_message_is_accounted_for()
        with engine.connect() as c:
            assert c.execute(WAITING).all() == []
    return walk


def test_a_random_walk_over_conversation_edges_never_wedges_a_queue_nor_loses_a_message(database_url, engine,
                                                                                        orders):
    walk = _walk(database_url, engine, seed=3, max_steps=600, max_s=45)
    assert walk.sent and walk.notes_consumed


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2, 4, 7])
def test_more_random_walks(database_url, engine, orders, seed):
    _walk(database_url, engine, seed=seed, max_steps=600, max_s=60)
