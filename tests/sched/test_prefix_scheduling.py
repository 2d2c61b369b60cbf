"""The scheduler with the prefix cache: reuse, siblings that wait for a shared prefix, lpm order and aging,
preemption that resumes from cached blocks, and the counters."""

from __future__ import annotations

from tests.sched.sched_fakes import (
    FakeRunner,
    make_request,
    make_scheduler,
    run_to_completion,
    shared_prefix,
    step,
    tokens_of,
)

from kvserve.sched import scheduler as scheduler_module
from kvserve.sched.scheduler import Scheduler

BLOCK = 4


def cached_scheduler(**kwargs) -> Scheduler:
    kwargs.setdefault("block_size", BLOCK)
    kwargs.setdefault("policy", "lpm")
    return make_scheduler(prefix_caching=True, **kwargs)


def runner_for(scheduler: Scheduler) -> FakeRunner:
    kv = scheduler.kv
    return FakeRunner(kv.num_blocks_total, kv.block_size, ref_count=kv.pool.ref_count)


def test_requests_arriving_together_compute_their_shared_prefix_once() -> None:
    scheduler = cached_scheduler(num_blocks=128, max_num_batched_tokens=32, max_num_seqs=16)
    prefix = shared_prefix(0, 64)
    for i in range(16):
        scheduler.add_request(make_request(f"r{i}", 68, prefix=prefix, max_tokens=1))
    runner = runner_for(scheduler)
    outputs = run_to_completion(scheduler, runner)
    assert runner.num_tokens_written == 64 + 16 * 4  # the prefix once, then each request's own 4 tokens
    assert all(len(tokens_of(outputs[f"r{i}"])) == 1 for i in range(16))
    stats = scheduler.prefix_cache_stats()
    assert stats["prefix_cache_queries"] == 16 * 68 and stats["prefix_cache_hits"] == 15 * 64
    assert stats["prefix_cache_hit_rate"] == 15 * 64 / (16 * 68)


def test_without_the_cache_each_request_computes_its_whole_prompt() -> None:
    scheduler = make_scheduler(num_blocks=128, block_size=BLOCK, max_num_batched_tokens=32, max_num_seqs=16)
    prefix = shared_prefix(0, 64)
    for i in range(4):
        scheduler.add_request(make_request(f"r{i}", 68, prefix=prefix, max_tokens=1))
    runner = runner_for(scheduler)
    run_to_completion(scheduler, runner)
    assert runner.num_tokens_written == 4 * 68
    stats = scheduler.prefix_cache_stats()  # nothing looked up: a hit rate is n/a, not 0 % of 272 tokens
    assert (stats["prefix_caching"], stats["prefix_cache_queries"], stats["prefix_cache_hits"]) == (False, 0, 0)


def test_a_later_turn_pays_only_for_its_new_tokens() -> None:
    scheduler = cached_scheduler(num_blocks=64)
    runner = runner_for(scheduler)
    first = make_request("turn1", 40, max_tokens=8)
    scheduler.add_request(first)
    answer = tokens_of(run_to_completion(scheduler, runner)["turn1"])
    history = first.prompt_token_ids + answer
    second = make_request("turn2", len(history) + 8, prefix=history, max_tokens=4)
    scheduler.add_request(second)
    written_before = runner.num_tokens_written
    run_to_completion(scheduler, runner)
    # turn 1 computed its prompt and 7 answers (the 8th was never fed back): 47 tokens, 11 whole blocks
    assert second.num_cached_tokens == 44
    assert runner.num_tokens_written - written_before == (len(history) + 8 - 44) + 3


def _first_admitted_after_a_warm_prefix(policy: str) -> list[str]:
    """One seat; a request that arrives first with nothing cached, then one whose 32-token prefix is cached."""
    scheduler = cached_scheduler(num_blocks=64, max_num_batched_tokens=64, max_num_seqs=1, policy=policy)
    runner = runner_for(scheduler)
    scheduler.add_request(make_request("warm", 33, prefix=shared_prefix(1, 32), max_tokens=1))
    run_to_completion(scheduler, runner)
    scheduler.add_request(make_request("cold", 20, max_tokens=1))
    scheduler.add_request(make_request("hot", 36, prefix=shared_prefix(1, 32), max_tokens=1))
    sched_out, _ = step(scheduler, runner)
    return [r.request_id for r in sched_out.requests]


def test_lpm_admits_the_request_with_the_longest_cached_prefix_first() -> None:
    assert _first_admitted_after_a_warm_prefix("lpm") == ["hot"]


def test_fcfs_keeps_arrival_order_even_with_a_cached_prefix() -> None:
    assert _first_admitted_after_a_warm_prefix("fcfs") == ["cold"]


def test_lpm_orders_only_the_head_of_a_long_queue_and_admission_keeps_the_rest_in_order(monkeypatch) -> None:
    """Past ``LPM_WINDOW`` waiting requests the rest keep arrival order (ordering them all matched every waiting
    prefix every step); the requests admitted leave the queue and the others keep their places."""
    monkeypatch.setattr(scheduler_module, "LPM_WINDOW", 2)
    scheduler = cached_scheduler(num_blocks=128, max_num_batched_tokens=64, max_num_seqs=1)
    runner = runner_for(scheduler)
    scheduler.add_request(make_request("warm", 33, prefix=shared_prefix(1, 32), max_tokens=1))
    run_to_completion(scheduler, runner)
    for name in ("cold0", "cold1", "hot", "cold2"):
        prefix = shared_prefix(1, 32) if name == "hot" else []
        scheduler.add_request(make_request(name, 36 if prefix else 20, prefix=prefix, max_tokens=1))
    sched_out, _ = step(scheduler, runner)
    assert [r.request_id for r in sched_out.requests] == ["cold0"]  # "hot" is behind the window of 2
    assert [r.request_id for r in scheduler.waiting] == ["cold1", "hot", "cold2"]
    sched_out, _ = step(scheduler, runner)
    assert [r.request_id for r in sched_out.requests if r.request_id != "cold0"] == ["hot"]  # now in the window
    assert [r.request_id for r in scheduler.waiting] == ["cold1", "cold2"]


def test_lpm_serves_a_request_that_waited_too_long_first() -> None:
    scheduler = cached_scheduler(num_blocks=128, max_num_batched_tokens=64, max_num_seqs=1, lpm_aging_steps=3)
    runner = runner_for(scheduler)
    scheduler.add_request(make_request("warm", 33, prefix=shared_prefix(1, 32), max_tokens=1))
    run_to_completion(scheduler, runner)
    scheduler.add_request(make_request("busy", 8, max_tokens=3))  # holds the one seat for 3 steps
    scheduler.add_request(make_request("cold", 20, max_tokens=1))
    step(scheduler, runner)
    for i in range(3):  # a stream of cache hits that would overtake "cold" forever
        scheduler.add_request(make_request(f"hot{i}", 36, prefix=shared_prefix(1, 32), max_tokens=1))
    order = []
    while scheduler.has_unfinished_requests():
        sched_out, _ = step(scheduler, runner)
        order += [r.request_id for r in sched_out.requests if r.request_id not in order]
    assert order.index("cold") < order.index("hot1")


def test_a_preempted_request_resumes_from_its_cached_blocks() -> None:
    written = {}
    for caching in (False, True):
        scheduler = make_scheduler(num_blocks=8, block_size=BLOCK, max_num_batched_tokens=64, prefix_caching=caching)
        runner = runner_for(scheduler)
        scheduler.add_request(make_request("a", 12, max_tokens=12))
        scheduler.add_request(make_request("b", 16, max_tokens=4))
        outputs = run_to_completion(scheduler, runner)
        assert scheduler.num_preemptions == 1  # b, when a grows; a finishes, b resumes
        assert len(tokens_of(outputs["a"])) == 12 and len(tokens_of(outputs["b"])) == 4
        written[caching] = runner.num_tokens_written
    # b's prompt blocks survive in the cache (a's growth took worthless blocks): 8 tokens not recomputed
    assert written[False] - written[True] == 8


def test_a_resumed_request_counts_neither_a_second_lookup_nor_its_own_blocks_as_cached() -> None:
    """The lookup is counted at a request's first admission alone: b, preempted and resumed from 8 tokens of its
    own blocks, still reports the 0 cached tokens it found at first, and the hit rate stays that of the prompts."""
    scheduler = make_scheduler(num_blocks=8, block_size=BLOCK, max_num_batched_tokens=64, prefix_caching=True)
    scheduler.add_request(make_request("a", 12, max_tokens=12))
    scheduler.add_request(make_request("b", 16, max_tokens=4))
    outputs = run_to_completion(scheduler, runner_for(scheduler))
    assert scheduler.num_preemptions == 1
    stats = scheduler.prefix_cache_stats()
    assert (stats["prefix_cache_queries"], stats["prefix_cache_hits"]) == (12 + 16, 0)
    assert {rid: [o.num_cached_tokens for o in outs] for rid, outs in outputs.items()} == {
        "a": [0] * len(outputs["a"]), "b": [0] * len(outputs["b"])}

def test_decodes_keep_flowing_while_a_max_model_len_prompt_is_prefilled() -> None:
    scheduler = cached_scheduler(num_blocks=128, max_num_batched_tokens=16, max_model_len=256)
    runner = runner_for(scheduler)
    scheduler.add_request(make_request("chat", 8, max_tokens=40))
    step(scheduler, runner)
    scheduler.add_request(make_request("long", 255, max_tokens=1))
    steps_with_long = 0
    while scheduler.has_unfinished_requests() and "long" in scheduler.requests:
        sched_out, _ = step(scheduler, runner)
        ids = [r.request_id for r in sched_out.requests]
        assert ids[0] == "chat" and sched_out.requests[0].num_tokens == 1  # a token for the decode every step
        steps_with_long += "long" in ids
    assert steps_with_long == -(-255 // 15)  # the prompt in chunks of the budget left after the decode

