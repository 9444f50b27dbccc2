"""The ingest's lock in SQL: only the session that holds it advances the checkpoint."""
import pytest
from sqlalchemy import text

import broker
from broker import queries
from broker.errors import translated_errors
from broker.spark_ingest.lock import RunLock
from tests.factories import WAREHOUSE_QUEUE

OUTPUTS = [f"file:/lake/{i}" for i in range(8)]  # lock keys of both signs


def _call(connection, function: str, output: str, **arguments):
    return queries.call(connection, function, queue=WAREHOUSE_QUEUE, output=output, **arguments).scalar_one()


def _advance(connection, output: str) -> int:
    _call(connection, "start_ingest", output)
    with translated_errors():
        return _call(connection, "advance_ingest_checkpoint", output, after_position=0, up_to_position=10,
                     run="0-10", rows_ingested=0, consume=False)


def _end_session(engine, session) -> None:
    """Commits what the session did, then ends its server process from another session, as a restart or a cut
    connection would."""
    pid = session.execute(text("SELECT pg_backend_pid()")).scalar_one()
    session.commit()
    with engine.connect() as admin:
        assert admin.execute(text("SELECT pg_terminate_backend(:pid, 10000)"), {"pid": pid}).scalar_one()


def test_only_the_session_holding_the_lock_advances_the_checkpoint(engine, orders):
    with engine.connect() as run, engine.connect() as other:
        for output in OUTPUTS:
            assert _call(run, "try_lock_ingest", output)
            assert not _call(other, "try_lock_ingest", output)
            assert _call(run, "holds_ingest_lock", output) and not _call(other, "holds_ingest_lock", output)
            with pytest.raises(broker.LockLost, match="is not locked by this session"):
                _advance(other, output)
            other.rollback()
            assert _advance(run, output) == 0
        run.commit()
        positions = run.execute(text("SELECT array_agg(DISTINCT queue_position) FROM broker.ingests")).scalar_one()
    assert positions == [10]


def test_a_lock_whose_session_ended_is_no_ones(engine, orders):
    with engine.connect() as run:
        assert _call(run, "try_lock_ingest", OUTPUTS[0])
        _end_session(engine, run)
        run.invalidate()
    with engine.connect() as late:
        assert not _call(late, "holds_ingest_lock", OUTPUTS[0])
        with pytest.raises(broker.LockLost):
            _advance(late, OUTPUTS[0])


def test_a_run_lets_its_lock_go_before_its_session_closes(engine, orders):
    """A follow's next round starts at once: it must not find the lock of the round before still held by a server
    process that is only exiting."""
    with engine.connect() as session, engine.connect() as next_round:
        lock = RunLock(session, WAREHOUSE_QUEUE, OUTPUTS[0])
        lock.acquire()
        assert not _call(next_round, "try_lock_ingest", OUTPUTS[0])
        lock.release()
        assert _call(next_round, "try_lock_ingest", OUTPUTS[0])


def test_a_run_whose_session_ended_after_its_checkpoint_still_ends_well(engine, orders):
    """The run has committed when it lets its lock go: a session gone by then took the lock with it."""
    with engine.connect() as session:
        lock = RunLock(session, WAREHOUSE_QUEUE, OUTPUTS[0])
        lock.acquire()
        _end_session(engine, session)
        lock.release()
    with engine.connect() as next_run:
        assert _call(next_run, "try_lock_ingest", OUTPUTS[0])
