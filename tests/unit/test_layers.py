"""The floors of package broker, each importing only from those below it: the library (what an application embeds:
the SQL API's client, the relay, the transport, the queries, settings, status and diagnose), then the services built
on it (broker.api, the REST API and the node-to-node transport; broker.spark_ingest, the Spark job;
broker.migrations), then the command (broker.cli: the command and what only it runs).  So embedding the library
never pulls in a terminal UI, an embedded server, Spark or FastAPI, and no service depends on the command line.
The benchmark (bench, not installed) is above them all."""
import ast
from importlib import resources

import pytest

from tests.syntax import syntax_tree

LIBRARY, SERVICES, COMMAND = "library", "services", "command"
SERVICE_PACKAGES = ("broker.api", "broker.spark_ingest", "broker.migrations")
FLOORS = {LIBRARY: 0, SERVICES: 1, COMMAND: 2}


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
    for node in ast.walk(syntax_tree(source)):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def floor_of(module: str) -> str | None:
    """The floor of a module of package broker; None for anything outside it."""
    if _within(module, "broker.cli") or _within(module, "bench"):
        return COMMAND
    if any(_within(module, package) for package in SERVICE_PACKAGES):
        return SERVICES
    return LIBRARY if _within(module, "broker") else None


# Package broker and the packages installed into it, which a checkout keeps in folders of their own.
MODULES = sorted({name: source for package in ("broker", *SERVICE_PACKAGES)
                  for name, source in _modules(package)}.items())


def test_the_floors_are_what_the_architecture_names():
    floors = {name: floor_of(name) for name, _ in MODULES}
    assert {name for name, floor in floors.items() if floor == LIBRARY} >= {
        "broker", "broker.core", "broker.relay", "broker.queries", "broker.settings", "broker.status",
        "broker.diagnose", "broker.transport.sending", "broker.transport.receiving", "broker.transport.describe",
        "broker.transport.wire", "broker.transport.signing"}
    assert {name for name, floor in floors.items() if floor == SERVICES} >= {
        "broker.api.main", "broker.api.routes.transport", "broker.spark_ingest.job", "broker.migrations.env"}
    assert {name for name, floor in floors.items() if floor == COMMAND} >= {
        "broker.cli.commands", "broker.cli.demo", "broker.cli.embedded", "broker.cli.processes"}


@pytest.mark.parametrize("module, source", MODULES, ids=[name for name, _ in MODULES])
def test_no_module_imports_from_a_floor_above_its_own(module, source):
    above = {name for name in _imported(source)
             if floor_of(name) is not None and FLOORS[floor_of(name)] > FLOORS[floor_of(module)]}
    assert not above, f"{module} ({floor_of(module)}) imports {sorted(above)}"
