"""PrefixIndex: chained chunk keys stand for whole prefixes; eviction and forgetting a refused request keep that
true; a long prompt is keyed by its leading chunks only."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.router.prefix_index import CHUNK_CHARS, MAX_KEYED_CHARS, PrefixIndex, prefix_keys


def test_keys_are_chained_over_whole_chunks() -> None:
    text = "a" * CHUNK_CHARS * 3 + "tail"
    keys = prefix_keys(text)
    assert len(keys) == 3 and len(set(keys)) == 3  # equal chunks, different prefixes
    assert prefix_keys(text[: CHUNK_CHARS * 2]) == keys[:2]
    assert prefix_keys("b" + text[1:])[0] != keys[0] and prefix_keys("short") == []


def test_a_long_text_is_keyed_by_its_leading_chunks_only() -> None:
    text = "ab" * MAX_KEYED_CHARS
    keys = prefix_keys(text)
    assert len(keys) == 2048 and keys == prefix_keys(text[:MAX_KEYED_CHARS])


def test_a_lone_surrogate_is_keyed_not_raised_on() -> None:
    """A replica refuses such text with a 400; the router's keying raised UnicodeEncodeError (a 500)."""
    keys = prefix_keys("\ud800" * CHUNK_CHARS)
    assert len(keys) == 1 and keys != prefix_keys("\udfff" * CHUNK_CHARS)


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


def test_forgetting_an_insert_drops_the_keys_it_added_that_no_insert_touched_since() -> None:
    shared, refused, later = "s" * CHUNK_CHARS * 2, "r" * CHUNK_CHARS * 2, "l" * CHUNK_CHARS
    index = PrefixIndex()
    index.insert(prefix_keys(shared))
    insertion = index.insert(prefix_keys(shared + refused))
    index.insert(prefix_keys(shared + refused[:CHUNK_CHARS] + later))  # a request sent meanwhile shares a chunk
    index.forget(insertion)
    assert index.match(prefix_keys(shared + refused)) == 3 and len(index) == 4  # the shared 2, r, l


# prompts of two kinds of chunk, so that many share prefixes
CHUNKED_PROMPTS = st.lists(st.sampled_from(["a" * CHUNK_CHARS, "b" * CHUNK_CHARS]), min_size=1, max_size=6).map("".join)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(CHUNKED_PROMPTS, st.booleans()), min_size=1, max_size=12),
       st.integers(min_value=1, max_value=20))
def test_after_forgetting_a_present_key_still_implies_its_prefix(steps: list[tuple[str, bool]],
                                                                 max_keys: int) -> None:
    """Some requests refused, each forgotten after the next request's insert (answers come in any order)."""
    index, refused = PrefixIndex(max_keys=max_keys), []
    for prompt, is_refused in steps:
        insertion = index.insert(prefix_keys(prompt))
        while refused:
            index.forget(refused.pop())
        if is_refused:
            refused.append(insertion)
    for prompt, _ in steps:
        present = [key in index._keys for key in prefix_keys(prompt)]
        assert present == sorted(present, reverse=True)
