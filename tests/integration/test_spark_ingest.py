"""The Spark ingest (SPEC.md, invariant 6): a real local SparkSession reading a real PostgreSQL over JDBC.

The dataset is compared with the queue as whole frames: every column of every row, each position once.
"""
import fnmatch
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from sqlalchemy import text

import broker
from broker.spark_ingest.errors import IngestError
from broker.spark_ingest.jdbc import spark_session
from broker.spark_ingest.job import OUTPUT_COLUMNS, ingest
from tests.nodes import wait_for
from tests.factories import WAREHOUSE_QUEUE, begin

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def spark():
    session = spark_session("local[2]")
    yield session
    session.stop()


def send_conversations(engine, conversations: int, messages: int, tag: str = "") -> None:
    """Conversations of JSON orders and binary notes (one not UTF-8, one empty), a transaction each."""
    for i in range(conversations):
        with engine.begin() as c:
            handle = begin(c)
            for j in range(messages):
                if j % 3 == 2:
                    broker.send(c, handle, "order.note", bytes([0xff, 0xfe, i % 256, j % 256]) if i % 2 else None)
                else:
                    order = f'{{"order": "{tag}{i}", "line": {j}, "pad": "{"x" * 900}"}}'
                    broker.send(c, handle, "order.submit", order)


def queue_content(engine) -> list[tuple]:
    """The queue as the dataset should hold it, in OUTPUT_COLUMNS order, sorted by position."""
    with engine.connect() as c:
        rows = c.execute(text(
            "SELECT queue_name, queue_position, conversation_id::text, conversation_handle::text,"
            " conversation_group_id::text, message_sequence_number, service_name, contract_name, message_type,"
            " body, CASE WHEN validation = 'json' THEN convert_from(body, 'UTF8') END, enqueued_at"
            " FROM broker.destination_queue WHERE queue_name = :queue ORDER BY queue_position"),
            {"queue": WAREHOUSE_QUEUE}).all()
    return [(*row[:9], None if row[9] is None else bytes(row[9]), row[10], round(row[11].timestamp() * 1e6))
            for row in rows]


def dataset_content(spark, output: Path) -> list[tuple]:
    """Every row of the dataset, sorted by position, in the same shape as queue_content."""
    frame = spark.read.parquet(str(output))
    assert frame.columns == [*OUTPUT_COLUMNS, "ingest_run"]
    rows = sorted(frame.drop("ingest_run").collect(), key=lambda row: row.queue_position)
    return [(*row[:9], None if row.body is None else bytes(row.body), row.body_text,
             round(row.enqueued_at.timestamp() * 1e6)) for row in rows]


def positions(content: list[tuple]) -> list[int]:
    return [row[1] for row in content]


def test_the_dataset_equals_the_queue(spark, engine, orders, tmp_path):
    send_conversations(engine, 200, 5)
    lake = tmp_path / "lake"
    summary = ingest(spark, engine.url.render_as_string(hide_password=False), WAREHOUSE_QUEUE, str(lake), partitions=4)

    expected = queue_content(engine)
    assert len(expected) == 1000 and summary.rows == 1000 and summary.partitions == 4 and not summary.adopted
    assert dataset_content(spark, lake) == expected
    runs = {row.ingest_run for row in spark.read.parquet(str(lake)).select("ingest_run").distinct().collect()}
    assert runs == {f"0-{summary.run.up_to_position}"}
    assert max(positions(expected)) <= summary.run.up_to_position

    again = ingest(spark, engine.url.render_as_string(hide_password=False), WAREHOUSE_QUEUE, str(lake))
    assert again.rows == 0 and again.run.after_position == summary.run.up_to_position
    assert dataset_content(spark, lake) == expected
    with engine.connect() as c:
        checkpoint = c.execute(text("SELECT queue_position, rows_ingested, runs FROM broker.ingests")).one()
    assert tuple(checkpoint) == (again.run.up_to_position, 1000, 2)


def test_a_late_commit_waits_for_the_next_run_and_is_never_skipped(spark, engine, orders, tmp_path):
    url, lake = engine.url.render_as_string(hide_password=False), str(tmp_path / "lake")
    with engine.connect() as early:
        early_handle = begin(early)
        broker.send(early, early_handle, "order.note", b"taken first, committed last")
        early_position = early.execute(text("SELECT max(queue_position) FROM broker.queue_messages")).scalar_one()
        with engine.begin() as late:
            broker.send(late, begin(late), "order.note", b"taken last, committed first")
        [late_position] = positions(queue_content(engine))
        assert late_position > early_position  # a reader going by "position > last seen" would skip the early one

        first = ingest(spark, url, WAREHOUSE_QUEUE, lake)
        assert first.rows == 0 and first.run.up_to_position < early_position
        early.commit()

    second = ingest(spark, url, WAREHOUSE_QUEUE, lake)
    assert second.rows == 2
    assert dataset_content(spark, tmp_path / "lake") == queue_content(engine)


def test_writers_committing_out_of_order_during_repeated_runs(spark, engine, orders, tmp_path):
    """Writers hold transactions open for random times (a fifth roll back) while runs follow one another."""
    import random

    url, lake = engine.url.render_as_string(hide_password=False), str(tmp_path / "lake")
    writing = True

    def writer(seed: int) -> None:
        rng = random.Random(seed)
        while writing:
            with engine.connect() as c:
                handle = begin(c)
                for j in range(rng.randint(1, 4)):
                    broker.send(c, handle, "order.submit", f'{{"writer": {seed}, "line": {j}}}')
                time.sleep(rng.random() * 0.6)
                if rng.random() < 0.2:
                    c.rollback()
                else:
                    c.commit()

    writers = [threading.Thread(target=writer, args=(seed,)) for seed in range(4)]
    for thread in writers:
        thread.start()
    held_back = 0
    try:
        runs = []
        for _ in range(12):
            time.sleep(0.2)
            runs.append(ingest(spark, url, WAREHOUSE_QUEUE, lake, partitions=3))
            with engine.connect() as c:
                newest = c.execute(text("SELECT max(queue_position) FROM broker.queue_messages")).scalar_one()
            held_back += newest is not None and newest > runs[-1].run.up_to_position
    finally:
        writing = False
        for thread in writers:
            thread.join()
    runs.append(ingest(spark, url, WAREHOUSE_QUEUE, lake, partitions=3))

    assert held_back > 0  # committed rows above a run's high-water mark waited for a later run
    assert [run.run.after_position for run in runs[1:]] == [run.run.up_to_position for run in runs[:-1]]
    content = dataset_content(spark, tmp_path / "lake")
    assert len(set(positions(content))) == len(content) == sum(run.rows for run in runs) > 0
    assert content == queue_content(engine)


def _start(command: list[str], database_url: str, log: Path) -> subprocess.Popen:
    env = {**os.environ, "BROKER_DATABASE_URL": database_url, "PYSPARK_PYTHON": sys.executable,
           "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    with log.open("ab") as out:
        return subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _wait_until(process: subprocess.Popen, reached, what: str, timeout_s: float = 120) -> None:
    wait_for(reached, timeout_s, what, interval_s=0.02, ended=lambda: process.poll() is not None and "the run ended")


def _kill_when(process: subprocess.Popen, reached, what: str) -> None:
    """SIGKILLs the run's whole process group (Python and its JVM) the moment `reached()` holds."""
    _wait_until(process, reached, what)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def _run(command: list[str], database_url: str, log: Path) -> str:
    process = _start(command, database_url, log)
    assert process.wait(timeout=180) == 0, log.read_text()[-3000:]
    return log.read_text().strip().splitlines()[-1]


def _files_under(folder: Path, name_glob: str = "*") -> bool:
    """Whether a file below folder matches name_glob; os.walk passes over the directories Spark
    removes while it looks (Path.rglob raises on them)."""
    return any(fnmatch.filter(files, name_glob) for _, _, files in os.walk(folder))


def _committed_runs(lake: Path) -> list[str]:
    return sorted(path.name for path in lake.glob("ingest_run=*")) if lake.exists() else []


def _checkpoint_row_locked(engine):
    """A transaction that holds the checkpoint row: a run blocks when it comes to advance it."""
    connection = engine.connect()
    connection.execute(text("SELECT 1 FROM broker.ingest_checkpoints FOR UPDATE")).one()
    return connection


def _blocked_at_the_checkpoint(engine) -> bool:
    with engine.connect() as c:
        return c.execute(text(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
            " AND query LIKE '%advance_ingest_checkpoint%'")).scalar_one() > 0


@pytest.mark.timeout(600)  # several Spark runs, each a JVM of its own: a loaded machine takes minutes
def test_runs_killed_at_any_instant_leave_every_message_exactly_once(spark, engine, orders, tmp_path):
    url, lake, log = engine.url.render_as_string(hide_password=False), tmp_path / "lake", tmp_path / "runs.log"
    module = [sys.executable, "-m", "broker.spark_ingest", "--output", str(lake), "--queue", WAREHOUSE_QUEUE]
    command_line = [str(BIN / "broker"), "ingest", "--output", str(lake), "--queue", WAREHOUSE_QUEUE]
    spark_submit = [str(BIN / "spark-submit"), "--master", "local[2]", "--jars", "/usr/share/java/postgresql.jar",
                    str(Path(__file__).parents[2] / "spark_ingest" / "__main__.py"), "--output", str(lake),
                    "--queue", WAREHOUSE_QUEUE]
    send_conversations(engine, 600, 5, "a")

    # During the read and write: the first Parquet file appears in the staging directory.
    run = _start([*module, "--partitions", "16", "--fetch-size", "100"], url, log)
    _kill_when(run, lambda: _files_under(lake / "_incoming", "*.parquet"), "writing")
    assert _committed_runs(lake) == []

    # After the write and its rename into the dataset, before the checkpoint: the run waits for the row we hold.
    send_conversations(engine, 50, 5, "b")
    holder = _checkpoint_row_locked(engine)
    run = _start(command_line, url, log)
    _kill_when(run, lambda: _blocked_at_the_checkpoint(engine), "the checkpoint")
    holder.rollback()
    holder.close()
    [written] = _committed_runs(lake)
    assert f"adopted run {written.removeprefix('ingest_run=')}" in _run(module, url, log)

    # Around Spark's job commit: written to staging, renamed or not yet.
    send_conversations(engine, 50, 5, "c")
    run = _start(command_line, url, log)
    _kill_when(run, lambda: _files_under(lake / "_incoming", "_SUCCESS") or len(_committed_runs(lake)) > 1,
               "its job commit")

    # Reruns (through spark-submit) adopt what was committed, then read the rest.
    send_conversations(engine, 50, 5, "d")
    summaries = [_run(spark_submit, url, log)]
    while "adopted" in summaries[-1]:
        summaries.append(_run(spark_submit, url, log))

    content = dataset_content(spark, lake)
    assert len(set(positions(content))) == len(content) == 3750
    assert content == queue_content(engine)
    assert not _files_under(lake / "_incoming")


def test_consume_deletes_the_rows_only_when_the_checkpoint_commits(spark, engine, orders, tmp_path):
    url, lake, log = engine.url.render_as_string(hide_password=False), tmp_path / "lake", tmp_path / "runs.log"
    send_conversations(engine, 40, 5, "a")
    first_batch = queue_content(engine)
    summary = ingest(spark, url, WAREHOUSE_QUEUE, str(lake), consume=True)
    assert summary.consumed == summary.rows == 200 and queue_content(engine) == []

    send_conversations(engine, 40, 5, "b")
    second_batch = queue_content(engine)
    holder = _checkpoint_row_locked(engine)
    run = _start([sys.executable, "-m", "broker.spark_ingest", "--consume", "--output", str(lake),
                  "--queue", WAREHOUSE_QUEUE], url, log)
    _kill_when(run, lambda: _blocked_at_the_checkpoint(engine), "the checkpoint")
    assert len(_committed_runs(lake)) == 2
    assert queue_content(engine) == second_batch  # in the dataset, not yet consumed
    holder.rollback()
    holder.close()
    assert queue_content(engine) == second_batch

    rerun = ingest(spark, url, WAREHOUSE_QUEUE, str(lake), consume=True)
    assert rerun.adopted and rerun.consumed == rerun.rows == 200
    assert queue_content(engine) == []
    assert dataset_content(spark, lake) == first_batch + second_batch


def test_what_the_ingest_refuses(spark, engine, orders, tmp_path):
    url = engine.url.render_as_string(hide_password=False)
    with pytest.raises(broker.UnknownObject, match="unknown queue 'nope'"):
        ingest(spark, url, "nope", str(tmp_path / "lake"))

    lake = tmp_path / "lake"
    with engine.connect() as other_run:
        other_run.execute(text("SELECT broker.try_lock_ingest(:queue, :output)"),
                          {"queue": WAREHOUSE_QUEUE, "output": f"file:{lake}"})
        with pytest.raises(IngestError, match="another ingest of queue 'warehouse_queue' into .* is running"):
            ingest(spark, url, WAREHOUSE_QUEUE, str(lake))
        other_run.execute(text("SELECT pg_advisory_unlock_all()"))  # the other run ends

    (lake / "ingest_run=100-200").mkdir(parents=True)
    with pytest.raises(IngestError, match="holds runs past the checkpoint at position 0"):
        ingest(spark, url, WAREHOUSE_QUEUE, str(lake))
    with engine.connect() as c:
        assert c.execute(text("SELECT queue_position FROM broker.ingests")).scalar_one() == 0


def _ingest_lock_holders(engine) -> list[int]:
    """The backends that hold an ingest run's lock (the advisory lock class of broker.try_lock_ingest)."""
    with engine.connect() as c:
        return c.execute(text("SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND classid = 1651663725"
                              " AND granted")).scalars().all()


def _checkpoint(engine) -> tuple:
    with engine.connect() as c:
        return tuple(c.execute(text("SELECT queue_position, last_run, rows_ingested FROM broker.ingests")).one())


def test_a_run_that_loses_its_lock_commits_nothing_and_the_next_run_is_not_doubled(spark, engine, orders, tmp_path):
    url, lake = engine.url.render_as_string(hide_password=False), tmp_path / "lake"
    module = [sys.executable, "-m", "broker.spark_ingest", "--output", str(lake), "--queue", WAREHOUSE_QUEUE]
    send_conversations(engine, 600, 5, "a")

    # The first run is paused mid-write (as a long GC pause or a stopped VM would) and its lock's session ends.
    first = _start([*module, "--master", "local[2,4]", "--partitions", "24", "--fetch-size", "10"], url,
                   tmp_path / "first.log")
    try:
        _wait_until(first, lambda: _files_under(lake / "_incoming", "*.parquet"), "writing")
        os.killpg(first.pid, signal.SIGSTOP)
        [holder] = _ingest_lock_holders(engine)
        with engine.connect() as c:
            assert c.execute(text("SELECT pg_terminate_backend(:pid, 10000)"), {"pid": holder}).scalar_one()
        assert _ingest_lock_holders(engine) == []

        # A second run takes the free lock and commits everything, including rows sent since.
        send_conversations(engine, 50, 5, "b")
        second = _run(module, url, tmp_path / "second.log")
        assert "3,250 rows" in second
    finally:
        os.killpg(first.pid, signal.SIGCONT)
        try:
            first.wait(timeout=180)
        finally:
            if first.poll() is None:
                os.killpg(first.pid, signal.SIGKILL)

    # The first run wakes up, finds its lock gone and stops without touching the dataset or the checkpoint.
    first_log = (tmp_path / "first.log").read_text()
    assert first.returncode == 1, first_log[-3000:]
    assert re.search(r"\nspark_ingest: the ingest of queue 'warehouse_queue' into \S+ lost its lock \(its database "
                     r"session ended: [^\n]+\): another run may hold it now, so this one stops without committing",
                     first_log)
    [committed] = _committed_runs(lake)
    run_id = committed.removeprefix("ingest_run=")
    assert _checkpoint(engine) == (int(run_id.split("-")[1]), run_id, 3250)
    content = dataset_content(spark, lake)
    assert len(set(positions(content))) == len(content) == 3250
    assert content == queue_content(engine)
    assert ingest(spark, url, WAREHOUSE_QUEUE, str(lake)).rows == 0


def test_a_run_that_loses_its_lock_at_the_checkpoint_leaves_its_output_to_the_next_run(spark, engine, orders,
                                                                                      tmp_path):
    url, lake, log = engine.url.render_as_string(hide_password=False), tmp_path / "lake", tmp_path / "run.log"
    send_conversations(engine, 40, 5)
    with engine.begin() as c:  # the dataset's checkpoint row, at 0
        c.execute(text("SELECT broker.start_ingest(:queue, :output)"),
                  {"queue": WAREHOUSE_QUEUE, "output": f"file:{lake}"})
    holder = _checkpoint_row_locked(engine)
    run = _start([sys.executable, "-m", "broker.spark_ingest", "--consume", "--output", str(lake), "--queue",
                  WAREHOUSE_QUEUE], url, log)
    try:
        _wait_until(run, lambda: _blocked_at_the_checkpoint(engine), "the checkpoint")
        [lock_session] = _ingest_lock_holders(engine)
        with engine.connect() as c:
            assert c.execute(text("SELECT pg_terminate_backend(:pid, 10000)"), {"pid": lock_session}).scalar_one()
        assert run.wait(timeout=60) == 1
    finally:
        holder.rollback()
        holder.close()
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    assert re.search(r"\nspark_ingest: the ingest of queue 'warehouse_queue' into \S+ lost its lock \(its database "
                     r"session ended: [^\n]+\): another run may hold it now, so this one stops without committing",
                     log.read_text())
    assert _checkpoint(engine) == (0, None, 0) and len(queue_content(engine)) == 200  # neither advanced nor consumed

    expected = queue_content(engine)
    rerun = ingest(spark, url, WAREHOUSE_QUEUE, str(lake), consume=True)
    assert rerun.adopted and rerun.consumed == rerun.rows == 200
    assert dataset_content(spark, lake) == expected


def test_a_run_never_renames_over_positions_that_a_run_in_the_dataset_covers(spark, engine, orders, tmp_path):
    url, lake, log = engine.url.render_as_string(hide_password=False), tmp_path / "lake", tmp_path / "run.log"
    send_conversations(engine, 600, 5)
    run = _start([sys.executable, "-m", "broker.spark_ingest", "--output", str(lake), "--queue", WAREHOUSE_QUEUE,
                  "--partitions", "24", "--fetch-size", "10"], url, log)
    try:
        _wait_until(run, lambda: _files_under(lake / "_incoming", "*.parquet"), "writing")
        os.killpg(run.pid, signal.SIGSTOP)
        (lake / "ingest_run=0-1").mkdir()  # committed meanwhile by something that did not take the lock
        os.killpg(run.pid, signal.SIGCONT)
        assert run.wait(timeout=180) == 1
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    assert re.search(r"\nspark_ingest: file:\S+ already holds run 0-1, which covers positions of run 0-\d+: another "
                     r"run committed it, so this one stops without committing\n", log.read_text())
    assert _committed_runs(lake) == ["ingest_run=0-1"]
    assert _checkpoint(engine) == (0, None, 0)


def test_a_write_longer_than_the_idle_session_timeout_keeps_its_lock(spark, engine, orders, tmp_path):
    url = engine.url.update_query_dict({"options": "-c idle_session_timeout=1000"})
    lake = tmp_path / "lake"
    send_conversations(engine, 600, 5)
    run = _start([sys.executable, "-m", "broker.spark_ingest", "--output", str(lake), "--queue", WAREHOUSE_QUEUE,
                  "--partitions", "24", "--fetch-size", "10"], url.render_as_string(hide_password=False),
                 tmp_path / "run.log")
    try:
        _wait_until(run, lambda: _files_under(lake / "_incoming", "*.parquet"), "writing")
        holders = []
        with engine.connect() as stall:  # the reads still to come wait for this lock: the write stalls for 3 s
            stall.execute(text("LOCK TABLE broker.queue_messages IN ACCESS EXCLUSIVE MODE"))
            until = time.monotonic() + 3
            while time.monotonic() < until:
                holders.append(len(_ingest_lock_holders(engine)))
                time.sleep(0.1)
            stall.rollback()
        assert run.wait(timeout=180) == 0, (tmp_path / "run.log").read_text()[-3000:]
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    assert set(holders) == {1}  # held all along, though its session had nothing to do for 3 s
    assert dataset_content(spark, lake) == queue_content(engine)


def test_a_dataset_with_overlapping_runs_is_reported_and_left_alone(spark, engine, orders, tmp_path):
    url, lake = engine.url.render_as_string(hide_password=False), tmp_path / "lake"
    send_conversations(engine, 20, 5)
    first = ingest(spark, url, WAREHOUSE_QUEUE, str(lake))
    # What a run that lost its lock would leave beside the run that committed: some of the same rows again.
    shutil.copytree(lake / f"ingest_run={first.run.run_id}", lake / f"ingest_run=0-{first.run.up_to_position - 1}")
    send_conversations(engine, 5, 5, "b")
    before = _checkpoint(engine)

    with pytest.raises(IngestError) as refused:
        ingest(spark, url, WAREHOUSE_QUEUE, str(lake))
    assert re.fullmatch(rf"file:{lake} holds overlapping runs 0-{first.run.up_to_position - 1} and "
                        rf"{first.run.run_id}: .*", str(refused.value))
    assert "\n" not in str(refused.value)
    assert _checkpoint(engine) == before
    assert _committed_runs(lake) == sorted([f"ingest_run={first.run.run_id}",
                                            f"ingest_run=0-{first.run.up_to_position - 1}"])


_DESCRIPTOR_PATH = re.compile(r"\(\d+<([^>]*)>")  # strace -y: a call's file descriptor and its path


def test_consume_deletes_only_rows_whose_files_and_directories_are_on_disk(spark, engine, orders, tmp_path):
    url, lake = engine.url.render_as_string(hide_password=False), tmp_path / "lake"
    assert shutil.which("strace"), "this test watches the run with strace: apt-get install strace"
    send_conversations(engine, 100, 5)
    trace = tmp_path / "strace.log"
    strace = ["strace", "-f", "--seccomp-bpf", "-qq", "-y", "-s", "1000", "-e", "signal=none",
              "-e", "trace=fsync,fdatasync,syncfs,sync,rename,renameat,renameat2,sendto", "-o", str(trace)]
    last = _run([*strace, sys.executable, "-m", "broker.spark_ingest", "--consume", "--partitions", "4", "--output",
                 str(lake), "--queue", WAREHOUSE_QUEUE], url, tmp_path / "run.log")
    assert "500 rows consumed" in last and queue_content(engine) == []

    lines = trace.read_text(errors="replace").splitlines()
    [committed] = _committed_runs(lake)
    [rename_at] = [i for i, line in enumerate(lines) if re.search(r" rename(at2?)?\(", line)
                   and f'"{lake / committed}"' in line]
    staging = re.search(rf'"({re.escape(str(lake / "_incoming"))}/[^"]+)"', lines[rename_at])[1]
    [advance_at] = [i for i, line in enumerate(lines) if "sendto(" in line and "advance_ingest_checkpoint" in line]
    assert rename_at < advance_at

    def synced(between: range) -> set[str]:
        return {path[1] for i in between if re.match(r"\d+ +(fsync|fdatasync)\(", lines[i])
                for path in [_DESCRIPTOR_PATH.search(lines[i])] if path}

    # Every file and directory of the run, under its staging name, before the rename makes it part of the dataset.
    written = [Path(folder, name).relative_to(lake / committed)
               for folder, folders, files in os.walk(lake / committed) for name in [*folders, *files]]
    assert len([name for name in written if name.suffix == ".parquet"]) == 4
    assert {f"{staging}/{name}" for name in written} | {staging} <= synced(range(rename_at))
    # The directories the rename changed, before the checkpoint (and the delete) commits.
    assert {str(lake), str(lake / "_incoming")} <= synced(range(rename_at + 1, advance_at))
