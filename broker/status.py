"""What a node is doing, read from its catalog: the data behind `broker status` and the console."""
from datetime import datetime
from typing import Any
from uuid import UUID

from sqlalchemy import Connection

from broker import __version__, queries


def node_status(connection: Connection, dead_letters: int = 20) -> dict[str, Any]:
    """This node's release and schema revision; queues, their activation, conversations by service and state, the
    transmission queue by destination,
    ingests, the latest dead letters, and what a database that went back lost."""
    return {
        "version": __version__,
        "schema_revision": connection.execute(queries.QUERIES["schema_revision"]).scalar(),
        "queues": queries.as_dicts(queries.queue_statuses(connection)),
        "activation": queries.as_dicts(connection.execute(queries.QUERIES["activation_status"])),
        "conversations": queries.as_dicts(connection.execute(queries.QUERIES["conversation_counts"])),
        "transmission_queue": queries.as_dicts(connection.execute(queries.QUERIES["transmission_by_destination"])),
        "ingests": queries.as_dicts(connection.execute(queries.QUERIES["ingests"])),
        "dead_letters": queries.as_dicts(connection.execute(queries.QUERIES["latest_dead_letters"],
                                                            {"limit": dead_letters})),
        "lost_messages": [dict(row, explanation=lost_messages_explained(row))
                          for row in queries.as_dicts(connection.execute(queries.QUERIES["lost_messages"],
                                                                         {"limit": dead_letters}))],
    }


def lost_messages_explained(lost: dict[str, Any]) -> str:
    """A row of broker.lost_messages in words."""
    numbers = f"messages {lost['first_number']} to {lost['last_number']}"
    if lost["direction"] == "received":
        return {"missing": f"{numbers} from the far node are missing here: this database went back to an earlier "
                           "point; the far node is asked to send them again",
                "resent": f"{numbers} from the far node went missing here and were sent again",
                "lost": f"{numbers} from the far node went missing here and the far node no longer had them: "
                        "the conversation ended with broker.error -4",
                "renumbered": f"the far node's database went back: it had sent {numbers} before, and numbers its "
                              "messages past them (see the broker.renumbered message)"}[lost["outcome"]]
    return {"resent": f"the far node's database went back and lost {numbers} from here: sent again from the "
                      "resend window",
            "lost": f"the far node's database went back and lost {numbers} from here, which the resend window no "
                    "longer held: the conversation ended with broker.error -4",
            "renumbered": f"this database went back: the far node already held {numbers} from before, and the "
                          "messages after them were numbered past them (see the broker.renumbered message)",
            "withheld": f"{numbers} waited longer than the far node remembers ended conversations: they were not "
                        "sent, lest they reach it as new; they are in the dead letters and the conversation ended "
                        "here with broker.error -5",
            "missing": numbers}[lost["outcome"]]


# A conversation's messages listed at most, by `broker status --conversation`, the REST API and the console: the
# rest are counted.
MESSAGES_LISTED = 1000
COUNTS = {"held_here", "waiting_to_send", "not_received"}


def conversation_life(connection: Connection, handle: UUID) -> dict[str, Any] | None:
    """One side of a conversation on this node: the side itself, how many messages it sent and how many of those
    are gone (acknowledged by the far node, or delivered to a local one), how many arrived and how many of those
    were received, and the first MESSAGES_LISTED messages still here with why each waits, and how many more are
    not listed.  None for an unknown handle."""
    side = connection.execute(queries.QUERIES["endpoint"], {"handle": handle}).first()
    if side is None:
        return None
    rows = connection.execute(queries.QUERIES["conversation_messages"],
                              {"handle": handle, "limit": MESSAGES_LISTED}).all()
    counts = rows[0] if rows else None
    return {
        "conversation": side._asdict(),
        "sent": side.send_sequence,
        "sent_and_gone": side.send_sequence - (counts.waiting_to_send if counts else 0),
        "arrived": side.receive_sequence,
        "arrived_and_received": max(side.receive_sequence - (counts.not_received if counts else 0), 0),
        "messages": [{name: value for name, value in row._mapping.items() if name not in COUNTS} for row in rows],
        "messages_not_listed": counts.held_here - len(rows) if counts else 0,
    }


def json_default(value: Any) -> Any:
    """For json.dumps: datetimes as ISO 8601, UUIDs as strings (ages are float8 already)."""
    return value.isoformat() if isinstance(value, datetime) else str(value)


def age(seconds: float | None) -> str:
    """A duration in words a person reads at a glance: 0.4 s, 12 s, 5 min, 3.5 h, 2 d."""
    if seconds is None:
        return ""
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= 2 * size:
            return f"{seconds / size:.1f} {unit}".replace(".0 ", " ")
    return f"{seconds:.1f} s" if seconds < 10 else f"{seconds:.0f} s"
