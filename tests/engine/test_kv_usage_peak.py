"""The engine's peak KV block use (``llm.stats()``): exact, with the waste at peak measured at a step no more than
``PEAK_REMEASURE_SHARE`` of the pool below it (measuring walks every running request's blocks)."""

from __future__ import annotations

import random

from kvserve import LLM, SamplingParams
from kvserve.engine.core import PEAK_REMEASURE_SHARE
from tests.conftest import assert_all_blocks_free


def test_peak_is_exact_and_its_waste_is_remeasured_as_it_grows(tiny_checkpoints) -> None:
    llm = LLM(str(tiny_checkpoints["llama"]), dtype="float32", num_kv_blocks=400, block_size=4, max_num_seqs=8)
    engine, core = llm.engine, llm.engine.core
    kv = core.kv_manager
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    for i in range(8):
        engine.add_request(f"r{i}", {"prompt_token_ids": [rng.randrange(3, 200) for _ in range(40)]}, params)
    uses, schedule = [], core.scheduler.schedule

    def schedule_and_record():  # block use as _track_peak sees it: after the step's allocation
        sched_out = schedule()
        uses.append(kv.num_blocks_total - kv.num_free_blocks())
        return sched_out

    core.scheduler.schedule = schedule_and_record
    measured_at = set()
    while engine.has_unfinished_requests():
        engine.step()
        measured_at.add(core.peak.num_blocks_measured)
    peak, stats = core.peak, llm.stats()
    assert stats["peak_num_blocks_used"] == max(uses) == peak.num_blocks_used
    assert max(uses) - PEAK_REMEASURE_SHARE * kv.num_blocks_total <= peak.num_blocks_measured <= max(uses)
    # the blocks grew by more than the remeasure step many times, yet were walked only at those steps
    assert 1 < len(measured_at) < len(set(uses))
    assert 0 <= stats["kv_waste_at_peak"] < 0.5
    assert_all_blocks_free(llm)
