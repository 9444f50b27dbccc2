"""Each call of the SQL API by name in the code (broker.queries.call and select_from, and broker.core's _call and
_send around them) names a function of the broker's schema and only parameters it has: a call in named notation
depends on the SQL function's own parameter names."""
import ast
import uuid
from pathlib import Path

from sqlalchemy import create_engine, text

from broker import queries
from tests.syntax import syntax_tree

ROOT = Path(__file__).parents[2]
# Each function's input parameters (modes i, b and v; none given: all are inputs).
PARAMETERS = text("""
    SELECT p.proname, array_agg(a.name) FILTER (WHERE a.mode IN ('i', 'b', 'v')) AS inputs
    FROM pg_proc p
    LEFT JOIN LATERAL unnest(p.proargnames, coalesce(p.proargmodes, array_fill('i'::"char", ARRAY[p.pronargs])))
                      AS a(name, mode) ON true
    WHERE p.pronamespace = 'broker'::regnamespace
    GROUP BY p.oid, p.proname
""")


def _calls_by_name(called: ast.expr, path: Path) -> bool:
    """Whether the callee is queries.call or queries.select_from, or in broker/core.py _call or _send."""
    if isinstance(called, ast.Attribute):
        return isinstance(called.value, ast.Name) and called.value.id == "queries" and called.attr in (
            "call", "select_from")
    return path == ROOT / "broker" / "core.py" and isinstance(called, ast.Name) and called.id in ("_call", "_send")


def _named_calls() -> list[tuple[str, str, set[str]]]:
    """(where, function, argument names) of each call by a literal name in the code and its tests."""
    calls = []
    for folder in ("broker", "api", "spark_ingest", "tests"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(syntax_tree(path.read_text())):
                if not isinstance(node, ast.Call) or len(node.args) < 2:
                    continue
                function = node.args[1]
                if _calls_by_name(node.func, path) and isinstance(function, ast.Constant):
                    arguments = {keyword.arg for keyword in node.keywords} - {None, "casts", "traceparent"}
                    calls.append((f"{path.relative_to(ROOT)}:{node.lineno}", function.value, arguments))
    return calls


def test_each_call_by_name_names_a_function_and_its_parameters(shared_database_url):
    engine = create_engine(shared_database_url)
    try:
        with engine.connect() as connection:
            functions = {}
            for name, inputs in connection.execute(PARAMETERS):
                functions.setdefault(name, []).append(set(inputs or ()))
    finally:
        engine.dispose()
    calls = _named_calls()
    assert len({function for _, function, _ in calls}) > 50
    for where, function, arguments in calls:
        assert function in functions, f"{where}: no function broker.{function}"
        assert any(arguments <= inputs for inputs in functions[function]), (
            f"{where}: broker.{function} has no parameters named {sorted(arguments)}")


def test_an_array_literal_reads_back_as_the_values_it_was_made_of(shared_database_url):
    """broker.queries.array_literal, cast as broker.relay passes the sides of a batch to
    broker.apply_transport_results: the same uuids, booleans and numbers, in order, as the lists themselves."""
    sides = {(uuid.uuid4().hex, is_initiator): number
             for number, is_initiator in zip((1, 7, 2**40), (True, False, True))}
    engine = create_engine(shared_database_url)
    try:
        with engine.connect() as connection:
            read_back = connection.execute(text(
                "SELECT CAST(:conversations AS uuid[]), CAST(:by_initiator AS boolean[]), CAST(:numbers AS bigint[])"
            ), {"conversations": queries.array_literal(conversation for conversation, _ in sides),
                "by_initiator": queries.array_literal(by_initiator for _, by_initiator in sides),
                "numbers": queries.array_literal(sides.values())}).one()
    finally:
        engine.dispose()
    assert read_back == ([uuid.UUID(conversation) for conversation, _ in sides],
                         [by_initiator for _, by_initiator in sides], list(sides.values()))
