"""The broker's SQL API from its one definition: broker/sql/*.sql, applied in file order.

A fresh database is built from these files; an existing one is upgraded through the Alembic
revisions, which hold only the deltas.  tests/migrations/test_schema_definition.py keeps both the same.
"""
from importlib import resources
from importlib.resources.abc import Traversable


def definition_files() -> list[Traversable]:
    """The definition files, in the order they are applied."""
    folder = resources.files("broker") / "sql"
    return sorted((file for file in folder.iterdir() if file.name.endswith(".sql")), key=lambda file: file.name)


def create(connection) -> None:
    """Creates schema broker, as of the head revision, in an empty database.

    `connection` is a SQLAlchemy Connection (Alembic's op.get_bind() is one); everything runs in
    its transaction.  Stamping the head revision is the caller's part.
    """
    for file in definition_files():
        execute_script(connection, file.read_text())


def execute_script(connection, script: str) -> None:
    """Runs SQL as written, in the connection's transaction: straight to the driver's cursor, with no
    parameters, as plpgsql holds ":" and "%" that SQLAlchemy and psycopg2 would take for placeholders."""
    with connection.connection.dbapi_connection.cursor() as cursor:
        cursor.execute(script)
