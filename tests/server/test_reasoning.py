"""``--reasoning-parser`` through the HTTP app: the thinking in ``reasoning``, the answer in ``content``, whole and
streamed, with tools, constraints and ``include_reasoning``; over a scripted model-free engine (its tokens are
bytes, so every tag is split over several tokens) and over a Qwen3 checkpoint whose tags are single tokens."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import openai
import pytest
from fastapi.testclient import TestClient

from kvserve.outputs import FinishReason
from tests.engine.fake_engine import FakeEngine
from tests.server.test_app_fake_engine import MODEL, InProcessServer

THOUGHT = "The user asks for France's capital. <tool_call>not a call</tool_call> It is Paris."
ANSWER = "Paris."
SCRIPT = f"<think>{THOUGHT}</think>{ANSWER}"
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
USER = [{"role": "user", "content": "What is the capital of France?"}]


class ScriptedEngine(FakeEngine):
    """Every request's output spells ``script``, a byte a step, then ends with ``stop`` (with ``length`` where its
    ``max_tokens`` cut it first)."""

    def __init__(self, script: str) -> None:
        super().__init__(max_num_seqs=2, max_model_len=512, step_seconds=0.001)
        self.script = script.encode()

    def step(self) -> list:
        self.num_steps += 1
        time.sleep(self.step_seconds)  # as FakeEngine's steps: a client has time to act mid-answer
        outputs = []
        for request in list(self.requests.values())[: self.max_num_seqs]:
            request.output_token_ids.append(self.script[len(request.output_token_ids)])
            num_tokens = len(request.output_token_ids)
            finish = (FinishReason.STOP if num_tokens == len(self.script)
                      else FinishReason.LENGTH if num_tokens == request.max_tokens else None)
            if finish is not None:
                del self.requests[request.request_id]
            outputs.append(request.output(finish))
        return outputs


@pytest.fixture(scope="module")
def scripted() -> Iterator[InProcessServer]:
    server = InProcessServer(fake=ScriptedEngine(SCRIPT), reasoning_parser="qwen3")
    yield server
    server.stop()


def chat(srv: InProcessServer, **body: Any) -> dict:
    answer = httpx.post(f"{srv.url}/v1/chat/completions", json={"model": MODEL, "messages": USER, **body})
    assert answer.status_code == 200, answer.text
    return answer.json()


def streamed_deltas(srv: InProcessServer, **body: Any) -> list[dict]:
    with httpx.stream("POST", f"{srv.url}/v1/chat/completions",
                      json={"model": MODEL, "messages": USER, "stream": True, **body}) as answer:
        events = [json.loads(line[6:]) for line in answer.iter_lines() if line.startswith("data: {")]
    return [e["choices"][0]["delta"] | {"finish_reason": e["choices"][0]["finish_reason"]} for e in events]


def joined(deltas: list[dict], key: str) -> str:
    return "".join(d.get(key) or "" for d in deltas)


def test_the_thinking_goes_to_reasoning_and_the_answer_to_content(scripted: InProcessServer) -> None:
    whole = chat(scripted)
    message = whole["choices"][0]["message"]
    assert message["reasoning"] == THOUGHT and message["content"] == ANSWER
    assert whole["usage"]["completion_tokens"] == len(SCRIPT.encode())  # the thinking's tokens count too


def test_streamed_deltas_carry_reasoning_then_content_and_never_a_tag(scripted: InProcessServer) -> None:
    deltas = streamed_deltas(scripted)
    assert joined(deltas, "reasoning") == THOUGHT and joined(deltas, "content") == ANSWER
    first_content = next(i for i, d in enumerate(deltas) if d.get("content") and i > 0)
    assert not any(d.get("reasoning") for d in deltas[first_content + 1:])  # a straddling delta carries both
    assert not any("think>" in (d.get("reasoning") or "") + (d.get("content") or "") for d in deltas)
    assert deltas[-1]["finish_reason"] == "stop"


def test_include_reasoning_false_drops_the_thinking(scripted: InProcessServer) -> None:
    message = chat(scripted, include_reasoning=False)["choices"][0]["message"]
    assert message["reasoning"] is None and message["content"] == ANSWER
    deltas = streamed_deltas(scripted, include_reasoning=False)
    assert "reasoning" not in json.dumps(deltas) and joined(deltas, "content") == ANSWER


def test_thinking_turned_off_by_the_template_leaves_it_all_content(scripted: InProcessServer) -> None:
    body = {"chat_template_kwargs": {"enable_thinking": False}}
    message = chat(scripted, **body)["choices"][0]["message"]
    assert message["content"] == SCRIPT and message["reasoning"] is None
    assert joined(streamed_deltas(scripted, **body), "content") == SCRIPT


def test_an_answer_cut_inside_its_thinking_is_all_reasoning(scripted: InProcessServer) -> None:
    message = chat(scripted, max_tokens=20)["choices"][0]["message"]
    assert message["reasoning"] == SCRIPT[len("<think>"):20] and message["content"] is None


def test_the_openai_sdk_reads_reasoning(scripted: InProcessServer) -> None:
    client = openai.OpenAI(base_url=f"{scripted.url}/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(model=MODEL, messages=USER)
    assert reply.choices[0].message.reasoning == THOUGHT  # kept as an extra field
    assert reply.choices[0].message.model_extra == {"reasoning": THOUGHT}
    chunks = list(client.chat.completions.create(model=MODEL, messages=USER, stream=True))
    assert "".join(getattr(c.choices[0].delta, "reasoning", None) or "" for c in chunks) == THOUGHT


@pytest.mark.parametrize("field, value", [
    ("response_format", {"type": "json_object"}),
    ("guided_regex", "Paris"),
    ("structured_outputs", {"choice": ["Paris"]}),
    ("tool_choice", "required"),
])
def test_a_constraint_where_the_end_tag_is_several_tokens_is_a_400_naming_it(scripted: InProcessServer, field: str,
                                                                             value: Any) -> None:
    """The scripted engine's tokens are bytes: no one token ends the thinking for the constraint to begin after."""
    # the fake compiles nothing: every constraint compiles here
    scripted.fake.input_processor.check_constraint = lambda spec: None
    body = {"model": MODEL, "messages": USER, field: value, **({"tools": TOOLS} if field == "tool_choice" else {})}
    answer = httpx.post(f"{scripted.url}/v1/chat/completions", json=body)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == field and "--reasoning-parser" in error["message"]
    scripted.wait_idle()


def test_tool_calls_are_read_from_the_answer_only() -> None:
    server = InProcessServer(fake=ScriptedEngine(f"<think>{THOUGHT}</think>{CALL}"), reasoning_parser="qwen3")
    try:
        whole = chat(server, tools=TOOLS)["choices"][0]
        assert whole["message"]["reasoning"] == THOUGHT and whole["finish_reason"] == "tool_calls"
        (call,) = whole["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {
            "city": "Paris"}
        deltas = streamed_deltas(server, tools=TOOLS)
        assert joined(deltas, "reasoning") == THOUGHT and not joined(deltas, "content")
        assert [c["function"].get("name") for d in deltas for c in d.get("tool_calls") or []][0] == "get_weather"
    finally:
        server.stop()


def test_without_a_parser_nothing_changes_and_completions_parse_nothing(scripted: InProcessServer) -> None:
    plain = InProcessServer(fake=ScriptedEngine(SCRIPT))
    try:
        raw = httpx.post(f"{plain.url}/v1/chat/completions", json={"model": MODEL, "messages": USER}).text
        assert "reasoning" not in raw and json.loads(raw)["choices"][0]["message"]["content"] == SCRIPT
        assert "reasoning" not in json.dumps(streamed_deltas(plain))
    finally:
        plain.stop()
    completion = httpx.post(f"{scripted.url}/v1/completions",
                            json={"model": MODEL, "prompt": "q", "max_tokens": 200}).json()
    assert completion["choices"][0]["text"] == SCRIPT  # vLLM parses the thinking of chat answers only
    refused = httpx.post(f"{scripted.url}/v1/completions", json={"model": MODEL, "prompt": "q",
                                                                  "include_reasoning": False})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "include_reasoning"


# ---- a Qwen3 checkpoint whose <think> and </think> are tokens of its own ---------------------------------------

QWEN3_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def thinking_qwen3(root: Path, special: bool) -> Path:
    """The tiny Qwen3 checkpoint with ``<think>`` and ``</think>`` added as tokens (``special``: ones a decode
    that skips special tokens drops) and Qwen3's ``enable_thinking`` in its chat template."""
    from tokenizers import AddedToken
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvserve.model.checkpoint import make_checkpoint

    path = make_checkpoint(root, "qwen3", "tiny", seed=0)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.add_tokens([AddedToken(tag, special=special, normalized=False) for tag in ("<think>", "</think>")],
                         special_tokens=special)
    tokenizer.chat_template = QWEN3_TEMPLATE
    tokenizer.save_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    model.resize_token_embeddings(len(tokenizer))
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=[False, True], ids=["tags-as-text", "tags-special"])
def qwen3_apps(request, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TestClient, TestClient, int]]:
    """Two apps over one engine, with and without ``--reasoning-parser qwen3``, and the id of ``</think>``."""
    from kvserve.engine.async_engine import AsyncEngine
    from kvserve.engine.llm_engine import LLMEngine
    from kvserve.engine_args import EngineArgs
    from kvserve.server.app import build_app
    from kvserve.server.state import ServerSettings, ServerState

    path = thinking_qwen3(tmp_path_factory.mktemp("qwen3-think"), special=request.param)
    engine = LLMEngine(EngineArgs(model=str(path), num_kv_blocks=64, max_model_len=256).create_engine_config())
    end_id = engine.tokenizer.convert_tokens_to_ids("</think>")
    async_engine = AsyncEngine(engine)
    async_engine.start()
    apps = []
    for parser in ("qwen3", None):
        state = ServerState(ServerSettings((MODEL,), str(path), reasoning_parser=parser), max_model_len=256)
        state.engine = async_engine
        apps.append(TestClient(build_app(state)))
    yield apps[0], apps[1], end_id
    async_engine.shutdown()


def test_a_single_token_end_tag_ends_the_thinking(qwen3_apps) -> None:
    parsed, _, end_id = qwen3_apps
    body = {"model": MODEL, "messages": USER, "temperature": 0, "max_tokens": 3, "logit_bias": {str(end_id): 100}}
    whole = parsed.post("/v1/chat/completions", json=body).json()
    # every token is </think>: the first ends an empty thinking, the answer keeps the rest verbatim
    assert whole["choices"][0]["message"]["reasoning"] is None
    assert whole["choices"][0]["message"]["content"] == "</think></think>"
    assert whole["usage"]["completion_tokens"] == 3
    with parsed.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as answer:
        events = [json.loads(line[6:]) for line in answer.iter_lines() if line.startswith("data: {")]
    deltas = [e["choices"][0]["delta"] for e in events]
    assert joined(deltas, "content") == "</think></think>" and not joined(deltas, "reasoning")


def test_with_thinking_off_the_answer_is_the_parserless_one(qwen3_apps) -> None:
    parsed, plain, _ = qwen3_apps
    body = {"model": MODEL, "messages": USER, "temperature": 0, "max_tokens": 8,
            "chat_template_kwargs": {"enable_thinking": False}}
    with_parser = parsed.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    without = plain.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert "reasoning" not in without and with_parser["reasoning"] is None
    assert with_parser["content"] == without["content"] and without["content"]
    # the prompt closed the thinking: a constraint holds the whole answer
    constrained = parsed.post("/v1/chat/completions", json={**body, "guided_choice": ["Paris", "Oslo"]}).json()
    assert constrained["choices"][0]["message"]["content"] in ("Paris", "Oslo")


def test_a_constraint_begins_where_the_thinking_ends(qwen3_apps) -> None:
    """vLLM's rule: the thinking is free (here it ends at once, its end token biased), the answer held to the
    constraint (which, from the start, would have refused that token and left the whole output thinking)."""
    parsed, _, end_id = qwen3_apps
    body = {"model": MODEL, "messages": USER, "temperature": 0, "max_tokens": 20,
            "logit_bias": {str(end_id): 100}, "guided_choice": ["Paris", "Oslo"]}
    whole = parsed.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert whole["message"]["reasoning"] is None and whole["message"]["content"] in ("Paris", "Oslo")
    assert whole["finish_reason"] == "stop"
    with parsed.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as answer:
        events = [json.loads(line[6:]) for line in answer.iter_lines() if line.startswith("data: {")]
    assert joined([e["choices"][0]["delta"] for e in events], "content") == whole["message"]["content"]
