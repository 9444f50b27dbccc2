"""Following one message across nodes: its W3C traceparent, continued as OpenTelemetry spans.

A message carries the traceparent of the span that last handed it on (the column traceparent, set by the
setting broker.traceparent of the transaction that sends it).  Where OpenTelemetry is installed (the `tracing`
extra) and a process has a tracer provider, each stage continues the message's trace with a span of its own
and hands the message on under it:

    send (the sending application) -> transmit (the relay, one span per attempt) -> accept (the far node's
    transport endpoint, ended after its commit) -> receive (the receiving application)

A batch holds many messages: each trace in it gets one span, and the batch goes on with each message's
traceparent rewritten to its trace's span (a traceparent has a fixed length, so the batch is patched in place).
The SDK's sampler decides which spans are recorded; an unsampled trace is handed on all the same.  A node
(`broker serve`, `broker relay`) has a tracer provider when BROKER_TRACING names an exporter (configure());
an application has its own.  Without OpenTelemetry, or without a provider, nothing is parsed or made.
"""
import re
import struct
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from broker.errors import InvalidArgument

try:
    from opentelemetry import trace
    from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, StatusCode, TraceFlags
except ImportError:  # the tracing extra is not installed
    trace = None

TRACEPARENT = re.compile(r"00-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}")
TRACEPARENT_BYTES = 55
EXPORTERS = ("off", "console", "otlp")
# What every span of the broker says of itself (OpenTelemetry's messaging conventions).
SYSTEM = {"messaging.system": "pg-broker"}
_INT16, _INT32 = struct.Struct(">h").unpack_from, struct.Struct(">i").unpack_from
# The process's provider and its tracer, made once.
_tracer_of: tuple = (None, None)


def checked(traceparent: str | None) -> str | None:
    """The traceparent, when it is a W3C traceparent of version 00 (what the SQL domain broker.traceparent
    takes); raises InvalidArgument otherwise."""
    if traceparent is not None and not TRACEPARENT.fullmatch(traceparent):
        raise InvalidArgument(f"traceparent {traceparent[:80]!r} is not a W3C traceparent of version 00 "
                              "(00-<32 hex digits>-<16 hex digits>-<2 hex digits>, lower case, ids not all zero)",
                              "BR050")
    return traceparent


def _tracer():
    """The tracer of the process's provider, or None when there is none to record spans."""
    global _tracer_of
    if trace is None:
        return None
    provider = trace.get_tracer_provider()
    if isinstance(provider, (trace.ProxyTracerProvider, trace.NoOpTracerProvider)):
        return None
    if _tracer_of[0] is not provider:
        _tracer_of = (provider, provider.get_tracer("pg-broker"))
    return _tracer_of[1]


def _context(traceparent: str):
    """An OpenTelemetry context whose current span is the remote one the traceparent names."""
    _, trace_id, span_id, flags = traceparent.split("-")
    parent = SpanContext(int(trace_id, 16), int(span_id, 16), is_remote=True, trace_flags=TraceFlags(int(flags, 16)))
    return trace.set_span_in_context(NonRecordingSpan(parent))


def _traceparent(span) -> str | None:
    context = span.get_span_context()
    if not context.is_valid:
        return None
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"


def _ended(span, error: BaseException | None) -> None:
    if error is not None:
        span.set_status(StatusCode.ERROR, f"{type(error).__name__}: {error}"[:1000])
    span.end()


@contextmanager
def sending(traceparent: str | None, attributes: Mapping[str, Any]) -> Iterator[str | None]:
    """The traceparent that the messages sent inside take.  Where the process has a tracer provider, that of
    a send span, the child of the traceparent given or else of the current span; elsewhere the one given."""
    tracer = _tracer()
    if tracer is None:
        yield checked(traceparent)
        return
    parent = _context(checked(traceparent)) if traceparent is not None else None
    with tracer.start_as_current_span("send", context=parent, kind=SpanKind.PRODUCER,
                                      attributes={**SYSTEM, "messaging.operation.type": "send", **attributes}) as span:
        yield _traceparent(span)


def enabled() -> bool:
    """Whether this process records spans."""
    return _tracer() is not None


def _by_trace(rows: list) -> dict[str, list]:
    """The rows (each with a traceparent) of each trace among them, in their order."""
    by_trace: dict[str, list] = {}
    for row in rows:
        if row.traceparent is not None:
            by_trace.setdefault(row.traceparent, []).append(row)
    return by_trace


def _of_messages(rows: list) -> dict[str, Any]:
    """What a span of these messages (of one trace) says of them."""
    return {"messaging.batch.message_count": len(rows),
            "pg_broker.conversation_handles": sorted({str(row.conversation_handle) for row in rows}),
            "pg_broker.message_sequence_numbers": [row.message_sequence_number for row in rows]}


def received(queue: str, messages: list, started_ns: int) -> None:
    """Ends a receive span for each trace among the messages just received (each with a traceparent)."""
    tracer = _tracer()
    if tracer is None:
        return
    for traceparent, of_trace in _by_trace(messages).items():
        tracer.start_span(f"receive {queue}", context=_context(traceparent), kind=SpanKind.CONSUMER,
                          start_time=started_ns, attributes={
                              **SYSTEM, "messaging.operation.type": "receive", "messaging.destination.name": queue,
                              **_of_messages(of_trace)}).end()


def dead_lettered(letters: list) -> None:
    """A failed dead-letter span at each dead letter's time, for each trace and queue among the dead letters
    given (rows of the query traced_dead_letters_after), with the reason of its first."""
    tracer = _tracer()
    by_queue: dict[str, list] = {}
    for letter in letters:
        by_queue.setdefault(letter.queue_name, []).append(letter)
    for queue, of_queue in by_queue.items():
        for traceparent, of_trace in _by_trace(of_queue).items():
            at_ns = int(of_trace[0].dead_lettered_at.timestamp() * 1e9)
            span = tracer.start_span(f"dead-letter {queue}", context=_context(traceparent), start_time=at_ns,
                                     attributes={**SYSTEM, "messaging.destination.name": queue,
                                                 **_of_messages(of_trace)})
            span.set_status(StatusCode.ERROR, of_trace[0].reason[:1000])
            span.end(end_time=at_ns)


def traceparent_places(batch: bytes) -> dict[str, list[int]]:
    """Where each traceparent lies in a batch (PostgreSQL's binary COPY format of broker.wire_message rows,
    or of wire version 3's, whose last field is the traceparent): the offsets of its text, by traceparent.  Nothing is found
    past a row that is not such a row, nor in a batch cut short: the database refuses those."""
    places: dict[str, list[int]] = {}
    try:
        offset = 19 + _INT32(batch, 15)[0]  # signature, flags, header extension
        while (fields := _INT16(batch, offset)[0]) > 0:  # -1 ends the rows
            offset += 2
            for _ in range(fields):
                (length,) = _INT32(batch, offset)
                offset += 4 + (length if length > 0 else 0)
            if length == TRACEPARENT_BYTES:  # else NULL: a message without a trace
                traceparent = batch[offset - length:offset].decode("ascii", "replace")
                if TRACEPARENT.fullmatch(traceparent):  # else the database refuses the batch
                    places.setdefault(traceparent, []).append(offset - length)
    except struct.error:
        return {}
    return places


@contextmanager
def handed_on(batch: bytes, name: str, kind: str, attributes: Mapping[str, Any]) -> Iterator[bytes]:
    """A span for each trace of the batch, the child of its messages' traceparent, and the batch with those
    traceparents rewritten to the span's, to send or store; the spans end when the block does, failed when
    it raises.  kind: "client" (transmit) or "server" (accept)."""
    tracer = _tracer()
    places = traceparent_places(batch) if tracer is not None else {}
    if not places:
        yield batch
        return
    patched = bytearray(batch)
    spans = []
    start_ns = time.time_ns()
    for traceparent, offsets in places.items():
        span = tracer.start_span(name, context=_context(traceparent), kind=SpanKind[kind.upper()],
                                 start_time=start_ns,
                                 attributes={**SYSTEM, **attributes, "messaging.batch.message_count": len(offsets)})
        spans.append(span)
        handed = (_traceparent(span) or traceparent).encode()
        for offset in offsets:
            patched[offset:offset + TRACEPARENT_BYTES] = handed
    try:
        yield bytes(patched)
    finally:
        error = sys.exc_info()[1]
        for span in spans:
            _ended(span, error)


def configure(exporter: str, node: str) -> None:
    """Gives this process a tracer provider that exports the broker's spans: to OTLP (over HTTP, where the
    OTEL_EXPORTER_OTLP_* variables say; a collector on localhost:4318 by default) or to the console (stdout,
    one JSON object a span), batched in the background.  "off" does nothing."""
    if exporter == "off":
        return
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    if exporter == "otlp":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        span_exporter = OTLPSpanExporter()
    else:
        span_exporter = ConsoleSpanExporter(formatter=lambda span: span.to_json(indent=None) + "\n")
    provider = TracerProvider(resource=Resource.create({"service.name": "pg-broker", "pg_broker.node": node}))
    provider.add_span_processor(BatchSpanProcessor(span_exporter))
    trace.set_tracer_provider(provider)
