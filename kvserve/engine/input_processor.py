"""InputProcessor: prompts and chats -> token ids, and every request checked against the model's limits."""

from __future__ import annotations

import dataclasses
import functools
import numbers
from typing import Any, Mapping, Sequence, Union

from transformers import PreTrainedTokenizerBase

from kvserve.sample.grammar import StructuredOutputCompiler
from kvserve.sampling_params import InvalidParameter, SamplingParams, StructuredOutputsParams

# A prompt is text, or {"prompt_token_ids": [...]} (optionally with the "prompt" text it came from).
PromptInput = Union[str, Mapping[str, Any]]
ChatMessages = Sequence[Mapping[str, Any]]


@dataclasses.dataclass(frozen=True)
class ProcessedPrompt:
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams  # a per-request copy, with max_tokens filled in


class InputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, max_model_len: int,
                 structured: StructuredOutputCompiler | None = None) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.structured = structured

    def process(self, prompt: PromptInput, params: SamplingParams) -> ProcessedPrompt:
        """Tokenize (or check) the prompt and fit ``params`` to it; raise ValueError naming what is wrong (a
        constraint that does not compile included: compiled here, the runner finds it in the compiler's cache)."""
        text, token_ids = self._tokenize(prompt)
        self._check_token_ids(token_ids, "prompt_token_ids")
        token_ids = [int(t) for t in token_ids]
        if params.structured_outputs is not None:
            self.check_constraint(params.structured_outputs)
        return ProcessedPrompt(text, token_ids, self._fit_params(params, len(token_ids)))

    def check_constraint(self, spec: StructuredOutputsParams) -> None:
        """ValueError naming the problem if ``spec`` does not compile (compiled now; later requests with the same
        constraint find it in the compiler's cache)."""
        if self.structured is None:
            raise ValueError("structured output is not available in this engine")
        self.structured.compile(spec)

    def apply_chat_template(self, messages: ChatMessages, add_generation_prompt: bool = True,
                            tools: Sequence[Mapping[str, Any]] | None = None) -> dict[str, Any]:
        """Render a conversation (and the tools it may call, as JSON schemas in OpenAI's shape) with the model's
        chat template into a token-id prompt."""
        if not messages:
            raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
        for i, message in enumerate(messages):
            if not isinstance(message, Mapping) or "role" not in message or "content" not in message:
                raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content'")
        if self.tokenizer.chat_template is None:
            raise ValueError("this model has no chat template: send it a plain prompt (/v1/completions, or "
                             "LLM.generate)")
        text = self.tokenizer.apply_chat_template(
            list(messages), tools=list(tools) if tools else None, tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )
        self._check_text_fits(text, "the rendered conversation")
        # The template already holds the special tokens it wants (BOS included): don't add them twice.
        token_ids = self.tokenizer.encode(text, add_special_tokens=False)
        return {"prompt": text, "prompt_token_ids": token_ids}

    def _tokenize(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty")
            self._check_text_fits(prompt, "prompt")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, Mapping) and "prompt_token_ids" in prompt:
            token_ids = prompt["prompt_token_ids"]
            if not isinstance(token_ids, (list, tuple)) or not token_ids:
                raise ValueError("prompt_token_ids must be a non-empty list of token ids")
            return prompt.get("prompt"), list(token_ids)
        raise ValueError(f"a prompt must be a string or a dict with 'prompt_token_ids', got {type(prompt).__name__}")

    def tokenize_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """``text``'s token ids (the server's /tokenize); ValueError for a text no context could hold."""
        self._check_text_fits(text, "prompt")
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def _check_text_fits(self, text: str, what: str) -> None:
        """Refuse, before tokenizing it, a text too long for any tokenization of it to fit: no token covers more
        characters than its own string in the vocabulary has (a byte-level token's characters stand one for a
        byte; a SentencePiece token's one for a character), so such a text has more than max_model_len tokens.
        Tokenizing megabytes that are refused anyway held every stream still for seconds."""
        if len(text) > self.max_model_len and len(text) > self.max_model_len * self._longest_token_chars:
            raise ValueError(f"{what} has {len(text)} characters: more tokens than max_model_len="
                             f"{self.max_model_len}, whatever its tokenization")

    @functools.cached_property
    def _longest_token_chars(self) -> int:
        return max(map(len, self.tokenizer.get_vocab()))

    def _check_token_ids(self, token_ids: Sequence[Any], what: str) -> None:
        for t in token_ids:  # numpy's integers too (``process`` keeps Python's)
            if isinstance(t, bool) or not isinstance(t, numbers.Integral) or not 0 <= t < self.vocab_size:
                raise InvalidParameter(what, f"{what}: {t!r} is not a token id of this model (vocabulary size "
                                             f"{self.vocab_size})")

    def _fit_params(self, params: SamplingParams, num_prompt_tokens: int) -> SamplingParams:
        room = self.max_model_len - num_prompt_tokens
        if room < 1:
            raise ValueError(
                f"the prompt has {num_prompt_tokens} tokens, which leaves no room to generate within "
                f"max_model_len={self.max_model_len}"
            )
        max_tokens = room if params.max_tokens is None else params.max_tokens
        if num_prompt_tokens + max_tokens > self.max_model_len:
            raise InvalidParameter(
                "max_tokens", f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = "
                f"{num_prompt_tokens + max_tokens} is over max_model_len={self.max_model_len}"
            )
        self._check_token_ids(params.stop_token_ids or [], "stop_token_ids")
        self._check_token_ids(list(params.logit_bias or {}), "logit_bias")
        return dataclasses.replace(params, max_tokens=max_tokens)
