"""Chat messages as templates take them: OpenAI's shape normalised (text parts, missing content, a call's
arguments as a dict), refused by position where it cannot be rendered; tools described where the template takes
none."""

from __future__ import annotations

import pytest

from kvserve.engine.chat_messages import for_template, template_message
from tests.server.test_tools import TOOLS_TEMPLATE, WEATHER


def test_a_message_is_normalised_as_templates_take_it() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    assert template_message({"role": "assistant", "content": None, "tool_calls": [call]})["tool_calls"][0] == \
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
    parts = {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    assert template_message(parts) == {"role": "user", "content": "a\nb"}
    assert template_message({"role": "assistant", "content": None})["content"] == ""


def test_an_assistants_reasoning_reaches_the_template_under_both_names() -> None:
    """vLLM's ``reasoning``, and ``reasoning_content``, the name the templates that render it (Qwen3's) read."""
    message = template_message({"role": "assistant", "content": "Paris.", "reasoning": "France's capital."})
    assert message["reasoning"] == message["reasoning_content"] == "France's capital."
    assert "reasoning_content" not in template_message({"role": "assistant", "content": "Paris."})


def test_the_developer_role_is_the_system_prompt_for_a_template_that_knows_no_developer() -> None:
    """OpenAI's newer name for the system prompt; a template that names the role gets it as sent."""
    developer = {"role": "developer", "content": "Answer in French."}
    assert template_message(developer, developer_is_system=True) == {"role": "system", "content": "Answer in French."}
    assert template_message(developer)["role"] == "developer"


@pytest.mark.parametrize("message, fragment", [
    ({"content": "hi"}, r"messages\[3\] must be a dict with a 'role'"),
    ({"role": "user", "content": [{"type": "image_url", "image_url": {}}]}, r"messages\[3\].content must be text"),
    ({"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]},
     "tool call arguments are not JSON"),
    ({"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": "[1, 2]"}}]},
     r"messages\[3\]: tool call arguments must be a JSON object, got list"),
    ({"role": "assistant", "content": "", "tool_calls": [{"id": "c"}]}, "each call needs a function with a name"),
    ({"role": "assistant", "content": "x", "tool_calls": 1}, r"messages\[3\].tool_calls must be a list of calls"),
    ({"role": "assistant", "content": "x", "tool_calls": True}, r"messages\[3\].tool_calls must be a list"),
    ({"role": "assistant", "content": "x", "tool_calls": 0}, r"messages\[3\].tool_calls must be a list"),
    ({"role": "assistant", "content": "x", "tool_calls": {}}, r"messages\[3\].tool_calls must be a list"),
])
def test_a_message_that_cannot_be_rendered_is_refused_by_position(message: dict, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        template_message(message, 3)


def test_a_template_without_tools_gets_them_described_and_calls_as_text() -> None:
    conversation = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "content": "-3 C", "tool_call_id": "call_1"},
    ]
    rendered, tools = for_template(conversation, [WEATHER], chat_template="{{ messages }}")
    assert tools is None
    assert rendered[0]["role"] == "system" and '"get_weather"' in rendered[0]["content"]
    assert "<tool_call>" in rendered[0]["content"]
    assert rendered[2] == {"role": "assistant", "content":
                           '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'}
    assert rendered[3] == {"role": "user", "content": "<tool_response>\n-3 C\n</tool_response>"}
    unchanged, passed = for_template(conversation, [WEATHER], chat_template=TOOLS_TEMPLATE)
    assert unchanged == conversation and passed == [WEATHER]
