"""PrefixIndex: chained chunk keys stand for whole prefixes; eviction keeps that true."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.router.prefix_index import CHUNK_CHARS, PrefixIndex, prefix_keys


def test_keys_are_chained_over_whole_chunks() -> None:
    text = "a" * CHUNK_CHARS * 3 + "tail"
    keys = prefix_keys(text)
    assert len(keys) == 3 and len(set(keys)) == 3  # equal chunks, different prefixes
    assert prefix_keys(text[: CHUNK_CHARS * 2]) == keys[:2]
    assert prefix_keys("b" + text[1:])[0] != keys[0] and prefix_keys("short") == []


def test_match_counts_the_leading_keys_sent() -> None:
    index = PrefixIndex()
    shared = "s" * CHUNK_CHARS * 2
    index.insert(prefix_keys(shared + "x" * CHUNK_CHARS))
    assert index.match(prefix_keys(shared + "y" * CHUNK_CHARS)) == 2
    assert index.match(prefix_keys("z" * CHUNK_CHARS * 4)) == 0
    assert index.match([]) == 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.text(alphabet="ab", min_size=CHUNK_CHARS, max_size=CHUNK_CHARS * 6), min_size=1, max_size=12),
       st.integers(min_value=1, max_value=10))
def test_after_eviction_a_present_key_still_implies_its_prefix(prompts: list[str], max_keys: int) -> None:
    index = PrefixIndex(max_keys=max_keys)
    for prompt in prompts:
        index.insert(prefix_keys(prompt))
        assert len(index) <= max_keys
    for prompt in prompts:
        keys = prefix_keys(prompt)
        present = [key in index._keys for key in keys]
        assert present == sorted(present, reverse=True)  # a run of present keys, then absent ones
        assert index.match(keys) == sum(present)
