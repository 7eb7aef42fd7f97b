"""Read timeouts for HTTP connections: a client that connects and stalls cannot hold a connection forever.

uvicorn closes a connection left idle between requests (its keep-alive timeout), but it waits without
limit for a request's headers and for the rest of its body, so a slowloris — many connections that send
half a request line, or a body a byte a minute — holds sockets and memory for as long as it likes. This
protocol (uvicorn's own httptools protocol plus two timers) closes such a connection:

- headers: from the connection's first byte of a request (or from the connection itself, for the first
  request) until its headers are complete, at most `header_timeout_s`; the client gets a 408;
- body: at most `body_idle_timeout_s` between two pieces of a request's body (an idle limit, not a total:
  a 100 MiB upload over a slow link is fine while it keeps moving). Time during which the server itself
  stopped reading (flow control: the app has not taken the body so far) does not count.

A connection closed mid-body looks to the app like any client disconnect (it stops reading the body and
answers no one).
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

_TIMEOUT_BODY = b"the request's headers did not arrive in time\n"
_REQUEST_TIMEOUT = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
    b"content-length: %d\r\n\r\n%s" % (len(_TIMEOUT_BODY), _TIMEOUT_BODY)
)


class _ReadTimeoutProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a header timeout and a body idle timeout (see the module)."""

    header_timeout_s: float
    body_idle_timeout_s: float

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._read_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm(self.header_timeout_s, self._on_header_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._read_timer is None:  # a later request on a kept-alive connection
            self._arm(self.header_timeout_s, self._on_header_timeout)

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()
        if self.cycle is not None and self.cycle.more_body:
            self._arm(self.body_idle_timeout_s, self._on_body_timeout)

    def on_body(self, body: bytes) -> None:
        super().on_body(body)
        self._arm(self.body_idle_timeout_s, self._on_body_timeout)

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()

    def _arm(self, delay_s: float, callback: Any) -> None:
        self._disarm()
        self._read_timer = self.loop.call_later(delay_s, callback)

    def _disarm(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _on_header_timeout(self) -> None:
        self._read_timer = None
        if not self.transport.is_closing():
            self.transport.write(_REQUEST_TIMEOUT)
            self.transport.close()

    def _on_body_timeout(self) -> None:
        self._read_timer = None
        if self.flow is not None and self.flow.read_paused:  # we stopped reading, not the client
            self._arm(self.body_idle_timeout_s, self._on_body_timeout)
        elif not self.transport.is_closing():
            self.transport.close()


def read_timeout_protocol(header_timeout_s: float, body_idle_timeout_s: float) -> type[HttpToolsProtocol]:
    """The protocol class to give uvicorn (`uvicorn.Config(http=...)`) for these timeouts."""
    return type(
        "ReadTimeoutProtocol",
        (_ReadTimeoutProtocol,),
        {"header_timeout_s": header_timeout_s, "body_idle_timeout_s": body_idle_timeout_s},
    )
