"""One message followed across two real nodes by its W3C traceparent: the spans each node exports
(BROKER_TRACING=console) and their parent links, and the traceparent as SQL, Python and REST carry it."""
import json
import subprocess
import sys
import uuid

import httpx
import pytest
from sqlalchemy import text
from sqlalchemy.exc import IntegrityError

import broker
from broker.errors import InvalidArgument
from tests.integration.test_transport import _batch, _encode, _post, _stored
from tests.nodes import wait_for
from tests.rest import new_key

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER = f"00-{TRACE_ID}-00f067aa0ba902b7-01"  # the span of the application that sends


def _spans(node) -> list[dict]:
    """The spans the node exported to its log (the console exporter writes one JSON object a line)."""
    return [json.loads(line) for line in node.log.read_text().splitlines() if line.startswith('{"name"')]


def _one(spans: list[dict], name: str) -> dict:
    named = [span for span in spans if span["name"] == name]
    assert len(named) == 1, f"{len(named)} spans named {name!r}: {named}"
    return named[0]


def _span_id(traceparent: str) -> str:
    return "0x" + traceparent.split("-")[2]


def _rest_send(node, handle, traceparent: str | None, message_type="order.note", body="a note") -> httpx.Response:
    headers = {"Authorization": f"Bearer {new_key(node.engine, 'send:shop')}"}
    if traceparent is not None:
        headers["traceparent"] = traceparent
    return httpx.post(f"{node.address}/v1/conversations/{handle}/messages", timeout=10, headers=headers,
                      json={"message_type": message_type, "body": body})


def _receiving(node) -> dict:
    return {"Authorization": f"Bearer {new_key(node.engine, 'receive:warehouse_queue')}"}


def _rest_receive(node) -> dict:
    answer = httpx.post(f"{node.address}/v1/queues/warehouse_queue/receive", timeout=10, json={"max_messages": 10},
                        headers=_receiving(node))
    assert answer.status_code == 200, answer.text
    return answer.json()


@pytest.mark.slow
def test_one_message_is_followed_from_the_send_through_each_attempt_to_the_far_receive_and_dead_letter(nodes):
    a, b = nodes
    for node in nodes:
        node.stop()
        node.env.update(BROKER_TRACING="console", OTEL_BSP_SCHEDULE_DELAY="100")  # spans exported within 0.1 s
    a.start()
    with a.engine.begin() as c:
        handle = broker.begin_dialog(c, "shop", "warehouse", "orders")

    sent = _rest_send(a, handle, CALLER)
    assert sent.status_code == 201, sent.text
    wait_for(lambda: "cannot reach" in a.log.read_text(), 30, "a transmission to fail while b is down")
    waiting = httpx.get(f"{a.address}/v1/conversations/{handle}/messages", timeout=10,
                        headers={"Authorization": f"Bearer {new_key(a.engine, 'send:shop')}"}).json()["messages"]
    b.start()
    wait_for(lambda: b.scalar("SELECT count(*) FROM broker.queue_messages") == 1, 60, "the message to arrive at b")
    lease = _rest_receive(b)
    received = lease["messages"]
    dead_lettered = httpx.post(f"{b.address}/v1/locks/{lease['lock_token']}/dead-letter", headers=_receiving(b),
                               json={"conversation_handle": received[0]["conversation_handle"],
                                     "reason": "cannot process it"}, timeout=10)
    assert dead_lettered.json() == {"dead_lettered": 1}, dead_lettered.text
    wait_for(lambda: any(span["name"] == "dead-letter warehouse_queue" for span in _spans(b)), 30,
             "the dead letter to be reported in its trace")
    (letter,) = httpx.get(f"{b.address}/v1/queues/warehouse_queue/dead-letters", headers=_receiving(b),
                          timeout=10).json()
    for node in nodes:
        node.stop()  # a node's spans are exported in the background, and flushed as it stops

    a_spans, b_spans = _spans(a), _spans(b)
    every_span = a_spans + b_spans
    assert {span["context"]["trace_id"] for span in every_span} == {f"0x{TRACE_ID}"}, "one trace"
    send = _one(a_spans, "send")
    assert send["parent_id"] == _span_id(CALLER) and send["kind"] == "SpanKind.PRODUCER"
    assert send["attributes"]["pg_broker.conversation_handle"] == str(handle)
    assert [m["traceparent"] for m in waiting] == [f"00-{TRACE_ID}-{send['context']['span_id'][2:]}-01"]

    attempts = sorted((span for span in a_spans if span["name"] == "transmit"), key=lambda span: span["start_time"])
    assert len(attempts) >= 2 and {span["parent_id"] for span in attempts} == {send["context"]["span_id"]}
    assert all(span["kind"] == "SpanKind.CLIENT" and span["attributes"]["server.address"] == b.address
               for span in attempts)
    assert [span["status"]["status_code"] for span in attempts] == ["ERROR"] * (len(attempts) - 1) + ["UNSET"]
    assert "cannot reach" in attempts[0]["status"]["description"]

    accept = _one(b_spans, "accept")
    assert accept["parent_id"] == attempts[-1]["context"]["span_id"], "the attempt that got through is accepted"
    assert accept["kind"] == "SpanKind.SERVER" and accept["attributes"]["pg_broker.peer"] == str(a.instance)
    receive = _one(b_spans, "receive warehouse_queue")
    assert receive["parent_id"] == accept["context"]["span_id"] and receive["kind"] == "SpanKind.CONSUMER"
    assert receive["attributes"]["messaging.batch.message_count"] == 1

    assert [m["traceparent"] for m in received] == [f"00-{TRACE_ID}-{accept['context']['span_id'][2:]}-01"]
    dead_letter = _one(b_spans, "dead-letter warehouse_queue")
    assert dead_letter["parent_id"] == accept["context"]["span_id"]
    assert dead_letter["status"] == {"status_code": "ERROR",
                                     "description": "dead-lettered by its reader: cannot process it"}
    assert dead_letter["attributes"]["pg_broker.message_sequence_numbers"] == [1]
    assert letter["traceparent"] == received[0]["traceparent"]


def test_without_tracing_a_traceparent_given_in_sql_reaches_the_far_receiver_as_it_was(nodes):
    a, b = nodes
    with a.engine.begin() as c:
        handle = broker.begin_dialog(c, "shop", "warehouse", "orders")
        c.execute(text("SELECT set_config('broker.traceparent', :traceparent, true)"), {"traceparent": CALLER})
        broker.send(c, handle, "order.note", "the library sends in the transaction's trace")
    with a.engine.begin() as c:
        c.execute(text("SELECT set_config('broker.traceparent', :traceparent, true)"), {"traceparent": CALLER})
        c.execute(text("SELECT broker.send(:handle, 'order.note', 'sent in SQL'::bytea)"), {"handle": handle})
        broker.send(c, handle, "order.note", "the library's own", traceparent=CALLER.replace("-01", "-00"))
        broker.send(c, handle, "order.note", "a trace given to the library is that send's only")

    received = wait_for(lambda: _rest_receive(b)["messages"] if b.scalar(
        "SELECT count(*) FROM broker.queue_messages") == 4 else None, 30, "the four messages")
    assert [m["traceparent"] for m in received] == [CALLER, CALLER, CALLER.replace("-01", "-00"), None]


def test_a_malformed_traceparent_is_refused_and_nothing_is_sent(shared_nodes):
    a, _ = shared_nodes
    with a.engine.begin() as c:
        handle = broker.begin_dialog(c, "shop", "warehouse", "orders")
    malformed = ["00-" + "0" * 32 + "-00f067aa0ba902b7-01", CALLER.upper(), CALLER + "-extra", "01" + CALLER[2:],
                 "not a traceparent", "00-\u00e9" + CALLER[4:]]
    for traceparent in malformed:
        with pytest.raises(InvalidArgument, match="not a W3C traceparent"), a.engine.begin() as c:
            broker.send(c, handle, "order.note", "x", traceparent=traceparent)
        with pytest.raises(IntegrityError, match="traceparent_is_w3c_version_00"), a.engine.begin() as c:
            c.execute(text("SELECT set_config('broker.traceparent', :traceparent, true)"), {"traceparent": traceparent})
            c.execute(text("SELECT broker.send(:handle, 'order.note', 'x'::bytea)"), {"handle": handle})
        if traceparent.isascii():  # HTTP headers are ASCII
            answer = _rest_send(a, handle, traceparent)
            assert answer.status_code == 400, answer.text
            assert answer.json()["type"] == "/problems/invalid-argument"
            assert "not a W3C traceparent" in answer.json()["detail"]
    assert a.scalar("SELECT count(*) FROM broker.transmission_queue_status") == 0
    assert a.scalar("SELECT send_sequence FROM broker.endpoints WHERE conversation_handle = :h", h=handle) == 0


@pytest.mark.parametrize("traceparent", [CALLER.upper(), "00-" + "0" * 32 + "-00f067aa0ba902b7-01", "<script>", ""])
def test_a_peer_batch_with_a_malformed_traceparent_is_refused_whole_and_nothing_is_stored(shared_nodes, traceparent):
    a, b = shared_nodes
    rows = [(*row, CALLER) for row in _batch(uuid.uuid4(), [1, 2])] + \
        [(*row, traceparent) for row in _batch(uuid.uuid4(), [1])]
    answer = _post(b, a, _encode(b, rows))
    assert answer.status_code == 400, answer.text
    assert answer.json()["type"] == "/problems/malformed-batch"
    assert "traceparent_is_w3c_version_00" in answer.json()["detail"]
    assert _stored(b) == [] and b.scalar("SELECT count(*) FROM broker.endpoints") == 0


APPLICATION = """
import json, sys
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from sqlalchemy import create_engine
import broker
from tests import factories

exported = InMemorySpanExporter()
provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(exported))
trace.set_tracer_provider(provider)
engine = create_engine(sys.argv[1])
with trace.get_tracer("app").start_as_current_span("handle a request"), engine.begin() as c:
    handle = factories.begin(c)
    broker.send(c, handle, "order.note", "one")
    broker.send_batch(c, [handle, handle], "order.note", ["two", "three"])
with engine.begin() as c:
    received = broker.receive(c, factories.WAREHOUSE_QUEUE, None)
print(json.dumps({"spans": [json.loads(span.to_json()) for span in exported.get_finished_spans()],
                  "received": [m.traceparent for m in received]}))
"""


def test_an_application_with_a_tracer_provider_sends_and_receives_in_its_current_trace(database_url, orders):
    """A local conversation in a process of its own with the OpenTelemetry SDK: the sends are children of the
    application's span, and the receive of the message's send."""
    ran = subprocess.run([sys.executable, "-c", APPLICATION, database_url], capture_output=True, text=True, timeout=60)
    assert ran.returncode == 0, ran.stderr
    spans, received = json.loads(ran.stdout)["spans"], json.loads(ran.stdout)["received"]
    request = _one(spans, "handle a request")
    sends = [span for span in spans if span["name"] == "send"]
    assert len(sends) == 2 and all(span["parent_id"] == request["context"]["span_id"] and
                                   span["kind"] == "SpanKind.PRODUCER" for span in sends)
    assert sends[1]["attributes"]["messaging.batch.message_count"] == 2
    trace_id = request["context"]["trace_id"][2:]
    assert {traceparent[-3:] for traceparent in received} <= {"-01", "-03"}  # sampled (and a random trace id)
    assert [traceparent[:-3] for traceparent in received] == [f"00-{trace_id}-{sends[0]['context']['span_id'][2:]}"] + \
        [f"00-{trace_id}-{sends[1]['context']['span_id'][2:]}"] * 2
    receives = sorted((span for span in spans if span["name"] == "receive warehouse_queue"),
                      key=lambda span: span["attributes"]["pg_broker.message_sequence_numbers"])
    assert [(span["parent_id"], span["attributes"]["pg_broker.message_sequence_numbers"]) for span in receives] == [
        (sends[0]["context"]["span_id"], [1]), (sends[1]["context"]["span_id"], [2, 3])]
