"""The penalties' counts on the device through the lifecycle the sampler drives: tokens taken at launch, steps
launched before the last one's tokens are read back, speculating steps whose tokens come back late, drops
and slots reused, more samples than the first storage holds. Every ``apply`` must equal the per-row
reference over each sample's full history."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch

from kvserve.sample.metadata import SamplingRow
from kvserve.sample.penalties import Penalties
from kvserve.sampling_params import SamplingParams
from tests.sample.test_logits_processors import reference_row

VOCAB = 8


@dataclass
class Sample:
    params: SamplingParams
    prompt: list[int]
    outputs: list[int] = field(default_factory=list)  # as read back
    in_flight: list[int] = field(default_factory=list)  # drawn, not read back

    def row(self, key: str) -> SamplingRow:
        return SamplingRow(self.params, 0, key, self.prompt, self.outputs, num_in_flight=len(self.in_flight))


def check_apply(penalties: Penalties, rows: list[SamplingRow], histories: list[list[int]]) -> None:
    logits = torch.randn(len(rows), VOCAB) * 3
    expected = [reference_row(Penalties, logits[i].tolist(), SamplingRow(r.params, 0, r.generator_key,
                                                                         r.prompt_token_ids, histories[i]))
                for i, r in enumerate(rows)]
    penalties.apply(logits, rows)
    torch.testing.assert_close(logits, torch.tensor(expected), rtol=1e-6, atol=1e-6)


def params(rng: random.Random) -> SamplingParams:
    return SamplingParams(repetition_penalty=rng.choice([1.0, 1.3, 0.7]), presence_penalty=rng.choice([0.0, 0.5]),
                          frequency_penalty=rng.choice([0.25, -0.5]))


@pytest.mark.parametrize("seed", range(6))
def test_counts_follow_every_step_of_a_random_workload(seed: int) -> None:
    rng = random.Random(seed)
    penalties, samples, added, grew = Penalties(), {}, set(), False
    for step in range(120):
        grew = grew or (penalties.counts is not None and penalties.counts.shape[0] > 8)
        if len(samples) < 14 and rng.random() < 0.3:  # a new sample (up to 14: the storage grows past 8)
            key = f"s{step}"
            samples[key] = Sample(params(rng), [rng.randrange(VOCAB) for _ in range(rng.randrange(6))],
                                  [rng.randrange(VOCAB) for _ in range(rng.randrange(3))])
        if samples and rng.random() < 0.1:  # finished or aborted, with or without a token in flight
            del samples[key := rng.choice(list(samples))]
            penalties.drop(key)
        if not samples:
            continue
        keys = rng.sample(list(samples), rng.randrange(1, len(samples) + 1))
        for key in keys:
            if key not in added:
                penalties.add(key, samples[key].row(key))
                added.add(key)
        speculating = rng.random() < 0.25 and not any(samples[k].in_flight for k in keys)
        if speculating:
            drafts = {k: [rng.randrange(VOCAB) for _ in range(rng.randrange(3))] for k in keys}
            rows = [samples[k].row(k).after(drafts[k][:j]) for k in keys for j in range(len(drafts[k]) + 1)]
            check_apply(penalties, rows, [list(r.output_token_ids) for r in rows])
            for key in keys:  # read back: accepted drafts and the target's token
                accepted = drafts[key][: rng.randrange(len(drafts[key]) + 1)] + [rng.randrange(VOCAB)]
                samples[key].outputs.extend(accepted)
                penalties.accept(key, accepted)
            continue
        rows = [samples[k].row(k) for k in keys]
        check_apply(penalties, rows, [samples[k].outputs + samples[k].in_flight for k in keys])
        drawn = [rng.randrange(VOCAB) for _ in keys]
        penalties.accept_launched(rows, torch.tensor(drawn))
        for key, token in zip(keys, drawn):
            samples[key].in_flight.append(token)
        for key in samples:  # the last step read back, or (overlapped) left in flight for one more step
            if samples[key].in_flight and (len(samples[key].in_flight) > 1 or rng.random() < 0.6):
                token = samples[key].in_flight.pop(0)
                samples[key].outputs.append(token)
                penalties.accept(key, [token])
    assert penalties.num_states == len([k for k in samples if k in added]) and grew
    for key in list(samples):
        penalties.drop(key)
    assert penalties.num_states == 0 and penalties.counts is None  # no storage held without a penalized sample


def test_a_dropped_samples_slot_is_reused_from_zero() -> None:
    penalties = Penalties()
    first = SamplingRow(SamplingParams(frequency_penalty=1.0), 0, "a", [], [3, 3, 3])
    penalties.add("a", first)
    check_apply(penalties, [first], [[3, 3, 3]])
    penalties.drop("a")
    second = SamplingRow(SamplingParams(frequency_penalty=1.0), 0, "b", [], [])
    penalties.add("b", second)
    check_apply(penalties, [second], [[]])
    assert penalties.num_states == 1


def test_rows_without_a_penalty_take_no_slot_and_stay_bit_for_bit() -> None:
    penalties = Penalties()
    plain = SamplingRow(SamplingParams(), 0, "p", [1], [2])
    penalties.add("p", plain)
    logits = torch.randn(1, VOCAB)
    before = logits.clone()
    penalties.apply(logits, [plain])
    penalties.accept_launched([plain], torch.tensor([4]))
    penalties.accept("p", [4])
    assert penalties.num_states == 0 and torch.equal(logits, before)


def test_late_tokens_of_a_dropped_sample_are_not_counted_for_the_next_owner_of_its_slot() -> None:
    penalties = Penalties()
    first = SamplingRow(SamplingParams(frequency_penalty=1.0), 0, "a", [], [])
    penalties.add("a", first)
    check_apply(penalties, [first], [[]])
    penalties.accept("a", [5, 5])  # a speculating step's tokens, counted at the next apply
    penalties.drop("a")
    second = SamplingRow(SamplingParams(frequency_penalty=1.0), 0, "b", [], [1])
    penalties.add("b", second)  # takes a's slot
    check_apply(penalties, [second], [[1]])


def test_late_tokens_of_a_dropped_sample_stay_off_its_slot_while_another_sample_holds_the_storage() -> None:
    """As above, but with b alive the storage (and its late tokens) is not released on a's drop."""
    penalties = Penalties()
    a, b = (SamplingRow(SamplingParams(frequency_penalty=1.0), 0, key, [], []) for key in "ab")
    penalties.add("a", a)
    penalties.add("b", b)
    check_apply(penalties, [a, b], [[], []])
    penalties.accept("a", [5, 5, 5])  # a speculating step's tokens, counted at the next apply
    penalties.drop("a")
    c = SamplingRow(SamplingParams(frequency_penalty=1.0), 0, "c", [], [])
    penalties.add("c", c)  # takes a's slot
    check_apply(penalties, [b, c], [[], []])
