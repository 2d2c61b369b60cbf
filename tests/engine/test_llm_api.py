"""The offline API: input forms, output order, chat, stats, seeds, stops, and every bad argument."""

from __future__ import annotations

import concurrent.futures
import gc
import json
import shutil
import threading
import time
import weakref
from collections import deque
from types import MappingProxyType

import numpy as np
import pytest
import torch
from tqdm.auto import tqdm

from kvserve import LLM, SamplingParams, StructuredOutputsParams
from kvserve.outputs import FinishReason
from kvserve.sampling_params import InvalidParameter
from tests.conftest import assert_all_blocks_free


@pytest.fixture(scope="module")
def llm(tiny_checkpoints) -> LLM:
    return LLM(str(tiny_checkpoints["llama"]), dtype="float32", num_kv_blocks=128)


def test_outputs_come_back_in_input_order_with_per_prompt_params(llm: LLM) -> None:
    prompts = ["hello there", {"prompt_token_ids": [5, 6, 7]}, "a longer prompt about the weather today"]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 7, 5)]
    outs = llm.generate(prompts, params)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 7, 5]
    assert outs[0].prompt == "hello there" and outs[1].prompt_token_ids == [5, 6, 7]
    assert all(o.finished and o.outputs[0].finish_reason is FinishReason.LENGTH for o in outs)
    tokenizer = llm.get_tokenizer()
    assert outs[0].prompt_token_ids == tokenizer.encode("hello there")


def test_text_is_the_detokenized_tokens(llm: LLM) -> None:
    out = llm.generate("the cat", SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0].outputs[0]
    tokenizer = llm.get_tokenizer()
    assert out.text == tokenizer.decode(out.token_ids, skip_special_tokens=True)


def test_chat_uses_the_chat_template(llm: LLM) -> None:
    messages = [{"role": "user", "content": "hi"}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    rendered = llm.get_tokenizer().apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True
    )
    assert out.prompt_token_ids == list(rendered["input_ids"])
    two = llm.chat([messages, messages], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in two] == [out.outputs[0].token_ids] * 2


def test_chat_with_a_model_without_a_template_says_what_to_send(llm: LLM, monkeypatch) -> None:
    """Gemma 3 270M's GGUF (a base model) has none: the message fits an HTTP client as well as a Python one."""
    monkeypatch.setattr(llm.get_tokenizer(), "chat_template", None)
    with pytest.raises(ValueError, match=r"no chat template: send it a plain prompt \(/v1/completions"):
        llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=2))
    assert llm.stats()["num_waiting"] == 0


def test_a_warm_up_does_the_first_steps_work_and_leaves_nothing_behind(tiny_checkpoints) -> None:
    """A server warms its engine up before /health says it is ready: the first decode step's graph recorded
    (on CPU its recording imported torch._dynamo, 2 s of the first client's time), no block held or cached, and
    the tokens after it a fresh engine's."""
    warmed, fresh = (LLM(str(tiny_checkpoints["llama"]), dtype="float32", num_kv_blocks=64) for _ in range(2))
    warmed.engine.warm_up()
    stats = warmed.stats()
    assert (1, ()) in warmed.engine.core.runner.graphs.graphs  # a one-token decode step's
    assert stats["num_blocks_used"] == stats["num_running"] == stats["num_waiting"] == 0
    assert stats["prefix_cache_queries"] == 1 and stats["prefix_cache_hits"] == 0
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in warmed.generate(["abc", "x y"], params)] == \
        [o.outputs[0].token_ids for o in fresh.generate(["abc", "x y"], params)]
    assert warmed.stats()["prefix_cache_hits"] == 0  # the warm-up's token cached nothing to hit
    tight = LLM(str(tiny_checkpoints["llama"]), dtype="float32", num_kv_blocks=8, max_model_len=2)
    tight.engine.warm_up()  # a context of 2 takes one token after the prompt's: it refused a server's start
    assert tight.stats()["num_blocks_used"] == 0


def test_a_pooling_engine_warms_up_with_a_pooling_request(tiny_checkpoints) -> None:
    """--runner pooling refuses generations: its warm-up queued one, and `kvserve serve --runner pooling` could not
    start."""
    pooling = LLM(str(tiny_checkpoints["llama"]), dtype="float32", num_kv_blocks=64, runner="pooling")
    pooling.engine.warm_up()
    stats = pooling.stats()
    assert stats["num_blocks_used"] == stats["num_running"] == stats["num_waiting"] == 0
    assert stats["prefix_cache_queries"] == 1


def test_stats_report_the_kv_cache(llm: LLM) -> None:
    stats = llm.stats()
    for key in ("block_size", "num_blocks_total", "num_blocks_used", "num_blocks_free", "kv_cache_dtype"):
        assert key in stats
    assert stats["num_blocks_total"] == 128 and stats["kv_cache_dtype"] == "float32"
    assert stats["num_blocks_used"] + stats["num_blocks_free"] == stats["num_blocks_total"]


def test_same_seed_same_text_whatever_the_batch(llm: LLM) -> None:
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)
    alone = llm.generate(["tell me"], seeded)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=9, ignore_eos=True)
    batch = llm.generate(["x y z", "tell me", "one two three four"], [others, seeded, others])
    assert batch[1].outputs[0].token_ids == alone


def test_stop_string_is_cut_from_the_text(llm: LLM) -> None:
    free = llm.generate("the cat", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    assert len(free.text) > 4
    stop = free.text[2:4]
    out = llm.generate("the cat", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop]))
    completion = out[0].outputs[0]
    assert completion.finish_reason is FinishReason.STOP and completion.stop_reason == stop
    assert completion.text == free.text[: free.text.index(stop)]
    assert llm.stats()["num_blocks_used"] == 0


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ("", SamplingParams(), "empty"),
        ({"prompt_token_ids": []}, SamplingParams(), "prompt_token_ids"),
        ({"prompt_token_ids": [1, 10**9]}, SamplingParams(), "not a token id"),
        ({"prompt_token_ids": [1, -1]}, SamplingParams(), "not a token id"),
        ({"prompt_token_ids": [1, *torch.tensor([264])]}, SamplingParams(), r"tensor\(264\) is a Tensor, not a "
         "token id: token ids are ints"),
        (12, SamplingParams(), "must be a string"),
        ("hi", SamplingParams(stop_token_ids=[10**9]), "stop_token_ids"),
        ({"prompt_token_ids": [5, 6], "cache_salt": ""}, SamplingParams(), "cache_salt must be a non-empty string, "
         "got an empty one"),
        ({"prompt": "hi", "cache_salt": ["s"]}, SamplingParams(), "cache_salt must be a non-empty string, got a list"),
        ({"prompt": "hi", "cache_salt": "\ud800"}, SamplingParams(), "cache_salt"),
        ({"prompt": "hi", "multi_modal_data": {"image": 1}}, SamplingParams(), "'multi_modal_data'"),
        ({"prompt": 5}, SamplingParams(), "'prompt' with the text"),
        ("hi", SamplingParams(logit_bias={10**9: 1.0}), "logit_bias"),
        ("hi", SamplingParams(structured_outputs=StructuredOutputsParams(regex="a", begins_after_token_id=10**9)),
         "begins_after_token_id: 1000000000 is not a token id"),
    ],
)
def test_bad_input_is_refused_and_leaves_nothing_queued(llm: LLM, prompt, params, message) -> None:
    with pytest.raises(ValueError, match=message):
        llm.generate(["fine", prompt], params)
    stats = llm.stats()
    assert (stats["num_waiting"], stats["num_running"], stats["num_blocks_used"]) == (0, 0, 0)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"n": 0}, "n must"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_k": -5}, "top_k"),
        ({"min_p": 2}, "min_p"),
        ({"logprobs": -2}, "logprobs"),  # its upper bound is the engine's (tests/engine/test_logprobs_options.py)
        ({"stop": [""]}, "stop"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_wrong_number_of_sampling_params(llm: LLM) -> None:
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["a", "b"], [SamplingParams()])


def test_chats_options_past_use_tqdm_are_keywords_and_checked(llm: LLM) -> None:
    """vLLM's chat takes lora_request fourth (as kvserve's) and chat_template fifth: by position it landed in
    add_generation_prompt (the generation prompt silently dropped) and tools (a string as two tools)."""
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(TypeError, match="positional"):
        llm.chat(messages, SamplingParams(max_tokens=1), False, None, "{{ messages }}")
    with pytest.raises(TypeError, match="add_generation_prompt must be a bool"):
        llm.chat(messages, SamplingParams(max_tokens=1), add_generation_prompt="no")
    for tools in ("ab", {"type": "function"}, ["ab"]):
        with pytest.raises(TypeError, match="tools must be a list of tools"):
            llm.chat(messages, SamplingParams(max_tokens=1), tools=tools)
    assert llm.stats()["num_blocks_used"] == 0


def test_each_samples_cumulative_logprob_is_the_sum_of_its_tokens_as_in_vllm(llm: LLM) -> None:
    (out,) = llm.generate("Hello", SamplingParams(n=3, max_tokens=5, temperature=1.0, seed=1, logprobs=0))
    for sample in out.outputs:
        chosen = [position[token].logprob for token, position in zip(sample.token_ids, sample.logprobs)]
        assert len(chosen) == 5 and sample.cumulative_logprob == pytest.approx(sum(chosen))
    assert llm.generate("Hello", SamplingParams(max_tokens=2))[0].outputs[0].cumulative_logprob is None


def test_a_text_prompt_dict_is_its_text_as_in_vllm(llm: LLM) -> None:
    greedy = SamplingParams(max_tokens=4, temperature=0)
    as_text, as_dict = llm.generate(["Hello there", {"prompt": "Hello there"}], greedy)
    assert as_dict.prompt == "Hello there" and as_dict.prompt_token_ids == as_text.prompt_token_ids
    assert as_dict.outputs[0].token_ids == as_text.outputs[0].token_ids


def test_max_tokens_past_max_model_len_is_capped_offline_as_in_vllm(tiny_checkpoints) -> None:
    """vLLM's offline LLM ends such a sample at max_model_len with "length" (its server answers a 400, as
    kvserve's does); a prompt that leaves no room is still refused."""
    small = LLM(str(tiny_checkpoints["llama"]), dtype="float32", max_model_len=16, num_kv_blocks=16, block_size=4)
    prompt = {"prompt_token_ids": list(range(3, 13))}
    capped, filled = small.generate([prompt, prompt], [SamplingParams(max_tokens=10**6, temperature=0,
                                                                      ignore_eos=True),
                                                       SamplingParams(max_tokens=None, temperature=0, ignore_eos=True)])
    assert len(capped.outputs[0].token_ids) == 6 and capped.outputs[0].finish_reason.value == "length"
    assert capped.outputs[0].token_ids == filled.outputs[0].token_ids
    with pytest.raises(ValueError, match="leaves no room"):
        small.generate({"prompt_token_ids": list(range(3, 19))}, SamplingParams(max_tokens=10**6))
    with pytest.raises(ValueError, match="min_tokens"):
        small.generate(prompt, SamplingParams(max_tokens=10**6, min_tokens=7))
    assert small.stats()["num_blocks_used"] == 0


def test_the_models_generation_config_gives_the_sampling_defaults_as_in_vllm(tiny_checkpoints, tmp_path) -> None:
    """vLLM (since 0.8) fills what a request leaves out from generation_config.json's sampling fields; top_k 1
    makes every default draw the greedy token. Fields the file does not set keep SamplingParams' defaults."""
    folder = tmp_path / "llama"
    shutil.copytree(tiny_checkpoints["llama"], folder)
    generation = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**generation, "temperature": 0.6, "top_k": 1,
                                                              "top_p": None}))  # null: not set, as vLLM reads it
    llm = LLM(str(folder), dtype="float32", num_kv_blocks=32)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.top_p) == (0.6, 1, SamplingParams().top_p)
    greedy = llm.generate("Hello", SamplingParams(max_tokens=6, temperature=0))[0].outputs[0].token_ids
    assert [o.outputs[0].token_ids[:6] for o in llm.generate(["Hello", "Hello"])] == [greedy, greedy]
    plain = LLM(str(folder), dtype="float32", num_kv_blocks=32, generation_config="vllm")
    assert plain.get_default_sampling_params() == SamplingParams()
    (folder / "generation_config.json").write_text(json.dumps({**generation, "top_p": 2.0}))
    with pytest.raises(ValueError, match=r"generation_config.json: .*top_p"):
        LLM(str(folder), dtype="float32", num_kv_blocks=32)


def test_a_kv_cache_smaller_than_max_model_len_lowers_it(tiny_checkpoints, caplog) -> None:
    """A request without max_tokens may grow to max_model_len: with a pool that cannot hold that much, every such
    request was refused (the OpenAI SDK's default chat request among them) by a server that said it was healthy.
    max_model_len is lowered to what the pool holds instead, saying so, and longer requests refused at once."""
    small = LLM(str(tiny_checkpoints["llama"]), dtype="float32", num_kv_blocks=2, block_size=4)
    assert small.engine.max_model_len == 8 and "max_model_len lowered from 512" in caplog.text
    with pytest.raises(ValueError, match="max_model_len=8"):
        small.generate({"prompt_token_ids": list(range(3, 20))}, SamplingParams(max_tokens=4))
    (out,) = small.generate({"prompt_token_ids": [3, 4, 5]}, SamplingParams(max_tokens=None, temperature=0))
    assert len(out.outputs[0].token_ids) <= 5 and small.stats()["num_blocks_used"] == 0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"block_size": 3}, "block_size"),
        ({"num_kv_blocks": 0}, "num_kv_blocks"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
        ({"dtype": "float64"}, "dtype"),
        ({"device": "tpu"}, "device"),
        ({"kv_cache_dtype": "int3"}, "kv_cache_dtype='int3' is not one of auto, int8, fp8, int4"),
        ({"max_model_len": 10**9}, "max_model_len"),
    ],
)
def test_bad_engine_arguments_name_the_problem(tiny_checkpoints, kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        LLM(str(tiny_checkpoints["llama"]), **kwargs)


def test_seeded_samples_of_one_prompt_differ_and_leave_no_sampler_state(llm: LLM) -> None:
    params = SamplingParams(temperature=1.0, seed=7, n=3, max_tokens=8, ignore_eos=True)
    first = [s.token_ids for s in llm.generate("tell me", params)[0].outputs]
    again = [s.token_ids for s in llm.generate("tell me", params)[0].outputs]
    assert first == again, "a seeded request must repeat itself sample by sample"
    assert len({tuple(t) for t in first}) == 3, "each sample draws from its own generator"
    assert llm.engine.core.runner.sampler.num_states == 0


def test_aborted_requests_leave_no_sampler_state(llm: LLM) -> None:
    engine = llm.engine
    engine.add_request("gone", "a prompt to abort", SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=50))
    for _ in range(3):
        engine.step()
    engine.abort_request(["gone"])
    engine.step()  # the abort reaches the runner with the next step's diff
    assert engine.core.runner.sampler.num_states == 0
    assert llm.stats()["num_blocks_used"] == 0 or llm.engine.config.cache.enable_prefix_caching


@pytest.mark.parametrize("prompts, sampling_params, fragment", [
    (None, None, "prompts must be a string, a dict with 'prompt_token_ids' or 'prompt', or a list of them; got "
                 "NoneType"),
    (5, None, "got int"),
    ((p for p in ["a"]), None, "got generator"),
    (b"hi", None, "got bytes"),
    (["a"], {"max_tokens": 3}, "sampling_params must be a SamplingParams or a list of them"),
    (["a", "b"], [SamplingParams(), {"max_tokens": 3}], "sampling_params must be a SamplingParams"),
])
def test_arguments_of_the_wrong_type_say_what_they_must_be(llm: LLM, prompts, sampling_params, fragment) -> None:
    with pytest.raises(TypeError, match=fragment):
        llm.generate(prompts, sampling_params)
    assert not llm.engine.has_unfinished_requests()


def test_any_failure_while_queueing_leaves_nothing_queued(llm: LLM, monkeypatch) -> None:
    add, calls = llm.engine.add_processed, []

    def add_then_fail(*args, **kwargs) -> None:
        calls.append(args)
        if len(calls) == 2:
            raise RuntimeError("interrupted")
        add(*args, **kwargs)

    monkeypatch.setattr(llm.engine, "add_processed", add_then_fail)
    with pytest.raises(RuntimeError, match="interrupted"):
        llm.generate(["a", "b", "c"], SamplingParams(max_tokens=2))
    monkeypatch.undo()
    stats = llm.stats()  # the one queued is aborted (the next step's diff frees its runner state)
    assert stats["num_running"] == stats["num_waiting"] == stats["num_blocks_used"] == 0
    assert len(llm.generate(["d"], SamplingParams(max_tokens=2))[0].outputs[0].token_ids) == 2


def test_numpy_token_ids_are_token_ids(llm: LLM) -> None:
    out = llm.generate({"prompt_token_ids": list(np.array([5, 6, 7]))}, SamplingParams(max_tokens=1))[0]
    assert out.prompt_token_ids == [5, 6, 7] and all(type(t) is int for t in out.prompt_token_ids)


def test_chat_takes_openai_shaped_conversations_and_tools(llm: LLM) -> None:
    """Text parts, an assistant's calls with JSON-text arguments and a tool's result render as the server renders
    them; tools reach a template that takes none described in the system message."""
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    conversation = [{"role": "user", "content": [{"type": "text", "text": "Weather"}, {"type": "text", "text": "?"}]},
                    {"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": "c1", "content": "-3 C"}]
    params = SamplingParams(temperature=0, max_tokens=2)
    tick = {"type": "function", "function": {"name": "tick"}}  # short: the tiny model's context is 512 bytes
    plain, with_tools = llm.chat(conversation, params), llm.chat(conversation, params, tools=[tick])
    prompt = llm.get_tokenizer().decode(with_tools[0].prompt_token_ids)
    assert '"tick"' in prompt and "<tool_response>\n-3 C\n</tool_response>" in prompt
    assert len(with_tools[0].prompt_token_ids) > len(plain[0].prompt_token_ids)
    with pytest.raises(ValueError, match=r"messages\[1\]: tool call arguments are not JSON"):
        llm.chat([conversation[0], {"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "f", "arguments": "{x"}}]}], params)


def test_chat_continues_the_final_message_and_passes_template_kwargs(llm: LLM) -> None:
    """vLLM's ``continue_final_message`` and ``chat_template_kwargs`` (as the server takes them)."""
    conversation = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "The colour is"}]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    (out,) = llm.chat(conversation, params, add_generation_prompt=False, continue_final_message=True,
                      chat_template_kwargs={"enable_thinking": False})
    assert llm.get_tokenizer().decode(out.prompt_token_ids).endswith("The colour is")
    (closed,) = llm.chat(conversation, params, add_generation_prompt=False)
    assert len(closed.prompt_token_ids) > len(out.prompt_token_ids)
    with pytest.raises(ValueError, match="set add_generation_prompt to false"):
        llm.chat(conversation, params, continue_final_message=True)
    with pytest.raises(TypeError, match="continue_final_message must be a bool"):
        llm.chat(conversation, params, add_generation_prompt=False, continue_final_message="yes")
    with pytest.raises(ValueError, match="chat_template_kwargs may not set tools"):
        llm.chat(conversation, params, chat_template_kwargs={"tools": []})


def test_speculative_config_given_twice_or_not_as_a_dict_is_refused(tiny_checkpoints) -> None:
    path = str(tiny_checkpoints["llama"])
    with pytest.raises(ValueError, match="speculative_method='draft' and speculative_config's 'ngram' disagree"):
        LLM(path, speculative_config={"method": "ngram"}, speculative_method="draft")
    with pytest.raises(ValueError, match="speculative_config must be a dict"):
        LLM(path, speculative_config="ngram")


def test_outputs_say_when_the_engine_first_scheduled_them(llm: LLM) -> None:
    before = time.monotonic()
    out = llm.generate("hello", SamplingParams(max_tokens=2, n=3, seed=0))[0]
    assert before <= out.first_scheduled_time <= time.monotonic()


def test_a_text_too_long_for_any_tokenization_is_refused_without_tokenizing_it(llm: LLM, monkeypatch) -> None:
    """Megabytes of text sent to be refused held the engine thread (and every stream) for seconds in the
    tokenizer: a text longer than max_model_len tokens of the vocabulary's longest token is refused unread."""
    def encode(*args, **kwargs):
        raise AssertionError("tokenized")

    limit = llm.engine.config.scheduler.max_model_len * max(map(len, llm.get_tokenizer().get_vocab()))
    monkeypatch.setattr(llm.get_tokenizer(), "encode", encode)
    with pytest.raises(ValueError, match=f"prompt has {limit + 1} characters: more tokens than max_model_len"):
        llm.generate(["x" * (limit + 1)], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="the conversation's messages has .* characters"):  # not even rendered
        llm.chat([{"role": "user", "content": "x" * limit}], SamplingParams(max_tokens=1))


def test_an_id_still_tracked_for_its_other_samples_is_refused_and_queues_nothing(tiny_checkpoints) -> None:
    """Sample 0 of an n = 2 request finishes first (one token a step, the parent decodes to its end): the id is
    still in use until sample 1 finishes, and a request refused for it leaves nothing queued."""
    llm = LLM(str(tiny_checkpoints["llama"]), dtype="float32", num_kv_blocks=32, block_size=4, max_model_len=64,
              max_num_batched_tokens=1)
    engine = llm.engine
    engine.add_request("x", {"prompt_token_ids": [11, 12, 13]},
                       SamplingParams(temperature=0, max_tokens=6, n=2, ignore_eos=True))
    while "x" in engine.core.scheduler.requests or not engine.core.scheduler.requests:
        engine.step()
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("x", {"prompt_token_ids": [21, 22, 23]}, SamplingParams(max_tokens=30))
    assert list(engine.core.scheduler.requests) == ["x#1"]
    finals = []
    while engine.has_unfinished_requests():
        finals += engine.step(final_only=True)
    assert [len(c.token_ids) for o in finals for c in o.outputs] == [6, 6]
    assert llm.stats()["num_blocks_used"] == 0


def test_an_interrupt_while_a_cached_prefix_is_taken_leaks_no_block(tiny_checkpoints, monkeypatch) -> None:
    """A Ctrl-C in LLM.generate while fresh blocks were allocated for a request that starts from a cached prefix:
    they were in no request's table yet, so the abort could not free them (one block lost for good a time)."""
    from kvserve.kv.manager import KVCacheManager

    llm = LLM(str(tiny_checkpoints["llama"]), dtype="float32", num_kv_blocks=64)
    prompt = {"prompt_token_ids": list(range(3, 40))}
    params = SamplingParams(max_tokens=4, temperature=0)
    (first,) = llm.generate(prompt, params)  # its prefix is cached now
    fill = KVCacheManager._fill

    def interrupted(self, tables, slots, num_new_blocks):
        fill(self, tables, slots, num_new_blocks)
        raise KeyboardInterrupt

    monkeypatch.setattr(KVCacheManager, "_fill", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompt, params)
    monkeypatch.setattr(KVCacheManager, "_fill", fill)
    assert llm.stats()["num_blocks_used"] == 0
    (again,) = llm.generate(prompt, params)
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def test_garbage_cycles_made_between_generate_calls_are_collected(llm: LLM) -> None:
    """Each generate freezes the heap; unfrozen, what it froze lands in the oldest generation, which only a full
    collection visits, so the caller's cycles made between calls piled up (1.2 GB over 300 calls)."""
    gc.collect()

    class Cycle:
        pass

    cycle = Cycle()
    cycle.me = cycle
    alive = weakref.ref(cycle)
    del cycle
    llm.generate("hello", SamplingParams(max_tokens=1, temperature=0))
    assert alive() is None


def test_generate_from_two_threads_gives_each_its_own_answers(llm: LLM) -> None:
    """Calls from two threads stepped each other's requests: wrong tokens, or errors naming nothing the caller
    did. They now run one after the other."""
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    batches = [[{"prompt_token_ids": [3 + i, 4 + i, 5 + i]} for i in range(j, j + 4)] for j in (0, 10)]
    alone = [[o.outputs[0].token_ids for o in llm.generate(b, params)] for b in batches]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        together = list(pool.map(lambda b: [o.outputs[0].token_ids for o in llm.generate(b, params)], batches))
    assert together == alone


def test_a_dropped_or_closed_llm_stops_its_disk_tiers_threads(tiny_checkpoints, tmp_path) -> None:
    """A dropped LLM's disk tier kept its two I/O threads and its store (a 0.25 GiB slab) alive for good."""
    def tier_threads() -> int:
        return sum(t.name.startswith("kvserve-kv-") and t.is_alive() for t in threading.enumerate())

    before, existing = tier_threads(), set(threading.enumerate())
    llm = LLM(str(tiny_checkpoints["llama"]), dtype="float32", num_kv_blocks=16, kv_offload_dir=str(tmp_path))
    llm.generate("hello", SamplingParams(max_tokens=2, temperature=0))
    assert tier_threads() == before + 2
    del llm
    gc.collect()
    for thread in set(threading.enumerate()) - existing:
        if thread.name.startswith("kvserve-kv-"):
            thread.join(10)
    assert tier_threads() == before
    with LLM(str(tiny_checkpoints["llama"]), dtype="float32", num_kv_blocks=16, kv_offload_dir=str(tmp_path)):
        assert tier_threads() == before + 2
    assert tier_threads() == before


def test_a_closed_llm_stops_its_grammar_masks_thread(tiny_checkpoints) -> None:
    """The masks' worker thread, started by the first constrained step, outlived ``close``."""
    def mask_threads() -> int:
        return sum(t.name.startswith("kvserve-grammar") and t.is_alive() for t in threading.enumerate())

    before = mask_threads()
    with LLM(str(tiny_checkpoints["llama"]), dtype="float32", num_kv_blocks=16) as llm:
        llm.generate("hello", SamplingParams(max_tokens=3, structured_outputs=StructuredOutputsParams(regex="[ab]+")))
        assert mask_threads() == before + 1
    assert mask_threads() == before


def test_ctrl_c_lands_between_engine_steps(llm: LLM, monkeypatch) -> None:
    """A SIGINT in the middle of a step (here while a finished request's blocks are freed) is held until the step
    is done, then raised: the requests are aborted and the engine is as it was. Landing inside a step, it left a
    request in two queues, a block in no table, or a request freed twice (every later generate spun)."""
    import os
    import signal

    from kvserve.kv.block_pool import BlockPool

    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(3 + i, 40 + i))} for i in range(4)]  # 3 blocks each
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    free = BlockPool.free

    def interrupted(self, block_ids):
        block_ids = list(block_ids)
        free(self, block_ids[:1])
        if len(block_ids) > 1:
            os.kill(os.getpid(), signal.SIGINT)  # delivered here, mid-step, as a Ctrl-C would be
        free(self, block_ids[1:])

    monkeypatch.setattr(BlockPool, "free", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, params)
    monkeypatch.setattr(BlockPool, "free", free)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert llm.stats()["num_blocks_used"] == 0 and not llm.engine.core.scheduler.requests
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected


def test_use_tqdm_may_name_the_progress_bar_to_make(llm: LLM) -> None:
    """As vLLM's: a callable given as use_tqdm makes the bar (it was taken as True)."""
    made = []

    def bar(**kwargs):
        made.append(kwargs["total"])
        return tqdm(**kwargs)

    llm.generate(["a"] * 8, SamplingParams(max_tokens=1, temperature=0), use_tqdm=bar)
    assert made == [8]
    with pytest.raises(TypeError, match="messages must be a list of messages or of conversations, got generator"):
        llm.chat(m for m in [[{"role": "user", "content": "hi"}]])


def test_any_sequence_or_mapping_is_taken_as_its_list_or_dict(llm: LLM) -> None:
    """generate and chat are typed Sequence / Mapping, as vLLM types them: a deque or a read-only mapping is
    taken as the list or dict it holds."""
    params = SamplingParams(temperature=0, max_tokens=3)
    as_lists = llm.generate(["a", {"prompt_token_ids": [5, 6]}], [params, params])
    as_others = llm.generate(deque(["a", MappingProxyType({"prompt_token_ids": [5, 6]})]), (params, params))
    assert [o.outputs[0].token_ids for o in as_others] == [o.outputs[0].token_ids for o in as_lists]
    message = {"role": "user", "content": "hi"}
    as_dict = llm.chat([message], params)
    as_proxy = llm.chat(deque([MappingProxyType(message)]), params)
    assert as_proxy[0].outputs[0].token_ids == as_dict[0].outputs[0].token_ids
    with pytest.raises(TypeError, match="messages must be a list of messages or of conversations, got str"):
        llm.chat("hi")


def test_a_progress_bar_that_raises_leaves_nothing_queued(llm: LLM) -> None:
    """The call's requests were queued before its progress bar was made: a bar that raised left them for the next
    call to run and throw away."""
    class Broken:
        def __init__(self, **options) -> None:
            raise RuntimeError("progress bar broke")

    with pytest.raises(RuntimeError, match="progress bar broke"):
        llm.generate(["a", "b"], SamplingParams(max_tokens=4), use_tqdm=Broken)
    stats = llm.stats()
    assert (stats["num_waiting"], stats["num_running"], stats["num_blocks_used"]) == (0, 0, 0)


def test_an_llm_in_a_forked_child_refuses_to_generate(llm: LLM) -> None:
    """The child's OpenMP threads did not come with the fork: its first parallel kernel waited for ever."""
    import os

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report what generate raised, then leave at once
        try:
            llm.generate(["a"], SamplingParams(max_tokens=2), use_tqdm=False)
            os.write(write, b"generated")
        except BaseException as error:
            os.write(write, f"{type(error).__name__}: {error}".encode())
        os._exit(0)
    os.close(write)
    said = os.read(read, 1000).decode()
    os.waitpid(pid, 0)
    os.close(read)
    assert said.startswith("RuntimeError: this LLM was made in another process (a fork)"), said
    assert llm.generate(["a"], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


def test_an_llm_cannot_be_pickled_and_says_so(llm: LLM) -> None:
    import pickle

    with pytest.raises(TypeError, match="an LLM cannot be pickled or sent to another process"):
        pickle.dumps(llm)


def test_an_llm_dropped_with_a_disk_tier_stops_its_threads_at_once(tiny_checkpoints, tmp_path) -> None:
    """The KV manager's reference cycles held the tiers until a collection (never, with the collector off)."""
    def tier_threads() -> list[str]:
        return [t.name for t in threading.enumerate() if t.name.startswith("kvserve-kv-")]

    llm = LLM(str(tiny_checkpoints["llama"]), dtype="float32", num_kv_blocks=32, kv_offload_dir=str(tmp_path))
    llm.generate(["hello " * 20], SamplingParams(max_tokens=2), use_tqdm=False)
    assert tier_threads()
    gc.disable()
    try:
        del llm
        assert tier_threads() == []
    finally:
        gc.enable()


def _finish_order(llm: LLM, prompts: list, params: SamplingParams, priorities: list[int],
                  steps_between: int = 0) -> list:
    """Add the prompts one by one (``steps_between`` steps after each) and step to the end: the finished outputs
    in the order they finished."""
    engine, finished = llm.engine, []
    for i, (prompt, priority) in enumerate(zip(prompts, priorities)):
        engine.add_request(f"r{i}", prompt, params, priority=priority)
        for _ in range(steps_between):
            finished += [out for out in engine.step() if out.finished]
    while engine.has_unfinished_requests():
        finished += [out for out in engine.step() if out.finished]
    return finished


def test_the_priority_policy_serves_the_lowest_value_first_and_displaces_with_the_same_tokens(
        llm: LLM, tiny_checkpoints) -> None:
    prompts = [{"prompt_token_ids": [5 + i, 6, 7 + 2 * i]} for i in range(5)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = {f"r{i}": out.outputs[0].token_ids for i, out in enumerate(llm.generate(prompts, params))}
    with LLM(str(tiny_checkpoints["llama"]), dtype="float32", num_kv_blocks=128, max_num_seqs=1,
             scheduling_policy="priority") as ranked:
        queued = _finish_order(ranked, prompts, params, [3, 1, 2, 0, 1])
        assert [out.request_id for out in queued] == ["r3", "r1", "r4", "r2", "r0"]
        # each arrives while the one before runs, and every one of a lower value takes its seat
        displacing = _finish_order(ranked, prompts, params, [4, 3, 2, 1, 0], steps_between=3)
        assert [out.request_id for out in displacing] == ["r4", "r3", "r2", "r1", "r0"]
        assert ranked.engine.core.scheduler.num_preemptions == 4
        for finished in (queued, displacing):
            assert {out.request_id: out.outputs[0].token_ids for out in finished} == expected
        assert_all_blocks_free(ranked)


def test_generate_takes_a_priority_per_prompt_under_the_priority_policy_only(llm: LLM, tiny_checkpoints) -> None:
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    with pytest.raises(InvalidParameter, match="--scheduling-policy priority") as refused:
        llm.generate(["a", "b"], params, priority=[0, 1])
    assert refused.value.param == "priority"
    assert _nothing_queued(llm)  # the first prompt, queued with priority 0, was taken back
    with LLM(str(tiny_checkpoints["llama"]), dtype="float32", num_kv_blocks=128,
             scheduling_policy="priority") as ranked:
        outs = ranked.generate(["a", "b"], params, priority=[5, -2])
        assert [len(o.outputs[0].token_ids) for o in outs] == [3, 3]
        with pytest.raises(ValueError, match="2 values for 3 prompts"):
            ranked.generate(["a", "b", "c"], params, priority=[0, 1])
        with pytest.raises(TypeError, match="one int per prompt"):
            ranked.generate("a", params, priority=1)
        with pytest.raises(InvalidParameter, match="must be an integer"):
            ranked.generate(["a"], params, priority=[True])
        assert _nothing_queued(ranked)


def _nothing_queued(llm: LLM) -> bool:
    stats = llm.stats()
    return (stats["num_waiting"], stats["num_running"], stats["num_blocks_used"]) == (0, 0, 0)
