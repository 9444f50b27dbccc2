"""The transport's pure parts, without a database: what a request and an answer are signed for and with, how a
batch's Content-Type names its wire version, passwords masked in what is shown, and a peer's words escaped."""
import hashlib
import hmac
import time

import httpx
import pytest

from broker.masking import mask_passwords, visible
from broker.transport import sending, signing, wire

SECRET = "shared-secret"
INSTANCE = "6f1c2a9e-5d2b-4c1e-9a0f-3b8e7d6c5a41"


def test_a_signature_is_hmac_sha256_over_timestamp_purpose_and_body_in_lower_case_hex():
    purpose = signing.request_purpose("POST", signing.BATCHES_PATH, wire.BATCH_MEDIA_TYPE, INSTANCE)
    assert purpose == f"POST /transport/v1/batches as application/vnd.pg-broker.batch; version=4 at {INSTANCE}"
    expected = hmac.new(SECRET.encode(), f"1700000000\n{purpose}\n".encode() + b"body", hashlib.sha256).hexdigest()
    assert signing.signature(SECRET, "1700000000", purpose, b"body") == expected == expected.lower()


def test_a_request_is_good_only_under_its_secret_for_its_purpose_and_body():
    purpose = signing.request_purpose("POST", signing.BATCHES_PATH, wire.BATCH_MEDIA_TYPE, INSTANCE)
    headers = signing.signed_headers(SECRET, INSTANCE, purpose, b"batch")
    timestamp, given = headers[signing.TIMESTAMP_HEADER], headers[signing.SIGNATURE_HEADER]
    assert headers[signing.INSTANCE_HEADER] == INSTANCE
    assert signing.matching_secret(["old", SECRET], timestamp, given, purpose, b"batch") == SECRET
    elsewhere = signing.request_purpose("POST", signing.BATCHES_PATH, wire.BATCH_MEDIA_TYPE, "another-node")
    for secrets, signed_for, body in ((["old"], purpose, b"batch"), ([SECRET], elsewhere, b"batch"),
                                      ([SECRET], purpose, b"other batch")):
        with pytest.raises(signing.BadSignature, match="does not match"):
            signing.matching_secret(secrets, timestamp, given, signed_for, body)


def test_an_answer_is_good_only_for_the_request_it_answers():
    headers = signing.answer_headers(SECRET, INSTANCE, "request-signature", b"{}")
    signing.check_answer(SECRET, headers, "request-signature", b"{}")
    with pytest.raises(signing.BadSignature):
        signing.check_answer(SECRET, headers, "another-request", b"{}")


@pytest.mark.parametrize("timestamp, signature, why", [
    (None, "abc", "not signed"), ("", "abc", "not signed"), ("1700000000", None, "not signed"),
    ("17e8", "abc", "not a number"), ("١٢٣", "abc", "not a number")])
def test_an_unsigned_or_oddly_stamped_request_is_refused_before_its_body(timestamp, signature, why):
    with pytest.raises(signing.BadSignature, match=why):
        signing.check_fresh(timestamp, signature, 300)


def test_a_request_stamped_too_far_from_this_clock_is_refused_to_a_tenth_of_a_second():
    signing.check_fresh(str(int(time.time()) - 100), "abc", 300)
    with pytest.raises(signing.BadSignature, match=r"is \d+\.\d s away .*\(at most 300 s allowed\)"):
        signing.check_fresh(str(int(time.time()) - 1000), "abc", 300)


@pytest.mark.parametrize("content_type, version, taken", [
    ("application/vnd.pg-broker.batch; version=4", "4", 4), ("Application/VND.pg-broker.batch;VERSION=\"3\"", "3", 3),
    ("application/vnd.pg-broker.batch; version=2", "2", None), ("application/vnd.pg-broker.batch; version=5", "5", None),
    ("application/vnd.pg-broker.batch; version=04", "04", None),
    ("application/json", "1", None), ("application/json; charset=utf-8", "1", None),
    ("application/vnd.pg-broker.batch", None, None), ("text/plain; version=3", None, None), (None, None, None),
    ("", None, None)])
def test_a_batch_names_its_wire_version_in_its_content_type(content_type, version, taken):
    assert wire.version_of(content_type) == version
    assert wire.taken_version(content_type) == taken


@pytest.mark.parametrize("theirs, sent", [((3, 4), 4), ((4,), 4), ((3,), 3), ((2, 3), 3), ((3, 4, 5), 4),
                                          ((2,), None), ((5,), None), ((), None)])
def test_a_peer_is_sent_the_highest_wire_version_both_take(theirs, sent):
    assert wire.version_for(theirs) == sent


def test_a_node_takes_its_own_wire_version_and_the_one_before_it():
    assert wire.WIRE_VERSIONS == (wire.WIRE_VERSION - 1, wire.WIRE_VERSION)


def test_a_refusal_says_what_a_batch_was_sent_as():
    assert wire.sent_as(None) == "no Content-Type"
    assert wire.sent_as("text/plain") == "'text/plain' (no wire version)"
    assert wire.sent_as("application/json") == "'application/json' (wire version 1)"


@pytest.mark.parametrize("text, shown", [
    ("postgresql://broker:s3cret@db:5432/broker", "postgresql://broker:***@db:5432/broker"),
    ("host=db password=s3cret user=broker", "host=db password=*** user=broker"),
    ("{'password': 's3cret'}", "{'password': '***'}"),
    ("postgresql://broker@db/broker", "postgresql://broker@db/broker")])
def test_passwords_are_masked_in_what_is_shown(text, shown):
    assert mask_passwords(text) == shown


def test_text_from_a_peer_or_a_procedure_is_recorded_and_logged_with_its_control_characters_escaped():
    """What a peer answers is recorded in PostgreSQL text (which takes no NUL) and logged, and what an activated
    procedure raises is logged (where a terminal's escapes or a line break would act): each control character is
    written as its escape."""
    answer = httpx.Response(500, headers={"content-type": "application/problem+json"},
                            text='{"detail": "a\x00b\x1b[2Jc\nforged line"}')
    assert sending._detail(answer) == '{"detail": "a\\x00b\\x1b[2Jc\\x0aforged line"}'
    assert visible("the procedure said: \x1b]0;title\x07\r\nWARNING forged") == \
        "the procedure said: \\x1b]0;title\\x07\\x0d\\x0aWARNING forged"
