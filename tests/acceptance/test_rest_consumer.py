"""A REST consumer killed mid-processing loses nothing and applies nothing twice."""
import json
import signal
import subprocess
import sys

from sqlalchemy import text

from tests import factories
from tests.rest import ApiServer, new_key

CONVERSATIONS, MESSAGES = 10, 5


def _consume(api, key, database_url, *options):
    return subprocess.run([sys.executable, "-m", "tests.rest_consumer", api.url, key, factories.WAREHOUSE_QUEUE,
                           database_url, *options], capture_output=True, text=True, timeout=120)


def test_a_consumer_that_crashes_mid_processing_applies_every_message_exactly_once(database_url, engine, orders):
    with ApiServer(database_url) as api:
        with api.client(new_key(engine, "send:shop")) as sender:
            for _ in range(CONVERSATIONS):
                handle = sender.post("/v1/conversations", json={
                    "from_service": "shop", "to_service": "warehouse", "contract": "orders"}).json()[
                    "conversation_handle"]
                for n in range(1, MESSAGES + 1):
                    sender.post(f"/v1/conversations/{handle}/messages",
                                json={"message_type": "order.submit", "body": {"n": n}, "sequence_number": n})
        key = new_key(engine, "receive:warehouse_queue")

        crashed = _consume(api, key, database_url, "--crash-after", "7")
        assert crashed.returncode == -signal.SIGKILL, crashed.stderr
        with engine.connect() as connection:
            applied_before_crash = connection.execute(text("SELECT count(*) FROM consumer_effects")).scalar()
        assert applied_before_crash == 7

        recovered = _consume(api, key, database_url)
        assert recovered.returncode == 0, recovered.stderr
        done = json.loads(recovered.stdout)
        # The crashed lock expired and its messages came back: those applied before the crash were skipped.
        assert done["redelivered"] >= 1 and done["skipped"] >= 1
        assert done["applied"] == CONVERSATIONS * MESSAGES - applied_before_crash

    with engine.connect() as connection:
        effects = connection.execute(text(
            "SELECT conversation_id, array_agg(sequence_number ORDER BY sequence_number) FROM consumer_effects"
            " GROUP BY conversation_id")).all()
        assert len(effects) == CONVERSATIONS
        assert all(numbers == list(range(1, MESSAGES + 1)) for _, numbers in effects)
        assert connection.execute(text("SELECT count(*) FROM broker.queue_messages")).scalar() == 0
        assert connection.execute(text("SELECT count(*) FROM broker.leases")).scalar() == 0
