"""A client's ``X-Request-Id``: sent back on every answer to the request, errors included, as vLLM's server does,
so that a client's, a router's and a replica's logs name the same request. The server also makes a completion's
``id`` of it; the router relays a replica's answer, which carries it already."""

from __future__ import annotations

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import Message, Scope, Send

REQUEST_ID_HEADER = "X-Request-Id"


def client_request_id(scope: Scope) -> str | None:
    """The request's ``X-Request-Id`` header (None: none, or empty)."""
    return Headers(scope=scope).get(REQUEST_ID_HEADER) or None


def echoing_request_id(scope: Scope, send: Send) -> Send:
    """``send`` adding the request's X-Request-Id (if it sent one) to the response's headers, unless the response
    has one already (a replica's answer relayed)."""
    request_id = client_request_id(scope)
    if request_id is None:
        return send

    async def echoing(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = MutableHeaders(scope=message)
            if REQUEST_ID_HEADER not in headers:
                headers.append(REQUEST_ID_HEADER, request_id)
        await send(message)

    return echoing
