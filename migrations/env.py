"""Alembic environment: the database URL comes from the broker's settings, never alembic.ini.

After the revisions, a database at the head gets the function files that changed (broker.schema.apply_functions),
and broker.function_release the release they are of: a release that changes only function files needs no revision
of its own."""
from alembic import context
from sqlalchemy import create_engine, pool

from broker import schema
from broker.migrate import VERSION_TABLE, refuse_older_than_baseline
from broker.settings import Settings

config = context.config


def run_migrations() -> None:
    url = config.attributes.get("database_url") or Settings().database_url
    if not url:
        raise SystemExit("alembic: set BROKER_DATABASE_URL to the database to migrate (`broker migrate` migrates the "
                         "embedded database when none is set)")
    engine = create_engine(url, poolclass=pool.NullPool)
    with engine.connect() as connection:
        with connection.begin():
            refuse_older_than_baseline(connection)
        context.configure(connection=connection, version_table=VERSION_TABLE, transaction_per_migration=True)
        with context.begin_transaction():
            context.run_migrations()
        at_head = set(context.get_context().get_current_heads()) == {context.script.get_current_head()}
        connection.commit()
        if at_head:
            with connection.begin():
                schema.apply_functions(connection)
    engine.dispose()


if context.is_offline_mode():
    raise SystemExit("offline (--sql) migrations are not supported: run them against a database")
run_migrations()
