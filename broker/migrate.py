"""Applying the Alembic migrations from Python (the CLI and the tests use this)."""
from importlib import resources
from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import create_engine, text

from broker import schema

# Our own version table, so that an application's Alembic history in the same
# database stays its own.
VERSION_TABLE = "broker_alembic_version"
LOCK_FIRST_BUILD = text("SELECT pg_advisory_xact_lock(hashtext('broker schema build'))")
SCHEMA_EXISTS = text(f"SELECT to_regnamespace('broker') IS NOT NULL"
                     f" OR to_regclass('public.{VERSION_TABLE}') IS NOT NULL")
# broker/sql/ creates the version table as Alembic does (it grants on it); the row is Alembic's stamp.
STAMP = text(f"INSERT INTO public.{VERSION_TABLE} (version_num) VALUES (:revision)")


def run_sql_file(path: Path) -> None:
    """Runs a revision's frozen SQL inside the migration's transaction (see schema.execute_script)."""
    from alembic import op

    schema.execute_script(op.get_bind(), path.read_text())


def alembic_config(database_url: str) -> Config:
    """The configuration alembic.ini gives the `alembic` command in a checkout, built here so that an
    installed wheel, which has the migrations package but no alembic.ini, needs no file."""
    config = Config()
    config.set_main_option("script_location", str(resources.files("migrations")))
    config.set_main_option("path_separator", "os")
    config.attributes["database_url"] = database_url
    return config


def head_revision() -> str:
    """The revision this version of the broker needs."""
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(alembic_config("")).get_current_head()


def upgrade(database_url: str, revision: str = "head") -> None:
    """To head: a database without the broker's schema is built from its definition (broker/sql/) and
    stamped, in one transaction; any other goes through the revisions, which hold the deltas."""
    if revision != "head" or not _build_if_empty(database_url):
        command.upgrade(alembic_config(database_url), revision)


def _build_if_empty(database_url: str) -> bool:
    """Builds the schema at head in a database that has none yet; False when it has one."""
    engine = create_engine(database_url)
    try:
        with engine.begin() as connection:
            connection.execute(LOCK_FIRST_BUILD)  # two processes starting on one new database build it once
            if connection.execute(SCHEMA_EXISTS).scalar_one():
                return False
            schema.create(connection)
            connection.execute(STAMP, {"revision": head_revision()})
        return True
    finally:
        engine.dispose()


def downgrade(database_url: str, revision: str = "base") -> None:
    command.downgrade(alembic_config(database_url), revision)


def current(database_url: str) -> None:
    command.current(alembic_config(database_url), verbose=True)
