"""vLLM's development endpoints, served with ``$VLLM_SERVER_DEV_MODE=1`` (``environment.server_dev_mode``) as vLLM
serves them: POST /reset_prefix_cache. Without it each is a 404 saying how to turn it on (vLLM mounts none).

Each runs on the engine thread between two steps (``AsyncEngine.call``), so that it sees no step half done.
"""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Sequence

from fastapi import FastAPI, Request, Response

from kvserve.sampling_params import InvalidParameter
from kvserve.server.environment import VLLM_SERVER_DEV_MODE_ENV, server_dev_mode
from kvserve.server.errors import APIError, bad_request
from kvserve.server.state import ServerState

logger = logging.getLogger(__name__)

DEV_PATHS = ("/reset_prefix_cache",)
RESET_FLAGS = ("reset_running_requests", "reset_external")
# how pydantic (vLLM's FastAPI query parameters) reads a boolean
_TRUE, _FALSE = frozenset({"true", "1", "yes", "on", "t", "y"}), frozenset({"false", "0", "no", "off", "f", "n"})


def add_dev_routes(app: FastAPI, state: ServerState) -> None:
    """The development routes where ``$VLLM_SERVER_DEV_MODE`` turns them on, else a 404 for each saying so."""
    if not server_dev_mode():
        async def dev_mode_off(request: Request) -> Response:
            raise APIError(HTTPStatus.NOT_FOUND, f"{request.url.path} is a development endpoint: start the server "
                                                 f"with ${VLLM_SERVER_DEV_MODE_ENV}=1 to serve it")

        for path in DEV_PATHS:
            app.add_api_route(path, dev_mode_off, methods=["POST"])
        return

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request) -> Response:
        """200 once the prefix cache is empty; 409 where running requests still hold cached blocks (those stay;
        what no request held is gone), as vLLM answers a reset that could not be made. ``reset_external``: the KV
        tiers too (``LLMEngine.reset_prefix_cache``'s ``reset_connector``)."""
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


def query_flags(request: Request, names: Sequence[str]) -> dict[str, bool]:
    """The boolean query parameters ``names`` (False where absent), read as vLLM's FastAPI reads them; a 400
    naming a parameter that is none of them, or a value that is no boolean."""
    query = request.query_params
    for name in query:
        if name not in names:
            raise APIError(HTTPStatus.BAD_REQUEST, f"unknown query parameter {name!r}: {request.url.path} takes "
                                                   f"{', '.join(names)}", param=name)
    flags = {}
    for name in names:
        value = query.get(name, "false").strip().lower()
        if value not in _TRUE | _FALSE:
            raise APIError(HTTPStatus.BAD_REQUEST, f"{name} must be true or false, got {query[name]!r}", param=name)
        flags[name] = value in _TRUE
    return flags
