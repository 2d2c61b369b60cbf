"""The HTTP/1.1 protocol kvserve's server and router speak: uvicorn's h11 one, with a request h11 cannot parse
answered in OpenAI's error shape (uvicorn's is the plain text "Invalid HTTP request received."), and a lingering
close: a connection closed while the client may still be sending (a 413, 401 or 408 answered before the body was
read) is half-closed, what still comes read and dropped until the client closes or ``LINGER_SECONDS`` pass. Closed
at once with unread data in it, the socket sent a reset, which overtook the answer: a client sending a body over
the limit saw "connection reset", never the 413 (as nginx's and Apache's lingering close prevent)."""

from __future__ import annotations

import asyncio
import json
from typing import Any, Callable

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvserve.server.errors import error_body

LINGER_SECONDS = 2.0  # the longest a closed connection is read and dropped from before it is closed outright

MALFORMED = ("the request is not valid HTTP/1.1: a missing or repeated Host, Content-Length values that disagree, "
             "a malformed line or header, or a head over 16 KiB")


class LingeringTransport:
    """A connection's transport whose ``close``, while ``sending_body`` (the client is still sending a request's
    body), half-closes it and keeps reading (dropped by the protocol) until the client closes or ``LINGER_SECONDS``
    pass; an idle connection is closed at once (a shutdown waits for no idle client). Everything else is the
    transport's own."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop,
                 sending_body: Callable[[], bool]) -> None:
        self._transport = transport
        self._loop = loop
        self._sending_body = sending_body
        self.lingering = False
        self._deadline: asyncio.TimerHandle | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def is_closing(self) -> bool:
        return self.lingering or self._transport.is_closing()

    def close(self) -> None:
        if self.lingering or self._transport.is_closing():
            return
        if not self._sending_body():
            self._transport.close()
            return
        self.lingering = True
        try:
            if not self._transport.can_write_eof():  # TLS: no half-close
                raise OSError("no half-close")
            self._transport.write_eof()
            self._transport.resume_reading()  # flow control may have paused it: the rest must be read to be dropped
        except (OSError, RuntimeError):
            self._transport.close()
            return
        self._deadline = self._loop.call_later(LINGER_SECONDS, self._transport.close)

    def closed(self) -> None:
        """The connection is gone: no deadline left to keep."""
        if self._deadline is not None:
            self._deadline.cancel()


class JsonErrorH11Protocol(H11Protocol):
    """uvicorn's ``H11Protocol``, its transport's close a lingering one (``LingeringTransport``); its 400 for a request
    h11 refuses carries OpenAI's error JSON."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.transport = LingeringTransport(  # type: ignore[assignment]
            transport, self.loop, lambda: self.conn.their_state is h11.SEND_BODY)

    def data_received(self, data: bytes) -> None:
        if self.transport.lingering:  # type: ignore[attr-defined]
            return  # the rest of a request answered and closed: read so that closing sends no reset, and dropped
        super().data_received(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport.closed()  # type: ignore[attr-defined]
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        body = json.dumps(error_body(400, MALFORMED), separators=(",", ":")).encode()  # as the app's JSON
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body)),
                   (b"connection", b"close")]
        for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"), h11.Data(data=body),
                      h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()
