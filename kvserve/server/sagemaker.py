"""SageMaker's inference route, as vLLM serves it: POST /invocations, a body served by the first endpoint of
``INVOCATIONS`` whose request it validates as (chat, completion, embedding, score, rerank, pooling: vLLM's order),
and answered as that endpoint answers it (streaming too). (SageMaker's health check, GET or POST /ping, is
/health's route: ``app._add_health_routes``.)

The request guard, which holds the whole body, re-points such a request at its endpoint (``dispatched``) before
routing, so the endpoint's own checks, errors and answer are the ones the client gets. A body no request validates as
reaches the /invocations route, whose 400 names what each request type found wrong. Adding an endpoint here is one
entry of ``INVOCATIONS``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

import pydantic
from fastapi import FastAPI, Request

from kvserve.server.chat_protocol import ChatCompletionRequest
from kvserve.server.completion_protocol import CompletionRequest
from kvserve.server.errors import APIError
from kvserve.server.pooling_protocol import EmbeddingRequest, PoolingRequest, RerankRequest, ScoreRequest

if TYPE_CHECKING:
    from starlette.types import Scope

INVOCATIONS_PATH = "/invocations"


@dataclass(frozen=True)
class Invocation:
    """An endpoint /invocations serves: what its 400 calls it, the request it takes, its path."""

    name: str
    request_type: type[pydantic.BaseModel]
    path: str


# tried in this order, vLLM's: no body validates as two of them (each refuses the others' required fields)
INVOCATIONS = (
    Invocation("chat completion", ChatCompletionRequest, "/v1/chat/completions"),
    Invocation("completion", CompletionRequest, "/v1/completions"),
    Invocation("embedding", EmbeddingRequest, "/v1/embeddings"),
    Invocation("score", ScoreRequest, "/score"),
    Invocation("rerank", RerankRequest, "/rerank"),
    Invocation("pooling", PoolingRequest, "/pooling"),
)


def dispatched(scope: Scope, body: bytes) -> Scope:
    """A POST /invocations whose body validates as one of ``INVOCATIONS``' requests, re-pointed at that endpoint;
    any other request as it is."""
    if scope["path"] != INVOCATIONS_PATH or scope["method"] != "POST":
        return scope
    payload = _payload(body)
    for invocation in INVOCATIONS:
        if _refusal(invocation, payload) is None:
            return {**scope, "path": invocation.path, "raw_path": invocation.path.encode()}
    return scope


def add_invocations_route(app: FastAPI) -> None:
    """POST /invocations for a body that ``dispatched`` found no endpoint for: a 400 naming each request type and the
    first thing it found wrong."""

    @app.post(INVOCATIONS_PATH)
    async def invocations(request: Request) -> None:
        body = await request.body()
        try:
            payload = json.loads(body)
        except ValueError as e:
            raise APIError(HTTPStatus.BAD_REQUEST, f"the body is not JSON: {e}") from e
        refusals = "; ".join(f"{invocation.name} ({_refusal(invocation, payload)})" for invocation in INVOCATIONS)
        raise APIError(HTTPStatus.BAD_REQUEST,
                       f"the body is none of the requests {INVOCATIONS_PATH} serves: {refusals}")


def _payload(body: bytes) -> Any:
    try:
        return json.loads(body)
    except ValueError:  # not JSON: no request validates; the route says so
        return None


def _refusal(invocation: Invocation, payload: Any) -> str | None:
    """Why ``payload`` is not ``invocation``'s request (its first error), or None if it is."""
    try:
        invocation.request_type.model_validate(payload)
    except pydantic.ValidationError as e:
        error = e.errors()[0]
        where = ".".join(str(part) for part in error["loc"])
        return f"{where}: {error['msg']}" if where else error["msg"]
    return None
