"""Sleep mode (vLLM's ``LLM(enable_sleep_mode=True)``): level 1 releases the KV cache (its prefix cache and its
tensors' memory) and keeps the weights; level 2 drops the weights too and reads them again at wake-up; a request
sent meanwhile is refused (``EngineAsleep``), nothing of it left queued; after ``wake_up`` the tokens are those of
before. Misuse is an error naming the parameter. Gemma 3 runs in KV cache groups."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvserve import LLM, SamplingParams
from kvserve.engine.sleep_mode import EngineAsleep
from kvserve.sampling_params import InvalidParameter
from tests.conftest import assert_all_blocks_free, greedy_token_ids

PROMPTS = [list(range(3, 30)), list(range(3, 22)) + [7, 9]]
MAX_NEW = 5


def _llm(path: Path, **options) -> LLM:
    return LLM(str(path), dtype="float32", num_kv_blocks=64, block_size=4, enable_sleep_mode=True, **options)


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def checkpoint(request: pytest.FixtureRequest, tiny_checkpoints) -> Path:
    return tiny_checkpoints[request.param]


def _refuses_requests(llm: LLM) -> None:
    with pytest.raises(EngineAsleep, match="sleep mode"):
        greedy_token_ids(llm, PROMPTS, MAX_NEW)
    assert not llm.engine.has_unfinished_requests()


def test_level_1_releases_the_kv_cache_keeps_the_weights_and_wakes_to_the_same_tokens(checkpoint) -> None:
    llm = _llm(checkpoint)
    expected = greedy_token_ids(llm, PROMPTS, MAX_NEW)
    before = llm.stats()
    assert before["kv_cache_bytes"] > 0 and before["prefix_cache_blocks"] > 0
    llm.sleep(level=1)
    asleep = llm.stats()
    assert llm.is_sleeping() and llm.engine.core.runner.kv is None
    assert asleep["kv_cache_bytes"] == 0 and asleep["prefix_cache_blocks"] == 0
    assert asleep["weights_bytes"] == before["weights_bytes"]
    assert asleep["num_graph_replays"] == before["num_graph_replays"]  # a counter since start: kept
    _refuses_requests(llm)
    llm.wake_up()
    assert not llm.is_sleeping() and llm.stats()["kv_cache_bytes"] == before["kv_cache_bytes"]
    assert greedy_token_ids(llm, PROMPTS, MAX_NEW) == expected
    # as the first run, from an empty cache (the second prompt hits the first's blocks in both): nothing was kept
    assert llm.stats()["prefix_cache_hits"] == 2 * before["prefix_cache_hits"]
    assert_all_blocks_free(llm)


def test_level_2_drops_the_weights_and_reads_them_again_weights_first(checkpoint) -> None:
    llm = _llm(checkpoint)
    expected = greedy_token_ids(llm, PROMPTS, MAX_NEW)
    weights_bytes = llm.stats()["weights_bytes"]
    llm.sleep(level=2)
    assert llm.stats()["weights_bytes"] == 0 and llm.engine.core.runner.model is None
    with pytest.raises(InvalidParameter, match="weights first") as raised:
        llm.wake_up(["kv_cache"])
    assert raised.value.param == "tags"
    llm.wake_up(["weights"])
    assert llm.is_sleeping() and llm.stats()["weights_bytes"] == weights_bytes
    _refuses_requests(llm)
    llm.wake_up(["kv_cache"])
    assert not llm.is_sleeping()
    assert greedy_token_ids(llm, PROMPTS, MAX_NEW) == expected
    assert_all_blocks_free(llm)


def test_misuse_is_refused_naming_it(tiny_checkpoints) -> None:
    path = tiny_checkpoints["llama"]
    with pytest.raises(ValueError, match="enable_sleep_mode=True"):
        LLM(str(path), dtype="float32", num_kv_blocks=32).sleep()
    llm = _llm(path)
    for level in (0, 3, True, "1"):
        with pytest.raises(InvalidParameter, match="level must be 1"):
            llm.sleep(level)
    with pytest.raises(InvalidParameter, match="unknown wake-up tags"):
        llm.wake_up(["weights", "optimizer"])
    llm.engine.add_request("running", {"prompt_token_ids": PROMPTS[0]}, SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="some are unfinished"):
        llm.sleep()
    llm.engine.abort_request(["running"])
    llm.sleep()
    with pytest.raises(ValueError, match="asleep already"):
        llm.sleep(2)
    llm.wake_up()
    llm.wake_up()  # awake: nothing to bring back
    assert greedy_token_ids(llm, PROMPTS[:1], 2)
