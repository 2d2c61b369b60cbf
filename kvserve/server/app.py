"""The FastAPI app: OpenAI's routes (and Anthropic's /v1/messages), vLLM's pooling routes (``pooling``: embeddings,
pooling, score, rerank), /health, /metrics, /tokenize, /detokenize, and the request guards.

Guards (one ASGI middleware, before any routing): the body-size limit (413) and the API key (401) on the
OpenAI and tokenizer routes. The model's lifecycle (loading, draining) belongs to ``launch``; the routes read it
from ``ServerState``.
"""

from __future__ import annotations

import asyncio
import logging
from http import HTTPStatus
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Protocol

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import PlainTextResponse, Response, StreamingResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvserve import __version__
from kvserve.sampling_params import InvalidParameter
from kvserve.server.chat import ChatServer, render_chat
from kvserve.server.chat_protocol import ChatCompletionRequest
from kvserve.server.completion_protocol import CompletionRequest
from kvserve.server.completions import CompletionServer
from kvserve.server.dev_endpoints import add_dev_routes
from kvserve.server.errors import (
    PROTECTED_PREFIXES,
    APIError,
    bad_request,
    error_response,
    install_error_handlers,
    unauthorized,
)
from kvserve.server.messages import MessagesServer
from kvserve.server.messages_protocol import CountTokensRequest, MessagesRequest, TokenCount
from kvserve.server.metrics import CONTENT_TYPE
from kvserve.server.model_protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    UnloadLoRAAdapterRequest,
)
from kvserve.server.pooling import add_pooling_routes
from kvserve.server.profile_endpoints import add_profile_routes
from kvserve.server.protocol import SamplingRequest
from kvserve.server.request_body import read_body
from kvserve.server.request_ids import client_request_id, echoing_request_id
from kvserve.server.responses import ResponsesServer
from kvserve.server.responses_protocol import ResponsesRequest
from kvserve.server.sagemaker import add_invocations_route, dispatched
from kvserve.server.state import ServerState
from kvserve.server.streaming import ending_on_failure, until_disconnected

if TYPE_CHECKING:
    from kvserve.engine.async_engine import AsyncEngine

logger = logging.getLogger(__name__)

class _Generation(Protocol):
    async def start(self) -> AsyncIterator[Any]: ...

    async def respond(self, stream: AsyncIterator[Any]) -> Any: ...

    def stream(self, stream: AsyncIterator[Any]) -> AsyncIterator[str]: ...


# the methods of the routes that read: HEAD too (RFC 9110 section 9.1; the router answered HEAD, a server 405)
READ_METHODS = ["GET", "HEAD"]


def build_app(state: ServerState, lifespan: Callable[[FastAPI], Any] | None = None) -> FastAPI:
    """The app serving ``state``; ``lifespan`` loads and unloads the engine (see ``launch``)."""
    app = FastAPI(title="kvserve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state
    install_error_handlers(app)
    _add_health_routes(app, state)
    _add_model_routes(app, state)
    _add_generation_routes(app, state)
    add_pooling_routes(app, state)
    _add_token_routes(app, state)
    _add_lora_routes(app, state)
    add_dev_routes(app, state)
    add_profile_routes(app, state)
    add_invocations_route(app)
    app.add_middleware(RequestGuard, state=state)
    # added last, so outermost: a preflight is answered before the guard
    app.add_middleware(CORSMiddleware, **state.settings.cors.middleware_options())
    return app


def _add_health_routes(app: FastAPI, state: ServerState) -> None:
    """GET /health (200 once the model serves, else 503 saying why; SageMaker's GET and POST /ping alike, as
    vLLM's), GET /metrics and GET /version."""

    @app.api_route("/health", methods=READ_METHODS)
    @app.api_route("/ping", methods=[*READ_METHODS, "POST"])
    async def health() -> Response:
        if state.is_ready:
            return Response(status_code=HTTPStatus.OK)
        return error_response(HTTPStatus.SERVICE_UNAVAILABLE, f"not ready: {state.why_not_ready}")

    @app.api_route("/metrics", methods=READ_METHODS)
    async def metrics() -> Response:
        body = state.metrics.render() if state.metrics else b""
        return Response(body, media_type=CONTENT_TYPE)

    @app.api_route("/version", methods=READ_METHODS)
    async def version() -> dict[str, str]:
        return {"version": __version__}  # as vLLM answers it


def _add_model_routes(app: FastAPI, state: ServerState) -> None:
    """GET /v1/models and /v1/models/{model}: the cards of the served names."""

    @app.api_route("/v1/models", methods=READ_METHODS)
    async def models() -> ModelList:
        names = state.settings.served_model_names + state.adapters.names
        return ModelList(data=[_model_card(state, name) for name in names])

    @app.api_route("/v1/models/{model:path}", methods=READ_METHODS)
    async def model(model: str) -> ModelCard | ModelList:
        if not model:  # /v1/models/: the list, as vLLM's redirect to it answers
            return await models()
        state.engine_for(model)  # 404 naming the served models if it is not one of them
        return _model_card(state, model)


def _model_card(state: ServerState, name: str) -> ModelCard:
    """A served name's card, or a LoRA adapter's: its directory as root and the base model as parent (vLLM's)."""
    adapter = state.adapters.get(name)
    if adapter is None:
        return ModelCard(id=name, root=state.settings.model_root, max_model_len=state.max_model_len)
    return ModelCard(id=name, root=adapter.lora_path, parent=state.settings.model_name,
                     max_model_len=state.max_model_len)


def _add_generation_routes(app: FastAPI, state: ServerState) -> None:
    """POST /v1/completions, /v1/chat/completions, /v1/responses and Anthropic's /v1/messages (each of the last two
    served as the chat request it stands for)."""

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await _serve(state, CompletionServer, body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await _serve(state, ChatServer, body, request, tool_call_parser=state.settings.tool_call_parser,
                            reasoning_parser=state.settings.reasoning_parser)

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        return await _serve(state, ResponsesServer, body.chat_request, request, responses=body,
                            tool_call_parser=state.settings.tool_call_parser,
                            reasoning_parser=state.settings.reasoning_parser)

    @app.post("/v1/messages")
    async def messages(body: MessagesRequest, request: Request) -> Response:
        return await _serve(state, MessagesServer, body.chat_request, request, messages=body,
                            tool_call_parser=state.settings.tool_call_parser,
                            reasoning_parser=state.settings.reasoning_parser)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(body: CountTokensRequest) -> TokenCount:
        """Anthropic's count of a Messages request's prompt: the tokens the chat template renders it in (the
        anthropic SDK's ``messages.count_tokens``)."""
        chat = body.chat_request
        prompt = await render_chat(state.engine_for(chat.model), chat.messages, chat.tool_dicts,
                                   **chat.template_options)
        return TokenCount(input_tokens=len(prompt["prompt_token_ids"]))


async def _serve(state: ServerState, handler: Callable[..., _Generation], body: SamplingRequest, request: Request,
                 **options: Any) -> Response:
    """Admit the request (an error answer when the server cannot take it now), make its ``handler`` (400 for
    bad input, naming the field as the request sent it), queue it (400 on bad input), then answer it. A client
    that disconnects, streaming or not, aborts its requests. The client's id for it is its ``X-Request-Id``, else
    its body's ``request_id`` (vLLM's order)."""
    request_id = client_request_id(request.scope) or body.request_id
    with state.admission(body.model) as (engine, admission):
        try:
            generation = handler(engine, body, body.model or state.settings.model_name,
                                 client_request_id=request_id, admission=admission,
                                 request_log=state.settings.request_log,
                                 lora_request=state.adapters.get(body.model), **options)
        except ValueError as e:
            raise bad_request(body.named_as_sent(e)) from e
        outputs = await until_disconnected(request, generation.start())
    return await _answer(request, generation, outputs, body.stream, request_id)


async def _answer(request: Request, generation: _Generation, outputs: AsyncIterator[Any],
                  stream: bool, request_id: str | None) -> Response:
    """Stream the queued generation's ``outputs``, or answer once it is done."""
    if stream:
        return StreamingResponse(ending_on_failure(generation.stream(outputs), request_id, request.url.path),
                                 media_type="text/event-stream")
    body = await until_disconnected(request, generation.respond(outputs))
    return Response(await asyncio.to_thread(body.model_dump_json), media_type="application/json")


def _add_token_routes(app: FastAPI, state: ServerState) -> None:
    """POST /tokenize (a prompt, or messages rendered with the chat template) and POST /detokenize."""

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        token_ids = await _token_ids(state.engine_for(body.model), body)
        return TokenizeResponse(count=len(token_ids), max_model_len=state.max_model_len, tokens=token_ids)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        engine = state.engine_for(body.model)
        try:
            return DetokenizeResponse(prompt=await engine.detokenize(body.tokens))
        except InvalidParameter as e:  # the engine names the ids token_ids; the request sent them as tokens
            raise bad_request(e.renamed("tokens")) from e


def _add_lora_routes(app: FastAPI, state: ServerState) -> None:
    """POST /v1/load_lora_adapter and /v1/unload_lora_adapter (``served_adapters``), vLLM's plain-text answers;
    without --allow-runtime-lora-updating a 404 whatever the body, saying how to turn them on (vLLM mounts no
    such route)."""
    if not state.settings.allow_runtime_lora_updating:
        @app.post("/v1/load_lora_adapter")
        @app.post("/v1/unload_lora_adapter")
        async def runtime_lora_updating_off() -> Response:
            raise APIError(HTTPStatus.NOT_FOUND, "loading and unloading LoRA adapters at runtime is off: start the "
                                                 "server with --allow-runtime-lora-updating (and --enable-lora), or "
                                                 "with $VLLM_ALLOW_RUNTIME_LORA_UPDATING=1")
        return

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> PlainTextResponse:
        return PlainTextResponse(await state.adapters.load(state.engine_for(None), body))

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        return PlainTextResponse(await state.adapters.unload(state.engine_for(None), body))


async def _token_ids(engine: AsyncEngine, body: TokenizeRequest) -> list[int]:
    """The token ids of the request's messages or prompt. Special tokens (BOS) are added, by vLLM's defaults, to
    a prompt and not to messages, whose template holds those it wants; ``add_special_tokens`` overrides that."""
    if body.messages is not None:
        prompt = await render_chat(engine, body.messages, **body.template_options)
        return prompt["prompt_token_ids"]
    try:
        return await engine.tokenize(body.prompt, body.add_special_tokens is not False)
    except ValueError as e:
        raise bad_request(e, param="prompt") from e


class RequestGuard:
    """ASGI middleware: the body read in full before the app sees it (``read_body``: 413 over ``max_body_bytes``,
    408 too slow, 400 / 415 framed or coded as kvserve cannot read; 400 not UTF-8), 401 for a missing or wrong
    bearer token on the protected routes when an API key is set; a SageMaker POST /invocations re-pointed at the
    endpoint its body is a request of (``sagemaker.dispatched``). Every answer to a request
    that sent an ``X-Request-Id`` carries it back, errors included (a router or a client's logs match the two)."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.settings = state.settings

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        send = echoing_request_id(scope, send)
        try:
            self._check_api_key(scope)
            body = await read_body(scope, receive, self.settings.max_body_bytes)
        except APIError as e:  # answered before the body was all read: its headers close the connection
            await error_response(e.status, e.message, e.param, e.headers, scope["path"])(scope, receive, send)
            return
        if body is None:  # the client left before its request was in
            return
        not_utf8 = _not_utf8(body, scope["path"])
        if not_utf8 is not None:
            await not_utf8(scope, receive, send)
            return
        await self._answer_or_fail(dispatched(scope, body), _replay(body, receive), send)

    async def _answer_or_fail(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The app's answer; an exception that no handler answered is a 500 here, inside the guard, so that it
        carries the request's id and is logged once, naming it (Starlette's own last handler sits outside every
        middleware: its 500 dropped the id, and uvicorn logged the traceback a second time)."""
        started = False

        async def noting_start(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, noting_start)
        except Exception as error:
            if started:  # too late to answer: uvicorn logs it and closes the connection
                raise
            request_id = client_request_id(scope)
            logger.exception("unhandled error in %s %s (%s)", scope["method"], scope["path"],
                             f"X-Request-Id {request_id}" if request_id else "no X-Request-Id")
            response = error_response(HTTPStatus.INTERNAL_SERVER_ERROR, f"internal error: {type(error).__name__}",
                                      path=scope["path"])
            await response(scope, receive, send)

    def _check_api_key(self, scope: Scope) -> None:
        keys = self.settings.api_keys
        if not keys or not scope["path"].startswith(PROTECTED_PREFIXES):
            return
        error = unauthorized(scope["headers"], keys)
        if error is not None:
            raise error


def _not_utf8(body: bytes, path: str) -> Response | None:
    """The 400 for a body that is not UTF-8, naming where it breaks; None for one that is."""
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as e:
        return error_response(HTTPStatus.BAD_REQUEST, f"the body is not valid UTF-8: {e.reason} at byte {e.start}",
                              path=path)
    return None


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that hands the app the buffered body once, then waits on the real one (for the disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay

