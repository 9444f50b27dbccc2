"""Temporary tables that a database session keeps for the batches it moves, made once per session."""
from sqlalchemy import Connection

from broker import queries


def with_temporary_table(connection: Connection, name: str, made_by: str) -> Connection:
    """The connection, with the temporary table `name` made in its session by the SQL function made_by (once, in a
    transaction of its own)."""
    session = connection.connection.info
    if not session.get(name):
        queries.call(connection, made_by)
        connection.commit()
        session[name] = True
    return connection
