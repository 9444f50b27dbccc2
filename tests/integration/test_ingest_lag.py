"""An ingest's lag in SQL (broker.ingest_lag): the messages above its checkpoint and the oldest one's age."""
import os
import subprocess
import sys
import time

from sqlalchemy import text

import broker
from tests.factories import WAREHOUSE_QUEUE, begin

OUTPUT = "file:/lake/warehouse"
LAG = text("SELECT lag_messages, lag_s FROM broker.ingest_lag() WHERE queue_name = :queue AND output = :output")


def _lag(engine) -> tuple[int, float] | None:
    with engine.connect() as c:
        row = c.execute(LAG, {"queue": WAREHOUSE_QUEUE, "output": OUTPUT}).one_or_none()
    return None if row is None else tuple(row)


def _send(engine, messages: int) -> None:
    with engine.begin() as c:
        handle = begin(c)
        for i in range(messages):
            broker.send(c, handle, "order.note", f"note {i}".encode())


def _status_row(engine) -> list[str]:
    """The cells of the ingest's row in `broker status`, as a person reads them."""
    shown = subprocess.run([sys.executable, "-m", "broker.cli", "status"], capture_output=True, text=True, timeout=60,
                           env={**os.environ, "BROKER_DATABASE_URL": engine.url.render_as_string(hide_password=False)},
                           check=True).stdout
    [row] = [line for line in shown.splitlines() if OUTPUT in line]
    return [cell.strip() for cell in row.split("│")[1:-1]]


def test_the_lag_counts_the_messages_above_the_checkpoint_and_ages_the_oldest(engine, orders):
    _send(engine, 2)
    assert _lag(engine) is None  # no run yet: no checkpoint
    with engine.connect() as run:
        assert run.execute(text("SELECT broker.try_lock_ingest(:queue, :output)"),
                           {"queue": WAREHOUSE_QUEUE, "output": OUTPUT}).scalar_one()
        run.execute(text("SELECT broker.start_ingest(:queue, :output)"), {"queue": WAREHOUSE_QUEUE, "output": OUTPUT})
        run.commit()
        time.sleep(0.2)
        messages, oldest = _lag(engine)
        assert messages == 2 and 0.2 <= oldest < 30
        lag, oldest_shown = _status_row(engine)[-2:]
        assert lag == "2" and oldest_shown.endswith(" s")

        with engine.connect() as open_transaction:  # not committed: not waiting for the ingest yet
            broker.send(open_transaction, begin(open_transaction), "order.note", b"uncommitted")
            assert _lag(engine)[0] == 2
        _send(engine, 3)
        assert _lag(engine)[0] == 5

        up_to = run.execute(text("SELECT max(queue_position) FROM broker.queue_messages")).scalar_one()
        run.execute(text("SELECT broker.advance_ingest_checkpoint(:queue, :output, 0, :up_to, :run, 5)"),
                    {"queue": WAREHOUSE_QUEUE, "output": OUTPUT, "up_to": up_to, "run": f"0-{up_to}"})
        run.commit()
    assert _lag(engine) == (0, 0.0)
    assert _status_row(engine)[-2:] == ["0", ""]
