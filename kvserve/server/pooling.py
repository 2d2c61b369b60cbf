"""The pooling endpoints (``pooling_protocol``): POST /v1/embeddings, /pooling, /score and /v1/score, /rerank,
/v1/rerank and /v2/rerank, each a batch of prompts pooled by the engine (``AsyncEngine.encode``: all queued or
none) and its vectors made into vLLM's answer.

A request goes as a generation does: admitted under ``--max-waiting`` (a 400 first where the engine's
``--runner`` does not serve the task), its prompts rendered or tokenized off the event loop, queued under the
request's priority and LoRA adapter, logged, and aborted should its client go away. A score or rerank embeds both
sides in one batch and answers the cosine similarity of each pair's embeddings, as vLLM scores with an embedding
model.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass
from http import HTTPStatus
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Sequence

import torch
from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel

from kvserve.engine.scoring import pair_scores
from kvserve.pooling_params import PoolingParams
from kvserve.server.chat import render_chat
from kvserve.server.errors import RETRY_LATER, APIError, bad_request
from kvserve.server.pooling_protocol import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EncodingBody,
    PoolingBody,
    PoolingData,
    PoolingRequest,
    PoolingResponse,
    RerankRequest,
    RerankResponse,
    RerankUsage,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
    encoded,
    ranked,
)
from kvserve.server.protocol import Usage
from kvserve.server.request_ids import client_request_id
from kvserve.server.state import ServerState
from kvserve.server.streaming import queue_refusal, salted, until_disconnected

if TYPE_CHECKING:
    from kvserve.engine.async_engine import Admission, AsyncEngine
    from kvserve.engine.input_processor import PromptInput
    from kvserve.outputs import PoolingRequestOutput

RERANK_PATHS = ("/rerank", "/v1/rerank", "/v2/rerank")


def add_pooling_routes(app: FastAPI, state: ServerState) -> None:
    """The pooling endpoints, registered as the generation endpoints are (the request guard's body limit and API
    key apply to them alike)."""

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
        return await _json(_embeddings_answer, await _encode(state, request, body, "embd", _prompts_of(body)), body)

    @app.post("/pooling")
    async def pooling(body: PoolingRequest, request: Request) -> Response:
        return await _json(_pooling_answer, await _encode(state, request, body, "pool", _prompts_of(body)), body)

    @app.post("/score")
    @app.post("/v1/score")
    async def score(body: ScoreRequest, request: Request) -> Response:
        first, second = body.pairs()
        return await _json(_score_answer, await _encode(state, request, body, "score", _texts(first + second)), body)

    async def rerank(body: RerankRequest, request: Request) -> Response:
        run = await _encode(state, request, body, "rerank", _texts([body.query, *body.documents]))
        return await _json(_rerank_answer, run, body)

    for path in RERANK_PATHS:
        app.post(path)(rerank)


@dataclass
class _Encoded:
    """A request's pooled outputs, in its prompts' order, and what its answer is named by."""

    answer_id: str
    model_name: str
    outputs: list[PoolingRequestOutput]

    @property
    def usage(self) -> Usage:
        return Usage.of(sum(len(out.prompt_token_ids) for out in self.outputs), 0,
                        sum(out.num_cached_tokens for out in self.outputs))

    @property
    def vectors(self) -> list[torch.Tensor]:
        return [out.outputs.data for out in self.outputs]


PromptsOf = Callable[["AsyncEngine"], Awaitable[list["PromptInput"]]]


async def _encode(state: ServerState, request: Request, body: PoolingBody, id_prefix: str,
                  prompts_of: PromptsOf) -> _Encoded:
    """Admit the request, make its prompts (``prompts_of``), pool them with the body's params and return the
    outputs: 400 for bad input (the engine's words, naming the field), 499 where the client left first (its
    requests aborted). The answer's id is ``{id_prefix}-{X-Request-Id, else the body's request_id}``, or the
    engine's fresh id."""
    params = body.pooling_params()
    engine_id = f"{id_prefix}-{uuid.uuid4().hex}"  # the engine's own, fresh whatever the client sends
    client_id = client_request_id(request.scope) or body.request_id
    answer_id = engine_id if client_id is None else f"{id_prefix}-{client_id}"
    with state.admission(body.model, params.task) as (engine, admission):
        try:
            prompts = salted(await until_disconnected(request, prompts_of(engine)), body.cache_salt)
            outputs = await until_disconnected(request, _pooled(
                state, engine, prompts, params, body, answer_id, engine_id, admission))
        except ValueError as error:
            raise queue_refusal(body.named_as_sent(error)) from error
    if any(out.outputs is None for out in outputs):  # aborted by the engine: the shutdown's end of its grace period
        raise APIError(HTTPStatus.SERVICE_UNAVAILABLE, "the request was aborted: the server is shutting down",
                       headers=RETRY_LATER)
    return _Encoded(answer_id, body.model or state.settings.model_name, outputs)


async def _pooled(state: ServerState, engine: AsyncEngine, prompts: Sequence[PromptInput], params: PoolingParams,
                  body: PoolingBody, answer_id: str, engine_id: str, admission: Admission | None
                  ) -> list[PoolingRequestOutput]:
    """The prompts pooled (a batch's requests ``{engine_id}-{i}``), logged as queued and as ended."""
    request_ids = [engine_id] if len(prompts) == 1 else [f"{engine_id}-{i}" for i in range(len(prompts))]
    logged = state.settings.request_log.queued(answer_id, engine_id, prompts, params)
    try:
        outputs = await engine.encode(prompts, params, request_ids, admission, priority=body.priority,
                                      lora_request=state.adapters.get(body.model))
    except BaseException as error:  # refused, failed, or its client gone (cancelled)
        if logged is not None:
            logged.ended_early(error)
        raise
    if logged is not None:
        logged.pooled(outputs)
    return outputs


def _prompts_of(body: EncodingBody) -> PromptsOf:
    """The engine prompts of ``input`` (a text tokenized here where ``add_special_tokens`` is false) or of
    ``messages`` (rendered with the chat template)."""
    async def prompts(engine: AsyncEngine) -> list[PromptInput]:
        if body.messages is not None:
            return [await render_chat(engine, body.messages, **body.template_options)]
        if body.add_special_tokens is not False:
            return [p if isinstance(p, str) else {"prompt_token_ids": p} for p in body.prompts]
        return [{"prompt_token_ids": await _tokenized(engine, p) if isinstance(p, str) else p} for p in body.prompts]

    return prompts


async def _tokenized(engine: AsyncEngine, text: str) -> list[int]:
    try:
        return await engine.tokenize(text, add_special_tokens=False)
    except ValueError as error:
        raise bad_request(error, param="input") from error


def _texts(texts: list[str]) -> PromptsOf:
    async def prompts(engine: AsyncEngine) -> list[PromptInput]:
        return list(texts)

    return prompts


def _embeddings_answer(run: _Encoded, body: EmbeddingRequest) -> EmbeddingResponse:
    data = [EmbeddingData(index=i, embedding=encoded(vector, body.encoding_format))
            for i, vector in enumerate(run.vectors)]
    return EmbeddingResponse(id=run.answer_id, model=run.model_name, data=data, usage=run.usage)


def _pooling_answer(run: _Encoded, body: PoolingRequest) -> PoolingResponse:
    data = [PoolingData(index=i, data=encoded(vector, body.encoding_format)) for i, vector in enumerate(run.vectors)]
    return PoolingResponse(id=run.answer_id, model=run.model_name, data=data, usage=run.usage)


def _score_answer(run: _Encoded, body: ScoreRequest) -> ScoreResponse:
    num_first = len(body.pairs()[0])
    scores = pair_scores(run.vectors[:num_first], run.vectors[num_first:])
    data = [ScoreData(index=i, score=score) for i, score in enumerate(scores)]
    return ScoreResponse(id=run.answer_id, model=run.model_name, data=data, usage=run.usage)


def _rerank_answer(run: _Encoded, body: RerankRequest) -> RerankResponse:
    scores = pair_scores(run.vectors[:1], run.vectors[1:])
    usage = RerankUsage(prompt_tokens=run.usage.prompt_tokens, total_tokens=run.usage.total_tokens)
    results = ranked(scores, body.documents, body.top_n, body.return_documents)
    return RerankResponse(id=run.answer_id, model=run.model_name, usage=usage, results=results)


async def _json(answer_of: Callable[[_Encoded, Any], BaseModel], run: _Encoded, body: PoolingBody) -> Response:
    """``answer_of(run, body)`` as JSON, made and rendered off the event loop (a batch of embeddings is megabytes of
    numbers), fields that are None left out (a rerank result's document under return_documents false)."""
    def render() -> str:
        return answer_of(run, body).model_dump_json(exclude_none=True)

    return Response(await asyncio.to_thread(render), media_type="application/json")
