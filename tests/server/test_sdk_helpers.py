"""The official SDKs' high-level helpers against kvserve's answers, over scripted model-free servers (text, a Hermes
tool call, a Qwen3 thinking, a JSON document): what the accumulating and parsing helpers check (event order,
indices, item ids, types) and what applications do with their results (send them back as the next turn).

Each answer is also validated against the SDK's own models in pydantic's strict mode: the SDKs build their objects
leniently, so a field of the wrong type or a required one missing would otherwise pass unseen."""

from __future__ import annotations

import json
import time
from typing import Any, Iterator

import anthropic
import httpx
import openai
import pytest
from anthropic.types import Message, RawMessageStreamEvent
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import BaseModel, TypeAdapter

from tests.engine.fake_engine import FakeEngine
from tests.server.test_app_fake_engine import MODEL, InProcessServer
from tests.server.test_reasoning import ANSWER as THOUGHT_ANSWER
from tests.server.test_responses import ANSWER, WEATHER, scripted_server

USER = [{"role": "user", "content": "hi"}]
RESPONSE_EVENT = TypeAdapter(ResponseStreamEvent)
MESSAGE_EVENT = TypeAdapter(RawMessageStreamEvent)


class Point(BaseModel):
    x: int
    y: int


class GetWeather(BaseModel):
    city: str


POINT = Point(x=1, y=2)
# the call the scripted caller makes, of the function pydantic_function_tool(GetWeather) declares
STRICT_CALL = '<tool_call>\n{"name": "GetWeather", "arguments": {"city": "Oslo"}}\n</tool_call>'


@pytest.fixture(scope="module")
def jsoner() -> Iterator[InProcessServer]:
    """A server whose every answer is POINT's JSON; the fake compiles no constraint, so none is checked."""
    for server in scripted_server(POINT.model_dump_json()):
        server.fake.input_processor.check_constraint = lambda spec: None
        yield server


@pytest.fixture(scope="module")
def strict_caller() -> Iterator[InProcessServer]:
    yield from scripted_server(f"Checking.\n{STRICT_CALL}")


def openai_sdk(srv: InProcessServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)


def anthropic_sdk(srv: InProcessServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0)


def sse_data(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", url, json={**body, "stream": True}) as answer:
        return [json.loads(line[6:]) for line in answer.iter_lines() if line.startswith("data: {")]


def without_ids(response: dict[str, Any]) -> dict[str, Any]:
    """A response with what differs between two runs of one request left out: its ids and creation time."""
    items = [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in response["output"]]
    return {**{k: v for k, v in response.items() if k not in ("id", "created_at")}, "output": items}


# ---- /v1/responses ---------------------------------------------------------------------------------------------


def check_response_events(events: list[dict[str, Any]]) -> None:
    """OpenAI's stream contract: numbered from 0 without a gap, each event of its declared type, every content event
    naming the item an ``output_item.added`` opened at its ``output_index``, each ``*.done`` holding what its
    deltas added up to, each item done as it was added."""
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    opened: dict[int, dict[str, Any]] = {}
    written: dict[tuple[int, str], str] = {}
    for event in events:
        RESPONSE_EVENT.validate_python(event, strict=True)
        kind = event["type"]
        if kind == "response.output_item.added":
            assert event["output_index"] == len(opened)
            opened[event["output_index"]] = event["item"]
        elif "item_id" in event:
            assert opened[event["output_index"]]["id"] == event["item_id"], event
        if kind.endswith(".delta"):
            key = (event["output_index"], kind.removesuffix(".delta"))
            written[key] = written.get(key, "") + event["delta"]
        elif kind.endswith((".output_text.done", ".reasoning_text.done", ".function_call_arguments.done")):
            done = event.get("text", event.get("arguments"))
            assert written.get((event["output_index"], kind.removesuffix(".done")), "") == done, event
        elif kind == "response.output_item.done":
            added = opened[event["output_index"]]
            assert (event["item"]["id"], event["item"]["type"]) == (added["id"], added["type"])


@pytest.mark.parametrize("scripted, body", [
    ("talker", {"input": "hi"}),
    ("talker", {"input": "hi", "max_output_tokens": 4}),
    ("caller", {"input": "Weather in Oslo?", "tools": [WEATHER]}),
    ("thinker", {"input": "What is the capital of France?"}),
], ids=["text", "incomplete", "function-call", "reasoning"])
def test_a_response_and_its_events_are_the_sdks_types_and_agree(scripted: str, body: dict,
                                                                request: pytest.FixtureRequest) -> None:
    srv: InProcessServer = request.getfixturevalue(scripted)
    body = {"model": MODEL, **body}
    whole = httpx.post(f"{srv.url}/v1/responses", json=body).json()
    Response.model_validate(whole, strict=True)  # the SDK's required fields (usage's cache_write_tokens) there
    events = sse_data(f"{srv.url}/v1/responses", body)
    check_response_events(events)
    assert events[-1]["type"] == f"response.{whole['status']}"
    assert without_ids(events[-1]["response"]) == without_ids(whole)
    if whole["status"] == "completed":  # the SDK's accumulation raises on a response.incomplete, as against OpenAI
        with openai_sdk(srv).responses.stream(**body) as stream:
            assert stream.get_final_response().output_text == Response.model_validate(whole).output_text


def test_a_response_stream_the_engine_fails_midway_ends_with_response_failed(caplog: pytest.LogCaptureFixture) -> None:
    """OpenAI's last event for a failure: ``response.failed``, numbered as the rest, its response's ``error`` saying
    why and its output what was written, cut (chat's error object and ``[DONE]`` had no type or number, so a client
    that reads each event's type skipped it)."""
    server = InProcessServer()
    try:
        body = {"model": MODEL, "input": "hi", "max_output_tokens": 40, "stream": True}
        with (caplog.at_level("WARNING"),
              httpx.stream("POST", f"{server.url}/v1/responses", json=body, timeout=30,
                           headers={"X-Request-Id": "trace-7"}) as answer):
            lines = answer.iter_lines()
            first = [json.loads(next(line for line in lines if line.startswith("data: {"))[6:]) for _ in range(5)]
            assert first[-1]["type"] == "response.output_text.delta"
            server.fake.step_error = RuntimeError("device lost")
            events = first + [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        check_response_events(events)
        failed = events[-1]
        assert failed["type"] == "response.failed" and failed["response"]["status"] == "failed"
        error = failed["response"]["error"]
        assert error["code"] == "server_error" and "the engine failed: device lost" in error["message"]
        (message,) = failed["response"]["output"]  # what was written, cut
        assert message["status"] == "incomplete" and message["content"][0]["text"] == "".join(
            event["delta"] for event in events if event["type"] == "response.output_text.delta")
        assert failed["response"]["usage"] is None
        assert "the stream of request trace-7 ended: the engine failed (device lost)" in caplog.text  # as chat's
    finally:
        server.stop()


class _FailsBeforeItsFirstText(FakeEngine):
    """Its first step answers each request with a token that is no text yet (a character's first byte); its second
    fails."""

    def step(self) -> list:
        self.num_steps += 1
        time.sleep(self.step_seconds)  # the first step's output read before the second fails
        if self.num_steps > 1:
            raise RuntimeError("device lost")
        outputs = []
        for request in self.requests.values():
            request.output_token_ids.append(0xC3)
            outputs.append(request.output(None))
            outputs[-1].outputs[0].text = ""
        return outputs


def test_a_response_that_fails_before_any_text_has_no_output() -> None:
    """OpenAI's ``output: []``: no empty message the model never wrote."""
    server = InProcessServer(fake=_FailsBeforeItsFirstText(max_num_seqs=2, max_model_len=256, step_seconds=0.2))
    try:
        events = sse_data(f"{server.url}/v1/responses", {"model": MODEL, "input": "hi"})
        check_response_events(events)
        assert [e["type"] for e in events] == ["response.created", "response.in_progress", "response.failed"]
        assert events[-1]["response"]["output"] == [] and "device lost" in events[-1]["response"]["error"]["message"]
    finally:
        server.stop()


def test_responses_parse_reads_its_text_format_and_strict_tools(jsoner: InProcessServer,
                                                               strict_caller: InProcessServer) -> None:
    client = openai_sdk(jsoner)
    assert client.responses.parse(model=MODEL, input="A point?", text_format=Point).output_parsed == POINT
    with client.responses.stream(model=MODEL, input="A point?", text_format=Point) as stream:
        assert stream.get_final_response().output_parsed == POINT
    tool = openai.pydantic_function_tool(GetWeather)
    response = openai_sdk(strict_caller).responses.parse(model=MODEL, input="Weather?", tools=[tool])
    (call,) = [item for item in response.output if item.type == "function_call"]
    assert call.parsed_arguments == GetWeather(city="Oslo")


# ---- /v1/chat/completions --------------------------------------------------------------------------------------


def test_chat_answers_and_chunks_are_the_sdks_types(strict_caller: InProcessServer, thinker: InProcessServer) -> None:
    for srv in (strict_caller, thinker):
        body = {"model": MODEL, "messages": USER, "tools": [openai.pydantic_function_tool(GetWeather)]}
        ChatCompletion.model_validate(httpx.post(f"{srv.url}/v1/chat/completions", json=body).json(), strict=True)
        chunks = sse_data(f"{srv.url}/v1/chat/completions", {**body, "stream_options": {"include_usage": True}})
        for chunk in chunks:
            ChatCompletionChunk.model_validate(chunk, strict=True)


def test_the_chat_stream_helper_parses_what_parse_does(jsoner: InProcessServer,
                                                      strict_caller: InProcessServer) -> None:
    client = openai_sdk(jsoner)
    assert client.chat.completions.parse(model=MODEL, messages=USER, response_format=Point).choices[0].message.parsed \
        == POINT
    with client.chat.completions.stream(model=MODEL, messages=USER, response_format=Point) as stream:
        assert stream.get_final_completion().choices[0].message.parsed == POINT
    tools = [openai.pydantic_function_tool(GetWeather)]
    client = openai_sdk(strict_caller)
    whole = client.chat.completions.parse(model=MODEL, messages=USER, tools=tools).choices[0]
    with client.chat.completions.stream(model=MODEL, messages=USER, tools=tools) as stream:
        done = [e for e in stream if e.type == "tool_calls.function.arguments.done"]
        streamed = stream.get_final_completion().choices[0]
    assert [e.parsed_arguments for e in done] == [GetWeather(city="Oslo")]
    for choice in (whole, streamed):
        assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking.\n"
        assert [c.function.parsed_arguments for c in choice.message.tool_calls] == [GetWeather(city="Oslo")]


def test_a_parsed_message_goes_back_as_the_next_turns_message(jsoner: InProcessServer,
                                                              strict_caller: InProcessServer) -> None:
    """The SDK's own loop: the message ``parse`` returned appended to the conversation, its ``parsed`` and a call's
    ``parsed_arguments`` with it, copies of its content and arguments that the prompt leaves out."""
    client = openai_sdk(jsoner)
    message = client.chat.completions.parse(model=MODEL, messages=USER, response_format=Point).choices[0].message
    again = client.chat.completions.create(model=MODEL, messages=[*USER, message, {"role": "user", "content": "?"}])
    plain = {"role": "assistant", "content": message.content}
    as_dict = client.chat.completions.create(model=MODEL, messages=[*USER, plain, {"role": "user", "content": "?"}])
    assert again.usage.prompt_tokens == as_dict.usage.prompt_tokens
    tools = [openai.pydantic_function_tool(GetWeather)]
    client = openai_sdk(strict_caller)
    message = client.chat.completions.parse(model=MODEL, messages=USER, tools=tools).choices[0].message
    result = {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "Sunny"}
    assert client.chat.completions.create(model=MODEL, messages=[*USER, message, result], tools=tools).choices


def test_a_thinking_answer_goes_back_with_its_reasoning(thinker: InProcessServer) -> None:
    """The message kvserve answered, ``reasoning`` included (vLLM's field), is taken back as an assistant turn."""
    client = openai_sdk(thinker)
    message = client.chat.completions.create(model=MODEL, messages=USER).choices[0].message
    assert message.content == THOUGHT_ANSWER and message.model_extra["reasoning"]
    again = client.chat.completions.create(model=MODEL, messages=[*USER, message, {"role": "user", "content": "?"}])
    assert again.choices[0].message.content == THOUGHT_ANSWER
    with pytest.raises(openai.BadRequestError, match="only assistant messages carry reasoning"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi", "reasoning": "x"}])


# ---- /v1/messages ----------------------------------------------------------------------------------------------


def check_message_events(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Anthropic's stream contract: message_start, then each block opened, written and closed at the next index,
    one at a time, then message_delta and message_stop; each event of its declared type. The blocks as written."""
    for event in events:
        MESSAGE_EVENT.validate_python(event, strict=True)
    kinds = [e["type"] for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    blocks: list[dict[str, Any]] = []
    is_open = False
    for event in events[1:-2]:
        if event["type"] == "content_block_start":
            assert not is_open and event["index"] == len(blocks)
            blocks.append(dict(event["content_block"], json=""))
            is_open = True
        else:
            assert is_open and event["index"] == len(blocks) - 1, event
            delta, block = event.get("delta", {}), blocks[-1]
            for field in ("text", "thinking"):
                if field in delta:
                    block[field] += delta[field]
            block["json"] += delta.get("partial_json", "")
            is_open = event["type"] != "content_block_stop"
    assert not is_open
    for block in blocks:
        if block["type"] == "tool_use":
            block["input"] = json.loads(block["json"] or "{}")
        del block["json"]
    return blocks


@pytest.mark.parametrize("scripted, body", [
    ("talker", {}),
    ("talker", {"max_tokens": 4}),
    ("talker", {"stop_sequences": ["there"]}),
    ("caller", {"tools": [{"name": "get_weather", "input_schema": WEATHER["parameters"]}]}),
    ("thinker", {}),
], ids=["text", "max-tokens", "stop-sequence", "tool-use", "thinking"])
def test_a_message_and_its_events_are_the_sdks_types_and_agree(scripted: str, body: dict,
                                                               request: pytest.FixtureRequest) -> None:
    srv: InProcessServer = request.getfixturevalue(scripted)
    body = {"model": MODEL, "max_tokens": 300, "messages": USER, **body}
    whole = httpx.post(f"{srv.url}/v1/messages", json=body).json()
    Message.model_validate(whole, strict=True)
    events = sse_data(f"{srv.url}/v1/messages", body)
    blocks = check_message_events(events)
    assert [{k: v for k, v in b.items() if k != "id"} for b in blocks] == \
        [{k: v for k, v in b.items() if k != "id"} for b in whole["content"]]
    assert events[-2]["delta"] == {"stop_reason": whole["stop_reason"], "stop_sequence": whole["stop_sequence"]}
    assert events[-2]["usage"]["output_tokens"] == whole["usage"]["output_tokens"]
    with anthropic_sdk(srv).messages.stream(**body) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    exclude = {"id": True, "content": {"__all__": {"id"}}}  # a call's id is the run's
    assert final.model_dump(exclude=exclude) == Message.model_validate(whole).model_dump(exclude=exclude)
    assert text == "".join(b["text"] for b in whole["content"] if b["type"] == "text")
    assert stream.current_message_snapshot.stop_reason == whole["stop_reason"]


def test_the_sdks_answer_goes_back_as_the_assistants_turn(caller: InProcessServer, thinker: InProcessServer) -> None:
    tools = [{"name": "get_weather", "input_schema": WEATHER["parameters"]}]
    client = anthropic_sdk(caller)
    with client.messages.stream(model=MODEL, max_tokens=300, messages=USER, tools=tools) as stream:
        message = stream.get_final_message()
    (call,) = [b for b in message.content if b.type == "tool_use"]
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "Sunny"}]}
    again = client.messages.create(model=MODEL, max_tokens=300, tools=tools,
                                   messages=[*USER, {"role": "assistant", "content": message.content}, result])
    assert again.stop_reason == "tool_use"
    client = anthropic_sdk(thinker)
    thought = client.messages.create(model=MODEL, max_tokens=300, messages=USER)
    assert [b.type for b in thought.content] == ["thinking", "text"]
    follow_up = [*USER, {"role": "assistant", "content": thought.content}, {"role": "user", "content": "?"}]
    assert client.messages.create(model=MODEL, max_tokens=300, messages=follow_up).content[-1].text == THOUGHT_ANSWER


# ---- langchain-openai ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("use_responses_api", [True, False], ids=["responses", "chat"])
def test_langchain_invokes_streams_and_structures(use_responses_api: bool, talker: InProcessServer,
                                                  strict_caller: InProcessServer, jsoner: InProcessServer) -> None:
    from langchain_openai import ChatOpenAI

    def model(srv: InProcessServer) -> ChatOpenAI:
        return ChatOpenAI(model=MODEL, base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, stream_usage=True,
                          use_responses_api=use_responses_api)

    def streamed(runnable: Any, prompt: str) -> Any:
        first, *rest = runnable.stream(prompt)
        return sum(rest, first)

    whole, chunks = model(talker).invoke("hi"), streamed(model(talker), "hi")
    assert whole.text == chunks.text == ANSWER
    assert whole.usage_metadata["output_tokens"] == chunks.usage_metadata["output_tokens"] == len(ANSWER)
    with_tools = model(strict_caller).bind_tools([GetWeather])
    for answer in (with_tools.invoke("Weather?"), streamed(with_tools, "Weather?")):
        assert [(c["name"], c["args"]) for c in answer.tool_calls] == [("GetWeather", {"city": "Oslo"})]
    structured = model(jsoner).with_structured_output(Point, method="json_schema")
    assert structured.invoke("A point?") == POINT and list(structured.stream("A point?"))[-1] == POINT
