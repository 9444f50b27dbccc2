"""The `broker` command, run as a user runs it."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from uuid import uuid4

import psutil
import pytest

import broker
from broker import migrate

BROKER = [sys.executable, "-m", "broker.cli"]


def _run(*args, env=None, timeout=300):
    return subprocess.run([*BROKER, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


@pytest.mark.parametrize("command", [[], ["migrate"], ["keys"], ["keys", "create"], ["psql"], ["demo"], ["serve"],
                                     ["ingest"], ["bench"], ["relay"], ["status"], ["diagnose"],
                                     ["purge"], ["dead-letters"], ["definitions"], ["definitions", "export"],
                                     ["definitions", "apply"]])
def test_every_command_has_help(command):
    result = _run(*command, "--help")
    assert result.returncode == 0
    assert "Usage" in result.stdout


def test_the_version_is_this_releases_and_the_changelog_says_what_it_changed():
    result = _run("--version")
    assert (result.returncode, result.stdout) == (0, f"pg-broker {broker.__version__}\n")
    changelog = (Path(__file__).parents[2] / "CHANGELOG.md").read_text()
    assert f"## [{broker.__version__}]" in changelog


@pytest.mark.slow
def test_demo_shows_every_message_once_in_order_and_leaves_nothing_running(tmp_path):
    result = _run("demo", "--conversations", "40", "--messages", "3",
                  env={"TMPDIR": str(tmp_path), "COLUMNS": "200"}, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "killed node a's relay (SIGKILL)" in result.stdout
    assert re.search(r"started node a's relay again, with [1-9]\d* messages waiting for it", result.stdout)
    assert "Every message arrived exactly once, in order, and Spark ingested each once." in result.stdout
    for check in ("stored by the warehouse", "duplicates", "out of order", "ingested by Spark, once each"):
        assert check in result.stdout
    assert "FAILED" not in result.stdout
    assert list(tmp_path.iterdir()) == []  # its throwaway folders are gone
    left_running = [p for p in psutil.process_iter(["cmdline"]) if str(tmp_path) in " ".join(p.info["cmdline"] or [])]
    assert left_running == []


def test_migrate_applies_to_the_configured_database(empty_database_url):
    assert _run("migrate", env={"BROKER_DATABASE_URL": empty_database_url}).returncode == 0
    current = _run("migrate", "current", env={"BROKER_DATABASE_URL": empty_database_url})
    assert current.returncode == 0
    assert f"{migrate.head_revision()} (head)" in current.stdout + current.stderr


def test_a_bad_argument_exits_with_usage_error():
    result = _run("demo", "--conversations", "1")
    assert result.returncode == 2


def test_relay_runs_on_its_own_and_stops_on_sigterm(database_url):
    process = subprocess.Popen([*BROKER, "relay"], env={**os.environ, "BROKER_DATABASE_URL": database_url},
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert "relaying the transmission queue" in process.stdout.readline()
    process.terminate()
    assert process.wait(timeout=15) == 0


def test_keys_are_created_listed_and_revoked_from_the_command_line(database_url):
    env = {"BROKER_DATABASE_URL": database_url, "COLUMNS": "200"}  # a table row on one line
    created = _run("keys", "create", "--name", "billing", "--scope", "send:shop", "--scope", "receive:shop_queue",
                   env=env)
    assert created.returncode == 0, created.stderr
    key = created.stdout.strip().splitlines()[-1]
    assert key.startswith("bk_")
    listed = _run("keys", "list", env=env)
    key_id = key.split("_")[1]
    assert key_id in listed.stdout and "send:shop receive:shop_queue" in listed.stdout
    assert key.split("_", 2)[2] not in listed.stdout  # the secret is never shown again
    assert _run("keys", "revoke", key_id, env=env).returncode == 0
    assert _run("keys", "revoke", key_id, env=env).returncode == 1


def test_a_key_with_a_malformed_scope_is_refused(database_url):
    result = _run("keys", "create", "--name", "x", "--scope", "write:everything",
                  env={"BROKER_DATABASE_URL": database_url})
    assert result.returncode == 2
    assert "invalid scope" in result.stdout + result.stderr


def test_status_shows_queues_conversations_and_the_transmission_queue(engine, orders, database_url):
    with engine.begin() as c:
        broker.create_route(c, "far_away", "http://127.0.0.1:9/", uuid4(), "a-secret-of-16-chars")
        broker.send(c, broker.begin_dialog(c, "shop", "far_away", "orders"), "order.submit", '{"sku": 1}')
        broker.send(c, orders.begin(c), "order.note", "local")
    env = {"BROKER_DATABASE_URL": database_url, "COLUMNS": "200"}

    report = json.loads(_run("status", "--json", env=env).stdout)
    queues = {q["queue_name"]: q for q in report["queues"]}
    assert queues["warehouse_queue"]["depth"] == 1 and queues["shop_queue"]["depth"] == 0
    assert {(c["service_name"], c["state"], c["endpoints"]) for c in report["conversations"]} == {
        ("shop", "conversing", 2), ("warehouse", "conversing", 1)}
    [waiting] = report["transmission_queue"]
    assert (waiting["destination"], waiting["messages"], waiting["status"]) == (
        "http://127.0.0.1:9", 1, "waiting for its first transmission")  # the address as stored

    tables = _run("status", env=env)
    assert tables.returncode == 0
    for expected in ("Queues", "warehouse_queue", "Conversation endpoints", "Transmission queue",
                     "waiting for its first transmission", "Spark ingests: none", "Latest dead letters: none"):
        assert expected in tables.stdout


def test_psql_passes_the_arguments_after_it_to_psql(database_url):
    result = _run("psql", "-X", "-qAt", "-c", "SELECT count(*) FROM broker.node",
                  env={"BROKER_DATABASE_URL": database_url})
    assert (result.returncode, result.stdout) == (0, "1\n"), result.stderr
