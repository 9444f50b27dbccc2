"""Signing of node-to-node requests and responses: HMAC-SHA256 over a timestamp and the body.

Both directions are signed with the secret the two nodes share, so a relay
applies only acknowledgements that really come from its peer.  Replaying a
request within the allowed skew does no harm: the receiver discards
duplicates and acknowledges again.
"""
import hashlib
import hmac
import time

INSTANCE_HEADER = "X-Broker-Instance"
TIMESTAMP_HEADER = "X-Broker-Timestamp"
SIGNATURE_HEADER = "X-Broker-Signature"
MAX_CLOCK_SKEW_S = 300


def signature(secret: str, timestamp: str, body: bytes) -> str:
    return hmac.new(secret.encode(), timestamp.encode() + b"\n" + body, hashlib.sha256).hexdigest()


def signed_headers(secret: str, instance: str, body: bytes) -> dict[str, str]:
    timestamp = str(int(time.time()))
    return {INSTANCE_HEADER: instance, TIMESTAMP_HEADER: timestamp, SIGNATURE_HEADER: signature(secret, timestamp, body)}


class BadSignature(Exception):
    """Why a request or response was not accepted as signed by a known peer."""


def matching_secret(secrets: list[str], timestamp: str | None, given: str | None, body: bytes) -> str:
    """The secret under which the signature is good and fresh; raises BadSignature otherwise."""
    if not timestamp or not given:
        raise BadSignature("the message is not signed")
    try:
        skew = abs(time.time() - int(timestamp))
    except ValueError:
        raise BadSignature("the timestamp is not a number of seconds") from None
    if skew > MAX_CLOCK_SKEW_S:
        raise BadSignature(f"the timestamp is {skew:.0f} s away from this node's clock "
                           f"(at most {MAX_CLOCK_SKEW_S} s allowed)")
    for secret in secrets:
        if hmac.compare_digest(signature(secret, timestamp, body), given):
            return secret
    raise BadSignature("the signature does not match any secret shared with this node")
