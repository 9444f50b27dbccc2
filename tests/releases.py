"""Earlier releases from the git history, to run beside this one: every release talks to the previous release in
both directions."""
import io
import os
import subprocess
import sys
import tarfile
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parent.parent
# The last release before this one (revision 0028, before the baseline): the release this one must talk to.
PREVIOUS_RELEASE = "b38c60a"


def checkout(commit: str, directory: Path) -> Path:
    """The project's files as of commit, in directory (from git archive: no work tree is touched)."""
    directory.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(REPOSITORY), "archive", "--format=tar", commit],
                             capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(directory, filter="data")
    return directory


def migrate(release: Path, database_url: str) -> None:
    """The release's own `broker migrate` on an empty database: its schema, at its head revision."""
    subprocess.run([sys.executable, "-m", "broker.cli", "migrate"], cwd=release, check=True, capture_output=True,
                   timeout=120, env={**os.environ, "PYTHONPATH": str(release), "BROKER_DATABASE_URL": database_url})
