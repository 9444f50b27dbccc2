"""The project as a user installs it: a wheel, in a fresh virtual environment outside the checkout, with no
extras. It must migrate, serve (the console included) and carry a message over REST, and a command whose
extra is missing must say which to install."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from sqlalchemy import create_engine

from broker import migrate
from broker.cli.processes import answers, free_port
from tests import factories
from tests.nodes import wait_for

ROOT = Path(__file__).resolve().parents[2]
# What a wheel is built from: the checkout less what is not the product or is built locally.
NOT_SOURCE = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache",
                                    ".broker", "tests", "docs")
# The extras' packages (psutil is not among them: the embedded PostgreSQL's package needs it too).
OPTIONAL = {"pyspark", "matplotlib", "pika"}


def _build_and_install(folder: Path) -> None:
    """The wheel, built from a copy of the checkout (the build leaves nothing in it), installed into a fresh virtual
    environment, folder / "venv"."""
    source = folder / "source"
    shutil.copytree(ROOT, source, ignore=NOT_SOURCE)
    env, quiet = _outside(), ["-q", "--disable-pip-version-check"]
    subprocess.run([sys.executable, "-m", "pip", "wheel", *quiet, "--no-deps", str(source), "-w", str(folder / "dist")],
                   cwd=folder, env=env, check=True, capture_output=True, timeout=180)
    (wheel,) = (folder / "dist").glob("pg_broker-*.whl")
    venv = folder / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], cwd=folder, env=env, check=True, timeout=120)
    subprocess.run([venv / "bin" / "pip", "install", *quiet, "--no-compile", str(wheel)], cwd=folder, env=env,
                   check=True, capture_output=True, timeout=300)
    shutil.rmtree(source)


def _outside() -> dict[str, str]:
    """Nothing of the checkout or of the test's environment on the path of the installed commands."""
    return {name: value for name, value in os.environ.items() if name not in ("PYTHONPATH", "VIRTUAL_ENV")}


@pytest.fixture(scope="module")
def installed(made_once, tmp_path_factory):
    """The wheel installed into a fresh virtual environment (made once for the test run), a folder of this test
    process's own to run its commands in, and the environment to run them with."""
    built = made_once("wheel", _build_and_install)
    assert not built.is_relative_to(ROOT)
    return built / "venv" / "bin", tmp_path_factory.mktemp("wheel"), _outside()


def _run(installed, *command, env=None):
    bin_dir, folder, base = installed
    return subprocess.run([bin_dir / command[0], *command[1:]], cwd=folder, env={**base, **(env or {})},
                          capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_the_installed_package_is_its_own_and_lean(installed):
    located = _run(installed, "python", "-c", "import broker, broker.api, broker.migrations, broker.spark_ingest; "
                   "print('\\n'.join(m.__file__ for m in (broker, broker.api, broker.migrations, broker.spark_ingest)))")
    assert located.returncode == 0, located.stderr
    assert all("/site-packages/broker/" in line and str(ROOT) not in line for line in located.stdout.split())
    top_level = _run(installed, "python", "-c", "import importlib.metadata as m; "
                     "print(m.distribution('pg-broker').read_text('top_level.txt'))")
    assert top_level.stdout.split() == ["broker"]
    for other in ("api", "migrations", "spark_ingest", "bench"):
        assert _run(installed, "python", "-c", f"import {other}").returncode == 1, f"{other} is installed"
    packages = _run(installed, "pip", "list", "--disable-pip-version-check", "--format", "freeze").stdout
    assert not OPTIONAL & {line.split("==")[0].lower() for line in packages.split()}


@pytest.mark.slow
def test_migrate_serve_console_and_a_message_over_rest(installed, empty_database_url, tmp_path):
    env = {"BROKER_DATABASE_URL": empty_database_url}
    migrated = _run(installed, "broker", "migrate", env=env)
    assert migrated.returncode == 0, migrated.stderr
    current = _run(installed, "broker", "migrate", "current", env=env)
    assert f"{migrate.head_revision()} (head)" in current.stdout + current.stderr
    engine = create_engine(empty_database_url)
    with engine.begin() as connection:
        factories.define_orders(connection)
    engine.dispose()
    created = _run(installed, "broker", "keys", "create", "--name", "wheel", "--scope", "admin", env=env)
    assert created.returncode == 0, created.stderr
    key = created.stdout.strip()

    bin_dir, folder, base = installed
    address = f"http://127.0.0.1:{free_port()}"
    with (tmp_path / "serve.log").open("ab") as log:
        server = subprocess.Popen([bin_dir / "broker", "serve", "--port", address.rsplit(":", 1)[1]], cwd=folder,
                                  env={**base, **env}, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: server.poll() is not None or answers(address), 60, "broker serve to answer /healthz")
        assert server.poll() is None, (tmp_path / "serve.log").read_text()[-2000:]
        with httpx.Client(base_url=address, headers={"Authorization": f"Bearer {key}"}, timeout=30) as client:
            console = client.get("/console")
            assert console.status_code == 200 and console.headers["content-type"].startswith("text/html")
            assert console.text == (ROOT / "api" / "console.html").read_text()
            conversation = client.post("/v1/conversations", json={
                "from_service": factories.SHOP, "to_service": factories.WAREHOUSE, "contract": factories.CONTRACT})
            assert conversation.status_code in (200, 201), conversation.text
            handle = conversation.json()["conversation_handle"]
            sent = client.post(f"/v1/conversations/{handle}/messages", json={
                "message_type": "order.submit", "body": {"sku": "A-1", "quantity": 2}, "sequence_number": 1})
            assert sent.status_code in (200, 201), sent.text
            received = client.post(f"/v1/queues/{factories.WAREHOUSE_QUEUE}/receive",
                                   json={"max_messages": 10, "wait_ms": 5000, "lock_s": 60})
            assert received.status_code == 200, received.text
            (message,) = received.json()["messages"]
            assert (message["sequence_number"], message["body"]) == (1, {"sku": "A-1", "quantity": 2})
            completed = client.post(f"/v1/locks/{received.json()['lock_token']}/complete")
            assert completed.json() == {"completed": 1}
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert server.returncode in (0, 143), (tmp_path / "serve.log").read_text()[-2000:]


# An application of its own beside the broker: its api package, and its Alembic migrations with its alembic.ini.
APPLICATION = {
    "api/__init__.py": "NAME = \"the application's api\"\n",
    "alembic.ini": "[alembic]\nscript_location = migrations\n",
    "migrations/env.py": """import os
from alembic import context
from sqlalchemy import create_engine

with create_engine(os.environ["APPLICATION_DATABASE_URL"]).connect() as connection:
    context.configure(connection=connection)
    with context.begin_transaction():
        context.run_migrations()
""",
    "migrations/script.py.mako": "",
    "migrations/versions/0001_orders.py": """from alembic import op

revision = "0001"
down_revision = None


def upgrade():
    op.execute("CREATE TABLE application_orders (id serial PRIMARY KEY)")
""",
}


@pytest.mark.slow
def test_an_application_with_its_own_api_and_migrations_installs_the_broker_beside_them(installed,
                                                                                        empty_database_url):
    """Its `alembic upgrade head` and `import api` are its own; `broker migrate` and `broker serve` are the
    broker's, on the same database, each keeping its own Alembic history."""
    bin_dir, folder, base = installed
    application = folder / "application"
    for name, text in APPLICATION.items():
        (application / name).parent.mkdir(parents=True, exist_ok=True)
        (application / name).write_text(text)
    env = {**base, "APPLICATION_DATABASE_URL": empty_database_url, "BROKER_DATABASE_URL": empty_database_url}

    def run(*command):
        return subprocess.run([bin_dir / command[0], *command[1:]], cwd=application, env=env, capture_output=True,
                              text=True, timeout=120)

    assert run("python", "-c", "import api; print(api.NAME)").stdout == "the application's api\n"
    migrated = run("alembic", "upgrade", "head")
    assert migrated.returncode == 0, migrated.stderr
    migrated = run("broker", "migrate")
    assert migrated.returncode == 0, migrated.stderr
    engine = create_engine(empty_database_url)
    with engine.connect() as connection:
        versions = connection.exec_driver_sql("SELECT (SELECT version_num FROM alembic_version),"
                                              " (SELECT version_num FROM broker_alembic_version)").one()
        assert tuple(versions) == ("0001", migrate.head_revision())
    engine.dispose()
    address = f"http://127.0.0.1:{free_port()}"
    with (folder / "application-serve.log").open("ab") as log:
        server = subprocess.Popen([bin_dir / "broker", "serve", "--port", address.rsplit(":", 1)[1]], cwd=application,
                                  env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: server.poll() is not None or answers(address), 60, "broker serve to answer /healthz")
        assert server.poll() is None, (folder / "application-serve.log").read_text()[-2000:]
        assert httpx.get(f"{address}/readyz", timeout=10).json()["status"] == "ready"
    finally:
        server.terminate()
        server.wait(timeout=30)


@pytest.mark.slow
@pytest.mark.parametrize("command, extra", [(["ingest", "--queue", "q", "--output", "lake"], "spark"),
                                            (["demo"], "spark"), (["bench", "--quick"], "bench")])
def test_a_command_without_its_extra_says_which_to_install(installed, command, extra):
    result = _run(installed, "broker", *command)
    assert result.returncode == 1
    assert result.stderr == f"broker: broker {command[0]} needs the {extra} extra: pip install 'pg-broker[{extra}]'\n"
    assert result.stdout == ""
