"""POST /v1/messages (Anthropic's Messages API) through the HTTP app with the anthropic SDK as the client: shapes,
stop reasons and events over scripted model-free engines (text, a Hermes tool call, a Qwen3 thinking), a tool
round trip, refusals by name in Anthropic's error shape, the API key in X-Api-Key, a client gone mid-stream; and
over a tiny real checkpoint, token for token the chat endpoint's answer to the same conversation, and the prefix
cache's hits as cache reads."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import anthropic
import httpx
import openai
import pytest

from kvserve.server.errors import sse_failure
from kvserve.server.messages_protocol import MessagesRequest
from tests.server.conftest import MODEL_NAME
from tests.server.test_app_fake_engine import MODEL, InProcessServer
from tests.server.test_reasoning import THOUGHT
from tests.server.test_responses import ANSWER, kinds

WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CHAT_WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                                 "parameters": WEATHER["input_schema"]}}
USER = [{"role": "user", "content": "hi"}]
TEXT_EVENTS = ["message_start", "content_block_start", "content_block_delta", "content_block_stop", "message_delta",
               "message_stop"]


def sdk(srv: InProcessServer, **options: Any) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=srv.url, api_key=options.pop("api_key", "unused"), max_retries=0, **options)


def chat_sdk(srv: InProcessServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)


def raw_events(url: str, body: dict, headers: dict | None = None) -> list[tuple[str, dict]]:
    """A stream's events as sent: each one's ``event:`` name and its data."""
    with httpx.stream("POST", f"{url}/v1/messages", json=body, headers=headers) as answer:
        lines = [line for line in answer.iter_lines() if line]
    names, data = lines[0::2], [json.loads(line.removeprefix("data: ")) for line in lines[1::2]]
    return [(name.removeprefix("event: "), event) for name, event in zip(names, data)]


def test_a_message_is_anthropics_object_and_its_text_the_chat_answers(talker: InProcessServer) -> None:
    system = [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}]
    message = sdk(talker).messages.create(model=MODEL, max_tokens=64, messages=USER, system=system,
                                          metadata={"user_id": "u1"}, service_tier="auto")
    chat = chat_sdk(talker).chat.completions.create(model=MODEL, messages=[
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]}, *USER])
    assert message.id.startswith("msg_") and message.type == "message" and message.role == "assistant"
    assert [block.type for block in message.content] == ["text"] and message.model == MODEL
    assert message.content[0].text == chat.choices[0].message.content == ANSWER
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    usage = message.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert usage.output_tokens == chat.usage.completion_tokens and usage.cache_creation_input_tokens == 0


def test_max_tokens_is_its_stop_reason(talker: InProcessServer) -> None:
    client = sdk(talker)
    cut = client.messages.create(model=MODEL, max_tokens=4, messages=USER)
    assert cut.stop_reason == "max_tokens" and cut.content[0].text == ANSWER[:4] and cut.usage.output_tokens == 4
    with client.messages.stream(model=MODEL, max_tokens=4, messages=USER) as stream:
        assert stream.get_final_message().stop_reason == "max_tokens"


def test_a_stream_is_anthropics_named_events_adding_up_to_the_message(talker: InProcessServer) -> None:
    events = raw_events(talker.url, {"model": MODEL, "max_tokens": 64, "messages": USER, "stream": True})
    assert all(name == event["type"] for name, event in events)
    assert kinds([name for name, _ in events]) == TEXT_EVENTS
    start = events[0][1]["message"]
    assert start["id"].startswith("msg_") and start["content"] == [] and start["stop_reason"] is None
    assert events[1][1]["content_block"] == {"type": "text", "text": ""}
    deltas = [event["delta"] for name, event in events if name == "content_block_delta"]
    assert {d["type"] for d in deltas} == {"text_delta"} and "".join(d["text"] for d in deltas) == ANSWER
    assert {event["index"] for name, event in events if name.startswith("content_block")} == {0}
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == len(ANSWER)
    assert delta["usage"]["input_tokens"] == start["usage"]["input_tokens"]
    client = sdk(talker)
    with client.messages.stream(model=MODEL, max_tokens=64, messages=USER) as stream:  # the SDK's accumulation
        assert "".join(stream.text_stream) == ANSWER
        final = stream.get_final_message()
    assert final.content[0].text == ANSWER and final.stop_reason == "end_turn"
    assert final.usage.output_tokens == len(ANSWER) and final.id.startswith("msg_")
    created = list(client.messages.create(model=MODEL, max_tokens=64, messages=USER, stream=True))
    assert [e.type for e in created][0] == "message_start" and created[-1].type == "message_stop"


def test_a_tool_call_is_a_tool_use_block_and_goes_back_round_as_a_tool_result(caller: InProcessServer) -> None:
    client = sdk(caller)
    question = [{"role": "user", "content": "Weather in Oslo?"}]
    message = client.messages.create(model=MODEL, max_tokens=200, messages=question, tools=[WEATHER])
    text, call = message.content
    assert text.text == "Checking.\n" and call.type == "tool_use" and call.name == "get_weather"
    assert call.input == {"city": "Oslo"} and message.stop_reason == "tool_use"
    events = raw_events(caller.url, {"model": MODEL, "max_tokens": 200, "messages": question, "tools": [WEATHER],
                                     "stream": True})
    starts = [event["content_block"] for name, event in events if name == "content_block_start"]
    assert [b["type"] for b in starts] == ["text", "tool_use"] and starts[1]["name"] == "get_weather"
    pieces = [e["delta"]["partial_json"] for _, e in events if e.get("delta", {}).get("type") == "input_json_delta"]
    assert json.loads("".join(pieces)) == {"city": "Oslo"}
    assert all(e["index"] == 1 for _, e in events if e.get("delta", {}).get("type") == "input_json_delta")
    with client.messages.stream(model=MODEL, max_tokens=200, messages=question, tools=[WEATHER]) as stream:
        streamed = stream.get_final_message()
    assert streamed.content[1].input == {"city": "Oslo"} and streamed.stop_reason == "tool_use"
    # the SDK's answer goes back as the assistant's turn, with the call's result (text blocks, then a failed one);
    # the fake engine's template writes each message's content as it comes (a call's, the real checkpoint's test)
    for result, chat_result in ((anthropic_result(call.id, [{"type": "text", "text": "Sunny"}]), "Sunny"),
                                (anthropic_result(call.id, "timed out", is_error=True), "Error: timed out")):
        again = client.messages.create(model=MODEL, max_tokens=200, tools=[WEATHER], tool_choice={"type": "none"},
                                       messages=[*question, {"role": "assistant", "content": message.content},
                                                 {"role": "user", "content": [result]}])
        chat = chat_sdk(caller).chat.completions.create(model=MODEL, tools=[CHAT_WEATHER], tool_choice="none",
                                                        messages=[*question, {
            "role": "assistant", "content": [{"type": "text", "text": "Checking.\n"}], "tool_calls": [{
                "id": call.id, "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": call.id, "content": chat_result}])
        assert again.usage.input_tokens + again.usage.cache_read_input_tokens == chat.usage.prompt_tokens


def anthropic_result(tool_use_id: str, content: Any, is_error: bool = False) -> dict:
    return {"type": "tool_result", "tool_use_id": tool_use_id, "content": content, "is_error": is_error}


@pytest.mark.parametrize("choice, chat_choice, parallel", [
    ({"type": "auto"}, "auto", True),
    ({"type": "any"}, "required", True),
    ({"type": "none"}, "none", True),
    ({"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
     {"type": "function", "function": {"name": "get_weather"}}, False),
])
def test_a_tool_choice_is_chats(choice: dict, chat_choice: Any, parallel: bool) -> None:
    request = MessagesRequest.model_validate({"model": "", "max_tokens": 1, "messages": USER, "tools": [WEATHER],
                                              "tool_choice": choice})
    chat = request.chat_request
    assert chat.effective_tool_choice == chat_choice and chat.parallel_tool_calls is parallel
    assert chat.tool_dicts == [CHAT_WEATHER]


BILLING = "x-anthropic-billing-header: cc_version=2.1.160.a1b; cc_entrypoint=cli; cch=3f9c2;"


def chat_messages_of(**body: Any) -> list[dict]:
    request = MessagesRequest.model_validate({"model": "", "max_tokens": 1, **body})
    return [message.model_dump(exclude_none=True) for message in request.chat_request.messages]


@pytest.mark.parametrize("system, turns, chat_system", [
    # Claude Code's billing line left out, as its own block and as a string's first line
    ([{"type": "text", "text": BILLING}, {"type": "text", "text": "You are a CLI."}], [],
     [{"type": "text", "text": "You are a CLI."}]),
    (f"{BILLING}\nYou are a CLI.", [], "You are a CLI."),
    (BILLING, [], None),
    # a system turn (newer Claude Code releases send them) joins the system prompt, at the start
    ("You are a CLI.", [{"role": "system", "content": f"{BILLING}\nRemember the date."}],
     [{"type": "text", "text": "You are a CLI."}, {"type": "text", "text": "Remember the date."}]),
    (None, [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]}],
     [{"type": "text", "text": "Be brief."}]),
    # only a line that starts with it: one that quotes it is the prompt's text
    ("Never print x-anthropic-billing-header: lines.", [], "Never print x-anthropic-billing-header: lines."),
])
def test_claude_codes_system_turns_join_the_system_prompt_without_its_billing_line(
        system: Any, turns: list, chat_system: Any) -> None:
    messages = chat_messages_of(messages=[*USER[:1], *turns, {"role": "assistant", "content": "ok"}, *USER],
                                **({"system": system} if system is not None else {}))
    if chat_system is None:
        assert [m["role"] for m in messages] == ["user", "assistant", "user"]
    else:
        assert messages[0] == {"role": "system", "content": chat_system}
        assert [m["role"] for m in messages[1:]] == ["user", "assistant", "user"]
    # the user's own text is theirs, billing line or not
    assert chat_messages_of(messages=[{"role": "user", "content": BILLING}])[0]["content"] == BILLING


def test_thinking_is_a_thinking_block_before_the_text(thinker: InProcessServer) -> None:
    client = sdk(thinker)
    question = [{"role": "user", "content": "What is the capital of France?"}]
    message = client.messages.create(model=MODEL, max_tokens=200, messages=question)
    thinking, text = message.content
    assert thinking.type == "thinking" and thinking.thinking == THOUGHT and text.text == "Paris."
    with client.messages.stream(model=MODEL, max_tokens=200, messages=question) as stream:
        events = list(stream)
        streamed = stream.get_final_message()
    assert [b.type for b in streamed.content] == ["thinking", "text"] and streamed.content[0].thinking == THOUGHT
    assert [e.index for e in events if e.type == "content_block_start"] == [0, 1]
    # the thinking sent back is the turn's reasoning, as a chat message's: the chat template renders or drops it
    follow_up = {"role": "user", "content": "And Spain?"}
    answered = [block.model_dump() for block in message.content]
    assert client.messages.create(model=MODEL, max_tokens=1, messages=[
        *question, {"role": "assistant", "content": answered}, follow_up]).stop_reason == "max_tokens"
    (_, assistant, _) = chat_messages_of(messages=[*question, {"role": "assistant", "content": answered}, follow_up])
    assert assistant["reasoning"] == THOUGHT and assistant["content"] == [{"type": "text", "text": "Paris."}]
    (_, plain, _) = chat_messages_of(messages=[*question, {"role": "assistant", "content": answered[1:]}, follow_up])
    assert "reasoning" not in plain


@pytest.mark.parametrize("extra, named", [
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ({"output_config": {"effort": "low"}}, "output_config"),
    ({"container": "c1"}, "container"),
    ({"mcp_servers": []}, "mcp_servers"),
    ({"metadata": {"tenant": "t"}}, "metadata.tenant"),
    ({"cache_control": {"type": "persistent"}}, "cache_control"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "web_search_20250305"),
    ({"tools": [{**WEATHER, "input_examples": [{"city": "Oslo"}]}]}, "tools.0.input_examples"),
    ({"tools": [{**WEATHER, "input_schema": {"type": "array"}}]}, "tools.0.input_schema"),
    ({"tools": [{**WEATHER, "input_schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}]},
     "tools[0].input_schema"),  # chat's check, in Anthropic's words
    ({"tools": [WEATHER], "tool_choice": {"type": "tool"}}, "tool_choice.name"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),  # with no tools
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "x"}}]}]},
     "'image'"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "w", "input": {}}]}]},
     "'tool_use'"),
    ({"messages": [{"role": "assistant", "content": [{"type": "redacted_thinking", "data": "x"}]}]},
     "'redacted_thinking'"),
    ({"messages": [{"role": "system", "content": "x"}]}, "no user or assistant turn"),
    ({"messages": [{"role": "system", "content": [{"type": "tool_result", "tool_use_id": "t"}]}, *USER]},
     "'tool_result'"),
    ({"messages": [{"role": "developer", "content": "x"}, *USER]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "citations": [{}]}]}]}, "citations"),
    ({"messages": []}, "messages"),
    ({"max_tokens": None}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"stop_sequences": [""]}, "stop_sequences"),
])
def test_what_kvserve_does_not_implement_is_a_400_in_anthropics_shape(talker: InProcessServer, extra: dict,
                                                                      named: str) -> None:
    body = {"model": MODEL, "max_tokens": 8, "messages": USER, **extra}
    answer = httpx.post(f"{talker.url}/v1/messages", json={k: v for k, v in body.items() if v is not None})
    assert answer.status_code == 400, answer.text
    assert answer.json()["type"] == "error" and answer.json()["error"]["type"] == "invalid_request_error"
    assert named in answer.json()["error"]["message"]
    talker.wait_idle()
    assert not talker.fake.requests


def test_the_sdk_reads_a_refusal(talker: InProcessServer) -> None:
    with pytest.raises(anthropic.BadRequestError) as refused:
        sdk(talker).messages.create(model=MODEL, max_tokens=8, messages=USER, extra_body={"thinking": {
            "type": "enabled", "budget_tokens": 1024}})
    assert refused.value.status_code == 400 and "thinking" in refused.value.message
    assert refused.value.body["error"]["type"] == "invalid_request_error"


def test_every_error_on_the_route_is_in_anthropics_shape(talker: InProcessServer) -> None:
    """Routing's, the model's and a stream's failure midway alike; the OpenAI routes keep OpenAI's shape."""
    with pytest.raises(anthropic.NotFoundError) as unknown:
        sdk(talker).messages.create(model="not-served", max_tokens=8, messages=USER)
    assert unknown.value.body == {"type": "error", "error": {"type": "not_found_error",
                                                            "message": unknown.value.body["error"]["message"]}}
    wrong_method = httpx.get(f"{talker.url}/v1/messages")
    assert wrong_method.status_code == 405 and wrong_method.json()["type"] == "error"
    assert httpx.post(f"{talker.url}/v1/chat/completions", json={}).json()["error"]["param"] == "messages"
    failure = sse_failure(500, "the engine failed: boom", "/v1/messages")
    assert failure.startswith("event: error\ndata: ") and "[DONE]" not in failure
    assert json.loads(failure.split("data: ")[1]) == {"type": "error", "error": {
        "type": "api_error", "message": "the engine failed: boom"}}


def test_the_api_key_comes_in_x_api_key_or_as_a_bearer_token() -> None:
    server = InProcessServer(fake=talker_engine(), api_keys=("sesame", "rotated"))
    try:
        assert sdk(server, api_key="sesame").messages.create(model=MODEL, max_tokens=4, messages=USER).content
        assert sdk(server, api_key=None, auth_token="rotated").messages.create(model=MODEL, max_tokens=4,
                                                                               messages=USER).content
        with pytest.raises(anthropic.AuthenticationError):
            sdk(server, api_key="sesame2").messages.create(model=MODEL, max_tokens=4, messages=USER)
        refused = httpx.post(f"{server.url}/v1/messages", json={}, headers={"X-Api-Key": "wrong"})
        assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"
        chat = {"model": MODEL, "messages": USER, "max_tokens": 1}
        assert httpx.post(f"{server.url}/v1/chat/completions", json=chat,
                          headers={"X-Api-Key": "rotated"}).status_code == 200
        assert httpx.post(f"{server.url}/v1/chat/completions", json=chat,
                          headers={"X-Api-Key": "", "Authorization": "Basic sesame"}).status_code == 401
    finally:
        server.stop()


def talker_engine():
    from tests.server.test_reasoning import ScriptedEngine

    return ScriptedEngine(ANSWER)


def test_a_client_gone_mid_stream_aborts_its_request(talker: InProcessServer) -> None:
    aborted_before = talker.metric("kvserve:request_success_total", finished_reason="abort")
    talker.fake.script = b"x" * 200  # long enough to be left mid-way, at 50 ms a step however slow the client
    talker.fake.step_seconds = 0.05

    async def leave_mid_stream() -> None:
        async with httpx.AsyncClient(timeout=30) as client:
            body = {"model": MODEL, "max_tokens": 300, "messages": USER, "stream": True}
            async with client.stream("POST", f"{talker.url}/v1/messages", json=body) as response:
                async for line in response.aiter_lines():
                    if line == "event: content_block_delta":
                        return

    try:
        asyncio.run(leave_mid_stream())
        talker.wait_idle()
    finally:
        talker.fake.script = ANSWER.encode()
        talker.fake.step_seconds = 0.001
    assert talker.metric("kvserve:request_success_total", finished_reason="abort") - aborted_before == 1
    assert talker.metric("kvserve:kv_cache_usage_perc") == 0


# ---- a tiny real checkpoint (the session's shared server) -----------------------------------------------------


def test_a_message_is_token_for_token_the_chat_answer(server, client: openai.OpenAI) -> None:
    """The same conversation, a tool round trip included, through both endpoints: the same prompt tokens and
    the same greedy tokens, whole and streamed; the second time, its prompt found in the prefix cache; a stop
    sequence met is its stop reason."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"}]
    turns = [{"role": "user", "content": [{"type": "text", "text": "Weather in Oslo?"}]},
             {"role": "assistant", "content": [{"type": "tool_use", "id": "call_1", "name": "get_weather",
                                                "input": {"city": "Oslo"}}]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1", "content": "Sunny"}]}]
    messages_client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    for conversation, chat_messages, system in ((turns, messages, "Answer briefly."),
                                                ("Weather in Oslo?", messages[1:2], None)):
        chat = client.chat.completions.create(model=MODEL_NAME, messages=chat_messages, temperature=0, max_tokens=12)
        # this SDK release no longer sends temperature (Anthropic's newer models refuse it); kvserve takes it, as vLLM
        body = {"model": MODEL_NAME, "max_tokens": 12, "extra_body": {"temperature": 0},
                "messages": conversation if isinstance(conversation, list) else [
                    {"role": "user", "content": conversation}]} | ({"system": system} if system else {})
        message = messages_client.messages.create(**body)
        assert message.content[0].text and message.content[0].text == chat.choices[0].message.content
        usage = message.usage
        assert usage.input_tokens + usage.cache_read_input_tokens == chat.usage.prompt_tokens
        assert usage.cache_read_input_tokens > 0  # the chat request just computed the same prompt
        assert usage.output_tokens == chat.usage.completion_tokens
        with messages_client.messages.stream(**body) as stream:
            assert "".join(stream.text_stream) == message.content[0].text
    text = message.content[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    stopped = messages_client.messages.create(**body, stop_sequences=["\x00never", stop])
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", stop)
    assert stopped.content[0].text == text[:text.index(stop)]
    with messages_client.messages.stream(**body, stop_sequences=[stop]) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)


def test_claude_codes_next_request_finds_its_prompt_in_the_cache(server) -> None:
    """Two requests whose billing lines differ (its hash changes with every request): the second finds the whole
    prompt but the last block's tokens in the prefix cache, and both answer as the prompt without the line."""
    messages_client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    system = ("You are a command line coding assistant. Answer in one short sentence, and never use more words than "
              "the question needs. ") * 2
    turns = [{"role": "user", "content": "What does ls do?"}]

    def answer(billing: str | None) -> anthropic.types.Message:
        blocks = [{"type": "text", "text": billing}] if billing else []
        return messages_client.messages.create(model=MODEL_NAME, max_tokens=6, messages=turns, extra_body={
            "temperature": 0}, system=[*blocks, {"type": "text", "text": system}])

    plain = answer(None)
    first, second = answer(BILLING), answer(BILLING.replace("3f9c2", "77e01"))
    assert first.content[0].text == second.content[0].text == plain.content[0].text
    prompt = plain.usage.input_tokens + plain.usage.cache_read_input_tokens
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens == prompt
    assert second.usage.cache_read_input_tokens >= prompt - 16  # all but the last, partly filled, block


def test_count_tokens_counts_the_prompt_a_message_would_run(server, client: openai.OpenAI) -> None:
    """The anthropic SDK's messages.count_tokens: the chat template's rendering of the conversation, its system
    prompt and tools (the prompt tokens the chat answer to it reports); errors in Anthropic's shape."""
    messages_client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    chat = client.chat.completions.create(model=MODEL_NAME, max_tokens=1,
                                          messages=[{"role": "system", "content": "Be brief."},
                                                    {"role": "user", "content": "Weather in Oslo?"}])
    conversation = {"model": MODEL_NAME, "system": "Be brief.",
                    "messages": [{"role": "user", "content": "Weather in Oslo?"}]}
    assert messages_client.messages.count_tokens(**conversation).input_tokens == chat.usage.prompt_tokens
    # the tools' schemas join the prompt (past this test server's context: counted all the same)
    with_tools = messages_client.messages.count_tokens(**conversation, tools=[WEATHER]).input_tokens
    assert with_tools > chat.usage.prompt_tokens + 50
    refused = httpx.post(f"{server.url}/v1/messages/count_tokens", json={"model": MODEL_NAME, "messages": []})
    assert refused.status_code == 400 and refused.json()["type"] == "error"
    assert refused.json()["error"]["type"] == "invalid_request_error"
