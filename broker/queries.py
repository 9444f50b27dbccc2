"""Every statement the Python side runs on the broker's database, in one of two ways:

- a function of the SQL API, called by its name with its own parameter names (call, select_from);
- any other statement (a lookup on the broker's tables and views, the relay's and the transport's COPY, a lock,
  the schema's own records): a named block of broker/sql/queries.sql, in QUERIES by its name.

Where a lookup needs Python around its statement, it is a function here too.
"""
from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping
from importlib import resources
from typing import TYPE_CHECKING, Any, TypeAlias
from uuid import UUID

from sqlalchemy import Connection, Result, Row, TextClause, text
from sqlalchemy.dialects.postgresql.psycopg2 import PGDialect_psycopg2

from broker import errors

if TYPE_CHECKING:  # the ORM is the application's to import: a node and the CLI use Connections alone
    from sqlalchemy.orm import Session

# What the broker's statements run on: the caller's Connection or Session, in the caller's transaction.
Executor: TypeAlias = "Connection | Session"

BLOCK_NAME = re.compile(r"^-- ([a-z][a-z0-9_]*) --$", re.MULTILINE)


def _named_blocks(sql: str) -> dict[str, TextClause]:
    """Each block of the file, after its line `-- name --`, by name.  Lines that begin with -- are for the reader
    and are not sent: a word after a colon in them would be taken for a parameter."""
    _, *names_and_blocks = BLOCK_NAME.split(sql)
    return {name: text("\n".join(line for line in block.splitlines() if not line.startswith("--")).strip())
            for name, block in zip(names_and_blocks[::2], names_and_blocks[1::2])}


QUERIES = _named_blocks((resources.files("broker") / "sql" / "queries.sql").read_text())

# --- The SQL API, by name -------------------------------------------------------------------------

# A function's or an argument's name, and a type an argument is cast to.  No leading underscore: the internal
# functions (broker._…) are not called by name.
NAME = re.compile(r"[a-z][a-z0-9_]*")
SQL_TYPE = re.compile(r"[a-z][a-z0-9_]*(\[\])?")


def _checked(pattern: re.Pattern, word: str, what: str) -> str:
    if not pattern.fullmatch(word):
        raise ValueError(f"{what} {word!r} does not match {pattern.pattern}")
    return word


def _called(function: str, arguments: Iterable[str], casts: Mapping[str, str] | None) -> str:
    """broker.function(name => :name, …), each argument cast to its type in casts, where it has one there."""
    casts = casts or {}
    unknown = set(casts) - set(arguments)
    if unknown:
        raise ValueError(f"casts name arguments not given: {sorted(unknown)}")
    named = []
    for name in arguments:
        value = f":{_checked(NAME, name, 'argument')}"
        if name in casts:
            value = f"CAST({value} AS {_checked(SQL_TYPE, casts[name], 'type')})"
        named.append(f"{name} => {value}")
    return f"broker.{_checked(NAME, function, 'function')}({', '.join(named)})"


# The statements of each form, by what they are made from.
CALL = "SELECT {}"
TRACED_CALL = ("WITH traced AS MATERIALIZED (SELECT set_config('broker.traceparent', :traceparent, true))"
               " SELECT {} FROM traced")
SELECT_FROM = "SELECT * FROM {}"


@functools.lru_cache(maxsize=512)
def _statement(form: str, function: str, arguments: tuple[str, ...], casts: tuple[tuple[str, str], ...]) -> TextClause:
    """The statement of a call, made once for each function, set of arguments and form: calls are on the hot path
    (every send and receive), and one TextClause object per statement lets SQLAlchemy reuse its compilation."""
    return text(form.format(_called(function, arguments, dict(casts))))


def call(executor: Executor, function: str, /, *, casts: Mapping[str, str] | None = None,
         traceparent: str | None = None, **arguments: Any) -> Result:
    """SELECT broker.function(name => :name, …): a function of the SQL API with the arguments given, named by the
    SQL function's own parameter names (PostgreSQL's named notation); those not given take their defaults.  The
    caller reads the Result (scalar_one(), …); errors are SQLAlchemy's (broker.core translates them).

    This is the one place a statement is made from names rather than written out: the function's name and each
    argument's must match NAME, and each type SQL_TYPE, so that nothing but such a word reaches the SQL; the
    values travel as parameters.  casts: the SQL type an argument is cast to, where psycopg2's own type for its
    value is not the function's (a list of UUID strings for uuid[], a JSON text for jsonb).  traceparent: the
    messages the call sends carry it (broker.tracing); it is set for the call's statement and cleared after it.
    No function of the SQL API has a parameter named casts or traceparent.
    """
    casts_given = tuple(sorted((casts or {}).items()))
    if traceparent is None:
        return executor.execute(_statement(CALL, function, tuple(arguments), casts_given), arguments)
    result = executor.execute(_statement(TRACED_CALL, function, tuple(arguments), casts_given),
                              {**arguments, "traceparent": traceparent})
    executor.execute(QUERIES["end_the_trace"])
    return result


def select_from(executor: Executor, function: str, /, **arguments: Any) -> Result:
    """SELECT * FROM broker.function(name => :name, …): the rows of a set-returning function of the SQL API (or
    the OUT parameters of one as columns), with the arguments given as call gives them."""
    return executor.execute(_statement(SELECT_FROM, function, tuple(arguments), ()), arguments)


def array_literal(values: Iterable[str | int | bool]) -> str:
    """The values as one PostgreSQL array literal ('{a,b,c}'), for an argument cast to their array type: values
    that need no quoting (uuids, numbers, booleans).  PostgreSQL reads it as one constant, where a list that
    psycopg2 writes out as ARRAY[...] is parsed element by element (three arrays of 400: 1.3 ms a call, against
    0.3) and makes a statement of its own for each length (pg_stat_statements keeps an entry for each)."""
    return "{" + ",".join(("t" if value else "f") if isinstance(value, bool) else str(value) for value in values) + "}"


def with_values(cursor, query: TextClause, values: Mapping[str, Any]) -> str:
    """The query with the values written in by psycopg2's cursor: for a COPY, which takes no parameters."""
    return cursor.mogrify(_in_psycopg2_style(query), values).decode()


@functools.cache
def _in_psycopg2_style(query: TextClause) -> str:
    """The query with its :names as psycopg2 takes them: compiled once, not for each batch a relay lane reads
    (0.13 ms each)."""
    return str(query.compile(dialect=PGDialect_psycopg2()))


# --- Lookups that need more than their statement --------------------------------------------------

def broker_instance(connection: Connection) -> str:
    """This node's broker_instance: what a peer's routes to it name."""
    return str(connection.execute(QUERIES["broker_instance"]).scalar_one())


def contracts(connection: Connection, names: list[str] | None = None) -> dict[str, dict[str, dict]]:
    """Contracts (all, or those named) by name: message type -> {"sent_by": …, "validation": …}."""
    return dict(connection.execute(QUERIES["contracts"], {"names": names}).all())


def services(connection: Connection, names: list[str] | None = None) -> list[Row]:
    """Services (all, or those named): name, queue, queue_enabled and the contracts each accepts."""
    return connection.execute(QUERIES["services"], {"names": names}).all()


def contracts_in_use_by_remote_service(connection: Connection) -> dict[str, set[str]]:
    """For each remote service with open conversations begun here: the contracts they use."""
    in_use: dict[str, set[str]] = {}
    for row in connection.execute(QUERIES["contracts_in_use"]):
        in_use.setdefault(row.far_service, set()).add(row.contract_name)
    return in_use


def queue_statuses(connection: Connection, queue: str | None = None) -> list[Row]:
    """broker.queue_status of every queue (or the one named), with the oldest message's age in seconds."""
    return connection.execute(QUERIES["queue_status"], {"queue": queue}).all()


def refuse_lock_as_unknown(connection: Connection, lock_token: UUID) -> None:
    """Raises LockLost (reason unknown), word for word what the broker raises for a lock never made."""
    with errors.translated_errors():
        connection.execute(QUERIES["refuse_lock_as_unknown"], {"token": lock_token})


def endpoints_named(connection: Connection, handles: list[UUID]) -> dict[UUID, Row]:
    """Each conversation side named, by its handle, from broker.conversation_endpoints (unknown handles are left
    out)."""
    rows = connection.execute(QUERIES["endpoints_named"], {"handles": [str(handle) for handle in handles]}).all()
    return {row.conversation_handle: row for row in rows}


def revoke_api_key(connection: Connection, key_id: str) -> bool:
    """Whether a live key was revoked."""
    return connection.execute(QUERIES["revoke_api_key"], {"key_id": key_id}).rowcount == 1


def as_dicts(rows: Iterable[Row]) -> list[dict[str, Any]]:
    return [row._asdict() for row in rows]
