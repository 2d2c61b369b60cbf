"""SamplingParams: vLLM-compatible fields, validated once at construction."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One constraint on a request's output (vLLM's offline shape): a JSON schema (a dict or its text), any
    JSON object, a regex, a choice among strings, or an EBNF grammar. Exactly one must be given."""

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(f"structured output takes exactly one of json, json_object, regex, choice, grammar; "
                             f"got {', '.join(given) or 'none'}")
        if self.choice is not None:
            if not self.choice or any(not isinstance(c, str) or not c for c in self.choice):
                raise ValueError("structured output: choice must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", tuple(self.choice))

    @property
    def kind(self) -> str:
        """What the constraint is, for messages: "JSON schema", "regex"..."""
        if self.json is not None:
            return "JSON schema"
        return "JSON object grammar" if self.json_object else "regex" if self.regex is not None \
            else "choice" if self.choice is not None else "grammar"


@dataclass
class SamplingParams:
    """How to sample one request and when to stop it.

    ``temperature == 0`` is greedy: an exact argmax over the processed logits. ``seed`` makes a request's
    samples reproducible whatever else shares its batch. ``logprobs=k`` returns the sampled token's log
    probability and the top-k alternatives per generated token; ``prompt_logprobs=k`` the same for prompt
    tokens (the first prompt token has none).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    stop_strings: tuple[str, ...] = field(init=False, repr=False)

    MAX_N = 64
    MAX_LOGPROBS = 20
    MAX_STOP_STRINGS = 16

    def __post_init__(self) -> None:
        if self.top_k == -1:
            self.top_k = 0
        self._check_ranges()
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > self.MAX_STOP_STRINGS:
            raise ValueError(f"stop: at most {self.MAX_STOP_STRINGS} stop strings, got {len(stops)}")
        if any(not isinstance(s, str) or not s for s in stops):
            raise ValueError("stop: every stop string must be a non-empty string")
        self.stop_strings = tuple(stops)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids: every id must be a non-negative integer")
        if self.logit_bias is not None:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}

    def _check_ranges(self) -> None:
        checks = [
            (1 <= self.n <= self.MAX_N, f"n must be in [1, {self.MAX_N}], got {self.n}"),
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= 0, f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (self.repetition_penalty > 0, f"repetition_penalty must be > 0, got {self.repetition_penalty}"),
            (-2 <= self.presence_penalty <= 2, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2 <= self.frequency_penalty <= 2,
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (self.max_tokens is None or self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}"),
            (self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens}"),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens,
             f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"),
            (self.logprobs is None or 0 <= self.logprobs <= self.MAX_LOGPROBS,
             f"logprobs must be in [0, {self.MAX_LOGPROBS}], got {self.logprobs}"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= self.MAX_LOGPROBS,
             f"prompt_logprobs must be in [0, {self.MAX_LOGPROBS}], got {self.prompt_logprobs}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0
