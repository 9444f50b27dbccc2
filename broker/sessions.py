"""Temporary tables that a database session keeps for the batches it moves, made once per session."""
from sqlalchemy import Connection, TextClause


def with_temporary_table(connection: Connection, name: str, create: TextClause) -> Connection:
    """The connection, with the temporary table `name` made in its session (once, in a transaction of its own)."""
    session = connection.connection.info
    if not session.get(name):
        connection.execute(create)
        connection.commit()
        session[name] = True
    return connection
