"""The statements the Python side runs: a call of the SQL API made from names that are checked, in the
function's own parameter names, traced in one place; and the named queries of broker/sql/queries.sql, each used
and each that is used there.  No other module makes a statement out of pieces."""
import ast
import re
from pathlib import Path

import pytest

from broker import queries
from tests.syntax import syntax_tree
from tests.unit.test_layers import MODULES

ROOT = Path(__file__).parents[2]
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


class Recorder:
    """An executor that keeps what it is asked to run."""

    def __init__(self):
        self.executed = []

    def execute(self, statement, parameters=None):
        self.executed.append((statement.text, parameters))


def test_a_call_names_each_argument_as_the_function_does():
    recorder = Recorder()
    queries.call(recorder, "send", conversation_handle="h", message_type="order.note", body=b"x")
    assert recorder.executed == [(
        "SELECT broker.send(conversation_handle => :conversation_handle, message_type => :message_type,"
        " body => :body)", {"conversation_handle": "h", "message_type": "order.note", "body": b"x"})]


def test_a_call_casts_the_arguments_named_in_casts():
    recorder = Recorder()
    queries.call(recorder, "send_batch", casts={"conversation_handles": "uuid[]", "bodies": "bytea[]"},
                 conversation_handles=["h"], message_type="order.note", bodies=[b"x"])
    [(statement, _)] = recorder.executed
    assert statement == ("SELECT broker.send_batch(conversation_handles => CAST(:conversation_handles AS uuid[]),"
                         " message_type => :message_type, bodies => CAST(:bodies AS bytea[]))")


def test_a_set_returning_function_is_selected_from():
    recorder = Recorder()
    queries.select_from(recorder, "receive", queue="warehouse", max_messages=10)
    assert recorder.executed == [("SELECT * FROM broker.receive(queue => :queue, max_messages => :max_messages)",
                                  {"queue": "warehouse", "max_messages": 10})]


def test_a_traced_call_sets_the_traceparent_for_its_statement_and_clears_it_after():
    recorder = Recorder()
    queries.call(recorder, "send", traceparent=TRACEPARENT, conversation_handle="h", message_type="order.note")
    assert recorder.executed == [
        ("WITH traced AS MATERIALIZED (SELECT set_config('broker.traceparent', :traceparent, true))"
         " SELECT broker.send(conversation_handle => :conversation_handle, message_type => :message_type)"
         " FROM traced", {"conversation_handle": "h", "message_type": "order.note", "traceparent": TRACEPARENT}),
        ("SELECT set_config('broker.traceparent', '', true);", None)]


@pytest.mark.parametrize("function, arguments, casts", [
    ("send(); DROP TABLE broker.node; --", {}, None),
    ("Send", {}, None),
    ("_raise", {}, None),
    ("send", {"conversation_handle)": "h"}, None),
    ("send", {"body": b"x"}, {"body": "bytea); DROP TABLE broker.node; --"}),
    ("send", {"body": b"x"}, {"bodies": "bytea[]"}),
])
def test_only_plain_names_and_types_reach_the_statement(function, arguments, casts):
    recorder = Recorder()
    with pytest.raises(ValueError):
        queries.call(recorder, function, casts=casts, **arguments)
    assert recorder.executed == []


def _source(folders=("broker", "api", "spark_ingest", "bench")) -> str:
    return "\n".join(path.read_text() for folder in folders for path in sorted((ROOT / folder).rglob("*.py")))


def test_each_named_query_is_used_and_each_used_is_named():
    used = set(re.findall(r'QUERIES\["([a-z0-9_]+)"\]', _source()))
    assert used == set(queries.QUERIES)
    assert set(re.findall(r'QUERIES\["([a-z0-9_]+)"\]', _source(("tests",)))) <= set(queries.QUERIES)


def test_each_block_has_a_name_of_its_own_and_says_what_it_is():
    sql = (ROOT / "broker" / "sql" / "queries.sql").read_text()
    names = queries.BLOCK_NAME.findall(sql)
    assert len(names) == len(set(names)) == len(queries.QUERIES)
    for name in names:
        assert re.search(rf"^-- {name} --\n-- \S", sql, re.MULTILINE), f"{name} has no comment"
        assert queries.QUERIES[name].text and not queries.QUERIES[name].text.startswith("--")


def _pieced(node: ast.AST) -> bool:
    """Whether an expression makes a string out of pieces: an f-string, + or %, or str.format."""
    return (isinstance(node, ast.JoinedStr) or isinstance(node, ast.BinOp)
            or isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "format")


@pytest.mark.parametrize("module, source", [(name, source) for name, source in MODULES if name != "broker.queries"],
                         ids=[name for name, _ in MODULES if name != "broker.queries"])
def test_no_other_module_pieces_a_statement_together(module, source):
    pieced = [node.lineno for node in ast.walk(syntax_tree(source))
              if isinstance(node, ast.Call) and node.args and _pieced(node.args[0])
              and (isinstance(node.func, ast.Name) and node.func.id == "text"
                   or isinstance(node.func, ast.Attribute) and node.func.attr in ("execute", "copy_expert", "mogrify"))]
    assert not pieced, f"{module} makes a statement out of pieces on lines {pieced}"
