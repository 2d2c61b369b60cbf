"""The step trace: each step's shape recorded as its tokens come back, and a fit that recovers known costs."""

from __future__ import annotations

import pytest

from kvserve.bench import step_trace
from kvserve.bench.step_trace import StepTrace, format_step_trace
from kvserve.sched.output import ScheduledRequest, SchedulerOutput


def step(*requests: ScheduledRequest) -> SchedulerOutput:
    return SchedulerOutput(list(requests), sum(r.num_tokens for r in requests))


def test_a_steps_shape_counts_decodes_their_context_and_prefill_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(step_trace.time, "perf_counter", lambda: 5.0)
    trace = StepTrace()
    trace(step(ScheduledRequest("a", 40, 1), ScheduledRequest("b", 9, 1 + 2, draft_token_ids=(7, 8)),
               ScheduledRequest("c", 0, 30), ScheduledRequest("d", 64, 16)))
    # a and b decode (b with two drafts) over 41 and 12 positions; c's first chunk and d's later one prefill
    assert trace.segments == [[(5.0, 2, 41 + 12, 30 + 16)]]


def test_the_fit_recovers_the_costs_the_periods_were_made_of(monkeypatch: pytest.MonkeyPatch) -> None:
    """Periods built from 2 ms a step, 10 us a decode row, 50 ns a context token and 20 us a prefill token, in
    two segments (the gap between them is no step's): the fit gives those back, each term's share of the time."""
    shapes = [(decodes, decodes * (100 + 37 * i % 900), 256 * (i % 3)) for i, decodes in
              enumerate([1, 3, 8, 8, 16, 20, 32, 40, 64, 7, 5, 50])]
    trace = StepTrace()
    for segment in (shapes[:6], shapes[6:]):
        trace.new_segment()
        now, times = 100.0 * len(trace.segments), []
        for decodes, context, prefill in segment:
            now += 2e-3 + 10e-6 * decodes + 50e-9 * context + 20e-6 * prefill
            times.append(now)
        clock = iter(times)
        monkeypatch.setattr(step_trace.time, "perf_counter", lambda: next(clock))
        for decodes, context, prefill in segment:
            trace(step(*[ScheduledRequest(f"r{j}", context // decodes - 1, 1) for j in range(decodes)],
                       *([ScheduledRequest("p", 0, prefill)] if prefill else [])))
    summary = trace.summary()
    assert summary["num_steps"] == len(shapes) - 2
    assert summary["seconds"] == pytest.approx({"per_step": 2e-3, "per_decode_row": 10e-6,
                                                "per_context_token": 50e-9, "per_prefill_token": 20e-6}, rel=1e-6)
    assert summary["r2"] == pytest.approx(1.0) and sum(summary["share"].values()) == pytest.approx(1.0)
    assert "2.00 ms a step" in format_step_trace(summary)


def test_too_few_steps_are_not_fitted() -> None:
    trace = StepTrace()
    trace(step(ScheduledRequest("a", 3, 1)))
    assert trace.summary() == {"num_steps": 0}
    assert format_step_trace(trace.summary()) == "step trace: 0 steps, too few to fit"
