"""Pure functions of the relay and the transport: lanes, backoff, batch budgets, signing and the wire
version, checked without a database."""
import time
import uuid

import pytest

from broker.relay import backoff_s, lane_bounds, lane_digits, smaller_batch_bytes
from broker.transport import signing, wire


@pytest.mark.parametrize("lanes", [1, 2, 3, 4, 7, 16])
def test_lanes_cover_the_handle_space_once(lanes):
    bounds = [lane_bounds(lane, lanes) for lane in range(lanes)]
    assert bounds[0][0] == 0 and bounds[-1][1] == 2**128 - 1
    assert all(last + 1 == next_first for (_, last), (next_first, _) in zip(bounds, bounds[1:]))
    assert all(first <= last for first, last in bounds)


@pytest.mark.parametrize("lanes", [1, 2, 3, 4, 7, 16])
def test_a_handle_wakes_the_lane_it_belongs_to(lanes):
    for _ in range(200):
        handle = uuid.uuid4()
        owner = next(lane for lane in range(lanes) if lane_bounds(lane, lanes)[0] <= handle.int <= lane_bounds(lane, lanes)[1])
        assert str(handle)[0] in lane_digits(owner, lanes)


def test_backoff_doubles_to_a_minute_with_jitter():
    for failures, full in [(1, 1.0), (2, 2.0), (3, 4.0), (7, 60.0), (100, 60.0)]:
        waits = [backoff_s(failures) for _ in range(200)]
        assert all(full / 2 <= wait <= full for wait in waits)
        assert len(set(waits)) > 1


def test_a_refused_batch_shrinks_within_the_named_limit_or_by_half():
    assert smaller_batch_bytes(8_000_000, 1_048_576) == 1_048_576 - 65_536
    assert smaller_batch_bytes(8_000_000, None) == 4_000_000
    assert smaller_batch_bytes(8_000_000, 9_000_000) == 4_000_000  # a limit above what was refused says nothing


def test_a_signature_holds_for_its_purpose_and_body_only():
    purpose = signing.request_purpose("POST", signing.BATCHES_PATH, wire.BATCH_MEDIA_TYPE, "instance-b")
    headers = signing.signed_headers("secret", "instance-a", purpose, b"batch")
    timestamp, given = headers[signing.TIMESTAMP_HEADER], headers[signing.SIGNATURE_HEADER]
    assert signing.matching_secret(["other", "secret"], timestamp, given, purpose, b"batch") == "secret"
    for secrets, signed_for, body in [(["other"], purpose, b"batch"), (["secret"], purpose, b"batch!"),
                                      (["secret"], purpose.replace("instance-b", "instance-c"), b"batch")]:
        with pytest.raises(signing.BadSignature):
            signing.matching_secret(secrets, timestamp, given, signed_for, body)


def test_an_answer_is_good_only_for_the_request_it_answers_however_old_its_timestamp():
    """The answer is bound to its request, not to a time: what the far node committed is acknowledged whatever
    the two clocks say (the request was held to the skew where it arrived)."""
    stale = str(int(time.time()) - 10 * signing.DEFAULT_MAX_CLOCK_SKEW_S)
    purpose = signing.answer_purpose("request-signature")
    headers = {signing.TIMESTAMP_HEADER: stale, signing.SIGNATURE_HEADER: signing.signature("secret", stale, purpose,
                                                                                            b"answer")}
    signing.check_answer("secret", headers, "request-signature", b"answer")
    for secret, request, answer in [("other", "request-signature", b"answer"), ("secret", "another-request", b"answer"),
                                    ("secret", "request-signature", b"answer!")]:
        with pytest.raises(signing.BadSignature):
            signing.check_answer(secret, headers, request, answer)


@pytest.mark.parametrize("timestamp, why", [
    (None, "not signed"), ("12a", "not a number"), ("-5", "not a number"), ("١٢٣", "not a number"),
    (-65, r"is 6\d\.\d s away from this node's clock \(at most 60 s allowed\)"),
    (+65, r"is 6\d\.\d s away from this node's clock \(at most 60 s allowed\)")])
def test_a_stale_or_unsigned_request_is_refused_before_its_body(timestamp, why):
    """timestamp: the header as sent, or how many seconds from now it is."""
    if isinstance(timestamp, int):
        timestamp = str(int(time.time()) + timestamp)
    with pytest.raises(signing.BadSignature, match=why):
        signing.check_fresh(timestamp, "signature", 60)
