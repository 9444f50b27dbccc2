"""The `broker` command."""
import math
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING
from uuid import UUID

import psycopg2
import typer
from rich.console import Console
from rich.text import Text
from sqlalchemy import Engine, create_engine

from broker import migrate as migrations
from broker.masking import mask_passwords, visible
from broker.settings import Settings

if TYPE_CHECKING:  # the embedded server's package is imported only where no database is configured
    from broker.cli.embedded import EmbeddedPostgres

app = typer.Typer(help="Exactly-once-in-order messaging between PostgreSQL databases.", no_args_is_help=True,
                  add_completion=False, pretty_exceptions_enable=False)
# The width of a console that is not a terminal: wider than any line the commands print.
UNWRAPPED_WIDTH = 10_000


def _console(to_stderr: bool) -> Console:
    """Rich on a terminal; without one (a pipe, a log) plain and unwrapped: each line whole, a table at
    its natural width."""
    if (sys.stderr if to_stderr else sys.stdout).isatty():
        return Console(stderr=to_stderr)
    return Console(stderr=to_stderr, soft_wrap=True, width=UNWRAPPED_WIDTH, no_color=True)


console = _console(to_stderr=False)
stderr = _console(to_stderr=True)  # failures and notices: stdout keeps what a script reads

# glibc's mallopt parameter for the size from which a block is mapped on its own (malloc.h), and the size we hold it at.
M_MMAP_THRESHOLD = -3
LARGE_BLOCK_BYTES = 128 * 1024
# PostgreSQL's errors for a schema, table or function that is not there: the broker schema is missing or old.
SCHEMA_MISSING = {"3F000", "42P01", "42883"}


class MissingExtra(Exception):
    """A command whose optional dependencies are not installed: a node installs none of them."""


def require_extra(command: str, extra: str, *modules: str) -> None:
    """Stops a command before it starts anything when its extra (see pyproject.toml) is not installed."""
    import importlib.util

    if any(importlib.util.find_spec(module) is None for module in modules):
        raise MissingExtra(f"broker {command} needs the {extra} extra: pip install 'pg-broker[{extra}]'")


def _log_to_stderr() -> None:
    """For the long-running commands: warnings and errors with their time, level and origin, and the node's
    record of what API keys did to its queues and conversations (broker.api.audit, at INFO)."""
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("broker.api.audit").setLevel(logging.INFO)


def _map_large_blocks_apart() -> None:
    """For a node's processes: memory blocks of 128 KiB and more (a batch, a request's body) are mapped on their own
    and given back when freed.  glibc does so until the first is freed, then raises the size from which it maps to
    the largest freed, and serves such blocks from the threads' heaps, which batches of every size fragment: in a
    6-minute soak at 4,000 msgs/s the relay's resident memory grew 13% and the API's 5%, and with the size held 4%
    and 1%, both flat from the second minute on.  Nothing to do where the C library is not glibc."""
    import ctypes

    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return
    mallopt(M_MMAP_THRESHOLD, LARGE_BLOCK_BYTES)


def _print_version(shown: bool) -> None:
    if shown:
        from broker import __version__

        print(f"pg-broker {__version__}")
        raise typer.Exit()


@app.callback()
def _options(version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                          help="print this release's version and exit")) -> None:
    """Exactly-once-in-order messaging between PostgreSQL databases."""


def main() -> None:
    """The `broker` command: any failure is one line on stderr that says what to do, never a traceback."""
    try:
        app()
    except KeyboardInterrupt:
        raise SystemExit(130) from None
    except Exception as error:  # every failure, whatever raised it, is told the same way
        stderr.print(f"broker: {failure_line(error)}", markup=False, highlight=False, soft_wrap=True)
        raise SystemExit(1) from None


def finite(value: float | None) -> float | None:
    """An option's number, refused when it is not one (nan) or infinite: a range lets nan through."""
    if value is not None and not math.isfinite(value):
        raise typer.BadParameter(f"{value} is not a finite number of seconds")
    return value


def failure_line(error: Exception) -> str:
    """What failed and what to do, in one line, with any password masked."""
    if isinstance(error, (MissingExtra, migrations.OlderThanBaseline)):
        return str(error)
    cause = getattr(error, "orig", None) or error  # SQLAlchemy wraps the driver's error
    words = str(cause).strip()
    first = mask_passwords(visible(words.splitlines()[0] if words else type(cause).__name__))
    if isinstance(cause, psycopg2.OperationalError):
        return f"cannot use the database: {first} (check BROKER_DATABASE_URL, and that its server runs)"
    if isinstance(cause, psycopg2.Error) and cause.pgcode in SCHEMA_MISSING:
        return f"the database has no broker schema of this version ({first}): run `broker migrate`"
    return f"{type(cause).__name__}: {first}"


def cell(value: object) -> Text:
    """A table cell for text from data or from a peer: shown as it is, never read as markup."""
    return Text(visible(str(value)))


def add_cells(table, *values: object) -> None:
    table.add_row(*map(cell, values))


@contextmanager
def database(settings: Settings) -> Iterator[tuple[str, "EmbeddedPostgres | None"]]:
    """The configured database, or the embedded server in the data folder, stopped on exit."""
    if settings.database_url:
        yield settings.database_url, None
        return
    from broker.cli.embedded import EmbeddedPostgres

    with EmbeddedPostgres(settings.data_dir) as server:
        stderr.print(f"[dim]embedded PostgreSQL on 127.0.0.1:{server.port}, data in {server.pgdata}[/dim]")
        yield server.url(), server


@contextmanager
def database_engine() -> Iterator[Engine]:
    with database(Settings()) as (url, _):
        engine = create_engine(url)
        try:
            yield engine
        finally:
            engine.dispose()


class MigrateAction(str, Enum):
    upgrade = "upgrade"
    downgrade = "downgrade"
    current = "current"


@app.command()
def migrate(
    action: MigrateAction = typer.Argument(MigrateAction.upgrade, help="upgrade, downgrade or current"),
    revision: str = typer.Option(None, help="target revision (default: head for upgrade, base for downgrade)"),
) -> None:
    """Apply the broker's Alembic migrations to BROKER_DATABASE_URL (or the embedded database)."""
    with database(Settings()) as (url, _):
        if action is MigrateAction.upgrade:
            migrations.upgrade(url, revision or "head")
        elif action is MigrateAction.downgrade:
            migrations.downgrade(url, revision or "base")
        else:
            migrations.current(url)


@app.command()
def serve(
    host: str = typer.Option("127.0.0.1", help="address to listen on"),
    port: int = typer.Option(8080, min=1, max=65535, help="port to listen on"),
    relay: bool = typer.Option(True, help="run the relay in this process"),
    activation: bool = typer.Option(True, help="call the queues' activated procedures in this process "
                                               "(broker.set_queue_activation)"),
    migrate: bool = typer.Option(True, help="apply the migrations first"),
    tls_cert: Path = typer.Option(None, exists=True, dir_okay=False, help="serve HTTPS with this certificate (PEM)"),
    tls_key: Path = typer.Option(None, exists=True, dir_okay=False, help="the certificate's private key (PEM)"),
) -> None:
    """Run a node: the HTTP API and transport endpoint, the relay and the queues' activated procedures (embedded
    PostgreSQL unless configured)."""
    import threading

    import uvicorn

    from broker.api import connections
    from broker.api.main import create_app
    from broker.activator import Activator

    if (tls_cert is None) != (tls_key is None):
        raise typer.BadParameter("give --tls-cert and --tls-key together")
    _log_to_stderr()
    _map_large_blocks_apart()
    settings = Settings()
    _trace(settings, "serve", f"{host}:{port}")
    # SIGTERM unwinds like Ctrl-C (the server passes both on once it has shut down), so that the node stops
    # what it started: its relay and its embedded PostgreSQL.
    signal.signal(signal.SIGTERM, lambda signum, _: sys.exit(128 + signum))
    with database(settings) as (url, _):
        if migrate:
            migrations.upgrade(url)
        stop = threading.Event()
        relaying = threading.Thread(target=_relay(url, settings).run, args=(stop,), name="relay", daemon=True)
        activating = threading.Thread(target=Activator(url).run, args=(stop,), name="activation", daemon=True)
        if relay:
            relaying.start()
        if activation:
            activating.start()
        scheme = "https" if tls_cert else "http"
        console.print(f"node listening on {scheme}://{host}:{port}" + (" with its relay" if relay else ""))
        try:
            app = create_app(url, settings)
            # A stop waits at most a few seconds for requests in progress (a long poll may wait a minute).
            uvicorn.run(app, host=host, port=port, log_level="warning", http=connections.protocol(
                settings.request_head_timeout_s), limit_concurrency=settings.max_connections,
                timeout_graceful_shutdown=5, ssl_certfile=str(tls_cert) if tls_cert else None,
                ssl_keyfile=str(tls_key) if tls_key else None)
        finally:
            stop.set()
            if relay:
                relaying.join(timeout=10)
            if activation:
                activating.join(timeout=10)


def _trace(settings: Settings, command: str, node: str) -> None:
    """Exports this process's spans as BROKER_TRACING says (broker.tracing)."""
    from broker import tracing

    if settings.tracing != "off":
        require_extra(f"{command} with BROKER_TRACING={settings.tracing}", "tracing", "opentelemetry.sdk")
    tracing.configure(settings.tracing, node)


def _relay(url: str, settings: Settings):
    """A relay for the database, as the settings say."""
    from broker.relay import Relay

    return Relay(url, batch_messages=settings.relay_batch_messages, batch_bytes=settings.relay_batch_bytes,
                 tls_ca_file=settings.tls_ca(), probe_interval_s=settings.relay_probe_interval_s)


@app.command()
def relay() -> None:
    """Run only a relay for the database: several relays may run at once, one per destination at a time."""
    import threading

    _log_to_stderr()
    _map_large_blocks_apart()
    settings = Settings()
    _trace(settings, "relay", "relay")
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    with database(settings) as (url, _):
        console.print("relaying the transmission queue; Ctrl-C stops")
        _relay(url, settings).run(stop)


keys = typer.Typer(help="API keys for the REST API: each has scopes, and only its hash is stored.",
                   no_args_is_help=True)
app.add_typer(keys, name="keys")


@keys.command("create")
def create_key(
    name: str = typer.Option(..., help="who or what uses the key, e.g. billing-worker"),
    scope: list[str] = typer.Option(..., help="admin, send:<service> or receive:<queue>; repeat for several"),
) -> None:
    """Create an API key and print it: the only time it is shown."""
    from broker import api_keys

    with database_engine() as engine, engine.begin() as connection:
        try:
            key = api_keys.create(connection, name, scope)
        except ValueError as error:
            raise typer.BadParameter(str(error), param_hint="--scope") from error
    stderr.print(Text(f"created key for {visible(name)} with {visible(', '.join(scope))}; keep it now, it is not "
                      "stored:", style="dim"), highlight=False)
    print(key)


@keys.command("list")
def list_keys() -> None:
    """List API keys (never their secrets)."""
    from rich.table import Table

    from broker import queries

    with database_engine() as engine, engine.connect() as connection:
        rows = connection.execute(queries.QUERIES["api_keys"]).all()
    table = Table("key id", "name", "scopes", "created", "revoked")
    for row in rows:
        add_cells(table, row.key_id, row.name, " ".join(row.scopes), f"{row.created_at:%Y-%m-%d %H:%M}",
                         f"{row.revoked_at:%Y-%m-%d %H:%M}" if row.revoked_at else "")
    console.print(table)


@keys.command("revoke")
def revoke_key(key_id: str = typer.Argument(..., help="the key id that 'broker keys list' shows")) -> None:
    """Revoke an API key: requests with it get 401 from then on."""
    from broker import queries

    with database_engine() as engine, engine.begin() as connection:
        revoked = queries.revoke_api_key(connection, key_id)
    if not revoked:
        console.print(f"no live key {key_id}", style="red")
        raise typer.Exit(1)
    console.print(f"revoked {key_id}")


definitions = typer.Typer(help="The catalog as code: export a node's message types, contracts, queues, services, "
                                 "routes and broker priorities as one YAML file, keep it in git, apply it to a "
                                 "node.", no_args_is_help=True)
app.add_typer(definitions, name="definitions")


@definitions.command("export")
def export_definitions(output: Path = typer.Option(None, "--output", "-o", dir_okay=False, metavar="FILE",
                                                   help="write to FILE instead of standard output")) -> None:
    """Write the node's catalog as YAML, sorted by name, so that two exports differ only where the catalogs do.

    Route secrets are never written: each route names the environment variable that holds its secret
    (BROKER_SECRET_<SERVICE>), which `broker definitions apply` reads.
    """
    from broker import definitions as catalog_file

    with database_engine() as engine, engine.connect() as connection:
        text = catalog_file.export(connection)
    if output is None:
        print(text, end="")
        return
    output.write_text(text)
    stderr.print(f"wrote the catalog to {visible(str(output))}", markup=False, highlight=False)


def _text_of(file: Path) -> str:
    """A definitions file's text; DefinitionsError when it is not UTF-8."""
    from broker.definitions import DefinitionsError

    try:
        return file.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise DefinitionsError(f"{file}: not UTF-8 text (byte {error.start + 1} is not)") from None


@definitions.command("apply")
def apply_definitions(
    file: Path = typer.Argument(..., exists=True, dir_okay=False, help="a file `broker definitions export` wrote, "
                                                                       "or one written like it"),
    plan: bool = typer.Option(False, "--plan", help="print what would change, and change nothing"),
    prune: bool = typer.Option(False, "--prune", help="also drop what the file does not name (without it, such "
                                                      "objects are kept and listed)"),
) -> None:
    """Make the node's catalog match FILE, in one transaction: create what is new, alter or replace what
    differs, and (with --prune) drop what the file no longer names. Applying the same file again changes nothing.

    Route secrets are read from the environment variables the file names. A refusal names the line and column
    of the entry, and applies nothing.
    """
    from broker import definitions as catalog_file

    try:
        wanted = catalog_file.load(_text_of(file), str(file))
        with database_engine() as engine, engine.connect() as connection:
            with connection.begin() as transaction:
                if plan:
                    changes = catalog_file.plan(connection, wanted, prune)
                    transaction.rollback()
                else:
                    changes = catalog_file.make_match(connection, wanted, prune)
    except catalog_file.DefinitionsError as error:
        stderr.print(f"broker: {mask_passwords(visible(str(error)))}; nothing was applied", markup=False,
                     highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None
    for change in changes:
        console.print(mask_passwords(visible(change.describe())), markup=False, highlight=False)
    done = sum(change.action != "keep" for change in changes)
    if not done:
        console.print("nothing to change", highlight=False)
    elif plan:
        console.print(f"{done} {_changes(done)} planned; nothing was applied (--plan)", highlight=False)
    else:
        console.print(f"applied {done} {_changes(done)} in one transaction", highlight=False)


def _changes(count: int) -> str:
    return "change" if count == 1 else "changes"


@app.command()
def purge(queue: str = typer.Argument(..., help="the queue to empty"),
          yes: bool = typer.Option(False, "--yes", help="do not ask first")) -> None:
    """Delete every message waiting in a queue and end its locks; its conversations go on without them."""
    from broker.core import purge_queue

    if not yes:
        typer.confirm(f"Delete every message waiting in queue {visible(queue)!r}?", abort=True)
    with database_engine() as engine, engine.begin() as connection:
        purged = purge_queue(connection, queue)
    console.print(f"purged {purged} messages from {visible(queue)!r}", markup=False, highlight=False)


# What `broker dead-letters` reads of their bodies at most: it shows none of them, and shows fewer letters than
# --limit only when the bodies of that many come to more.
DEAD_LETTER_BYTES_READ = 64 * 2**20


@app.command("dead-letters")
def dead_letters(queue: str = typer.Argument(..., help="the queue whose dead letters to show"),
                 limit: int = typer.Option(50, min=1, max=1000, help="show at most this many, oldest first"),
                 purge: bool = typer.Option(False, "--purge", help="delete them instead, after asking"),
                 yes: bool = typer.Option(False, "--yes", help="with --purge: do not ask first")) -> None:
    """Show a queue's dead letters with why each was dead-lettered, or delete them (--purge)."""
    from rich.table import Table

    from broker import queries
    from broker.core import purge_dead_letters

    if purge:
        if not yes:
            typer.confirm(f"Delete every dead letter of queue {visible(queue)!r}?", abort=True)
        with database_engine() as engine, engine.begin() as connection:
            purged = purge_dead_letters(connection, queue)
        console.print(f"purged {purged} dead letters of {visible(queue)!r}", markup=False, highlight=False)
        return
    with database_engine() as engine, engine.connect() as connection:
        if connection.execute(queries.QUERIES["queue_id"], {"queue": queue}).scalar() is None:
            raise typer.BadParameter(f"unknown queue {visible(queue)!r}", param_hint="QUEUE")
        letters = connection.execute(queries.QUERIES["dead_letters"], {
            "queue": queue, "limit": limit, "offset": 0, "max_bytes": DEAD_LETTER_BYTES_READ}).all()
    table = Table("conversation", "number", "message type", "attempts", "dead-lettered at", "reason")
    for letter in letters:
        add_cells(table, letter.conversation_handle, letter.message_sequence_number, letter.message_type,
                  letter.failed_attempts, letter.dead_lettered_at.isoformat(timespec="seconds"), letter.reason)
    console.print(table if letters else f"no dead letters in {visible(queue)!r}")


@app.command()
def status(as_json: bool = typer.Option(False, "--json", help="print JSON instead of tables"),
           conversation: UUID = typer.Option(None, metavar="HANDLE",
                                             help="show one conversation side's messages on this node instead")
           ) -> None:
    """Show queues, their activation, conversations by state, the transmission queue by destination, ingests and
    dead letters; or, with --conversation, one conversation side: what it sent and received, and why each message
    here waits."""
    import json

    from rich.table import Table

    from broker.status import age, conversation_life, json_default, node_status

    with database_engine() as engine, engine.connect() as connection:
        report = node_status(connection) if conversation is None else conversation_life(connection, conversation)
    if report is None:
        raise typer.BadParameter(f"no conversation {conversation} on this node (a closed one is forgotten after "
                                 "its retention)", param_hint="--conversation")
    if as_json:
        print(json.dumps(report, default=json_default, indent=2))
        return
    if conversation is not None:
        _print_conversation(report)
        return
    console.print(f"pg-broker {report['version']}, schema revision {report['schema_revision']}", highlight=False)
    queues = Table("queue", "status", "depth", "oldest", "readers", "dead letters", title="Queues",
                   title_justify="left")
    for q in report["queues"]:
        add_cells(queues, q["queue_name"], q["status"], f"{q['depth']:,}", age(q["oldest_message_age_s"]),
                          str(q["readers"]), str(q["dead_letters"]))
    activation = Table("queue", "procedure", "status", "readers", "execute as", "activations", "failures",
                       "last failure", title="Activation", title_justify="left")
    for a in report["activation"]:
        last_failure = (f"{a['last_failure_at']:%Y-%m-%d %H:%M:%S} {a['last_failure']}" if a["last_failure"]
                        else "")
        add_cells(activation, a["queue_name"], a["procedure_name"], a["status"],
                  f"{a['readers']} of {a['max_queue_readers']}", a["execute_as"], f"{a['activations']:,}",
                  f"{a['failures']:,}", last_failure)
    conversations = Table("service", "state", "endpoints", "without lifetime", "oldest",
                          title="Conversation endpoints", title_justify="left")
    for c in report["conversations"]:
        add_cells(conversations, c["service_name"], c["state"].replace("_", " "), f"{c['endpoints']:,}",
                                 f"{c['without_lifetime']:,}", f"{c['oldest_created_at']:%Y-%m-%d %H:%M:%S}")
    transmission = Table("destination", "messages", "conversations", "oldest", "attempts", "status",
                         title="Transmission queue", title_justify="left")
    for t in report["transmission_queue"]:
        add_cells(transmission, t["destination"], f"{t['messages']:,}", f"{t['conversations']:,}",
                                age(t["oldest_message_age_s"]), str(t["attempts"]), t["status"])
    ingests = Table("queue", "output", "position", "rows", "runs", "last run at", "lag", "oldest waiting",
                    title="Spark ingests", title_justify="left")
    for i in report["ingests"]:
        add_cells(ingests, i["queue_name"], i["output"], str(i["queue_position"]), f"{i['rows_ingested']:,}",
                           str(i["runs"]), f"{i['updated_at']:%Y-%m-%d %H:%M:%S}", f"{i['lag_messages']:,}",
                           age(i["lag_s"]) if i["lag_messages"] else "")
    dead = Table("queue", "conversation", "#", "message type", "reason", "at", title="Latest dead letters",
                 title_justify="left")
    for d in report["dead_letters"]:
        add_cells(dead, d["queue_name"], str(d["conversation_id"]), str(d["message_sequence_number"]),
                        d["message_type"], d["reason"], f"{d['dead_lettered_at']:%Y-%m-%d %H:%M:%S}")
    lost = Table("conversation", "far service", "found at", "what happened",
                 title="Messages lost when a database went back to an earlier point", title_justify="left")
    for m in report["lost_messages"]:
        add_cells(lost, str(m["conversation_handle"] or m["conversation_id"]), m["far_service"],
                        f"{m['found_at']:%Y-%m-%d %H:%M:%S}", m["explanation"])
    for table in (queues, activation, conversations, transmission, ingests, dead, lost):
        if table.row_count:
            console.print(table)
        else:
            console.print(f"{table.title}: none", style="dim")


def _print_conversation(life: dict) -> None:
    from rich.table import Table

    side = life["conversation"]
    far = "on this node" if side["far_is_local"] else f"at broker instance {side['far_broker_instance']}"
    console.print(Text.assemble(
        f"Conversation {side['conversation_handle']} ({'initiator' if side['is_initiator'] else 'target'}): ",
        visible(side["service_name"]), " to ", visible(side["far_service"]), f" {far}, contract ",
        visible(side["contract_name"]), f", {side['state'].replace('_', ' ')}, priority {side['priority']}, "
        f"created {side['created_at']:%Y-%m-%d %H:%M:%S}"
        + (f", lifetime until {side['expires_at']:%Y-%m-%d %H:%M:%S}" if side["expires_at"] else "")))
    gone = "acknowledged by the far node" if not side["far_is_local"] else "delivered"
    console.print(f"Sent {life['sent']:,}: {life['sent_and_gone']:,} {gone}, "
                  f"{life['sent'] - life['sent_and_gone']:,} waiting here. Arrived {life['arrived']:,}: "
                  f"{life['arrived_and_received']:,} received.")
    messages = Table("", "#", "message type", "bytes", "since", "attempts", "why it is here",
                     title="Messages on this node", title_justify="left")
    for m in life["messages"]:
        add_cells(messages, m["direction"], str(m["sequence_number"]), m["message_type"],
                  "" if m["body_bytes"] is None else f"{m['body_bytes']:,}", f"{m['since']:%Y-%m-%d %H:%M:%S}",
                  str(m["attempts"]), m["status"])
    console.print(messages if messages.row_count else Text("Messages on this node: none", style="dim"))
    if life["messages_not_listed"]:
        console.print(f"… and {life['messages_not_listed']:,} more on this node, not listed.")


@app.command()
def diagnose(as_json: bool = typer.Option(False, "--json", help="print JSON instead of a table"),
             max_wait: float = typer.Option(300.0, "--max-wait", min=0, max=10**9, callback=finite,
                                            metavar="SECONDS", help="a message waiting longer than this for its "
                                                                    "destination node is a problem")) -> None:
    """Check the configuration end to end: schema, queues, routes, a relay for every destination, and every peer
    (answers, is the instance its route names, accepts our signature, clock, services, queues, contracts, a route
    back).

    Exits 1 when something is wrong, a message waiting longer than --max-wait included; each finding says what
    to do.
    """
    import dataclasses
    import json

    from rich.table import Table

    from broker.diagnose import counted, diagnose as run_checks
    from broker.transport.addresses import client_for_peers

    settings = Settings()
    with database_engine() as engine, engine.connect() as connection, \
            client_for_peers(connection, 10, settings.tls_ca() or True) as client:
        findings = run_checks(connection, client, migrations.head_revision(), max_wait_s=max_wait,
                              max_clock_skew_s=settings.max_clock_skew_s)
    if as_json:
        print(json.dumps([dataclasses.asdict(finding) for finding in findings], indent=2))
    else:
        table = Table("", "check", "finding", "what to do")
        marks = {"ok": "[green]✓[/green]", "warning": "[yellow]![/yellow]", "error": "[red]✗[/red]"}
        for finding in findings:
            table.add_row(marks[finding.level], cell(finding.check), cell(finding.finding), cell(finding.advice))
        console.print(table)
    errors = sum(finding.level == "error" for finding in findings)
    if not as_json:
        console.print(f"{counted(errors, 'problem')} found" if errors else "no problems found",
                      style="red" if errors else "green")
    raise typer.Exit(1 if errors else 0)


@app.command()
def ingest(
    queue: str = typer.Option(..., help="the queue to ingest"),
    output: str = typer.Option(..., help="the Parquet dataset's location (a path or a Hadoop URI)"),
    consume: bool = typer.Option(False, help="delete the ingested rows from the queue when the checkpoint commits"),
    partitions: int = typer.Option(None, min=1,
                                   help="JDBC reads, each a range of equal row count (default: 4 per core)"),
    fetch_size: int = typer.Option(10_000, min=1, help="rows per JDBC fetch"),
    master: str = typer.Option(None, help="Spark master URL, e.g. spark://host:7077 (default: local[*])"),
    follow: bool = typer.Option(False, "--follow",
                                help="keep running: a run whenever messages commit to the queue, in one "
                                     "SparkSession, one log line each, until SIGTERM or Ctrl-C (which let the run "
                                     "in progress finish)"),
    interval: float = typer.Option(None, min=0.1, max=3600, callback=finite, metavar="SECONDS",
                                   help="with --follow: look at least this often, besides waking on each commit "
                                        "(default: 5)"),
) -> None:
    """Ingest a queue's committed messages into Parquet with Spark, exactly once across runs.

    Each run reads the positions above the last checkpoint up to a high-water mark fixed at its start,
    writes them as one directory of the dataset, then advances the checkpoint.
    """
    if interval is not None and not follow:
        raise typer.BadParameter("--interval goes with --follow", param_hint="--interval")
    require_extra("ingest", "spark", "pyspark")
    from broker.spark_ingest.jdbc import spark_session

    settings = Settings()
    if follow:
        import logging

        from broker.spark_ingest.follow import StopSignals, follow as follow_queue

        _log_to_stderr()
        logging.getLogger("broker.spark_ingest.follow").setLevel(logging.INFO)  # one line per run
        with database(settings) as (url, _), _ingest_failures():
            spark = spark_session(master, settings.jdbc_driver)
            with StopSignals() as stop:  # after Spark's start, which sets a SIGINT handler of its own
                follow_queue(spark, url, queue, output, stop, interval_s=interval or 5.0, partitions=partitions,
                             consume=consume, fetch_size=fetch_size)
        return

    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from broker.spark_ingest.job import ingest as ingest_queue

    with database(settings) as (url, _), Progress(
            TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[rows]}"), TimeElapsedColumn(),
            console=console, transient=True) as bar, _ingest_failures():
        task = bar.add_task(f"ingest {queue}", total=None, rows="starting Spark")

        def show(progress) -> None:
            bar.update(task, total=progress.rows, completed=progress.rows_done,
                       rows=f"~{progress.rows_done:,}/{progress.rows:,} rows, {progress.rows_per_second:,.0f} rows/s")

        spark = spark_session(master, settings.jdbc_driver)
        summary = ingest_queue(spark, url, queue, output, partitions=partitions, consume=consume,
                               fetch_size=fetch_size, on_progress=show)
    console.print(summary.describe(), highlight=False)


@contextmanager
def _ingest_failures() -> Iterator[None]:
    """A run that cannot start or commit: its reason in one line, and exit status 1."""
    from broker.errors import BrokerError
    from broker.spark_ingest.errors import IngestError

    try:
        yield
    except (BrokerError, IngestError) as error:
        stderr.print(Text(f"ingest failed: {mask_passwords(visible(str(error)))}", style="red"), highlight=False,
                     soft_wrap=True)
        raise typer.Exit(1) from error


def _find_the_benchmark() -> None:
    """The benchmark is the project's, not installed with it: it runs from the checkout this broker is installed
    from (pip install -e), whose bench/ lies beside broker/."""
    checkout = Path(__file__).resolve().parents[2]
    if not (checkout / "bench" / "__init__.py").is_file():
        raise MissingExtra("broker bench runs from a checkout of pg-broker: clone its repository, "
                           "pip install -e '.[bench]' there, and run broker bench")
    if str(checkout) not in sys.path:
        sys.path.insert(0, str(checkout))


@app.command()
def bench(
    output: Path = typer.Option(Path("bench-results"), help="folder for results.json, results.md and the charts"),
    quick: bool = typer.Option(False, help="a smoke run with less traffic (under two minutes)"),
    repetitions: int = typer.Option(3, min=1, max=50, help="measurements of each scenario and baseline"),
    soak: float = typer.Option(None, min=0.25, max=24 * 60, metavar="MINUTES",
                               help="instead: steady cross-node traffic for MINUTES with a long transaction held "
                                    "open through the middle third; throughput, dead tuples and memory over time"),
    soak_rate: int = typer.Option(1_000, min=1, max=1_000_000, metavar="MSGS_PER_S",
                                  help="with --soak: the messages a second offered"),
    soak_window: int = typer.Option(None, min=0, metavar="SECONDS",
                                    help="with --soak: the sending node's resend window (default: the node's, "
                                         "24 hours); the log it retains is sampled with the rest"),
    soak_hold: bool = typer.Option(True, help="with --soak: hold a transaction open through the middle third"),
    pgmq_sql: Path = typer.Option(None, "--pgmq-sql", envvar="BROKER_BENCH_PGMQ_SQL", exists=True, dir_okay=False,
                                  metavar="FILE",
                                  help="pgmq's extension script (pgmq.sql): measures pgmq beside the local send "
                                       "and receive; without it those comparisons are skipped, saying why"),
) -> None:
    """Measure each scenario next to its baseline in the same run (throwaway databases, durable settings):
    local send and receive, cross-node transfer and latency, REST, RabbitMQ when one answers on
    127.0.0.1:5672, Spark ingest, and throughput at scale.

    With BROKER_DATABASE_URL set, databases broker_bench_* are created on that server and dropped after;
    otherwise an embedded PostgreSQL is started in a temporary folder.
    """
    require_extra("bench", "bench", "pyspark", "psutil", "pika", "matplotlib")
    _find_the_benchmark()
    from bench.results import markdown_table
    from bench.runner import run_bench

    results = run_bench(output, quick=quick, repetitions=repetitions, soak_minutes=soak, soak_rate=soak_rate,
                        soak_window_s=soak_window, soak_hold=soak_hold,
                        server_url=Settings().database_url,
                        report=lambda line: console.print(line, style="dim", highlight=False), pgmq_sql=pgmq_sql)
    print(markdown_table(results))
    console.print(f"written to {output}/: results.json, results.md and PNG charts")


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def psql(context: typer.Context) -> None:
    """Open psql on the broker's database (the embedded one unless BROKER_DATABASE_URL is set).  Arguments after
    the command go to psql: broker psql -q -c 'SELECT 1'."""
    import os

    from sqlalchemy.engine import make_url

    with database(Settings()) as (url, server):
        client = str(server.bin_dir / "psql") if server else "psql"
        # The password goes to psql in its environment, not on a command line that any process can read.
        given = make_url(url)
        environment = {**os.environ, **({"PGPASSWORD": given.password} if given.password else {})}
        raise typer.Exit(subprocess.call([client, *context.args,
                                          given.set(password=None).render_as_string(hide_password=False)],
                                         env=environment))


@app.command()
def demo(
    conversations: int = typer.Option(300, min=2, max=100_000, help="conversations, alternating A→B and B→A"),
    messages: int = typer.Option(5, min=1, max=1000, help="order lines per conversation"),
) -> None:
    """Two nodes on throwaway embedded databases converse across the HTTP relay (whose relay is killed and
    restarted midway), Spark ingests what arrived, the warehouses consume it in order; the summary shows
    that every message arrived once, in order, and was ingested once. Leaves nothing running."""
    require_extra("demo", "spark", "pyspark")
    from broker.cli.demo import run_demo

    with tempfile.TemporaryDirectory(prefix="broker-demo-") as folder:
        ok = run_demo(Path(folder), console, conversations=conversations, messages=messages)
    raise typer.Exit(0 if ok else 1)

