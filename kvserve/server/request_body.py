"""A request's body as the server and the router read it, before anything else: whole within ``BODY_SECONDS``, no
larger than the body limit, framed and coded as both can read. An answer given before the body is all read (a 401,
413, 408, or a framing or coding refused) closes the connection: uvicorn otherwise reads and drops what still
comes for as long as it comes, and a body trickled a byte a second kept its connection open past the 408."""

from __future__ import annotations

import asyncio
from http import HTTPStatus
from typing import TYPE_CHECKING

from starlette.datastructures import Headers

from kvserve.server.errors import CLOSE_CONNECTION, APIError

if TYPE_CHECKING:
    from starlette.types import Receive, Scope

BODY_SECONDS = 60.0  # a request body must have come whole within this long (a 4 MiB body at 0.6 Mbit/s)


async def read_body(scope: Scope, receive: Receive, limit: int) -> bytes | None:
    """The request's body, or None if the client left before all of it came; an ``APIError`` that closes the
    connection for a body over ``limit`` bytes (as soon as its declared length or what has come of it is over: the
    rest is not read), one not whole within ``BODY_SECONDS``, or one framed or coded as ``check_framing``
    refuses."""
    headers = Headers(raw=scope["headers"])
    check_framing(headers)
    too_large = APIError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"the request body is over the limit of {limit} bytes",
                         headers=CLOSE_CONNECTION)
    declared = headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    parts, size = [], 0
    try:
        async with asyncio.timeout(BODY_SECONDS):  # a body sent a byte at a time held its connection forever
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return None
                parts.append(message.get("body", b""))
                size += len(parts[-1])
                if size > limit:
                    raise too_large
                if not message.get("more_body", False):
                    return parts[0] if len(parts) == 1 else b"".join(parts)
    except TimeoutError:
        raise APIError(HTTPStatus.REQUEST_TIMEOUT, f"the request body did not come whole within {BODY_SECONDS:g} s",
                       headers=CLOSE_CONNECTION) from None


def check_framing(headers: Headers) -> None:
    """An ``APIError`` that closes the connection for a body whose end two headers would place differently (RFC
    9112 section 6.1: a proxy in front that frames by Content-Length would take the rest of a chunked body as a
    request of its own), or that is compressed (kvserve reads bodies as sent: a gzip body was "not valid UTF-8", a
    plain one labelled gzip served)."""
    if "content-length" in headers and "transfer-encoding" in headers:
        raise APIError(HTTPStatus.BAD_REQUEST, "a request with both Content-Length and Transfer-Encoding is "
                                               "ambiguous (RFC 9112 section 6.1): send one of them",
                       headers=CLOSE_CONNECTION)
    codings = [coding.strip().lower() for value in headers.getlist("content-encoding") for coding in value.split(",")]
    coded = [coding for coding in codings if coding not in ("", "identity")]  # a repeated header: one list
    if coded:
        raise APIError(HTTPStatus.UNSUPPORTED_MEDIA_TYPE, f"Content-Encoding {', '.join(coded)} is not supported: "
                                                          "send the body uncompressed", headers=CLOSE_CONNECTION)
