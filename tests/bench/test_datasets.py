"""Each workload is deterministic for a seed and respects its lengths."""

from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path

import pytest

from kvserve.bench.datasets import (SHAREGPT_SAMPLE, add_dataset_arguments, build_dataset, chat_template_len,
                                    ordinary_token_ids)


def args(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_dataset_arguments(parser)
    return parser.parse_args(list(flags))


def test_random_is_seeded_and_within_vllms_ranges(tokenizer) -> None:
    flags = ["--num-prompts", "40", "--random-input-len", "40", "--random-output-len", "10",
             "--random-range-ratio", "0.5"]
    a, b = build_dataset(args(*flags), tokenizer), build_dataset(args(*flags), tokenizer)
    other = build_dataset(args(*flags, "--seed", "1"), tokenizer)
    assert a == b and a != other
    assert all(20 <= r.prompt_len <= 60 and 5 <= r.output_len <= 15 for r in a)
    assert len({r.prompt_len for r in a}) > 5  # the range is used, not one length
    assert all(len(r.prompt) == r.prompt_len for r in a)
    special = set(tokenizer.added_tokens_decoder)
    assert not any(t in special for r in a for t in r.prompt)


def test_random_without_a_range_has_exact_lengths(tokenizer) -> None:
    requests = build_dataset(args("--num-prompts", "5", "--random-input-len", "7", "--random-output-len", "3"),
                             tokenizer)
    assert [(r.prompt_len, r.output_len) for r in requests] == [(7, 3)] * 5


def test_ordinary_ids_leave_out_added_tokens(tokenizer) -> None:
    ids = ordinary_token_ids(tokenizer)
    assert len(ids) == len(tokenizer) - len(tokenizer.added_tokens_decoder)
    assert ordinary_token_ids(tokenizer, vocab_size=100) == [i for i in ids if i < 100]


def test_prefix_groups_share_their_system_prompt_and_arrive_together(tokenizer) -> None:
    flags = ["--dataset-name", "prefix", "--prefix-num-groups", "3", "--prefix-group-size", "4", "--prefix-len", "50",
             "--suffix-len", "6", "--random-output-len", "9"]
    requests = build_dataset(args(*flags), tokenizer)
    assert requests == build_dataset(args(*flags), tokenizer)
    assert [r.group for r in requests] == [0] * 4 + [1] * 4 + [2] * 4
    assert all(len(r.prompt) == r.prompt_len == 56 and r.output_len == 9 for r in requests)
    for group in range(3):
        members = [r.prompt for r in requests if r.group == group]
        assert len({tuple(p[:50]) for p in members}) == 1 and len({tuple(p[50:]) for p in members}) == 4
    assert requests[0].prompt[:50] != requests[4].prompt[:50]


def test_shuffled_prefix_groups_are_the_same_requests_in_a_seeded_order(tokenizer) -> None:
    flags = ["--dataset-name", "prefix", "--prefix-num-groups", "3", "--prefix-group-size", "4", "--prefix-len", "50",
             "--suffix-len", "6"]
    grouped = build_dataset(args(*flags), tokenizer)
    shuffled = build_dataset(args(*flags, "--prefix-order", "shuffled"), tokenizer)
    assert shuffled == build_dataset(args(*flags, "--prefix-order", "shuffled"), tokenizer)
    assert [r.group for r in shuffled] != [r.group for r in grouped]
    assert sorted(map(tuple, (r.prompt for r in shuffled))) == sorted(map(tuple, (r.prompt for r in grouped)))


def test_multiturn_turns_resend_the_history_in_order(tokenizer) -> None:
    flags = ["--dataset-name", "multiturn", "--num-conversations", "3", "--num-turns", "4", "--first-turn-len", "60",
             "--turn-len", "10", "--random-output-len", "8"]
    requests = build_dataset(args(*flags), tokenizer)
    assert requests == build_dataset(args(*flags), tokenizer)
    assert [(r.group, r.turn) for r in requests] == [(c, t) for c in range(3) for t in range(4)]
    first, last = requests[0], requests[3]
    assert [m["role"] for m in last.messages] == ["user", "assistant"] * 3 + ["user"]
    assert last.messages[:1] == first.messages  # later turns resend the first message
    def num_tokens(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    assert num_tokens(first.messages[0]["content"]) == pytest.approx(60, abs=3)
    assert num_tokens(last.messages[-1]["content"]) == pytest.approx(10, abs=2)
    assert num_tokens(last.messages[1]["content"]) == pytest.approx(8, abs=2)  # a scripted answer
    assert last.prompt_len > 60 + 3 * 10 + 3 * 8 - 10 and last.prompt.startswith(first.prompt[:20])
    assert all(r.output_len == 8 for r in requests)


def test_long_prompts_fill_the_context_but_the_output(tokenizer) -> None:
    requests = build_dataset(args("--dataset-name", "long", "--num-prompts", "2", "--random-output-len", "16"),
                             tokenizer, max_model_len=200)
    assert [(r.prompt_len, len(r.prompt), r.output_len) for r in requests] == [(184, 184, 16)] * 2
    explicit = build_dataset(args("--dataset-name", "long", "--num-prompts", "1", "--long-prompt-len", "90"),
                             tokenizer)
    assert explicit[0].prompt_len == 90
    with pytest.raises(ValueError, match="--long-prompt-len"):
        build_dataset(args("--dataset-name", "long"), tokenizer)


def test_chat_prompts_are_texts_of_the_lengths_drawn_for_ids(tokenizer) -> None:
    """The chat endpoint takes no ids: its prompts are texts that tokenize to the lengths the id workload draws
    for the same seed (decoded random ids would come back longer)."""
    def num_tokens(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    flags = ["--num-prompts", "30", "--random-input-len", "60", "--random-range-ratio", "0.5"]
    ids, texts = build_dataset(args(*flags), tokenizer), build_dataset(args(*flags), tokenizer, chat=True)
    assert texts == build_dataset(args(*flags), tokenizer, chat=True)
    assert [(r.prompt_len, r.output_len) for r in texts] == [(r.prompt_len, r.output_len) for r in ids]
    assert all(isinstance(r.prompt, str) and num_tokens(r.prompt) == r.prompt_len for r in texts)
    prefix = build_dataset(args("--dataset-name", "prefix", "--prefix-num-groups", "2", "--prefix-group-size", "3",
                                "--prefix-len", "50", "--suffix-len", "6"), tokenizer, chat=True)
    assert all(abs(num_tokens(r.prompt) - 56) <= 1 and r.prompt_len == 56 for r in prefix)  # 1: the join
    shared = os.path.commonprefix([r.prompt for r in prefix if r.group == 0])
    assert num_tokens(shared) >= 49 and prefix[3].prompt[:len(shared)] != shared  # group 1: a prefix of its own


def test_long_on_chat_leaves_room_for_the_template(tokenizer) -> None:
    requests = build_dataset(args("--dataset-name", "long", "--num-prompts", "2", "--random-output-len", "16"),
                             tokenizer, max_model_len=200, chat=True)
    template_len = chat_template_len(tokenizer)
    assert template_len > 0 and all(r.prompt_len == 200 - 16 - template_len for r in requests)
    for r in requests:
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": r.prompt}], tokenize=False,
                                                 add_generation_prompt=True)
        assert len(tokenizer.encode(rendered, add_special_tokens=False)) + 16 <= 200
    with pytest.raises(ValueError, match="and the chat template's"):
        build_dataset(args("--dataset-name", "long", "--random-output-len", "16"), tokenizer,
                      max_model_len=16 + template_len, chat=True)


def test_grounded_prompts_hold_what_their_answers_quote(tokenizer) -> None:
    flags = ["--dataset-name", "grounded", "--num-prompts", "6", "--random-input-len", "200",
             "--random-output-len", "50"]
    requests = build_dataset(args(*flags), tokenizer)
    assert requests == build_dataset(args(*flags), tokenizer) != build_dataset(args(*flags, "--seed", "2"), tokenizer)
    assert all(r.prompt_len >= 200 and r.output_len == 50 for r in requests)
    assert all(r.prompt_len == len(tokenizer.encode(r.prompt, add_special_tokens=False)) for r in requests)
    code, summary, extraction = requests[:3]
    renamed = code.prompt.split("`")[1]
    assert f"def {renamed}(" in code.prompt  # the function to rename is in the file
    assert "word for word" in summary.prompt and "- id 1000:" in extraction.prompt
    # the chat turn the prompt templates, for a chat endpoint to template once
    assert [m["role"] for m in code.messages] == ["user"] and code.messages[0]["content"] in code.prompt
    assert code.prompt == tokenizer.apply_chat_template(code.messages, tokenize=False, add_generation_prompt=True)


def test_a_dataset_file_is_read_as_utf8_whatever_the_locale(tmp_path: Path) -> None:
    """Read in the locale's encoding, one seeded workload was another under Latin-1 (80 prompt tokens, not 62)
    and a codec error naming no file under ASCII."""
    import subprocess
    import sys

    dataset = tmp_path / "sharegpt.json"
    dataset.write_text(json.dumps([{"conversations": [{"from": "human", "value": "Größe von İstanbul, 東京?"},
                                                      {"from": "gpt", "value": "Groß. 🙂"}]}], ensure_ascii=False),
                       encoding="utf-8")
    read = ("import sys; from kvserve.bench.datasets import _sharegpt_pairs; "
            "print(ascii(_sharegpt_pairs(sys.argv[1])))")
    ascii_locale = {**os.environ, "LC_ALL": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"}
    result = subprocess.run([sys.executable, "-c", read, str(dataset)], env=ascii_locale, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ascii([("Größe von İstanbul, 東京?", "Groß. 🙂")])


def test_sharegpt_takes_first_turns_and_reply_lengths_filtered_like_vllm(tokenizer) -> None:
    flags = ["--dataset-name", "sharegpt", "--dataset-path", str(SHAREGPT_SAMPLE), "--num-prompts", "20"]
    requests = build_dataset(args(*flags), tokenizer)
    assert requests == build_dataset(args(*flags), tokenizer)
    assert requests != build_dataset(args(*flags, "--seed", "3"), tokenizer)
    data = json.loads(SHAREGPT_SAMPLE.read_text())
    replies = {c["conversations"][0]["value"]: c["conversations"][1]["value"] for c in data
               if len(c["conversations"]) >= 2}
    for r in requests:
        assert r.output_len == len(tokenizer.encode(replies[r.prompt], add_special_tokens=False))
        assert r.prompt_len == len(tokenizer.encode(r.prompt, add_special_tokens=False))
        assert r.prompt_len >= 4 and r.output_len >= 4 and r.prompt_len <= 1024
    fixed = build_dataset(args(*flags, "--sharegpt-output-len", "12"), tokenizer)
    assert {r.output_len for r in fixed} == {12}
    # as in vLLM, the minimum length is the replies' alone: a fixed length under it is asked for, not filtered
    assert {r.output_len for r in build_dataset(args(*flags, "--sharegpt-output-len", "2"), tokenizer)} == {2}


@pytest.mark.parametrize("flags, named", [
    (["--dataset-name", "prefix", "--num-prompts", "50"], "--num-prompts is read by --dataset-name random / "
                                                          "sharegpt / long / grounded only, not prefix"),
    (["--dataset-name", "random", "--prefix-len", "4096"], "--prefix-len"),
    (["--dataset-name", "multiturn", "--random-range-ratio", "0.9"], "--random-range-ratio"),
    (["--dataset-name", "long", "--random-input-len", "100"], "--random-input-len"),
    (["--dataset-name", "grounded", "--num-turns", "2"], "--num-turns"),
])
def test_a_flag_the_workload_would_ignore_is_refused_by_name(tokenizer, flags: list[str], named: str) -> None:
    with pytest.raises(ValueError, match=re.escape(named)):
        build_dataset(args(*flags), tokenizer)


def test_sharegpt_errors_name_the_problem(tokenizer, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--dataset-path"):
        build_dataset(args("--dataset-name", "sharegpt"), tokenizer)
    with pytest.raises(ValueError, match="pass the length filter"):  # 48 usable pairs in the sample
        build_dataset(args("--dataset-name", "sharegpt", "--dataset-path", str(SHAREGPT_SAMPLE),
                           "--num-prompts", "1000"), tokenizer)
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(ValueError, match="not JSON"):
        build_dataset(args("--dataset-name", "sharegpt", "--dataset-path", str(broken)), tokenizer)


@pytest.mark.parametrize("flags, message", [
    (["--num-prompts", "0"], "--num-prompts"),
    (["--random-range-ratio", "1.0"], "--random-range-ratio"),
    (["--dataset-name", "prefix", "--prefix-len", "0"], "--prefix-len"),
    (["--dataset-name", "sharegpt", "--sharegpt-output-len", "0"], "--sharegpt-output-len must be at least 1, got 0"),
    (["--dataset-name", "sharegpt", "--sharegpt-output-len", "-3"], "--sharegpt-output-len must be at least 1"),
    (["--dataset-name", "long", "--long-prompt-len", "0"], "--long-prompt-len must be at least 1, got 0"),
])
def test_bad_lengths_name_their_flag(tokenizer, flags: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_dataset(args(*flags), tokenizer)


@pytest.mark.parametrize("content, message", [
    ("[1, 2]", "entry 0 is not a {'conversations'"),
    ('[{"conversations": [{"from": "human"}, {"from": "gpt"}]}]', "entry 0 is not a {'conversations'"),
    ('[{"conversations": [{"value": "hi"}, {"value": "yo"}]}, {"conversations": "text"}]', "entry 1 is not"),
    ("[]", "no conversation of"),
])
def test_a_malformed_or_empty_sharegpt_file_is_named(tokenizer, tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "sharegpt.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=re.escape(message)) as error:
        build_dataset(args("--dataset-name", "sharegpt", "--dataset-path", str(path)), tokenizer)
    assert str(path) in str(error.value) and "--num-prompts 0" not in str(error.value)


def test_a_dataset_path_for_another_workload_is_refused(tokenizer) -> None:
    with pytest.raises(ValueError, match="--dataset-path is read by --dataset-name sharegpt only"):
        build_dataset(args("--dataset-path", str(SHAREGPT_SAMPLE)), tokenizer)
