"""The catalog as a file (`broker definitions`): a node's message types, contracts, queues, the queues'
activations, services, routes and broker priorities written as YAML, and a node made to match such a file in one
transaction.

A file names each object once, under its section, with every setting; a setting left out takes the default of
its create_* function.  A route's secret is never in a file: the file names the environment variable that holds
it.  Everything a file refers to (a contract's message types, a service's queue and contracts) is in the file.
What a file is refused for is told with the line and column of the offending entry.
"""
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

import yaml
from sqlalchemy import Connection
from sqlalchemy.exc import DBAPIError

from broker import core, queries
from broker.errors import BrokerError, InUse

HEADER = ("# The catalog of a pg-broker node: `broker definitions apply FILE` makes a node match it.\n"
          "# Route secrets are not written here: each route names the environment variable that holds its secret.\n")
SENT_BY = ("initiator", "target", "any")
VALIDATIONS = ("none", "empty", "json")
REQUIRED = object()


@dataclass(frozen=True)
class Secret:
    """A route's secret: compared by value, shown only by the environment variable it came from."""

    value: str = field(repr=False)
    env: str | None = field(default=None, compare=False)


# Each section's settings in the order a file lists them, with their default (REQUIRED: none).
SETTINGS: dict[str, dict[str, tuple[type, Any]]] = {
    "message_types": {"validation": (str, "none")},
    "contracts": {"message_types": (dict, REQUIRED)},
    "queues": {"enabled": (bool, True), "retention": (bool, False), "poison_threshold": (int, 5)},
    # By queue: the procedure (schema-qualified, as the node keeps it) is the application's, not in the file.
    "activations": {"procedure": (str, REQUIRED), "max_queue_readers": (int, 1), "enabled": (bool, True),
                    "execute_as": (str, REQUIRED)},
    "services": {"queue": (str, REQUIRED), "contracts": (list, [])},
    "routes": {"address": (str, REQUIRED), "broker_instance": (str, REQUIRED), "secret": (Secret, REQUIRED)},
    "broker_priorities": {"priority": (int, REQUIRED), "contract": (str, None), "local_service": (str, None),
                          "remote_service": (str, None)},
}
SECTIONS = tuple(SETTINGS)  # in the order of what depends on what: each refers only to those before it
KIND = {"message_types": "message type", "contracts": "contract", "queues": "queue",
        "activations": "activation of queue", "services": "service",
        "routes": "route", "broker_priorities": "broker priority"}
TYPE_NAMES = {str: "text", bool: "true or false", int: "a whole number", dict: "a mapping", list: "a list",
              Secret: "{env: VARIABLE}"}


class DefinitionsError(Exception):
    """A file refused, or a change the node refused: where, what, and what to do.  Nothing was applied."""


@dataclass
class Catalog:
    """Objects by section and name, each as its settings; for a file, where each entry is written."""

    objects: dict[str, dict[str, dict[str, Any]]]
    places: dict[tuple[str, str], str] = field(default_factory=dict)
    source: str = "the node"


@dataclass(frozen=True)
class Change:
    """One step that makes the node match the file: create, alter, replace (drop and create), drop, or keep
    (not in the file, and kept without --prune)."""

    action: str
    section: str
    name: str
    wanted: dict[str, Any] | None
    present: dict[str, Any] | None
    place: str

    def describe(self) -> str:
        what = f"{KIND[self.section]} {self.name!r}"
        if self.action == "create":
            return f"create {what} ({_settings_text(self.wanted)})"
        if self.action in ("alter", "replace"):
            differences = "; ".join(_difference(key, self.present[key], self.wanted[key])
                                    for key in self.wanted if self.present[key] != self.wanted[key])
            how = " (drop and create again)" if self.action == "replace" else ""
            return f"{self.action} {what}{how}: {differences}"
        if self.action == "drop":
            return f"drop {what}: not in the file"
        return f"keep {what}: not in the file, kept (--prune drops it)"


def _shown(value: Any) -> str:
    if isinstance(value, Secret):
        return f"secret from ${value.env}" if value.env else "a secret"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{key}: {item}" for key, item in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(value) + "]"
    return "any" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def _settings_text(settings: dict[str, Any]) -> str:
    return ", ".join(_shown(value) if isinstance(value, Secret) else f"{key} {_shown(value)}"
                     for key, value in settings.items())


def _difference(key: str, present: Any, wanted: Any) -> str:
    if isinstance(wanted, Secret):
        return f"a new secret from ${wanted.env}"
    return f"{key} {_shown(present)} -> {_shown(wanted)}"


# --- The node's catalog -----------------------------------------------------------------------------


def read_node(connection: Connection) -> Catalog:
    """The node's catalog, without the broker's own message types."""
    return Catalog({
        "message_types": {row.name: {"validation": row.validation}
                          for row in connection.execute(queries.QUERIES["message_types"])
                          if not row.name.startswith("broker.")},
        "contracts": {name: {"message_types": {t: m["sent_by"] for t, m in sorted(types.items())}}
                      for name, types in queries.contracts(connection).items()},
        "queues": {row.name: {"enabled": row.is_enabled, "retention": row.retention,
                              "poison_threshold": row.poison_threshold}
                   for row in connection.execute(queries.QUERIES["queues"])},
        "activations": {row.queue_name: {"procedure": row.procedure_name,
                                         "max_queue_readers": row.max_queue_readers, "enabled": row.status == "on",
                                         "execute_as": row.execute_as}
                        for row in connection.execute(queries.QUERIES["activation_status"])},
        "services": {row.name: {"queue": row.queue, "contracts": sorted(row.contracts)}
                     for row in queries.services(connection)},
        "routes": {row.service_name: {"address": row.address, "broker_instance": str(row.broker_instance),
                                      "secret": Secret(row.peer_secret)}
                   for row in sorted(connection.execute(queries.QUERIES["routes_with_secrets"]),
                                     key=lambda row: row.service_name)},
        "broker_priorities": {row.name: {"priority": row.priority, "contract": row.contract_name,
                                         "local_service": row.local_service_name,
                                         "remote_service": row.remote_service_name}
                              for row in connection.execute(queries.QUERIES["broker_priorities"])},
    })


def export(connection: Connection) -> str:
    """The node's catalog as YAML, sorted by name: the same catalog is always the same text."""
    catalog = read_node(connection)
    variables = _secret_variables(catalog.objects["routes"])
    document = {}
    for section in SECTIONS:
        document[section] = {}
        for name, settings in sorted(catalog.objects[section].items()):
            document[section][name] = {key: {"env": variables[name]} if isinstance(value, Secret) else value
                                       for key, value in settings.items() if value is not None}
    return HEADER + yaml.safe_dump(document, sort_keys=False, default_flow_style=False, allow_unicode=True)


def _secret_variables(routes: dict[str, dict[str, Any]]) -> dict[str, str]:
    """Each route's environment variable for its secret: BROKER_SECRET_ and the service's name, that of the
    first route (by name) with the same node and secret, so that the routes to a node share one variable."""
    by_peer: dict[tuple[str, Secret], str] = {}
    taken: set[str] = set()
    variables = {}
    for name, route in sorted(routes.items()):
        peer = (route["broker_instance"], route["secret"])
        if peer not in by_peer:
            base = "BROKER_SECRET_" + re.sub(r"[^A-Za-z0-9]", "_", name).upper()
            variable, n = base, 1
            while variable in taken:
                n += 1
                variable = f"{base}_{n}"
            taken.add(variable)
            by_peer[peer] = variable
        variables[name] = by_peer[peer]
    return variables


# --- A file ---------------------------------------------------------------------------------------


def _is_utf8(text: str) -> bool:
    """Whether the text came from UTF-8 (Python reads other bytes of the environment as lone surrogates)."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def load(text: str, source: str, environ: Mapping[str, str] = os.environ) -> Catalog:
    """The catalog a file defines, with each route's secret taken from the environment; DefinitionsError names
    the line and column of what is wrong."""
    return _Reader(source, environ).read(text)


class _Reader:
    def __init__(self, source: str, environ: Mapping[str, str]):
        self.source = source
        self.environ = environ
        self.loader: yaml.SafeLoader | None = None

    def place(self, node: yaml.Node) -> str:
        return f"{self.source}:{node.start_mark.line + 1}:{node.start_mark.column + 1}"

    def refuse(self, node: yaml.Node, message: str) -> DefinitionsError:
        return DefinitionsError(f"{self.place(node)}: {message}")

    def read(self, text: str) -> Catalog:
        """The catalog, or DefinitionsError: also for YAML that is malformed, nested past Python's recursion limit,
        or uses what a catalog never does (tags, merge keys)."""
        try:
            return self.catalog(text)
        except yaml.MarkedYAMLError as error:
            mark = error.problem_mark or error.context_mark
            raise DefinitionsError(f"{self.source}:{mark.line + 1}:{mark.column + 1}: not valid YAML here: "
                                   f"{error.problem or error.context}") from None
        except yaml.YAMLError as error:
            raise DefinitionsError(f"{self.source}: not valid YAML: {error}") from None
        except RecursionError:
            raise DefinitionsError(f"{self.source}: nested too deeply to be a catalog") from None

    def catalog(self, text: str) -> Catalog:
        self.loader = yaml.SafeLoader(text)
        root = self.loader.get_single_node()
        if root is None:
            raise DefinitionsError(f"{self.source}: the file is empty: start from `broker definitions export`")
        catalog = Catalog({section: {} for section in SECTIONS}, source=self.source)
        entries: dict[tuple[str, str], yaml.Node] = {}
        for section, key_node, value in self.mapping(root, "the file", SECTIONS):
            for name, name_node, entry in self.mapping(value, section, None):
                catalog.objects[section][name] = self.entry(section, name, entry)
                catalog.places[(section, name)] = self.place(name_node)
                entries[(section, name)] = entry
        self.check_references(catalog, entries)
        return catalog

    def mapping(self, node: yaml.Node, what: str, keys: tuple[str, ...] | None):
        """A mapping's (key, key node, value node), its keys text, each once, and one of keys when given; null
        is an empty mapping."""
        if isinstance(node, yaml.ScalarNode) and node.tag == "tag:yaml.org,2002:null":
            return []
        if not isinstance(node, yaml.MappingNode):
            raise self.refuse(node, f"{what} must be a mapping (key: value)")
        seen = set()
        items = []
        for key_node, value in node.value:
            key = self.scalar(key_node, str, f"a name in {what}")
            if key in seen:
                raise self.refuse(key_node, f"{key!r} is written twice in {what}: keep one")
            if keys is not None and key not in keys:
                raise self.refuse(key_node, f"unknown key {key!r} in {what}: use {', '.join(keys)}")
            seen.add(key)
            items.append((key, key_node, value))
        return items

    def scalar(self, node: yaml.Node, kind: type, what: str) -> Any:
        value = self.loader.construct_object(node, deep=True) if isinstance(node, yaml.ScalarNode) else node
        if type(value) is not kind:
            hint = " (quote it)" if kind is str and isinstance(node, yaml.ScalarNode) and value is not None else ""
            raise self.refuse(node, f"{what} must be {TYPE_NAMES[kind]}{hint}")
        if kind is str and "\0" in value:
            raise self.refuse(node, f"{what} holds a NUL character, which no name or setting may")
        if kind is int and not -2**31 <= value < 2**31:
            raise self.refuse(node, f"{what} is out of range: at most {2**31 - 1:,}")
        return value

    def entry(self, section: str, name: str, node: yaml.Node) -> dict[str, Any]:
        what = f"{KIND[section]} {name!r}"
        given = {key: value for key, _, value in self.mapping(node, what, tuple(SETTINGS[section]))}
        settings = {}
        for key, (kind, default) in SETTINGS[section].items():
            if key not in given or (default is None and _is_null(given[key])):
                if default is REQUIRED:
                    raise self.refuse(node, f"{what} has no {key}: add it")
                settings[key] = default
                continue
            value = given[key]
            if kind is dict:
                settings[key] = {t: self.choice(v, SENT_BY, f"who sends {t!r} in {what}")
                                 for t, _, v in self.mapping(value, f"{key} of {what}", None)}
            elif kind is list:
                settings[key] = sorted(set(self.strings(value, f"{key} of {what}")))
            elif kind is Secret:
                settings[key] = self.secret(value, what)
            elif key == "validation":
                settings[key] = self.choice(value, VALIDATIONS, f"validation of {what}")
            else:
                settings[key] = self.scalar(value, kind, f"{key} of {what}")
        self.check_values(section, what, settings, given)
        return settings

    def choice(self, node: yaml.Node, choices: tuple[str, ...], what: str) -> str:
        value = self.scalar(node, str, what)
        if value not in choices:
            raise self.refuse(node, f"{what} must be {', '.join(choices)}")
        return value

    def strings(self, node: yaml.Node, what: str) -> list[str]:
        if not isinstance(node, yaml.SequenceNode):
            raise self.refuse(node, f"{what} must be a list")
        return [self.scalar(item, str, f"each of {what}") for item in node.value]

    def secret(self, node: yaml.Node, what: str) -> Secret:
        if not isinstance(node, yaml.MappingNode):
            raise self.refuse(node, f"the secret of {what} must be {{env: VARIABLE}}, the environment variable "
                                    "that holds it: a file never holds a secret")
        given = self.mapping(node, f"the secret of {what}", ("env",))
        if not given:
            raise self.refuse(node, f"the secret of {what} must be {{env: VARIABLE}}")
        [(_, _, variable_node)] = given
        variable = self.scalar(variable_node, str, f"env of the secret of {what}")
        if variable not in self.environ:
            raise self.refuse(variable_node, f"the secret of {what} is in ${variable}, which is not set: set it "
                                             "to the secret shared with that node")
        secret = self.environ[variable]
        if "\0" in secret or not _is_utf8(secret):
            raise self.refuse(variable_node, f"${variable}, the secret of {what}, holds what a secret may not "
                                             "(a NUL character, or bytes that are not UTF-8)")
        return Secret(secret, variable)

    def check_values(self, section: str, what: str, settings: dict[str, Any], given: dict[str, yaml.Node]) -> None:
        """What can be told from the entry alone; the node checks the rest (names, ranges) as it applies it."""
        if section == "contracts" and not settings["message_types"]:
            raise self.refuse(given["message_types"], f"{what} names no message type: name at least one")
        if section == "routes":
            try:
                settings["broker_instance"] = str(UUID(settings["broker_instance"]))
            except ValueError:
                raise self.refuse(given["broker_instance"], f"broker_instance of {what} must be a uuid") from None
            # The node keeps an address without its trailing slashes (broker.create_route).
            settings["address"] = settings["address"].rstrip("/")
        if section == "activations" and "." not in settings["procedure"]:
            raise self.refuse(given["procedure"], f"procedure of {what} must name its schema, as the node keeps it "
                                                  f"and export writes it: e.g. public.{settings['procedure']}")

    def check_references(self, catalog: Catalog, entries: dict[tuple[str, str], yaml.Node]) -> None:
        """Each name an entry refers to is defined in the file."""
        defined = catalog.objects
        for name, contract in defined["contracts"].items():
            for type_name, key_node, _ in self.mapping(
                    self.setting(entries[("contracts", name)], "message_types"), name, None):
                if type_name.startswith("broker."):
                    raise self.refuse(key_node, f"the broker's message type {type_name!r} is part of every "
                                                "contract: leave it out")
                if type_name not in defined["message_types"]:
                    raise self.refuse(key_node, f"contract {name!r} names message type {type_name!r}, which the "
                                                "file does not define: add it under message_types")
        for name in defined["activations"]:
            if name not in defined["queues"]:
                raise self.refuse(entries[("activations", name)], f"activations name queue {name!r}, which the "
                                                                  "file does not define: add it under queues")
        for name, service in defined["services"].items():
            entry = entries[("services", name)]
            if service["queue"] not in defined["queues"]:
                raise self.refuse(self.setting(entry, "queue"), f"service {name!r} is on queue "
                                  f"{service['queue']!r}, which the file does not define: add it under queues")
            for contract in service["contracts"]:
                if contract not in defined["contracts"]:
                    raise self.refuse(self.setting(entry, "contracts"), f"service {name!r} accepts contract "
                                      f"{contract!r}, which the file does not define: add it under contracts")

    def setting(self, entry: yaml.Node, key: str) -> yaml.Node:
        return next(value for k, _, value in self.mapping(entry, "", None) if k == key)


def _is_null(node: yaml.Node) -> bool:
    return isinstance(node, yaml.ScalarNode) and node.tag == "tag:yaml.org,2002:null"


# --- Plan and apply -------------------------------------------------------------------------------

# A changed object that has no alter_* function is dropped and created again (a replace).
ALTERED_IN_PLACE = {"queues", "activations"}


def plan(connection: Connection, wanted: Catalog, prune: bool) -> list[Change]:
    """What makes the node match the file, section by section, by name; objects the file does not name are
    dropped with prune, else kept."""
    present = read_node(connection).objects
    changes = []
    for section in SECTIONS:
        have, want = present[section], wanted.objects[section]
        for name in sorted(have.keys() | want.keys()):
            place = wanted.places.get((section, name), wanted.source)
            if name not in want:
                changes.append(Change("drop" if prune else "keep", section, name, None, have[name], place))
            elif name not in have:
                changes.append(Change("create", section, name, want[name], None, place))
            elif have[name] != want[name]:
                changes.append(Change(_how_to_change(section, have[name], want[name]), section, name, want[name],
                                      have[name], place))
    return changes


def _how_to_change(section: str, present: dict[str, Any], wanted: dict[str, Any]) -> str:
    if section in ALTERED_IN_PLACE or (section == "services" and present["queue"] == wanted["queue"]):
        return "alter"
    return "replace"


def apply(connection: Connection, changes: list[Change]) -> None:
    """Runs the changes in the caller's transaction: first what goes, the objects that depend on others first,
    then what comes, in the opposite order.  A service whose contracts change first lets go of those that go,
    so that they can be dropped, then takes those that come."""
    leaving = [c for c in changes if c.action in ("drop", "replace")]
    for section in reversed(SECTIONS):
        for change in leaving:
            if change.section == section:
                _run(change, _DROP[section], connection, change.name)
        if section == "services":
            going = {c.name for c in leaving if c.section == "contracts"}
            for change in changes:
                if change.action == "alter" and change.section == "services":
                    kept = [c for c in change.wanted["contracts"]
                            if c in change.present["contracts"] and c not in going]
                    if kept != change.present["contracts"]:
                        _run(change, core.alter_service, connection, change.name, kept)
    for section in SECTIONS:
        for change in changes:
            if change.section != section:
                continue
            if change.action in ("create", "replace"):
                _run(change, _CREATE[section], connection, change.name, change.wanted)
            elif change.action == "alter":
                _run(change, _ALTER[section], connection, change.name, change.wanted)


def _run(change: Change, step, connection: Connection, *arguments) -> None:
    """One call of the SQL API; its refusal becomes a DefinitionsError that names the entry."""
    try:
        step(connection, *arguments)
    except BrokerError as error:
        raise DefinitionsError(_refusal(change, error.message, error.sqlstate, error.hint,
                                        isinstance(error, InUse))) from None
    except DBAPIError as error:
        diag = getattr(error.orig, "diag", None)
        message = diag.message_primary if diag and diag.message_primary else str(error.orig).strip()
        raise DefinitionsError(_refusal(change, message, getattr(error.orig, "pgcode", None), None, False)) from None


def _refusal(change: Change, message: str, sqlstate: str | None, hint: str | None, in_use: bool) -> str:
    doing = {"drop": "dropping", "replace": "replacing", "create": "creating", "alter": "altering"}[change.action]
    if change.action == "replace" and in_use:
        hint = (f"a {KIND[change.section]} in use cannot change: define the changed one under a new name, and "
                "drop the old one once nothing uses it")
    return (f"{change.place}: {doing} {KIND[change.section]} {change.name!r}: {message}"
            + (f" ({sqlstate})" if sqlstate else "") + (f"; {hint}" if hint else ""))


def _set_activation(connection: Connection, queue: str, settings: dict[str, Any]) -> None:
    core.set_queue_activation(connection, queue, settings["procedure"], max_queue_readers=settings["max_queue_readers"],
                              enabled=settings["enabled"], execute_as=settings["execute_as"])


_DROP = {
    "message_types": core.drop_message_type,
    "contracts": core.drop_contract,
    "queues": core.drop_queue,
    "activations": core.drop_queue_activation,
    "services": core.drop_service,
    "routes": core.drop_route,
    "broker_priorities": core.drop_broker_priority,
}
_CREATE = {
    "message_types": lambda c, name, s: core.create_message_type(c, name, s["validation"]),
    "contracts": lambda c, name, s: core.create_contract(c, name, s["message_types"]),
    "queues": lambda c, name, s: core.create_queue(c, name, enabled=s["enabled"], retention=s["retention"],
                                                   poison_threshold=s["poison_threshold"]),
    "activations": _set_activation,
    "services": lambda c, name, s: core.create_service(c, name, s["queue"], s["contracts"]),
    "routes": lambda c, name, s: core.create_route(c, name, s["address"], s["broker_instance"], s["secret"].value),
    "broker_priorities": lambda c, name, s: core.create_broker_priority(
        c, name, s["priority"], contract=s["contract"], local_service=s["local_service"],
        remote_service=s["remote_service"]),
}
_ALTER = {
    "queues": lambda c, name, s: core.alter_queue(c, name, enabled=s["enabled"], retention=s["retention"],
                                                  poison_threshold=s["poison_threshold"]),
    "activations": _set_activation,
    "services": lambda c, name, s: core.alter_service(c, name, s["contracts"]),
}



def make_match(connection: Connection, wanted: Catalog, prune: bool) -> list[Change]:
    """Plans and applies in the caller's transaction, after any other apply on the node has ended."""
    connection.execute(queries.QUERIES["lock_definitions"])
    changes = plan(connection, wanted, prune)
    apply(connection, changes)
    return changes
