"""Seeded benchmark workloads: what each request sends and how many tokens it must get back.

``random``: prompts of random ordinary token ids, lengths drawn around ``--random-input-len`` /
``--random-output-len``. ``sharegpt``: the first human turn of each conversation of a ShareGPT file, the reply's
length as the output length. ``prefix``: groups of requests that share a long system prompt, listed group by group
so that a group arrives together (``--prefix-order shuffled``: in a seeded random order, so that every group
keeps coming back among the others: what a router must keep apart). ``multiturn``: conversations whose every turn resends the whole history; the
list holds every turn with a scripted history, and ``kvserve bench serve`` swaps the scripted answers for the
server's own. ``long``: prompts that fill the context but for the output. ``grounded``: chat turns whose answers
quote their prompt (code edits, summaries with quotes, extraction; ``bench/grounded.py``), for speculation.

The same flags and seed give the same requests, whoever builds them (``bench serve``, ``bench throughput``, the
peers' scripts), so every engine runs exactly the same work.
"""

from __future__ import annotations

import argparse
import json
import math
import random
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from kvserve.bench.grounded import grounded_messages

DATASETS = ("random", "sharegpt", "prefix", "multiturn", "long", "grounded")
SHAREGPT_SAMPLE = Path(__file__).parent / "data" / "sharegpt_sample.json"
# vLLM's ShareGPT filter: pairs this short say little, and longer ones would not fit a 2k context.
SHAREGPT_MIN_LEN = 4
SHAREGPT_MAX_PROMPT_LEN = 1024
SHAREGPT_MAX_TOTAL_LEN = 2048
TEXT_ROUNDS = 8  # of re-tokenizing a random text towards its length: one or two suffice

# The workload flags each dataset reads, and their defaults: a flag set away from its default for a dataset that
# does not read it is refused (a sweep written with another dataset's flags would run other work than it reads).
READ_BY = {
    "dataset_path": ("sharegpt",),
    "num_prompts": ("random", "sharegpt", "long", "grounded"),
    "random_input_len": ("random", "grounded"),
    "random_output_len": ("random", "prefix", "multiturn", "long", "grounded"),
    "random_range_ratio": ("random", "grounded"),
    "random_output_range_ratio": ("random", "grounded"),
    "sharegpt_output_len": ("sharegpt",),
    **dict.fromkeys(("prefix_num_groups", "prefix_group_size", "prefix_len", "suffix_len", "prefix_order"),
                    ("prefix",)),
    **dict.fromkeys(("num_conversations", "num_turns", "first_turn_len", "turn_len"), ("multiturn",)),
    "long_prompt_len": ("long",),
}
DEFAULTS: dict[str, Any] = {
    "dataset_path": None, "num_prompts": 64, "random_input_len": 256, "random_output_len": 64,
    "random_range_ratio": 0.0, "random_output_range_ratio": None, "sharegpt_output_len": None,
    "prefix_num_groups": 8, "prefix_group_size": 16, "prefix_len": 1024, "suffix_len": 32, "prefix_order": "grouped",
    "num_conversations": 8, "num_turns": 4, "first_turn_len": 1000, "turn_len": 100, "long_prompt_len": None,
}


@dataclass(frozen=True)
class SampleRequest:
    """One request of a workload."""

    prompt: str | list[int]  # text, or token ids (random, prefix, long: servers take ids in /v1/completions)
    prompt_len: int  # in tokens, as generated (the server's usage is what reports count)
    output_len: int  # tokens to generate, exactly (ignore_eos)
    # multiturn: the whole chat history, its answers scripted; grounded: the chat turn its prompt is the template of
    messages: list[dict[str, str]] | None = None
    group: int | None = None  # prefix group, or conversation
    turn: int | None = None  # multiturn: the turn's index in its conversation


def add_dataset_arguments(parser: argparse.ArgumentParser) -> None:
    """The workload flags, shared by ``kvserve bench serve`` and ``kvserve bench throughput``."""
    group = parser.add_argument_group("workload")
    group.add_argument("--dataset-name", choices=DATASETS, default="random", help="default: %(default)s")
    group.add_argument("--dataset-path", type=Path, default=DEFAULTS["dataset_path"],
                       help=f"sharegpt: a ShareGPT-format JSON file (default: a small synthetic one, "
                       f"{SHAREGPT_SAMPLE})")
    group.add_argument("--num-prompts", type=int, default=DEFAULTS["num_prompts"],
                       help="requests (random, sharegpt, long, grounded) (default: %(default)s)")
    group.add_argument("--seed", type=int, default=0, help="default: %(default)s")
    group.add_argument("--random-input-len", type=int, default=DEFAULTS["random_input_len"],
                       help="random: prompt tokens (the centre of a range with --random-range-ratio); grounded: "
                       "tokens of each document (default: %(default)s)")
    group.add_argument("--random-output-len", type=int, default=DEFAULTS["random_output_len"],
                       help="output tokens of every request of prefix, multiturn and long; of random and grounded, "
                       "the centre of a range with a range ratio (default: %(default)s)")
    group.add_argument("--random-range-ratio", type=float, default=DEFAULTS["random_range_ratio"],
                       help="random: lengths uniform in [len * (1 - r), len * (1 + r)], 0 <= r < 1 (vLLM's meaning); "
                       "grounded: its output lengths' (default: %(default)s)")
    group.add_argument("--random-output-range-ratio", type=float, default=DEFAULTS["random_output_range_ratio"],
                       help="random, grounded: the output lengths' r, where it differs from the prompts' (0: exact "
                       "lengths; default: the prompts')")
    group.add_argument("--sharegpt-output-len", type=int, default=DEFAULTS["sharegpt_output_len"],
                       help="sharegpt: this output length for every request (default: each reply's)")
    group.add_argument("--prefix-num-groups", type=int, default=DEFAULTS["prefix_num_groups"],
                       help="prefix: groups (default: %(default)s)")
    group.add_argument("--prefix-group-size", type=int, default=DEFAULTS["prefix_group_size"],
                       help="prefix: requests per group (default: %(default)s)")
    group.add_argument("--prefix-len", type=int, default=DEFAULTS["prefix_len"],
                       help="prefix: tokens of each group's shared prompt (default: %(default)s)")
    group.add_argument("--suffix-len", type=int, default=DEFAULTS["suffix_len"],
                       help="prefix: tokens of each request's own suffix (default: %(default)s)")
    group.add_argument("--prefix-order", choices=("grouped", "shuffled"), default=DEFAULTS["prefix_order"],
                       help="prefix: a group's requests together, or all requests in a seeded random order "
                       "(default: %(default)s)")
    group.add_argument("--num-conversations", type=int, default=DEFAULTS["num_conversations"],
                       help="multiturn: conversations (default: %(default)s)")
    group.add_argument("--num-turns", type=int, default=DEFAULTS["num_turns"],
                       help="multiturn: turns of each (default: %(default)s)")
    group.add_argument("--first-turn-len", type=int, default=DEFAULTS["first_turn_len"],
                       help="multiturn: tokens of the first message (default: %(default)s)")
    group.add_argument("--turn-len", type=int, default=DEFAULTS["turn_len"],
                       help="multiturn: tokens of each later message (default: %(default)s)")
    group.add_argument("--long-prompt-len", type=int, default=DEFAULTS["long_prompt_len"],
                       help="long: prompt tokens (default: the context limit minus --random-output-len)")


def build_dataset(args: argparse.Namespace, tokenizer: PreTrainedTokenizerBase,
                  max_model_len: int | None = None, chat: bool = False) -> list[SampleRequest]:
    """The workload ``args.dataset_name`` describes, the same for the same flags and seed.

    ``max_model_len`` is the context limit that ``long`` fills when ``--long-prompt-len`` is not given.
    ``chat``: for a chat endpoint, which takes no token ids: random, prefix and long prompts are texts of their
    lengths in tokens (the lengths drawn as for ids), and ``long`` leaves room for the chat template's tokens.
    Raises ``ValueError`` naming the flag when a length or count is out of range.
    """
    check_workload_flags(args)
    rng = random.Random(args.seed)
    name = args.dataset_name
    if name == "sharegpt":
        return _sharegpt(rng, tokenizer, args)
    if name == "grounded":
        return _grounded_requests(rng, tokenizer, args)
    words = _RandomText(tokenizer, as_text=chat)
    if name == "random":
        return [_random_request(rng, words, args) for _ in range(args.num_prompts)]
    if name == "prefix":
        return _prefix_requests(rng, words, args)
    if name == "multiturn":
        return _multiturn_requests(rng, words, tokenizer, args)
    return _long_requests(rng, words, args, max_model_len, chat_template_len(tokenizer) if chat else 0)


def ordinary_token_ids(tokenizer: PreTrainedTokenizerBase, vocab_size: int | None = None) -> list[int]:
    """Every id below ``vocab_size`` (default: the tokenizer's size) that is not an added (special or control)
    token, so that a prompt of n of them is n tokens to every server."""
    added = set(tokenizer.added_tokens_decoder)
    limit = len(tokenizer) if vocab_size is None else min(vocab_size, len(tokenizer))
    return [i for i in range(limit) if i not in added]


def check_workload_flags(args: argparse.Namespace) -> None:
    """Raise ValueError naming the flag whose value is out of range, or that the chosen workload would ignore (set
    away from its default: ``READ_BY``)."""
    for name, datasets in READ_BY.items():
        if args.dataset_name not in datasets and getattr(args, name) != DEFAULTS[name]:
            raise ValueError(f"--{name.replace('_', '-')} is read by --dataset-name {' / '.join(datasets)} only, "
                             f"not {args.dataset_name}")
    positive = ["num_prompts", "random_input_len", "random_output_len", "prefix_num_groups", "prefix_group_size",
                "prefix_len", "suffix_len", "num_conversations", "num_turns", "first_turn_len", "turn_len"]
    optional = ["sharegpt_output_len", "long_prompt_len"]  # None: unset
    for name in positive + [name for name in optional if getattr(args, name) is not None]:
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if not 0 <= args.random_range_ratio < 1:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {args.random_range_ratio}")
    if args.random_output_range_ratio is not None and not 0 <= args.random_output_range_ratio < 1:
        raise ValueError(f"--random-output-range-ratio must be in [0, 1), got {args.random_output_range_ratio}")


class _RandomText:
    """Seeded random token ids and texts of a given length in tokens; ``as_text``: prompts are texts."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, as_text: bool = False) -> None:
        self.tokenizer = tokenizer
        self.ids = ordinary_token_ids(tokenizer)
        self.as_text = as_text

    def ids_of_len(self, rng: random.Random, n: int) -> list[int]:
        return rng.choices(self.ids, k=n)

    def prompt_of_len(self, rng: random.Random, n: int) -> str | list[int]:
        return self.text_of_len(rng, n) if self.as_text else self.ids_of_len(rng, n)

    def text_of_len(self, rng: random.Random, n: int) -> str:
        """A text that re-tokenizes to n tokens (in the rare case that the rounds run out, within a token or
        two). Words joined merge or split tokens at the joins, so the text is re-tokenized, cut back to n tokens
        when over and lengthened when under, until it has n. It takes n draws of ``rng``, as ``ids_of_len``
        does, so that the lengths drawn after it are the same for text and ids; the words of the rounds come
        from a generator seeded with the text."""
        text = self.tokenizer.decode(rng.choices(self._words, k=n))
        more = random.Random(text)
        for _ in range(TEXT_ROUNDS):
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            if len(ids) == n:
                break
            text = (self.tokenizer.decode(ids[:n]) if len(ids) > n
                    else text + self.tokenizer.decode(more.choices(self._words, k=n - len(ids))))
        return text

    @cached_property
    def _words(self) -> list[int]:
        """The ordinary ids whose text alone re-tokenizes to that id: unlike a byte of a character, for one,
        which decodes to a replacement character that is a token or two of its own."""
        texts = self.tokenizer.batch_decode([[i] for i in self.ids])
        return [i for i, text in zip(self.ids, texts) if self.tokenizer.encode(text, add_special_tokens=False) == [i]]


def _length(rng: random.Random, mean: int, ratio: float) -> int:
    return rng.randint(max(1, math.floor(mean * (1 - ratio))), math.ceil(mean * (1 + ratio)))


def _output_length(rng: random.Random, args: argparse.Namespace) -> int:
    ratio = args.random_range_ratio if args.random_output_range_ratio is None else args.random_output_range_ratio
    return _length(rng, args.random_output_len, ratio)


def _random_request(rng: random.Random, words: _RandomText, args: argparse.Namespace) -> SampleRequest:
    prompt_len = _length(rng, args.random_input_len, args.random_range_ratio)
    output_len = _output_length(rng, args)
    return SampleRequest(words.prompt_of_len(rng, prompt_len), prompt_len, output_len)


def _prefix_requests(rng: random.Random, words: _RandomText, args: argparse.Namespace) -> list[SampleRequest]:
    requests = []
    for group in range(args.prefix_num_groups):
        system = words.prompt_of_len(rng, args.prefix_len)
        for _ in range(args.prefix_group_size):
            prompt = system + words.prompt_of_len(rng, args.suffix_len)  # text: within a token, for the join
            requests.append(SampleRequest(prompt, args.prefix_len + args.suffix_len, args.random_output_len,
                                          group=group))
    if args.prefix_order == "shuffled":
        rng.shuffle(requests)
    return requests


def _long_requests(rng: random.Random, words: _RandomText, args: argparse.Namespace,
                   max_model_len: int | None, template_len: int) -> list[SampleRequest]:
    """``template_len``: the tokens a chat template puts around the prompt, which the context must hold too."""
    prompt_len = args.long_prompt_len
    if prompt_len is None:
        if max_model_len is None:
            raise ValueError("the long workload needs --long-prompt-len, or a context limit to fill")
        prompt_len = max_model_len - args.random_output_len - template_len
    if prompt_len < 1:
        template = f" and the chat template's {template_len}" if template_len else ""
        raise ValueError(f"the long workload's prompts would have {prompt_len} tokens: the context limit "
                         f"{max_model_len} leaves no room beside --random-output-len {args.random_output_len}"
                         f"{template}")
    return [SampleRequest(words.prompt_of_len(rng, prompt_len), prompt_len, args.random_output_len)
            for _ in range(args.num_prompts)]


def _multiturn_requests(rng: random.Random, words: _RandomText, tokenizer: PreTrainedTokenizerBase,
                        args: argparse.Namespace) -> list[SampleRequest]:
    """Conversation by conversation, turn by turn. Turn t's history holds the user messages 0..t and scripted
    answers of ``--random-output-len`` tokens; its prompt is that history through the chat template."""
    requests = []
    for conversation in range(args.num_conversations):
        messages: list[dict[str, str]] = []
        for turn in range(args.num_turns):
            user_len = args.first_turn_len if turn == 0 else args.turn_len
            messages.append({"role": "user", "content": words.text_of_len(rng, user_len)})
            prompt = _chat_prompt(tokenizer, messages)
            prompt_len = len(tokenizer.encode(prompt, add_special_tokens=False))
            requests.append(SampleRequest(prompt, prompt_len, args.random_output_len, messages=list(messages),
                                          group=conversation, turn=turn))
            messages.append({"role": "assistant", "content": words.text_of_len(rng, args.random_output_len)})
    return requests


def _grounded_requests(rng: random.Random, tokenizer: PreTrainedTokenizerBase, args: argparse.Namespace
                       ) -> list[SampleRequest]:
    """``--num-prompts`` chat turns of documents of about ``--random-input-len`` tokens and tasks that quote them."""
    requests = []
    for i in range(args.num_prompts):
        messages = grounded_messages(rng, i, tokenizer, args.random_input_len)
        prompt = _chat_prompt(tokenizer, messages)
        prompt_len = len(tokenizer.encode(prompt, add_special_tokens=False))
        output_len = _output_length(rng, args)
        requests.append(SampleRequest(prompt, prompt_len, output_len, messages=messages))
    return requests


def chat_template_len(tokenizer: PreTrainedTokenizerBase) -> int:
    """The tokens the chat template puts around a user message (a default system prompt included)."""
    empty = _chat_prompt(tokenizer, [{"role": "user", "content": ""}])
    return len(tokenizer.encode(empty, add_special_tokens=False))


def _chat_prompt(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]]) -> str:
    if tokenizer.chat_template is None:
        raise ValueError("this workload needs a tokenizer with a chat template")
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def _sharegpt(rng: random.Random, tokenizer: PreTrainedTokenizerBase, args: argparse.Namespace
              ) -> list[SampleRequest]:
    """The first human turn and the token length of the reply to it (or ``--sharegpt-output-len``), in a seeded
    order, skipping the pairs vLLM's benchmark skips (under 4 tokens, over 1,024 prompt tokens or 2,048 in all;
    like vLLM's, the minimum holds for the reply's length only, not for a length that was asked for)."""
    pairs = _sharegpt_pairs(args.dataset_path)
    rng.shuffle(pairs)
    requests = []
    for prompt, reply in pairs:
        prompt_len = len(tokenizer.encode(prompt, add_special_tokens=False))
        fixed = args.sharegpt_output_len
        output_len = fixed if fixed is not None else len(tokenizer.encode(reply, add_special_tokens=False))
        if prompt_len < SHAREGPT_MIN_LEN or (fixed is None and output_len < SHAREGPT_MIN_LEN) \
                or prompt_len > SHAREGPT_MAX_PROMPT_LEN or prompt_len + output_len > SHAREGPT_MAX_TOTAL_LEN:
            continue
        requests.append(SampleRequest(prompt, prompt_len, output_len))
        if len(requests) == args.num_prompts:
            return requests
    if not requests:
        raise ValueError(f"no conversation of {args.dataset_path} passes the length filter (at least "
                         f"{SHAREGPT_MIN_LEN} tokens each way, at most {SHAREGPT_MAX_PROMPT_LEN} in the prompt and "
                         f"{SHAREGPT_MAX_TOTAL_LEN} in all)")
    raise ValueError(f"only {len(requests)} conversations of {args.dataset_path} pass the length filter; "
                     f"ask for --num-prompts {len(requests)} or fewer")


def _sharegpt_pairs(path: Path | None) -> list[tuple[str, str]]:
    if path is None:
        raise ValueError(f"the sharegpt workload needs --dataset-path FILE (ShareGPT JSON; a small synthetic "
                         f"one ships at {SHAREGPT_SAMPLE})")
    try:
        data: Any = json.loads(Path(path).read_bytes())  # JSON is UTF-8 (RFC 8259), whatever the locale's encoding
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not JSON: {e}") from None
    if not isinstance(data, list):
        raise ValueError(f"{path}: a ShareGPT file is a list of {{'conversations': [...]}} entries")
    return [pair for index, entry in enumerate(data) if (pair := _first_exchange(path, index, entry)) is not None]


def _first_exchange(path: Path, index: int, entry: Any) -> tuple[str, str] | None:
    """The texts of an entry's first two turns; None for an entry of fewer turns."""
    turns = entry.get("conversations", []) if isinstance(entry, dict) else None
    if not isinstance(turns, list) or not all(isinstance(turn, dict) and isinstance(turn.get("value"), str)
                                              for turn in turns[:2]):
        raise ValueError(f"{path}: entry {index} is not a {{'conversations': [{{'value': ...}}, ...]}} object")
    return (turns[0]["value"], turns[1]["value"]) if len(turns) >= 2 else None
