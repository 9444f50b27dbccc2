"""Applying the Alembic migrations from Python (the CLI and the tests use this).

Alembic is imported where it is used: every `broker` command imports this module, and most never migrate."""
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import create_engine

from broker import queries, schema

if TYPE_CHECKING:
    from alembic.config import Config

# Our own version table, so that an application's Alembic history in the same
# database stays its own.
VERSION_TABLE = "broker_alembic_version"
# The revisions up to the baseline were squashed into it; the last release that holds them all upgrades a database
# from any of them to the baseline.  It came before release numbers: CHANGELOG.md names it by its commit.
BASELINE = "0028"
LAST_RELEASE_BEFORE_BASELINE = "b38c60a"


class OlderThanBaseline(Exception):
    """The database is at a revision squashed into the baseline: an earlier release must upgrade it first."""


def run_sql_file(path: Path) -> None:
    """Runs a revision's frozen SQL inside the migration's transaction (see schema.execute_script)."""
    from alembic import op

    schema.execute_script(op.get_bind(), path.read_text())


def alter_while_serving(*statements: str, lock_timeout_ms: int = 1000, attempts: int = 120) -> None:
    """Runs each statement of a revision that locks a table the node uses all the time (ALTER TABLE takes its ACCESS
    EXCLUSIVE lock) in a transaction of its own, waiting at most lock_timeout_ms for the lock and trying again when
    it did not get it.  So the revision never holds one such table while it waits for another, which a node's
    transaction may hold while it waits for the first (a deadlock that fails the node's work), and holds the node's
    work up for at most lock_timeout_ms at a time.  Each statement must do nothing when it has been done already
    (ADD COLUMN IF NOT EXISTS): a revision stopped between them is run again from its start."""
    from alembic import op
    from psycopg2.errors import LockNotAvailable
    from sqlalchemy.exc import OperationalError

    with op.get_context().autocommit_block():
        connection = op.get_bind()
        connection.exec_driver_sql(f"SET lock_timeout = {int(lock_timeout_ms)}")
        try:
            for statement in statements:
                for attempt in range(1, attempts + 1):
                    try:
                        connection.exec_driver_sql(statement)
                        break
                    except OperationalError as error:
                        if not isinstance(error.orig, LockNotAvailable) or attempt == attempts:
                            raise
        finally:
            connection.exec_driver_sql("RESET lock_timeout")


def alembic_config(database_url: str) -> "Config":
    """The configuration alembic.ini gives the `alembic` command in a checkout, built here so that an
    installed wheel, which has the migrations package but no alembic.ini, needs no file."""
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(resources.files("broker.migrations")))
    config.set_main_option("path_separator", "os")
    config.attributes["database_url"] = database_url
    return config


def is_later(revision: str | None, than: str) -> bool:
    """Whether a revision comes after another: revisions are numbered, each after the one it revises."""
    return revision is not None and revision.isdigit() and int(revision) > int(than)


def head_revision() -> str:
    """The revision this version of the broker needs: the highest number of a revision's file.  Read from the
    files' names rather than by Alembic, which a node would import for this alone (a sixth of its start's CPU)."""
    return max(entry.name[:4] for entry in resources.files("broker.migrations.versions").iterdir()
               if entry.name[:4].isdigit() and entry.name.endswith(".py"))


def upgrade(database_url: str, revision: str = "head") -> None:
    """To head: a database without the broker's schema is built from its definition (broker/sql/) and
    stamped, in one transaction; any other goes through the revisions, which change its tables, and then gets the
    function files that changed (migrations/env.py)."""
    from alembic import command

    if revision != "head" or not _build_if_empty(database_url):
        command.upgrade(alembic_config(database_url), revision)


def _build_if_empty(database_url: str) -> bool:
    """Builds the schema at head in a database that has none yet; False when it has one."""
    engine = create_engine(database_url)
    try:
        with engine.begin() as connection:
            # two processes starting on one new database build it once
            connection.execute(queries.QUERIES["lock_schema_changes"])
            if connection.execute(queries.QUERIES["schema_exists"]).scalar_one():
                return False
            schema.create(connection)
            connection.execute(queries.QUERIES["stamp"], {"revision": head_revision()})
        return True
    finally:
        engine.dispose()


def refuse_older_than_baseline(connection) -> None:
    """Raises OlderThanBaseline when the database holds a revision that this release no longer has."""
    from alembic.script import ScriptDirectory

    if not connection.execute(queries.QUERIES["version_table_exists"]).scalar_one():
        return
    known = {revision.revision for revision in ScriptDirectory.from_config(alembic_config("")).walk_revisions()}
    for held in connection.execute(queries.QUERIES["schema_revision"]).scalars():
        if held not in known:
            raise OlderThanBaseline(
                f"the database's broker schema is at revision {held}, older than this release's baseline "
                f"{BASELINE}: upgrade it first with the release of commit {LAST_RELEASE_BEFORE_BASELINE}, from before "
                f"release numbers (see \"Before 0.1.0\" in CHANGELOG.md; its `broker migrate` takes it to {BASELINE}), "
                "then run `broker migrate` again with this one")


def downgrade(database_url: str, revision: str = "base") -> None:
    from alembic import command

    command.downgrade(alembic_config(database_url), revision)


def current(database_url: str) -> None:
    from alembic import command

    command.current(alembic_config(database_url), verbose=True)
