"""Applying the Alembic migrations from Python (the CLI and the tests use this)."""
from pathlib import Path

from alembic import command
from alembic.config import Config

# Our own version table, so that an application's Alembic history in the same
# database stays its own.
VERSION_TABLE = "broker_alembic_version"

_PROJECT_ROOT = Path(__file__).resolve().parent.parent


def run_sql_file(path: Path) -> None:
    """Runs a revision's frozen SQL inside the migration's transaction.

    Straight to the driver's cursor, with no parameters: the plpgsql holds ":"
    and "%" that SQLAlchemy and psycopg2 would take for placeholders.
    """
    from alembic import op

    with op.get_bind().connection.dbapi_connection.cursor() as cursor:
        cursor.execute(path.read_text())


def alembic_config(database_url: str) -> Config:
    config = Config(str(_PROJECT_ROOT / "alembic.ini"))
    config.set_main_option("script_location", str(_PROJECT_ROOT / "migrations"))
    config.attributes["database_url"] = database_url
    return config


def head_revision() -> str:
    """The revision this version of the broker needs."""
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(alembic_config("")).get_current_head()


def upgrade(database_url: str, revision: str = "head") -> None:
    command.upgrade(alembic_config(database_url), revision)


def downgrade(database_url: str, revision: str = "base") -> None:
    command.downgrade(alembic_config(database_url), revision)


def current(database_url: str) -> None:
    command.current(alembic_config(database_url), verbose=True)
