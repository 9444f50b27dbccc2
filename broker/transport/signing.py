"""Signing of node-to-node requests and answers: HMAC-SHA256 over a timestamp, what the message
is for, and the body.

A request is signed for its method, its endpoint, the media type of its body (for a batch, the
wire version: see broker.transport.wire) and the broker_instance of the node it goes to, so a request
captured on its way to one node is worth nothing at another node that shares the secret, or at
another endpoint, and its body cannot be passed off as another format.  An answer is signed as
the answer to one request (its signature), so an answer cannot be passed off for another
request.  Both directions use the secret the two nodes share.  Replaying a request within the
allowed skew does no harm: the receiver discards duplicates and acknowledges again.

Only a request's timestamp is held to the allowed clock skew (BROKER_MAX_CLOCK_SKEW_S), once, before its
body is read.  An answer's is not: the answer is signed for one request, whose signature covers that
request's own timestamp, so an old answer is worth nothing for another request, and whatever a node accepted
and committed is acknowledged, however far the two clocks are apart.
"""
import hashlib
import hmac
import time

INSTANCE_HEADER = "X-Broker-Instance"
TIMESTAMP_HEADER = "X-Broker-Timestamp"
SIGNATURE_HEADER = "X-Broker-Signature"
DEFAULT_MAX_CLOCK_SKEW_S = 300

# The transport's endpoints, as their requests are signed (whatever path prefix a route's address has).
BATCHES_PATH = "/transport/v1/batches"
DESCRIBE_PATH = "/transport/v1/describe"


def request_purpose(method: str, path: str, media_type: str, destination_instance: str) -> str:
    """What a request is for: its method, endpoint, the media type of its body and the broker_instance of
    the node it is sent to."""
    return f"{method} {path} as {media_type} at {destination_instance}"


def answer_purpose(request_signature: str) -> str:
    """What an answer is for: the request it answers, named by that request's signature."""
    return f"answer to {request_signature}"


def signature(secret: str, timestamp: str, purpose: str, body: bytes) -> str:
    return hmac.new(secret.encode(), f"{timestamp}\n{purpose}\n".encode() + body, hashlib.sha256).hexdigest()


def signed_headers(secret: str, instance: str, purpose: str, body: bytes) -> dict[str, str]:
    timestamp = str(int(time.time()))
    return {INSTANCE_HEADER: instance, TIMESTAMP_HEADER: timestamp,
            SIGNATURE_HEADER: signature(secret, timestamp, purpose, body)}


def answer_headers(secret: str, instance: str, request_signature: str, answer: bytes) -> dict[str, str]:
    """The headers that sign an answer as the answer to the request of that signature."""
    return signed_headers(secret, instance, answer_purpose(request_signature), answer)


class BadSignature(Exception):
    """Why a request or answer was not accepted as signed by a known peer."""


def _check_signed(timestamp: str | None, given: str | None) -> None:
    if not timestamp or not given:
        raise BadSignature("the message is not signed")
    if not timestamp.isascii() or not timestamp.isdigit():
        raise BadSignature("the timestamp is not a number of seconds")


def check_fresh(timestamp: str | None, given: str | None, max_skew_s: float) -> None:
    """Raises BadSignature unless a request is signed with a timestamp within max_skew_s of this node's clock:
    what can be known of a request before its body has come.  The skew is given to a tenth of a second, so that
    one just past the limit never reads as the limit."""
    _check_signed(timestamp, given)
    skew = abs(time.time() - int(timestamp))
    if skew > max_skew_s:
        raise BadSignature(f"the timestamp is {skew:.1f} s away from this node's clock "
                           f"(at most {max_skew_s:g} s allowed)")


def matching_secret(secrets: list[str], timestamp: str | None, given: str | None, purpose: str, body: bytes) -> str:
    """The secret under which the signature is good and for this purpose; raises BadSignature otherwise."""
    _check_signed(timestamp, given)
    for secret in secrets:
        if hmac.compare_digest(signature(secret, timestamp, purpose, body).encode(), given.encode()):
            return secret
    raise BadSignature("the signature does not match any secret shared with this node")


def check_answer(secret: str, headers, request_signature: str, answer: bytes) -> None:
    """Raises BadSignature unless the answer is signed with the secret as the answer to the request of that
    signature."""
    matching_secret([secret], headers.get(TIMESTAMP_HEADER), headers.get(SIGNATURE_HEADER),
                    answer_purpose(request_signature), answer)
