"""The overlapped scheduler (``LLMEngine.overlap_scheduling``, on by default on CUDA): the next decode step scheduled
and launched before the last one's tokens are read back, its input ids taken from them on the device, gives
exactly the outputs of the plain loop, through EOS, stop strings, max_tokens, logprobs, n > 1, preemption,
prefix hits, aborts, seeded draws, penalties, grammars (their draws deferred), and speculation, which it does not
continue, and leaves no block behind. On CPU a launch finishes the step's work before it returns, so these tests
check the ordering and bookkeeping; its speed is measured on a GPU (docs/benchmarks.md)."""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from kvserve import LLM, SamplingParams, StructuredOutputsParams
from kvserve.engine.async_engine import AsyncEngine
from kvserve.outputs import FinishReason
from kvserve.sched.output import SchedulerOutput
from tests.conftest import assert_all_blocks_free
from tests.engine.test_overlap_outputs import NGRAM, OPTIONS, prompts, summary


def overlapped_llm(path: str, **options) -> LLM:
    llm = LLM(path, **{**OPTIONS, **options})
    assert not llm.engine.overlap_scheduling  # the default on CPU
    llm.engine.overlap_outputs = llm.engine.overlap_scheduling = True
    return llm


def num_continued(llm: LLM) -> int:
    return llm.stats()["num_steps_scheduled_ahead"]


def both(path: str, params, prompt_list: list[dict] | None = None, **options) -> tuple[list, list, LLM, int]:
    """The plain loop's outputs, the overlapped scheduler's, its engine and how many steps it continued."""
    prompt_list = prompt_list or prompts()
    expected = summary(LLM(path, **{**OPTIONS, **options}).generate(prompt_list, params, use_tqdm=False))
    llm = overlapped_llm(path, **options)
    return expected, summary(llm.generate(prompt_list, params, use_tqdm=False)), llm, num_continued(llm)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])  # gemma3: window layers in a KV cache group of their own
@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=12, n=2),
    SamplingParams(temperature=0, max_tokens=12, top_k=5, logprobs=3),
    SamplingParams(temperature=0, max_tokens=40),  # some stop at EOS with steps of theirs in flight
    # a seeded draw is keyed by its output position, which counts the token still in flight
    SamplingParams(temperature=1.0, max_tokens=24, seed=7, n=2),
    # the ban and the bias read a row's position and params, not its tokens
    SamplingParams(temperature=0, max_tokens=12, min_tokens=6, logit_bias={5: 3.0}),
    # the penalties' counts on the device take each token as it is drawn
    SamplingParams(temperature=0, max_tokens=16, repetition_penalty=1.3, n=2),
    SamplingParams(temperature=0.8, max_tokens=16, seed=7, presence_penalty=0.5, frequency_penalty=0.7),
], ids=["greedy-n2", "top-k-logprobs", "eos", "seeded-n2", "min-tokens-bias", "repetition-n2", "seeded-penalties"])
def test_continued_steps_give_the_plain_loops_outputs(tiny_checkpoints, arch: str, params: SamplingParams) -> None:
    expected, overlapped, llm, num_continued = both(str(tiny_checkpoints[arch]), params)
    assert overlapped == expected
    assert num_continued > 0
    assert_all_blocks_free(llm)


def test_requests_of_every_length_and_a_stop_string(tiny_checkpoints) -> None:
    path = str(tiny_checkpoints["llama"])
    free = LLM(path, **OPTIONS).generate(prompts(), SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    stops = [o.outputs[0].text[3:6] for o in free if len(o.outputs[0].text) > 8]
    rng = random.Random(3)
    params = [SamplingParams(temperature=0, max_tokens=rng.randrange(1, 20), stop=stops if i % 2 else None)
              for i in range(len(prompts()))]
    expected, overlapped, llm, num_continued = both(path, params)
    assert overlapped == expected and num_continued > 0
    assert any(c[2] is FinishReason.STOP and isinstance(c[3], str) for _, cs in overlapped for c in cs)
    assert any(c[2] is FinishReason.LENGTH for _, cs in overlapped for c in cs)
    assert_all_blocks_free(llm)


def test_preemption_prefix_hits_and_admission_under_a_full_batch(tiny_checkpoints) -> None:
    path = str(tiny_checkpoints["qwen3"])
    params = SamplingParams(temperature=0, max_tokens=20)
    expected, overlapped, llm, _ = both(path, params, num_kv_blocks=20, block_size=4, max_num_batched_tokens=16)
    assert overlapped == expected and llm.stats()["num_preemptions"] > 0
    assert_all_blocks_free(llm)
    # more requests than max_num_seqs: continued while the batch is full, a normal step when one finishes
    many = prompts() + prompts(1)
    expected, overlapped, llm, num_continued = both(path, params, many, max_num_seqs=4)
    assert overlapped == expected and num_continued > 0
    assert_all_blocks_free(llm)
    again = summary(llm.generate(many, params, use_tqdm=False))  # prefix hits now
    assert again == expected and llm.stats()["prefix_cache_hits"] > 0
    assert_all_blocks_free(llm)


def test_a_continued_min_tokens_ban_counts_the_token_in_flight(tiny_checkpoints) -> None:
    """EOS pushed far ahead by a bias: each output ends right at min_tokens, in continued steps; a ban that
    did not count the token in flight would hold EOS back one token too long."""
    path = tiny_checkpoints["llama"]
    eos = json.loads((path / "config.json").read_text())["eos_token_id"]
    params = SamplingParams(temperature=0, max_tokens=20, min_tokens=6, logit_bias={eos: 100.0})
    expected, overlapped, llm, num_continued = both(str(path), params)
    assert overlapped == expected and num_continued > 0
    lengths = {len(choice[0]) for _, choices in overlapped for choice in choices}
    assert lengths == {6} or lengths == {7}  # EOS drawn as the 7th output, whether it is kept or not
    assert_all_blocks_free(llm)


def test_speculation_runs_without_continuation(tiny_checkpoints) -> None:
    path = str(tiny_checkpoints["llama"])
    expected, overlapped, llm, num_continued = both(path, SamplingParams(temperature=0, max_tokens=16),
                                                    speculative_config=NGRAM)
    assert overlapped == expected and num_continued == 0
    assert_all_blocks_free(llm)


SCHEMA = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})


@pytest.mark.parametrize("params_of", [
    lambda i: SamplingParams(temperature=0, max_tokens=24, structured_outputs=SCHEMA),
    # a seeded draw under a grammar: keyed by a position that no longer counts a token in flight when it is drawn
    lambda i: SamplingParams(temperature=1.0, max_tokens=24, seed=3, n=2, structured_outputs=SCHEMA),
    # documents that end long before max_tokens: drawn on past the end (the stop tokens' mask), then dropped
    lambda i: SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, structured_outputs=SCHEMA),
    # constrained and free rows in one step: the whole step's draw waits
    lambda i: SamplingParams(temperature=0, max_tokens=20, structured_outputs=SCHEMA if i % 2 else None,
                             repetition_penalty=1.2 if i % 3 else 1.0),
], ids=["greedy", "seeded-n2", "past-the-document", "mixed"])
def test_grammar_rows_continue_with_their_draw_deferred(tiny_checkpoints, params_of) -> None:
    """A continued step with a grammar's rows runs its model at once and draws after the step before is read
    back and its tokens accepted by the matchers (``ModelRunner.draw_deferred``): the plain loop's outputs."""
    params = [params_of(i) for i in range(len(prompts()))]
    expected, overlapped, llm, num_continued = both(str(tiny_checkpoints["llama"]), params)
    assert overlapped == expected and num_continued > 0
    assert llm.engine.core.runner._deferred is None
    assert_all_blocks_free(llm)


def test_a_deferred_draw_is_made_before_its_step_is_read_back(tiny_checkpoints) -> None:
    """Where nothing draws a deferred step after the step before it finished, reading the step back draws it
    first; the step launched after it waits for its own turn."""
    path = str(tiny_checkpoints["llama"])
    params = SamplingParams(temperature=0, max_tokens=12, structured_outputs=SCHEMA)
    expected = summary(LLM(path, **OPTIONS).generate(prompts(), params, use_tqdm=False))
    llm = overlapped_llm(path)
    runner = llm.engine.core.runner
    draw = runner.draw_deferred
    runner.draw_deferred = lambda: None  # EngineCore.finish_step's call does nothing
    assert summary(llm.generate(prompts(), params, use_tqdm=False)) == expected
    assert num_continued(llm) > 0 and runner._deferred is None
    runner.draw_deferred = draw
    assert_all_blocks_free(llm)


def test_an_abort_with_a_step_in_flight_frees_everything(tiny_checkpoints) -> None:
    llm = overlapped_llm(str(tiny_checkpoints["llama"]))
    engine = llm.engine
    for i, prompt in enumerate(prompts()):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    while num_continued(llm) < 3:
        engine.step()
    assert engine._next is not None  # a step is in flight for every request
    engine.abort_request([f"r{i}" for i in range(0, len(prompts()), 2)])
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert sorted(finished) == [f"r{i}" for i in range(1, len(prompts()), 2)]
    assert all(len(o.outputs[0].token_ids) == 30 for o in finished.values())
    assert_all_blocks_free(llm)


def test_a_step_that_cannot_be_continued_is_scheduled_after_the_update(tiny_checkpoints) -> None:
    """A prefill chunk in the last step, or a request waiting with room in the batch: no continuation."""
    llm = overlapped_llm(str(tiny_checkpoints["llama"]), max_num_batched_tokens=8)
    scheduler = llm.engine.core.scheduler
    chunk = SchedulerOutput([], 0)
    assert scheduler.schedule_continuation(chunk) is None  # nothing to continue
    llm.engine.add_request("long", {"prompt_token_ids": list(range(3, 40))}, SamplingParams(max_tokens=4))
    first = scheduler.schedule()  # the first chunk of 8 tokens, no sampling
    assert not first.requests[0].sample
    assert scheduler.schedule_continuation(first) is None


def test_no_overlap_scheduling_turns_it_off(tiny_checkpoints) -> None:
    llm = LLM(str(tiny_checkpoints["llama"]), overlap_scheduling=False, **OPTIONS)
    llm.engine.overlap_outputs = True  # as on CUDA, where the option matters
    assert not llm.engine.overlap_scheduling
    llm.generate(prompts(), SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert num_continued(llm) == 0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_random_mix_of_requests_gives_the_plain_loops_outputs(tiny_checkpoints, seed: int) -> None:
    """Requests of every kind the overlapped scheduler continues (plain, penalized, seeded, with logprobs), of
    random lengths, more of them than the batch holds: steps switch between continued and scheduled after the
    update."""
    rng = random.Random(seed)
    choices = [*[dict()] * 8, *[dict(ignore_eos=True)] * 4, dict(repetition_penalty=1.2), dict(logprobs=2),
               dict(seed=3)]
    prompt_list = [{"prompt_token_ids": [rng.randrange(3, 200) for _ in range(rng.randrange(1, 30))]}
                   for _ in range(12)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randrange(1, 24), **rng.choice(choices))
              for _ in prompt_list]
    expected, overlapped, llm, continued = both(str(tiny_checkpoints["qwen2"]), params, prompt_list,
                                                max_num_seqs=5, num_kv_blocks=96, block_size=4)
    assert overlapped == expected and continued > 0
    assert_all_blocks_free(llm)


def test_the_kv_books_balance_after_every_overlapped_step(tiny_checkpoints) -> None:
    """``check_integrity`` after every step: blocks taken ahead for a continued step, freed with a request that
    stopped while its next step was in flight, and shared through the prefix tree all stay accounted for."""
    llm = overlapped_llm(str(tiny_checkpoints["gemma3"]), num_kv_blocks=96, block_size=4, max_num_seqs=4)
    engine, rng = llm.engine, random.Random(5)
    shared = [rng.randrange(3, 200) for _ in range(9)]  # a prefix some prompts share: hits on the tree
    for i in range(10):
        prompt = (shared if i % 2 else []) + [rng.randrange(3, 200) for _ in range(rng.randrange(1, 12))]
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt},
                           SamplingParams(temperature=0, max_tokens=rng.randrange(1, 20)))
    scheduler = engine.core.scheduler
    while engine.has_unfinished_requests():
        engine.step()
        engine.core.kv_manager.check_integrity(scheduler.requests.values())
    assert num_continued(llm) > 0 and llm.stats()["prefix_cache_hits"] > 0
    assert_all_blocks_free(llm)


def test_the_servers_engine_thread_streams_the_plain_loops_text_and_aborts_mid_stream(tiny_checkpoints) -> None:
    """The server's ``AsyncEngine`` over an overlapped engine: concurrent streams end with the plain loop's text,
    and a stream its client leaves is aborted with its next step already in flight, freeing its blocks."""
    path = str(tiny_checkpoints["llama"])
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    expected = [o.outputs[0].text for o in LLM(path, **OPTIONS).generate(prompts(), params, use_tqdm=False)]
    llm = overlapped_llm(path)
    engine = AsyncEngine(llm.engine)

    async def final_text(prompt: dict) -> str:
        outputs = [out async for out in engine.generate(prompt, params)]
        return outputs[-1].outputs[0].text

    async def leave_after(prompt: dict, num_outputs: int) -> None:
        seen = 0
        async for _ in engine.generate(prompt, params):
            seen += 1
            if seen == num_outputs:
                break  # the client leaves: the request is aborted

    async def run() -> list[str]:
        texts = asyncio.gather(*(final_text(p) for p in prompts()))
        await asyncio.gather(*(leave_after(p, 3) for p in prompts(1)))
        return await texts

    engine.start()
    try:
        assert asyncio.run(asyncio.wait_for(run(), timeout=60)) == expected
        stats = asyncio.run(asyncio.wait_for(engine.call(lambda e: e.stats()), timeout=10))
    finally:
        engine.shutdown()
    assert stats["num_steps_scheduled_ahead"] > 0 and stats["num_blocks_used"] == 0


def test_continued_while_waiting_requests_do_not_fit_the_pool(tiny_checkpoints) -> None:
    """A pool too small for every request at once (room in the batch, not in the KV): decodes go on ahead while
    the waiting ones cannot be admitted, and each is admitted once blocks come free."""
    path = str(tiny_checkpoints["qwen3"])
    many = prompts() + prompts(1) + prompts(2)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected, overlapped, llm, num_continued = both(path, params, many, num_kv_blocks=24, block_size=4,
                                                    max_num_seqs=16)
    assert overlapped == expected and num_continued > 0
    assert all(len(c[0]) == 12 for _, cs in overlapped for c in cs)
    assert_all_blocks_free(llm)
