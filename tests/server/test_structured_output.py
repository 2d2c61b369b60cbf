"""Structured output over HTTP with the official SDK: response_format (json_schema through ``parse``,
json_object), vLLM's guided_* extras, 400 for a constraint that does not compile, and 400 naming each OpenAI
field kvserve does not implement (tools: test_tool_calls.py)."""

from __future__ import annotations

import json
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, Field

from tests.server.conftest import MODEL_NAME

MESSAGES = [{"role": "user", "content": "Describe a pet."}]


class Pet(BaseModel):
    kind: Literal["cat", "dog", "fish"]
    age: int = Field(ge=0, le=30)
    vaccinated: bool


def test_parse_with_a_pydantic_model_returns_a_valid_instance(client: openai.OpenAI) -> None:
    reply = client.chat.completions.parse(model=MODEL_NAME, messages=MESSAGES, response_format=Pet, max_tokens=64,
                                          temperature=0)
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(message.parsed, Pet) and message.parsed == Pet.model_validate_json(message.content)


def test_json_object_and_guided_choice(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=120, temperature=0,
                                           response_format={"type": "json_object"})
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(reply.choices[0].message.content, strict=False), dict)
    choice = client.completions.create(model=MODEL_NAME, prompt="yes or no?", max_tokens=8, temperature=0,
                                       extra_body={"guided_choice": ["yes", "no"]})
    assert choice.choices[0].text in ("yes", "no")


def test_streamed_structured_output_equals_the_unstreamed_one(client: openai.OpenAI) -> None:
    body = {"guided_regex": "[a-z]{4}-[0-9]{3}"}
    whole = client.completions.create(model=MODEL_NAME, prompt="code:", max_tokens=16, temperature=0,
                                      extra_body=body).choices[0].text
    chunks = client.completions.create(model=MODEL_NAME, prompt="code:", max_tokens=16, temperature=0,
                                       extra_body=body, stream=True)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole


@pytest.mark.parametrize("extra, fragment", [
    ({"guided_regex": "(unclosed"}, "regex does not compile"),
    ({"guided_json": {"type": "object", "properties": {"a": {"type": "nope"}}}}, "JSON schema does not compile"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "one constraint"),
    ({"response_format": {"type": "json_schema"}}, "json_schema.schema"),
    ({"function_call": "auto"}, "function_call is not supported"),
    ({"audio": {"voice": "alloy"}}, "audio is not supported"),
    ({"modalities": ["text", "audio"]}, "modalities is not supported"),
    ({"prediction": {"type": "content", "content": "x"}}, "prediction is not supported"),
])
def test_a_bad_or_unsupported_request_is_a_400_naming_it(client: openai.OpenAI, extra: dict, fragment: str) -> None:
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=4, extra_body=extra)
    assert fragment in str(error.value)
