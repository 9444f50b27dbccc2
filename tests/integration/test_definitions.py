"""`broker definitions`: a node's catalog exported as one file, and a node made to match a file in one transaction,
run as a user runs the command."""
import os
import subprocess
import sys
import textwrap
import uuid

import pytest
from sqlalchemy import create_engine, text

import broker
from broker import definitions
from tests.conftest import _fresh_database
from tests import factories
from tests.factories import CONTRACT, SHOP, WAREHOUSE, WAREHOUSE_QUEUE, begin, broker_table_counts

SECRET = "billing-and-shop-share-this-secret"
OTHER_SECRET = "a-secret-that-comes-later-on-123"
PEER = uuid.UUID("5e0c2f4a-1b7d-4c3e-9a8f-6d2b1c0e9f7a")


def _run(*args: str, database_url: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "broker.cli", "definitions", *args], capture_output=True,
                          text=True, timeout=120,
                          env={**os.environ, "BROKER_DATABASE_URL": database_url, "COLUMNS": "300", **(env or {})})


@pytest.fixture
def other_database_url(admin_url, template_database):
    """A second node, with nothing in its catalog."""
    yield from _fresh_database(admin_url, template_database)


# The application's procedure that an activation names, and the role it runs as: a node's file names them, each
# node has them of its own.
ARCHIVER = """
CREATE PROCEDURE public.archive_messages(queue text) LANGUAGE plpgsql AS $$
BEGIN
    PERFORM broker.receive(queue, 10);
END $$;
DO $$
BEGIN
    CREATE ROLE archiver NOLOGIN;
EXCEPTION WHEN duplicate_object THEN
    NULL;
END $$;
GRANT broker_application TO archiver;
"""


def _define_everything(engine) -> None:
    """The orders catalog, with queue settings other than the defaults, an activation, two routes to one peer and a
    priority."""
    with engine.begin() as c:
        c.exec_driver_sql(ARCHIVER)
        broker.create_message_type(c, "billing.invoice", "json")
        broker.create_contract(c, "billing", {"billing.invoice": "any"})
        broker.create_queue(c, "archive", enabled=False, retention=True, poison_threshold=2)
        broker.set_queue_activation(c, "archive", "archive_messages", max_queue_readers=3, enabled=False,
                                    execute_as="archiver")
        broker.alter_queue(c, WAREHOUSE_QUEUE, poison_threshold=3)
        broker.create_route(c, "billing", "http://billing.example:8080/", PEER, SECRET)
        broker.create_route(c, "billing.audit", "http://billing.example:8080", PEER, SECRET)
        broker.create_broker_priority(c, "urgent-billing", 8, contract="billing", remote_service="billing")


def _export(database_url: str) -> str:
    result = _run("export", database_url=database_url)
    assert result.returncode == 0, result.stderr
    return result.stdout


def _write(tmp_path, content: str):
    path = tmp_path / "catalog.yaml"
    path.write_text(textwrap.dedent(content).lstrip())
    return path


def test_an_export_applied_to_an_empty_node_exports_the_same(database_url, engine, orders, other_database_url,
                                                              tmp_path):
    _define_everything(engine)
    exported = _export(database_url)
    assert SECRET not in exported
    # The routes to one node with one secret name one variable, after the first of them by name.
    assert exported.count("env: BROKER_SECRET_BILLING\n") == 2
    assert "broker.end_dialog" not in exported
    path = tmp_path / "catalog.yaml"
    written = _run("export", "--output", str(path), database_url=database_url)
    assert written.returncode == 0 and written.stdout == "" and path.read_text() == exported

    assert "activations:\n  archive:\n    procedure: public.archive_messages\n    max_queue_readers: 3\n" \
           "    enabled: false\n    execute_as: archiver\n" in exported
    other = create_engine(other_database_url)
    with other.begin() as c:
        c.exec_driver_sql(ARCHIVER)
    applied = _run("apply", str(path), database_url=other_database_url, env={"BROKER_SECRET_BILLING": SECRET})
    assert applied.returncode == 0, applied.stderr
    assert ("create activation of queue 'archive' (procedure public.archive_messages, max_queue_readers 3, "
            "enabled false, execute_as archiver)") in applied.stdout
    assert "create queue 'archive' (enabled false, retention true, poison_threshold 2)" in applied.stdout
    assert "create route 'billing' (address http://billing.example:8080, broker_instance " \
           f"{PEER}, secret from $BROKER_SECRET_BILLING)" in applied.stdout
    assert SECRET not in applied.stdout + applied.stderr
    assert _export(other_database_url) == exported
    with other.connect() as c:
        assert set(c.execute(text("SELECT peer_secret FROM broker.routes")).scalars()) == {SECRET}
    other.dispose()

    again = _run("apply", "--plan", str(path), database_url=other_database_url, env={"BROKER_SECRET_BILLING": SECRET})
    assert again.returncode == 0 and again.stdout == "nothing to change\n"


def test_applying_a_file_twice_changes_nothing_the_second_time(engine, orders, tmp_path):
    _define_everything(engine)
    with engine.connect() as c:
        exported = definitions.export(c)
    changed = exported.replace("poison_threshold: 3", "poison_threshold: 7").replace(
        "billing.invoice: any", "billing.invoice: initiator").replace("max_queue_readers: 3", "max_queue_readers: 5")
    wanted = definitions.load(changed, "catalog.yaml", {"BROKER_SECRET_BILLING": OTHER_SECRET})
    with engine.begin() as c:
        first = definitions.make_match(c, wanted, prune=False)
    assert [change.describe() for change in first] == [
        "replace contract 'billing' (drop and create again): message_types {billing.invoice: any} -> "
        "{billing.invoice: initiator}",
        f"alter queue '{WAREHOUSE_QUEUE}': poison_threshold 3 -> 7",
        "alter activation of queue 'archive': max_queue_readers 3 -> 5",
        "replace route 'billing' (drop and create again): a new secret from $BROKER_SECRET_BILLING",
        "replace route 'billing.audit' (drop and create again): a new secret from $BROKER_SECRET_BILLING",
    ]
    with engine.connect() as c:
        counts = broker_table_counts(c)
    with engine.begin() as c:
        assert definitions.make_match(c, wanted, prune=False) == []
    with engine.connect() as c:
        assert broker_table_counts(c) == counts
        assert definitions.export(c) == changed


def test_plan_prints_what_would_change_and_changes_nothing(database_url, engine, orders, tmp_path):
    before = _export(database_url)
    path = _write(tmp_path, before.replace("poison_threshold: 5", "poison_threshold: 9", 1).replace(
        "queues:\n", "queues:\n  returns:\n    poison_threshold: 4\n"))
    planned = _run("apply", "--plan", str(path), database_url=database_url)
    assert planned.returncode == 0, planned.stderr
    assert planned.stdout.splitlines() == [
        "create queue 'returns' (enabled true, retention false, poison_threshold 4)",
        "alter queue 'shop_queue': poison_threshold 5 -> 9",
        "2 changes planned; nothing was applied (--plan)",
    ]
    assert _export(database_url) == before


def test_prune_drops_what_the_file_no_longer_names_and_without_it_keeps_it(database_url, engine, orders, tmp_path):
    path = _write(tmp_path, f"""
        message_types:
          order.submit: {{validation: json}}
          order.note:
          order.ack: {{validation: empty}}
        contracts:
          {CONTRACT}:
            message_types: {{order.submit: initiator, order.ack: target, order.note: any}}
        queues:
          {WAREHOUSE_QUEUE}: {{poison_threshold: 5}}
        services:
          {WAREHOUSE}: {{queue: {WAREHOUSE_QUEUE}, contracts: [{CONTRACT}]}}
        """)
    kept = _run("apply", str(path), database_url=database_url)
    assert kept.returncode == 0, kept.stderr
    assert kept.stdout.splitlines() == ["keep queue 'shop_queue': not in the file, kept (--prune drops it)",
                                        f"keep service '{SHOP}': not in the file, kept (--prune drops it)",
                                        "nothing to change"]
    pruned = _run("apply", "--prune", str(path), database_url=database_url)
    assert pruned.returncode == 0, pruned.stderr
    assert pruned.stdout.splitlines() == ["drop queue 'shop_queue': not in the file",
                                          f"drop service '{SHOP}': not in the file",
                                          "applied 2 changes in one transaction"]
    with engine.connect() as c:
        assert [s.name for s in broker.queries.services(c)] == [WAREHOUSE]
    assert _run("apply", "--prune", str(path), database_url=database_url).stdout == "nothing to change\n"


# Each file defines a queue 'new' before what is wrong: a refusal applies nothing, that queue included.
BAD_FILES = {
    "unknown key": ("queues:\n  new: {}\n  other:\n    poisn_threshold: 3\n", "4:5",
                    "unknown key 'poisn_threshold' in queue 'other': use enabled, retention, poison_threshold"),
    "wrong type": ("queues:\n  new: {}\n  other:\n    poison_threshold: three\n", "4:23",
                   "poison_threshold of queue 'other' must be a whole number"),
    "unknown section": ("queues:\n  new: {}\nexchanges: {}\n", "3:1", "unknown key 'exchanges' in the file"),
    "unknown queue": ("queues:\n  new: {}\nservices:\n  billing:\n    queue: nowhere\n", "5:12",
                      "service 'billing' is on queue 'nowhere', which the file does not define: add it under queues"),
    "unknown message type": ("queues:\n  new: {}\ncontracts:\n  c:\n    message_types:\n      x.y: any\n", "6:7",
                             "contract 'c' names message type 'x.y', which the file does not define"),
    "who sends": ("queues:\n  new: {}\nmessage_types:\n  a.b:\ncontracts:\n  c:\n    message_types: {a.b: everyone}\n",
                  "7:26", "who sends 'a.b' in contract 'c' must be initiator, target, any"),
    "a number for a name": ("queues:\n  new: {}\nservices:\n  billing:\n    queue: 2024\n", "5:12",
                            "queue of service 'billing' must be text (quote it)"),
    "unset secret": ("queues:\n  new: {}\nroutes:\n  billing:\n    address: http://billing.example\n"
                     f"    broker_instance: {PEER}\n    secret: {{env: BROKER_SECRET_NOT_SET}}\n", "7:19",
                     "the secret of route 'billing' is in $BROKER_SECRET_NOT_SET, which is not set"),
    "secret in the file": ("queues:\n  new: {}\nroutes:\n  billing:\n    address: http://billing.example\n"
                           f"    broker_instance: {PEER}\n    secret: {SECRET}\n", "7:13",
                           "a file never holds a secret"),
    "written twice": ("queues:\n  new: {}\n  new: {}\n", "3:3", "'new' is written twice in queues"),
    "not YAML": ("queues:\n  new: {}\n  - other\n", "3:3", "not valid YAML"),
    "a procedure without its schema": ("queues:\n  new: {}\nactivations:\n  new:\n    procedure: archive_messages\n"
                                       "    execute_as: archiver\n", "5:16",
                                       "procedure of activation of queue 'new' must name its schema"),
    "an activation of an unknown queue": ("queues:\n  new: {}\nactivations:\n  old:\n"
                                          "    procedure: public.archive_messages\n    execute_as: archiver\n", "5:5",
                                          "activations name queue 'old', which the file does not define"),
    "refused by the node": ("queues:\n  new: {}\n  'new but bad!': {}\n", "3:3",
                            "creating queue 'new but bad!': invalid queue name 'new but bad!' (BR050); use 1-128"),
    "a NUL in a name": ('queues:\n  new: {}\n  "bad\\0name": {}\n', "3:3",
                        "a name in queues holds a NUL character"),
    "a number out of range": ("queues:\n  new: {}\n  other:\n    poison_threshold: 3000000000\n", "4:23",
                              "poison_threshold of queue 'other' is out of range: at most 2,147,483,647"),
    "a merge key": ("queues:\n  new: {}\n  other:\n    <<: {enabled: true}\n", "4:5", "not valid YAML here"),
}


@pytest.mark.parametrize("content, where, message", BAD_FILES.values(), ids=BAD_FILES)
def test_a_bad_file_is_refused_naming_its_line_and_nothing_is_applied(database_url, engine, tmp_path, content,
                                                                       where, message):
    path = _write(tmp_path, content)
    with engine.connect() as c:
        before = broker_table_counts(c)
    refused = _run("apply", str(path), database_url=database_url, env={"BROKER_SECRET_BILLING": SECRET})
    assert refused.returncode == 1
    assert refused.stdout == "" and "Traceback" not in refused.stderr and SECRET not in refused.stderr
    [line] = refused.stderr.splitlines()
    assert line.startswith(f"broker: {path}:{where}: ") and line.endswith("; nothing was applied")
    assert message in line
    with engine.connect() as c:
        assert broker_table_counts(c) == before


def test_dropping_a_service_with_open_conversations_is_refused_in_one_line(database_url, engine, orders, tmp_path):
    with engine.begin() as c:
        begin(c)
    path = _write(tmp_path, _export(database_url).replace(f"  {SHOP}:\n    queue: shop_queue\n    contracts: []\n",
                                                          ""))
    assert f"  {SHOP}:" not in path.read_text()
    refused = _run("apply", "--prune", str(path), database_url=database_url)
    assert refused.returncode == 1
    [line] = refused.stderr.splitlines()
    assert line == (f"broker: {path}: dropping service '{SHOP}': service '{SHOP}' has open conversations (BR041); "
                    "end them first, or with broker.end_conversation(handle, cleanup => true); nothing was applied")


def test_a_service_takes_a_new_contract_while_its_conversations_go_on(database_url, engine, orders, tmp_path):
    with engine.begin() as c:
        handle = begin(c)
    before = _export(database_url)
    changed = before.replace("contracts:\n  orders:", "contracts:\n  returns:\n    message_types:\n"
                             "      order.note: any\n  orders:").replace(
        f"    queue: {WAREHOUSE_QUEUE}\n    contracts:\n    - {CONTRACT}\n",
        f"    queue: {WAREHOUSE_QUEUE}\n    contracts:\n    - returns\n")
    applied = _run("apply", "--prune", str(_write(tmp_path, changed)), database_url=database_url)
    assert applied.returncode == 0, applied.stderr
    assert applied.stdout.splitlines() == ["create contract 'returns' (message_types {order.note: any})",
                                           f"alter service '{WAREHOUSE}': contracts [{CONTRACT}] -> [returns]",
                                           "applied 2 changes in one transaction"]
    with engine.begin() as c:
        broker.send(c, handle, "order.note", "still flowing")
        [message] = broker.receive(c, WAREHOUSE_QUEUE)
        assert message.body == b"still flowing"
        with pytest.raises(broker.NotAllowed):
            begin(c)


def test_a_contract_in_use_is_not_changed_and_the_refusal_says_to_name_a_new_one(database_url, engine, orders,
                                                                                  tmp_path):
    path = _write(tmp_path, _export(database_url).replace("order.note: any", "order.note: initiator"))
    refused = _run("apply", str(path), database_url=database_url)
    assert refused.returncode == 1
    [line] = refused.stderr.splitlines()
    assert line.startswith(f"broker: {path}:") and f"replacing contract '{CONTRACT}': contract " in line
    assert "(BR041); a contract in use cannot change: define the changed one under a new name" in line


def test_alter_service_sets_the_contracts_a_service_accepts(rolled_back):
    factories.define_orders(rolled_back)
    broker.alter_service(rolled_back, WAREHOUSE, [])
    assert broker.queries.services(rolled_back, [WAREHOUSE])[0].contracts == []
    broker.alter_service(rolled_back, WAREHOUSE, [CONTRACT, CONTRACT])
    assert broker.queries.services(rolled_back, [WAREHOUSE])[0].contracts == [CONTRACT]
    for service, contracts in ((WAREHOUSE, ["nope"]), ("nowhere", [CONTRACT])):
        with pytest.raises(broker.UnknownObject), rolled_back.begin_nested():
            broker.alter_service(rolled_back, service, contracts)


@pytest.mark.parametrize("write, env, message", [
    (lambda path: path.write_text("queues:\n  other: " + "[" * 5000 + "]" * 5000 + "\n"), {},
     "nested too deeply to be a catalog"),
    (lambda path: path.write_bytes(b"queues:\n  caf\xe9: {}\n"), {}, "not UTF-8 text (byte 14 is not)"),
    (lambda path: path.write_text(f"routes:\n  billing:\n    address: http://billing.example\n"
                                  f"    broker_instance: {PEER}\n    secret: {{env: BROKER_SECRET_BILLING}}\n"),
     {"BROKER_SECRET_BILLING": "not\udcffutf8"}, "holds what a secret may not"),
    (lambda path: path.write_text(f"routes:\n  billing:\n    address: http://admin:hunter2pass@169.254.169.254\n"
                                  f"    broker_instance: {PEER}\n    secret: {{env: BROKER_SECRET_BILLING}}\n"),
     {"BROKER_SECRET_BILLING": SECRET}, "admin:***@169.254.169.254")],
    ids=["nested too deeply", "not UTF-8", "a secret that is not UTF-8", "a password in an address"])
def test_a_file_python_or_the_node_cannot_read_is_one_line_that_shows_no_password(database_url, engine, tmp_path,
                                                                                  write, env, message):
    path = tmp_path / "catalog.yaml"
    write(path)
    with engine.connect() as c:
        before = broker_table_counts(c)
    refused = _run("apply", str(path), database_url=database_url, env=env)
    assert refused.returncode == 1 and "Traceback" not in refused.stderr and "hunter2pass" not in refused.stderr
    [line] = refused.stderr.splitlines()
    assert line.startswith(f"broker: {path}") and line.endswith("; nothing was applied") and message in line
    with engine.connect() as c:
        assert broker_table_counts(c) == before
