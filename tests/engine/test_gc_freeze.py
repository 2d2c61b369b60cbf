"""The engine's heap kept out of Python's full collections while it runs (``engine/gc_freeze.py``)."""

from __future__ import annotations

import asyncio
import gc
import weakref
from pathlib import Path

import pytest

from kvserve import LLM, SamplingParams
from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.gc_freeze import heap_frozen
from kvserve.model.checkpoint import make_checkpoint
from tests.engine.fake_engine import FakeEngine


class Cycle:
    """An object in a reference cycle: only the cyclic collector frees it."""

    def __init__(self) -> None:
        self.me = self


def test_objects_alive_at_the_start_are_frozen_and_handed_back_at_the_end() -> None:
    assert gc.get_freeze_count() == 0
    with heap_frozen():
        frozen = gc.get_freeze_count()
        assert frozen > 0
        # nested (or another thread's): the heap stays frozen until the outer block ends. An unfreeze would empty
        # the permanent generation; a frozen object some other thread of the process frees meanwhile leaves it
        # (the whole suite has such threads), so the count may dip below ``frozen`` but not empty
        with heap_frozen():
            assert gc.get_freeze_count() > frozen // 2
        assert gc.get_freeze_count() > frozen // 2
    assert gc.get_freeze_count() == 0


def test_the_heap_is_handed_back_when_the_block_raises() -> None:
    with pytest.raises(RuntimeError, match="boom"):
        with heap_frozen():
            raise RuntimeError("boom")
    assert gc.get_freeze_count() == 0


def test_collect_first_freezes_no_garbage_and_frozen_cycles_are_freed_after() -> None:
    garbage = Cycle()
    garbage_ref = weakref.ref(garbage)
    del garbage
    with heap_frozen(collect_first=True):  # collected before the freeze, not kept frozen
        assert garbage_ref() is None
    kept = Cycle()
    kept_ref = weakref.ref(kept)
    with heap_frozen():
        del kept
        gc.collect()  # the cycle is frozen: this collection does not free it
        assert kept_ref() is not None
    gc.collect()  # handed back: now it is freed
    assert kept_ref() is None


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("gc") / "llama", "llama", "tiny")


def test_offline_generate_steps_with_the_heap_frozen(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), max_model_len=64)
    step, seen = llm.engine.step, []

    def recording_step(*args, **kwargs):
        seen.append(gc.get_freeze_count())
        return step(*args, **kwargs)

    llm.engine.step = recording_step
    outputs = llm.generate([{"prompt_token_ids": [5, 6, 7]}] * 3, SamplingParams(max_tokens=4, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in outputs] == [4, 4, 4]
    assert seen and all(count > 0 for count in seen)
    assert gc.get_freeze_count() == 0


def test_the_server_engine_thread_runs_with_the_heap_frozen_and_hands_it_back_at_shutdown() -> None:
    engine = AsyncEngine(FakeEngine())
    engine.start()
    try:
        count = asyncio.run(asyncio.wait_for(engine.call(lambda _: gc.get_freeze_count()), timeout=10))
        assert count > 0
    finally:
        engine.shutdown()
    assert gc.get_freeze_count() == 0


def test_a_host_that_froze_its_own_heap_or_turned_the_collector_off_is_left_to_it() -> None:
    """A host program freezes its heap before forking workers (copy-on-write pages stay shared): ``generate``'s
    unfreeze thawed it. One that turned the collector off got collections."""
    gc.freeze()
    try:
        host_frozen = gc.get_freeze_count()
        with heap_frozen():
            pass
        assert gc.get_freeze_count() >= host_frozen // 2  # still frozen (other threads may free frozen objects)
    finally:
        gc.unfreeze()
    gc.disable()
    try:
        with heap_frozen():
            assert gc.get_freeze_count() == 0
        assert not gc.isenabled()
    finally:
        gc.enable()
