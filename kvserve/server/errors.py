"""Errors in OpenAI's JSON shape: ``{"error": {"message", "type", "param", "code"}}``, or on the routes of
Anthropic's API (``ANTHROPIC_PATHS``) in Anthropic's: ``{"type": "error", "error": {"type", "message"}}``, which
its SDK reads.

Every invalid request is a 400 (FastAPI's 422 validation errors included); nothing about bad input is a 500.
The router imports this module for the shape alone, so FastAPI is imported only where the handlers are
installed (the router starts without FastAPI and the request models).
"""

from __future__ import annotations

import hashlib
import json
import secrets
from http import HTTPStatus
from typing import TYPE_CHECKING, Any, Iterable, Sequence

from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse

if TYPE_CHECKING:
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError


RETRY_AFTER_SECONDS = 1
# What a 503 of a server that will serve again soon (loading, overloaded, no replica up) asks a client to wait
RETRY_LATER = {"Retry-After": str(RETRY_AFTER_SECONDS)}

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",  # the client's body came too slowly
    413: "invalid_request_error",
    415: "invalid_request_error",  # a body coded as kvserve cannot read
    503: "service_unavailable",
}


# Anthropic's error types by status (https://docs.anthropic.com/en/api/errors); any other status is an api_error
_ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
}
# the routes that speak Anthropic's API: their errors, the server's and the router's alike, take its shape
ANTHROPIC_PATHS = frozenset({"/v1/messages", "/v1/messages/count_tokens"})


# on an answer given before the request's body was read: uvicorn otherwise reads and drops the rest of the body for
# as long as it comes (``server/request_body.py``)
CLOSE_CONNECTION = {"Connection": "close"}


class APIError(Exception):
    """An error to answer with: raised anywhere in a handler, turned into an OpenAI-shaped JSON response."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers


def error_body(status: int, message: str, param: str | None = None, path: str = "") -> dict[str, Any]:
    """An error's JSON in the shape of the API ``path`` belongs to (Anthropic's names no parameter: its messages
    do)."""
    if path in ANTHROPIC_PATHS:
        return {"type": "error", "error": {"type": _ANTHROPIC_ERROR_TYPES.get(status, "api_error"), "message": message}}
    return {"error": {"message": message, "type": _ERROR_TYPES.get(status, "server_error"), "param": param,
                      "code": status}}


def sse_failure(status: int, message: str, path: str = "") -> str:
    """The events that end a stream which failed midway: an error in OpenAI's shape, then ``[DONE]``; on
    Anthropic's routes its ``error`` event (its streams end with no ``[DONE]``). The status went out as 200 with
    the first event, so this is how a client reading the stream learns why it ended there (as vLLM's streams do)."""
    data = json.dumps(error_body(status, message, path=path))
    if path in ANTHROPIC_PATHS:
        return f"event: error\ndata: {data}\n\n"
    return f"data: {data}\n\ndata: [DONE]\n\n"


def error_response(status: int, message: str, param: str | None = None,
                   headers: dict[str, str] | None = None, path: str = "") -> JSONResponse:
    """The error's answer, in the shape of the API ``path`` (the request's) belongs to."""
    return JSONResponse(error_body(status, message, param, path), status_code=status, headers=headers)


def bad_request(error: ValueError, param: str | None = None) -> APIError:
    """A 400 for ``error``, about ``param`` or else the parameter the error names (``InvalidParameter``)."""
    return APIError(HTTPStatus.BAD_REQUEST, str(error), param=param or getattr(error, "param", None))


# what a 404 lists: the OpenAI routes and vLLM's kvserve answers
SERVED_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages",
                 "/v1/messages/count_tokens", "/v1/embeddings", "/pooling", "/score", "/v1/score", "/rerank",
                 "/v1/rerank", "/v2/rerank", "/v1/models", "/tokenize", "/detokenize", "/invocations", "/health",
                 "/ping", "/metrics", "/version")
# the paths ``--api-key`` guards, on a server and on the router alike (/health and /metrics stay open). vLLM leaves
# the rest open; kvserve guards the pooling endpoints, SageMaker's /invocations (it generates) and the development
# and profiling endpoints (they empty the cache, put the engine to sleep, record every request)
PROTECTED_PREFIXES = ("/v1/", "/v2/", "/tokenize", "/detokenize", "/pooling", "/score", "/rerank", "/invocations",
                      "/reset_prefix_cache", "/sleep", "/wake_up", "/is_sleeping", "/start_profile", "/stop_profile")


def unauthorized(headers: Iterable[tuple[bytes, bytes]], keys: Sequence[str]) -> APIError | None:
    """The 401 for a request that brings none of ``keys``, neither as ``Authorization: Bearer`` (the scheme in any
    case, RFC 9110) nor as ``X-Api-Key`` (Anthropic's clients send it there), or None; each key the request
    brings compared with each of ``keys`` by its digest, in constant time and whatever its length, every pair
    compared. The server and the router answer alike."""
    headers = list(headers)
    authorization = next((value for name, value in headers if name == b"authorization"), b"")
    scheme, _, token = authorization.partition(b" ")
    brought = [token.strip() if scheme.lower() == b"bearer" else b"",
               next((value for name, value in headers if name == b"x-api-key"), b"").strip()]
    digests = [hashlib.sha256(key.encode()).digest() for key in keys]
    # no key is empty (``environment.check_api_keys``), so a header not sent matches none
    matches = [secrets.compare_digest(hashlib.sha256(given).digest(), digest)
               for given in brought for digest in digests]
    if any(matches):
        return None
    return APIError(HTTPStatus.UNAUTHORIZED, "a missing or invalid API key: send 'Authorization: Bearer <key>' "
                    "(or, as Anthropic's clients do, 'X-Api-Key: <key>')", headers=CLOSE_CONNECTION)


def _validation_message(error: RequestValidationError, content_type: str | None = None) -> tuple[str, str | None]:
    """FastAPI's first validation error as one line, with the field it is about."""
    first = error.errors()[0] if error.errors() else {}
    if tuple(first.get("loc", ())) == ("body",) and first.get("type") in _NO_OBJECT:
        return _whole_body_message(first, content_type), None
    # Drop "body" and pydantic's names for union members and validators (e.g. "function-after[...]").
    location = [str(part) for part in first.get("loc", ()) if part != "body" and not _is_type_tag(str(part))]
    param = ".".join(location) or None
    message = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    cause = first.get("ctx", {}).get("error")
    if first.get("type") == "json_invalid":
        return f"the body is not valid JSON: {cause or message}", None
    if first.get("type") == "extra_forbidden":
        param = shortened(param or "")
        return f"{param}: kvserve does not know or implement this field (it is refused, not ignored)", param
    if getattr(cause, "param", None):  # an InvalidParameter from a model's own check: it names the field whole
        return message, cause.param
    return (f"{param}: {message}" if param else message), param


# pydantic's errors for a body that is no JSON object (a model's own checks fail at the body's place too)
_NO_OBJECT = frozenset({"missing", "model_attributes_type", "model_type", "dict_type"})


def _whole_body_message(error: dict[str, Any], content_type: str | None) -> str:
    """Why a body is no JSON object at all: sent as another media type (``curl -d`` sends a form), empty, or
    JSON of another kind. FastAPI reads a body as JSON only under a JSON media type (newer releases: not
    without one either); one it did not read comes as its bytes."""
    if isinstance(error.get("input"), bytes):
        sent = repr(shortened(content_type)) if content_type else "none"
        return f"the body must be JSON sent with 'Content-Type: application/json'; the request sent {sent}"
    if error.get("type") == "missing":
        return "the request body is empty: send a JSON object"
    return f"the body must be a JSON object, not {_json_kind(error.get('input'))}"


def _json_kind(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    kinds = {list: "an array", str: "a string", int: "a number", float: "a number", type(None): "null"}
    return kinds.get(type(value), "another kind of value")


def shortened(text: str, limit: int = 100) -> str:
    """A value the request sent, cut short for an error message (a 100 KB field name came back twice, a 1 MB
    model name whole)."""
    return text if len(text) <= limit else f"{text[:limit]}..."


def _is_type_tag(part: str) -> bool:
    return "[" in part or part in {"str", "int", "float", "bool", "list", "dict"}


def install_error_handlers(app: FastAPI) -> None:
    """Answer APIError, validation errors and HTTP errors (404 route, 405 method) in OpenAI's shape, or
    Anthropic's on its routes (an
    exception none of them answers is the request guard's 500: ``server/app.py``)."""
    from fastapi.exceptions import RequestValidationError

    from kvserve.engine.async_engine import EngineDeadError

    @app.exception_handler(APIError)
    async def _api_error(request: Request, error: APIError) -> JSONResponse:
        return error_response(error.status, error.message, error.param, error.headers, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(error, request.headers.get("content-type"))
        return error_response(HTTPStatus.BAD_REQUEST, message, param, path=request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        headers = dict(error.headers or {})
        if "Allow" in headers:  # Starlette lists a route's methods in a set's order, which varies by process
            headers["Allow"] = ", ".join(sorted(headers["Allow"].split(", ")))
        return error_response(error.status_code, _routing_message(request, error, headers), headers=headers,
                              path=request.url.path)

    @app.exception_handler(EngineDeadError)
    async def _engine_failed(request: Request, error: EngineDeadError) -> JSONResponse:
        # a request in flight when the engine failed (later ones get the state's 503 before they start)
        return error_response(HTTPStatus.SERVICE_UNAVAILABLE, f"the engine failed: {error}", path=request.url.path)


def _routing_message(request: Request, error: StarletteHTTPException, headers: dict[str, str]) -> str:
    """Routing's 404 and 405 as ``no_route`` and ``wrong_method`` word them; other HTTP errors as raised."""
    if error.status_code == HTTPStatus.NOT_FOUND:
        return no_route(request.method, request.url.path)
    if error.status_code == HTTPStatus.METHOD_NOT_ALLOWED:
        return wrong_method(request.method, request.url.path, headers.get("Allow", "another method"))
    return str(error.detail)


def no_route(method: str, path: str) -> str:
    """A 404's words for a path no route serves, naming it and the routes (a bare "Not Found" read as a wrong
    base URL, or as a model that does not exist); the router answers in a replica's words."""
    return f"kvserve serves no {method} {shortened(path)} (it serves {', '.join(SERVED_ROUTES)})"


def wrong_method(method: str, path: str, allowed: str) -> str:
    return f"{method} {shortened(path)}: this route takes {allowed}"
