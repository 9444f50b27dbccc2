"""The README as a newcomer runs it: its example between two databases, as written, and its test command, which
is the one CI runs."""
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from broker.cli.processes import free_port

README = (Path(__file__).parents[2] / "README.md").read_text()


def _blocks_after(heading: str) -> list[tuple[str, str]]:
    """The (language, text) of each code block in the section that the heading opens."""
    section = README.split(f"\n{heading}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```(\w+)\n(.*?)```", section, re.DOTALL)


def test_ci_runs_the_readmes_test_command():
    command = README.split("# Install and run the tests\n", 1)[1].splitlines()[0]
    ci = (Path(__file__).parents[2] / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci == command


@pytest.mark.slow
def test_the_example_between_two_databases_prints_what_the_readme_shows(tmp_path):
    (_, script), (_, shown) = _blocks_after("## Between two databases")
    for written in ("8081", "8082"):  # ports free on this machine, for the ones the README names
        script = script.replace(written, str(free_port()))
    environment = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    environment.pop("BROKER_DATABASE_URL", None)
    shell = subprocess.Popen(["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path, env=environment,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        printed, errors = shell.communicate(timeout=180)
    finally:  # the nodes it started, were it to stop before it stops them (they stop their PostgreSQL)
        try:
            os.killpg(shell.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        shell.wait(30)
    assert shell.returncode == 0, errors[-3000:]
    assert printed == shown
