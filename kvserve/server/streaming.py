"""What completions and chat share: running a batch of prompts, deltas of cumulative outputs, SSE framing, and
aborting on a client disconnect."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import TYPE_CHECKING, Any, AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence, TypeVar

from fastapi import Request
from pydantic import BaseModel

from kvserve.engine.async_engine import EngineDeadError
from kvserve.engine.beam_search import BeamBatch, beam_search_async
from kvserve.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from kvserve.lora_request import LoRARequest, RemovedLoRAAdapter
from kvserve.sampling_params import InvalidParameter, SamplingParams
from kvserve.server.errors import APIError, bad_request, sse_failure
from kvserve.server.request_log import RequestLog
from kvserve.server.response_extras import ResponseExtras

if TYPE_CHECKING:
    from kvserve.engine.async_engine import Admission, AsyncEngine
    from kvserve.engine.input_processor import PromptInput

T = TypeVar("T")
logger = logging.getLogger(__name__)

SSE_DONE = "data: [DONE]\n\n"
# Characters JSON leaves as they are but Python's str.splitlines ends a line at, and with it httpx's
# iter_lines, which many clients read an event stream through: escaped, a chunk whose text holds one stays one
# line (the event-stream format ends lines at CR and LF alone)
_SPLITLINES_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(body: BaseModel, exclude: set[str] | None = None) -> str:
    return sse_event(body.model_dump_json(exclude=exclude))


def sse_event(data: str) -> str:
    """``data`` (JSON) as one event; translated only where it holds a break (the translation of a 300-character
    chunk took 6 us, a twentieth of the event loop's time a streamed token)."""
    if "\x85" in data or "\u2028" in data or "\u2029" in data:
        data = data.translate(_SPLITLINES_BREAKS)
    return f"data: {data}\n\n"


class TextEvents:
    """The events of a stream that differ only in one choice's next text (most of a stream's events): each
    choice's event is rendered once, by its pydantic models, around a marker, and each event is then that JSON
    with the text in the marker's place, escaped as pydantic escapes it. Built through the models, an event took
    22 us, a fifth of the event loop's time a streamed token. ``render(index, text)``: the chunk of choice
    ``index`` with ``text``."""

    def __init__(self, render: Callable[[int, str], BaseModel], exclude: set[str] | None = None) -> None:
        self._render = render
        self._exclude = exclude
        self._around: dict[int, tuple[str, str]] = {}  # choice index -> its chunk's JSON before and after the text

    def event(self, index: int, text: str) -> str:
        around = self._around.get(index)
        if around is None:
            marker = uuid.uuid4().hex  # no id or model name a client chooses can hold it
            before, _, after = self._render(index, marker).model_dump_json(exclude=self._exclude).partition(
                f'"{marker}"')
            around = self._around[index] = (before, after)
        return sse_event(f"{around[0]}{json.dumps(text, ensure_ascii=False)}{around[1]}")


@dataclass
class SampleDelta:
    """What one sample produced since its last emission."""

    text: str
    token_ids: list[int]
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None
    stop_reason: int | str | None
    is_first: bool  # nothing of this sample was sent before

    @property
    def is_empty(self) -> bool:
        return not self.text and not self.token_ids and self.finish_reason is None

    @classmethod
    def whole(cls, sample: CompletionOutput) -> SampleDelta:
        """A finished sample as one delta: what a whole (not streamed) answer is made of."""
        return cls(sample.text, sample.token_ids, sample.logprobs, str(sample.finish_reason), sample.stop_reason,
                   is_first=True)


@dataclass
class SampleCursor:
    """How much of one sample's cumulative output has been sent (text in characters, tokens in ids)."""

    num_chars: int = 0
    num_tokens: int = 0
    finished: bool = False

    def advance(self, sample: CompletionOutput) -> SampleDelta | None:
        """The delta since the last call, or None if there is nothing new (or the sample already finished)."""
        if self.finished:
            return None
        # Text only grows, except that a stop string found at the end is cut off: nothing more is sent then.
        text = sample.text[self.num_chars:]
        token_ids = sample.token_ids[self.num_tokens:]
        logprobs = sample.logprobs[self.num_tokens:] if sample.logprobs is not None else None
        finish = str(sample.finish_reason) if sample.finish_reason is not None else None
        is_first = self.num_chars == 0 and self.num_tokens == 0
        delta = SampleDelta(text, list(token_ids), logprobs, finish, sample.stop_reason, is_first)
        self.num_chars = max(self.num_chars, len(sample.text))
        self.num_tokens = len(sample.token_ids)
        self.finished = finish is not None
        return None if delta.is_empty else delta


@dataclass
class BatchCursor:
    """Cursors for every choice of a batch of requests: choice ``i * n + j`` is sample j of prompt i."""

    n: int
    cursors: dict[int, SampleCursor] = field(default_factory=dict)

    def advance(self, outputs: Sequence[RequestOutput]) -> list[tuple[int, SampleDelta]]:
        deltas = []
        for i, out in enumerate(outputs):
            for sample in out.outputs:
                index = i * self.n + sample.index
                delta = self.cursors.setdefault(index, SampleCursor()).advance(sample)
                if delta is not None:
                    deltas.append((index, delta))
        return deltas


class GenerationHandler:
    """What every generation endpoint holds: the engine, the request body, the model name its answer says (the one
    the request used), the answer's id (``{id_prefix}-{the client's X-Request-Id}``, as vLLM's, or
    ``{id_prefix}-{fresh hex}``; ``id_separator`` in place of the dash) and when it was made (every chunk's
    ``created``, as OpenAI's and vLLM's), the sampling params, the tokenizer, the vLLM extras the answer carries,
    and the first outputs (a stream's first chunks name the prompt's tokens before any sample's)."""

    id_prefix = "req"
    id_separator = "-"  # OpenAI's ids: chatcmpl-..., resp_...

    def __init__(self, engine: AsyncEngine, body: Any, model_name: str, client_request_id: str | None = None,
                 admission: Admission | None = None, request_log: RequestLog = RequestLog(),
                 lora_request: LoRARequest | None = None) -> None:
        self.engine = engine
        self.lora_request = lora_request  # the LoRA adapter ``model`` named (None: the base model)
        self.request_log = request_log
        self.admission = admission  # counted as waiting until queued (``AsyncEngine.admit``)
        self.body = body
        self.model_name = model_name
        # the engine's ids are always fresh: a client may send one X-Request-Id twice at once, or one with a
        # character the engine keeps for its samples' ids ('#')
        self._engine_id = f"{self.id_prefix}{self.id_separator}{uuid.uuid4().hex}"
        self.client_request_id = client_request_id  # what the log lines name the request by, where it sent one
        self.request_id = (self._engine_id if client_request_id is None
                           else f"{self.id_prefix}{self.id_separator}{client_request_id}")
        self.created = int(time.time())
        self.params = body.to_sampling_params(engine.engine.default_sampling_params)
        self.tokenizer = engine.engine.tokenizer
        self.extras = ResponseExtras.of(body, self.tokenizer)
        self.first_outputs: list[RequestOutput] = []

    async def _generate(self, prompts: Sequence[PromptInput]) -> AsyncGenerator[list[RequestOutput], None]:
        """Queue the batch and wait until it is accepted, so bad input is a 400 before any byte is streamed. A
        constraint is compiled first, off the engine thread."""
        request_id = self._engine_id
        request_ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
        prompts = salted(prompts, self.body.cache_salt)
        if self.body.use_beam_search:
            if self.lora_request is not None:
                raise bad_request(InvalidParameter("use_beam_search", "use_beam_search with a LoRA adapter is not "
                                                                      "supported: its beams run the base model"))
            return await self._beam_search(prompts, request_ids)
        if self.params.structured_outputs is not None:
            try:
                await self.engine.compile_constraint(self.params.structured_outputs)
            except ValueError as e:  # the constraint's own fault: named as the field that held it
                raise bad_request(e, param=self.body.constraint_field) from e
        logged = self.request_log.queued(self.request_id, request_id, prompts, self.params)
        try:
            stream = self.engine.generate_many(prompts, self.params, request_ids, self.admission,
                                               final_only=not self.body.stream, priority=self.body.priority,
                                               lora_request=self.lora_request)
            first = await anext(stream)
        except BaseException as error:  # refused, or its client gone before any output
            if logged is not None:
                logged.ended_early(error)
            if isinstance(error, ValueError):
                raise queue_refusal(self.body.named_as_sent(error)) from error
            raise
        self.first_outputs = first
        outputs = _prepend(first, stream)
        return outputs if logged is None else logged.watched(outputs)

    async def _beam_search(self, prompts: Sequence[PromptInput], request_ids: list[str]
                           ) -> AsyncGenerator[list[RequestOutput], None]:
        """vLLM's beam search of each prompt (``engine/beam_search.py``): the prompts checked now (a 400 for bad
        input, naming the field as sent), the searches run, side by side, as the answer is awaited. A prompt's
        ``max_tokens`` left out is the room ``max_model_len`` leaves it, as in vLLM."""
        engine = self.engine.engine
        batches = []
        try:
            for prompt in prompts:
                processed = await self.engine.process(prompt, SamplingParams(max_tokens=1))
                max_tokens = self.params.max_tokens or engine.max_model_len - len(processed.prompt_token_ids)
                params = self.body.beam_search_params(max_tokens, engine.default_sampling_params)
                batches.append(BeamBatch([processed], params, engine.eos_token_ids, engine.max_model_len,
                                         self.params.logprobs or 0))
        except ValueError as error:
            raise bad_request(self.body.named_as_sent(error)) from error
        finally:
            if self.admission is not None:  # from here on its steps' requests count as waiting, as they queue
                self.admission.close()
        logged = self.request_log.queued(self.request_id, self._engine_id, prompts, self.params)
        outputs = self._searched(batches, request_ids)
        return outputs if logged is None else logged.watched(outputs)

    async def _searched(self, batches: list[BeamBatch], request_ids: list[str]
                        ) -> AsyncGenerator[list[RequestOutput], None]:
        """The finished outputs of the searches, once all have run; one that fails (or a client gone) cancels the
        others, whose requests are aborted. A search's requests are queued only as it runs: one the engine refuses
        (a ``priority`` the policy does not take, a beam past the KV cache) is a 400 naming it, as its answer is
        not streamed and nothing is sent before it."""
        try:
            async with asyncio.TaskGroup() as searches:
                for batch, request_id in zip(batches, request_ids):
                    searches.create_task(beam_search_async(self.engine, batch, request_id, self.body.priority))
        except ExceptionGroup as failed:  # the first failure, as the engine raised it (a dead engine: 503)
            first = failed.exceptions[0]
            if isinstance(first, ValueError):
                raise bad_request(self.body.named_as_sent(first)) from first
            raise first from None
        yield [batch.request_outputs([request_id], self.tokenizer, self.params.skip_special_tokens)[0]
               for batch, request_id in zip(batches, request_ids)]


def queue_refusal(error: ValueError) -> APIError:
    """The answer to a request the engine refused to queue: 400 for bad input; 404 for a LoRA adapter unloaded
    while the request was on its way (as if it had come after the unload)."""
    if isinstance(error, RemovedLoRAAdapter):
        return APIError(HTTPStatus.NOT_FOUND, f"the model {error.lora_name!r} does not exist: its LoRA adapter was "
                                              "unloaded", param="model")
    return bad_request(error)


def salted(prompts: Sequence[PromptInput], salt: str | None) -> Sequence[PromptInput]:
    """The prompts carrying the request's ``cache_salt``, as vLLM's server hands it to its engine."""
    if salt is None:
        return prompts
    return [{"prompt": p, "cache_salt": salt} if isinstance(p, str) else {**p, "cache_salt": salt} for p in prompts]


async def ending_on_failure(events: AsyncIterator[str], request_id: str | None = None,
                            path: str = "") -> AsyncIterator[str]:
    """``events``; should they fail midway (the engine died), an error event in the shape of ``path``'s API
    (``sse_failure``): the headers went out with the first event, so a client reading the stream learns why it
    ended there. ``request_id``: the client's, which the log line names."""
    try:
        async for event in events:
            yield event
    except Exception as error:  # whatever failed, the client is told; a disconnect's cancellation passes
        yield sse_failure(HTTPStatus.INTERNAL_SERVER_ERROR, failure_message(error, request_id), path)


def failure_message(error: Exception, request_id: str | None) -> str:
    """What a client is told of a stream that failed midway with ``error``, logged once (naming the client's
    ``request_id``)."""
    named = f"the stream of request {request_id}" if request_id else "a stream"
    if isinstance(error, EngineDeadError):  # its cause is logged once, by the engine thread
        logger.warning("%s ended: the engine failed (%s)", named, error)
        return f"the engine failed: {error}"
    logger.exception("%s failed midway", named)
    return f"internal error: {type(error).__name__}"


def num_tokens_used(outputs: Sequence[RequestOutput]) -> tuple[int, int, int]:
    """(prompt tokens, completion tokens over every sample, prompt tokens found in the prefix cache) of a
    batch of requests."""
    num_prompt = sum(len(out.prompt_token_ids) for out in outputs)
    num_completion = sum(len(s.token_ids) for out in outputs for s in out.outputs)
    num_cached = sum(out.num_cached_tokens for out in outputs)
    return num_prompt, num_completion, num_cached


async def _prepend(first: T, rest: AsyncGenerator[T, None]) -> AsyncGenerator[T, None]:
    try:
        yield first
        async for item in rest:
            yield item
    finally:
        await rest.aclose()  # aborts whatever is unfinished


async def last_item(stream: AsyncIterator[T]) -> T:
    last = None
    async for last in stream:
        pass
    assert last is not None
    return last


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``; if the client goes away first, cancel it (aborting its requests) and raise APIError 499."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():
        raise APIError(499, "the client disconnected")
    return task.result()


async def _wait_for_disconnect(request: Request) -> None:
    """The body is already read, so the next ASGI message is the disconnect (uvicorn blocks until then)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
