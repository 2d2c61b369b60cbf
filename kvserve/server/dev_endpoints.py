"""vLLM's development endpoints, served with ``$VLLM_SERVER_DEV_MODE=1`` (``environment.server_dev_mode``) as vLLM
serves them: POST /reset_prefix_cache; sleep mode's POST /sleep?level=, POST /wake_up?tags=, GET /is_sleeping.
Without it each is a 404 saying how to turn it on (vLLM mounts none).

Each runs on the engine thread between two steps (``AsyncEngine.call``), so that it sees no step half done. A
request sent while the engine sleeps is a 503 naming sleep mode (``EngineAsleep``).
"""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Awaitable, Sequence

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from kvserve.engine.sleep_mode import EngineAsleep
from kvserve.sampling_params import InvalidParameter
from kvserve.server.environment import VLLM_SERVER_DEV_MODE_ENV, server_dev_mode
from kvserve.server.errors import APIError, bad_request, error_response
from kvserve.server.state import ServerState

logger = logging.getLogger(__name__)

DEV_PATHS = {"/reset_prefix_cache": "POST", "/sleep": "POST", "/wake_up": "POST", "/is_sleeping": "GET"}
RESET_FLAGS = ("reset_running_requests", "reset_external")
# how pydantic (vLLM's FastAPI query parameters) reads a boolean
_TRUE, _FALSE = frozenset({"true", "1", "yes", "on", "t", "y"}), frozenset({"false", "0", "no", "off", "f", "n"})


def add_dev_routes(app: FastAPI, state: ServerState) -> None:
    """The development routes where ``$VLLM_SERVER_DEV_MODE`` turns them on, else a 404 for each saying so."""
    if not server_dev_mode():
        async def dev_mode_off(request: Request) -> Response:
            raise APIError(HTTPStatus.NOT_FOUND, f"{request.url.path} is a development endpoint: start the server "
                                                 f"with ${VLLM_SERVER_DEV_MODE_ENV}=1 to serve it")

        for path, method in DEV_PATHS.items():
            app.add_api_route(path, dev_mode_off, methods=[method])
        return
    _add_reset_route(app, state)
    _add_sleep_routes(app, state)


def _add_reset_route(app: FastAPI, state: ServerState) -> None:

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request) -> Response:
        """200 once the prefix cache is empty; 409 where running requests still hold cached blocks (those stay;
        what no request held is gone; vLLM's answers 200 whatever happened). ``reset_external``: the KV tiers too
        (``LLMEngine.reset_prefix_cache``'s ``reset_connector``)."""
        flags = query_flags(request, RESET_FLAGS)
        engine = state.engine_for(None)
        try:
            reset = await engine.call(lambda e: e.reset_prefix_cache(flags["reset_running_requests"],
                                                                     flags["reset_external"]))
        except InvalidParameter as e:
            raise bad_request(e) from e
        if not reset:
            raise APIError(HTTPStatus.CONFLICT, "the prefix cache was reset in part: running requests still hold "
                                                "cached blocks, which stay cached; reset again once they finish")
        return Response(status_code=HTTPStatus.OK)


def _add_sleep_routes(app: FastAPI, state: ServerState) -> None:
    """Sleep mode (``engine/sleep_mode.py``), vLLM's routes: POST /sleep aborts every request (vLLM's default
    ``mode=abort``; ``wait`` and ``keep`` are refused) and releases the KV cache (``level=1``) or the weights too
    (``level=2``); POST /wake_up brings back what its ``tags`` name (all where none); GET /is_sleeping."""

    @app.exception_handler(EngineAsleep)
    async def asleep(request: Request, error: EngineAsleep) -> Response:
        return error_response(HTTPStatus.SERVICE_UNAVAILABLE, str(error), path=request.url.path)

    @app.post("/sleep")
    async def sleep(request: Request) -> Response:
        query = _checked_query(request, ("level", "mode"))
        if query.get("mode", "abort") != "abort":
            raise APIError(HTTPStatus.BAD_REQUEST, f"mode {query['mode']!r} is not supported: sleep aborts the "
                                                   "requests in flight (mode=abort)", param="mode")
        level = query.get("level", "1")
        if not level.isdigit():
            raise APIError(HTTPStatus.BAD_REQUEST, f"level must be 1 or 2, got {level!r}", param="level")
        await _on_engine(state.engine_for(None).sleep(int(level)))
        return Response(status_code=HTTPStatus.OK)

    @app.post("/wake_up")
    async def wake_up(request: Request) -> Response:
        _checked_query(request, ("tags",))
        tags = request.query_params.getlist("tags") or None
        await _on_engine(state.engine_for(None).call(lambda engine: engine.wake_up(tags)))
        return Response(status_code=HTTPStatus.OK)

    @app.get("/is_sleeping")
    async def is_sleeping() -> JSONResponse:
        engine = state.engine_for(None)
        return JSONResponse({"is_sleeping": await engine.call(lambda e: e.is_sleeping)})


async def _on_engine(call: Awaitable[None]) -> None:
    """A sleep-mode call; its ValueError (a level, a tag, sleeping twice, requests it cannot sleep with) a 400."""
    try:
        await call
    except ValueError as e:
        raise bad_request(e) from e


def _checked_query(request: Request, names: Sequence[str]) -> dict[str, str]:
    """The query parameters, a 400 naming one that is none of ``names``."""
    query = request.query_params
    for name in query:
        if name not in names:
            raise APIError(HTTPStatus.BAD_REQUEST, f"unknown query parameter {name!r}: {request.url.path} takes "
                                                   f"{', '.join(names)}", param=name)
    return dict(query)


def query_flags(request: Request, names: Sequence[str]) -> dict[str, bool]:
    """The boolean query parameters ``names`` (False where absent), read as vLLM's FastAPI reads them; a 400
    naming a parameter that is none of them, or a value that is no boolean."""
    query = _checked_query(request, names)
    flags = {}
    for name in names:
        value = query.get(name, "false").strip().lower()
        if value not in _TRUE | _FALSE:
            raise APIError(HTTPStatus.BAD_REQUEST, f"{name} must be true or false, got {query[name]!r}", param=name)
        flags[name] = value in _TRUE
    return flags
