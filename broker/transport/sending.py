"""The sending side of a batch: one signed POST to the destination, in a wire version it takes, and its answer
accepted only when the destination signed it as the answer to this very request and is the instance the route
names."""
import httpx

from broker.masking import visible
from broker.transport import signing, wire


# A node's /healthz answers at once, however busy the node: a destination that does not is taken as down.
PROBE_TIMEOUT_S = 5.0


class TransportFailure(Exception):
    """A destination did not take a batch; the message says why, in words for transmission_status."""


class UnsupportedWireVersion(TransportFailure):
    """The destination refused the batch's wire version; versions are those it named (none when it named none)."""

    def __init__(self, reason: str, versions: tuple[int, ...]):
        super().__init__(reason)
        self.versions = versions


class SignatureRefused(TransportFailure):
    """The destination refused the request's signature (401): it may hold another of the secrets this node holds
    for it, while one is rotated."""


class BatchTooLarge(TransportFailure):
    """The destination refused a batch as larger than it accepts; limit_bytes is its limit, when it said."""

    def __init__(self, reason: str, limit_bytes: int | None):
        super().__init__(reason)
        self.limit_bytes = limit_bytes


def _positive(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _problem_member(response: httpx.Response, name: str) -> int | None:
    """A positive integer member of a problem answer (limit_bytes of a 413), if it names a sane one."""
    try:
        value = response.json().get(name)
    except (ValueError, AttributeError):
        return None
    return value if _positive(value) else None


def wire_versions_named(response: httpx.Response) -> tuple[int, ...]:
    """The wire versions a node's /healthz or 415 names: its wire_versions, or else its wire_version alone (a
    node of a release that took one version only), or none."""
    try:
        named = response.json()
        versions = named.get("wire_versions", [named.get("wire_version")])
    except (ValueError, AttributeError):
        return ()
    return tuple(sorted({v for v in versions if _positive(v)})) if isinstance(versions, list) else ()


def peer_wire_versions(client: httpx.Client, address: str) -> tuple[int, ...]:
    """The wire versions the node at address takes, as its /healthz names them; none when it does not answer."""
    try:
        health = client.get(f"{address}/healthz", timeout=PROBE_TIMEOUT_S)
    except httpx.HTTPError:
        return ()
    return wire_versions_named(health) if health.status_code == 200 else ()


def _detail(response: httpx.Response) -> str:
    """A refusal's problem document, cut short, to say why; nothing when the answer is not JSON."""
    return visible(response.text[:300]) if "json" in response.headers.get("content-type", "") else ""


def post_batch(client: httpx.Client, destination, our_instance: str, batch: bytes, version: int, secret: str) -> str:
    """Sends a batch in that wire version to the destination (a row of the query destinations), signed under
    the secret; returns its answer, as JSON text, once it is signed by the destination under the same secret as the
    answer to this request.  Raises TransportFailure."""
    address = destination.address
    media_type = wire.media_type(version)
    purpose = signing.request_purpose("POST", signing.BATCHES_PATH, media_type, str(destination.broker_instance))
    signed = signing.signed_headers(secret, our_instance, purpose, batch)
    try:
        response = client.post(f"{address}{signing.BATCHES_PATH}", content=batch,
                               headers={"Content-Type": media_type, **signed})
    except httpx.HTTPError as error:
        raise TransportFailure(f"cannot reach {address}: {type(error).__name__}: {error}") from error
    if response.status_code == 413:
        raise BatchTooLarge(f"{address} answered HTTP 413: a batch of {len(batch)} bytes is over its limit",
                            _problem_member(response, "limit_bytes"))
    if response.status_code == 415:
        theirs = wire_versions_named(response)
        takes = wire.in_words(theirs) if theirs else "a wire version it does not name"
        raise UnsupportedWireVersion(f"{address} speaks another wire version (HTTP 415): it takes {takes}, "
                                     f"this node sends {wire.in_words(wire.WIRE_VERSIONS)}", theirs)
    if response.status_code == 401:
        raise SignatureRefused(f"{address} answered HTTP 401 {_detail(response)}".strip())
    if response.status_code != 200:
        raise TransportFailure(f"{address} answered HTTP {response.status_code} {_detail(response)}".strip())
    try:
        signing.check_answer(secret, response.headers, signed[signing.SIGNATURE_HEADER],
                             response.content)
    except signing.BadSignature as error:
        raise TransportFailure(f"the answer from {address} is not signed by the peer as the answer "
                               f"to this batch: {error}") from error
    try:
        instance = response.json()["broker_instance"]
    except (ValueError, TypeError, KeyError):
        raise TransportFailure(f"{address} answered something other than a transport answer") from None
    if instance != str(destination.broker_instance):
        raise TransportFailure(f"{address} is broker instance {visible(str(instance))}, "
                               f"the route expects {destination.broker_instance}")
    return response.text
