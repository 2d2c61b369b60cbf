"""SamplingParams: vLLM-compatible fields, validated once at construction."""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar


class InvalidParameter(ValueError):
    """A value out of range or of the wrong type, and the name of the parameter that holds it (a server answers
    with that name as OpenAI's ``param``)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param

    def renamed(self, param: str) -> InvalidParameter:
        """The same error, told of the parameter under another name (the one a request sent it as)."""
        return InvalidParameter(param, str(self).replace(self.param, param, 1))


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One constraint on a request's output (vLLM's offline shape): a JSON schema (a dict or its text), any
    JSON object, a regex, a choice among strings, or an EBNF grammar. Exactly one must be given.

    ``begins_after_token_id`` (kvserve's): the constraint holds only the output after the first time this token
    is sampled, and none before it: a reasoning model's end of thinking (Qwen3's or DeepSeek R1's ``</think>``),
    so that its thinking is free and its answer constrained, as vLLM's structured output is under
    ``--reasoning-parser`` (kvserve's server sets it there)."""

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None
    begins_after_token_id: int | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise InvalidParameter("structured_outputs", "structured_outputs takes exactly one of json, "
                                   f"json_object, regex, choice, grammar; got {', '.join(given) or 'none'}")
        _check_kinds(self, _CONSTRAINT_KINDS)  # a request's JSON may hold anything
        if self.choice is not None and (not self.choice or any(not isinstance(c, str) or not c for c in self.choice)):
            raise InvalidParameter("choice", "choice must be a non-empty list of non-empty strings")

    @property
    def kind(self) -> str:
        """What the constraint is, for messages: "JSON schema", "regex"..."""
        if self.json is not None:
            return "JSON schema"
        return "JSON object grammar" if self.json_object else "regex" if self.regex is not None \
            else "choice" if self.choice is not None else "grammar"


def _is_integer(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_seed(value: object) -> bool:
    """A seed is a 64-bit signed integer, as vLLM's: a larger one would be folded into 64 bits and draw as another
    seed does."""
    return _is_integer(value) and -(2**63) <= value < 2**63


# Each step applies every row's biases anew: a bias on each of 49,152 tokens cost 0.17 s a row a step (5.4 s at 64
# rows), stalling every stream for one request; a few hundred favour or ban what a request needs
MAX_LOGIT_BIAS_ENTRIES = 300


def _token_biases(logit_bias: object) -> dict[int, float]:
    """``logit_bias`` as {token id: finite bias}; InvalidParameter naming what is not (a NaN bias would win
    every argmax) or more than ``MAX_LOGIT_BIAS_ENTRIES`` entries."""
    if not isinstance(logit_bias, Mapping):
        raise InvalidParameter("logit_bias", f"logit_bias must be a dict of token id to bias, got "
                                             f"{type(logit_bias).__name__}")
    if len(logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidParameter("logit_bias", f"logit_bias takes at most {MAX_LOGIT_BIAS_ENTRIES} tokens, got "
                                             f"{len(logit_bias)}")
    biases = {}
    for key, value in logit_bias.items():
        # a token id has at most 19 digits (int64): longer strings are no id (and past 4,300, int() refuses them)
        if not (_is_integer(key) or isinstance(key, str) and re.fullmatch(r"-?[0-9]{1,19}", key)):
            raise InvalidParameter("logit_bias", f"logit_bias: key {str(key)[:40]!r} is not a token id")
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise InvalidParameter("logit_bias", f"logit_bias: the bias of token {key} must be a finite number, "
                                                 f"got {value!r}")
        biases[int(key)] = float(value)
    return biases


@dataclass
class SamplingParams:
    """How to sample one request and when to stop it.

    A temperature below ``GREEDY_BELOW`` (0 included) is greedy: an exact argmax over the processed logits, as
    vLLM does (dividing fp32 logits by less would overflow them to inf). ``seed`` makes a request's
    samples reproducible whatever else shares its batch. ``logprobs=k`` returns the sampled token's log
    probability and the top-k alternatives per generated token; ``prompt_logprobs=k`` the same for prompt
    tokens (the first prompt token has none); -1 asks for the whole vocabulary. The engine bounds k
    (``max_logprobs``) and decides what the values are (``logprobs_mode``).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Mapping[Any, float] | None = None  # ids as ints or their text (JSON); int keys once built
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | tuple[str, ...] | None = None
    stop_token_ids: list[int] | tuple[int, ...] | None = None  # a list once constructed
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    allowed_token_ids: list[int] | tuple[int, ...] | None = None  # only these may be drawn (a list once built)
    # the outputs never end with one of these words: a word's last token is banned where the outputs end with the
    # tokens before it (vLLM's); the engine adds their tokens (the model's tokenizer's) to ``bad_words_token_ids``
    bad_words: str | list[str] | tuple[str, ...] | None = None
    bad_words_token_ids: tuple[tuple[int, ...], ...] | None = None
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens; -1: its last max_model_len
    stop_strings: tuple[str, ...] = field(init=False, repr=False)

    MAX_N = 64
    MAX_STOP_STRINGS = 16
    # Stop strings and token ids are checked against every token of every sample on the engine thread: bounded,
    # so that one request cannot slow every step (2 M stop ids took 10 ms a token; 100,000-character strings 0.1 s)
    MAX_STOP_STRING_CHARS = 1024
    MAX_STOP_TOKEN_IDS = 1024
    # each step compares every bad word's tokens with the end of its row's outputs
    MAX_BAD_WORDS = 1024
    GREEDY_BELOW = 1e-5
    # Penalized fp32 logits (|logit| <~ 1e2) divided or multiplied by these, then by a temperature of at least
    # GREEDY_BELOW, stay far from fp32's overflow; a penalty of 1e-300 would be 0 in fp32 (inf logits, NaN draws).
    REPETITION_PENALTY_RANGE = (1e-6, 1e6)

    def __post_init__(self) -> None:
        _check_kinds(self, _FIELD_KINDS)  # before any range is checked or any step sees a value
        if self.top_k == -1:
            self.top_k = 0
        self._check_ranges()
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > self.MAX_STOP_STRINGS:
            raise InvalidParameter("stop", f"stop takes at most {self.MAX_STOP_STRINGS} stop strings, got {len(stops)}")
        if any(not isinstance(s, str) or not s for s in stops):
            raise InvalidParameter("stop", "stop must hold non-empty strings only")
        if any(len(s) > self.MAX_STOP_STRING_CHARS for s in stops):
            raise InvalidParameter("stop", f"a stop string has at most {self.MAX_STOP_STRING_CHARS} characters")
        self.stop_strings = tuple(stops)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if any(not _is_integer(t) or t < 0 for t in self.stop_token_ids):
            raise InvalidParameter("stop_token_ids", "stop_token_ids must hold non-negative integers only")
        self.stop_token_ids = list(dict.fromkeys(int(t) for t in self.stop_token_ids))  # each once, in order
        if len(self.stop_token_ids) > self.MAX_STOP_TOKEN_IDS:
            raise InvalidParameter("stop_token_ids", f"stop_token_ids takes at most {self.MAX_STOP_TOKEN_IDS} "
                                                     f"distinct ids, got {len(self.stop_token_ids)}")
        if self.logit_bias is not None:
            self.logit_bias = _token_biases(self.logit_bias)
        self._check_token_restrictions()

    def _check_token_restrictions(self) -> None:
        """``allowed_token_ids``, ``bad_words`` and their token ids: non-empty, ids non-negative, each kept once."""
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids or any(not _is_integer(t) or t < 0 for t in self.allowed_token_ids):
                raise InvalidParameter("allowed_token_ids", "allowed_token_ids must be a non-empty list of token ids")
            self.allowed_token_ids = list(dict.fromkeys(int(t) for t in self.allowed_token_ids))
        words = [self.bad_words] if isinstance(self.bad_words, str) else self.bad_words
        if words is not None:
            if len(words) > self.MAX_BAD_WORDS:
                raise InvalidParameter("bad_words", f"bad_words takes at most {self.MAX_BAD_WORDS} words, got "
                                                    f"{len(words)}")
            if any(not isinstance(w, str) or not w.strip() or len(w) > self.MAX_STOP_STRING_CHARS for w in words):
                raise InvalidParameter("bad_words", "bad_words must hold words of 1 to "
                                                    f"{self.MAX_STOP_STRING_CHARS} characters, not only spaces")
            self.bad_words = list(words)
        if self.bad_words_token_ids is not None:
            sequences = self.bad_words_token_ids
            if (not isinstance(sequences, (list, tuple)) or len(sequences) > 2 * self.MAX_BAD_WORDS
                    or any(not isinstance(s, (list, tuple)) or not s or not all(_is_integer(t) and t >= 0 for t in s)
                           for s in sequences)):
                raise InvalidParameter("bad_words_token_ids", "bad_words_token_ids must be a list of non-empty "
                                                              "lists of token ids")
            self.bad_words_token_ids = tuple(dict.fromkeys(tuple(int(t) for t in s) for s in sequences))

    def _check_ranges(self) -> None:
        low, high = self.REPETITION_PENALTY_RANGE
        checks = [
            ("n", 1 <= self.n <= self.MAX_N, f"must be in [1, {self.MAX_N}], got {self.n}"),
            ("temperature", 0 <= self.temperature < math.inf, f"must be a finite number >= 0, got {self.temperature}"),
            ("top_p", 0 < self.top_p <= 1, f"must be in (0, 1], got {self.top_p}"),
            ("top_k", self.top_k >= 0, f"must be -1, 0 (disabled) or positive, got {self.top_k}"),
            ("min_p", 0 <= self.min_p <= 1, f"must be in [0, 1], got {self.min_p}"),
            ("repetition_penalty", low <= self.repetition_penalty <= high,
             f"must be in [{low:g}, {high:g}], got {self.repetition_penalty}"),
            ("presence_penalty", -2 <= self.presence_penalty <= 2, f"must be in [-2, 2], got {self.presence_penalty}"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2,
             f"must be in [-2, 2], got {self.frequency_penalty}"),
            ("max_tokens", self.max_tokens is None or self.max_tokens >= 1, f"must be >= 1, got {self.max_tokens}"),
            ("seed", self.seed is None or is_seed(self.seed), f"must be a 64-bit signed integer, got {self.seed}"),
            ("min_tokens", self.min_tokens >= 0, f"must be >= 0, got {self.min_tokens}"),
            ("min_tokens", self.max_tokens is None or self.min_tokens <= self.max_tokens,
             f"({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"),
            # their bound is the engine's (its max_logprobs, checked as a request is added)
            ("logprobs", self.logprobs is None or self.logprobs >= -1,
             f"must be -1 (the whole vocabulary) or >= 0, got {self.logprobs}"),
            ("prompt_logprobs", self.prompt_logprobs is None or self.prompt_logprobs >= -1,
             f"must be -1 (the whole vocabulary) or >= 0, got {self.prompt_logprobs}"),
            ("truncate_prompt_tokens", self.truncate_prompt_tokens in (None, -1) or self.truncate_prompt_tokens >= 1,
             f"must be -1 (the last max_model_len tokens) or >= 1, got {self.truncate_prompt_tokens}"),
        ]
        for param, ok, problem in checks:
            if not ok:
                raise InvalidParameter(param, f"{param} {problem}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < self.GREEDY_BELOW



@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's beam search parameters (``LLM.beam_search``; the server's ``use_beam_search``): ``beam_width`` beams
    of up to ``max_tokens`` tokens each (required: a beam search has no natural end), ranked by cumulative logprob
    over length ** ``length_penalty`` (the prompt counted, an ending EOS not, as vLLM counts them). ``temperature``
    only chooses the one token each step draws beside the ``2 * beam_width`` most likely (the candidates, whose
    logprobs are the model's own), as in vLLM; 0 draws the most likely, adding nothing. ``ignore_eos``: an EOS goes
    on as any token; ``include_stop_str_in_output``: the EOS that ended a sequence is in its text."""

    beam_width: int
    max_tokens: int | None = None
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    # each step asks for the 2 * beam_width most likely tokens of every beam: within the engine's default
    # max_logprobs (20), as vLLM's beam search asks its engine for them
    MAX_BEAM_WIDTH: ClassVar[int] = 10

    def __post_init__(self) -> None:
        _check_kinds(self, _BEAM_SEARCH_KINDS)
        if self.max_tokens is None:
            raise InvalidParameter("max_tokens", "max_tokens is required for beam search")
        checks = [
            ("beam_width", 1 <= self.beam_width <= self.MAX_BEAM_WIDTH,
             f"must be in [1, {self.MAX_BEAM_WIDTH}], got {self.beam_width}"),
            ("max_tokens", self.max_tokens >= 1, f"must be >= 1, got {self.max_tokens}"),
            ("temperature", 0 <= self.temperature < math.inf, f"must be a finite number >= 0, got {self.temperature}"),
            ("length_penalty", math.isfinite(self.length_penalty), f"must be finite, got {self.length_penalty}"),
        ]
        for param, ok, problem in checks:
            if not ok:
                raise InvalidParameter(param, f"{param} {problem}")


# Each field's kind, and whether it may be None, in SamplingParams and then in StructuredOutputsParams: checked
# once, at construction (``_check_kinds``)
_FIELD_KINDS: dict[str, tuple[str, bool]] = {
    "n": ("integer", False), "top_k": ("integer", False), "min_tokens": ("integer", False),
    "max_tokens": ("integer", True), "seed": ("integer", True), "logprobs": ("integer", True),
    "prompt_logprobs": ("integer", True), "truncate_prompt_tokens": ("integer", True),
    "temperature": ("number", False), "top_p": ("number", False), "min_p": ("number", False),
    "repetition_penalty": ("number", False), "presence_penalty": ("number", False),
    "frequency_penalty": ("number", False),
    "ignore_eos": ("bool", False), "include_stop_str_in_output": ("bool", False),
    "skip_special_tokens": ("bool", False),
    "stop": ("strings", True), "stop_token_ids": ("ids", True), "structured_outputs": ("constraint", True),
    "allowed_token_ids": ("ids", True), "bad_words": ("strings", True),
}
_BEAM_SEARCH_KINDS: dict[str, tuple[str, bool]] = {
    "beam_width": ("integer", False), "max_tokens": ("integer", True), "ignore_eos": ("bool", False),
    "temperature": ("number", False), "length_penalty": ("number", False),
    "include_stop_str_in_output": ("bool", False),
}
_CONSTRAINT_KINDS: dict[str, tuple[str, bool]] = {
    "json": ("schema", True), "json_object": ("bool", False), "regex": ("text", True), "choice": ("choices", True),
    "grammar": ("text", True), "begins_after_token_id": ("integer", True),
}
# kind -> (accepts a value, what it must be, how it is kept)
_KINDS: dict[str, tuple[Callable[[Any], bool], str, Callable[[Any], Any]]] = {
    "integer": (_is_integer, "an integer", int),
    "number": (lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool), "a number", float),
    "bool": (lambda v: isinstance(v, bool), "true or false", bool),
    "text": (lambda v: isinstance(v, str), "a string", str),
    "strings": (lambda v: isinstance(v, (str, list, tuple)), "a string or a list of strings", lambda v: v),
    "choices": (lambda v: isinstance(v, (list, tuple)), "a list of strings", tuple),
    "ids": (lambda v: isinstance(v, (list, tuple)), "a list of token ids", lambda v: v),
    "schema": (lambda v: isinstance(v, (dict, str)), "a JSON schema (an object, or its text)", lambda v: v),
    "constraint": (lambda v: isinstance(v, StructuredOutputsParams), "a StructuredOutputsParams", lambda v: v),
}


def _check_kinds(obj: object, kinds: Mapping[str, tuple[str, bool]]) -> None:
    """InvalidParameter naming a field of ``obj`` whose value is not of its kind (None passes where the field is
    optional); a number of another numeric type (numpy's) becomes Python's own, and a bool is no number."""
    for name, (kind, optional) in kinds.items():
        value = getattr(obj, name)
        if value is None and optional:
            continue
        accepts, described, convert = _KINDS[kind]
        if not accepts(value):
            raise InvalidParameter(name, f"{name} must be {described}, got {type(value).__name__}")
        object.__setattr__(obj, name, convert(value))  # frozen dataclasses too
