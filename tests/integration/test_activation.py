"""Internal activation: a queue's procedure declared in SQL (broker.set_queue_activation) and called by a real
`broker serve` process while the queue has messages."""
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from sqlalchemy import text

import broker
from broker import api_keys, queries
from broker.schema import execute_script
from tests.nodes import Node, wait_for

TUTORIAL = Path(__file__).parents[1] / "sql" / "internal_activation.sql"

# An application's queue and a procedure that records each message it receives, as the role "worker": "fail" in
# a body makes it raise; a number makes it sleep that many seconds first.
APPLICATION = """
SELECT broker.create_message_type('job');
SELECT broker.create_contract('jobs', '{"job": "initiator"}');
SELECT broker.create_queue('client_queue');
SELECT broker.create_service('client', 'client_queue');
SELECT broker.create_queue('job_queue', poison_threshold => 2);
SELECT broker.create_service('jobs', 'job_queue', ARRAY['jobs']);
CREATE TABLE done (body text NOT NULL, readers bigint NOT NULL);
CREATE PROCEDURE do_jobs(queue text)
LANGUAGE plpgsql AS $$
DECLARE
    received record;
    body text;
BEGIN
    FOR received IN SELECT * FROM broker.receive(queue, 1) LOOP
        CONTINUE WHEN received.message_type <> 'job';
        body := convert_from(received.body, 'UTF8');
        IF body LIKE 'fail%' THEN
            RAISE EXCEPTION 'cannot do job %', body;
        END IF;
        IF body ~ '^[0-9.]+$' THEN
            PERFORM pg_sleep(body::float8);
        END IF;
        INSERT INTO done VALUES (body, (SELECT readers FROM broker.activation_status WHERE queue_name = queue));
    END LOOP;
END $$;
DO $$
BEGIN
    CREATE ROLE worker NOLOGIN;
EXCEPTION WHEN duplicate_object THEN
    NULL;
END $$;
GRANT broker_application TO worker;
GRANT SELECT, INSERT ON done TO worker;
"""


def _define(node: Node, script: str) -> None:
    with node.engine.begin() as connection:
        execute_script(connection, script)


def _send_jobs(node: Node, *bodies: str, conversations: bool = True) -> None:
    """The bodies as jobs: each on a conversation of its own, or all on one."""
    with node.engine.begin() as connection:
        handle = None
        for body in bodies:
            if conversations or handle is None:
                handle = broker.begin_dialog(connection, "client", "jobs", "jobs")
            broker.send(connection, handle, "job", body)


def _done(node: Node) -> list[str]:
    with node.engine.connect() as connection:
        return sorted(connection.execute(text("SELECT body FROM done")).scalars())


def _status(node: Node, queue: str = "job_queue"):
    with node.engine.connect() as connection:
        return next(row for row in connection.execute(queries.QUERIES["activation_status"]) if row.queue_name == queue)


@pytest.fixture
def node(database_url, tmp_path):
    node = Node("activation", database_url, tmp_path)
    _define(node, APPLICATION)
    yield node
    node.stop()
    node.engine.dispose()


# --- Declaring it ---------------------------------------------------------------------------------

def _refused(connection, sqlstate: str, **arguments) -> str:
    with pytest.raises(broker.BrokerError) as refused, connection.begin_nested():
        broker.set_queue_activation(connection, **arguments)
    assert refused.value.sqlstate == sqlstate, refused.value.message
    return refused.value.message


def test_a_declaration_names_a_procedure_taking_the_queue_and_a_role_that_may_run_it(rolled_back):
    execute_script(rolled_back, APPLICATION + """
        CREATE FUNCTION not_a_procedure(queue text) RETURNS void LANGUAGE sql AS 'SELECT';
        CREATE PROCEDURE no_queue() LANGUAGE sql AS 'SELECT';
        CREATE ROLE outsider NOLOGIN;
    """)
    assert "no procedure missing(queue text)" in _refused(rolled_back, "BR080", queue="job_queue",
                                                          procedure_name="missing")
    _refused(rolled_back, "BR080", queue="job_queue", procedure_name="not_a_procedure")
    _refused(rolled_back, "BR080", queue="job_queue", procedure_name="no_queue")
    _refused(rolled_back, "BR080", queue="job_queue", procedure_name="do_jobs(text); DROP TABLE done; --")
    assert "superuser" in _refused(rolled_back, "BR081", queue="job_queue", procedure_name="do_jobs")  # its owner
    assert "broker.receive" in _refused(rolled_back, "BR081", queue="job_queue", procedure_name="do_jobs",
                                        execute_as="outsider")
    _refused(rolled_back, "BR081", queue="job_queue", procedure_name="do_jobs", execute_as="nobody here")
    _refused(rolled_back, "BR050", queue="job_queue", procedure_name="do_jobs", execute_as="worker",
             max_queue_readers=0)
    _refused(rolled_back, "BR050", queue="job_queue", procedure_name="do_jobs", execute_as="worker",
             max_queue_readers=101)
    _refused(rolled_back, "BR050", queue="job_queue", execute_as="worker")  # no procedure yet
    _refused(rolled_back, "BR004", queue="no_such_queue", procedure_name="do_jobs", execute_as="worker")

    broker.set_queue_activation(rolled_back, "job_queue", "do_jobs", max_queue_readers=4, execute_as="worker")
    broker.set_queue_activation(rolled_back, "job_queue", enabled=False)  # the rest as it was
    row = rolled_back.execute(queries.QUERIES["activation_status"]).first()
    assert (row.queue_name, row.procedure_name, row.status, row.max_queue_readers, row.execute_as, row.readers,
            row.activations, row.failures) == ("job_queue", "public.do_jobs", "off", 4, "worker", 0, 0, 0)
    broker.drop_queue_activation(rolled_back, "job_queue")
    assert rolled_back.execute(queries.QUERIES["activation_status"]).all() == []
    with pytest.raises(broker.UnknownObject), rolled_back.begin_nested():
        broker.drop_queue_activation(rolled_back, "job_queue")


# --- The node runs it -----------------------------------------------------------------------------

def test_the_tutorial_target_replies_and_ends_its_side(database_url, tmp_path):
    """Service Broker's internal activation tutorial: the initiator sends a request, the target's activated
    procedure replies, the initiator ends the conversation, and the procedure ends the target's side."""
    node = Node("tutorial", database_url, tmp_path)
    try:
        _define(node, TUTORIAL.read_text())
        node.start()
        with node.engine.begin() as c:
            handle = broker.begin_dialog(c, "//AWDB/InternalAct/InitiatorService", "//AWDB/InternalAct/TargetService",
                                         "//AWDB/InternalAct/SampleContract")
            broker.send(c, handle, "//AWDB/InternalAct/RequestMessage", "<RequestMsg>Message for Target service.</RequestMsg>")
        with node.engine.begin() as c:
            [reply] = broker.receive(c, "InitiatorQueueIntAct", wait_ms=20000)
            assert (reply.message_type, reply.body) == ("//AWDB/InternalAct/ReplyMessage",
                                                        b"<ReplyMsg>Message for Initiator service.</ReplyMsg>")
            broker.end_conversation(c, handle)
        wait_for(lambda: node.scalar("SELECT count(*) FROM broker.conversation_endpoints"
                                     " WHERE state NOT IN ('closed')") == 0, 20, "both sides to close")
        assert node.scalar("SELECT depth FROM broker.queue_status WHERE queue_name = 'TargetQueueIntAct'") == 0
        wait_for(lambda: _status(node, "TargetQueueIntAct").activations >= 2, 5,  # the request, the end of dialog
                 "the activations recorded")
    finally:
        node.stop()
        node.engine.dispose()


def test_each_message_is_done_once_by_readers_that_grow_with_the_backlog_and_go(node):
    with node.engine.begin() as c:
        broker.set_queue_activation(c, "job_queue", "do_jobs", max_queue_readers=3, execute_as="worker")
    node.start()
    jobs = ["0.1"] * 40 + [f"job {n}" for n in range(100)]
    _send_jobs(node, *jobs)
    wait_for(lambda: len(_done(node)) >= len(jobs), 60, "every job done")
    wait_for(lambda: _status(node).readers == 0, 10, "the readers to go once the queue is empty")
    assert _done(node) == sorted(jobs)  # each once
    assert node.scalar("SELECT max(readers) FROM done") == 3
    wait_for(lambda: _status(node).activations >= len(jobs), 5, "the activations recorded")


def test_a_procedure_that_raises_rolls_back_and_its_message_ends_in_the_dead_letters(node):
    with node.engine.begin() as c:
        broker.set_queue_activation(c, "job_queue", "do_jobs", execute_as="worker")
    node.start()
    _send_jobs(node, "fail me", "then me", conversations=False)
    _send_jobs(node, "another conversation")
    wait_for(lambda: node.scalar("SELECT count(*) FROM broker.dead_letters") == 2, 30, "the quarantine")
    wait_for(lambda: _done(node) == ["another conversation"], 10, "the other conversation's job done")
    assert node.scalar("SELECT string_agg(convert_from(body, 'UTF8'), ',' ORDER BY message_sequence_number)"
                       " FROM broker.dead_letters") == "fail me,then me"
    status = wait_for(lambda: (s := _status(node)).failures >= 2 and s.activations >= 1 and s, 10,
                      "the calls recorded")
    assert status.last_failure == "cannot do job fail me"
    _shown(node)


def test_a_poison_message_does_not_hold_the_other_conversations_back_while_it_is_tried_again(node):
    """The poison message comes first and the other conversations right behind it: each failed call backs its
    group off, so the readers take the others while it waits to be tried again (a second after its first failure,
    two after its second...); none of them waits for its quarantine."""
    with node.engine.begin() as c:
        broker.alter_queue(c, "job_queue", poison_threshold=5)
        broker.set_queue_activation(c, "job_queue", "do_jobs", max_queue_readers=4, execute_as="worker")
    _send_jobs(node, "fail me")
    _send_jobs(node, *(f"job {n}" for n in range(20)))
    node.start()
    started = time.monotonic()
    wait_for(lambda: len(_done(node)) == 20, 30, "the other conversations' jobs")
    took_s = time.monotonic() - started
    failures = node.scalar("SELECT max(failed_attempts) FROM broker.queue_messages")
    assert failures is not None and failures < 5, "the poison message was quarantined before the others were done"
    assert node.scalar("SELECT count(*) FROM broker.dead_letters") == 0
    # Its quarantine comes 1 + 2 + 4 + 8 = 15 s after its first failure.
    assert took_s < 8, f"the other conversations took {took_s:.1f} s behind the poison message"
    wait_for(lambda: node.scalar("SELECT count(*) FROM broker.dead_letters") == 1, 60, "its quarantine")


def test_what_a_procedure_sets_for_its_session_does_not_outlast_its_call(node):
    """A procedure that sets its session's role and search_path (not SET LOCAL) leaves the next call as it found
    it: the node's reader resets its session after each call, so the next job is done too."""
    _define(node, """
        CREATE PROCEDURE sticky_jobs(queue text)
        LANGUAGE plpgsql AS $$
        DECLARE
            received record;
        BEGIN
            FOR received IN SELECT * FROM broker.receive(queue, 1) LOOP
                INSERT INTO done VALUES (convert_from(received.body, 'UTF8'), 0);
            END LOOP;
            SET ROLE worker;
            SET search_path = pg_catalog;
        END $$;""")
    with node.engine.begin() as c:
        broker.set_queue_activation(c, "job_queue", "sticky_jobs", execute_as="worker")
    node.start()
    _send_jobs(node, "first", "second", "third", conversations=False)
    wait_for(lambda: _done(node) == ["first", "second", "third"], 30, "every job done")
    assert _status(node).failures == 0


def _shown(node: Node) -> None:
    """broker status, /metrics and the console's /v1/status show the queue's activation as the view has it. The
    node records its calls' counts every few seconds, so the view is read before and after the three are, and they
    are compared with it when it did not move meanwhile."""
    with node.engine.begin() as c:
        key = api_keys.create(c, "activation", ["admin"])
    headers = {"Authorization": f"Bearer {key}"}
    deadline = time.monotonic() + 30
    while True:
        status = _status(node)
        tables = subprocess.run([sys.executable, "-m", "broker.cli", "status"], capture_output=True, text=True,
                                env={**os.environ, "BROKER_DATABASE_URL": node.database_url, "COLUMNS": "250"},
                                timeout=60)
        metrics = httpx.get(f"{node.address}/metrics", headers=headers).text
        [shown] = httpx.get(f"{node.address}/v1/status", headers=headers).json()["activation"]
        if _status(node) == status or time.monotonic() > deadline:
            break
    assert tables.returncode == 0, tables.stderr
    assert re.search(r"job_queue .* public\.do_jobs .* on .* 0 of 1 .* worker .* "
                     rf"{status.activations} .* {status.failures} .* cannot do job fail me", tables.stdout), tables.stdout
    assert 'broker_activation_readers{queue="job_queue"} 0.0' in metrics
    assert f'broker_activations_total{{queue="job_queue"}} {float(status.activations)}' in metrics
    assert f'broker_activation_failures_total{{queue="job_queue"}} {float(status.failures)}' in metrics
    assert (shown["queue_name"], shown["procedure_name"], shown["failures"], shown["last_failure"]) == (
        "job_queue", "public.do_jobs", status.failures, "cannot do job fail me")


def test_disabled_activation_calls_nothing_until_enabled_again(node):
    with node.engine.begin() as c:
        broker.set_queue_activation(c, "job_queue", "do_jobs", execute_as="worker", enabled=False)
    node.start()
    _send_jobs(node, "waits")
    time.sleep(2)
    assert _done(node) == [] and _status(node).activations == 0
    with node.engine.begin() as c:
        broker.set_queue_activation(c, "job_queue", enabled=True)
    wait_for(lambda: _done(node) == ["waits"], 10, "the job done once enabled")


def test_a_node_killed_during_a_call_loses_nothing(node):
    with node.engine.begin() as c:
        broker.set_queue_activation(c, "job_queue", "do_jobs", execute_as="worker")
    node.start()
    _send_jobs(node, "2")
    wait_for(lambda: _status(node).readers == 1, 10, "a reader in its call")
    node.kill()
    wait_for(lambda: _status(node).readers == 0, 20, "the killed node's session to end")
    assert _done(node) == []
    node.start()
    wait_for(lambda: _done(node) == ["2"], 20, "the job done by the restarted node")
    assert node.scalar("SELECT depth FROM broker.queue_status WHERE queue_name = 'job_queue'") == 0
