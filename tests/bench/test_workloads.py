"""Each workload is deterministic for a seed and respects its lengths."""

from __future__ import annotations

import argparse
import json

import pytest

from kvserve.bench.workloads import add_workload_arguments, build_workload
from kvserve.model.loader import load_checkpoint
from kvserve.model.sources import resolve_model


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoints):
    import torch

    return load_checkpoint(resolve_model(str(tiny_checkpoints["llama"])), torch.float32).tokenizer


def args(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_workload_arguments(parser)
    return parser.parse_args(list(flags))


def test_random_is_seeded_and_within_its_ranges(tokenizer) -> None:
    flags = ["--dataset-name", "random", "--num-prompts", "20", "--random-input-len", "40",
             "--random-output-len", "10", "--random-range-ratio", "0.5"]
    a, b = build_workload(args(*flags), tokenizer), build_workload(args(*flags), tokenizer)
    other = build_workload(args(*flags, "--seed", "1"), tokenizer)
    assert a.requests == b.requests and a.requests != other.requests
    assert all(20 <= r.prompt_len <= 60 and 5 <= r.output_len <= 15 for r in a.requests)
    assert all(len(r.prompt) == r.prompt_len for r in a.requests)
    special = set(tokenizer.all_special_ids)
    assert not any(t in special for r in a.requests for t in r.prompt)


def test_prefix_groups_share_their_system_prompt_and_arrive_together(tokenizer) -> None:
    w = build_workload(args("--dataset-name", "prefix", "--prefix-num-groups", "3", "--prefix-group-size", "4",
                            "--prefix-len", "50", "--suffix-len", "6"), tokenizer)
    assert [r.group for r in w.requests] == [0] * 4 + [1] * 4 + [2] * 4
    assert all(len(r.prompt) == 56 for r in w.requests)
    for group in range(3):
        members = [r.prompt for r in w.requests if r.group == group]
        assert len({tuple(p[:50]) for p in members}) == 1 and len({tuple(p[50:]) for p in members}) == 4
    assert w.requests[0].prompt[:50] != w.requests[4].prompt[:50]


def test_multiturn_conversations_have_their_turns(tokenizer) -> None:
    w = build_workload(args("--dataset-name", "multiturn", "--num-conversations", "3", "--num-turns", "4",
                            "--first-turn-len", "60", "--turn-len", "10"), tokenizer)
    assert len(w.conversations) == 3 and all(len(c.user_turns) == 4 for c in w.conversations)
    first = len(tokenizer.encode(w.conversations[0].user_turns[0], add_special_tokens=False))
    assert 30 <= first <= 120  # decoded random ids re-tokenize to about the asked length


def test_long_prompts_fill_the_context_but_the_output(tokenizer) -> None:
    w = build_workload(args("--dataset-name", "long", "--num-prompts", "2", "--max-model-len", "200",
                            "--random-output-len", "16"), tokenizer)
    assert [r.prompt_len for r in w.requests] == [184, 184]


def test_sharegpt_reads_first_turns_and_reply_lengths(tokenizer, tmp_path) -> None:
    data = [{"conversations": [{"from": "human", "value": f"question number {i} about a topic"},
                               {"from": "gpt", "value": f"an answer of some length {i} " * 3}]} for i in range(5)]
    data.append({"conversations": [{"from": "human", "value": "a lonely turn"}]})
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    w = build_workload(args("--dataset-name", "sharegpt", "--dataset-path", str(path), "--num-prompts", "3"),
                       tokenizer)
    assert len(w.requests) == 3 and all(r.prompt.startswith("question number") for r in w.requests)
    with pytest.raises(ValueError, match="--dataset-path"):
        build_workload(args("--dataset-name", "sharegpt"), tokenizer)
