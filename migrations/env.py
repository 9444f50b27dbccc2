"""Alembic environment: the database URL comes from the broker's settings, never alembic.ini."""
from alembic import context
from sqlalchemy import create_engine, pool

from broker.migrate import VERSION_TABLE
from broker.settings import database_url_for_migrations

config = context.config


def run_migrations() -> None:
    url = config.attributes.get("database_url") or database_url_for_migrations()
    engine = create_engine(url, poolclass=pool.NullPool)
    with engine.connect() as connection:
        context.configure(connection=connection, version_table=VERSION_TABLE, transaction_per_migration=True)
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


if context.is_offline_mode():
    raise SystemExit("offline (--sql) migrations are not supported: run them against a database")
run_migrations()
