"""The library floor (package broker: what an application embeds, the SQL API's client, the relay, the transport,
the queries) never imports the application floor (broker.cli: the command and what only it runs) or the other
top-level packages, so that embedding it never pulls in a terminal UI, an embedded server, Spark or FastAPI."""
import ast
from importlib import resources

import pytest

APPLICATION_FLOOR = "broker.cli"
OTHER_PACKAGES = ("api", "bench", "spark_ingest", "migrations")


def _modules(package: str, folder=None):
    folder = folder or resources.files(package)
    for entry in folder.iterdir():
        if entry.name.endswith(".py"):
            name = package if entry.name == "__init__.py" else f"{package}.{entry.name[:-3]}"
            yield name, entry.read_text()
        elif entry.is_dir() and (entry / "__init__.py").is_file():
            yield from _modules(f"{package}.{entry.name}", entry)


def _imported(source: str) -> set[str]:
    """Every module an import statement names, at any depth (imports inside functions count too)."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def _on_application_floor(module: str) -> bool:
    return module == APPLICATION_FLOOR or module.startswith(APPLICATION_FLOOR + ".")


LIBRARY_FLOOR = sorted((name, source) for name, source in _modules("broker") if not _on_application_floor(name))


def test_the_floors_are_what_the_architecture_names():
    assert {name for name, _ in LIBRARY_FLOOR} >= {"broker", "broker.core", "broker.relay", "broker.queries",
                                                   "broker.transport.sending", "broker.transport.receiving",
                                                   "broker.transport.describe", "broker.transport.wire",
                                                   "broker.transport.signing"}
    assert {name for name, _ in _modules("broker") if _on_application_floor(name)} >= {
        "broker.cli.commands", "broker.cli.demo", "broker.cli.diagnose", "broker.cli.status", "broker.cli.embedded",
        "broker.cli.processes", "broker.cli.settings"}


@pytest.mark.parametrize("module, source", LIBRARY_FLOOR, ids=[name for name, _ in LIBRARY_FLOOR])
def test_the_library_floor_never_imports_the_application_floor(module, source):
    forbidden = {name for name in _imported(source)
                 if _on_application_floor(name) or name.split(".")[0] in OTHER_PACKAGES}
    assert not forbidden, f"{module} imports {sorted(forbidden)}"
