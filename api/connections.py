"""Connections that must send their request in time: a client that trickles its head (the request line and
headers) at any rate is disconnected within the head's deadline instead of holding a connection for as long as it
likes.  The body of a request let in is timed by api.limits; a request not let in has no body read
(api.admission, api.main.body_limit)."""
import functools

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


class HeadersInTime(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, closing a connection whose next request's head has not all come within
    timeout_s of the connection opening or of the last response: a deadline, not an idle timeout, so that
    trickling a byte now and then does not put it off."""

    def __init__(self, *args, timeout_s: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.timeout_s = timeout_s

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._expect_headers()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._expect_headers()

    def _expect_headers(self) -> None:
        self.loop.call_later(self.timeout_s, self._close_if_still_waiting, self.cycle)

    def _close_if_still_waiting(self, cycle_then) -> None:
        """No request has begun since: the headers are still coming, or nothing is."""
        if self.cycle is cycle_then and self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


def protocol(timeout_s: float):
    """The protocol to give uvicorn (its `http` setting)."""
    return functools.partial(HeadersInTime, timeout_s=timeout_s)
