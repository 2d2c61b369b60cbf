"""``ListPrefix``: a list that is only appended to, read as it was when the view was made, without copying it."""

from __future__ import annotations

import itertools
from typing import Iterator, Sequence, TypeVar, overload

T = TypeVar("T")


class ListPrefix(Sequence[T]):
    """The first ``len(items)`` items of ``items`` (as many as it had when the view was made), for a list that
    only grows at its end: an unfinished request's outputs are snapshotted at every step, and copying all of them
    each time makes a generation's host work grow with the square of its length. Slices are lists; a view equals
    a list (or a view) holding the same items."""

    __slots__ = ("_items", "_length")

    def __init__(self, items: list[T]) -> None:
        self._items, self._length = items, len(items)

    def __len__(self) -> int:
        return self._length

    def __iter__(self) -> Iterator[T]:
        return itertools.islice(self._items, self._length)

    @overload
    def __getitem__(self, index: int) -> T: ...
    @overload
    def __getitem__(self, index: slice) -> list[T]: ...

    def __getitem__(self, index: int | slice) -> T | list[T]:
        if isinstance(index, slice):
            start, stop, step = index.indices(self._length)
            # bounds of a forward slice are in 0..length; a backward one's stop may be -1, "the end" to a list
            return self._items[start:stop:step] if step > 0 else list(self)[index]
        position = index + self._length if index < 0 else index
        if not 0 <= position < self._length:
            raise IndexError(f"index {index} outside a list of {self._length}")
        return self._items[position]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, (list, ListPrefix)):
            return NotImplemented
        return len(other) == self._length and all(a == b for a, b in zip(self, other))

    __hash__ = None  # type: ignore[assignment]  # equal to a list, so unhashable as one

    def __repr__(self) -> str:
        return repr(list(self))
