"""The wire version: the format of a batch between nodes, named by its media type.

Version 1 was JSON (sent as application/json); version 2 was PostgreSQL's binary COPY format of
broker.transport_message rows, sent as BATCH_MEDIA_TYPE; version 3 adds each message's traceparent to
the row (broker.tracing).  A node takes batches of its own wire
version only and refuses any other from the request's headers (415, naming both versions), so two
nodes of different versions never read each other's batches as something they are not.  A request
is signed for its media type as well (broker.transport.signing), so a batch cannot be passed off as another
format.  /healthz names the version, for `broker diagnose` on a peer.
"""
import uuid

WIRE_VERSION = 3
BATCH_TYPE = "application/vnd.pg-broker.batch"
BATCH_MEDIA_TYPE = f"{BATCH_TYPE}; version={WIRE_VERSION}"
# What a describe request and every answer are: JSON.
JSON_MEDIA_TYPE = "application/json"


def version_of(content_type: str | None) -> str | None:
    """The wire version a batch's Content-Type names, or None when it names none: the version parameter
    of BATCH_TYPE, or 1 for JSON."""
    media_type, *parameters = (content_type or "").split(";")
    media_type = media_type.strip().lower()
    if media_type == JSON_MEDIA_TYPE:
        return "1"
    if media_type != BATCH_TYPE:
        return None
    for parameter in parameters:
        name, _, value = parameter.partition("=")
        if name.strip().lower() == "version":
            return value.strip().strip('"') or None
    return None


def is_ours(content_type: str | None) -> bool:
    return version_of(content_type) == str(WIRE_VERSION)


def sent_as(content_type: str | None) -> str:
    """What a batch was sent as, in words for a refusal."""
    if not content_type:
        return "no Content-Type"
    version = version_of(content_type)
    named = f"wire version {version}" if version else "no wire version"
    return f"{content_type[:100]!r} ({named})"


def first_conversation(batch: bytes) -> tuple[uuid.UUID, bool]:
    """The conversation id and sender_is_initiator of a batch's first row.  Binary COPY: a 19-byte header,
    then per row a 2-byte field count and each field as a 4-byte length and its bytes (a uuid has 16)."""
    return uuid.UUID(bytes=batch[25:41]), batch[45] == 1
