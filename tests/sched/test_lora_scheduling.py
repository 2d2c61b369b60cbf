"""``max_loras``: the scheduler keeps the LoRA adapters of the running requests within it, and a request held back
for its adapter still runs: a steady stream of another adapter's requests does not starve it, and under
``priority`` it displaces no running request while those it does not outrank hold every adapter slot."""

from __future__ import annotations

from tests.sched.sched_fakes import assert_all_blocks_free, make_request, make_scheduler, runner_for, step

from kvserve.request import Request


def with_adapter(request_id: str, lora_id: int, priority: int = 0, **params) -> Request:
    request = make_request(request_id, 6, **params)
    request.lora_id, request.lora_digest, request.priority = lora_id, f"adapter-{lora_id}", priority
    return request


def test_a_busy_adapters_stream_does_not_starve_a_request_of_another() -> None:
    """max_loras=1: adapter 1's requests arrive every other step and always find adapter 1 running. Adapter 2's
    request, held back past lpm_aging_steps, holds back adapter requests behind it (not the base model's) until
    adapter 1's drain; before, it ran only once the stream stopped."""
    for policy in ("fcfs", "lpm"):
        scheduler = make_scheduler(max_num_seqs=4, policy=policy, lpm_aging_steps=8, max_loras=1,
                                   prefix_caching=policy == "lpm")
        runner = runner_for(scheduler)
        scheduler.add_request(with_adapter("busy-0", 1, max_tokens=6))
        step(scheduler, runner)
        scheduler.add_request(with_adapter("other", 2, max_tokens=4))
        finished: dict[str, int] = {}
        for index in range(120):
            if index % 2 == 0:
                scheduler.add_request(with_adapter(f"busy-{index + 1}", 1, max_tokens=6))
            if index == 20:
                scheduler.add_request(make_request("base", 6, max_tokens=2))
            for out in step(scheduler, runner)[1]:
                if out.finished:
                    finished[out.request_id] = index
            assert len({r.lora_id for r in scheduler.running} - {0}) <= 1
        assert finished["other"] < 40, policy  # aged at 8 steps, then adapter 1's running requests drain
        assert finished["base"] < 30, policy  # the base model's requests are not held back with the adapters
        while scheduler.has_unfinished_requests():
            step(scheduler, runner)
        assert_all_blocks_free(scheduler)


def test_priority_displaces_no_one_for_a_head_whose_adapter_cannot_fit() -> None:
    """Running: adapter 1's requests of priority 0 and 5; waiting: adapter 2's of priority 1 (max_loras=1). The one
    of priority 0 holds the only slot, so preempting the one of priority 5 cannot seat the head: before, it was
    preempted and readmitted every step until the first finished."""
    scheduler = make_scheduler(policy="priority", max_loras=1)
    runner = runner_for(scheduler)
    scheduler.add_request(with_adapter("first", 1, priority=0, max_tokens=12))
    scheduler.add_request(with_adapter("low", 1, priority=5, max_tokens=30))
    step(scheduler, runner)
    scheduler.add_request(with_adapter("head", 2, priority=1, max_tokens=3))
    finished: list[str] = []
    while scheduler.has_unfinished_requests():
        finished += [out.request_id for out in step(scheduler, runner)[1] if out.finished]
    # once the first is done, the head displaces the one of priority 5 (which then holds the slot), once
    assert scheduler.num_preemptions == 1
    assert finished.index("first") < finished.index("head") < finished.index("low")
    assert_all_blocks_free(scheduler)
