"""POST /v1/responses through the HTTP app with the openai SDK as the client: shapes and events over scripted
model-free engines (text, a Hermes tool call, a Qwen3 thinking), refusals by name, a client gone mid-stream; and
over a tiny real checkpoint, token for token the chat endpoint's answer to the same conversation, and
``text.format`` json_schema through ``responses.parse``."""

from __future__ import annotations

import asyncio
import json
from typing import Any, Iterator

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from kvserve.server.responses_protocol import ResponsesRequest
from tests.server.conftest import MODEL_NAME
from tests.server.test_app_fake_engine import MODEL, InProcessServer
from tests.server.test_reasoning import THOUGHT, ScriptedEngine

ANSWER = "Hello there."
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city", "strict": None,
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
# a text answer's events, each run of deltas as one (the engine hands a slow reader several tokens at once)
TEXT_EVENTS = ["response.created", "response.in_progress", "response.output_item.added",
               "response.content_part.added", "response.output_text.delta", "response.output_text.done",
               "response.content_part.done", "response.output_item.done", "response.completed"]


def kinds(types: list[str]) -> list[str]:
    """``types`` with each run of one type as one."""
    return [kind for i, kind in enumerate(types) if i == 0 or types[i - 1] != kind]


def scripted_server(script: str, **settings: Any) -> Iterator[InProcessServer]:
    server = InProcessServer(fake=ScriptedEngine(script), **settings)
    yield server
    server.stop()


def sdk(srv: InProcessServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)


def test_a_response_is_openais_object_and_its_text_the_chat_answers(talker: InProcessServer) -> None:
    client = sdk(talker)
    response = client.responses.create(model=MODEL, input="hi", instructions="Be brief.", metadata={"k": "v"})
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": "Be brief."},
                                                                 {"role": "user", "content": "hi"}])
    assert response.id.startswith("resp_") and response.object == "response" and response.status == "completed"
    assert response.output_text == chat.choices[0].message.content == ANSWER
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"
    assert message.id.startswith("msg_") and [part.type for part in message.content] == ["output_text"]
    usage = response.usage
    assert (usage.input_tokens, usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.output_tokens_details.reasoning_tokens == 0 and usage.input_tokens_details.cached_tokens == 0
    assert response.instructions == "Be brief." and response.metadata == {"k": "v"} and response.store is False
    assert response.incomplete_details is None and response.text.format.type == "text"


def test_max_output_tokens_makes_it_incomplete(talker: InProcessServer) -> None:
    response = sdk(talker).responses.create(model=MODEL, input="hi", max_output_tokens=4)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.output_text == ANSWER[:4] and response.output[-1].status == "incomplete"
    assert response.max_output_tokens == 4 and response.usage.output_tokens == 4
    events = list(sdk(talker).responses.create(model=MODEL, input="hi", max_output_tokens=4, stream=True))
    assert events[-1].type == "response.incomplete" and events[-1].response.status == "incomplete"
    assert events[-2].item.status == "incomplete"


def test_a_stream_is_openais_numbered_events_adding_up_to_the_response(talker: InProcessServer) -> None:
    client = sdk(talker)
    events = list(client.responses.create(model=MODEL, input="hi", stream=True))
    assert kinds([e.type for e in events]) == TEXT_EVENTS
    assert [e.sequence_number for e in events] == list(range(len(events)))
    created, final = events[0].response, events[-1].response
    assert created.status == "in_progress" and created.output == [] and created.id == final.id
    item_id = events[2].item.id
    assert all(e.item_id == item_id for e in events[3:-2]) and events[-2].item.id == item_id
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == ANSWER
    assert final.output_text == ANSWER and final.output[0].id == item_id
    assert final.usage.output_tokens == len(ANSWER) and final.status == "completed"
    with client.responses.stream(model=MODEL, input="hi") as stream:  # the SDK's own accumulation
        assert stream.get_final_response().output_text == ANSWER


def test_a_streamed_answer_is_event_for_event_what_the_raw_body_says(talker: InProcessServer) -> None:
    """OpenAI's framing: each event named in an event line, its data JSON, no [DONE]."""
    with httpx.stream("POST", f"{talker.url}/v1/responses", json={"input": "hi", "stream": True}) as answer:
        lines = [line for line in answer.iter_lines() if line]
    names, data = lines[0::2], [json.loads(line.removeprefix("data: ")) for line in lines[1::2]]
    assert [n.removeprefix("event: ") for n in names] == [d["type"] for d in data]
    assert kinds([d["type"] for d in data]) == TEXT_EVENTS


TOOL_ROUND_TRIP = [{"role": "user", "content": "Weather in Oslo?"}]


def test_a_tool_call_is_a_function_call_item_and_goes_back_round(caller: InProcessServer) -> None:
    client = sdk(caller)
    response = client.responses.create(model=MODEL, input=TOOL_ROUND_TRIP, tools=[WEATHER])
    message, call = response.output
    assert message.content[0].text == "Checking.\n" and response.output_text == "Checking.\n"
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert json.loads(call.arguments) == {"city": "Oslo"} and call.call_id.startswith("call_")
    assert call.id.startswith("fc_") and response.tools[0].name == "get_weather" and response.tool_choice == "auto"
    events = list(client.responses.create(model=MODEL, input=TOOL_ROUND_TRIP, tools=[WEATHER], stream=True))
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert json.loads("".join(pieces)) == json.loads(done.arguments) == {"city": "Oslo"}
    streamed = events[-1].response.output
    assert [i.type for i in streamed] == ["message", "function_call"] and streamed[1].name == "get_weather"
    # the SDK's output items go back as input, with the call's output
    follow_up = [*TOOL_ROUND_TRIP, *[item.model_dump(exclude_none=True) for item in response.output],
                 {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}]
    again = client.responses.create(model=MODEL, input=follow_up, tools=[WEATHER], tool_choice="none")
    chat = client.chat.completions.create(model=MODEL, tools=[{"type": "function", "function": {
        k: v for k, v in WEATHER.items() if k != "type"}}], tool_choice="none", messages=[
        *TOOL_ROUND_TRIP,
        {"role": "assistant", "content": [{"type": "text", "text": "Checking.\n"}], "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 21 C"}])
    assert again.usage.input_tokens == chat.usage.prompt_tokens
    assert again.output_text == chat.choices[0].message.content


def test_the_tail_of_a_calls_arguments_beside_the_text_after_it_stays_the_calls() -> None:
    """The parser holds a call's last arguments back until the call closes: they may come in one delta with the
    text written after the call, and belong to the call, not to a message that text opens."""
    from kvserve.server.chat_protocol import DeltaFunctionCall, DeltaMessage, DeltaToolCall
    from kvserve.server.responses import ResponseEvents

    events = ResponseEvents()
    opening = DeltaToolCall(index=0, id="call_1", type="function",
                            function=DeltaFunctionCall(name="get_weather", arguments='{"cit'))
    tail = DeltaToolCall(index=0, function=DeltaFunctionCall(arguments='y": "Oslo"}'))
    then = DeltaToolCall(index=1, id="call_2", type="function",
                         function=DeltaFunctionCall(name="get_time", arguments="{}"))
    list(events.pieces(DeltaMessage(content="Checking.\n", tool_calls=[opening])))
    list(events.pieces(DeltaMessage(content="\nAnd the time:", tool_calls=[tail, then])))
    list(events.finish("completed"))
    shape = [(item.type, getattr(item, "arguments", None)) for item in events.items]
    assert shape == [("message", None), ("function_call", '{"city": "Oslo"}'), ("message", None),
                     ("function_call", "{}")]
    assert events.items[2].content[0].text == "\nAnd the time:"


def test_a_named_tool_choice_is_the_responses_shape(caller: InProcessServer, monkeypatch) -> None:
    monkeypatch.setattr(caller.fake.input_processor, "check_constraint", lambda spec: None, raising=False)
    response = sdk(caller).responses.create(model=MODEL, input=TOOL_ROUND_TRIP, tools=[WEATHER], max_output_tokens=3,
                                            tool_choice={"type": "function", "name": "get_weather"})
    assert response.tool_choice.name == "get_weather"
    with pytest.raises(openai.BadRequestError, match="not among the tools"):
        sdk(caller).responses.create(model=MODEL, input="x", tools=[WEATHER],
                                     tool_choice={"type": "function", "name": "get_time"})


def test_thinking_is_a_reasoning_item_before_the_message(thinker: InProcessServer) -> None:
    client = sdk(thinker)
    response = client.responses.create(model=MODEL, input="What is the capital of France?")
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_")
    assert reasoning.content[0].text == THOUGHT and response.output_text == "Paris."
    thinking = f"<think>{THOUGHT}</think>"
    assert response.usage.output_tokens_details.reasoning_tokens == len(thinking.encode())  # a byte a token
    events = list(client.responses.create(model=MODEL, input="What is the capital of France?", stream=True))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == THOUGHT
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Paris."
    assert [e.output_index for e in events if e.type == "response.output_item.added"] == [0, 1]
    final = events[-1].response
    assert [i.type for i in final.output] == ["reasoning", "message"] and final.output_text == "Paris."
    assert final.usage.output_tokens_details.reasoning_tokens == len(thinking.encode())
    # a reasoning item sent back with no answer of its turn after it belongs to none: the same prompt as without it
    turn = [{"role": "user", "content": "Hi"}]
    with_it = client.responses.create(model=MODEL, input=[*turn, response.output[0].model_dump(exclude_none=True),
                                                          {"role": "user", "content": "And Spain?"}])
    without = client.responses.create(model=MODEL, input=[*turn, {"role": "user", "content": "And Spain?"}])
    assert with_it.usage.input_tokens == without.usage.input_tokens


def test_a_reasoning_item_sent_back_is_its_answers_reasoning() -> None:
    """As a chat message's ``reasoning`` (the template renders or drops it): the assistant message its turn makes
    next, a message or calls; its summary is not the thinking."""
    thought = {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "short"}],
               "content": [{"type": "reasoning_text", "text": THOUGHT}]}
    call = {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Oslo"}'}
    result = {"type": "function_call_output", "call_id": "c1", "output": "Sunny"}
    answer = {"role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]}
    for turn, expected in (([thought, answer, call], {"content": [{"type": "text", "text": "Checking."}]}),
                           ([thought, call], {"content": None})):
        request = ResponsesRequest.model_validate({"model": "", "input": [{"role": "user", "content": "Weather?"},
                                                                          *turn, result], "tools": [WEATHER]})
        user, assistant, tool = [m.model_dump(exclude_none=True) for m in request.chat_request.messages]
        assert assistant["reasoning"] == THOUGHT and assistant["tool_calls"][0]["id"] == "c1"
        assert assistant.get("content") == expected["content"] and tool["role"] == "tool"


def test_priority_and_cache_salt_are_taken_as_on_chat(talker: InProcessServer) -> None:
    before = set(talker.fake.priorities)
    answer = httpx.post(f"{talker.url}/v1/responses", json={"input": "hi", "priority": -2, "cache_salt": "tenant-1"})
    assert answer.status_code == 200, answer.text
    assert [talker.fake.priorities[rid] for rid in talker.fake.priorities if rid not in before] == [-2]


@pytest.mark.parametrize("extra, param", [
    ({"store": True}, "store"),
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"background": True}, "background"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"truncation": "auto"}, "truncation"),
    ({"reasoning": {"effort": "low"}}, "reasoning.effort"),
    ({"text": {"verbosity": "low"}}, "text.verbosity"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"max_tool_calls": 2}, "max_tool_calls"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"stream_options": {"include_obfuscation": False}}, "stream_options"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"tools": [{**WEATHER, "defer_loading": True}]}, "tools.0.defer_loading"),
    ({"tools": [{**WEATHER, "parameters": {"type": "object", "properties": {"a": {"type": "nope"}}}}]},
     "tools.0.parameters"),  # chat's check, in the Responses shape's words
    ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),  # with no tools
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]},
     "input.0.content"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input.0.role"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"temperature": -1}, "temperature"),
])
def test_what_kvserve_does_not_implement_is_a_400_naming_it(talker: InProcessServer, extra: dict,
                                                             param: str) -> None:
    answer = httpx.post(f"{talker.url}/v1/responses", json={"model": MODEL, "input": "hi", **extra})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["code"] == 400
    assert param.split(".")[0] in error["message"]
    talker.wait_idle()
    assert not talker.fake.requests


def test_a_client_gone_mid_stream_aborts_its_request(talker: InProcessServer) -> None:
    aborted_before = talker.metric("kvserve:request_success_total", finished_reason="abort")
    talker.fake.script = b"x" * 200  # long enough to be left mid-way, at 50 ms a step however slow the client
    talker.fake.step_seconds = 0.05

    async def leave_mid_stream() -> None:
        async with httpx.AsyncClient(timeout=30) as client:
            body = {"input": "hi", "stream": True}
            async with client.stream("POST", f"{talker.url}/v1/responses", json=body) as response:
                async for line in response.aiter_lines():
                    if line == "event: response.output_text.delta":
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


def test_a_response_is_token_for_token_the_chat_answer(client: openai.OpenAI) -> None:
    """The same conversation, a tool round trip included, through both endpoints: the same prompt tokens and
    the same greedy tokens, whole and streamed."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"}]
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Weather in Oslo?"}]},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "Sunny"}]
    for conversation, chat_messages in ((items, messages), ("Weather in Oslo?", messages[1:2])):
        instructions = "Answer briefly." if conversation is items else None
        chat = client.chat.completions.create(model=MODEL_NAME, messages=chat_messages, temperature=0, max_tokens=12)
        response = client.responses.create(model=MODEL_NAME, input=conversation, instructions=instructions,
                                           temperature=0, max_output_tokens=12)
        assert response.output_text and response.output_text == chat.choices[0].message.content
        assert response.usage.input_tokens == chat.usage.prompt_tokens
        assert response.usage.output_tokens == chat.usage.completion_tokens
        events = client.responses.create(model=MODEL_NAME, input=conversation, instructions=instructions,
                                         temperature=0, max_output_tokens=12, stream=True)
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == response.output_text


class Point(BaseModel):
    x: int = Field(ge=0, le=9)
    y: int = Field(ge=0, le=9)


def test_a_json_schema_text_format_holds_the_output(client: openai.OpenAI) -> None:
    response = client.responses.parse(model=MODEL_NAME, input="A point?", text_format=Point, temperature=0,
                                      max_output_tokens=40)
    assert response.status == "completed"
    assert isinstance(response.output_parsed, Point)
    assert response.output_parsed == Point.model_validate_json(response.output_text)
    assert response.text.format.type == "json_schema"
    json_object = client.responses.create(model=MODEL_NAME, input="A JSON object?", temperature=0,
                                          max_output_tokens=60, text={"format": {"type": "json_object"}})
    if json_object.status == "completed":
        assert isinstance(json.loads(json_object.output_text, strict=False), dict)
