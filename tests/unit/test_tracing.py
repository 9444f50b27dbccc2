"""Where a batch's traceparents lie, found without trusting the batch, and which traceparents are taken."""
import struct
import uuid

import pytest

from broker import tracing
from broker.errors import InvalidArgument

ONE = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
TWO = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"
HEADER = b"PGCOPY\n\xff\r\n\x00" + struct.pack(">ii", 0, 0)
TRAILER = struct.pack(">h", -1)


def _field(value: bytes | None) -> bytes:
    return struct.pack(">i", -1) if value is None else struct.pack(">i", len(value)) + value


def _row(traceparent: str | bytes | None, body: bytes = b"a body") -> bytes:
    """A row of broker.wire_message as PostgreSQL's binary COPY writes it: eleven fields, the last the
    traceparent."""
    if isinstance(traceparent, str):
        traceparent = traceparent.encode()
    fields = [uuid.uuid4().bytes, b"\x01", b"shop", b"warehouse", b"orders", None, struct.pack(">q", 1),
              uuid.uuid4().bytes, b"order.note", body, traceparent]
    return struct.pack(">h", len(fields)) + b"".join(map(_field, fields))


def test_each_traceparent_is_found_where_its_text_lies():
    batch = HEADER + _row(ONE) + _row(None) + _row(TWO) + _row(ONE, body=ONE.encode()) + TRAILER
    places = tracing.traceparent_places(batch)
    assert set(places) == {ONE, TWO} and len(places[ONE]) == 2 and len(places[TWO]) == 1
    for traceparent, offsets in places.items():
        assert all(batch[offset:offset + 55].decode() == traceparent for offset in offsets)
    assert batch.index(ONE.encode()) == places[ONE][0]  # a body that looks like one is not one


@pytest.mark.parametrize("batch", [
    HEADER + _row(ONE)[:-10],  # cut short
    HEADER[:10],
    b"",
    HEADER + struct.pack(">h", 0) + _row(ONE) + TRAILER,  # a row of no fields: nothing after it is read
    HEADER + struct.pack(">h", 10) + struct.pack(">i", 2**31 - 1) + TRAILER,  # a length past the end
], ids=["cut short", "header cut short", "empty", "a row of no fields", "a length past the end"])
def test_a_batch_that_is_not_such_rows_gives_no_places(batch):
    assert tracing.traceparent_places(batch) == {}


def test_a_last_field_of_the_length_but_not_a_traceparent_is_not_one():
    not_one = ONE.upper().encode()
    assert tracing.traceparent_places(HEADER + _row(not_one) + _row(b"\xff" * 55) + TRAILER) == {}


@pytest.mark.parametrize("traceparent", [ONE.upper(), "00-" + "0" * 32 + "-00f067aa0ba902b7-01",
                                         "00-4bf92f3577b34da6a3ce929d0e0e4736-" + "0" * 16 + "-01",
                                         "01" + ONE[2:], ONE + "-", ONE[:-1], "", "00-\u0663" + ONE[4:]])
def test_only_a_w3c_traceparent_of_version_00_is_taken(traceparent):
    with pytest.raises(InvalidArgument, match="not a W3C traceparent"):
        tracing.checked(traceparent)
    assert tracing.checked(ONE) == ONE and tracing.checked(None) is None
