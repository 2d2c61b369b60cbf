"""AsyncEngine over a model-free fake engine: streaming, batching, errors, aborts, idling, failure."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
from typing import Any

import pytest

from kvserve.engine import async_engine
from kvserve.engine.async_engine import AsyncEngine, EngineDeadError
from kvserve.engine.input_processor import InputProcessor
from kvserve.outputs import FinishReason, RequestOutput
from kvserve.sampling_params import InvalidParameter, SamplingParams, StructuredOutputsParams
from tests.engine.fake_engine import FakeEngine


class RecordingObserver:
    def __init__(self) -> None:
        self.added: list[str] = []
        self.finished: list[str] = []
        self.num_refreshes = 0

    def on_request_added(self, request_id: str, arrival_time: float) -> None:
        self.added.append(request_id)

    def on_step(self, outputs: list[RequestOutput], stats: dict[str, Any], step_start: float) -> None:
        self.finished += [o.request_id for o in outputs if o.finished]
        self.num_refreshes += 1


def run_with_engine(test, fake: FakeEngine | None = None, **engine_kwargs: Any) -> tuple[FakeEngine, AsyncEngine]:
    fake = fake or FakeEngine(**engine_kwargs)
    engine = AsyncEngine(fake, observer=RecordingObserver())
    engine.start()
    try:
        asyncio.run(asyncio.wait_for(test(engine), timeout=10))
    finally:
        engine.shutdown()
    return fake, engine


async def collect(engine: AsyncEngine, prompt: str, max_tokens: int) -> list[RequestOutput]:
    return [out async for out in engine.generate(prompt, SamplingParams(max_tokens=max_tokens))]


def test_generate_streams_cumulative_outputs_to_the_finished_one() -> None:
    async def test(engine: AsyncEngine) -> None:
        outputs = await collect(engine, "a", 5)
        final = outputs[-1]
        assert final.finished and final.outputs[0].finish_reason is FinishReason.LENGTH
        assert final.outputs[0].token_ids == [98, 99, 100, 101, 102]
        assert final.outputs[0].text == "bcdef"
        lengths = [len(o.outputs[0].token_ids) for o in outputs]
        assert lengths == sorted(lengths) and not any(o.finished for o in outputs[:-1])

    fake, engine = run_with_engine(test)
    assert fake.threads_seen == {"kvserve-engine"}  # the engine is only ever touched by its own thread
    assert fake.input_processor.threads_seen == {"kvserve-inputs_0"}  # prompts are tokenized beside the steps
    assert engine.observer.added == engine.observer.finished and len(engine.observer.added) == 1


def test_a_final_only_batch_is_woken_once_by_its_finished_outputs_and_stats_refresh_once_a_step() -> None:
    """A whole (non-streamed) answer reads only the final outputs: posting each step's woke its coroutines at
    every step, half of the event loop's time under 128 such requests. And the stats were refreshed twice a step,
    once more before it though no command had come."""
    async def test(engine: AsyncEngine) -> None:
        yielded = [outputs async for outputs in engine.generate_many(["a", "b"], SamplingParams(max_tokens=6),
                                                                     final_only=True)]
        assert all(out.finished for out in yielded[-1]) and len(yielded) <= 3  # the first output, then finishes
        assert [out.outputs[0].text for out in yielded[-1]] == ["bcdefg", "cdefgh"]

    fake, engine = run_with_engine(test)
    assert engine.observer.num_refreshes == fake.num_steps + 1  # each step, and the add


def test_bad_input_raises_value_error_and_queues_nothing() -> None:
    async def test(engine: AsyncEngine) -> None:
        with pytest.raises(ValueError, match="max_model_len"):
            await collect(engine, "x" * 60, 10)
        # a batch is all or nothing: the good first prompt is not left running
        with pytest.raises(ValueError, match="empty"):
            async for _ in engine.generate_many(["fine", ""], SamplingParams(max_tokens=3)):
                pass
        assert engine.num_unfinished() == 0
        assert (await collect(engine, "b", 2))[-1].finished

    fake, _ = run_with_engine(test)
    assert not fake.requests


def test_many_concurrent_requests_all_finish_with_their_token_count() -> None:
    async def test(engine: AsyncEngine) -> None:
        results = await asyncio.gather(*(collect(engine, chr(65 + i % 26), 3 + i % 7) for i in range(40)))
        for i, outputs in enumerate(results):
            assert len(outputs[-1].outputs[0].token_ids) == 3 + i % 7

    run_with_engine(test, max_num_seqs=8)


def test_generate_many_yields_every_request_of_the_batch() -> None:
    async def test(engine: AsyncEngine) -> None:
        last = None
        async for last in engine.generate_many(["a", "b", "c"], SamplingParams(max_tokens=4), ["x", "y", "z"]):
            assert [o.request_id for o in last] == ["x", "y", "z"]
        assert all(o.finished and len(o.outputs[0].token_ids) == 4 for o in last)

    run_with_engine(test)


def test_a_consumer_that_stops_early_aborts_its_request() -> None:
    async def test(engine: AsyncEngine) -> None:
        stream = engine.generate("a", SamplingParams(max_tokens=50))
        await anext(stream)
        await stream.aclose()
        streaming = asyncio.Event()

        async def consume() -> None:
            async for _ in engine.generate("b", SamplingParams(max_tokens=60)):
                streaming.set()

        task = asyncio.create_task(consume())
        await streaming.wait()  # cancelled mid-stream, not before it submitted anything
        assert engine.num_unfinished() == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await engine.call(lambda e: None)  # the aborts are queued before this command, so they have run
        assert engine.num_unfinished() == 0
        assert engine.stats()["num_blocks_used"] == 0

    fake, _ = run_with_engine(test, step_seconds=0.01)  # b's 60 tokens take 0.6 s: it is cancelled mid-stream
    assert not fake.requests


def test_the_loop_sleeps_when_idle() -> None:
    async def test(engine: AsyncEngine) -> None:
        await collect(engine, "a", 2)
        steps = engine.engine.num_steps
        await asyncio.sleep(0.2)
        assert engine.engine.num_steps == steps

    run_with_engine(test)


def test_call_runs_on_the_engine_thread_and_passes_exceptions_back() -> None:
    async def test(engine: AsyncEngine) -> None:
        assert await engine.call(lambda e: threading.current_thread().name) == "kvserve-engine"
        with pytest.raises(KeyError):
            await engine.call(lambda e: {}["missing"])

    run_with_engine(test)


def test_a_failing_step_fails_every_request_instead_of_hanging() -> None:
    async def test(engine: AsyncEngine) -> None:
        engine.engine.step_error = RuntimeError("device lost")
        with pytest.raises(EngineDeadError, match="device lost"):
            await collect(engine, "a", 5)
        assert not engine.is_running
        with pytest.raises(EngineDeadError):
            await collect(engine, "b", 5)

    run_with_engine(test)


def test_a_step_that_fails_behind_a_cancelled_command_still_fails_every_request() -> None:
    """A client gone while its command waited behind the failing step (a disconnect during a chat's render):
    failing its cancelled future raised on the engine thread, before any stream was told, and every stream hung."""
    in_step, release = threading.Event(), threading.Event()

    def blocked_step() -> list[RequestOutput]:
        in_step.set()
        release.wait(5)
        raise RuntimeError("device lost")

    async def test(engine: AsyncEngine) -> None:
        stream = asyncio.create_task(collect(engine, "a", 50))
        await asyncio.to_thread(in_step.wait, 5)  # the stream's first step blocks; its failure is to come
        gone = asyncio.create_task(engine.call(lambda e: None))
        await asyncio.sleep(0.05)
        gone.cancel()
        await asyncio.sleep(0.05)
        release.set()
        with pytest.raises(EngineDeadError, match="device lost"):
            await asyncio.wait_for(stream, 5)
        with pytest.raises(asyncio.CancelledError):
            await gone

    fake = FakeEngine()
    fake.step = blocked_step
    run_with_engine(test, fake)


def test_a_request_whose_event_loop_closed_is_aborted_and_the_engine_serves_on() -> None:
    """A stream begun under an ``asyncio.run`` that returned after its first output: delivering its next output
    (or its abort) to the closed loop raised on the engine thread and stopped the engine for every caller."""
    fake = FakeEngine(step_seconds=0.01)
    engine = AsyncEngine(fake)
    engine.start()

    async def first_output_only() -> None:
        stream = engine.generate("a", SamplingParams(max_tokens=60))
        await anext(stream)  # asyncio.run then closes the loop with the stream still running

    try:
        asyncio.run(first_output_only())
        asyncio.run(first_output_only())
        deadline = time.monotonic() + 5
        while fake.requests and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.is_running and not fake.requests
        assert len(asyncio.run(collect(engine, "b", 3))) == 3
    finally:
        engine.shutdown()


def test_shutdown_aborts_requests_in_flight_and_refuses_new_ones() -> None:
    fake = FakeEngine()
    engine = AsyncEngine(fake)
    engine.start()
    fake.max_num_seqs = 0  # nothing makes progress: the request can only end by the shutdown

    async def test() -> None:
        task = asyncio.create_task(collect(engine, "a", 5))
        deadline = time.monotonic() + 5
        while engine.num_unfinished() == 0:  # shut down with the request in flight, not before it arrives
            assert time.monotonic() < deadline, "the request never reached the engine"
            await asyncio.sleep(0.005)
        started = time.monotonic()
        await asyncio.to_thread(engine.shutdown)
        outputs = await task
        assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason is FinishReason.ABORT
        with pytest.raises(EngineDeadError):
            await collect(engine, "b", 5)
        assert time.monotonic() - started < 2

    asyncio.run(asyncio.wait_for(test(), timeout=10))
    assert not fake.requests
    assert fake.num_kv_flushes == 1  # blocks due to the KV disk tier are written before the engine stops


def test_a_consumer_that_falls_behind_holds_one_output_of_its_request() -> None:
    """Outputs are cumulative: a client that stops reading its stream (its socket full) costs one output, not one
    a step, each holding everything so far (with n > 1 and logprobs that grew as the square of the length)."""
    async def test(engine: AsyncEngine) -> None:
        stream = engine.generate("a", SamplingParams(max_tokens=60), request_id="slow")
        first = await anext(stream)
        while engine.num_unfinished():  # the request runs to its end while nobody reads
            await asyncio.sleep(0.01)
        # a command runs after the step that delivered the last output, and its answer reaches this loop after
        # that delivery (both by call_soon_threadsafe, in order): the mailbox holds everything by then
        await engine.call(lambda _: None)
        alive = [o for o in gc.get_objects() if isinstance(o, RequestOutput) and o.request_id == "slow"]
        assert len(alive) <= 2, len(alive)  # the one read, and the latest
        rest = [out async for out in stream]
        assert len(rest) == 1 and rest[0].finished and len(rest[0].outputs[0].token_ids) == 60
        assert not first.finished

    run_with_engine(test)


def test_a_worker_that_dies_while_the_engine_idles_fails_it_within_a_second(monkeypatch) -> None:
    """Not at the next request: the server's health turns 503 and it stops, so that it is restarted."""
    monkeypatch.setattr(async_engine, "IDLE_CHECK_SECONDS", 0.05)

    async def test(engine: AsyncEngine) -> None:
        await collect(engine, "a", 2)
        fake.worker_failure = RuntimeError("worker rank 1 (pid 7) died (signal SIGKILL)")
        for _ in range(100):
            if engine.failure is not None:
                break
            await asyncio.sleep(0.02)
        assert "worker rank 1" in str(engine.failure) and not engine.is_running

    fake = FakeEngine()
    engine = AsyncEngine(fake)
    engine.start()
    try:
        asyncio.run(asyncio.wait_for(test(engine), timeout=10))
    finally:
        engine.shutdown()


def test_a_constraint_compiles_off_the_engine_thread(monkeypatch) -> None:
    """A constraint can take xgrammar seconds to compile: not on the engine thread, where every stream would wait."""
    threads: list[str] = []

    async def test(engine: AsyncEngine) -> None:
        monkeypatch.setattr(engine.engine.input_processor, "check_constraint",
                            lambda spec: threads.append(threading.current_thread().name), raising=False)
        await engine.compile_constraint(StructuredOutputsParams(regex="a+"))

    run_with_engine(test)
    assert len(threads) == 1 and threads[0].startswith("kvserve-compile")


def test_a_compiled_constraint_waits_behind_no_slow_compile(monkeypatch) -> None:
    """Compiles shared asyncio's default threads with the answers being built, and a cached constraint went
    through them too: 8 slow regexes held a 2-token answer 39 s and a cached one's TTFT 5 s."""
    release = threading.Event()

    async def test(engine: AsyncEngine) -> None:
        processor = engine.engine.input_processor
        monkeypatch.setattr(processor, "check_constraint", lambda spec: release.wait(5), raising=False)
        monkeypatch.setattr(processor, "constraint_compiled", lambda spec: spec.regex == "cached", raising=False)
        slow = [asyncio.create_task(engine.compile_constraint(StructuredOutputsParams(regex=f"slow{i}")))
                for i in range(4)]
        await asyncio.sleep(0.05)
        await asyncio.wait_for(engine.compile_constraint(StructuredOutputsParams(regex="cached")), 0.5)
        assert await asyncio.wait_for(asyncio.to_thread(lambda: "answer built"), 0.5) == "answer built"
        assert not any(task.done() for task in slow)
        release.set()
        await asyncio.gather(*slow)

    run_with_engine(test)


class ThreadRecordingProcessor(InputProcessor):
    """An InputProcessor that notes the thread each tokenization ran on."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.threads: list[str] = []

    def tokenize_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.threads.append(threading.current_thread().name)
        return super().tokenize_text(text, add_special_tokens)


def test_tokenize_detokenize_and_render_chat_run_on_the_inputs_thread(monkeypatch) -> None:
    """The server's way to the tokenizer: typed calls, no reach into the engine's input processor; they run beside
    the steps (a 650 KB prompt tokenized on the engine thread held every stream for 1.7 s)."""
    fake = FakeEngine()
    processor = ThreadRecordingProcessor(fake.tokenizer, vocab_size=256, max_model_len=64)
    monkeypatch.setattr(fake, "input_processor", processor)

    async def test(engine: AsyncEngine) -> None:
        assert await engine.tokenize("hé") == [104, 195, 169]
        assert await engine.detokenize([104, 195, 169]) == "hé"
        with pytest.raises(InvalidParameter, match=r"token_ids: 256 is not a token id .*vocabulary size 256") as error:
            await engine.detokenize([104, 256])
        assert error.value.param == "token_ids"
        with pytest.raises(ValueError, match="no chat template"):  # the byte tokenizer has none
            await engine.render_chat([{"role": "user", "content": "hi"}])

    run_with_engine(test, fake)
    assert processor.threads == ["kvserve-inputs_0"]


def test_a_slow_tokenization_holds_no_step_back(monkeypatch) -> None:
    """A prompt is tokenized and checked on the inputs thread while the steps go on: on the engine thread, one
    650 KB prompt held every stream still for 1.7 s (and was then refused)."""
    fake = FakeEngine(max_model_len=256)
    steps_while_tokenizing: list[int] = []
    process = fake.input_processor.process

    def slow_process(prompt: Any, params: SamplingParams) -> Any:
        if prompt == "slow":
            before = fake.num_steps
            time.sleep(0.5)
            steps_while_tokenizing.append(fake.num_steps - before)
        return process(prompt, params)

    monkeypatch.setattr(fake.input_processor, "process", slow_process)

    async def test(engine: AsyncEngine) -> None:
        running = asyncio.ensure_future(collect(engine, "a", 200))
        while fake.num_steps < 2:
            await asyncio.sleep(0.01)
        assert (await collect(engine, "slow", 3))[-1].finished
        assert (await running)[-1].finished

    run_with_engine(test, fake)
    (num_steps,) = steps_while_tokenizing
    assert num_steps > 0  # every step, unless the machine is very busy: one is enough to show it was not held


def test_commands_that_keep_coming_wait_for_the_next_step() -> None:
    """A drain runs the commands queued when it began: run until none was queued, callers who kept queueing
    (16 clients looping /tokenize) held every stream still for as long as they kept at it."""
    fake = FakeEngine()
    num_commands = 0

    async def test(engine: AsyncEngine) -> None:
        start = fake.num_steps

        def queue_another(_: Any) -> None:  # a caller always queueing one more, until three steps have run
            nonlocal num_commands
            num_commands += 1
            if fake.num_steps < start + 3:
                engine._submit(queue_another, None)

        engine._submit(queue_another, None)
        outputs = await collect(engine, "a", 5)
        assert outputs[-1].finished and [len(o.outputs[0].token_ids) for o in outputs][-1] == 5

    run_with_engine(test, fake)
    assert num_commands >= 4  # one drained before each step


def test_input_work_in_flight_or_queued_at_shutdown_ends_in_engine_dead_errors(monkeypatch) -> None:
    """A request being tokenized, or queued behind one, when the engine shuts down is told the engine stopped, as
    one that comes after; none is left waiting, nor cancelled without a word."""
    fake = FakeEngine()
    started = slow_prompt_processing(fake, monkeypatch)
    engine = AsyncEngine(fake)
    engine.start()

    async def test() -> None:
        calls = [asyncio.ensure_future(collect(engine, prompt, 3)) for prompt in ("a", "b")]
        await asyncio.to_thread(started.wait)  # "a" on the inputs thread, "b" queued behind it
        await asyncio.to_thread(engine.shutdown)
        for call in calls:
            with pytest.raises(EngineDeadError):
                await call
        with pytest.raises(EngineDeadError):
            await engine.tokenize("c")

    asyncio.run(asyncio.wait_for(test(), timeout=10))
    assert not fake.requests


def test_abort_all_aborts_a_request_still_being_tokenized(monkeypatch) -> None:
    """The server's shutdown aborts every request once its grace is over: one still on the inputs thread (or
    being rendered, or its constraint compiled) was added after the abort and ran to its max_tokens, the shutdown
    waiting for it. Every add after an abort_all is aborted as it lands."""
    fake = FakeEngine(step_seconds=0.01)
    started = slow_prompt_processing(fake, monkeypatch)

    async def test(engine: AsyncEngine) -> None:
        call = asyncio.ensure_future(collect(engine, "a", 50))
        await asyncio.to_thread(started.wait)  # on the inputs thread
        engine.abort_all()
        final = (await call)[-1]
        assert final.finished and final.outputs[0].finish_reason is FinishReason.ABORT
        assert len(final.outputs[0].token_ids) < 50
        later = (await collect(engine, "b", 50))[-1]  # the server is shutting down: one added after is aborted too
        assert later.outputs[0].finish_reason is FinishReason.ABORT and len(later.outputs[0].token_ids) < 50

    run_with_engine(test, fake)
    assert not fake.requests


def slow_prompt_processing(fake: FakeEngine, monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Each prompt takes 0.3 s on the inputs thread; the event is set as the first one starts."""
    process, started = fake.input_processor.process, threading.Event()

    def slow_process(prompt: Any, params: SamplingParams) -> Any:
        started.set()
        time.sleep(0.3)
        return process(prompt, params)

    monkeypatch.setattr(fake.input_processor, "process", slow_process)
    return started
