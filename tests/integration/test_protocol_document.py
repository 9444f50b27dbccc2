"""docs/reference/protocol.md is what the code does: its worked example's batch is PostgreSQL's binary COPY of the row it
states, its signed strings and signatures are broker.transport.signing's, and a real `broker serve` with the
example's instance, catalog and secret accepts the batch and answers it, the same batch again, a batch that
disagrees with what it holds, and a describe request, byte for byte as the document shows.  The document names
every header, endpoint and problem type of the transport."""
import io
import re
from pathlib import Path
from uuid import UUID

import httpx
from sqlalchemy import create_engine, text

import broker
from broker.settings import Settings
from broker.transport import signing, wire
from tests.nodes import Node, define_node

ROOT = Path(__file__).resolve().parents[2]
DOCUMENT = (ROOT / "docs" / "reference" / "protocol.md").read_text()


def example(name: str) -> str:
    """The fenced block that follows <!-- example: name -->."""
    found = re.search(rf"<!-- example: {name} -->\n```[^\n]*\n(.*?)```", DOCUMENT, re.DOTALL)
    assert found, f"docs/reference/protocol.md has no example block {name!r}"
    return found.group(1)


def http_head(name: str) -> tuple[str, dict[str, str]]:
    """The first line and the headers of an example block of HTTP."""
    first, *lines = example(name).strip().splitlines()
    return first, dict(line.split(": ", 1) for line in lines)


def signed_text(name: str) -> str:
    """An example of the text before the signed body, with its \\n written out."""
    return example(name).strip().replace("\\n", "\n")


def stated_fields() -> list[tuple[str, str, str | None]]:
    """The example's row, from the table after <!-- example: fields -->: (field, type, value; None for NULL)."""
    table = re.search(r"<!-- example: fields -->\n((?:\|.*\n)+)", DOCUMENT).group(1)
    rows = []
    for line in table.splitlines()[2:]:
        field, type_, value = (re.findall(r"`([^`]*)`", cell) for cell in line.strip().strip("|").split("|"))
        rows.append((field[0], type_[0], value[0] if value else None))
    return rows


SECRET = example("secret").strip()
BATCH = bytes.fromhex(" ".join(line.partition("#")[0] for line in example("batch").splitlines()))
REQUEST_LINE, REQUEST = http_head("request")
ANSWER_LINE, ANSWER_HEADERS = http_head("answer-headers")
ANSWER = example("answer").strip().encode()
SENDER, DESTINATION = REQUEST[signing.INSTANCE_HEADER], ANSWER_HEADERS[signing.INSTANCE_HEADER]
PURPOSE = signing.request_purpose("POST", signing.BATCHES_PATH, wire.BATCH_MEDIA_TYPE, DESTINATION)


def test_the_batch_is_the_binary_copy_of_the_row_it_states(rolled_back):
    fields = stated_fields()
    columns = rolled_back.execute(text(
        "SELECT attname, format_type(atttypid, atttypmod) FROM pg_attribute"
        " WHERE attrelid = 'broker.wire_message'::regclass AND attnum > 0 AND NOT attisdropped"
        " ORDER BY attnum")).all()
    assert [tuple(column) for column in columns] == [(field, type_) for field, type_, _ in fields]
    as_text = ", ".join("convert_from(body, 'UTF8')" if field == "body" else f"{field}::text" for field, _, _ in fields)
    with rolled_back.connection.cursor() as cursor:
        cursor.execute("CREATE TEMPORARY TABLE example_batch OF broker.wire_message")
        cursor.copy_expert("COPY example_batch FROM STDIN (FORMAT binary)", io.BytesIO(BATCH))
        cursor.execute(f"SELECT {as_text} FROM example_batch")
        assert cursor.fetchall() == [tuple(value for _, _, value in fields)]
        written = io.BytesIO()  # and the row written as a relay's database writes it is the same bytes
        cursor.copy_expert("COPY example_batch TO STDOUT (FORMAT binary)", written)
    assert written.getvalue() == BATCH


def test_the_signed_strings_and_signatures_are_those_of_the_code():
    method, path, _ = REQUEST_LINE.split()
    assert method == "POST" and path.endswith(signing.BATCHES_PATH) and path != signing.BATCHES_PATH  # a prefix
    assert REQUEST["Content-Type"] == wire.BATCH_MEDIA_TYPE and int(REQUEST["Content-Length"]) == len(BATCH)
    timestamp, request_signature = REQUEST[signing.TIMESTAMP_HEADER], REQUEST[signing.SIGNATURE_HEADER]
    assert signed_text("signed") == f"{timestamp}\n{PURPOSE}\n"
    assert request_signature == signing.signature(SECRET, timestamp, PURPOSE, BATCH)

    assert ANSWER_LINE == "HTTP/1.1 200 OK" and ANSWER_HEADERS["Content-Type"] == wire.JSON_MEDIA_TYPE
    assert int(ANSWER_HEADERS["Content-Length"]) == len(ANSWER)
    answered_at = ANSWER_HEADERS[signing.TIMESTAMP_HEADER]
    assert signed_text("answer-signed") == f"{answered_at}\n{signing.answer_purpose(request_signature)}\n"
    assert ANSWER_HEADERS[signing.SIGNATURE_HEADER] == signing.signature(
        SECRET, answered_at, signing.answer_purpose(request_signature), ANSWER)


def test_a_node_takes_the_batch_and_answers_what_the_document_shows(database_url, tmp_path):
    engine = create_engine(database_url)
    with engine.begin() as c:  # the receiving node is the example's warehouse
        c.execute(text("UPDATE broker.node SET broker_instance = :instance"), {"instance": DESTINATION})
    engine.dispose()
    node = Node("warehouse", database_url, tmp_path)
    define_node(node, "warehouse_queue", "warehouse")
    with node.engine.begin() as c:
        broker.create_route(c, "shop", "http://127.0.0.1:9", UUID(SENDER), SECRET)
    node.start()
    try:
        sent = signing.signed_headers(SECRET, SENDER, PURPOSE, BATCH)  # now: the stated timestamp is long past
        answer = httpx.post(f"{node.address}{signing.BATCHES_PATH}", content=BATCH, timeout=30,
                            headers={"Content-Type": REQUEST["Content-Type"], **sent})
        assert answer.status_code == 200, answer.text
        assert answer.content == ANSWER
        assert answer.headers["Content-Type"] == wire.JSON_MEDIA_TYPE
        assert answer.headers[signing.INSTANCE_HEADER] == DESTINATION
        signing.check_answer(SECRET, answer.headers, sent[signing.SIGNATURE_HEADER], answer.content)
        assert node.scalar("SELECT convert_from(body, 'UTF8') || ' ' || traceparent FROM broker.queue_messages") \
            == f"hello {stated_fields()[-1][2]}"

        again = _post(node, BATCH).text
        assert again.startswith('{"results": [' + example("answer-again").strip() + "]")
        disagreeing = _batch_of(node, [(1, "a new message 1"), (2, "and 2")])
        assert _post(node, disagreeing).text == again
        assert node.scalar("SELECT count(*) FROM broker.queue_messages") == 1

        asked = example("describe-request").strip().encode()
        purpose = signing.request_purpose("POST", signing.DESCRIBE_PATH, wire.JSON_MEDIA_TYPE, DESTINATION)
        described = httpx.post(f"{node.address}{signing.DESCRIBE_PATH}", content=asked, timeout=30,
                               headers={"Content-Type": wire.JSON_MEDIA_TYPE,
                                        **signing.signed_headers(SECRET, SENDER, purpose, asked)})
        assert described.status_code == 200, described.text
        assert described.content == example("describe-answer").strip().encode()
    finally:
        node.stop()
        node.engine.dispose()


def _post(node, batch: bytes) -> httpx.Response:
    """The batch, posted to the node as shop signs it now."""
    return httpx.post(f"{node.address}{signing.BATCHES_PATH}", content=batch, timeout=30,
                      headers={"Content-Type": REQUEST["Content-Type"],
                               **signing.signed_headers(SECRET, SENDER, PURPOSE, batch)})


def _batch_of(node, messages: list[tuple[int, str]]) -> bytes:
    """The example's row, once per (sequence_number, body), each with a message id of its own, as a batch."""
    fields = {field: value for field, _, value in stated_fields()}
    with node.engine.raw_connection().cursor() as cursor:
        cursor.execute("CREATE TEMPORARY TABLE disagreeing OF broker.wire_message")
        for number, body in messages:
            cursor.execute("INSERT INTO disagreeing VALUES (%s, true, %s, %s, %s, NULL, %s, gen_random_uuid(), %s,"
                           " convert_to(%s, 'UTF8'), %s)",
                           (fields["conversation_id"], fields["from_service"], fields["to_service"],
                            fields["contract"], number, fields["message_type"], body, fields["traceparent"]))
        written = io.BytesIO()
        cursor.copy_expert("COPY disagreeing TO STDOUT (FORMAT binary)", written)
        cursor.connection.rollback()
    return written.getvalue()


def test_the_document_names_every_header_endpoint_and_problem_type_of_the_transport():
    for named in (signing.INSTANCE_HEADER, signing.TIMESTAMP_HEADER, signing.SIGNATURE_HEADER, signing.BATCHES_PATH,
                  signing.DESCRIBE_PATH, wire.BATCH_MEDIA_TYPE, "BROKER_MAX_CLOCK_SKEW_S", "BROKER_MAX_BATCH_BYTES",
                  f"default {signing.DEFAULT_MAX_CLOCK_SKEW_S} s", str(Settings.model_fields["max_batch_bytes"].default)):
        assert named in DOCUMENT, named
    sources = "".join((ROOT / "api" / name).read_text()
                      for name in ("admission.py", "limits.py", "problems.py", "routes/transport.py"))
    kinds = set(re.findall(r'problem\(\s*\d{3},\s*"([a-z-]+)"', sources))
    kinds |= set(re.findall(r'_answer\(request, "([a-z-]+)"', sources))
    kinds -= {"unauthorized", "invalid-request"}  # an API key, a JSON request body: /v1 and /metrics only
    assert {"unknown-peer", "bad-signature", "too-large", "malformed-batch"} <= kinds
    for kind in kinds | {"http-error"}:  # http-error: api.main, a path or method not served
        assert f"/problems/{kind}" in DOCUMENT, kind
