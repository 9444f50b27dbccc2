"""What the `broker` command shows a person: failures in one line without secrets, data as it is."""
import os
import subprocess
import sys

import pytest

import broker
from broker.cli.processes import free_port
from tests.factories import WAREHOUSE_QUEUE, begin

PASSWORD = "TopSecret-pw-4711"
HOSTILE_REASON = "KeyError: '[/]' [link=http://evil.example]click[/link] \x1b]8;;http://evil.example\x1b\\x\x1b[31m"


def _run(*args: str, database_url: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "broker.cli", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "BROKER_DATABASE_URL": database_url, "COLUMNS": "300"})


@pytest.mark.parametrize("command", [["status"], ["diagnose"], ["migrate"], ["keys", "list"],
                                     ["serve", "--no-relay"], ["definitions", "export"]])
def test_a_database_that_does_not_answer_is_one_line_without_its_password(command):
    unreachable = f"postgresql://broker:{PASSWORD}@127.0.0.1:{free_port()}/broker"
    result = _run(*command, *(["--port", str(free_port())] if command[0] == "serve" else []),
                  database_url=unreachable)
    assert result.returncode == 1
    shown = result.stdout + result.stderr
    assert PASSWORD not in shown and "Traceback" not in shown
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("broker: cannot use the database:") and "BROKER_DATABASE_URL" in line


def test_a_database_without_the_schema_says_to_migrate(empty_database_url):
    result = _run("status", database_url=empty_database_url)
    assert result.returncode == 1
    [line] = result.stderr.strip().splitlines()
    assert "run `broker migrate`" in line
    assert "Traceback" not in result.stdout + result.stderr


def _dead_letter(engine, reason: str) -> None:
    with engine.begin() as c:
        broker.alter_queue(c, WAREHOUSE_QUEUE, poison_threshold=1)
        broker.send(c, begin(c), "order.note", "poison")
    with engine.begin() as c:
        [message] = broker.receive(c, WAREHOUSE_QUEUE)
        c.rollback()
    with engine.begin() as c:
        assert broker.report_processing_failure(c, WAREHOUSE_QUEUE, message.conversation_group_id, reason)


def test_status_shows_stored_text_as_it_is_never_as_markup_or_terminal_codes(database_url, engine, orders):
    _dead_letter(engine, HOSTILE_REASON)
    result = _run("status", database_url=database_url)
    assert result.returncode == 0, result.stderr
    assert "KeyError: '[/]'" in result.stdout and "[link=http://evil.example]click[/link]" in result.stdout
    assert "\x1b" not in result.stdout and "\\x1b]8;;http://evil.example" in result.stdout


def test_keys_create_prints_only_the_key_on_stdout_for_a_shell_to_capture(database_url):
    result = _run("keys", "create", "--name", "docs", "--scope", "admin", database_url=database_url)
    assert result.returncode == 0, result.stderr
    [key] = result.stdout.splitlines()
    assert key.startswith("bk_") and "keep it now" in result.stderr


def test_without_a_terminal_output_is_plain_and_unwrapped(database_url, engine, orders):
    """As in a log: no COLUMNS, no terminal, and a line longer than any terminal."""
    reason = "ValueError: " + " ".join(f"field{i}" for i in range(60))
    _dead_letter(engine, reason)
    environment = {name: value for name, value in os.environ.items() if name != "COLUMNS"}
    result = subprocess.run([sys.executable, "-m", "broker.cli", "status"], capture_output=True, text=True,
                            timeout=120, env={**environment, "BROKER_DATABASE_URL": database_url})
    assert result.returncode == 0, result.stderr
    assert any(reason in line for line in result.stdout.splitlines()), result.stdout
    assert "\x1b[" not in result.stdout


def test_an_interval_without_follow_is_refused_before_anything_starts(database_url):
    result = _run("ingest", "--queue", WAREHOUSE_QUEUE, "--output", "/tmp/lake", "--interval", "3",
                  database_url=database_url)
    assert result.returncode == 2 and "--interval goes with --follow" in result.stderr


@pytest.mark.parametrize("arguments", [
    ("ingest", "--queue", WAREHOUSE_QUEUE, "--output", "/tmp/lake", "--follow", "--interval", "nan"),
    ("ingest", "--queue", WAREHOUSE_QUEUE, "--output", "/tmp/lake", "--follow", "--interval", "1e300"),
    ("diagnose", "--max-wait", "nan"),
    ("diagnose", "--max-wait", "inf")], ids=["interval nan", "interval 1e300", "max-wait nan", "max-wait inf"])
def test_a_number_of_seconds_that_is_not_finite_or_in_range_is_refused_before_anything_starts(database_url,
                                                                                              arguments):
    result = _run(*arguments, database_url=database_url)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "not a finite number" in result.stderr or "not in the range" in result.stderr
