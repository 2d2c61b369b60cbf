"""InputProcessor's chat rendering against transformers' own: which template, what it is given, and a clear
ValueError (a 400 on the server) for a conversation that cannot be rendered."""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import pytest
from tokenizers.processors import TemplateProcessing
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from kvserve.engine.input_processor import InputProcessor
from kvserve.sampling_params import SamplingParams

# Gemma 3's way with content: a string as it is, a list of parts trimmed and joined
PARTS_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for item in m['content'] %}{{ item['text'] | trim }}{% endfor %}{% endif %}{% endfor %}"
)
STRING_TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
NAMED_TEMPLATES = {
    "default": "D{% for m in messages %}{{ m.content }}{% endfor %}",
    "tool_use": "T{{ tools | length }}{% for m in messages %}{{ m.content }}{% endfor %}",
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {}}}}
PARTS = [{"role": "user", "content": [{"type": "text", "text": " one "}, {"type": "text", "text": "two"}]}]


@pytest.fixture
def tokenizer(tiny_checkpoints: dict[str, Path]) -> PreTrainedTokenizerBase:
    return copy.deepcopy(AutoTokenizer.from_pretrained(tiny_checkpoints["llama"]))


def processor_with(tokenizer: PreTrainedTokenizerBase, template: str | dict[str, str]) -> InputProcessor:
    tokenizer.chat_template = template
    return InputProcessor(tokenizer, len(tokenizer), max_model_len=512)


def render(processor: InputProcessor, messages: list[dict], **kwargs) -> str:
    return processor.apply_chat_template(messages, add_generation_prompt=False, **kwargs)["prompt"]


def test_a_template_that_iterates_over_parts_gets_them_as_a_list(tokenizer) -> None:
    """As transformers and vLLM pass them (vLLM's "openai" content format): Gemma 3's template trims and joins
    them; joined with newlines first, it rendered "one \\ntwo"."""
    processor = processor_with(tokenizer, PARTS_TEMPLATE)
    assert render(processor, PARTS) == tokenizer.apply_chat_template(PARTS, tokenize=False) == "<user>onetwo"


def test_a_template_that_prints_content_gets_the_parts_joined_with_newlines(tokenizer) -> None:
    assert render(processor_with(tokenizer, STRING_TEMPLATE), PARTS) == "<user> one \ntwo"


@pytest.mark.parametrize("tools, expected", [([WEATHER], "T1hi"), (None, "Dhi")])
def test_named_templates_render_with_tool_use_where_tools_are_given(tokenizer, tools, expected) -> None:
    """Hermes and Command-R ship a ``default`` and a ``tool_use`` template; transformers picks as kvserve does.
    Before, a dict of templates counted as none taking tools, and tools were described in kvserve's own text."""
    processor = processor_with(tokenizer, NAMED_TEMPLATES)
    messages = [{"role": "user", "content": "hi"}]
    assert render(processor, messages, tools=tools) == expected
    assert tokenizer.apply_chat_template(messages, tools=tools, tokenize=False) == expected
    assert processor.chat_template(tools) == NAMED_TEMPLATES["tool_use" if tools else "default"]


def test_a_template_that_fails_on_a_conversation_is_a_value_error(tokenizer) -> None:
    processor = processor_with(tokenizer, "{% if messages | length > 1 %}{{ 1 / 0 }}{% endif %}ok")
    assert render(processor, [{"role": "user", "content": "a"}]) == "ok"
    with pytest.raises(ValueError, match="the chat template failed on this conversation: ZeroDivisionError"):
        render(processor, [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])
    with pytest.raises(ValueError, match="^roles must alternate$"):  # raise_exception: the template's own words
        render(processor_with(tokenizer, "{{ raise_exception('roles must alternate') }}"), PARTS)


def test_a_template_given_parses_as_transformers_renders_it(tokenizer) -> None:
    """With transformers' Jinja extensions: a plain environment refused ``{% break %}`` and ``{% generation %}``."""
    template = ("{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{% generation %}{{ m.content }}"
                "{% endgeneration %}{% endfor %}")
    processor = InputProcessor(tokenizer, len(tokenizer), max_model_len=512, chat_template=template)
    assert render(processor, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]) == "a"


def test_a_models_template_that_does_not_parse_or_renders_nothing_is_named_as_the_templates_fault(tokenizer,
                                                                                                  caplog) -> None:
    """Jinja's own words blamed the client's request; an empty rendering was refused as an empty
    prompt_token_ids, which the client never sent. A template that does not parse is said as the model loads."""
    with caplog.at_level(logging.WARNING, "kvserve.engine.input_processor"):
        broken = processor_with(tokenizer, "{% for x in %}")
    assert "the model's chat_template does not parse as Jinja" in caplog.text
    with pytest.raises(ValueError, match=r"the model's chat template does not parse as Jinja: .* \(line 1\); give "
                                         r"the engine one that does \(--chat-template, LLM\(chat_template=...\)\)"):
        render(broken, PARTS)
    with pytest.raises(ValueError, match="the chat template rendered this conversation as no text at all"):
        render(processor_with(tokenizer, "{% if false %}x{% endif %}"), PARTS)


@pytest.mark.parametrize("messages, tools", [
    ([{"role": "user", "content": "hi"}], [{**WEATHER, "function": {**WEATHER["function"], "description": "\ud800"}}]),
    ([{"role": "user", "content": "hi", "name": "b\ud800"}], None),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": "\\ud800"}'}}]}], None),
])
def test_a_lone_surrogate_anywhere_in_a_conversation_is_named(tokenizer, messages, tools) -> None:
    """JSON carries "\\ud800" into a tool's description, a name or a call's arguments; the tokenizer's TypeError
    was a 500."""
    template = ("{% for m in messages %}{{ m.name }}{{ m.content }}{{ (m.tool_calls or []) | tojson }}"
                "{% endfor %}{{ (tools or []) | tojson }}")
    with pytest.raises(ValueError, match=r"the conversation \(a message, a tool or a tool call\) is not valid "
                                         r"UTF-8: it holds a lone surrogate"):
        render(processor_with(tokenizer, template), messages, tools=tools)


@pytest.mark.parametrize("prompt", ["H\udcc3\udca9llo", {"prompt": "\ud800"}])
def test_a_lone_surrogate_in_a_text_prompt_is_named(tokenizer, prompt) -> None:
    """A command line's bytes its locale does not decode reach `generate` as surrogates (surrogateescape), and
    the tokenizer's TypeError named nothing ("TextEncodeInput must be Union[...]")."""
    processor = InputProcessor(tokenizer, len(tokenizer), max_model_len=512)
    with pytest.raises(ValueError, match="the prompt is not valid UTF-8: it holds a lone surrogate"):
        processor.process(prompt, SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="the text is not valid UTF-8"):
        processor.tokenize_text("\ud800")


def test_add_special_tokens_adds_the_tokenizers_own_to_the_rendered_text(tokenizer) -> None:
    bos = tokenizer.convert_tokens_to_ids("<|begin_of_text|>")
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bos)])
    processor = processor_with(tokenizer, STRING_TEMPLATE)
    messages = [{"role": "user", "content": "hi"}]
    plain = processor.apply_chat_template(messages)["prompt_token_ids"]
    assert processor.apply_chat_template(messages, add_special_tokens=True)["prompt_token_ids"] == [bos, *plain]
    assert bos not in plain


@pytest.mark.parametrize("template, expected", [
    (STRING_TEMPLATE, "<system>Answer in French.<user>hi"),
    (STRING_TEMPLATE.replace("{% for", "{# developer #}{% for"), "<developer>Answer in French.<user>hi"),
])
def test_a_developer_message_is_the_system_prompt_unless_the_template_names_the_role(
        tokenizer, template: str, expected: str) -> None:
    messages = [{"role": "developer", "content": "Answer in French."}, {"role": "user", "content": "hi"}]
    assert render(processor_with(tokenizer, template), messages) == expected


def test_a_template_given_to_the_engine_or_the_call_takes_the_tokenizers_place(tokenizer) -> None:
    """``--chat-template`` / ``LLM.chat(chat_template=...)``, as in vLLM: for a model without one (the packaged
    gemma-3-270m) or in place of its own."""
    tokenizer.chat_template = None
    processor = InputProcessor(tokenizer, len(tokenizer), max_model_len=512, chat_template=STRING_TEMPLATE)
    messages = [{"role": "user", "content": "hi"}]
    assert render(processor, messages) == "<user>hi"
    assert render(processor, messages, chat_template="[{{ messages[0].content }}]") == "[hi]"
    with pytest.raises(ValueError, match="has no chat template"):
        render(InputProcessor(tokenizer, len(tokenizer), max_model_len=512), messages)
    with pytest.raises(ValueError, match="does not parse as Jinja"):
        InputProcessor(tokenizer, len(tokenizer), max_model_len=512, chat_template="{% for m in messages %}")
    with pytest.raises(ValueError, match="does not parse as Jinja"):
        render(processor, messages, chat_template="{{ messages[0].content")


def test_a_conversation_no_context_could_hold_is_refused_before_it_renders(tokenizer, monkeypatch) -> None:
    """100,000 messages of 4 MB rendered for 1.75 s on the engine thread (every stream stalled), then refused."""
    processor = processor_with(tokenizer, "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    monkeypatch.setattr(processor.tokenizer, "apply_chat_template", lambda *a, **k: pytest.fail("rendered"))
    many = [{"role": "user", "content": "a" * 100}] * 2_000
    with pytest.raises(ValueError, match="the conversation's messages has 200000 characters: more tokens than"):
        processor.apply_chat_template(many)
    parts = [{"role": "user", "content": [{"type": "text", "text": "a" * 200_000}]}]
    with pytest.raises(ValueError, match="the conversation's messages has 200000 characters"):
        processor.apply_chat_template(parts)


def test_a_tokenizer_file_s_truncation_and_padding_are_off_before_any_encode(tokenizer) -> None:
    """An encode turned them off (kvserve asks for neither) by writing to the Rust tokenizer, which a decode on the
    engine thread, beside the inputs thread's encode, met as "Already borrowed": off once, up front, encodes read
    it only."""
    backend = tokenizer.backend_tokenizer
    backend.enable_truncation(max_length=4)
    backend.enable_padding(length=16)
    processor = InputProcessor(tokenizer, len(tokenizer), max_model_len=512)
    assert backend.truncation is None and backend.padding is None
    text = "a text of more than four tokens, not padded to sixteen"
    assert processor.tokenize_text(text) == tokenizer.encode(text) and len(tokenizer.encode(text)) > 4


# a ChatML-like template that closes each message and opens the assistant's turn on add_generation_prompt
TURN_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% if enable_thinking is false %}<think></think>{% endif %}"
    "{% endif %}"
)
PREFILLED = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "The colour is"}]


def test_continue_final_message_leaves_the_last_message_open(tokenizer) -> None:
    """vLLM's prefill: the reply goes on from the assistant's text; rendered as transformers renders it."""
    processor = processor_with(tokenizer, TURN_TEMPLATE)
    text = render(processor, PREFILLED, continue_final_message=True)
    assert text == "<|user|>Name a colour.<|end|>\n<|assistant|>The colour is"
    assert text == tokenizer.apply_chat_template(PREFILLED, tokenize=False, continue_final_message=True)
    assert render(processor, PREFILLED).endswith("The colour is<|end|>\n")


@pytest.mark.parametrize("template, add_generation_prompt, message", [
    (TURN_TEMPLATE, True, "set add_generation_prompt to false"),
    ("{% for m in messages %}{{ m.content | upper }}{% endfor %}", False, "no end of it to go on from"),
])
def test_a_final_message_that_cannot_be_continued_is_refused_naming_the_option(tokenizer, template,
                                                                               add_generation_prompt, message) -> None:
    """Where the template changes the last message's text, transformers' error quoted the whole rendered chat."""
    processor = processor_with(tokenizer, template)
    with pytest.raises(ValueError, match=message) as refused:
        processor.apply_chat_template(PREFILLED, add_generation_prompt, continue_final_message=True)
    assert refused.value.param == "continue_final_message"


def test_chat_template_kwargs_reach_the_template(tokenizer) -> None:
    """Qwen3's ``enable_thinking``: a variable the template reads; one it does not read changes nothing."""
    processor = processor_with(tokenizer, TURN_TEMPLATE)
    messages = PREFILLED[:1]
    plain = processor.apply_chat_template(messages)["prompt"]
    assert plain.endswith("<|assistant|>")
    off = processor.apply_chat_template(messages, template_kwargs={"enable_thinking": False})["prompt"]
    assert off == plain + "<think></think>"
    assert processor.apply_chat_template(messages, template_kwargs={"unread": 1})["prompt"] == plain


@pytest.mark.parametrize("kwargs, message", [
    ({"tokenize": True}, "may not set tokenize"),
    ({"chat_template": "{{ 7 }}", "messages": []}, "may not set chat_template, messages"),
    ({"continue_final_message": True}, "may not set continue_final_message"),
    ([("enable_thinking", False)], "must be a dict"),
    ({1: True}, "must be a dict of variable names"),
])
def test_chat_template_kwargs_may_not_set_the_renderings_own_options(tokenizer, kwargs, message) -> None:
    """vLLM drops such names silently; a client meaning to set one is told."""
    processor = processor_with(tokenizer, TURN_TEMPLATE)
    with pytest.raises(ValueError, match=message) as refused:
        processor.apply_chat_template(PREFILLED[:1], template_kwargs=kwargs)
    assert refused.value.param == "chat_template_kwargs"
