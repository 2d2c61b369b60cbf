"""The HTTP/1.1 protocol kvserve's server and router speak: uvicorn's h11 one, with a request h11 cannot parse
answered in OpenAI's error shape (uvicorn's is the plain text "Invalid HTTP request received.")."""

from __future__ import annotations

import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvserve.server.errors import error_body

MALFORMED = ("the request is not valid HTTP/1.1: a missing or repeated Host, Content-Length values that disagree, "
             "a malformed line or header, or a head over 16 KiB")


class JsonErrorH11Protocol(H11Protocol):
    """uvicorn's ``H11Protocol``; its 400 for a request h11 refuses carries OpenAI's error JSON."""

    def send_400_response(self, msg: str) -> None:
        body = json.dumps(error_body(400, MALFORMED), separators=(",", ":")).encode()  # as the app's JSON
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body)),
                   (b"connection", b"close")]
        for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"), h11.Data(data=body),
                      h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()
