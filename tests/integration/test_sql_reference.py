"""docs/reference/sql.md is made from the functions' own COMMENTs (docs/sql_reference.py): every public function
has one, and the committed page is what they say now."""
import importlib.util
from pathlib import Path

import psycopg2
import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"

UNCOMMENTED = """
    SELECT p.oid::regprocedure::text
    FROM pg_proc p
    WHERE p.pronamespace = 'broker'::regnamespace
      AND left(p.proname, 1) <> '_'
      AND coalesce(trim(obj_description(p.oid, 'pg_proc')), '') = ''
    ORDER BY 1
"""


def _load_sql_reference():
    """docs/sql_reference.py, by its path: docs/ is not a package."""
    spec = importlib.util.spec_from_file_location("sql_reference", DOCS / "sql_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def connection(database_url):
    connection = psycopg2.connect(database_url)
    yield connection
    connection.close()


def test_every_public_function_has_a_comment(connection):
    with connection.cursor() as cursor:
        cursor.execute(UNCOMMENTED)
        uncommented = [signature for (signature,) in cursor.fetchall()]
    assert not uncommented, (
        "these functions have no COMMENT ON FUNCTION (put one after the definition, in broker/sql/functions/): "
        + ", ".join(uncommented))


def test_the_committed_page_is_what_the_comments_say(connection):
    rendered = _load_sql_reference().sql_reference(connection)
    committed = (DOCS / "reference" / "sql.md").read_text()
    assert committed == rendered, (
        "docs/reference/sql.md differs from the functions' comments: run `python docs/sql_reference.py` "
        "and commit the page")
