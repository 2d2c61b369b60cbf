"""InputProcessor: prompts and chats -> token ids, and every request checked against the model's limits."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import numbers
from typing import Any, Iterator, Mapping, Sequence, Union

import jinja2
from transformers import PreTrainedTokenizerBase

from kvserve.config import ModelConfig
from kvserve.engine.chat_messages import for_template, iterates_content, template_message
from kvserve.sample.grammar import StructuredOutputCompiler
from kvserve.pooling_params import PoolingParams
from kvserve.sampling_params import InvalidParameter, SamplingParams, StructuredOutputsParams
from kvserve.utf8 import check_utf8

# A prompt is text, {"prompt": text} (vLLM's TextPrompt), or {"prompt_token_ids": [...]} (its TokensPrompt,
# optionally with the "prompt" text it came from); either dict may carry a "cache_salt", as vLLM's do.
logger = logging.getLogger(__name__)
PromptInput = Union[str, Mapping[str, Any]]
PROMPT_KEYS = ("prompt", "prompt_token_ids", "cache_salt")
ChatMessages = Sequence[Mapping[str, Any]]


@dataclasses.dataclass(frozen=True)
class ProcessedPrompt:
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams  # a per-request copy, with max_tokens filled in
    grammar: object | None = None  # its constraint compiled (``Request.grammar``)
    cache_salt: str | None = None  # ``Request.cache_salt``
    pooling: PoolingParams | None = None  # a pooling request's, ``normalize`` filled in (``params`` then unused)


# A pooling request's sampling params: it draws nothing (the scheduler finishes it once its prompt has run), but the
# engine's request state has a place for them
POOLING_SAMPLING_PARAMS = SamplingParams(max_tokens=1, temperature=0.0)


class InputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, max_model_len: int,
                 structured: StructuredOutputCompiler | None = None, chat_template: str | None = None,
                 max_logprobs: int = ModelConfig.max_logprobs) -> None:
        """``chat_template``: a template in place of the tokenizer's (``--chat-template``); ValueError if it does
        not parse. ``max_logprobs``: the most alternatives a request's logprobs may ask for at a position (-1: the
        vocabulary's)."""
        self.tokenizer = tokenizer
        _no_truncation_or_padding(tokenizer)
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_logprobs = vocab_size if max_logprobs == -1 else max_logprobs
        self.structured = structured
        self._chat_template = _checked_template(chat_template) if chat_template is not None else None
        if chat_template is None:
            _warn_if_unparsable(getattr(tokenizer, "chat_template", None))

    def process(self, prompt: PromptInput, params: SamplingParams, cap_max_tokens: bool = False) -> ProcessedPrompt:
        """Tokenize (or check) the prompt and fit ``params`` to it; raise ValueError naming what is wrong (a
        constraint that does not compile included: compiled here, the runner finds it in the compiler's cache).
        A ``max_tokens`` past the room ``max_model_len`` leaves is refused, as vLLM's server answers a 400, or with
        ``cap_max_tokens`` lowered to that room, as vLLM's offline ``LLM`` does (the sample ends with "length")."""
        text, token_ids = self._prompt_tokens(prompt, params.truncate_prompt_tokens)
        salt = _cache_salt(prompt)
        grammar = None if params.structured_outputs is None else self.check_constraint(params.structured_outputs)
        fitted = self._fit_params(params, len(token_ids), cap_max_tokens)
        return ProcessedPrompt(text, token_ids, fitted, grammar, salt)

    def constraint_compiled(self, spec: StructuredOutputsParams) -> bool:
        """Whether ``spec`` is compiled already (in the compiler's cache); ValueError if it is no valid one."""
        return self.structured is not None and self.structured.is_cached(spec)

    def check_constraint(self, spec: StructuredOutputsParams) -> object:
        """``spec`` compiled (later requests with the same constraint find it in the compiler's cache); ValueError
        naming the problem if it does not compile."""
        if self.structured is None:
            raise ValueError("structured output is not available in this engine")
        return self.structured.compile(spec)

    def chat_template(self, tools: Sequence[Any] | None = None) -> str | None:
        """The template a conversation renders with: the engine's ``chat_template``, else the tokenizer's; of named
        templates (as Hermes and Command-R ship them) the one named ``tool_use`` where tools are given and it has
        one, else ``default``, as transformers chooses. None: the model has none."""
        template = self._chat_template or getattr(self.tokenizer, "chat_template", None)
        if isinstance(template, Mapping):
            return template.get("tool_use") if tools and "tool_use" in template else template.get("default")
        return template

    def apply_chat_template(self, messages: ChatMessages, add_generation_prompt: bool = True,
                            tools: Sequence[Mapping[str, Any]] | None = None,
                            add_special_tokens: bool = False, chat_template: str | None = None,
                            continue_final_message: bool = False,
                            template_kwargs: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Render a conversation in OpenAI's shape (and the tools it may call, as JSON schemas in OpenAI's shape)
        with the model's chat template into a token-id prompt: the messages normalised and the tools described
        where the template takes none (``chat_messages``). ``add_special_tokens``: the tokenizer's special tokens
        (BOS) added to the rendered text as well (the template already holds those it wants).
        ``continue_final_message``: the last message left open, for the model to go on with (a "prefill" of its
        answer; vLLM's option, which excludes ``add_generation_prompt``). ``template_kwargs``: more variables for
        the template (vLLM's ``chat_template_kwargs``, e.g. Qwen3's ``enable_thinking``). ValueError naming what is
        wrong: a message, an option, a template that fails on this conversation, text that is no valid UTF-8."""
        if not messages:
            raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
        if continue_final_message and add_generation_prompt:
            raise InvalidParameter("continue_final_message", "continue_final_message leaves the last message open "
                                   "for the model to go on with: set add_generation_prompt to false with it")
        template_kwargs = _checked_template_kwargs(template_kwargs)
        template = _checked_template(chat_template) if chat_template is not None else self.chat_template(tools)
        if template is None:
            raise ValueError("this model has no chat template: send it a plain prompt (/v1/completions, "
                             "LLM.generate, `kvserve generate` without --chat), or give it one (--chat-template, "
                             "chat_template=)")
        keep_parts, developer_is_system = iterates_content(template), "developer" not in template
        conversation, template_tools = for_template(
            [template_message(m, i, keep_parts, developer_is_system) for i, m in enumerate(messages)], tools,
            template)
        # before rendering it: 100,000 messages of 4 MB rendered in 1.75 s on the engine thread, then refused
        self._check_text_fits("".join(_texts(conversation)), "the conversation's messages", "messages")
        text = self._render(conversation, template, template_tools, add_generation_prompt=add_generation_prompt,
                            continue_final_message=continue_final_message, **template_kwargs)
        self._check_text_fits(text, "the rendered conversation", "messages")
        check_utf8(text, "the conversation (a message, a tool or a tool call)")  # JSON's "\ud800" in any
        token_ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return {"prompt": text, "prompt_token_ids": token_ids}

    def _render(self, conversation: list[dict[str, Any]], template: str, tools: list[dict[str, Any]] | None,
                **options: Any) -> str:
        """The conversation's text: transformers renders it; how a template fails, worded for the client."""
        try:
            text = self.tokenizer.apply_chat_template(conversation, tools=tools, chat_template=template,
                                                      tokenize=False, **options)
        except jinja2.TemplateSyntaxError as e:  # the model's own template (one given was checked as it came)
            raise ValueError(f"the model's chat template does not parse as Jinja: {e} (line {e.lineno}); give the "
                             "engine one that does (--chat-template, LLM(chat_template=...))") from e
        except jinja2.TemplateError as e:  # raise_exception(...) of the template: its own words
            raise ValueError(str(e)) from e
        except Exception as e:  # the template failed on what this conversation holds: the request's fault
            if options["continue_final_message"] and "continue_final_message" in str(e):  # transformers' words
                raise InvalidParameter("continue_final_message", _NOTHING_TO_CONTINUE) from e  # quote the chat
            raise ValueError(f"the chat template failed on this conversation: {type(e).__name__}: {e}") from e
        if not text:  # refused later as an empty prompt_token_ids, which the client did not send
            raise ValueError("the chat template rendered this conversation as no text at all")
        return text

    def process_pooling(self, prompt: PromptInput, params: PoolingParams, normalize: bool) -> ProcessedPrompt:
        """Tokenize (or check) a pooling request's prompt, which may fill ``max_model_len`` (it draws no token);
        ``normalize``: the engine's default, where ``params`` leaves it out. InvalidParameter naming what is
        wrong: ``dimensions`` among it, since no model kvserve serves is trained for Matryoshka truncation."""
        if params.dimensions is not None:
            raise InvalidParameter("dimensions", "dimensions: this model does not support Matryoshka "
                                                 "representations (its embeddings have one size)")
        text, token_ids = self._prompt_tokens(prompt, params.truncate_prompt_tokens)
        if len(token_ids) > self.max_model_len and params.truncate_prompt_tokens is not None:
            raise InvalidParameter("truncate_prompt_tokens", f"truncate_prompt_tokens={params.truncate_prompt_tokens} "
                                   f"keeps {len(token_ids)} tokens, over max_model_len={self.max_model_len} (-1 keeps "
                                   "that many)")
        if len(token_ids) > self.max_model_len:
            raise InvalidParameter("prompt", f"prompt ({len(token_ids)} tokens) is over max_model_len="
                                             f"{self.max_model_len} (truncate_prompt_tokens cuts it to its last ones)")
        if params.normalize is None:
            params = dataclasses.replace(params, normalize=normalize)
        return ProcessedPrompt(text, token_ids, POOLING_SAMPLING_PARAMS, cache_salt=_cache_salt(prompt), pooling=params)

    def _prompt_tokens(self, prompt: PromptInput, truncate_prompt_tokens: int | None) -> tuple[str | None, list[int]]:
        """The prompt's text and checked token ids, cut to its last ``truncate_prompt_tokens`` (None: whole)."""
        # a text to be cut to its last tokens may be longer than any context (the body's limit bounds it)
        text, token_ids = self._tokenize(prompt, check_fits=truncate_prompt_tokens is None)
        self.check_token_ids(token_ids, "prompt_token_ids")
        token_ids = [int(t) for t in token_ids]
        if truncate_prompt_tokens is not None:
            text, token_ids = self._truncated(text, token_ids, truncate_prompt_tokens)
        return text, token_ids

    def _tokenize(self, prompt: PromptInput, check_fits: bool = True) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty")
            if check_fits:
                self._check_text_fits(prompt, "prompt", "prompt")
            return prompt, self.tokenizer.encode(check_utf8(prompt, "the prompt"))
        if not isinstance(prompt, Mapping):
            raise ValueError(f"a prompt must be a string or a dict with 'prompt_token_ids' or 'prompt', got "
                             f"{type(prompt).__name__}")
        unknown = [key for key in prompt if key not in PROMPT_KEYS]
        if unknown:  # vLLM's multi_modal_data, ...: dropped, they would change the answer unseen
            raise ValueError(f"a prompt dict takes {', '.join(map(repr, PROMPT_KEYS))} only; kvserve does not "
                             f"implement {', '.join(map(repr, unknown))}")
        if "prompt_token_ids" in prompt:
            token_ids = prompt["prompt_token_ids"]
            if not isinstance(token_ids, (list, tuple)) or not token_ids:
                raise ValueError("prompt_token_ids must be a non-empty list of token ids")
            return prompt.get("prompt"), list(token_ids)
        if not isinstance(prompt.get("prompt"), str):
            raise ValueError("a prompt dict needs 'prompt_token_ids', or 'prompt' with the text to tokenize")
        return self._tokenize(prompt["prompt"], check_fits)

    def _truncated(self, text: str | None, token_ids: list[int], keep: int) -> tuple[str | None, list[int]]:
        """The prompt's last ``keep`` tokens (-1: ``max_model_len``), as vLLM's ``truncate_prompt_tokens`` keeps
        them; a prompt cut short has no text of its own (an echo spells its tokens)."""
        keep = self.max_model_len if keep == -1 else keep
        return (text, token_ids) if len(token_ids) <= keep else (None, token_ids[-keep:])

    def tokenize_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """``text``'s token ids (the server's /tokenize); ValueError for a text no context could hold."""
        self._check_text_fits(text, "prompt", "prompt")
        return self.tokenizer.encode(check_utf8(text, "the text"), add_special_tokens=add_special_tokens)

    def _check_text_fits(self, text: str, what: str, param: str) -> None:
        """Refuse, before tokenizing it, a text too long for any tokenization of it to fit: no token covers more
        characters than its own string in the vocabulary has (a byte-level token's characters stand one for a
        byte; a SentencePiece token's one for a character), so such a text has more than max_model_len tokens.
        Tokenizing megabytes that are refused anyway held every stream still for seconds. InvalidParameter naming
        ``param``, the request's field that holds the text."""
        if len(text) > self.max_model_len and len(text) > self.max_model_len * self._longest_token_chars:
            raise InvalidParameter(param, f"{what} has {len(text)} characters: more tokens than max_model_len="
                             f"{self.max_model_len}, whatever its tokenization")

    @functools.cached_property
    def _longest_token_chars(self) -> int:
        return max(map(len, self.tokenizer.get_vocab()))

    def check_token_ids(self, token_ids: Sequence[Any], what: str) -> None:
        """InvalidParameter naming ``what`` for the first of ``token_ids`` that is no int or no token id of this
        model."""
        for t in token_ids:  # numpy's integers too (``process`` keeps Python's)
            if isinstance(t, bool) or not isinstance(t, numbers.Integral):  # a tensor's element: .tolist() it
                raise InvalidParameter(what, f"{what}: {t!r} is a {type(t).__name__}, not a token id: token ids "
                                             "are ints (Python's or numpy's)")
            if not 0 <= t < self.vocab_size:
                raise InvalidParameter(what, f"{what}: {t!r} is not a token id of this model (vocabulary size "
                                             f"{self.vocab_size})")

    def _fit_params(self, params: SamplingParams, num_prompt_tokens: int, cap_max_tokens: bool) -> SamplingParams:
        room = self.max_model_len - num_prompt_tokens
        if room < 1:
            raise InvalidParameter(  # scoring a prompt (echo, max_tokens 0) draws one token too, left out of its answer
                "prompt", f"prompt ({num_prompt_tokens} tokens) leaves no room within max_model_len="
                f"{self.max_model_len} for the token every request draws"
            )
        max_tokens = room if params.max_tokens is None else params.max_tokens
        if cap_max_tokens:
            max_tokens = min(max_tokens, room)
        if num_prompt_tokens + max_tokens > self.max_model_len:
            raise InvalidParameter(
                "max_tokens", f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = "
                f"{num_prompt_tokens + max_tokens} is over max_model_len={self.max_model_len}"
            )
        self.check_token_ids(params.stop_token_ids or [], "stop_token_ids")
        self.check_token_ids(list(params.logit_bias or {}), "logit_bias")
        self.check_token_ids(params.allowed_token_ids or [], "allowed_token_ids")
        if params.structured_outputs is not None and params.structured_outputs.begins_after_token_id is not None:
            self.check_token_ids([params.structured_outputs.begins_after_token_id], "begins_after_token_id")
        bad_words_token_ids = params.bad_words_token_ids
        if params.bad_words:  # beside any token sequences given as they are
            bad_words_token_ids = (*(bad_words_token_ids or ()), *self._bad_word_tokens(params.bad_words))
        for sequence in bad_words_token_ids or ():
            self.check_token_ids(sequence, "bad_words_token_ids")
        always_banned = {word[0] for word in bad_words_token_ids or () if len(word) == 1}
        if params.allowed_token_ids is not None and always_banned.issuperset(params.allowed_token_ids):
            raise InvalidParameter("bad_words", "bad_words ban every token of allowed_token_ids: nothing is left "
                                                "to draw")
        return dataclasses.replace(params, max_tokens=max_tokens, bad_words_token_ids=bad_words_token_ids,
                                   logprobs=self._num_logprobs(params.logprobs, "logprobs"),
                                   prompt_logprobs=self._num_logprobs(params.prompt_logprobs, "prompt_logprobs"))

    def _num_logprobs(self, asked: int | None, param: str) -> int | None:
        """How many alternatives a position's entry holds (-1: the whole vocabulary); InvalidParameter naming
        ``param`` past ``max_logprobs``, as vLLM refuses them."""
        if asked is None:
            return None
        num = self.vocab_size if asked == -1 else asked
        if num > self.max_logprobs:
            raise InvalidParameter(param, f"{param} asks for {num} alternatives a position, more than the "
                                          f"{self.max_logprobs} that max_logprobs allows (--max-logprobs; -1 in it "
                                          "allows the whole vocabulary)")
        return num

    def _bad_word_tokens(self, words: Sequence[str]) -> Iterator[tuple[int, ...]]:
        """Each word's tokens as it starts a text, and, where the tokenizer spells it otherwise after a space (a
        word token of its own, as many tokens), as it follows a space (vLLM's two spellings of a bad word)."""
        for word in words:
            alone = tuple(self.tokenizer.encode(word.lstrip(), add_special_tokens=False))
            spaced = tuple(self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            yield from [alone] if alone else []
            if alone and spaced and spaced[0] != alone[0] and len(spaced) == len(alone):
                yield spaced


_NOTHING_TO_CONTINUE = (
    "continue_final_message: the chat template does not render the last message's text as sent (it has none, or "
    "the template leaves it out or changes it), so there is no end of it to go on from")


@functools.cache
def _template_call_names() -> frozenset[str]:
    """The names a template's variables may not take: ``apply_chat_template``'s own parameters (how it renders,
    whether it tokenizes, which template) and the messages."""
    parameters = inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters
    return frozenset(name for name, p in parameters.items() if p.kind is not p.VAR_KEYWORD) | {"messages"}


def _checked_template_kwargs(kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """``chat_template_kwargs`` as variables for the template; InvalidParameter for one that is no dict of names,
    or that names an option of the rendering itself (vLLM drops those silently: a client meaning to set one would
    never learn it did nothing). A name the template does not read changes nothing, as in vLLM and
    transformers."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, Mapping) or not all(isinstance(name, str) for name in kwargs):
        raise InvalidParameter("chat_template_kwargs", "chat_template_kwargs must be a dict of variable names to "
                               "values")
    reserved = sorted(_template_call_names() & kwargs.keys())
    if reserved:
        raise InvalidParameter("chat_template_kwargs", f"chat_template_kwargs may not set {', '.join(reserved)}: "
                               "those are options of the rendering (give add_generation_prompt, "
                               "continue_final_message and tools as fields of their own)")
    return dict(kwargs)


def _cache_salt(prompt: PromptInput) -> str | None:
    """A prompt dict's ``cache_salt``: a non-empty string (as vLLM asks), else ValueError."""
    salt = prompt.get("cache_salt") if isinstance(prompt, Mapping) else None
    if salt is not None and (not isinstance(salt, str) or not salt):
        got = "an empty one" if salt == "" else f"a {type(salt).__name__}"
        raise InvalidParameter("cache_salt", f"cache_salt must be a non-empty string, got {got}")
    return None if salt is None else check_utf8(salt, "cache_salt")


def _no_truncation_or_padding(tokenizer: PreTrainedTokenizerBase) -> None:
    """Turn off the truncation and padding a fast tokenizer's file may turn on (kvserve asks for neither), here,
    before any thread uses it: transformers turns them off at the first encode otherwise, a write to the Rust
    tokenizer that the engine thread's decode, running beside the inputs thread's encode, meets as "Already
    borrowed"."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        backend.no_truncation()
        backend.no_padding()


def _checked_template(template: str) -> str:
    """A chat template given in place of the model's, checked to parse (a typo fails here, not in every request)
    as transformers compiles templates to render them: with its extensions (``{% break %}``, ``{% generation %}``),
    which a plain Jinja environment refused."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        _compile_jinja_template(template)
    except jinja2.TemplateSyntaxError as error:
        raise ValueError(f"chat_template does not parse as Jinja: {error} (line {error.lineno})") from None
    return template


def _warn_if_unparsable(template: str | Mapping[str, str] | None) -> None:
    """A warning as the model loads if its own chat template (each of its named ones) does not parse: its chats are
    then refused naming the template, its completions served."""
    for text in template.values() if isinstance(template, Mapping) else [template]:
        if text:
            try:
                _checked_template(text)
            except ValueError as error:
                logger.warning("the model's %s; chat requests will be refused until one that parses is given "
                               "(--chat-template)", error)


def _texts(conversation: list[dict[str, Any]]) -> Iterator[str]:
    """The text every message of ``conversation`` holds (its content, or its text parts), which its rendering
    holds too."""
    for message in conversation:
        content = message.get("content")
        if isinstance(content, str):
            yield content
        elif isinstance(content, list):
            yield from (part["text"] for part in content
                        if isinstance(part, dict) and isinstance(part.get("text"), str))

