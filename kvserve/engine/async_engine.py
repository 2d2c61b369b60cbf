"""AsyncEngine: the LLMEngine's step loop in one background thread, driven from asyncio.

::

    asyncio (HTTP)                         inputs thread          engine thread
    --------------                         -------------          -------------
    generate() --------------------------> tokenize, check ----> commands: drain those queued (add / abort ...)
                                                                  step()  -> outputs
    await mailbox.take() <--call_soon_threadsafe-- each call's mailbox (one call a step for all of them)

Everything that touches the engine runs on the engine thread, between two steps, so the engine needs no locks;
each drain runs only the commands queued when it began, so that callers who keep queueing cannot hold the next
step back. What reads only the tokenizer and the model's limits (a prompt tokenized and checked, a chat rendered,
/tokenize, /detokenize: a megabyte of text takes seconds) runs on an inputs thread of its own, beside the steps,
as vLLM's and SGLang's servers tokenize outside their engine loop: the tokenizer's Rust encoder lets go of the GIL,
and the engine thread only decodes. When no request is unfinished and no command is queued the engine thread
sleeps on a condition (no busy spin).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncGenerator, Callable, Mapping, Protocol, Sequence, TypeVar

from kvserve.engine.gc_freeze import heap_frozen
from kvserve.outputs import PoolingRequestOutput, RequestOutput
from kvserve.pooling_params import PoolingParams
from kvserve.lora_request import LoRARequest
from kvserve.sampling_params import SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    from kvserve.engine.input_processor import ChatMessages, ProcessedPrompt, PromptInput
    from kvserve.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)

T = TypeVar("T")
IDLE_CHECK_SECONDS = 1.0  # how often an idle engine looks at its tensor-parallel workers
SHUTDOWN_FLUSH_SECONDS = 30.0  # at most this long for queued KV block writes at shutdown
MAX_IDS_LOGGED = 16  # a log line names at most this many request ids
COMPILE_THREADS = 2  # structured-output constraints compiled at once


class EngineDeadError(RuntimeError):
    """The engine thread stopped (shut down, or a step raised): no request can make progress."""


class StepObserver(Protocol):
    """Told, on the engine thread, what the engine did; the server's metrics implement it."""

    def on_request_added(self, request_id: str, arrival_time: float) -> None: ...

    def on_step(self, outputs: list[RequestOutput], stats: dict[str, Any], step_start: float) -> None: ...


class _Mailbox:
    """The outputs of one ``generate_many`` call not yet taken: the latest of each request, or the error that
    ended them. Each output is cumulative, so a newer one replaces an older one unread: a consumer that falls
    behind (a client that does not read its stream) holds one output a request, not one a step."""

    def __init__(self) -> None:
        self._latest: dict[str, RequestOutput] = {}
        self._error: BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, item: RequestOutput | BaseException) -> None:
        if isinstance(item, BaseException):
            self._error = item
        else:
            self._latest[item.request_id] = item
        self._ready.set()

    async def take(self) -> list[RequestOutput]:
        """Wait for something new; the outputs that came since the last take, or raise the error."""
        await self._ready.wait()
        self._ready.clear()
        if self._error is not None:
            raise self._error
        outputs = list(self._latest.values())
        self._latest.clear()
        return outputs


@dataclass
class _Stream:
    """The asyncio side of one request: outputs are delivered to ``mailbox`` on ``loop``."""

    loop: asyncio.AbstractEventLoop
    mailbox: _Mailbox
    # after its first output, only finished ones are posted: a whole (non-streamed) answer reads nothing else,
    # and waking its coroutines at every step took half of a loop's time under 128 such requests. The first
    # still is: a server waits for it as the sign the batch was accepted (then watches for its client leaving)
    final_only: bool = False
    has_output: bool = False


class Admission:
    """One request let in by ``AsyncEngine.admit``, counted as waiting while open."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine
        self._open = True

    def close(self) -> None:
        """Stop counting it (idempotent): it was queued, or refused before that."""
        with self._engine._wakeup:
            self.close_locked()

    def close_locked(self) -> None:
        """``close``, with the engine's lock held."""
        if self._open:
            self._open = False
            self._engine._num_admitted -= 1


class AsyncEngine:
    """Runs ``engine`` in a background thread; ``generate`` streams each request's cumulative outputs."""

    def __init__(self, engine: LLMEngine, observer: StepObserver | None = None) -> None:
        self.engine = engine
        self.observer = observer
        self._commands: deque[tuple[Callable[[LLMEngine], Any], Future | None]] = deque()
        self._wakeup = threading.Condition()
        self._streams: dict[str, _Stream] = {}  # owned by the engine thread
        self._stats: dict[str, Any] = engine.stats()
        self._num_pending_adds = 0
        self._num_admitted = 0  # admissions still open (``admit``)
        self._aborting_all = False  # ``abort_all`` was called: every add is aborted as it lands
        self._request_counter = itertools.count()
        self._stopped = False
        self._error: BaseException | None = None
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kvserve-engine", daemon=True)
        # constraints compile on threads of their own: a slow one (a regex of nested stars took minutes) then
        # delays only the constrained requests behind it, not the answers built on asyncio's default threads
        self._compiling = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="kvserve-compile")
        # one thread: requests are tokenized in the order they came, and a step's Python shares the GIL with one
        self._inputs = ThreadPoolExecutor(1, thread_name_prefix="kvserve-inputs")

    # ---- lifecycle ----

    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float | None = 10.0) -> None:
        """Abort every request, stop the loop and join the thread."""
        with self._wakeup:
            self._stopped = True
            self._wakeup.notify()
        self._thread.join(timeout)
        self._compiling.shutdown(wait=False, cancel_futures=True)
        # work queued there finishes (bounded: no text longer than a context could hold is tokenized); its add then
        # finds the engine stopped and says so, where a cancelled future would drop its caller's answer unsaid
        self._inputs.shutdown(wait=False)

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stopped

    @property
    def failure(self) -> BaseException | None:
        """What stopped the engine loop, if a step or command failed (None while it runs, or after a shutdown)."""
        return self._failure

    # ---- the asyncio side ----

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run ``fn(engine)`` on the engine thread between two steps and return (or raise) its result: what the
        typed methods below are made of (and tests' probes of the engine thread); a server calls those instead."""
        future: Future[T] = Future()
        self._submit(fn, future)
        return await asyncio.wrap_future(future)

    async def sleep(self, level: int) -> None:
        """Abort every unfinished request (vLLM's ``mode="abort"``), then put the engine to sleep
        (``LLMEngine.sleep``), in one command on the engine thread: no request lands between the two, and those
        that land after are refused (``EngineAsleep``). A sleep refused (``LLMEngine.check_sleep``) aborts nothing."""
        def abort_and_sleep(engine: LLMEngine) -> None:
            engine.check_sleep(level)
            self._abort_now(list(self._streams))
            engine.sleep(level)

        await self.call(abort_and_sleep)

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """``text``'s token ids, tokenized on the inputs thread; ValueError for a text no context could hold."""
        return await self._on_inputs(lambda: self.engine.input_processor.tokenize_text(text, add_special_tokens))

    async def detokenize(self, token_ids: Sequence[int]) -> str:
        """The text of ``token_ids``, decoded on the inputs thread; InvalidParameter naming ``token_ids`` for an id
        that is none of this model's."""
        def decode() -> str:
            self.engine.input_processor.check_token_ids(token_ids, "token_ids")
            return self.engine.tokenizer.decode(token_ids)

        return await self._on_inputs(decode)

    async def process(self, prompt: PromptInput, params: SamplingParams) -> ProcessedPrompt:
        """``prompt`` tokenized and checked with ``params`` (``InputProcessor.process``) on the inputs thread,
        nothing queued: what a driver above the engine (beam search) reads before it queues requests; ValueError
        naming what is wrong."""
        return await self._on_inputs(lambda: self.engine.input_processor.process(prompt, params))

    async def render_chat(self, messages: ChatMessages, tools: Sequence[Mapping[str, Any]] | None = None,
                          **options: Any) -> dict[str, Any]:
        """A conversation (and its tools) rendered with the model's chat template into a token-id prompt
        (``InputProcessor.apply_chat_template``, which takes ``options`` as keywords: ``add_generation_prompt``,
        ``continue_final_message``, ...), on the inputs thread; ValueError naming what is wrong."""
        return await self._on_inputs(lambda: self.engine.input_processor.apply_chat_template(
            messages, tools=tools, **options))

    async def compile_constraint(self, spec: StructuredOutputsParams) -> None:
        """Compile a structured-output constraint on a compile thread (xgrammar lets go of the GIL while it
        compiles), so that no step waits on it: the request's add on the engine thread then finds it in
        the compiler's cache, as does a later request's, at once. ValueError naming the problem if it does not
        compile."""
        processor = self.engine.input_processor
        if processor.constraint_compiled(spec):
            return
        await asyncio.get_running_loop().run_in_executor(self._compiling, processor.check_constraint, spec)

    async def generate(
        self, prompt: PromptInput, params: SamplingParams, request_id: str | None = None, priority: int = 0
    ) -> AsyncGenerator[RequestOutput, None]:
        """Queue one request and yield its cumulative outputs until the finished one.

        Outputs may be coalesced: when the consumer falls behind, only the latest output is yielded (each is
        cumulative, so nothing is lost). Bad input raises ValueError before anything is yielded. If the
        consumer stops early (cancelled, closed, disconnected client), the request is aborted and its KV
        blocks are freed. ``priority``: ``LLMEngine.add_request``'s.
        """
        stream = self.generate_many([prompt], params, [request_id] if request_id else None, priority=priority)
        async with contextlib.aclosing(stream):
            async for outputs in stream:
                yield outputs[0]

    async def generate_many(
        self, prompts: Sequence[PromptInput], params: SamplingParams | PoolingParams,
        request_ids: Sequence[str] | None = None,
        admission: Admission | None = None, final_only: bool = False, priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> AsyncGenerator[list[RequestOutput], None]:
        """Queue several requests with the same params, all or none (one bad prompt raises ValueError and
        queues nothing), and yield, each time any of them moves (with ``final_only``: the first time, then as
        each finishes), the latest output of each request in input order; a request that has not produced
        anything yet appears as an output with no samples. ``admission``: the one ``admit`` gave these requests,
        closed as their add takes over its count. ``priority`` and ``lora_request``: each request's
        (``LLMEngine.add_request``). With ``PoolingParams`` the requests are pooling ones (``encode``)."""
        ids = list(request_ids) if request_ids else [f"req-{next(self._request_counter)}" for _ in prompts]
        stream = _Stream(asyncio.get_running_loop(), _Mailbox(), final_only)
        mailbox = stream.mailbox
        try:
            await self._add(ids, prompts, params, stream, admission, priority, lora_request)
        except asyncio.CancelledError:  # the add may have run before the cancellation reached it
            self.abort(ids)
            raise
        latest = [_placeholder(rid) for rid in ids]
        index = {rid: i for i, rid in enumerate(ids)}
        num_finished = 0
        try:
            while num_finished < len(ids):
                for out in await mailbox.take():
                    latest[index[out.request_id]] = out
                    num_finished += out.finished
                yield list(latest)
        finally:
            unfinished = [out.request_id for out in latest if not out.finished]
            if unfinished:
                self.abort(unfinished)

    async def encode(
        self, prompts: Sequence[PromptInput], params: PoolingParams, request_ids: Sequence[str] | None = None,
        admission: Admission | None = None, priority: int = 0, lora_request: LoRARequest | None = None,
    ) -> list[PoolingRequestOutput]:
        """Queue pooling requests (all or none: ValueError naming what is wrong, nothing queued) and return their
        outputs in input order once every one has run; cancelled meanwhile, those not finished are aborted. The
        arguments are ``generate_many``'s."""
        outputs: list[Any] = []
        stream = self.generate_many(prompts, params, request_ids, admission, final_only=True, priority=priority,
                                    lora_request=lora_request)
        async with contextlib.aclosing(stream):
            async for outputs in stream:
                pass
        return outputs

    def abort(self, request_ids: Sequence[str]) -> None:
        """Abort requests (a no-op for finished or unknown ids); their KV blocks are freed on the engine thread.
        Once the engine has stopped there is nothing left to abort, and this does nothing."""
        ids = list(request_ids)
        try:
            self._submit(lambda _: self._abort_now(ids), None)
        except EngineDeadError:
            pass

    def abort_all(self) -> None:
        """Abort every unfinished request, and every one added from now on (the server's shutdown, once its grace
        period is over: a request still being rendered, compiled or tokenized then is aborted as its add lands)."""
        with self._wakeup:
            self._aborting_all = True
        try:
            self._submit(lambda _: self._abort_now(list(self._streams)), None)
        except EngineDeadError:
            pass

    def num_waiting(self) -> int:
        """Requests queued but not yet running: the engine's waiting queue plus adds not yet handed to it, and
        requests admitted that have not reached their add."""
        with self._wakeup:
            return self._stats.get("num_waiting", 0) + self._num_pending_adds + self._num_admitted

    def admit(self, max_waiting: int) -> Admission | None:
        """Let one request in while at most ``max_waiting`` wait, else None. It counts as waiting from
        now until ``generate_many`` queues it (given the admission) or the admission is closed (refused before
        that): a chat template's render or the step under way may come first, and each request of a burst
        admitted meanwhile must see those before it."""
        with self._wakeup:
            num_waiting = self._stats.get("num_waiting", 0) + self._num_pending_adds + self._num_admitted
            if num_waiting > max_waiting:
                return None
            self._num_admitted += 1
        return Admission(self)

    def num_unfinished(self) -> int:
        """Requests added (or being added) that have not finished."""
        with self._wakeup:
            return len(self._streams) + self._num_pending_adds

    def stats(self) -> dict[str, Any]:
        """The engine's stats as of the end of the last step or command (see ``LLMEngine.stats``)."""
        with self._wakeup:
            return dict(self._stats)

    async def _on_inputs(self, fn: Callable[[], T]) -> T:
        """``fn()`` run on the inputs thread (work that reads only the tokenizer and the model's limits);
        EngineDeadError once the engine has stopped, as for a command."""
        try:
            future = None if self._stopped else self._inputs.submit(fn)
        except RuntimeError:  # shut down meanwhile: the executor takes no more work
            future = None
        if future is None:
            raise EngineDeadError("the engine is not running") from self._error
        return await asyncio.wrap_future(future)

    async def _add(
        self, ids: list[str], prompts: Sequence[PromptInput], params: SamplingParams | PoolingParams, stream: _Stream,
        admission: Admission | None, priority: int, lora_request: LoRARequest | None,
    ) -> None:
        arrival_time = time.monotonic()

        def add(engine: LLMEngine, processed: list[ProcessedPrompt]) -> None:
            added: list[str] = []
            try:
                for rid, prompt in zip(ids, processed):
                    if rid in self._streams:
                        raise ValueError(f"request id {rid!r} is already in use")
                    engine.add_processed(rid, prompt, priority, lora_request)
                    self._streams[rid] = stream
                    added.append(rid)
            except BaseException:
                self._withdraw(added)
                raise
            if self.observer:  # only a batch accepted whole is a request the metrics count
                for rid in ids:
                    self.observer.on_request_added(rid, arrival_time)
            stats = engine.stats()  # counting them before the caller resumes and drops them from the pending adds
            with self._wakeup:
                self._stats = stats
            if self._aborting_all:  # it was on its way when every request was aborted
                self._abort_now(ids)

        # Counted as waiting until the caller hears back: briefly counted twice (here and in the engine's
        # stats, refreshed by the add itself), which only makes admission stricter, never looser.
        with self._wakeup:
            self._num_pending_adds += len(ids)
            if admission is not None:
                admission.close_locked()
        try:
            engine = self.engine  # all prompts checked before any is queued
            processed = await self._on_inputs(lambda: [engine.process(prompt, params) for prompt in prompts])
            await self.call(lambda engine: add(engine, processed))
        finally:
            with self._wakeup:
                self._num_pending_adds -= len(ids)

    # ---- the engine thread ----

    def _submit(self, fn: Callable[[LLMEngine], Any], future: Future | None) -> None:
        with self._wakeup:
            if self._stopped:
                raise EngineDeadError("the engine is not running") from self._error
            self._commands.append((fn, future))
            self._wakeup.notify()

    def _run(self) -> None:
        with heap_frozen(collect_first=True):  # a server's heap is mostly the model's: no full walk of it
            self._loop()

    def _loop(self) -> None:
        try:
            while self._wait_for_work():
                self._run_commands()
                if self.engine.has_unfinished_requests():
                    step_start = time.monotonic()
                    self._deliver(self.engine.step(), step_start)
        except BaseException as e:
            logger.exception("the engine loop failed; failing its requests: %s", _listed(list(self._streams)))
            self._failure = e
            self._fail_everything(e)
        else:
            self._run_commands()
            self._abort_now(list(self._streams))
            self.engine.flush_kv_offload(SHUTDOWN_FLUSH_SECONDS)  # a restart finds every computed block on disk
            self._fail_everything(EngineDeadError("the engine was shut down"))
        finally:
            self.engine.close()  # tensor-parallel workers, if any

    def _wait_for_work(self) -> bool:
        """Sleep until a command arrives or requests are unfinished; False once shut down."""
        with self._wakeup:
            while not self._stopped and not self._commands and not self.engine.has_unfinished_requests():
                if not self._wakeup.wait(IDLE_CHECK_SECONDS):
                    # a tensor-parallel worker that dies while nothing runs fails the engine now (health 503, the
                    # server restarted), not the next request
                    self.engine.check_workers()
            return not self._stopped

    def _run_commands(self) -> None:
        """Run the commands queued now, not those queued meanwhile: callers who keep queueing commands (adds,
        aborts) would otherwise hold every running request's next step back for as long as they keep at it."""
        with self._wakeup:
            num_queued = len(self._commands)
        for _ in range(num_queued):
            with self._wakeup:
                fn, future = self._commands.popleft()
            if future is not None and not future.set_running_or_notify_cancel():
                continue  # its caller was cancelled before it ran
            try:
                result = fn(self.engine)
            except Exception as e:  # handed to the caller, who decides what it means
                if future is None:
                    raise
                future.set_exception(e)
            else:
                if future is not None:
                    future.set_result(result)
        if num_queued:  # else the stats are the last step's, refreshed as it was delivered
            self._refresh_stats([], time.monotonic())

    def _withdraw(self, request_ids: list[str]) -> None:
        """Take back the requests of a batch refused as a whole: they leave the engine (their KV blocks freed)
        unreported, since the caller gets the refusal instead."""
        self.engine.abort_request(request_ids)
        for rid in request_ids:
            del self._streams[rid]

    def _abort_now(self, request_ids: list[str]) -> None:
        live = [rid for rid in request_ids if rid in self._streams]
        if live:
            self._deliver(self.engine.abort_request(live), time.monotonic())

    def _deliver(self, outputs: list[RequestOutput], step_start: float) -> None:
        # Stats and the observer first: a client that got its answer then reads metrics that include it.
        self._refresh_stats(outputs, step_start)
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Mailbox, RequestOutput]]] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None or (stream.final_only and stream.has_output and not out.finished):
                continue
            stream.has_output = True
            if out.finished:
                del self._streams[out.request_id]
            by_loop.setdefault(stream.loop, []).append((stream.mailbox, out))
        # one wake-up of each loop for the whole step (each call_soon_threadsafe writes to the loop's self-pipe)
        closed = {loop for loop, items in by_loop.items() if not _posted(loop, _put_all, items)}
        if closed:  # their callers are gone with them: their requests' aborts were never to arrive
            self._abort_now([rid for rid, stream in self._streams.items() if stream.loop in closed])

    def _refresh_stats(self, outputs: list[RequestOutput], step_start: float) -> None:
        stats = self.engine.stats()
        with self._wakeup:
            self._stats = stats
        if self.observer:
            self.observer.on_step(outputs, stats, step_start)

    def _fail_everything(self, error: BaseException) -> None:
        with self._wakeup:
            self._error = error
            self._stopped = True
            futures = [future for _, future in self._commands if future is not None]
            self._commands.clear()
        for stream in self._streams.values():
            _posted(stream.loop, stream.mailbox.put, EngineDeadError(str(error)))
        self._streams.clear()
        for future in futures:  # callers waiting on a command see the failure instead of hanging
            if future.set_running_or_notify_cancel():  # not one whose caller was cancelled (that raised here)
                future.set_exception(EngineDeadError(str(error)))


def _listed(request_ids: list[str]) -> str:
    """Request ids for a log line: the first ``MAX_IDS_LOGGED`` of them, and how many there are."""
    if not request_ids:
        return "none"
    more = ", ..." if len(request_ids) > MAX_IDS_LOGGED else ""
    return f"{len(request_ids)} ({', '.join(request_ids[:MAX_IDS_LOGGED])}{more})"


def _posted(loop: asyncio.AbstractEventLoop, callback: Callable[..., None], *args: Any) -> bool:
    """Whether ``callback`` was handed to ``loop``: not if the loop is closed (a request begun under an
    ``asyncio.run`` that has returned), which must not stop the engine for every other caller."""
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:  # "Event loop is closed"
        return False
    return True


def _put_all(items: list[tuple[_Mailbox, RequestOutput]]) -> None:
    for mailbox, out in items:
        mailbox.put(out)


def _placeholder(request_id: str) -> RequestOutput:
    return RequestOutput(request_id=request_id, prompt=None, prompt_token_ids=[], outputs=[])
