"""Connections that must send their request in time and within bounds: a client that trickles its head (the request
line and headers) at any rate is disconnected within the head's deadline instead of holding a connection for as long
as it likes, and a head larger than MAX_HEAD_BYTES is refused before more of it is kept.  The body of a request let
in is timed by api.limits; a request not let in has no body read (api.admission, api.main.body_limit).

The protocol is uvicorn's on httptools (llhttp, in C): it reads a batch's body with a fifth less CPU than
uvicorn's pure-Python h11 one, and a small request in less time.  llhttp keeps a head whatever its size, so the
reads of a head still coming are counted here, and a head that came whole is measured once it has."""
import functools

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

# The most bytes a request's head may take, as uvicorn's h11 protocol bounded it (h11_max_incomplete_event_size).
MAX_HEAD_BYTES = 16 * 1024
HEAD_TOO_LARGE = f"the request's head (its request line and headers) is over {MAX_HEAD_BYTES} bytes"


class HeadersInTime(HttpToolsProtocol):
    """uvicorn's HTTP/1.1 protocol, closing a connection whose next request's head has not all come within
    timeout_s of the connection opening or of the last response: a deadline, not an idle timeout, so that
    trickling a byte now and then does not put it off.  A head that takes more than MAX_HEAD_BYTES is answered
    400 and the connection closed."""

    def __init__(self, *args, timeout_s: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.timeout_s = timeout_s
        self.head_pending = False  # a request's head has begun and not all come
        self.head_bytes = 0  # what the reads of that head brought
        self.head_too_large = False  # the parser was stopped at a head over MAX_HEAD_BYTES

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._expect_headers()

    def data_received(self, data: bytes) -> None:
        """The read goes to the parser; a read after which a head is still incomplete counts against
        MAX_HEAD_BYTES, unless a request's body came before that head in it (a pipelined request: its head then
        counts from the next read)."""
        pending_before = self.head_pending
        between_requests = self.cycle is None or self.cycle.response_complete
        super().data_received(data)
        if self.head_pending and not self.transport.is_closing() and (pending_before or between_requests):
            self.head_bytes += len(data)
            if self.head_bytes > MAX_HEAD_BYTES:
                self.send_400_response(HEAD_TOO_LARGE)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.head_pending = True

    def on_headers_complete(self) -> None:
        """A head that came whole, in one read or the last of several, is measured here: its request target and
        headers, each header line with its separator and line end.  One over MAX_HEAD_BYTES stops the parser, which
        uvicorn answers 400 (send_400_response)."""
        self.head_pending = False
        self.head_bytes = 0
        if len(self.url) + sum(len(name) + len(value) + 4 for name, value in self.headers) > MAX_HEAD_BYTES:
            self.head_too_large = True
            raise ValueError(HEAD_TOO_LARGE)
        super().on_headers_complete()

    def send_400_response(self, msg: str) -> None:
        super().send_400_response(HEAD_TOO_LARGE if self.head_too_large else msg)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._expect_headers()

    def _expect_headers(self) -> None:
        self.loop.call_later(self.timeout_s, self._close_if_still_waiting, self.cycle)

    def _close_if_still_waiting(self, cycle_then) -> None:
        """No request's head has come since: it is still coming, or nothing is."""
        if self.cycle is cycle_then and not self.transport.is_closing():
            self.transport.close()


def protocol(timeout_s: float):
    """The protocol to give uvicorn (its `http` setting)."""
    return functools.partial(HeadersInTime, timeout_s=timeout_s)
