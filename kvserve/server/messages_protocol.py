"""The bodies of POST /v1/messages (Anthropic's Messages API): the request, which renders as the chat request it
stands for (``MessagesRequest.chat_request``: its system prompt and turns as chat messages, its tools and tool
choice in chat's shapes), and the message object it is answered with.

What kvserve does not implement is refused by name: a field it does not know (``extra="forbid"``: ``thinking``,
``output_config``, ``container``, ``mcp_servers``, a tool's ``input_examples``, ...), a server tool
(``web_search_...``, ``bash_...``, ...) and a block that is neither text nor part of a tool round trip (``image``,
``document``, ``search_result``, ``redacted_thinking``, ...). ``cache_control`` is taken wherever Anthropic takes it
and asks for nothing more: kvserve's prefix cache keeps every prefix unasked.

Two things Claude Code sends are taken as vLLM takes them: ``system`` turns inside ``messages`` (newer releases send
them) join the top-level system prompt, as the one system message chat templates take, at the start; and its
``x-anthropic-billing-header: ...`` line, which carries a hash that changes with every request, is left out of the
system prompt, so that a conversation's next request finds its prefix in the cache past the first few tokens.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import (
    BaseModel,
    Discriminator,
    Field,
    PrivateAttr,
    StrictBool,
    StrictInt,
    Tag,
    field_validator,
    model_validator,
)

from kvserve.sampling_params import InvalidParameter
from kvserve.server.chat_protocol import ChatCompletionRequest, FunctionDefinition, StandInChatRequest
from kvserve.server.protocol import RequestBody, Text, json_kind, only_types


class CacheControl(RequestBody):
    """A cache breakpoint: a hint kvserve has no need of (its prefix cache keeps every prefix), taken in
    Anthropic's one form."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(RequestBody):
    type: Literal["text"]
    text: Text
    cache_control: CacheControl | None = None


class ToolUseBlock(RequestBody):
    """A call the assistant made in an earlier turn."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None


ERROR_PREFIX = "Error: "  # a failed call's result, as the model reads it (a chat template has no flag for it)


class ToolResultBlock(RequestBody):
    """What a call returned: text, or text blocks; ``is_error`` where the call failed."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: Annotated[Union[Annotated[Text, Tag("str")], Annotated[list[TextBlock], Tag("list")]],
                       Discriminator(json_kind)] = ""
    is_error: StrictBool = False
    cache_control: CacheControl | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_blocks_only(cls, content: Any) -> Any:
        return only_types(content, ("text",), "block")

    def chat_message(self) -> dict[str, Any]:
        """The tool message it stands for: its text blocks joined by newlines; a failure's text after
        ``ERROR_PREFIX``, so that the model is told the call failed."""
        text = self.content if isinstance(self.content, str) else "\n".join(block.text for block in self.content)
        return {"role": "tool", "tool_call_id": self.tool_use_id, "content": ERROR_PREFIX + text if self.is_error
                else text}


class ThinkingBlock(RequestBody):
    """An earlier answer's thinking sent back (clients send the whole answer back): the turn's ``reasoning``, as a
    chat message's, which the chat template renders or drops (Qwen3's keeps it only in the turns after the last
    user message: a tool-call chain's, as Anthropic's own API uses the thinking sent back)."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


Block = Annotated[Union[TextBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock], Field(discriminator="type")]
# the blocks each role's turn may hold
ROLE_BLOCKS = {"user": ("text", "tool_result"), "assistant": ("text", "tool_use", "thinking"), "system": ("text",)}
# Claude Code's per-request billing line in the system prompt: ``x-anthropic-billing-header: cc_version=...; cch=...;``
_BILLING_LINE = re.compile(r"^x-anthropic-billing-header:[^\n]*(?:\n|$)", re.MULTILINE)


def _system_parts(system: str | list[TextBlock] | None) -> list[dict[str, str]]:
    """A system prompt's text parts, without Claude Code's billing line; empty parts (one that held only that line)
    are dropped."""
    texts = [system] if isinstance(system, str) else [block.text for block in system or []]
    return [{"type": "text", "text": text} for text in (_BILLING_LINE.sub("", text) for text in texts) if text]


class InputMessage(RequestBody):
    """A turn: the user's (text, the results of the assistant's calls), the assistant's (text, calls, thinking), or
    a system turn (text), which joins the system prompt (``MessagesRequest``)."""

    role: Literal["user", "assistant", "system"]
    content: Annotated[Union[Annotated[Text, Tag("str")], Annotated[list[Block], Field(min_length=1), Tag("list")]],
                       Discriminator(json_kind)]

    @model_validator(mode="before")
    @classmethod
    def _blocks_of_its_role(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("role") in ROLE_BLOCKS:
            only_types(data.get("content"), ROLE_BLOCKS[data["role"]], f"{data['role']} turn's block")
        return data

    def chat_messages(self) -> list[dict[str, Any]]:
        """The chat messages the turn stands for. The user's: a tool message for each call's result, then its text
        (Anthropic puts the results first). The assistant's: its text and its calls (their input as arguments)."""
        if isinstance(self.content, str):
            return [{"role": self.role, "content": self.content}]
        text = [{"type": "text", "text": block.text} for block in self.content if isinstance(block, TextBlock)]
        if self.role == "user":
            results = [block.chat_message() for block in self.content if isinstance(block, ToolResultBlock)]
            return results + ([{"role": "user", "content": text}] if text else [])
        calls = [{"id": block.id, "function": {"name": block.name, "arguments": json.dumps(block.input)}}
                 for block in self.content if isinstance(block, ToolUseBlock)]
        thinking = [block.thinking for block in self.content if isinstance(block, ThinkingBlock)]
        message: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else "")}
        return [message | ({"tool_calls": calls} if calls else {}) | ({"reasoning": "\n".join(thinking)}
                                                                       if thinking else {})]


class Tool(FunctionDefinition):
    """A tool in Anthropic's shape: chat's function definition, its parameters' schema named ``input_schema``."""

    parameters: dict[str, Any] = Field(alias="input_schema")
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None

    def chat_tool(self) -> dict[str, Any]:
        function = self.model_dump(include={"name", "description", "parameters", "strict"}, exclude_none=True)
        return {"type": "function", "function": function}


class ToolChoice(RequestBody):
    """``auto`` (the model decides), ``any`` (at least one call), ``tool`` (a call of the named tool), ``none``;
    ``disable_parallel_tool_use``: at most one call."""

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: StrictBool = False

    @model_validator(mode="after")
    def _name_with_tool(self) -> ToolChoice:
        if (self.type == "tool") != (self.name is not None):
            raise InvalidParameter("tool_choice.name", "tool_choice.name is given with type tool, and only then")
        return self

    def chat_tool_choice(self) -> str | dict[str, Any]:
        if self.type == "tool":
            return {"type": "function", "function": {"name": self.name}}
        return {"any": "required"}.get(self.type, self.type)


class Metadata(RequestBody):
    user_id: str | None = None  # informational, as chat's user


class MessagesRequest(RequestBody):
    model: str  # required, as Anthropic's; "" is the served model, as on kvserve's other routes
    messages: list[InputMessage] = Field(min_length=1)
    max_tokens: StrictInt  # required, as Anthropic's
    system: Annotated[Union[Annotated[Text, Tag("str")], Annotated[list[TextBlock], Tag("list")]],
                      Discriminator(json_kind)] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: StrictInt | None = None
    stop_sequences: list[Text] | None = None
    stream: StrictBool = False
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    metadata: Metadata | None = None
    # kvserve serves one tier, and caches every prefix: both taken as asking for nothing more
    service_tier: Literal["auto", "standard_only"] | None = None
    cache_control: CacheControl | None = None

    _chat: ChatCompletionRequest = PrivateAttr()

    @field_validator("system", mode="before")
    @classmethod
    def _text_blocks_only(cls, system: Any) -> Any:
        return only_types(system, ("text",), "block")

    @field_validator("tools", mode="before")
    @classmethod
    def _custom_tools_only(cls, tools: Any) -> Any:
        # Anthropic's server tools (web_search, code_execution, ...) run on its side; its client tools (bash,
        # text_editor, computer) have schemas of its own that kvserve does not know
        return only_types(tools, ("custom",), "tool", default="custom")

    @model_validator(mode="after")
    def _as_chat(self) -> MessagesRequest:
        """The chat request this stands for, made once here, so that what it refuses is this body's 400."""
        if all(turn.role == "system" for turn in self.messages):
            raise InvalidParameter("messages", "messages holds no user or assistant turn (system turns join the "
                                   "system prompt)")
        choice = self.tool_choice
        self._chat = MessagesChatRequest.made(
            model=self.model, messages=self._chat_messages(), max_tokens=self.max_tokens,
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, stop=self.stop_sequences,
            stream=self.stream, tools=None if self.tools is None else [tool.chat_tool() for tool in self.tools],
            tool_choice=None if choice is None else choice.chat_tool_choice(),
            parallel_tool_calls=choice is None or not choice.disable_parallel_tool_use,
            user=self.metadata.user_id if self.metadata else None)
        return self

    @property
    def chat_request(self) -> ChatCompletionRequest:
        return self._chat

    def _chat_messages(self) -> list[dict[str, Any]]:
        """The system prompt, then the system turns' text, as the one system message (text parts; a system prompt
        sent as a string, alone, stays one); then the other turns' messages."""
        system: str | list[dict[str, str]] = _system_parts(self.system) + [
            part for turn in self.messages if turn.role == "system" for part in _system_parts(turn.content)]
        if isinstance(self.system, str) and len(system) == 1:
            system = system[0]["text"]
        messages = [{"role": "system", "content": system}] if system else []
        return messages + [message for turn in self.messages if turn.role != "system"
                           for message in turn.chat_messages()]


class CountTokensRequest(MessagesRequest):
    """``POST /v1/messages/count_tokens``: a Messages request's conversation, tools and system prompt, whose
    prompt is counted and not run (Anthropic's takes no ``max_tokens``)."""

    max_tokens: StrictInt = 1


class TokenCount(BaseModel):
    input_tokens: int  # the prompt's tokens as the chat template renders the conversation


class MessagesChatRequest(StandInChatRequest):
    """The chat request a Messages request stands for."""

    SENT_NAMES: ClassVar[dict[str, str]] = {"stop": "stop_sequences", "prompt": "messages"}


class TextContent(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ToolUseContent(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class ThinkingContent(BaseModel):
    """The thinking ``--reasoning-parser`` split off. Unsigned: a signature is Anthropic's proof that its model
    wrote the thinking, which kvserve has none of (and it does not read thinking sent back)."""

    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""


ContentBlock = Union[TextContent, ToolUseContent, ThinkingContent]
StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class MessageUsage(BaseModel):
    """Anthropic's counts: the prompt's tokens are ``input_tokens`` (computed) + ``cache_read_input_tokens`` (found
    in the prefix cache); nothing is written to a cache at a charge (``cache_creation_input_tokens``)."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int


class MessageObject(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ContentBlock]
    stop_reason: StopReason | None
    stop_sequence: str | None
    usage: MessageUsage
