"""``TokenIds``: two token lists read as one, without concatenating them."""

from __future__ import annotations

import itertools
from typing import Iterator, Sequence, overload


class TokenIds(Sequence[int]):
    """``head + tail`` without concatenating them (a request's prompt and outputs; a sampling row's outputs and
    the draft tokens it comes after): a step reads a few tokens of a long history, and copying the whole history
    each time would make the step's cost grow with context length. ``head`` is read to the length it had when the
    view was made (a list only appended to may grow past it), ``tail`` as it grows."""

    __slots__ = ("_head", "_num_head", "_tail")

    def __init__(self, head: list[int], tail: list[int]) -> None:
        self._head, self._num_head, self._tail = head, len(head), tail

    def __len__(self) -> int:
        return self._num_head + len(self._tail)

    def __iter__(self) -> Iterator[int]:
        yield from itertools.islice(self._head, self._num_head)
        yield from self._tail

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> list[int]: ...

    def __getitem__(self, index: int | slice) -> int | list[int]:
        num_head = self._num_head
        if isinstance(index, int):
            if index < 0:
                index += len(self)
            if not 0 <= index < len(self):
                raise IndexError(f"token index {index} outside a history of {len(self)} tokens")
            return self._head[index] if index < num_head else self._tail[index - num_head]
        start, stop, step = index.indices(len(self))
        if step != 1:
            return list(self)[index]
        if stop <= num_head:
            return self._head[start:stop]
        if start >= num_head:
            return self._tail[start - num_head : stop - num_head]
        return self._head[start:num_head] + self._tail[: stop - num_head]
