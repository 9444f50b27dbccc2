"""docs/tutorial.md runs as written: its ```bash blocks, in order, as one bash script in an empty folder, with
the output of each compared with the ```text block that follows it on the page."""
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from broker.cli.processes import free_port

TUTORIAL = Path(__file__).parents[2] / "docs" / "tutorial.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.MULTILINE | re.DOTALL)
# Printed between blocks, so that the script's output can be cut into each block's.
MARKER = "@@tutorial block {}@@"
# The ports the tutorial names, and what the test gives them: ports nothing listens on.
PORTS = ("8081", "8082")
TIMEOUT_S = 240


def _blocks() -> list[tuple[str, str | None]]:
    """(bash block, the text block right after it or None), in the order of the page."""
    blocks: list[tuple[str, str | None]] = []
    previous = None
    for match in FENCE.finditer(TUTORIAL.read_text()):
        language, body = match.groups()
        if language == "bash":
            blocks.append((body, None))
        elif language == "text" and previous == "bash":
            blocks[-1] = (blocks[-1][0], body)
        previous = language
    return blocks


def _with_ports(text: str, ports: dict[str, str]) -> str:
    for shown, port in ports.items():
        text = text.replace(shown, port)
    return text


def _script(blocks: list[tuple[str, str | None]]) -> str:
    """The blocks as one script, each after a line that marks where its output starts."""
    lines = []
    for number, (block, _) in enumerate(blocks):
        lines.append(f"printf '\\n{MARKER.format(number)}\\n'")
        lines.append(block)
    return "\n".join(lines)


def _normalized(text: str) -> str:
    """Without trailing spaces (psql pads its table headers with them) or blank lines at either end."""
    return "\n".join(line.rstrip() for line in text.strip("\n").splitlines()).strip("\n")


def _matches(expected: str, actual: str) -> bool:
    """Whether the output is the expected text, where `…` stands for anything (several lines included)."""
    pattern = ".*?".join(re.escape(part) for part in _normalized(expected).split("…"))
    return re.fullmatch(pattern, _normalized(actual), re.DOTALL) is not None


def _outputs(stdout: str, count: int) -> list[str | None]:
    """Each block's output, None for a block the script did not reach."""
    outputs: list[str | None] = [None] * count
    parts = re.split(r"\n@@tutorial block (\d+)@@\n", stdout)
    for number, output in zip(parts[1::2], parts[2::2]):
        outputs[int(number)] = output
    return outputs


def _stop_everything(script: subprocess.Popen, folder: Path) -> None:
    """Stops what the script started, however it ended: its process group (the nodes, the relay, psql, Spark),
    gently first so that the nodes stop their databases, then the embedded servers left running (they
    detach from the group as they start)."""
    for signum, grace_s in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
        try:
            os.killpg(script.pid, signum)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and _group_alive(script.pid):
            time.sleep(0.2)
    script.wait()
    for pid_file in folder.glob("**/pgdata/postmaster.pid"):
        try:
            os.kill(int(pid_file.read_text().split()[0]), signal.SIGQUIT)  # an immediate shutdown
        except (ProcessLookupError, ValueError, IndexError):
            pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S + 60)
def test_the_tutorial_runs_as_written(tmp_path):
    ports = {shown: str(free_port()) for shown in PORTS}
    blocks = [(_with_ports(block, ports), expected and _with_ports(expected, ports)) for block, expected in _blocks()]
    assert len(blocks) >= 10 and sum(expected is not None for _, expected in blocks) >= 6
    script = _script(blocks)
    environment = {name: value for name, value in os.environ.items()
                   if name not in ("BROKER_DATABASE_URL", "BROKER_DATA_DIR")}
    environment.update(PATH=f"{Path(sys.executable).parent}{os.pathsep}{environment['PATH']}", PSQLRC="/dev/null")
    process = subprocess.Popen(["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path, env=environment,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        _stop_everything(process, tmp_path)
        stdout, stderr = process.communicate()
        pytest.fail(f"the tutorial did not finish in {TIMEOUT_S} s\n{stdout[-3000:]}\n{stderr[-3000:]}")
    finally:
        _stop_everything(process, tmp_path)

    outputs = _outputs(stdout, len(blocks))
    reached = max(number for number, output in enumerate(outputs) if output is not None)
    assert process.returncode == 0, (f"block {reached} failed (exit status {process.returncode}):\n"
                                     f"{blocks[reached][0]}\n--- its output:\n{outputs[reached]}\n"
                                     f"--- stderr:\n{stderr[-4000:]}")
    assert None not in outputs, stdout
    for number, ((block, expected), actual) in enumerate(zip(blocks, outputs)):
        if expected is not None:
            assert _matches(expected, actual), (f"block {number}:\n{block}\n--- expected:\n{expected}\n"
                                                f"--- actual:\n{actual}\n--- stderr:\n{stderr[-2000:]}")
    assert not (tmp_path / "broker-tutorial").exists(), "the tutorial's clean-up leaves its folder"
