"""A scripted peer: a real HTTP server standing in for another node, answering as a test likes, to play
a hostile, broken or other-version node that the product cannot be made to be."""
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass
from email.message import Message
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    headers: Message  # case-insensitive, as HTTP headers are
    body: bytes


def json_answer(status: int, document, headers: dict[str, str] | None = None,
                media_type: str = "application/json") -> tuple[int, dict[str, str], bytes]:
    return status, {"Content-Type": media_type, **(headers or {})}, json.dumps(document).encode()


class ScriptedPeer:
    """answer(request) returns the status, headers and body of each answer; every request is kept in
    requests.  Use it as a context manager, or close() it."""

    def __init__(self, answer: Callable[[Request], tuple[int, dict[str, str], bytes]]):
        self.requests: list[Request] = []
        requests = self.requests

        class Handler(BaseHTTPRequestHandler):
            def _handle(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                request = Request(self.command, self.path, self.headers, body)
                requests.append(request)
                status, headers, content = answer(request)
                self.send_response(status)
                for name, value in {"Content-Type": "application/json", **headers,
                                    "Content-Length": str(len(content))}.items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(content)

            do_GET = do_POST = _handle

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.address = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
