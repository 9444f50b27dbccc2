"""`broker ingest --follow` as a real process: a local SparkSession writing Parquet from a real PostgreSQL, woken by
the messages that commit while it runs, and stopped by signals."""
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from sqlalchemy import text

from tests.nodes import wait_for
from tests.factories import WAREHOUSE_QUEUE
from tests.integration.test_spark_ingest import (BIN, _files_under, _start, dataset_content, positions,
                                                 queue_content, send_conversations, spark)
from tests.rest import ApiServer, new_key

pytestmark = pytest.mark.slow

__all__ = ["spark"]  # the module's SparkSession fixture, shared


def _follow(lake: Path, url: str, log: Path, *options: str, interval_s: float = 1) -> subprocess.Popen:
    return _start([str(BIN / "broker"), "ingest", "--follow", "--interval", str(interval_s), "--master", "local[2]",
                   "--queue", WAREHOUSE_QUEUE, "--output", str(lake), *options], url, log)


def _lag(engine, lake: Path) -> tuple[int, float] | None:
    with engine.connect() as c:
        row = c.execute(text("SELECT lag_messages, lag_s FROM broker.ingest_lag() WHERE output = :output"),
                        {"output": f"file:{lake}"}).one_or_none()
    return None if row is None else tuple(row)


def _wait_for(process: subprocess.Popen, reached, what: str, log: Path, timeout_s: float = 180) -> None:
    """Waits for the follow to reach something, failing with its log's end if it ends or never does."""
    try:
        wait_for(reached, timeout_s, what, ended=lambda: process.poll() is not None and "the follow ended")
    except AssertionError as error:
        raise AssertionError(f"{error}: {log.read_text()[-3000:]}") from None


def _caught_up(engine, lake: Path):
    return lambda: _lag(engine, lake) == (0, 0.0)


def _status_lag(url: str, lake: Path) -> tuple[int, float]:
    shown = subprocess.run([str(BIN / "broker"), "status", "--json"], capture_output=True, text=True, timeout=60,
                           env={**os.environ, "BROKER_DATABASE_URL": url}, check=True)
    [ingest] = [i for i in json.loads(shown.stdout)["ingests"] if i["output"] == f"file:{lake}"]
    return ingest["lag_messages"], ingest["lag_s"]


def _metrics_lag(admin, lake: Path) -> tuple[float, float]:
    metrics = admin.get("/metrics").text
    labels = re.escape(f'{{output="file:{lake}",queue="{WAREHOUSE_QUEUE}"}}')
    messages = re.search(rf"^broker_ingest_lag_messages{labels} (\S+)$", metrics, re.M)
    seconds = re.search(rf"^broker_ingest_lag_seconds{labels} (\S+)$", metrics, re.M)
    assert messages and seconds, metrics
    return float(messages[1]), float(seconds[1])


def _stopped(process: subprocess.Popen) -> int:
    """The exit status of a follow that was told to stop; it must stop within two minutes."""
    return process.wait(timeout=120)


def test_follow_ingests_what_commits_while_it_runs_and_shows_its_lag(spark, engine, orders, tmp_path):
    url, lake, log = engine.url.render_as_string(hide_password=False), tmp_path / "lake", tmp_path / "follow.log"
    send_conversations(engine, 20, 5, "before")
    follow = _follow(lake, url, log, interval_s=60)
    try:
        _wait_for(follow, _caught_up(engine, lake), "the messages sent before it started", log)
        for batch in range(3):  # each commit wakes it: the interval would not bring them in this soon
            send_conversations(engine, 4, 5, f"while{batch}")
            _wait_for(follow, _caught_up(engine, lake), f"batch {batch}", log, timeout_s=30)

        # Paused (a long GC, a stopped VM): the lag shows in status and in /metrics, then goes back to 0.
        os.killpg(follow.pid, signal.SIGSTOP)
        try:
            send_conversations(engine, 6, 5, "paused")
            time.sleep(1.1)
            messages, seconds = _status_lag(url, lake)
            assert messages == 30 and seconds >= 1.0
            with ApiServer(url) as api, api.client(new_key(engine, "admin")) as admin:
                messages, seconds = _metrics_lag(admin, lake)
                assert messages == 30 and seconds >= 1.0
                os.killpg(follow.pid, signal.SIGCONT)
                _wait_for(follow, _caught_up(engine, lake), "the messages sent while it was paused", log)
                assert _metrics_lag(admin, lake) == (0, 0)
            assert _status_lag(url, lake) == (0, 0)
        finally:
            os.killpg(follow.pid, signal.SIGCONT)

        follow.send_signal(signal.SIGTERM)  # waiting between rounds: it stops at once, not after the interval
        signalled = time.monotonic()
        assert _stopped(follow) == 0, log.read_text()[-3000:]
        assert time.monotonic() - signalled < 30
    finally:
        if follow.poll() is None:
            os.killpg(follow.pid, signal.SIGKILL)

    rounds = re.findall(r" INFO broker\.spark_ingest\.follow: round \d+: ingested queue warehouse_queue into file:\S+: "
                        r"([\d,]+) rows .*; lag ([\d,]+) messages, oldest [\d.]+ s\n", log.read_text())
    # A round per wake-up with messages waiting, and none for the wake-ups of the interval with nothing new.
    assert len(rounds) >= 5 and all(rows != "0" for rows, _ in rounds), log.read_text()
    assert sum(int(rows.replace(",", "")) for rows, _ in rounds) == 20 * 5 + 3 * 4 * 5 + 6 * 5
    assert "SIGTERM: stopping after the run in progress" in log.read_text()
    content = dataset_content(spark, lake)
    assert len(set(positions(content))) == len(content) == 190
    assert content == queue_content(engine)


@pytest.mark.timeout(600)  # several Spark runs, each a JVM of its own: a loaded machine takes minutes
def test_sigterm_during_a_run_lets_it_commit_and_a_restart_goes_on_without_duplicates(spark, engine, orders,
                                                                                        tmp_path):
    url, lake, log = engine.url.render_as_string(hide_password=False), tmp_path / "lake", tmp_path / "follow.log"
    slow = ["--partitions", "16", "--fetch-size", "100"]
    send_conversations(engine, 600, 5, "a")
    follow = _follow(lake, url, log, *slow)
    try:
        _wait_for(follow, lambda: _files_under(lake / "_incoming", "*.parquet"), "writing", log)
        follow.send_signal(signal.SIGTERM)
        assert _stopped(follow) == 0, log.read_text()[-3000:]
    finally:
        if follow.poll() is None:
            os.killpg(follow.pid, signal.SIGKILL)
    stopping = log.read_text().index("SIGTERM: stopping after the run in progress")
    assert re.search(r"round \d+: ingested queue warehouse_queue into \S+: 3,000 rows", log.read_text()[stopping:])
    assert _lag(engine, lake) == (0, 0.0) and not _files_under(lake / "_incoming")

    # Restarted: it goes on from the checkpoint.  Two signals during a run stop it at once, that run uncommitted.
    send_conversations(engine, 600, 5, "b")
    follow = _follow(lake, url, log, *slow)
    try:
        _wait_for(follow, lambda: _files_under(lake / "_incoming", "*.parquet"), "writing", log)
        follow.send_signal(signal.SIGINT)
        time.sleep(0.2)
        follow.send_signal(signal.SIGINT)
        assert _stopped(follow) == 130, log.read_text()[-3000:]
    finally:
        if follow.poll() is None:
            os.killpg(follow.pid, signal.SIGKILL)

    send_conversations(engine, 10, 5, "c")
    follow = _follow(lake, url, log)
    try:
        _wait_for(follow, _caught_up(engine, lake), "the messages left by the aborted run", log)
        follow.send_signal(signal.SIGINT)
        assert _stopped(follow) == 0, log.read_text()[-3000:]
    finally:
        if follow.poll() is None:
            os.killpg(follow.pid, signal.SIGKILL)
    content = dataset_content(spark, lake)
    assert len(set(positions(content))) == len(content) == 6050
    assert content == queue_content(engine)
