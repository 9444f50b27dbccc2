"""Writes docs/reference/sql.md, the SQL reference, from a database the project built.

Every function of schema broker whose name does not start with an underscore is listed with its signature and
its COMMENT (the text of its COMMENT ON FUNCTION in broker/sql/functions/), grouped by the file that defines
it; the sections on views, tables and traces follow, from this module.  So the page says what the database
says, and tests/integration/test_sql_reference.py fails when the committed page differs from what this renders.

    BROKER_DATABASE_URL=postgresql://... python docs/sql_reference.py

writes the page from that (migrated) database; without BROKER_DATABASE_URL, it starts an embedded PostgreSQL in
a temporary folder, builds the schema there, writes the page and stops the server.
"""
import os
import re
import tempfile
from pathlib import Path

import psycopg2

from broker import schema

PAGE = Path(__file__).resolve().parent / "reference" / "sql.md"

FUNCTIONS = """
    SELECT p.proname, pg_get_function_arguments(p.oid), pg_get_function_result(p.oid),
           obj_description(p.oid, 'pg_proc')
    FROM pg_proc p
    WHERE p.pronamespace = 'broker'::regnamespace
      AND left(p.proname, 1) <> '_'
    ORDER BY p.proname, p.pronargs DESC, pg_get_function_identity_arguments(p.oid)
"""

# The section title of each file of broker/sql/functions/; a file not named here gets one from its name.
FILE_TITLES = {
    "01_catalog.sql": "Catalog: message types, contracts, queues, services and routes",
    "02_delivery.sql": "Queue positions",
    "03_priorities.sql": "Broker priorities",
    "04_dialogs.sql": "Beginning and ending conversations",
    "05_send.sql": "Sending",
    "06_receive.sql": "Receiving",
    "07_dead_letters.sql": "Poison messages and dead letters",
    "08_groups.sql": "Conversation groups",
    "09_timers.sql": "Timers and lifetimes",
    "10_transport_accepting.sql": "Between nodes: accepting batches",
    "11_transport_sending.sql": "Between nodes: sending batches",
    "12_leases.sql": "Peek-lock leases",
    "13_ingest.sql": "Ingest into Spark",
    "14_forgetting.sql": "What a node forgets",
    "15_compatibility.sql": "Releases",
    "16_peer_secrets.sql": "Rotating a peer's secret",
    "17_activation.sql": "Activation",
}
OTHER_FUNCTIONS = "Other functions"

DEFINITION = re.compile(r"^CREATE (?:OR REPLACE )?(?:FUNCTION|PROCEDURE) broker\.([a-z][a-z_0-9]*)\s*\(", re.MULTILINE)

# A signature longer than this is written one argument a line.
LINE_LENGTH = 100

# A line that Markdown may read as the start of a list, quote, heading, table, code or indented block.
BLOCK_START = re.compile(r"^(\s|[-*+>#|]|\d+[.)]|```)")

INTRODUCTION = """\
<!-- Written by docs/sql_reference.py from the COMMENT of each function: edit those, in broker/sql/functions/,
     and run `python docs/sql_reference.py`. -->

# SQL reference

All in schema `broker`. Names of message types, contracts, queues and services are 1–128
characters of letters, digits and `_ . : / @ # -`, starting with a letter, a digit or `/`;
names beginning with `broker.` are reserved.

Each function below is shown with its signature and the comment it carries in the database
(`\\df+ broker.*` in psql shows it too). A mark at the start of a comment says who calls the
function, where it is not an application: (admin) an operator, (relay) a node's relay, which sends
to other nodes, (node) a running node otherwise, (ingest) a `broker ingest` run. The SQLSTATEs the
functions raise (class BR) are listed, with their Python exceptions, in [Error codes](errors.md);
a refused call writes nothing. The REST API's routes, which call these functions, are in the
[REST reference](rest.md).
"""

OTHER_SECTIONS = """\
## Traces

The messages a transaction sends after `SET LOCAL broker.traceparent = '00-<trace
id>-<span id>-<flags>'` (a [W3C traceparent](https://www.w3.org/TR/trace-context/) of version
00, lower case) carry it; a malformed one is refused with SQLSTATE 23514 (the domain
`broker.traceparent`) and nothing is sent. `received_message` and `locked_message` end with
the message's `traceparent` (that of the span that last handed it on; following one message is
described in the how-to "Monitoring and tracing"), and `dead_letters` keeps it.

## Views and tables

- `conversation_endpoints`: each conversation side, with its state (`conversing`,
  `disconnected_inbound`, `disconnected_outbound`, `error`, `closed`) and its `priority`.
- `queue_status`: each queue's depth, oldest message age, readers holding a receive, and dead letters.
- `activation_status`: each activated queue's procedure, `status` `on`/`off`, `max_queue_readers`,
  `execute_as`, the `readers` running now on all nodes, `activations` and `failures` (calls committed
  and rolled back), `last_failure` and `last_failure_at`.
- `transmission_queue_status`: one row per message waiting for a remote node, with `transmission_status`
  in words.
- `destination_queue`: the queues' messages with their names, for bulk readers.
- `ingests`: each ingest's checkpoint, last run and rows.
- `endpoint_counts`: endpoints per service and state, and how many have no lifetime.
- `node`: the node's settings, in its one row: `max_message_bytes`, `closed_endpoint_retention`,
  `tombstone_retention` (at least a day), `resend_window` (24 hours; 0 keeps nothing).
- `dead_letters`: the quarantined messages, with their reason.
- `broker_priorities`: the broker priorities.

## A database that went back: `lost_messages`

A database that went back to an earlier point (a restore from a backup, a recovery to a point in
time, a failover to a standby that lagged: see "The guarantees") is found, and healed where the
data exists. `lost_messages` has a row per conversation side and run of numbers, with `direction`
(`received`: from the far node; `sent`: this side's), `first_number`, `last_number` and `outcome`:
`missing` (a receiver waits for them to be sent again), `resent`, `renumbered` (this side's messages
were numbered past numbers the far side already held), `lost` (the conversation ended with
`broker.error` code -4) or `withheld` (see [`withhold_what_peers_forgot`](#withhold_what_peers_forgot)).

- `acknowledged_messages` keeps what far nodes acknowledged, for the resend window.
- `transmission_progress` keeps each conversation side's highest number transmitted and acknowledged.
- `far_node_checks` says when a far node that lost numbers it had acknowledged was last asked about
  every conversation with it.

The system message `broker.renumbered` (JSON `first_number`, `last_number`, `next_number`,
`description`) reaches the applications of both sides of a conversation whose sender went back.
"""


def defining_files() -> dict[str, str]:
    """The file of broker/sql/functions/ that defines each function, by the function's name."""
    files = {}
    for file in schema.function_files():
        for name in DEFINITION.findall(file.read_text()):
            files.setdefault(name, file.name)
    return files


def file_title(file_name: str) -> str:
    """A section's title: from FILE_TITLES, or made from the file's name (18_new_things.sql: "New things")."""
    if file_name in FILE_TITLES:
        return FILE_TITLES[file_name]
    words = re.sub(r"^[0-9]+_", "", file_name.removesuffix(".sql")).replace("_", " ")
    return words[:1].upper() + words[1:]


def split_arguments(arguments: str) -> list[str]:
    """pg_get_function_arguments' text split at the commas between arguments (not those in a default's
    quotes or parentheses)."""
    parts = []
    current = ""
    depth = 0
    quoted = False
    for character in arguments:
        if character == "'":
            quoted = not quoted
        elif not quoted and character == "(":
            depth += 1
        elif not quoted and character == ")":
            depth -= 1
        if character == "," and not quoted and depth == 0:
            parts.append(current.strip())
            current = ""
        else:
            current += character
    if current.strip():
        parts.append(current.strip())
    return parts


def signature(name: str, arguments: str, result: str | None) -> str:
    """The function's call as SQL: one line, or one argument a line when that is too long."""
    returns = f" RETURNS {result}" if result else ""
    one_line = f"broker.{name}({arguments}){returns}"
    if len(one_line) <= LINE_LENGTH or not arguments:
        return one_line
    lines = ",\n".join(f"    {argument}" for argument in split_arguments(arguments))
    return f"broker.{name}(\n{lines}\n){returns}"


def as_paragraphs(comment: str) -> str:
    """A comment as Markdown, its paragraphs each on one line: the line breaks of a COMMENT follow the width of
    the SQL file, not the text.  A paragraph with a line that may start a Markdown block is kept as it is."""
    paragraphs = []
    for paragraph in re.split(r"\n\s*\n", comment.strip()):
        lines = paragraph.splitlines()
        if any(BLOCK_START.match(line) for line in lines[1:]):
            paragraphs.append(paragraph)
        else:
            paragraphs.append(" ".join(line.strip() for line in lines))
    return "\n\n".join(paragraphs)


def function_entry(name: str, overloads: list[tuple[str, str | None, str | None]]) -> str:
    """A function's part of the page: its heading, and the signature and comment of each of its forms."""
    parts = [f"### {name}\n"]
    for arguments, result, comment in overloads:
        parts.append(f"```sql\n{signature(name, arguments, result)}\n```\n")
        parts.append(f"{as_paragraphs(comment or '') or '(no comment)'}\n")
    return "\n".join(parts)


def read_functions(connection) -> dict[str, list[tuple[str, str | None, str | None]]]:
    """Each function's forms, (arguments, result, comment), by its name; a name's forms with the most arguments
    first."""
    functions: dict[str, list[tuple[str, str | None, str | None]]] = {}
    with connection.cursor() as cursor:
        cursor.execute(FUNCTIONS)
        for name, arguments, result, comment in cursor.fetchall():
            functions.setdefault(name, []).append((arguments, result, comment))
    return functions


def sql_reference(connection) -> str:
    """The page docs/reference/sql.md for the database of `connection` (a psycopg2 connection)."""
    functions = read_functions(connection)
    files = defining_files()
    sections: dict[str, list[str]] = {}
    for file in schema.function_files():
        names = [name for name, defined_in in files.items() if defined_in == file.name and name in functions]
        if names:
            sections[file_title(file.name)] = names
    others = sorted(name for name in functions if name not in files)
    if others:
        sections[OTHER_FUNCTIONS] = others

    parts = [INTRODUCTION]
    for title, names in sections.items():
        parts.append(f"## {title}\n")
        parts.extend(function_entry(name, functions[name]) for name in names)
    parts.append(OTHER_SECTIONS)
    return "\n".join(parts)


def write_page(database_url: str) -> None:
    connection = psycopg2.connect(database_url)
    try:
        page = sql_reference(connection)
    finally:
        connection.close()
    PAGE.parent.mkdir(parents=True, exist_ok=True)
    PAGE.write_text(page)
    print(f"wrote {PAGE}")


def main() -> None:
    database_url = os.environ.get("BROKER_DATABASE_URL")
    if database_url:
        write_page(database_url)
        return
    from broker import migrate
    from broker.cli.embedded import EmbeddedPostgres

    with tempfile.TemporaryDirectory(prefix="sql-reference-") as folder:
        server = EmbeddedPostgres(Path(folder)).start()
        try:
            database_url = server.url()
            migrate.upgrade(database_url)
            write_page(database_url)
        finally:
            server.stop()


if __name__ == "__main__":
    main()
