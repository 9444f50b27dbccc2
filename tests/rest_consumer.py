"""A REST consumer that processes each message exactly once, even across its own crashes.

It applies every message in its own database transaction together with the
last sequence number applied for that conversation, skips what it applied
already, and completes the lock only afterwards. Run as
`python -m tests.rest_consumer URL KEY QUEUE DATABASE_URL [--crash-after N]`;
with --crash-after it kills itself (SIGKILL) after applying N messages, with a
lock held and not completed. At the end it prints what it did as JSON.
"""
import argparse
import json
import os
import signal

import httpx
import psycopg2

PROGRESS = """
CREATE TABLE IF NOT EXISTS consumer_progress (conversation_id uuid PRIMARY KEY, last_applied bigint NOT NULL);
CREATE TABLE IF NOT EXISTS consumer_effects (conversation_id uuid, sequence_number bigint, body jsonb,
                                             PRIMARY KEY (conversation_id, sequence_number));
"""
LAST_APPLIED = "SELECT last_applied FROM consumer_progress WHERE conversation_id = %s FOR UPDATE"
APPLY = "INSERT INTO consumer_effects VALUES (%s, %s, %s)"
ADVANCE = """INSERT INTO consumer_progress VALUES (%s, %s)
             ON CONFLICT (conversation_id) DO UPDATE SET last_applied = excluded.last_applied"""


def apply_once(database, message) -> bool:
    """Applies the message unless it was applied before; True when it was applied now."""
    with database, database.cursor() as cursor:  # one transaction
        cursor.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (message["conversation_id"],))
        cursor.execute(LAST_APPLIED, (message["conversation_id"],))
        row = cursor.fetchone()
        if row and message["sequence_number"] <= row[0]:
            return False
        cursor.execute(APPLY, (message["conversation_id"], message["sequence_number"], json.dumps(message["body"])))
        cursor.execute(ADVANCE, (message["conversation_id"], message["sequence_number"]))
        return True


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("url", "key", "queue", "database_url"):
        parser.add_argument(name)
    parser.add_argument("--crash-after", type=int)
    parser.add_argument("--lock-s", type=float, default=1.0)
    options = parser.parse_args()
    database = psycopg2.connect(options.database_url)
    with database, database.cursor() as cursor:
        cursor.execute(PROGRESS)
    done = {"applied": 0, "skipped": 0, "redelivered": 0}
    with httpx.Client(base_url=options.url, headers={"Authorization": f"Bearer {options.key}"}, timeout=30) as api:
        while True:
            response = api.post(f"/v1/queues/{options.queue}/receive",
                                json={"max_messages": 10, "wait_ms": 2000, "lock_s": options.lock_s})
            if response.status_code == 204:
                break
            response.raise_for_status()
            lock = response.json()
            for message in lock["messages"]:
                done["redelivered"] += message["delivery_count"] > 1
                applied = apply_once(database, message)
                done["applied" if applied else "skipped"] += 1
                if options.crash_after is not None and done["applied"] == options.crash_after:
                    os.kill(os.getpid(), signal.SIGKILL)
            api.post(f"/v1/locks/{lock['lock_token']}/complete").raise_for_status()
    print(json.dumps(done))


if __name__ == "__main__":
    main()
