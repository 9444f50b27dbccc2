"""Earlier releases from the git history, each installed with pip into an environment of its own, to run beside
this one: every release talks to the previous release in both directions."""
import io
import os
import re
import subprocess
import sys
import sysconfig
import tarfile
from dataclasses import dataclass
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parent.parent
# The last release before this one (revision 0037, wire versions 3 and 4): the release this one must talk to, both
# ways, and whose databases this release's migrations take over while it serves.
PREVIOUS_RELEASE = "0.3.0"
PREVIOUS_REVISION = "0037"
PREVIOUS_WIRE_VERSION = 4


def commit_of(version: str) -> str:
    """The commit a release landed as, as CHANGELOG.md names it in the release's section."""
    changelog = (REPOSITORY / "CHANGELOG.md").read_text()
    section = re.search(rf"^## \[{re.escape(version)}\].*?(?=^## )", changelog, re.MULTILINE | re.DOTALL)
    commit = section and re.search(r"Released as commit `([0-9a-f]{7,40})`", section.group(0))
    if not commit:
        raise LookupError(f"CHANGELOG.md names no commit for release {version}")
    return commit.group(1)


@dataclass(frozen=True)
class Release:
    """An earlier release, installed: its interpreter, and a directory to run it from (not this checkout, whose
    packages `python -m` would find first)."""
    python: Path
    home: Path


def checkout(version: str, directory: Path) -> Path:
    """The project's files as of a release, in directory (from git archive: no work tree is touched)."""
    directory.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(REPOSITORY), "archive", "--format=tar", commit_of(version)],
                             capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(directory, filter="data")
    return directory


def install(version: str, directory: Path) -> Release:
    """A release, installed with pip (not editable) into a virtual environment of its own in directory.  Its
    dependencies are this environment's, named by a .pth file rather than downloaded again: the releases pin the
    same versions."""
    source = checkout(version, directory / "source")
    release = installed_in(directory)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(release.home)], check=True, timeout=120)
    site_packages = subprocess.run(
        [str(release.python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True).stdout.strip()
    (Path(site_packages) / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([str(release.python), "-m", "pip", "install", "--quiet", "--no-deps",
                    "--target", site_packages, str(source)], check=True, capture_output=True, timeout=300)
    return release


def installed_in(directory: Path) -> Release:
    """The release that install() put in directory."""
    environment = directory / "environment"
    return Release(environment / "bin" / "python", environment)


def run(release: Release, *arguments: str, database_url: str) -> None:
    """The release's own `broker` command, e.g. migrate on an empty database: its schema, at its head revision."""
    subprocess.run([str(release.python), "-m", "broker.cli", *arguments], cwd=release.home, check=True,
                   capture_output=True, timeout=120, env={**os.environ, "BROKER_DATABASE_URL": database_url})
