"""The reference pages say what the code does: the CLI, configuration and REST pages are what docs/generate.py
writes from the code now, and the error codes' table holds every SQLSTATE the SQL raises, each with the exception
and the REST answer the code gives it."""
import importlib.util
import re
from pathlib import Path

from broker import errors
from broker.api.problems import BY_ERROR_CLASS

ROOT = Path(__file__).parents[2]


def _generator():
    spec = importlib.util.spec_from_file_location("generate", ROOT / "docs" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_generated_pages_are_what_the_code_says_now(shared_database_url):
    for page, text in _generator().pages(shared_database_url).items():
        assert page.read_text() == text, (f"{page.relative_to(ROOT)} is stale: run "
                                          "BROKER_DATABASE_URL=… python docs/generate.py")


def test_the_error_table_names_every_sqlstate_with_its_exception_and_answer():
    table = (ROOT / "docs" / "reference" / "errors.md").read_text()
    rows = {code: (exception, answer) for code, exception, answer in
            re.findall(r"^\| (BR\d{3}) \| `(\w+)`[^|]* \| ([^|]+?) \|", table, re.MULTILINE)}
    raised = {code for file in (ROOT / "broker" / "sql").rglob("*.sql")
              for code in re.findall(r"'(BR\d{3})'", file.read_text())}
    assert raised == set(errors.BY_SQLSTATE), raised ^ set(errors.BY_SQLSTATE)
    assert set(rows) == set(errors.BY_SQLSTATE)
    for code, cls in errors.BY_SQLSTATE.items():
        status, kind, _ = BY_ERROR_CLASS.get(cls, (None, None, None))
        answer = f"{status} `/problems/{kind}`" if status else "—"
        assert rows[code] == (cls.__name__, answer), code
