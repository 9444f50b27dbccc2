"""The broker's SQL from its one definition, broker/sql/.

schema/*.sql holds the tables, types and views: a new database runs them once, and after that the revisions in
migrations/versions change them.  functions/*.sql holds every function: each file is applied again, as a whole,
whenever its text changes, as repeatable migrations are; broker.function_files keeps the SHA-256 of each file as
it was last applied, and broker.function_release the release they are of and the oldest release whose nodes they
still serve (SERVES_FROM): a release that changes only function files needs no revision.
tests/migrations/test_schema_definition.py checks that a database built from here equals one
built by the revisions.
"""
import hashlib
from importlib import resources
from importlib.resources.abc import Traversable

from broker import queries

FUNCTION_PRIVILEGES = "function_privileges.sql"
# The oldest release whose nodes this release's functions serve: raise it to this release when a function file
# changes in a way that an earlier release's code cannot use (a function it calls dropped or changed in meaning).
SERVES_FROM = "0.2.0"


def _sql_files(folder: str) -> list[Traversable]:
    """The .sql files of a folder of broker/sql/, in the order they are applied."""
    directory = resources.files("broker") / "sql" / folder
    return sorted((file for file in directory.iterdir() if file.name.endswith(".sql")), key=lambda file: file.name)


def schema_files() -> list[Traversable]:
    return _sql_files("schema")


def function_files() -> list[Traversable]:
    return _sql_files("functions")


def create(connection) -> None:
    """Creates schema broker, as of the head revision, in an empty database.

    `connection` is a SQLAlchemy Connection; everything runs in its transaction.  Stamping the head revision is
    the caller's part.
    """
    for file in schema_files():
        execute_script(connection, file.read_text())
    apply_functions(connection)


def function_checksums() -> dict[str, bytes]:
    """The SHA-256 of each function file of this release, by file name."""
    return {file.name: hashlib.sha256(file.read_bytes()).digest() for file in function_files()}


def applied_function_checksums(connection) -> dict[str, bytes]:
    """The SHA-256 of each function file as the database last applied it."""
    return {name: bytes(sha256) for name, sha256 in connection.execute(queries.QUERIES["function_files_applied"])}


def apply_functions(connection) -> list[str]:
    """Applies every function file whose text differs from what the database last applied, in the connection's
    transaction, and records this release as theirs; returns their names.  The functions are replaced in place
    (CREATE OR REPLACE), so sessions that call them go on while this runs.  A database that holds a later release's
    functions keeps them: this release's would take them back."""
    import broker

    connection.execute(queries.QUERIES["lock_schema_changes"])
    held = connection.execute(queries.QUERIES["function_release"]).one_or_none()
    if held and is_later_release(held.release, broker.__version__):
        return []
    applied = applied_function_checksums(connection)
    changed = []
    for file in function_files():
        script = file.read_text()
        sha256 = hashlib.sha256(script.encode()).digest()
        if applied.get(file.name) != sha256:
            execute_script(connection, script)
            connection.execute(queries.QUERIES["record_function_file"], {"file_name": file.name, "sha256": sha256})
            changed.append(file.name)
    if changed:
        execute_script(connection, (resources.files("broker") / "sql" / FUNCTION_PRIVILEGES).read_text())
    connection.execute(queries.QUERIES["record_function_release"],
                       {"release": broker.__version__, "serves_from": SERVES_FROM})
    return changed


def is_later_release(release: str, than: str) -> bool:
    """Whether a release's version (major.minor.patch) comes after another's."""
    return tuple(map(int, release.split("."))) > tuple(map(int, than.split(".")))


def execute_script(connection, script: str) -> None:
    """Runs SQL as written, in the connection's transaction: straight to the driver's cursor, with no
    parameters, as plpgsql holds ":" and "%" that SQLAlchemy and psycopg2 would take for placeholders."""
    with connection.connection.dbapi_connection.cursor() as cursor:
        cursor.execute(script)
