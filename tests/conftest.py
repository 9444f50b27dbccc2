"""Test databases: one PostgreSQL per session (embedded unless BROKER_TEST_DATABASE_URL names a
server's admin database), one template migrated with Alembic, and either a fresh database per test or, for a
test that needs nothing committed, a transaction rolled back after it in a database its module shares."""
import fcntl
import os
import shutil
import uuid
from pathlib import Path

import psycopg2
import pytest
from sqlalchemy import create_engine
from sqlalchemy.pool import NullPool
from sqlalchemy.engine import make_url

from broker import migrate
from broker.cli.embedded import EmbeddedPostgres
from tests import factories

TEMPLATE = "broker_test_template"
# Every JVM the tests start (Spark's, one for each ingest run, the bench's and the demo's) lives a few seconds: the
# JIT's first tier alone serves it, for about 40% less CPU than compiling for peak speed as well (the Spark and CLI
# tests: 525 -> 327 s of CPU, all passing).  Set before any test process starts one, and inherited by each.
os.environ.setdefault("JAVA_TOOL_OPTIONS", "-XX:TieredStopAtLevel=1")


def pytest_addoption(parser):
    parser.addoption("--skip-slow", action="store_true", help="skip the slow fault-injection, Spark and browser tests")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--skip-slow"):
        skip = pytest.mark.skip(reason="--skip-slow given")
        for item in items:
            if "slow" in item.keywords:
                item.add_marker(skip)


def with_database(url: str, database: str) -> str:
    return make_url(url).set(database=database).render_as_string(hide_password=False)


def admin_execute(admin_url: str, *statements: str) -> None:
    connection = psycopg2.connect(admin_url)
    connection.autocommit = True
    try:
        with connection.cursor() as cursor:
            for statement in statements:
                cursor.execute(statement)
    finally:
        connection.close()


@pytest.fixture(scope="session")
def admin_url(tmp_path_factory):
    given = os.environ.get("BROKER_TEST_DATABASE_URL")
    if given:
        yield given
        return
    server = EmbeddedPostgres(tmp_path_factory.mktemp("embedded")).start()
    # The tests' own server writes what it commits to the operating system, as ever, but does not wait for the
    # disk: a process killed at any instant loses nothing still (only a crash of the machine would), and each
    # commit and each database made for a test costs no disk flush.  Servers of the tests' own (clusters.py) and
    # the benchmark's keep the defaults.
    admin_execute(server.url("postgres"), "ALTER SYSTEM SET fsync = off", "ALTER SYSTEM SET full_page_writes = off",
                  "SELECT pg_reload_conf()")
    try:
        yield server.url("postgres")
    finally:
        server.stop()


@pytest.fixture(scope="session")
def made_once(tmp_path_factory, worker_id):
    """made_once(name, make) -> a folder that make(folder) fills once per test run, however many test processes
    ask for it: the first fills it under a lock, the others wait for it (a wheel built and installed, or an earlier
    release installed, takes half a minute of both cores)."""
    shared = tmp_path_factory.getbasetemp()
    if worker_id != "master":  # the test processes' folders are in one made for this run
        shared = shared.parent

    def made(name: str, make) -> Path:
        folder = shared / name
        with open(shared / f"{name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not (folder / ".made").exists():
                shutil.rmtree(folder, ignore_errors=True)
                folder.mkdir()
                make(folder)
                (folder / ".made").touch()
        return folder

    return made


@pytest.fixture(scope="session")
def template_database(admin_url):
    admin_execute(admin_url, f"DROP DATABASE IF EXISTS {TEMPLATE}", f"CREATE DATABASE {TEMPLATE}")
    migrate.upgrade(with_database(admin_url, TEMPLATE))
    return TEMPLATE


def _fresh_database(admin_url: str, template: str = "template1"):
    name = f"broker_test_{uuid.uuid4().hex[:12]}"
    admin_execute(admin_url, f"CREATE DATABASE {name} TEMPLATE {template}")
    url = with_database(admin_url, name)
    if template != "template1":  # a copy of the migrated template: its own broker_instance, as every node has
        admin_execute(url, "UPDATE broker.node SET broker_instance = gen_random_uuid()")
    yield url
    admin_execute(admin_url, f"DROP DATABASE {name} WITH (FORCE)")


@pytest.fixture
def database_url(admin_url, template_database):
    """A migrated database of its own."""
    yield from _fresh_database(admin_url, template_database)


@pytest.fixture(scope="module")
def shared_database_url(admin_url, template_database):
    """A migrated database that a module's tests share, each in a transaction of its own (rolled_back)."""
    yield from _fresh_database(admin_url, template_database)


@pytest.fixture
def rolled_back(shared_database_url):
    """A connection to the module's shared database, in a transaction that is rolled back after the test: for a
    test that needs nothing committed and nothing seen by another session.  What it expects to fail, it runs in
    a savepoint of its own (connection.begin_nested())."""
    engine = create_engine(shared_database_url, poolclass=NullPool)
    with engine.connect() as connection:
        transaction = connection.begin()
        yield connection
        transaction.rollback()
    engine.dispose()


@pytest.fixture
def empty_database_url(admin_url):
    """A database with no broker schema."""
    yield from _fresh_database(admin_url)


@pytest.fixture
def engine(database_url):
    engine = create_engine(database_url, pool_size=10)
    yield engine
    engine.dispose()


@pytest.fixture
def orders(engine):
    """The orders catalog of tests/factories.py, committed."""
    with engine.begin() as connection:
        factories.define_orders(connection)
    return factories


@pytest.fixture
def nodes(admin_url, template_database, tmp_path):
    """Two nodes conversing over HTTP: see tests/nodes.py."""
    from tests.nodes import two_nodes

    yield from two_nodes(admin_url, template_database, tmp_path)


@pytest.fixture(scope="module")
def shared_nodes(admin_url, template_database, tmp_path_factory):
    """Two nodes that a module's tests share: for tests that leave them as they found them but for conversations
    of their own (in a module whose tests check that b stores nothing, only tests of requests b refuses whole)."""
    from tests.nodes import two_nodes

    yield from two_nodes(admin_url, template_database, tmp_path_factory.mktemp("shared_nodes"))
