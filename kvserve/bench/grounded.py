"""The ``grounded`` workload: prompts whose answers quote them, the case speculation by prompt lookup is for.

Each request is a chat turn holding a document and a task whose answer copies from it, cycling through three
kinds: edit a Python module (rename a function and print the whole file again), summarise a report quoting its
key sentences word for word, and extract the records of a list that match a condition, copied exactly. The
documents are put together from seeded templates and vocabularies until they reach about
``--random-input-len`` tokens, so the same flags and seed give the same text to every engine.
"""

from __future__ import annotations

import random
from typing import Callable

from transformers import PreTrainedTokenizerBase

NOUNS = ("order", "invoice", "sensor", "reading", "account", "shipment", "report", "ticket", "batch", "record")
VERBS = ("load", "parse", "check", "merge", "update", "compute", "format", "collect", "filter", "store")
PLACES = ("Oslo", "Lyon", "Porto", "Graz", "Turku", "Malmo", "Ghent", "Bergen")
PEOPLE = ("Ada", "Bruno", "Chen", "Dalia", "Emil", "Farah", "Goran", "Hana", "Ivo", "Jana")
SENTENCES = (
    "The {noun} team in {place} finished the quarter with {n} open items, down from {m} in spring.",
    "{person} noted that every {noun} older than {n} days is now checked twice before it is closed.",
    "Costs for the {noun} service rose by {n} percent, mostly because of the move to {place}.",
    "A review of {m} cases found that {n} of them had been filed under the wrong {noun}.",
    "From next month, {person} will lead the {noun} work in {place} and report every {n} weeks.",
)


def grounded_messages(rng: random.Random, index: int, tokenizer: PreTrainedTokenizerBase,
                      target_len: int) -> list[dict[str, str]]:
    """The chat of request ``index``: its kind by turn, its document of about ``target_len`` tokens."""
    kind = (_code_task, _summary_task, _extraction_task)[index % 3]
    return [{"role": "user", "content": kind(rng, lambda text: _fits(tokenizer, text, target_len))}]


def _fits(tokenizer: PreTrainedTokenizerBase, text: str, target_len: int) -> bool:
    return len(tokenizer.encode(text, add_special_tokens=False)) >= target_len


def _grow(rng: random.Random, make: Callable[[random.Random, int], str], long_enough: Callable[[str], bool],
          ) -> list[str]:
    parts: list[str] = []
    while not long_enough("\n".join(parts)):
        parts.append(make(rng, len(parts)))
    return parts


def _function(rng: random.Random, i: int) -> str:
    verb, noun = rng.choice(VERBS), rng.choice(NOUNS)
    limit = rng.randint(2, 99)
    return (f"def {verb}_{noun}_{i}(items, limit={limit}):\n"
            f"    \"\"\"{verb.capitalize()} each {noun} up to the limit.\"\"\"\n"
            f"    result = []\n"
            f"    for item in items[:limit]:\n"
            f"        if item.get(\"{noun}\") is not None:\n"
            f"            result.append(item[\"{noun}\"])\n"
            f"    return result\n")


def _code_task(rng: random.Random, long_enough: Callable[[str], bool]) -> str:
    functions = _grow(rng, _function, long_enough)
    old = functions[rng.randrange(len(functions))].split("(")[0].removeprefix("def ")
    return (f"Rename the function `{old}` to `{old}_v2` and print the whole file again, unchanged otherwise.\n\n"
            "```python\n" + "\n".join(functions) + "```")


def _sentence(rng: random.Random, i: int) -> str:
    return rng.choice(SENTENCES).format(noun=rng.choice(NOUNS), place=rng.choice(PLACES), person=rng.choice(PEOPLE),
                                        n=rng.randint(2, 40), m=rng.randint(41, 400))


def _summary_task(rng: random.Random, long_enough: Callable[[str], bool]) -> str:
    report = " ".join(_grow(rng, _sentence, long_enough))
    return f"Summarise this report, quoting its most important sentences word for word.\n\n{report}"


def _record(rng: random.Random, i: int) -> str:
    return (f"- id {1000 + i}: {rng.choice(PEOPLE)}, {rng.choice(PLACES)}, {rng.choice(NOUNS)} "
            f"{rng.randint(10, 99)}-{rng.randint(100, 999)}")


def _extraction_task(rng: random.Random, long_enough: Callable[[str], bool]) -> str:
    records = _grow(rng, _record, long_enough)
    return (f"Copy, exactly as written, every record below whose city is {rng.choice(PLACES)}.\n\n"
            + "\n".join(records))
