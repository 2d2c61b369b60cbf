"""Reasoning outputs (``kvserve serve --reasoning-parser qwen3|deepseek_r1``, vLLM's): a chat answer's thinking,
written between ``<think>`` and ``</think>``, split from its answer, whole or as it streams.

Both parsers read the same tags; they differ, as vLLM's do, in where an output without them starts:

- where the prompt ends with ``</think>`` (Qwen3's template with ``enable_thinking: false`` renders an empty
  think block), the thinking is over and the whole output is the answer; where it ends with ``<think>``
  (DeepSeek R1's and Qwen3.5's templates open the block), the output starts inside it;
- otherwise ``deepseek_r1`` takes the output to start in its thinking (R1 may leave out the ``<think>``), and so
  does ``qwen3``, unless the request's ``chat_template_kwargs`` turned ``enable_thinking`` off: then all of it is
  the answer.

Inside the thinking a ``<think>`` is dropped and the first ``</think>`` ends it; what follows is the answer,
verbatim (a later tag included, as vLLM leaves it). An output that never closes its thinking (cut by
``max_tokens``) is all thinking. The tags are matched in the text, so a tag the tokenizer spells in several tokens
is found across them; a tag that is one special token is kept in the text for it (``dropped_by_decoding``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

THINK_START, THINK_END = "<think>", "</think>"
REASONING_PARSERS = ("qwen3", "deepseek_r1")


@dataclass
class ReasoningDelta:
    """A piece of one sample's text, as thinking and answer."""

    reasoning: str = ""
    content: str = ""

    def __add__(self, other: ReasoningDelta) -> ReasoningDelta:
        return ReasoningDelta(self.reasoning + other.reasoning, self.content + other.content)


class ReasoningSplitter:
    """One sample's text, fed as it streams, split into thinking and answer. Inside the thinking, text that may be
    the start of a tag is held back until the next piece tells (``finish`` gives it back as thinking)."""

    def __init__(self, in_reasoning: bool) -> None:
        self.in_reasoning = in_reasoning
        self._held = ""

    def feed(self, text: str) -> ReasoningDelta:
        if not self.in_reasoning:
            return ReasoningDelta(content=text)
        text, self._held = self._held + text, ""
        reasoning = []
        while True:
            start, end = text.find(THINK_START), text.find(THINK_END)
            if end != -1 and (start == -1 or end < start):
                self.in_reasoning = False
                reasoning.append(text[:end])
                return ReasoningDelta("".join(reasoning), text[end + len(THINK_END):])
            if start == -1:
                break
            reasoning.append(text[:start])
            text = text[start + len(THINK_START):]
        kept = len(text) - _partial_tag_length(text)
        self._held = text[kept:]
        reasoning.append(text[:kept])
        return ReasoningDelta(reasoning="".join(reasoning))

    def finish(self) -> ReasoningDelta:
        """What is still held back: the sample ended, so it was no tag."""
        held, self._held = self._held, ""
        return ReasoningDelta(reasoning=held)


def _partial_tag_length(text: str) -> int:
    """The length of the longest end of ``text`` that a tag starts with (and that is not the whole tag)."""
    for length in range(min(len(text), len(THINK_END) - 1), 0, -1):
        tail = text[-length:]
        if THINK_START.startswith(tail) or THINK_END.startswith(tail):
            return length
    return 0


def split_reasoning(text: str, in_reasoning: bool) -> ReasoningDelta:
    """A whole sample's text as thinking and answer: what its streamed pieces add up to."""
    splitter = ReasoningSplitter(in_reasoning)
    return splitter.feed(text) + splitter.finish()


def starts_in_reasoning(parser: str, prompt: str, template_kwargs: dict[str, Any] | None,
                        continues_final_message: bool = False) -> bool:
    """Whether the output of ``prompt`` (as the chat template rendered it) starts inside the thinking. A request
    that continues its final message goes on from the prompt's last tag (a block closed, by the message or by the
    template before it, as Qwen3's writes an empty one: the answer; one opened: the thinking). Otherwise only a
    tag that ends the prompt counts: an earlier turn's think block (a tool conversation's) says nothing of the
    turn the generation prompt opens."""
    if continues_final_message:
        last_start, last_end = prompt.rfind(THINK_START), prompt.rfind(THINK_END)
        if last_start != last_end:  # not both -1: a tag is there
            return last_start > last_end
    ending = prompt.rstrip()
    if ending.endswith(THINK_END):
        return False
    if ending.endswith(THINK_START):
        return True
    return not (parser == "qwen3" and (template_kwargs or {}).get("enable_thinking") is False)
