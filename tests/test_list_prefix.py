"""ListPrefix: a list only appended to, read as it was when the view was made."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvserve.list_prefix import ListPrefix


@given(items=st.lists(st.integers(0, 99), max_size=12), more=st.lists(st.integers(0, 99), max_size=4),
       start=st.integers(-20, 20) | st.none(), stop=st.integers(-20, 20) | st.none(),
       step=st.sampled_from([None, 1, 2, -1, -3]))
def test_a_view_reads_as_the_list_it_was_made_of(items: list[int], more: list[int], start, stop, step) -> None:
    whole = list(items)
    view = ListPrefix(items)
    items.extend(more)  # what the engine does to a request's lists after a snapshot
    assert len(view) == len(whole) and list(view) == whole and view == whole and whole == view
    assert view[start:stop:step] == whole[start:stop:step]
    assert [view[i] for i in range(-len(whole), len(whole))] == whole + whole
    assert repr(view) == repr(whole) and view == ListPrefix(whole) and (view == items) == (not more)


def test_indexes_past_the_view_are_refused_though_the_list_has_grown() -> None:
    items = [1, 2]
    view = ListPrefix(items)
    items.append(3)
    for index in (2, -3):
        with pytest.raises(IndexError, match=f"index {index} outside a list of 2"):
            view[index]
    assert view[-1] == 2 and view[1:] == [2] and view != (1, 2)
    with pytest.raises(TypeError):
        hash(view)
