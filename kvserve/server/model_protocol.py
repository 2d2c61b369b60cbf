"""The bodies of the routes about the served model: /v1/models (its card), /tokenize, /detokenize (its
tokenizer), and /v1/load_lora_adapter, /v1/unload_lora_adapter (its LoRA adapters, ``served_adapters``)."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, Field, StrictBool, StrictStr, model_validator

from kvserve.sampling_params import InvalidParameter
from kvserve.server.chat_protocol import ChatMessage
from kvserve.server.protocol import RequestBody, Text, TokenIds


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "kvserve"
    root: str
    parent: str | None = None  # a LoRA adapter's base model (its served name), as vLLM's card says
    max_model_len: int | None  # None while the model loads


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(RequestBody):
    """Either ``prompt`` (text) or ``messages`` (rendered with the chat template) is tokenized."""

    model: str | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    # the tokenizer's special tokens (BOS) added: by default to a prompt, not to messages, whose template holds
    # those it wants (vLLM's defaults)
    add_special_tokens: StrictBool | None = None
    add_generation_prompt: StrictBool | None = None  # messages only; default true
    continue_final_message: StrictBool = False  # messages only, as a chat request renders them
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise InvalidParameter("prompt", "give exactly one of prompt or messages")
        if self.messages is not None and not self.messages:
            raise ValueError("messages must not be empty")
        if self.prompt is not None:
            given = {"add_generation_prompt": self.add_generation_prompt is not None,
                     "continue_final_message": self.continue_final_message,
                     "chat_template_kwargs": self.chat_template_kwargs is not None}
            misplaced = next((name for name, is_given in given.items() if is_given), None)
            if misplaced is not None:
                raise InvalidParameter(misplaced, f"{misplaced} applies to messages, not to a prompt")
        return self

    @property
    def template_options(self) -> dict[str, Any]:
        """How the messages render: as a chat request with the same fields renders them."""
        return {"add_generation_prompt": self.add_generation_prompt is not False,
                "add_special_tokens": bool(self.add_special_tokens),
                "continue_final_message": self.continue_final_message, "template_kwargs": self.chat_template_kwargs}


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: TokenIds


class DetokenizeResponse(BaseModel):
    prompt: str



class LoadLoRAAdapterRequest(RequestBody):
    """vLLM's body: the adapter's name and directory. ``load_inplace`` (vLLM's reload of a served name in place) is
    not implemented: true is refused (unload the name first)."""

    lora_name: StrictStr = Field(min_length=1)
    lora_path: StrictStr = Field(min_length=1)
    load_inplace: StrictBool = False

    @model_validator(mode="after")
    def _not_in_place(self) -> LoadLoRAAdapterRequest:
        if self.load_inplace:
            raise InvalidParameter("load_inplace", "load_inplace is not implemented: unload the adapter, then load it")
        return self


class UnloadLoRAAdapterRequest(RequestBody):
    """vLLM's body: the adapter's name. vLLM's ``lora_int_id`` is refused: a server's ids are its own."""

    lora_name: StrictStr = Field(min_length=1)
    lora_int_id: int | None = None

    @model_validator(mode="after")
    def _by_name(self) -> UnloadLoRAAdapterRequest:
        if self.lora_int_id is not None:
            raise InvalidParameter("lora_int_id", "name the adapter by lora_name: the server's adapter ids are its own")
        return self
