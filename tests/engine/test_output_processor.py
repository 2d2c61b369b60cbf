"""OutputProcessor: stop strings across tokens, hold-back, n samples, finish flags, abort and logprobs."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.engine.output_processor import OutputProcessor
from kvserve.list_prefix import ListPrefix
from kvserve.outputs import FinishReason, Logprob, RequestOutput
from kvserve.request import sample_request_id
from kvserve.sampling_params import SamplingParams
from kvserve.outputs import TokenLogprobs
from kvserve.sched.output import EngineOutput
from tests.engine.byte_bpe import byte_bpe_tokenizer

PROMPT = "prompt:"


def tok():
    return byte_bpe_tokenizer()


def processor(request_id: str = "r", **params) -> OutputProcessor:
    proc = OutputProcessor(tok())
    params.setdefault("max_tokens", 100)
    proc.add_request(request_id, PROMPT, tok().encode(PROMPT), SamplingParams(**params), {tok().eos_token_id})
    return proc


def feed(proc: OutputProcessor, token_ids: list[int], request_id: str = "r",
         last: FinishReason | None = None, stop_reason: int | None = None) -> list[tuple[RequestOutput, list[str]]]:
    """One EngineOutput per token; the last one carries ``last`` as its finish reason."""
    steps = []
    for i, token_id in enumerate(token_ids):
        finish = last if i == len(token_ids) - 1 else None
        out = proc.process([EngineOutput(request_id, [token_id], finish, stop_reason if finish else None)])
        steps.append((out.request_outputs[0] if out.request_outputs else None, out.stopped_request_ids))
    return steps


def test_plain_text_streams_and_finishes_with_the_engine():
    proc = processor()
    ids = tok().encode("hello world 🙂")
    steps = feed(proc, ids, last=FinishReason.LENGTH)
    final = steps[-1][0]
    assert final.finished and final.outputs[0].finish_reason is FinishReason.LENGTH
    assert final.outputs[0].text == "hello world 🙂"
    assert final.outputs[0].token_ids == ids
    assert not any(out.finished for out, _ in steps[:-1])
    assert all("\ufffd" not in out.outputs[0].text for out, _ in steps)
    assert proc.num_unfinished_requests == 0


def test_stop_string_across_token_boundaries_is_cut_and_reported():
    proc = processor(stop=["o w"])
    ids = tok().encode("hello world, the quick")
    steps = feed(proc, ids)
    stop_step = next(i for i, (_, stopped) in enumerate(steps) if stopped)
    out, stopped = steps[stop_step]
    assert stopped == ["r"]
    assert out.finished
    sample = out.outputs[0]
    assert sample.text == "hell"
    assert (sample.finish_reason, sample.stop_reason) == (FinishReason.STOP, "o w")
    assert sample.token_ids == ids[:stop_step + 1]  # the tokens that completed the stop string stay
    assert proc.process([EngineOutput("r", [ids[-1]])]).request_outputs == []  # forgotten


def test_include_stop_str_in_output_keeps_the_stop_string():
    proc = processor(stop=["o w"], include_stop_str_in_output=True)
    steps = feed(proc, tok().encode("hello world, the quick"))
    final = next(out for out, stopped in steps if stopped)
    assert final.outputs[0].text == "hello w"


def test_possible_stop_string_start_is_held_back_then_released():
    proc = processor(stop=["lo wx"])
    ids = tok().encode("hello world")
    assert [tok().decode([i]) for i in ids] == ["he", "l", "l", "o", " ", "w", "o", "r", "l", "d"]
    texts = [out.outputs[0].text for out, _ in feed(proc, ids)]
    # a trailing "l", "lo", "lo " or "lo w" could start "lo wx": hidden until the text rules it out
    assert texts == ["he", "he", "hel", "hel", "hel", "hel", "hello wo", "hello wor", "hello wor", "hello world"]


def test_held_text_is_released_when_the_sample_finishes():
    proc = processor(stop=["ld!"])
    out, _ = feed(proc, tok().encode("hello wor") + tok().encode("l"), last=FinishReason.LENGTH)[-1]
    assert out.outputs[0].text == "hello worl"


def test_earliest_stop_string_wins():
    proc = processor(stop=["rld", "o w", "world"])
    steps = feed(proc, tok().encode("hello world"), )
    final = next(out for out, stopped in steps if stopped)
    assert (final.outputs[0].text, final.outputs[0].stop_reason) == ("hell", "o w")


def test_no_stop_string_check_before_min_tokens():
    ids = tok().encode("stop STOP end.")
    proc = processor(stop=["stop"], min_tokens=6)
    steps = feed(proc, ids, last=FinishReason.LENGTH)
    assert not any(stopped for _, stopped in steps)
    assert steps[-1][0].outputs[0].text == "stop STOP end."
    assert steps[-1][0].outputs[0].finish_reason is FinishReason.LENGTH


def test_eos_stays_in_token_ids_but_not_in_text():
    eos = tok().eos_token_id
    proc = processor(skip_special_tokens=False)
    ids = tok().encode("hello") + [eos]
    out, stopped = feed(proc, ids, last=FinishReason.STOP)[-1]
    assert stopped == []
    assert out.outputs[0].text == "hello"
    assert out.outputs[0].token_ids == ids


def test_stop_token_id_hidden_unless_include_stop_str_in_output():
    stop_id = tok().encode("!")[0]
    for include, text in [(False, "The End"), (True, "The End!")]:
        proc = processor(stop_token_ids=[stop_id], include_stop_str_in_output=include)
        out, _ = feed(proc, tok().encode("The End!"), last=FinishReason.STOP, stop_reason=stop_id)[-1]
        assert out.outputs[0].text == text and out.outputs[0].stop_reason == stop_id


def test_n_samples_are_gathered_in_index_order_and_finish_together():
    proc = processor(n=3, stop=["!"])
    a, b, c = (sample_request_id("r", i) for i in range(3))
    assert proc.sample_request_ids("r") == [a, b, c]
    hi, yo = tok().encode("hi"), tok().encode("yo!")
    out = proc.process([EngineOutput(a, hi[:1]), EngineOutput(c, yo[:1]), EngineOutput(b, hi[:1])])
    (request,) = out.request_outputs
    assert [s.index for s in request.outputs] == [0, 1, 2]
    assert [s.token_ids for s in request.outputs] == [hi[:1], hi[:1], yo[:1]]
    out = proc.process([EngineOutput(a, hi[1:], FinishReason.LENGTH), EngineOutput(c, yo[1:])])
    assert out.stopped_request_ids == [c]
    (request,) = out.request_outputs
    assert [s.finished() for s in request.outputs] == [True, False, True]
    assert not request.finished
    assert request.outputs[2].text == "yo"
    (request,) = proc.process([EngineOutput(b, hi[1:], FinishReason.LENGTH)]).request_outputs
    assert request.finished and [s.text for s in request.outputs] == ["hi", "hi", "yo"]


def test_abort_finishes_unfinished_samples_only():
    proc = processor(n=2, stop=["zz"])
    a, b = proc.sample_request_ids("r")
    proc.process([EngineOutput(a, tok().encode("ok"), FinishReason.LENGTH), EngineOutput(b, tok().encode("az"))])
    out = proc.abort("r")
    assert out.finished
    assert [s.finish_reason for s in out.outputs] == [FinishReason.LENGTH, FinishReason.ABORT]
    assert out.outputs[1].text == "az"  # the held "z" cannot become a stop string any more
    assert proc.abort("r") is None and proc.abort("unknown") is None
    assert proc.sample_request_ids("r") == ["r"]


def test_logprobs_become_position_dicts_with_decoded_tokens():
    proc = processor(logprobs=2)
    ids = tok().encode("hi")
    entry = TokenLogprobs([ids[0], 7, ids[0]], [-0.5, -0.4, -0.5], [2, 1, 2])
    out = proc.process([EngineOutput("r", ids[:1], logprobs=[entry])]).request_outputs[0]
    (position,) = out.outputs[0].logprobs
    assert list(position) == [ids[0], 7]
    assert position[ids[0]] == Logprob(-0.5, 2, tok().decode(ids[:1]))
    assert position[7] == Logprob(-0.4, 1, tok().decode([7]))


def test_prompt_logprobs_start_with_none_and_accumulate_over_chunks():
    proc = processor(prompt_logprobs=1)
    chunk1 = [TokenLogprobs([5, 9], [-1.0, -0.1], [3, 1])]
    chunk2 = [TokenLogprobs([6, 6], [-0.2, -0.2], [1, 1])]
    proc.process([EngineOutput("r", [], prompt_logprobs=chunk1)])
    out = proc.process([EngineOutput("r", [11], prompt_logprobs=chunk2, num_cached_tokens=4)]).request_outputs[0]
    assert out.prompt_logprobs[0] is None
    assert out.prompt_logprobs[1] == {5: Logprob(-1.0, 3, tok().decode([5])), 9: Logprob(-0.1, 1, tok().decode([9]))}
    assert out.prompt_logprobs[2] == {6: Logprob(-0.2, 1, tok().decode([6]))}
    assert out.num_cached_tokens == 4
    assert out.outputs[0].logprobs is None


def test_snapshots_are_independent_of_later_steps():
    """An unfinished request's snapshot reads its lists through views (a copy at every step made a 16k-token
    answer's host work quadratic: 0.5 ms a token at 16k with logprobs); the finished one holds lists."""
    proc = processor(logprobs=0, prompt_logprobs=0)
    ids = tok().encode("hello")
    entry = TokenLogprobs([ids[0]], [-0.5], [1])
    first = proc.process([EngineOutput("r", ids[:1], logprobs=[entry], prompt_logprobs=[entry])]).request_outputs[0]
    rest = [TokenLogprobs([i], [-0.25], [1]) for i in ids[1:]]
    last = proc.process([EngineOutput("r", ids[1:], FinishReason.LENGTH, logprobs=rest, prompt_logprobs=rest)])
    sample = first.outputs[0]
    assert sample.token_ids == ids[:1] and len(sample.logprobs) == 1 and len(first.prompt_logprobs) == 2
    assert [list(p) for p in sample.logprobs] == [ids[:1]] and first.prompt_logprobs[1:] == sample.logprobs[:]
    assert isinstance(sample.token_ids, ListPrefix) and isinstance(first.prompt_logprobs, ListPrefix)
    final = last.request_outputs[0]
    assert final.outputs[0].token_ids == ids and len(final.prompt_logprobs) == len(ids) + 1
    assert all(type(x) is list for x in (final.outputs[0].token_ids, final.outputs[0].logprobs, final.prompt_logprobs))


def test_duplicate_request_id_is_rejected():
    proc = processor()
    with pytest.raises(ValueError, match="already in use"):
        proc.add_request("r", None, [1], SamplingParams(), frozenset())


@settings(max_examples=60, deadline=None)
@given(
    pieces=st.lists(st.sampled_from(["a", "b", "ab", " ", "é", "🙂", "the", "##"]), min_size=1, max_size=12),
    stops=st.lists(st.sampled_from(["a", "ba", "b b", "é🙂", "the#", "🙂a", "abab"]), min_size=1, max_size=3),
)
def test_streamed_text_is_append_only_and_cut_at_the_first_stop(pieces, stops):
    ids = tok().encode("".join(pieces))
    full = tok().decode(ids)
    proc = processor(stop=stops)
    steps = feed(proc, ids, last=FinishReason.LENGTH)
    texts = [out.outputs[0].text for out, _ in steps if out is not None]
    assert all(after.startswith(before) for before, after in zip(texts, texts[1:]))
    assert all("\ufffd" not in t for t in texts)
    final = next(out for out, _ in steps if out.finished).outputs[0]
    assert not any(stop in final.text for stop in stops)
    if final.finish_reason is FinishReason.STOP:
        assert full[len(final.text):].startswith(final.stop_reason)
    else:
        assert final.text == full


@pytest.mark.parametrize("stop", ["o w", "hello", "quick"])
def test_a_multi_token_step_stops_where_one_token_steps_would(stop):
    """A speculating step hands over several tokens at once: text and token ids still end at the token that
    completed the stop string."""
    ids = tok().encode("hello world, the quick brown fox")
    one_by_one = processor(stop=[stop])
    steps = feed(one_by_one, ids)
    want = next(out for out, stopped in steps if stopped).outputs[0]
    at_once = processor(stop=[stop])
    for chunk in (ids[:3], ids[3:]):  # two steps of several tokens each
        out = at_once.process([EngineOutput("r", chunk)])
        if out.stopped_request_ids:
            break
    assert out.stopped_request_ids == ["r"]
    got = out.request_outputs[0].outputs[0]
    assert (got.text, got.token_ids, got.finish_reason, got.stop_reason) == (
        want.text, want.token_ids, want.finish_reason, want.stop_reason)


def test_final_only_returns_finished_requests_alone_and_their_whole_output():
    ids = tok().encode("hello world, stop here")
    cumulative, final_only = processor(stop=["stop"]), processor(stop=["stop"])
    expected = feed(cumulative, ids, last=FinishReason.LENGTH)
    results = []
    for token_id in ids:
        out = final_only.process([EngineOutput("r", [token_id], None, None)], final_only=True)
        results.append(out)
    finished = [out for out in results if out.request_outputs]
    assert len(finished) == 1 and finished[0].stopped_request_ids == ["r"]  # stopped by "stop", mid-stream
    final = finished[0].request_outputs[0]
    reference = next(out for out, _ in expected if out.finished)
    assert final.finished and final.outputs[0].text == reference.outputs[0].text == "hello world, "
    assert final.outputs[0].token_ids == reference.outputs[0].token_ids
    assert final_only.num_unfinished_requests == 0


@settings(max_examples=60, deadline=None)
@given(
    pieces=st.lists(st.sampled_from(["a", " b", "é", "🙂", "漢字", "\n"]), min_size=1, max_size=10),
    end=st.sampled_from(["eos", "length", "abort"]),
    skip_special_tokens=st.booleans(),
)
def test_final_only_outputs_equal_the_streamed_ones(pieces: list[str], end: str, skip_special_tokens: bool) -> None:
    """Offline generation reads only finished samples, whose text is then detokenized at once: the same text,
    tokens and finish as when every step's text is made."""
    ids = tok().encode("".join(pieces)) + ([tok().eos_token_id] if end == "eos" else [])
    results = []
    for final_only in (False, True):
        proc = processor(skip_special_tokens=skip_special_tokens)
        outputs = []
        for i, token_id in enumerate(ids):
            finish = {"eos": FinishReason.STOP, "length": FinishReason.LENGTH}.get(end) if i == len(ids) - 1 else None
            outputs += proc.process([EngineOutput("r", [token_id], finish, None)], final_only).request_outputs
        if end == "abort":
            outputs.append(proc.abort("r"))
        final = outputs[-1].outputs[0]
        results.append((final.text, final.token_ids, final.finish_reason))
        assert not final_only or len(outputs) == 1  # the finished snapshot alone
    assert results[0] == results[1]


def test_a_two_token_step_ends_at_the_token_completing_a_stop_string():
    """The smallest speculating step: [a, b] with stop "a" ends at a, as two one-token steps would."""
    a, b = tok().encode("ab")
    proc = processor(stop=["a"])
    out = proc.process([EngineOutput("r", [a, b])])
    assert out.stopped_request_ids == ["r"]
    sample = out.request_outputs[0].outputs[0]
    assert (sample.text, sample.token_ids, sample.finish_reason, sample.stop_reason) == (
        "", [a], FinishReason.STOP, "a")


@pytest.mark.parametrize("min_tokens", [1, 2])
def test_a_stop_string_counts_from_the_output_after_min_tokens(min_tokens: int):
    """Output ``min_tokens`` completing a stop string does not end the sample; output ``min_tokens + 1`` does
    (vLLM: ``len(output_token_ids) > min_tokens``)."""
    (a,) = tok().encode("a")
    proc = processor(stop=["a"], min_tokens=min_tokens)
    steps = feed(proc, [a] * (min_tokens + 1))
    assert [stopped for _, stopped in steps] == [[]] * min_tokens + [["r"]]
    final = steps[-1][0].outputs[0]
    assert (final.text, final.token_ids, final.stop_reason) == ("a" * min_tokens, [a] * (min_tokens + 1), "a")


@pytest.mark.parametrize("stops", [["he", "h"], ["h", "he"]])
def test_of_stop_strings_starting_at_the_same_place_the_one_listed_first_wins(stops):
    (he,) = tok().encode("he")
    out = processor(stop=stops, include_stop_str_in_output=True).process([EngineOutput("r", [he])])
    sample = out.request_outputs[0].outputs[0]
    assert (sample.stop_reason, sample.text) == (stops[0], stops[0])


@pytest.mark.parametrize("text", ["hello", "hel!"])
def test_a_multi_token_step_split_for_stop_strings_splits_its_logprobs(text):
    """Each token of a speculating step keeps its own logprob entry, whether or not a stop string ends it."""
    ids = tok().encode(text)
    entries = [TokenLogprobs([t], [-0.5 * (i + 1)], [i + 1]) for i, t in enumerate(ids)]
    proc = processor(stop=["!"], logprobs=0)
    sample = proc.process([EngineOutput("r", ids, logprobs=entries)]).request_outputs[0].outputs[0]
    assert len(sample.logprobs) == len(sample.token_ids) == len(ids)
    for i, (token_id, position) in enumerate(zip(ids, sample.logprobs)):
        assert list(position) == [token_id]
        assert (position[token_id].logprob, position[token_id].rank) == (-0.5 * (i + 1), i + 1)
