"""Applying the Alembic migrations from Python (the CLI and the tests use this)."""
from pathlib import Path

from alembic import command
from alembic.config import Config

# Our own version table, so that an application's Alembic history in the same
# database stays its own.
VERSION_TABLE = "broker_alembic_version"

_PROJECT_ROOT = Path(__file__).resolve().parent.parent


def alembic_config(database_url: str) -> Config:
    config = Config(str(_PROJECT_ROOT / "alembic.ini"))
    config.set_main_option("script_location", str(_PROJECT_ROOT / "migrations"))
    config.attributes["database_url"] = database_url
    return config


def upgrade(database_url: str, revision: str = "head") -> None:
    command.upgrade(alembic_config(database_url), revision)


def downgrade(database_url: str, revision: str = "base") -> None:
    command.downgrade(alembic_config(database_url), revision)


def current(database_url: str) -> None:
    command.current(alembic_config(database_url), verbose=True)
