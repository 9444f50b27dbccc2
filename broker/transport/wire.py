"""The wire version: the format of a batch between nodes, named by its media type.

Version 1 was JSON (sent as application/json); version 2 was PostgreSQL's binary COPY format of message rows;
version 3 added each message's traceparent (broker.tracing); version 4 is the binary COPY format of
broker.wire_message rows, which add each message's id after its number, so that a receiver takes numbers past
what it holds only where the sender agrees on the message it holds last.  A node takes and sends its own wire
version and the one before it (WIRE_VERSIONS), so that a release talks to the previous one both ways: to each peer
it sends the highest version both take, which the peer's /healthz names (broker.relay), and a version 3 batch goes
without its message ids.  A batch of any other version is refused from the request's headers (415, naming the
versions this node takes), so two nodes never read each other's batches as something they are not.  A request is
signed for its media type as well (broker.transport.signing), so a batch cannot be passed off as another format.
See docs/reference/protocol.md.
"""
import struct
import uuid
from collections.abc import Iterable

WIRE_VERSION = 4
WIRE_VERSIONS = (3, 4)
BATCH_TYPE = "application/vnd.pg-broker.batch"
# What a describe request and every answer are: JSON.
JSON_MEDIA_TYPE = "application/json"


def media_type(version: int) -> str:
    """How a batch of that version is named, in its Content-Type and in what its request is signed for."""
    return f"{BATCH_TYPE}; version={version}"


BATCH_MEDIA_TYPE = media_type(WIRE_VERSION)


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


def taken_version(content_type: str | None) -> int | None:
    """The version of a batch sent as content_type, when this node takes it; else None."""
    version = version_of(content_type)
    return int(version) if version in {str(taken) for taken in WIRE_VERSIONS} else None


def version_for(theirs: Iterable[int]) -> int | None:
    """The version to send a peer that takes the versions theirs: the highest both take, or None."""
    shared = set(WIRE_VERSIONS) & set(theirs)
    return max(shared) if shared else None


def sent_as(content_type: str | None) -> str:
    """What a batch was sent as, in words for a refusal."""
    if not content_type:
        return "no Content-Type"
    version = version_of(content_type)
    named = f"wire version {version}" if version else "no wire version"
    return f"{content_type[:100]!r} ({named})"


def in_words(versions: Iterable[int]) -> str:
    """Versions as a refusal names them: "wire versions 3 and 4"."""
    versions = sorted(versions)
    if len(versions) == 1:
        return f"wire version {versions[0]}"
    return f"wire versions {', '.join(map(str, versions[:-1]))} and {versions[-1]}"


def first_conversation(batch: bytes) -> tuple[uuid.UUID, bool]:
    """The conversation id and sender_is_initiator of a batch's first row (in every version).  Binary COPY: a
    19-byte header, then per row a 2-byte field count and each field as a 4-byte length and its bytes (a uuid
    has 16)."""
    return uuid.UUID(bytes=batch[25:41]), batch[45] == 1


# A batch row's fixed-size start: its field count, then conversation_id (uuid) and sender_is_initiator (boolean),
# each after its length.  Four fields follow before sequence_number (from_service, to_service, contract and
# expires_at), and after it the rest of the row (from version 4 message_id, then message_type, body and
# traceparent).
ROW_START = 2 + (4 + 16) + (4 + 1)
_COUNT = struct.Struct(">h").unpack_from
_LENGTH = struct.Struct(">i").unpack_from
_NUMBER = struct.Struct(">q").unpack_from


def last_numbers(batch: bytes) -> dict[tuple[str, bool], int]:
    """The highest sequence number a batch (of any version) carries of each conversation side, by its
    conversation id (32 hex digits, as PostgreSQL takes a uuid) and sender_is_initiator: what an answer to the
    batch may settle.  Each row is read as far as its number; the rest of it (the body) is stepped over by its
    length."""
    numbers = {}
    offset = 19  # the header: signature, flags and header extension length
    while True:
        (fields,) = _COUNT(batch, offset)
        if fields == -1:  # the trailer
            return numbers
        side = (batch[offset + 6:offset + 22].hex(), batch[offset + 26] == 1)
        offset += ROW_START
        for _ in range(4):
            (length,) = _LENGTH(batch, offset)
            offset += 4 + max(length, 0)
        (number,) = _NUMBER(batch, offset + 4)
        offset += 12
        for _ in range(fields - 7):
            (length,) = _LENGTH(batch, offset)
            offset += 4 + max(length, 0)
        if numbers.get(side, 0) < number:
            numbers[side] = number
