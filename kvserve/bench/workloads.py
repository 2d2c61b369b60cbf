"""Seeded benchmark workloads: what each request sends and how many tokens it must get back.

``random``: prompts of random ordinary token ids; ``prefix``: groups of requests that share a long system
prompt and arrive together; ``multiturn``: conversations whose every turn resends the whole history (the
answers come from the server, so turns of one conversation run in order); ``long``: prompts near the
context limit; ``sharegpt``: the first human turn of each ShareGPT conversation, the reply's length as output.
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

WORKLOADS = ("random", "prefix", "multiturn", "long", "sharegpt")


@dataclass(frozen=True)
class SampleRequest:
    prompt: str | list[int]  # text, or token ids (for /v1/completions)
    prompt_len: int  # in tokens, as generated (the server's usage is what reports count)
    output_len: int  # tokens to generate, exactly (ignore_eos)
    group: int | None = None  # prefix group, or conversation


@dataclass(frozen=True)
class Conversation:
    """A multi-turn chat: ``user_turns[k]`` is sent after the server's answer to turn k - 1."""

    user_turns: list[str]
    output_len: int
    conversation_id: int = 0


@dataclass
class Workload:
    name: str
    requests: list[SampleRequest] = field(default_factory=list)
    conversations: list[Conversation] = field(default_factory=list)


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dataset-name", choices=WORKLOADS, default="random")
    parser.add_argument("--dataset-path", type=Path, help="a ShareGPT-format JSON file (sharegpt)")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--random-input-len", type=int, default=256)
    parser.add_argument("--random-output-len", type=int, default=64)
    parser.add_argument("--random-range-ratio", type=float, default=0.0,
                        help="lengths drawn uniformly in [len * (1 - r), len * (1 + r)] (vLLM's meaning)")
    parser.add_argument("--prefix-num-groups", type=int, default=8)
    parser.add_argument("--prefix-group-size", type=int, default=16)
    parser.add_argument("--prefix-len", type=int, default=1024)
    parser.add_argument("--suffix-len", type=int, default=32)
    parser.add_argument("--num-conversations", type=int, default=8)
    parser.add_argument("--num-turns", type=int, default=4)
    parser.add_argument("--first-turn-len", type=int, default=1000, help="multiturn: tokens of the first message")
    parser.add_argument("--turn-len", type=int, default=100, help="multiturn: tokens of each later message")
    parser.add_argument("--long-prompt-len", type=int, default=None,
                        help="long: prompt tokens (default: the context limit minus the output)")
    parser.add_argument("--max-model-len", type=int, default=2048, help="long: the context limit to fill")


def build_workload(args: argparse.Namespace, tokenizer: Any) -> Workload:
    """The workload ``args.dataset_name`` describes, the same for the same seed."""
    rng = random.Random(args.seed)
    ids = _OrdinaryIds(tokenizer)
    name = args.dataset_name
    if name == "random":
        return Workload(name, [_random_request(rng, ids, args) for _ in range(args.num_prompts)])
    if name == "prefix":
        return Workload(name, _prefix_requests(rng, ids, args))
    if name == "long":
        return Workload(name, _long_requests(rng, ids, args))
    if name == "multiturn":
        return Workload(name, conversations=_conversations(rng, ids, tokenizer, args))
    return Workload(name, _sharegpt_requests(rng, tokenizer, args))


class _OrdinaryIds:
    """Token ids that are not special, so a prompt of n ids is n tokens to every server."""

    def __init__(self, tokenizer: Any) -> None:
        special = set(tokenizer.all_special_ids)
        self.ids = [i for i in range(min(len(tokenizer), tokenizer.vocab_size)) if i not in special]

    def draw(self, rng: random.Random, n: int) -> list[int]:
        return [self.ids[rng.randrange(len(self.ids))] for _ in range(n)]


def _length(rng: random.Random, mean: int, ratio: float) -> int:
    return max(1, rng.randint(int(mean * (1 - ratio)), int(mean * (1 + ratio))))


def _random_request(rng: random.Random, ids: _OrdinaryIds, args: argparse.Namespace) -> SampleRequest:
    prompt_len = _length(rng, args.random_input_len, args.random_range_ratio)
    output_len = _length(rng, args.random_output_len, args.random_range_ratio)
    return SampleRequest(ids.draw(rng, prompt_len), prompt_len, output_len)


def _prefix_requests(rng: random.Random, ids: _OrdinaryIds, args: argparse.Namespace) -> list[SampleRequest]:
    requests = []
    for group in range(args.prefix_num_groups):  # group by group: a group's requests arrive together
        system = ids.draw(rng, args.prefix_len)
        for _ in range(args.prefix_group_size):
            prompt = system + ids.draw(rng, args.suffix_len)
            requests.append(SampleRequest(prompt, len(prompt), args.random_output_len, group))
    return requests


def _long_requests(rng: random.Random, ids: _OrdinaryIds, args: argparse.Namespace) -> list[SampleRequest]:
    prompt_len = args.long_prompt_len or args.max_model_len - args.random_output_len
    return [SampleRequest(ids.draw(rng, prompt_len), prompt_len, args.random_output_len)
            for _ in range(args.num_prompts)]


def _conversations(
    rng: random.Random, ids: _OrdinaryIds, tokenizer: Any, args: argparse.Namespace
) -> list[Conversation]:
    """Messages of random words: decoded random ids, so their token counts are close to the asked lengths."""
    def text(n: int) -> str:
        return tokenizer.decode(ids.draw(rng, n), skip_special_tokens=True)

    return [
        Conversation([text(args.first_turn_len)] + [text(args.turn_len) for _ in range(args.num_turns - 1)],
                     args.random_output_len, conversation_id=c)
        for c in range(args.num_conversations)
    ]


def _sharegpt_requests(rng: random.Random, tokenizer: Any, args: argparse.Namespace) -> list[SampleRequest]:
    """The first human turn and the length of the reply to it, skipping pairs too short or too long to be
    useful (under 4 tokens, or over 1,024 prompt / 2,048 total), as vLLM's benchmark does."""
    if args.dataset_path is None:
        raise ValueError("the sharegpt workload needs --dataset-path FILE (ShareGPT JSON)")
    conversations = json.loads(Path(args.dataset_path).read_text())
    rng.shuffle(conversations)
    requests = []
    for conversation in conversations:
        turns = conversation.get("conversations", [])
        if len(turns) < 2:
            continue
        prompt, reply = turns[0]["value"], turns[1]["value"]
        prompt_len, output_len = len(tokenizer.encode(prompt)), len(tokenizer.encode(reply))
        if prompt_len < 4 or output_len < 4 or prompt_len > 1024 or prompt_len + output_len > 2048:
            continue
        requests.append(SampleRequest(prompt, prompt_len, output_len))
        if len(requests) == args.num_prompts:
            break
    return requests
