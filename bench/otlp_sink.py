"""An OTLP/HTTP endpoint in the benchmark's process that takes the nodes' spans, counts them and drops them:
the export costs the nodes what it would with a real collector."""
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest


class OtlpSink:
    def __init__(self):
        self.spans = 0
        self._lock = threading.Lock()
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                request = ExportTraceServiceRequest.FromString(self.rfile.read(int(self.headers["Content-Length"])))
                with sink._lock:
                    sink.spans += sum(len(scope.spans) for resource in request.resource_spans
                                      for scope in resource.scope_spans)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *_) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}/v1/traces"

    def __enter__(self) -> "OtlpSink":
        threading.Thread(target=self._server.serve_forever, name="otlp sink", daemon=True).start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._server.shutdown()
        self._server.server_close()
