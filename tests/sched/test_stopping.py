"""Where a request's tokens end (``sched/stopping.py``), through a scheduler and a fake runner: EOS, stop token ids,
max_tokens and max_model_len, in that order; and prompt logprobs returned once each, across chunks and
preemptions."""

from __future__ import annotations

from tests.sched.sched_fakes import (
    EOS,
    assert_all_blocks_free,
    default_token,
    expected_tokens,
    make_request,
    make_scheduler,
    run_to_completion,
    runner_for,
    step,
    tokens_of,
)

from kvserve.outputs import FinishReason


# ------------------------------------------------------------------------------------------------ stops


def scripted(*tokens: int):
    return lambda request_id, output_index: tokens[output_index] if output_index < len(tokens) else 99


def run_one(num_prompt: int = 3, script=None, max_model_len: int = 256, **params):
    scheduler = make_scheduler(max_model_len=max_model_len)
    scheduler.add_request(make_request("r", num_prompt, **params))
    outputs = run_to_completion(scheduler, runner_for(scheduler, script or default_token))["r"]
    assert_all_blocks_free(scheduler)
    return tokens_of(outputs), outputs[-1]


def test_eos_stops_and_is_kept_in_the_output() -> None:
    tokens, last = run_one(script=scripted(11, 12, EOS, 13), ignore_eos=False, max_tokens=10)
    assert tokens == [11, 12, EOS]
    assert (last.finish_reason, last.stop_reason) == (FinishReason.STOP, None)


def test_ignore_eos_runs_to_max_tokens() -> None:
    tokens, last = run_one(script=scripted(EOS, EOS, EOS, EOS), ignore_eos=True, max_tokens=4)
    assert tokens == [EOS] * 4 and last.finish_reason is FinishReason.LENGTH


def test_an_eos_drawn_before_min_tokens_ends_the_request() -> None:
    """The sampler bans EOS until min_tokens unless a constraint allows nothing else; an EOS it lets through
    ends the output (counted only after min_tokens, the grammar's end repeated until then, [69, 70, 3, 3, 3])."""
    tokens, last = run_one(script=scripted(11, EOS, 12), ignore_eos=False, min_tokens=3, max_tokens=10)
    assert tokens == [11, EOS] and last.finish_reason is FinishReason.STOP


def test_a_stop_token_id_stops_with_its_id_as_the_reason() -> None:
    tokens, last = run_one(script=scripted(11, 5, 12), stop_token_ids=[5], max_tokens=10)
    assert tokens == [11, 5] and (last.finish_reason, last.stop_reason) == (FinishReason.STOP, 5)


def test_a_stop_token_drawn_before_min_tokens_ends_the_request_too() -> None:
    tokens, last = run_one(script=scripted(5, 5, 5), stop_token_ids=[5], min_tokens=2, max_tokens=10)
    assert tokens == [5] and last.stop_reason == 5


def test_eos_is_checked_before_stop_token_ids() -> None:
    tokens, last = run_one(script=scripted(EOS), ignore_eos=False, stop_token_ids=[EOS], max_tokens=10)
    assert tokens == [EOS] and (last.finish_reason, last.stop_reason) == (FinishReason.STOP, None)


def test_max_tokens_stops_with_length() -> None:
    tokens, last = run_one(max_tokens=3)
    assert tokens == expected_tokens("r", 3) and (last.finish_reason, last.stop_reason) == (FinishReason.LENGTH, None)


def test_without_max_tokens_a_request_stops_at_max_model_len() -> None:
    tokens, last = run_one(num_prompt=4, max_model_len=10, max_tokens=None)
    assert len(tokens) == 6 and last.finish_reason is FinishReason.LENGTH


def test_sampled_logprobs_travel_with_their_tokens() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("r", 3, max_tokens=3, logprobs=2))
    outputs = run_to_completion(scheduler, runner_for(scheduler))["r"]
    for out in outputs:
        assert [lp.token_ids[0] for lp in out.logprobs] == out.new_token_ids


# -------------------------------------------------------------------------------------- prompt logprobs


def test_prompt_logprobs_cover_every_prompt_token_once_across_chunks() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=4)
    runner = runner_for(scheduler)
    scheduler.add_request(make_request("r", 10, max_tokens=3, prompt_logprobs=1))
    flags, returned = [], []
    while scheduler.has_unfinished_requests():
        sched_out, outputs = step(scheduler, runner)
        flags += [r.prompt_logprobs for r in sched_out.requests]
        returned += [-lp.logprobs[0] for o in outputs for lp in o.prompt_logprobs or []]
    assert returned == list(range(1, 10))
    assert flags == [True, True, True, False, False]
    assert sched_out.is_empty and sched_out.finished_request_ids == {"r"}  # the last step only frees runner state


def test_prompt_logprobs_are_not_returned_again_after_a_mid_prefill_preemption() -> None:
    scheduler = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=5)
    runner = runner_for(scheduler)
    scheduler.add_request(make_request("old", 4, max_tokens=12))
    r = make_request("r", 12, max_tokens=1, prompt_logprobs=0)  # finishes with its prompt: preempted mid-prefill
    scheduler.add_request(r)
    outputs = run_to_completion(scheduler, runner)
    returned = [-lp.logprobs[0] for o in outputs["r"] for lp in o.prompt_logprobs or []]
    assert r.num_preemptions >= 1 and returned == list(range(1, 12))
