"""`broker diagnose`: checks a node's configuration end to end, each finding with what to do.

In the spirit of Service Broker's ssbdiagnose: the schema, the queues, a route for every
remote service in use, and for every peer: that it answers, is the instance the route names,
shares a wire version with us, accepts our signature and signs its answer, keeps a clock close to
ours, offers the service with an enabled queue, defines the contracts as we do, and has a route
back to us.
"""
import json
import time
from dataclasses import dataclass
from itertools import groupby

import httpx
from pydantic import ValidationError
from sqlalchemy import Connection

from broker import __version__, queries, relay
from broker.masking import visible
from broker.status import lost_messages_explained
from broker.transport import describe, signing, wire
from broker.transport.sending import wire_versions_named

# A destination that has refused this many attempts in a row keeps refusing: an error, not a passing failure.
REFUSING_ATTEMPTS = 3
WIRE_ADVICE = ("upgrade one of the two nodes so that they share a wire version (each names those it takes as "
               "wire_versions in /healthz)")
CLOCK_ADVICE = "keep the clocks in sync (NTP), or raise BROKER_MAX_CLOCK_SKEW_S on both nodes"
RELAY_ADVICE = ("start this node ('broker serve'), or 'broker relay' beside a node that runs with --no-relay")
# What a database that went back to an earlier point lost (broker.lost_messages): the level and what to do, by outcome.
LOST_MESSAGES_ADVICE = {
    "missing": ("error", "start the far node if it is down: it sends them again if its resend window still keeps "
                         "them, and otherwise ends the conversation with broker.error -4"),
    "lost": ("error", "reconcile with the far side's application (the numbers are above), then end the conversation "
                      "(broker.end_conversation): the finding goes when the conversation is forgotten"),
    "renumbered": ("warning", "the applications on both sides got a broker.renumbered message: reconcile the "
                              "numbers it names, which the far side may hold twice"),
    "withheld": ("error", "the far node was unreachable for longer than it remembers ended conversations: ask its "
                          "operator whether the conversation ended there; the messages are in the dead letters here "
                          "(queue_position 0); send what still matters on a new conversation, then end this one"),
    "resent": ("ok", ""),
}
LOST_MESSAGES_SHOWN = 100
# What to do about a destination that does not take our batches, by the words of its last failure: the clock
# first, as a refusal for any cause may name it.
REFUSAL_ADVICE = [
    ("clock", CLOCK_ADVICE),
    ("another wire version", WIRE_ADVICE),
    ("HTTP 413", "on that node raise BROKER_MAX_BATCH_BYTES above the largest message (its max_message_bytes "
                 "and a few KB), or send smaller messages"),
    ("HTTP 401", "that node refuses our signature: give the routes on both nodes the same secret and the right "
                 "broker_instance"),
    ("HTTP 5", "that node fails: look at its log"),
    ("HTTP 404", "that address does not lead to a node's transport: fix the routes' address (a path prefix needs a "
                 "proxy in front of that node that takes it away)"),
    ("cannot reach", "start that node ('broker serve'), or fix the routes' address"),
    ("not signed by the peer", "use the same secret in the routes on both nodes"),
    ("is broker instance", "recreate the routes to that node with its broker_instance"),
]


def refusal_advice(status: str) -> str:
    return next((advice for words, advice in REFUSAL_ADVICE if words in status),
                "see the checks of that node's routes below")


@dataclass(frozen=True, slots=True)
class Finding:
    level: str  # "ok", "warning" or "error"
    check: str
    finding: str
    advice: str = ""


def counted(count: int, noun: str) -> str:
    """A count with its noun: "1 message", "2 messages"."""
    return f"{count:,} {noun}{'' if count == 1 else 's'}"


def _member(response: httpx.Response, name: str) -> object:
    """A member of a JSON object answer; None when the answer is not one."""
    try:
        answer = response.json()
    except ValueError:
        return None
    return answer.get(name) if isinstance(answer, dict) else None


def _ok(check: str, finding: str) -> Finding:
    return Finding("ok", check, finding)


def _database_clock_findings(connection: Connection) -> list[Finding]:
    """The database's clock against this process's: lifetimes, timers and delivery times follow the database's
    and travel to peers as times of day, while requests are signed and judged by the processes' clocks."""
    before = time.time()
    database = connection.execute(queries.QUERIES["database_clock"]).scalar_one()
    after = time.time()
    skew_s = max(database - after, before - database, 0.0)
    if skew_s <= DATABASE_CLOCK_WARNING_S:
        return []
    return [Finding("error" if skew_s > DATABASE_CLOCK_ERROR_S else "warning", "database clock",
                    f"the database's clock is {skew_s:.1f} s {'ahead of' if database > after else 'behind'} this "
                    "node's: conversation lifetimes, timers and delivery times follow the database's clock, and a "
                    "peer reads them by its own", "keep the database server's clock in sync (NTP), as the nodes'")]


def _local_findings(connection: Connection, schema_head: str, max_wait_s: float) -> list[Finding]:
    findings = _database_clock_findings(connection)
    version = connection.execute(queries.QUERIES["schema_revision"]).scalar()
    findings.append(_ok("schema", f"at revision {version}, for pg-broker {__version__}") if version == schema_head
                    else Finding("error", "schema", f"the database is at revision {version}, pg-broker {__version__} "
                                 f"needs {schema_head}", "run 'broker migrate'"))
    for queue in queries.queue_statuses(connection):
        if queue.status != "enabled":
            findings.append(Finding(
                "error", f"queue {queue.queue_name}", f"disabled ({queue.dead_letters} dead letters)",
                f"look at broker.dead_letters, then SELECT broker.alter_queue('{queue.queue_name}', status => true)"))
        else:
            findings.append(_ok(f"queue {queue.queue_name}", "enabled"))
    for service in connection.execute(queries.QUERIES["unrouted_services"]):
        findings.append(Finding(
            "error", f"service {service.to_service}", f"{service.messages} messages wait for it, and it has no route",
            f"SELECT broker.create_route('{service.to_service}', '<address of its node>', "
            "'<that node's broker_instance>', '<the secret you share with it>')"))
    refusals = {}
    for destination in connection.execute(queries.QUERIES["failing_destinations"]):
        refusals[destination.address] = refusal_advice(destination.status)
        findings.append(Finding(
            # a message refused as too large on its own never goes until a limit changes, nor a batch in another
            # wire version until a node is upgraded
            "error" if destination.attempts >= REFUSING_ATTEMPTS or "HTTP 413" in destination.status
            or "HTTP 415" in destination.status else "warning",
            f"transmission to {destination.address}",
            f"{counted(destination.messages, 'message')} waiting, up to {counted(destination.attempts, 'attempt')}: "
            f"{destination.status}",
            refusals[destination.address]))
    lost_messages = connection.execute(queries.QUERIES["lost_messages"], {"limit": LOST_MESSAGES_SHOWN})
    for lost in queries.as_dicts(lost_messages):
        level, advice = LOST_MESSAGES_ADVICE[lost["outcome"]]
        findings.append(Finding(level, f"conversation {lost['conversation_handle'] or lost['conversation_id']}",
                                f"with {lost['far_service'] or 'a far node'} ({lost['far_broker_instance']}): "
                                f"{lost_messages_explained(lost)}", advice))
    backlogs = connection.execute(queries.QUERIES["routed_backlogs"], {"max_wait_s": max_wait_s, "lanes": relay.LANES})
    for backlog in backlogs:
        if not backlog.relayed:
            findings.append(Finding("error", f"relay to {backlog.address}",
                                    f"{backlog.messages} messages wait for it and no relay is running for it",
                                    RELAY_ADVICE))
        if backlog.overdue:
            advice = (refusals.get(backlog.address) or (RELAY_ADVICE if not backlog.relayed else
                      "the relay sends, and that node does not acknowledge: see the checks of that node below"))
            findings.append(Finding("error", f"waiting for {backlog.address}",
                                    f"{backlog.overdue} messages have waited longer than {max_wait_s:g} s, the "
                                    f"oldest {backlog.longest_wait_s:.0f} s", advice))
    return findings


# How far the database's clock may be from the node's: a warning past the first, an error past the second (a
# conversation's lifetime of a minute would end at once, or late, on one side).
DATABASE_CLOCK_WARNING_S = 2.0
DATABASE_CLOCK_ERROR_S = 60.0


def _clock_finding(check: str, their_instance: str, their_release: str, skew_s: float, max_skew_s: float) -> Finding:
    """How far the peer's clock is from ours, to a tenth of a second (the timestamps are whole seconds, so up
    to a second more or less), against the skew this node accepts."""
    if skew_s > max_skew_s:
        return Finding("error", check, f"its clock is {skew_s:.1f} s from ours, more than the {max_skew_s:g} s this "
                       "node accepts: its batches to this node are refused", CLOCK_ADVICE)
    if skew_s > max_skew_s / 2:
        return Finding("warning", check, f"its clock is {skew_s:.1f} s from ours (this node accepts at most "
                       f"{max_skew_s:g} s)", CLOCK_ADVICE)
    return _ok(check, f"answers as instance {their_instance} ({their_release}), signs both ways, clock within "
                      f"{skew_s:.0f} s")


def _release(health: httpx.Response) -> str:
    """A peer's release, as its /healthz names it (a node before 0.2.0 names none)."""
    version = _member(health, "version")
    return f"pg-broker {visible(version[:40])}" if isinstance(version, str) else "a release before pg-broker 0.2.0"


def _peer_findings(client: httpx.Client, address: str, route_instance: str, secret: str, rotated: list,
                   services: list[str], our_instance: str, our_contracts: dict, contracts_in_use: dict[str, set[str]],
                   max_skew_s: float) -> list[Finding]:
    check = f"node {address}"
    try:
        health = client.get(f"{address}/healthz")
    except httpx.HTTPError as error:
        tls = "certificate" in str(error).lower() or "ssl" in str(error).lower()
        return [Finding("error", check, f"does not answer: {error}",
                        "trust its CA with BROKER_TLS_CA_FILE" if tls else
                        "start that node ('broker serve'), or fix the routes' address")]
    if health.status_code != 200:
        return [Finding("error", check, f"/healthz answers {health.status_code}", "look at that node's log")]
    their_instance = _member(health, "broker_instance")
    if their_instance != route_instance:
        return [Finding("error", check, f"is instance {their_instance}, the routes to it say {route_instance}",
                        f"recreate the routes of {', '.join(services)} with broker_instance {their_instance}")]
    theirs = wire_versions_named(health)
    version = wire.version_for(theirs)
    if version is None:
        speaks = (f"speaks {wire.in_words(theirs)}" if theirs else
                  "names no wire version in /healthz (it is older than wire version 2)")
        return [Finding("error", check, f"{speaks}, this node {wire.in_words(wire.WIRE_VERSIONS)}: each refuses "
                        "the other's batches", WIRE_ADVICE)]
    findings = [] if version == wire.WIRE_VERSION else [Finding(
        "warning", check, f"takes {wire.in_words(theirs)}: batches go to it as wire version {version}, without "
        "what later versions carry (message ids, by which it checks that a batch agrees with what it holds)",
        "upgrade that node to this release")]

    answer = describe.ask(client, address, our_instance, route_instance, secret, services, sorted(our_contracts))
    for other in rotated if answer.status_code == 401 else ():  # as the relay signs: with another secret held
        taken = describe.ask(client, address, our_instance, route_instance, other.secret, services,
                             sorted(our_contracts))
        if taken.status_code != 401:
            answer, secret = taken, other.secret
            findings.append(_taken_instead(check, other.role, our_instance, route_instance))
            break
    if answer.status_code == 401:
        detail = str(_member(answer, "detail") or "")
        return [Finding("error", check, f"refuses our signature: {detail}",
                        CLOCK_ADVICE if "clock" in detail else
                        f"that node needs a route to one of our services with our broker_instance {our_instance} "
                        "and the same secret")]
    if answer.status_code != 200:
        return [Finding("error", check, f"answers {answer.status_code} to a signed request: {answer.text[:200]}",
                        "upgrade that node to this version")]
    try:
        signing.check_answer(secret, answer.headers, answer.request.headers[signing.SIGNATURE_HEADER],
                             answer.content)
    except signing.BadSignature as refusal:
        return [Finding("error", check, f"its answer is not signed with our shared secret: {refusal}",
                        "use the same secret in the routes on both nodes")]
    findings.append(_clock_finding(check, their_instance, _release(health),
                                   abs(time.time() - int(answer.headers[signing.TIMESTAMP_HEADER])), max_skew_s))
    try:
        described = describe.Description.model_validate_json(answer.content)
    except ValidationError as error:
        return findings + [Finding("error", check, f"its description of itself is malformed ({error.error_count()} "
                                   "problems)", "upgrade that node to this version")]
    for service in services:
        offered = described.services.get(service)
        if offered is None:
            findings.append(Finding("error", f"service {service}", f"{address} has no service {service}",
                                    f"create it on that node, or point the route of {service} elsewhere"))
            continue
        if not offered.queue_enabled:
            findings.append(Finding("error", f"service {service}",
                                    f"its queue {offered.queue} on {address} is disabled",
                                    "on that node: look at broker.dead_letters, then enable the queue with "
                                    "broker.alter_queue"))
        refused = contracts_in_use.get(service, set()) - set(offered.contracts)
        for contract in sorted(refused):
            findings.append(Finding("error", f"service {service}",
                                    f"conversations here use contract {contract}, which it does not accept",
                                    f"on that node: add {contract} to the contracts of {service}"))
        for contract in offered.contracts:
            theirs, ours = described.contracts.get(contract), our_contracts.get(contract)
            if ours is not None and theirs != ours:
                findings.append(Finding("error", f"contract {contract}",
                                        f"differs: here {json.dumps(ours)}, on {address} {json.dumps(theirs)}",
                                        "define it the same way on both nodes"))
        if offered.queue_enabled and not refused:
            findings.append(_ok(f"service {service}", f"on {address}, accepts {', '.join(offered.contracts)}"))
    if not described.routes_to_you:
        findings.append(Finding("warning", check, "has no route to any service here: its replies cannot reach us",
                                f"on that node: broker.create_route('<our service>', '<our address>', "
                                f"'{our_instance}', '<the shared secret>')"))
    return findings


SECRET_ROLES = {"current": "the routes' secret", "next": "the new secret, not yet switched to",
                "previous": "the old secret, switched from"}


def _when(at) -> str:
    return at.strftime("%Y-%m-%d %H:%M:%S %Z")


def _secret_findings(address: str, instance: str, secrets: list) -> list[Finding]:
    """Which secret the peer signs its batches with: the one it signed with last (rows of
    the query peer_secrets, the latest used first), and how far a rotation of it has got."""
    check = f"secret of {address}"
    latest = secrets[0] if secrets and secrets[0].last_used_at is not None else None
    if latest is None:
        findings = [_ok(check, "has sent no batch here yet: which secret it signs with is not known")]
    elif latest.role == "previous":
        findings = [Finding("warning", check, f"still signs its batches with the old secret (last at "
                            f"{_when(latest.last_used_at)}), which this node takes until it retires it",
                            "on that node: broker.switch_peer_secret; retire the old secret here only once this "
                            "warning is gone")]
    else:
        findings = [_ok(check, f"signs its batches with {SECRET_ROLES[latest.role]} (last at "
                               f"{_when(latest.last_used_at)})")]
    for secret in secrets:
        if secret.role == "next":
            findings.append(Finding("warning", check, f"a new secret is added and not yet switched to (since "
                                    f"{_when(secret.since)})", "once that node holds it too: SELECT "
                                    f"broker.switch_peer_secret('{instance}'), on both nodes"))
        elif secret.role == "previous" and secret is not latest:
            findings.append(_ok(check, f"the old secret, switched from at {_when(secret.since)}, is no longer used "
                                f"by that node: retire it with SELECT broker.retire_peer_secret('{instance}')"))
    return findings


def _taken_instead(check: str, role: str, our_instance: str, their_instance: str) -> Finding:
    """A peer refused the routes' secret and took another held for it while a secret is rotated (role: that one's):
    what its node or this one has still to do."""
    if role == "previous":
        advice = (f"on that node: SELECT broker.add_peer_secret('{our_instance}', …) with the secret this node "
                  f"switched to, then broker.switch_peer_secret('{our_instance}')")
    else:
        advice = f"that node switched to the new secret: here, SELECT broker.switch_peer_secret('{their_instance}')"
    return Finding("warning", check, f"refuses the routes' secret and takes the {role} one held for it, which the "
                   "relay signs with meanwhile: the rotation is half done", advice)


def diagnose(connection: Connection, client: httpx.Client, schema_head: str, *, max_wait_s: float,
             max_clock_skew_s: float) -> list[Finding]:
    """Every finding about this node and its peers; max_wait_s is how long a message may wait for a destination
    before that is an error, max_clock_skew_s the skew this node accepts (BROKER_MAX_CLOCK_SKEW_S)."""
    findings = _local_findings(connection, schema_head, max_wait_s)
    our_instance = queries.broker_instance(connection)
    our_contracts = queries.contracts(connection)
    contracts_in_use = queries.contracts_in_use_by_remote_service(connection)
    routes = connection.execute(queries.QUERIES["routes_with_secrets"]).all()
    for (address, instance, secret), group in groupby(routes, key=lambda r: (r.address, r.broker_instance,
                                                                             r.peer_secret)):
        services = [route.service_name for route in group]
        rotated = connection.execute(queries.QUERIES["rotated_secrets"], {"instance": str(instance)}).all()
        findings += _peer_findings(client, address, str(instance), secret, rotated, services, our_instance,
                                   our_contracts, contracts_in_use, max_clock_skew_s)
        secrets = connection.execute(queries.QUERIES["peer_secrets"], {"instance": str(instance)}).all()
        findings += _secret_findings(address, str(instance), secrets)
    return findings
