"""StopStringMatcher against the definitions, fed its text in pieces."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.engine.stop_strings import StopStringMatcher


def _first_stop_by_search(text: str, num_checked_chars: int, stops: list[str]) -> tuple[int, str] | None:
    """The definition: of the stop strings ending after ``num_checked_chars``, the one that starts first, on a
    tie the one listed first."""
    found = [(text.find(stop, max(0, num_checked_chars - len(stop) + 1)), i, stop) for i, stop in enumerate(stops)]
    found = [(position, i, stop) for position, i, stop in found if position != -1]
    return min(found)[0::2] if found else None


def _partial_length_by_every_length(text: str, stops: list[str]) -> int:
    """The definition: the longest end of ``text`` that starts a stop string, every length tried."""
    return max((n for stop in stops for n in range(1, min(len(stop) - 1, len(text)) + 1)
                if text.endswith(stop[:n])), default=0)


def test_examples() -> None:
    matcher = StopStringMatcher(["world", "xyz"])
    assert matcher.feed("hello wo") is None
    assert matcher.partial_length == 2
    assert matcher.feed("rld and xyz") == (6, "world")  # its start in the whole text

    assert StopStringMatcher(["world", "orl"]).feed("a world") == (2, "world")  # the one that starts first
    assert StopStringMatcher(["o w", "rld"]).feed("hello world") == (4, "o w")
    matcher = StopStringMatcher(["abx", "aabx"])
    assert matcher.feed("aab") is None and matcher.partial_length == 3


def test_a_stop_string_fed_before_it_is_reported_does_not_count_later() -> None:
    matcher = StopStringMatcher(["abc"])
    assert matcher.feed("abcab", report=False) is None  # min_tokens not reached: nothing reported
    assert matcher.partial_length == 2  # but what it saw may still start one
    assert matcher.feed("c") == (3, "abc")


@settings(max_examples=400, deadline=None)
@given(
    st.lists(st.text("ab", max_size=6), min_size=1, max_size=6),
    st.lists(st.text("ab", min_size=1, max_size=6), min_size=1, max_size=3),
    st.integers(0, 6),
)
def test_pieces_agree_with_the_definitions(pieces: list[str], stops: list[str], num_unreported: int) -> None:
    matcher = StopStringMatcher(stops)
    text = ""
    for i, piece in enumerate(pieces):
        report = i >= num_unreported
        found = matcher.feed(piece, report=report)
        expected = _first_stop_by_search(text + piece, len(text), stops) if report else None
        assert found == expected
        text += piece
        if found is not None:
            break
        assert matcher.partial_length == _partial_length_by_every_length(text, stops)

