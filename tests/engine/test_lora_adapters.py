"""Removing LoRA adapters (``engine/lora_adapters.py``): an adapter removed while requests run or wait with it stays
installed until they finish, with the tokens they would have had; then its weights leave the model and its id is
retired; its cached KV blocks are evicted as the pool needs them (none leaked), and the same content loaded again
under a new id finds them; the stats name the adapters of running and waiting requests."""

from __future__ import annotations

import pytest

from kvserve import LLM, LoRARequest, SamplingParams
from kvserve.model.lora_checkpoint import make_lora_adapter
from kvserve.sampling_params import InvalidParameter
from tests.conftest import assert_all_blocks_free

PROMPT = [17, 230, 41, 99, 310, 5, 72, 8, 150, 61, 33, 4]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(tiny_checkpoints, tmp_path_factory: pytest.TempPathFactory):
    base = tiny_checkpoints["llama"]
    root = tmp_path_factory.mktemp("lora-adapters")
    return base, make_lora_adapter(base, root / "first", seed=1), make_lora_adapter(base, root / "second", seed=2)


def _llm(base, **options) -> LLM:
    return LLM(str(base), dtype="float32", num_kv_blocks=32, block_size=4, enable_lora=True, **options)


def _installed(llm: LLM) -> set[int]:
    return {i for layer, _ in llm.engine.core.runner.model.lora_projections().values() for i in layer.lora}


def _tokens(llm: LLM, adapter: LoRARequest | None) -> tuple[list[int], int]:
    out = llm.generate([{"prompt_token_ids": PROMPT}], GREEDY, use_tqdm=False, lora_request=adapter)[0]
    return list(out.outputs[0].token_ids), out.num_cached_tokens


def test_an_adapter_removed_between_generates_is_unloaded_and_its_id_retired(adapters) -> None:
    base, first, _ = adapters
    llm = _llm(base)
    tokens, _ = _tokens(llm, LoRARequest("first", 1, str(first)))
    assert llm.list_loras() == {1} and _installed(llm) == {1}
    assert llm.remove_lora(1) is True
    assert llm.list_loras() == set() and _installed(llm) == set()
    assert llm.remove_lora(1) is False and llm.remove_lora(7) is False
    with pytest.raises(InvalidParameter, match="lora_int_id 1 was adapter 'first', since removed"):
        _tokens(llm, LoRARequest("first", 1, str(first)))
    # the same content under a new id: the same tokens, and its KV blocks found by the adapter's digest
    again, cached = _tokens(llm, LoRARequest("again", 2, str(first)))
    assert again == tokens and cached > 0
    assert_all_blocks_free(llm)


def test_an_unloaded_adapters_cached_blocks_are_evicted_as_the_pool_needs_them(adapters) -> None:
    """The removed adapter's blocks stay cached, unreachable, until other requests need the pool: each such block
    is then evicted, none held, none leaked."""
    base, first, _ = adapters
    llm = _llm(base)
    _tokens(llm, LoRARequest("first", 1, str(first)))
    cached = llm.stats()["prefix_cache_blocks"]
    assert cached > 0
    llm.remove_lora(1)
    assert llm.stats()["prefix_cache_blocks"] == cached
    long_prompt = {"prompt_token_ids": [(7 * i) % 300 + 3 for i in range(108)]}  # 128 tokens: the whole pool
    llm.generate([long_prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    assert llm.stats()["prefix_cache_evictions"] >= cached
    assert_all_blocks_free(llm)
    llm.engine.core.kv_manager.check_integrity([])


def test_an_adapter_removed_while_requests_run_and_wait_with_it_stays_until_they_finish(adapters) -> None:
    """One request running with the adapter and one waiting for it (max_num_seqs 1): removing it retires its id at
    once, both finish with the tokens they would have had, and its weights go after the last one."""
    base, first, _ = adapters
    expected, _ = _tokens(_llm(base), LoRARequest("first", 1, str(first)))
    llm = _llm(base, max_num_seqs=1)
    engine = llm.engine
    adapter = LoRARequest("first", 1, str(first))
    for request_id in ("a", "b"):
        engine.add_request(request_id, {"prompt_token_ids": PROMPT}, GREEDY, lora_request=adapter)
    engine.step()
    assert engine.stats()["running_lora_adapters"] == "first" == engine.stats()["waiting_lora_adapters"]
    assert engine.remove_lora(1) == 2
    assert llm.list_loras() == set() and _installed(llm) == {1}
    with pytest.raises(InvalidParameter, match="since removed"):
        engine.add_request("c", {"prompt_token_ids": PROMPT}, GREEDY, lora_request=adapter)
    finished = {}
    while engine.has_unfinished_requests():
        finished |= {out.request_id: list(out.outputs[0].token_ids) for out in engine.step() if out.finished}
        if len(finished) == 1:  # the second runs now: still installed
            assert _installed(llm) == {1}
    assert finished == {"a": expected, "b": expected}
    assert _installed(llm) == set()
    assert (engine.stats()["running_lora_adapters"], engine.stats()["waiting_lora_adapters"]) == ("", "")
    assert_all_blocks_free(llm)


def test_an_aborted_last_request_lets_the_removed_adapter_go(adapters) -> None:
    base, first, _ = adapters
    llm = _llm(base)
    engine = llm.engine
    engine.add_request("a", {"prompt_token_ids": PROMPT}, GREEDY, lora_request=LoRARequest("first", 1, str(first)))
    engine.step()
    assert engine.remove_lora(1) == 1 and _installed(llm) == {1}
    engine.abort_request(["a"])
    assert _installed(llm) == set()
    assert_all_blocks_free(llm)


def test_stats_name_the_adapters_of_running_and_waiting_requests(adapters) -> None:
    """max_loras 1: the second adapter's request waits while the first's runs."""
    base, first, second = adapters
    llm = _llm(base)
    engine = llm.engine
    stats = engine.stats()
    assert (stats["running_lora_adapters"], stats["waiting_lora_adapters"], stats["max_loras"]) == ("", "", 1)
    engine.add_request("a", {"prompt_token_ids": PROMPT}, GREEDY, lora_request=LoRARequest("first", 1, str(first)))
    engine.add_request("b", {"prompt_token_ids": PROMPT}, GREEDY, lora_request=LoRARequest("second", 2, str(second)))
    engine.add_request("c", {"prompt_token_ids": PROMPT}, GREEDY)
    engine.step()
    stats = engine.stats()
    assert (stats["running_lora_adapters"], stats["waiting_lora_adapters"]) == ("first", "second")
    while engine.has_unfinished_requests():
        engine.step()
    assert "running_lora_adapters" not in LLM(str(base), dtype="float32", num_kv_blocks=16).stats()


def test_a_removed_adapters_samples_each_count_until_the_last_finishes(adapters) -> None:
    """n=3: the samples forked from the request run with its adapter, each counted, so that its weights go after
    the last of them, not before, nor never (a count gone below zero)."""
    base, first, _ = adapters
    llm = _llm(base)
    engine = llm.engine
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=8, ignore_eos=True, n=3)
    engine.add_request("a", {"prompt_token_ids": PROMPT}, params, lora_request=LoRARequest("first", 1, str(first)))
    engine.step()
    assert engine.core.scheduler.num_requests_by_adapter == {1: 3}
    assert engine.remove_lora(1) == 3
    finished = False
    while not finished:
        assert _installed(llm) == {1}
        finished = any(out.finished for out in engine.step())
    assert _installed(llm) == set() and not engine.core.scheduler.num_requests_by_adapter
    assert_all_blocks_free(llm)
