"""StopStringMatcher: a sample's stop strings found as its text grows, in time linear in the text.

Each stop string has a Knuth-Morris-Pratt automaton whose state is how many of its leading characters the
text's end matches. Fed a piece of new text, it says where a stop string first ends in it; between pieces,
its largest state is the end of the text to hold back, since it may still become a stop string. Searching
the text's end anew at each token cost up to the square of a stop string's length a token where the text
repeats its first character (a few milliseconds a token for a 1,024-character stop string).
"""

from __future__ import annotations

import functools
from typing import Sequence


@functools.lru_cache(maxsize=1024)
def _borders(stop: str) -> tuple[int, ...]:
    """For each ``i``, the length of the longest proper prefix of ``stop[:i + 1]`` that is also its suffix
    (the prefix function): where the automaton falls back to when the next character does not match."""
    borders = [0] * len(stop)
    matched = 0
    for i in range(1, len(stop)):
        while matched and stop[i] != stop[matched]:
            matched = borders[matched - 1]
        if stop[i] == stop[matched]:
            matched += 1
        borders[i] = matched
    return tuple(borders)


class StopStringMatcher:
    """The stop strings of one sample, fed its text piece by piece."""

    def __init__(self, stop_strings: Sequence[str]) -> None:
        self._stops = tuple(stop_strings)
        self._borders = [_borders(stop) for stop in self._stops]
        self._matched = [0] * len(self._stops)  # per stop string: its leading characters the text ends with
        self._num_fed_chars = 0

    def feed(self, text: str, report: bool = True) -> tuple[int, str] | None:
        """Take ``text``, the next piece of the sample's text. Return the stop string that starts first of
        those that end in it, as (its start in the whole text, the stop string), on a tie the one listed first;
        None if none ends in it or ``report`` is false (stop strings are not looked for yet, but text fed
        now can still be the start of one that ends later)."""
        found: tuple[int, str] | None = None
        for i, (stop, borders) in enumerate(zip(self._stops, self._borders)):
            matched, end = self._advance(stop, borders, self._matched[i], text, report)
            self._matched[i] = matched
            if end is not None:
                start = self._num_fed_chars + end + 1 - len(stop)
                if found is None or start < found[0]:
                    found = (start, stop)
        self._num_fed_chars += len(text)
        return found

    @property
    def partial_length(self) -> int:
        """The length of the longest end of the text fed that is the start of a stop string, but not all of it
        (after a piece in which ``feed`` found none)."""
        return max(self._matched, default=0)

    @staticmethod
    def _advance(
        stop: str, borders: tuple[int, ...], matched: int, text: str, report: bool,
    ) -> tuple[int, int | None]:
        """One automaton over ``text``: its new state, and where in ``text`` its stop string first ends (None
        if nowhere, or if not ``report``: then a whole match falls back and the scan goes on)."""
        for offset, char in enumerate(text):
            while matched and stop[matched] != char:
                matched = borders[matched - 1]
            if stop[matched] == char:
                matched += 1
                if matched == len(stop):
                    if report:
                        return matched, offset
                    matched = borders[matched - 1]
        return matched, None
