"""vLLM's profiling endpoints, served where ``$VLLM_TORCH_PROFILER_DIR`` names a directory (as vLLM serves them):
POST /start_profile records ``torch.profiler`` traces of the engine's steps, POST /stop_profile writes them there,
one trace a pair (``engine/profiler.py``). Without the variable each is a 404 saying how to turn it on. For local
development only: a trace holds every op of every request profiled.
"""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import TYPE_CHECKING, Callable

from fastapi import FastAPI, Request, Response

from kvserve.server.environment import VLLM_TORCH_PROFILER_DIR_ENV, torch_profiler_dir
from kvserve.server.errors import APIError
from kvserve.server.state import ServerState

if TYPE_CHECKING:
    from kvserve.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)

PROFILE_PATHS = ("/start_profile", "/stop_profile")


def add_profile_routes(app: FastAPI, state: ServerState) -> None:
    """POST /start_profile and /stop_profile where ``$VLLM_TORCH_PROFILER_DIR`` is set, else a 404 for each saying
    so. Each runs on the engine thread between two steps; a stop without a start (or a second start) is a 400
    naming it."""
    trace_dir = torch_profiler_dir()
    if trace_dir is None:
        async def profiling_off(request: Request) -> Response:
            raise APIError(HTTPStatus.NOT_FOUND, f"{request.url.path} is off: start the server with "
                                                 f"${VLLM_TORCH_PROFILER_DIR_ENV} naming a directory for the traces")

        for path in PROFILE_PATHS:
            app.add_api_route(path, profiling_off, methods=["POST"])
        return
    logger.warning("the profiler's endpoints are on ($%s=%s): for local development only", VLLM_TORCH_PROFILER_DIR_ENV,
                   trace_dir)

    @app.post("/start_profile")
    async def start_profile() -> Response:
        await _on_engine(state, lambda engine: engine.start_profile(trace_dir))
        return Response(status_code=HTTPStatus.OK)

    @app.post("/stop_profile")
    async def stop_profile() -> Response:
        await _on_engine(state, lambda engine: engine.stop_profile())
        return Response(status_code=HTTPStatus.OK)


async def _on_engine(state: ServerState, fn: Callable[[LLMEngine], object]) -> None:
    """``fn`` run on the engine thread; the profiler's RuntimeError (a stop without a start, a second start) a 400
    saying it (an engine that stopped is the handlers' 503)."""
    from kvserve.engine.async_engine import EngineDeadError  # imports torch: not at the app's import

    try:
        await state.engine_for(None).call(fn)
    except EngineDeadError:
        raise
    except RuntimeError as e:
        raise APIError(HTTPStatus.BAD_REQUEST, str(e)) from e
