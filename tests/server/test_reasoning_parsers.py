"""The reasoning parsers: thinking split from the answer, whole and in every way a stream can cut the text."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.server.reasoning_parsers import (
    ReasoningDelta,
    ReasoningSplitter,
    split_reasoning,
    starts_in_reasoning,
)


@pytest.mark.parametrize("text, in_reasoning, reasoning, content", [
    ("<think>Let me see.</think>Paris.", True, "Let me see.", "Paris."),
    ("Let me see.</think>Paris.", True, "Let me see.", "Paris."),  # R1: the <think> is the prompt's
    ("<think>\nhm\n</think>\n\nParis.", True, "\nhm\n", "\n\nParis."),
    ("<think>cut short by max_tokens", True, "cut short by max_tokens", ""),
    ("no tags at all", True, "no tags at all", ""),
    ("no tags at all", False, "", "no tags at all"),
    ("</think>", True, "", ""),
    ("a</think>b</think>c<think>d", True, "a", "b</think>c<think>d"),  # the answer is kept verbatim
    ("x<think>y</think>z", True, "xy", "z"),
    ("ends in a partial tag </thi", True, "ends in a partial tag </thi", ""),
    ("<think>a < b and c </ d</think>ok", True, "a < b and c </ d", "ok"),
    ("<think>a</think>b", False, "", "<think>a</think>b"),
])
def test_a_whole_text_splits_into_thinking_and_answer(text: str, in_reasoning: bool, reasoning: str,
                                                      content: str) -> None:
    assert split_reasoning(text, in_reasoning) == ReasoningDelta(reasoning, content)


def _streamed(pieces: list[str], in_reasoning: bool) -> tuple[list[ReasoningDelta], ReasoningDelta]:
    splitter = ReasoningSplitter(in_reasoning)
    deltas = [splitter.feed(piece) for piece in pieces] + [splitter.finish()]
    total = ReasoningDelta()
    for delta in deltas:
        total += delta
    return deltas, total


_TEXTS = st.lists(st.sampled_from(["<think>", "</think>", "<", "</", "<th", "think", ">", "/", "a", " ", "\n",
                                   "é", "</thin", "k>"]), max_size=12).map("".join)


@settings(max_examples=300, deadline=None)
@given(text=_TEXTS, cuts=st.lists(st.integers(min_value=0, max_value=60), max_size=8), in_reasoning=st.booleans())
def test_every_way_of_streaming_a_text_adds_up_to_its_whole_split(text: str, cuts: list[int],
                                                                  in_reasoning: bool) -> None:
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    deltas, total = _streamed(pieces, in_reasoning)
    assert total == split_reasoning(text, in_reasoning)
    # once the answer started, no later delta holds thinking
    answered = [i for i, d in enumerate(deltas) if d.content]
    assert not answered or not any(d.reasoning for d in deltas[answered[0] + 1:])


def test_a_tag_split_over_pieces_is_held_back_until_it_is_told() -> None:
    splitter = ReasoningSplitter(True)
    assert splitter.feed("<thi") == ReasoningDelta()
    assert splitter.feed("nk>why") == ReasoningDelta(reasoning="why")
    assert splitter.feed(" so</") == ReasoningDelta(reasoning=" so")
    assert splitter.feed("thi") == ReasoningDelta()
    assert splitter.feed("nk>Because") == ReasoningDelta(content="Because")
    assert splitter.feed("</think>") == ReasoningDelta(content="</think>")


def test_a_piece_that_straddles_the_end_splits_there() -> None:
    assert ReasoningSplitter(True).feed("so.</think>Paris") == ReasoningDelta("so.", "Paris")


@pytest.mark.parametrize("parser, prompt, kwargs, expected", [
    ("qwen3", "<|im_start|>assistant\n", None, True),  # Qwen3's thinking template: the model opens it
    ("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n", {"enable_thinking": False}, False),
    ("qwen3", "<|im_start|>assistant\n", {"enable_thinking": False}, False),
    ("qwen3", "<|im_start|>assistant\n", {"enable_thinking": True}, True),
    ("qwen3", "<|im_start|>assistant\n<think>\n", None, True),  # Qwen3.5's template opens it
    ("deepseek_r1", "<｜Assistant｜><think>\n", None, True),
    ("deepseek_r1", "<｜Assistant｜>", {"enable_thinking": False}, True),  # R1 reads no such switch
    ("deepseek_r1", "<｜Assistant｜><think>\n\n</think>\n\n", None, False),
    # an earlier turn's think block says nothing of this one
    ("qwen3", "<think>a</think>b<|im_end|>\n<|im_start|>assistant\n", None, True),
])
def test_where_the_output_starts_follows_the_prompts_end_and_the_parser(parser: str, prompt: str, kwargs,
                                                                         expected: bool) -> None:
    assert starts_in_reasoning(parser, prompt, kwargs) is expected


@pytest.mark.parametrize("prefill, expected", [
    ("<think>\nshort.</think>\n\nThe capital is", False),  # the block closed: the answer goes on
    ("<think>\nlet me see, ", True),  # the block open: the thinking goes on
    ("<think>a</think> b <think>again", True),
    # Qwen3's template writes an empty block before the final assistant turn's text: the answer goes on
    ("<think>\n\n</think>\n\nThe capital is", False),
    ("The capital is", True),  # no tag at all: the parser decides, as for a generation prompt
])
def test_a_continued_final_message_starts_where_the_prompts_last_tag_leaves_it(prefill: str, expected: bool) -> None:
    """A prefill that ends the prompt has no tag at its very end: its block (or the template's), closed or open,
    decides."""
    prompt = f"<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n{prefill}"
    assert starts_in_reasoning("qwen3", prompt, None, continues_final_message=True) is expected
    if prefill.rstrip().endswith(("</think>", "<think>")) is False and expected is False:
        assert starts_in_reasoning("qwen3", prompt, None) is True  # a generation prompt's rule would miss it
