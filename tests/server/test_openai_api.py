"""The OpenAI API over HTTP with the official SDK: shapes, streaming, usage, n, stop, logprobs, seeds."""

from __future__ import annotations

import concurrent.futures
import json
import re

import httpx
import openai
import pytest

from tests.server.conftest import MODEL_NAME, ServerProcess

PROMPT = "The capital of France is"
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def tokenize(server: ServerProcess, text: str) -> list[int]:
    return httpx.post(f"{server.url}/tokenize", json={"prompt": text}).json()["tokens"]


def test_models_lists_the_served_name(client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL_NAME]
    assert models[0].object == "model"


def test_completion_has_text_usage_and_length_finish(client: openai.OpenAI, server: ServerProcess) -> None:
    answer = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=7, **GREEDY)
    (choice,) = answer.choices
    assert answer.object == "text_completion" and answer.model == MODEL_NAME and answer.id.startswith("cmpl-")
    assert choice.finish_reason == "length" and choice.index == 0 and choice.text
    assert answer.usage.prompt_tokens == len(tokenize(server, PROMPT))
    assert answer.usage.completion_tokens == 7
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + 7


def test_streamed_completion_equals_the_unstreamed_one(client: openai.OpenAI) -> None:
    whole = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, **GREEDY)
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    *text_chunks, usage_chunk = chunks
    assert all(c.object == "text_completion" and len(c.choices) == 1 and c.usage is None for c in text_chunks)
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    assert usage_chunk.choices == [] and usage_chunk.usage == whole.usage


def test_streaming_without_include_usage_sends_no_usage(server: ServerProcess) -> None:
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body) as response:
        lines = [line for line in response.iter_lines() if line]
    assert response.headers["content-type"].startswith("text/event-stream")
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") and '"usage"' not in line for line in lines)


def test_chat_answers_as_the_assistant(client: openai.OpenAI) -> None:
    answer = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=6, **GREEDY)
    (choice,) = answer.choices
    assert answer.object == "chat.completion" and answer.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant" and choice.message.content and choice.finish_reason == "length"
    assert answer.usage.completion_tokens == 6


def test_streamed_chat_equals_the_unstreamed_one(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=9, **GREEDY)
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=9,
                                                 stream=True, stream_options={"include_usage": True}, **GREEDY))
    first, *content_chunks, usage_chunk = chunks
    assert first.object == "chat.completion.chunk" and first.choices[0].delta.role == "assistant"
    assert content_chunks[-1].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].delta.content for c in content_chunks) == whole.choices[0].message.content
    assert usage_chunk.choices == []
    # the same counts, but cached tokens: the stream came second and found the prompt's first block cached (the
    # tests before this one, when run, have cached it for both)
    details = {"prompt_tokens_details"}
    assert usage_chunk.usage.model_dump(exclude=details) == whole.usage.model_dump(exclude=details)
    assert usage_chunk.usage.prompt_tokens_details.cached_tokens >= whole.usage.prompt_tokens_details.cached_tokens


def test_n_samples_come_back_as_indexed_choices(client: openai.OpenAI) -> None:
    answer = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=5, n=3, temperature=1.0,
                                       seed=3, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in answer.choices) == [0, 1, 2]
    assert answer.usage.completion_tokens == 15
    chat = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=4, n=2, seed=3,
                                          extra_body={"ignore_eos": True})
    assert sorted(c.index for c in chat.choices) == [0, 1] and chat.usage.completion_tokens == 8


def test_a_clients_request_id_may_hold_any_character_and_names_the_answer(server: ServerProcess) -> None:
    """'#' names samples inside the engine: a request id made of the client's X-Request-Id was refused over it."""
    for path, body in (("/v1/completions", {"prompt": PROMPT}),
                       ("/v1/chat/completions", {"messages": MESSAGES})):
        answer = httpx.post(f"{server.url}{path}", json={**body, "model": MODEL_NAME, "max_tokens": 2, "n": 2},
                            headers={"X-Request-Id": "trace#7"})
        assert answer.status_code == 200, answer.text
        assert answer.json()["id"].endswith("-trace#7") and answer.headers["x-request-id"] == "trace#7"


def test_a_batch_of_prompts_gets_one_choice_each(client: openai.OpenAI, server: ServerProcess) -> None:
    token_prompt = tokenize(server, "Hello there")
    answer = client.completions.create(model=MODEL_NAME, prompt=[PROMPT, "Hello there"], max_tokens=4, **GREEDY)
    by_tokens = client.completions.create(model=MODEL_NAME, prompt=[token_prompt], max_tokens=4, **GREEDY)
    assert [c.index for c in answer.choices] == [0, 1]
    assert by_tokens.choices[0].text == answer.choices[1].text


def test_a_stop_string_ends_the_text_before_it(client: openai.OpenAI) -> None:
    free = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=16, **GREEDY).choices[0].text
    stop = free[len(free) // 2: len(free) // 2 + 2]
    assert stop.strip(), f"the greedy text {free!r} is too short to pick a stop string from"
    cut = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=16, stop=[stop], **GREEDY)
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == free[: free.index(stop)]
    streamed = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=16, stop=stop, stream=True,
                                         **GREEDY)
    assert "".join(c.choices[0].text for c in streamed) == cut.choices[0].text


def test_completion_logprobs_have_one_entry_per_token(client: openai.OpenAI) -> None:
    answer = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=5, logprobs=3, **GREEDY)
    logprobs = answer.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 5
    assert all(lp <= 0 for lp in logprobs.token_logprobs)
    assert all(1 <= len(top) <= 3 for top in logprobs.top_logprobs)
    # greedy: the chosen token is the most likely one
    for top, chosen in zip(logprobs.top_logprobs, logprobs.token_logprobs):
        assert max(top.values()) == pytest.approx(chosen)
    assert logprobs.text_offset == sorted(logprobs.text_offset)


def test_streamed_text_offsets_are_those_of_the_whole_answer(server: ServerProcess, client: openai.OpenAI) -> None:
    """A stream sends a token before text held back for a stop string: its offset still counts the tokens
    before it, not the text sent so far. With echo, the prompt's tokens come first, from 0, and the answer's
    first token starts where the prompt's text ends (a BOS the tokenizer added takes no room in the text)."""
    free = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, **GREEDY).choices[0].text
    stop = free[len(free) // 2:][:6] + "\u2603"  # long enough to hold back text, never matched
    for echo in (False, True):
        options = {"prompt": PROMPT, "max_tokens": 12, "logprobs": 1, "stop": [stop], "echo": echo, **GREEDY}
        whole = client.completions.create(model=MODEL_NAME, **options).choices[0].logprobs
        chunks = [c.choices[0].logprobs for c in client.completions.create(model=MODEL_NAME, stream=True, **options)
                  if c.choices and c.choices[0].logprobs]
        assert [o for lp in chunks for o in lp.text_offset] == whole.text_offset
        assert whole.text_offset[0] == 0
    num_prompt_tokens = len(tokenize(server, PROMPT))
    assert whole.text_offset[num_prompt_tokens] == len(PROMPT)


def test_chat_logprobs_have_the_asked_number_of_alternatives(client: openai.OpenAI) -> None:
    answer = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=4, logprobs=True,
                                            top_logprobs=2, **GREEDY)
    content = answer.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
    # each token's own bytes (a byte-level token that splits a character is no text alone: spelled "\xfe", as
    # OpenAI spells such tokens), which join into the text
    assert not any("\ufffd" in e.token for e in content)
    text = b"".join(bytes(e.bytes) for e in content).decode("utf-8", errors="replace")
    assert text == answer.choices[0].message.content


def test_logprobs_spell_the_text_when_an_eos_ends_the_answer(tiny_checkpoint, client: openai.OpenAI) -> None:
    """The EOS that ends a sample is no text, so it has no logprob entry: chat's bytes and completions' tokens
    still spell the text, streamed or not."""
    eos = json.loads((tiny_checkpoint / "config.json").read_text())["eos_token_id"]
    ends = {"temperature": 0.0, "logit_bias": {str(eos): 100}, "extra_body": {"min_tokens": 3}}
    answer = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=8, logprobs=True,
                                            top_logprobs=1, **ends)
    assert answer.choices[0].finish_reason == "stop" and answer.usage.completion_tokens == 4
    content = answer.choices[0].logprobs.content
    assert len(content) == 3
    assert b"".join(bytes(e.bytes) for e in content).decode("utf-8", errors="replace") == answer.choices[0].message.content
    streamed = [e for c in client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=8,
                                                         logprobs=True, top_logprobs=1, stream=True, **ends)
                if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    completion = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, logprobs=1, **ends)
    choice = completion.choices[0]
    spelled = b"".join(token_bytes(token) for token in choice.logprobs.tokens).decode("utf-8", errors="replace")
    assert choice.finish_reason == "stop" and spelled == choice.text


def token_bytes(token: str) -> bytes:
    """A completions logprob token's bytes: a token that holds part of a character is spelled as its bytes
    escaped ("\\xe6\\x97")."""
    if re.fullmatch(r"(\\x[0-9a-f]{2})+", token):
        return bytes.fromhex(token.replace("\\x", ""))
    return token.encode("utf-8")


def test_echoed_prompt_tokens_are_among_their_own_top_logprobs(client: openai.OpenAI) -> None:
    """Legacy completions give each position its k most likely tokens and the token itself (OpenAI, vLLM): a
    prompt token the model did not expect still has its entry."""
    answer = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2, logprobs=1, echo=True,
                                       **GREEDY)
    logprobs = answer.choices[0].logprobs
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        if top is not None:
            assert top[token] == logprob and 1 <= len(top) <= 2
    assert any(len(top) == 2 for top in logprobs.top_logprobs if top)  # some prompt token outside the top 1


def test_tokens_that_split_a_character_are_spelled_apart(client: openai.OpenAI) -> None:
    """Tokens holding part of a character were all spelled "\ufffd": in top_logprobs they overwrote each other,
    so a position lost entries and the chosen token's key held another token's (lower) logprob. They are spelled
    with their bytes escaped, as chat's logprobs spell them."""
    answer = client.completions.create(model=MODEL_NAME, prompt="日本の首都は東京です。", max_tokens=4, logprobs=5,
                                       echo=True, **GREEDY)
    logprobs = answer.choices[0].logprobs
    partial = [token for token in logprobs.tokens[1:] if token.startswith("\\x")]
    assert partial, logprobs.tokens  # the byte-level vocabulary splits these characters
    assert "\ufffd" not in "".join(logprobs.tokens)  # the first prompt token (no logprob) spelled alike
    for token, logprob, top in zip(logprobs.tokens[1:], logprobs.token_logprobs[1:], logprobs.top_logprobs[1:]):
        assert top[token] == logprob and len(top) in (5, 6), (token, top)
        assert list(top.values()) == sorted(top.values(), reverse=True) or token in list(top)[-1:]


def test_echo_puts_the_prompt_before_the_completion(client: openai.OpenAI) -> None:
    plain = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, **GREEDY)
    echoed = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, echo=True, **GREEDY)
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text


def test_the_same_seed_gives_the_same_text_whatever_runs_beside_it(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        return client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=10, temperature=1.0, seed=seed,
                                         extra_body={"ignore_eos": True}).choices[0].text

    alone = sample(11)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        together = list(pool.map(sample, [11, 12, 11, 13]))
    assert together[0] == together[2] == alone
    assert alone != together[1] or alone != together[3]


def test_tokenize_and_detokenize_round_trip(server: ServerProcess) -> None:
    tokens = tokenize(server, PROMPT)
    answer = httpx.post(f"{server.url}/tokenize", json={"prompt": PROMPT}).json()
    assert answer["count"] == len(tokens) and answer["max_model_len"] == 256
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": tokens}).json()["prompt"]
    assert PROMPT in text
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": MESSAGES}).json()
    assert chat["count"] > len(tokenize(server, MESSAGES[0]["content"]))
    refused = httpx.post(f"{server.url}/tokenize", json={"prompt": PROMPT, "add_generation_prompt": False})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "add_generation_prompt"


def test_a_conversation_too_long_for_the_context_names_messages(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "the cat " * 300}])
    error = raised.value.body
    assert error["param"] == "messages" and error["message"].startswith("messages (") and "max_model_len=256" in \
        error["message"]


def test_a_lone_surrogate_in_a_tool_is_a_bad_request(server: ServerProcess) -> None:
    """Only message content was checked for lone surrogates; one in a tool's description reached the tokenizer,
    whose TypeError was a 500."""
    tool = {"type": "function", "function": {"name": "f", "description": "d\ud800"}}
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "tools": [tool], "max_tokens": 1}
    # json.dumps writes the surrogate as the escape "\\ud800", as a client's JSON carries it
    answer = httpx.post(f"{server.url}/v1/chat/completions", content=json.dumps(body),
                        headers={"Content-Type": "application/json"})
    assert answer.status_code == 400 and "lone surrogate" in answer.json()["error"]["message"], answer.text


def test_greedy_output_over_http_equals_the_offline_api(client: openai.OpenAI, tiny_checkpoint) -> None:
    from kvserve import LLM, SamplingParams

    prompts = [PROMPT, "Once upon a time", "1, 2, 3,"]
    llm = LLM(str(tiny_checkpoint), num_kv_blocks=64, max_model_len=256, device="cpu")
    offline = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), use_tqdm=False)
    for prompt, expected in zip(prompts, offline):
        answer = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=12, **GREEDY)
        assert answer.choices[0].text == expected.outputs[0].text


def test_echo_with_no_tokens_scores_the_prompt(client: openai.OpenAI) -> None:
    """``echo`` with ``max_tokens`` 0, as evaluation harnesses score a text: the prompt and its logprobs, nothing
    drawn; the same streamed. ``max_tokens`` 0 without echo is still refused."""
    scored = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1,
                                       temperature=0.0)
    choice = scored.choices[0]
    echoed = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=1, echo=True, logprobs=1,
                                       temperature=0.0).choices[0].logprobs
    assert choice.text == PROMPT and choice.finish_reason == "length" and scored.usage.completion_tokens == 0
    num_prompt_tokens = scored.usage.prompt_tokens
    assert choice.logprobs.token_logprobs == echoed.token_logprobs[:num_prompt_tokens]
    assert choice.logprobs.tokens == echoed.tokens[:num_prompt_tokens]
    chunks = [c.choices[0] for c in client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=0,
                                                              echo=True, logprobs=1, stream=True) if c.choices]
    assert "".join(c.text for c in chunks) == PROMPT and chunks[-1].finish_reason == "length"
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=0)


def test_a_cache_salt_shares_cached_prefixes_only_within_its_salt(client: openai.OpenAI,
                                                                   server: ServerProcess) -> None:
    """vLLM's ``cache_salt`` (completions and chat): a prompt sent under one salt is found cached only by
    requests sent with that salt; a salt that is no non-empty string is a 400 naming it."""
    prompt = "Only the tenants of this test send this prompt, long enough to fill a few blocks. " * 3

    def cached(salt: str | None, chat: bool = False) -> int:
        extra = {"extra_body": {"cache_salt": salt}} if salt else {}
        if chat:
            answer = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": prompt}],
                                                    max_tokens=1, temperature=0, **extra)
        else:
            answer = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=1, temperature=0, **extra)
        return answer.usage.prompt_tokens_details.cached_tokens

    sent = [("tenant-1", False), ("tenant-1", False), ("tenant-2", False), (None, False), (None, False),
            ("tenant-1", True), ("tenant-1", True), ("tenant-3", True)]
    got = [cached(salt, chat) for salt, chat in sent]
    assert got[0] == got[2] == got[3] == got[5] == got[7] == 0 and min(got[1], got[4], got[6]) >= 16, got
    for body in ({"cache_salt": ""}, {"cache_salt": ["tenant-1"]}):
        response = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL_NAME, "prompt": "Hi", **body})
        assert response.status_code == 400 and response.json()["error"]["param"] == "cache_salt", response.text


def test_continue_final_message_goes_on_from_the_assistants_text(client: openai.OpenAI, server: ServerProcess) -> None:
    """vLLM's prefill: the reply continues the last message, as a completion of the open rendering (which
    /tokenize gives with the same fields) does; with add_generation_prompt left true it is a 400 naming it."""
    messages = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "The colour is"}]
    options = {"add_generation_prompt": False, "continue_final_message": True}
    chat = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=5, temperature=0,
                                          extra_body={**options, "ignore_eos": True})
    rendered = httpx.post(f"{server.url}/tokenize", json={"messages": messages, **options}).json()["tokens"]
    closed = httpx.post(f"{server.url}/tokenize", json={"messages": messages, "add_generation_prompt": False})
    assert len(closed.json()["tokens"]) > len(rendered)  # the template's end of the message is left out
    completion = client.completions.create(model=MODEL_NAME, prompt=rendered, max_tokens=5, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert chat.choices[0].message.content == completion.choices[0].text
    assert chat.usage.prompt_tokens == len(rendered)
    both = httpx.post(f"{server.url}/v1/chat/completions",
                      json={"model": MODEL_NAME, "messages": messages, "continue_final_message": True})
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message", both.text


def test_chat_template_kwargs_reach_the_template_and_may_not_set_its_options(server: ServerProcess) -> None:
    body = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 1}
    fine = httpx.post(f"{server.url}/v1/chat/completions", json={**body, "chat_template_kwargs": {"enable_thinking":
                                                                                                   False}})
    assert fine.status_code == 200, fine.text
    for kwargs in ({"tokenize": True}, ["enable_thinking"]):
        refused = httpx.post(f"{server.url}/v1/chat/completions", json={**body, "chat_template_kwargs": kwargs})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "chat_template_kwargs", refused.text
    prompt = httpx.post(f"{server.url}/tokenize", json={"prompt": "hi", "continue_final_message": True})
    assert prompt.status_code == 400 and prompt.json()["error"]["param"] == "continue_final_message", prompt.text


def test_token_restrictions_over_http(client: openai.OpenAI, server: ServerProcess) -> None:
    """vLLM's ``allowed_token_ids``, ``bad_words`` and ``truncate_prompt_tokens`` (``tests/engine/
    test_token_restrictions.py`` holds them to transformers); a bad one is a 400 naming it."""
    allowed = tokenize(server, " yes no")
    answer = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=3,
                                       logprobs=0, extra_body={"allowed_token_ids": allowed, "ignore_eos": True})
    assert set(tokenize(server, answer.choices[0].text)) <= set(allowed)
    free = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, **GREEDY).choices[0].text
    word = free.split()[0]
    banned = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0.0,
                                       extra_body={"bad_words": [word], "ignore_eos": True}).choices[0].text
    assert not banned.startswith(word) and not banned.startswith(" " + word)
    cut = client.completions.create(model=MODEL_NAME, prompt="Some words before. " + PROMPT, max_tokens=1,
                                    extra_body={"truncate_prompt_tokens": 3})
    assert cut.usage.prompt_tokens == 3
    for body in ({"allowed_token_ids": []}, {"bad_words": [" "]}, {"truncate_prompt_tokens": 0},
                 {"allowed_token_ids": [10**9]}):
        response = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL_NAME, "prompt": "Hi", **body})
        assert response.status_code == 400 and response.json()["error"]["param"] == next(iter(body)), response.text
