"""The sending side of a batch: one signed POST to the destination, and its answer accepted only when
the destination signed it as the answer to this very request and is the instance the route names."""
import httpx

from broker.transport import signing, wire


class TransportFailure(Exception):
    """A destination did not take a batch; the message says why, in words for transmission_status."""


class BatchTooLarge(TransportFailure):
    """The destination refused a batch as larger than it accepts; limit_bytes is its limit, when it said."""

    def __init__(self, reason: str, limit_bytes: int | None):
        super().__init__(reason)
        self.limit_bytes = limit_bytes


def _problem_member(response: httpx.Response, name: str) -> int | None:
    """A positive integer member of a problem answer (limit_bytes of a 413, wire_version of a 415), if it names
    a sane one."""
    try:
        value = response.json().get(name)
    except (ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def post_batch(client: httpx.Client, destination, our_instance: str, batch: bytes) -> str:
    """Sends a batch to the destination (a row of broker.queries.destinations); returns its answer, as JSON
    text, once it is signed by the destination as the answer to this request.  Raises TransportFailure."""
    address = destination.address
    purpose = signing.request_purpose("POST", signing.BATCHES_PATH, wire.BATCH_MEDIA_TYPE,
                                      str(destination.broker_instance))
    signed = signing.signed_headers(destination.peer_secret, our_instance, purpose, batch)
    try:
        response = client.post(f"{address}{signing.BATCHES_PATH}", content=batch,
                               headers={"Content-Type": wire.BATCH_MEDIA_TYPE, **signed})
    except httpx.HTTPError as error:
        raise TransportFailure(f"cannot reach {address}: {type(error).__name__}: {error}") from error
    if response.status_code == 413:
        raise BatchTooLarge(f"{address} answered HTTP 413: a batch of {len(batch)} bytes is over its limit",
                            _problem_member(response, "limit_bytes"))
    if response.status_code == 415:
        theirs = _problem_member(response, "wire_version")
        takes = f"wire version {theirs}" if theirs else "a wire version it does not name"
        raise TransportFailure(f"{address} speaks another wire version (HTTP 415): it takes {takes}, "
                               f"this node sends wire version {wire.WIRE_VERSION}")
    if response.status_code != 200:
        detail = response.text[:300] if "json" in response.headers.get("content-type", "") else ""
        raise TransportFailure(f"{address} answered HTTP {response.status_code} {detail}".strip())
    try:
        signing.check_answer(destination.peer_secret, response.headers, signed[signing.SIGNATURE_HEADER],
                             response.content)
    except signing.BadSignature as error:
        raise TransportFailure(f"the answer from {address} is not signed by the peer as the answer "
                               f"to this batch: {error}") from error
    try:
        instance = response.json()["broker_instance"]
    except (ValueError, TypeError, KeyError):
        raise TransportFailure(f"{address} answered something other than a transport answer") from None
    if instance != str(destination.broker_instance):
        raise TransportFailure(f"{address} is broker instance {instance}, "
                               f"the route expects {destination.broker_instance}")
    return response.text
