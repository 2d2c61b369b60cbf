"""Draft verification in the sampler: the acceptance rule, each verified row processed with its own history,
logprobs of the kept tokens, seeded output equal to sampling without speculation, and (chi-square over a tiny
vocabulary) what speculation emits distributed exactly as the target's own samples."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from scipy import stats

from kvserve.sample.metadata import SamplingBatch, SamplingRow
from kvserve.sample.rejection import accept_draft
from kvserve.sample.sampler import Sampler
from kvserve.sampling_params import SamplingParams
from kvserve.spec.ngram import propose_ngram
from tests.sample.test_sampler import BanAccepted

VOCAB = 4
P_VALUE = 1e-3  # a correct sampler fails a chi-square test this rarely


def row(key: str = "r", outputs=(), eos=frozenset(), **params) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), 0, key, [1], list(outputs), frozenset(eos))


def drafted(base: SamplingRow, draft: tuple[int, ...]) -> SamplingBatch:
    return SamplingBatch.of_requests([base], [draft])


def test_drafts_are_kept_up_to_the_first_disagreement_then_the_targets_token() -> None:
    assert accept_draft([5, 6, 7], [5, 6, 9, 1]) == [5, 6, 9]
    assert accept_draft([5, 6, 7], [4, 6, 7, 1]) == [4]
    assert accept_draft([5, 6, 7], [5, 6, 7, 1]) == [5, 6, 7, 1]  # all accepted: the bonus token
    with pytest.raises(ValueError, match="k \\+ 1"):
        accept_draft([5, 6], [5, 6])


def test_rows_of_a_speculating_request_extend_its_history_by_the_drafts_before_them() -> None:
    batch = SamplingBatch.of_requests([row("a", outputs=[9]), row("b", outputs=[8])], [(3, 4), ()])
    assert [list(r.output_token_ids) for r in batch.rows] == [[9], [9, 3], [9, 3, 4], [8]]
    assert batch.first_rows == [0, 3]
    assert SamplingBatch.of_requests([row()], [()]).draft_token_ids is None  # nobody speculates: a row each


def test_greedy_verification_keeps_the_argmax_run() -> None:
    logits = torch.full((4, 8), -1.0)
    for position, token in enumerate([3, 4, 6, 2]):
        logits[position, token] = 1.0
    out = Sampler()(logits, drafted(row(temperature=0.0), (3, 4, 5)))
    assert out.token_ids == [[3, 4, 6]]


def test_each_verified_row_is_processed_with_the_drafts_before_it() -> None:
    """The repetition penalty and min_tokens read the history of their own row: row j counts drafts 1..j."""
    logits = torch.zeros(3, 8)
    logits[:, 5] = 2.0  # best, unless penalised for having been seen
    logits[:, 6] = 1.0
    out = Sampler()(logits, drafted(row(temperature=0.0, repetition_penalty=4.0), (5, 5)))
    assert out.token_ids == [[5, 6]]  # the second 5 sees the first in its history
    eos_first = torch.zeros(3, 8)
    eos_first[:, 2] = 5.0
    eos_first[:, 7] = 1.0
    out = Sampler()(eos_first, drafted(row(temperature=0.0, min_tokens=2, eos={2}), (7, 7)))
    assert out.token_ids == [[7, 7, 2]]  # EOS banned at outputs 0 and 1, allowed at output 2
    counts = torch.zeros(3, 8)
    counts[:, 4] = 1.0
    counts[:, 3] = 0.5
    out = Sampler()(counts, drafted(row(temperature=0.0, frequency_penalty=0.3, logit_bias={1: -9.0}), (4, 4)))
    assert out.token_ids == [[4, 4, 3]]  # 4 counted twice by the last row: 1 - 0.6 < 0.5


def test_kept_tokens_carry_their_own_rows_logprobs() -> None:
    logits = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    draft = (int(logits[0].argmax()), int(logits[1].argmin()))
    out = Sampler()(logits.clone(), drafted(row(temperature=0.0, logprobs=2), draft))
    (kept,) = out.token_ids
    raw = torch.log_softmax(logits, dim=-1)
    assert len(kept) == 2 and len(out.logprobs[0]) == 2
    for position, (token, entry) in enumerate(zip(kept, out.logprobs[0])):
        assert entry.token_ids[0] == token and len(entry.token_ids) == 3
        assert entry.logprobs[0] == pytest.approx(raw[position, token].item())


def test_a_stateful_processor_advances_past_the_kept_tokens_only() -> None:
    processor = BanAccepted()
    sampler = Sampler(processors=[processor])
    processor.is_needed = lambda r: r.generator_key == "plain"  # type: ignore[method-assign]
    batch = SamplingBatch.of_requests([row("plain", temperature=0.0), row("s", temperature=0.0)], [(), (0, 5)])
    out = sampler(torch.zeros(4, 8), batch)
    assert out.token_ids == [[0], [0, 0]]
    assert processor.produced == {"plain": [0], "s": [0, 0]}



def test_penalties_after_a_speculating_step_count_the_emitted_tokens_only() -> None:
    """Draft (3, 4) against the target's choices 3, 6, 7: [3, 6] emitted. The 7 after the rejected draft was
    never emitted, so the next step must not penalise it (speculation never changes the output)."""
    sampler = Sampler()
    params = dict(temperature=0.0, frequency_penalty=0.5)
    logits = torch.zeros(3, 8)
    logits[0, 3] = logits[1, 6] = logits[2, 7] = 5.0
    assert sampler(logits, drafted(row("s", **params), (3, 4))).token_ids == [[3, 6]]
    following = torch.zeros(1, 8)
    following[0, 7] = 0.25  # the best unless penalised (0.25 - 0.5 < 0)
    assert sampler(following, SamplingBatch([row("s", outputs=[3, 6], **params)])).token_ids == [[7]]

class MarkovModel:
    """A fake target over a tiny vocabulary: the next token's logits depend on the last two tokens."""

    def __init__(self, seed: int = 0) -> None:
        self.table = torch.randn(VOCAB, VOCAB, VOCAB, generator=torch.Generator().manual_seed(seed)) * 1.5

    def logits(self, history: list[int]) -> torch.Tensor:
        return self.table[history[-2], history[-1]].clone()

    def sequence_probability(self, prompt: list[int], tokens: tuple[int, ...], temperature: float) -> float:
        history, probability = list(prompt), 1.0
        for token in tokens:
            probability *= torch.softmax(self.logits(history) / temperature, -1)[token].item()
            history.append(token)
        return probability


def generate(model: MarkovModel, sampler: Sampler, prompt: list[int], params: list[SamplingParams],
             num_tokens: int, speculate: bool) -> tuple[list[list[int]], int, int]:
    """``num_tokens`` tokens for each of ``len(params)`` sequences, in lockstep, a step at a time; with
    ``speculate``, each step verifies up to 3 n-gram draft tokens per sequence on the rows the runner builds.
    Returns the sequences, and the draft tokens made and kept."""
    outputs: list[list[int]] = [[] for _ in params]
    num_drafted = num_accepted = 0
    while any(len(o) < num_tokens for o in outputs):
        rows, logits, drafts = [], [], []
        for index, (sequence_params, sequence) in enumerate(zip(params, outputs)):
            history = prompt + sequence
            draft = tuple(propose_ngram(np.array(history), 1, 3, 3).tolist()) if speculate else ()
            rows.append(SamplingRow(sequence_params, 0, f"s{index}", prompt, list(sequence)))
            logits += [model.logits(history + list(draft[:j])) for j in range(len(draft) + 1)]
            drafts.append(draft)
        appended = sampler(torch.stack(logits), SamplingBatch.of_requests(rows, drafts)).token_ids
        for sequence, draft, tokens in zip(outputs, drafts, appended):
            sequence += tokens
            num_drafted, num_accepted = num_drafted + len(draft), num_accepted + len(tokens) - 1
    return [o[:num_tokens] for o in outputs], num_drafted, num_accepted


PROMPT = [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]  # loops: the n-gram proposer has something to say at once


def test_seeded_sampling_with_speculation_is_token_for_token_sampling_without() -> None:
    model = MarkovModel()
    seeded = [SamplingParams(temperature=1.0, top_p=0.95, seed=seed) for seed in range(50)]
    plain, _, _ = generate(model, Sampler(), PROMPT, seeded, 12, speculate=False)
    speculated, num_drafted, num_accepted = generate(model, Sampler(seed=9), PROMPT, seeded, 12, speculate=True)
    assert speculated == plain
    assert len({tuple(s) for s in plain}) > 40  # the seeds drew different texts
    assert 0 < num_accepted < num_drafted


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_speculation_draws_from_the_targets_distribution_chi_square(temperature: float) -> None:
    """Unseeded (fresh noise for every row): the first three tokens of 6,000 speculated samples against the
    exact probabilities of the 64 sequences."""
    model, sampler = MarkovModel(seed=1), Sampler(seed=7)
    sequences = list(itertools.product(range(VOCAB), repeat=3))
    expected = torch.tensor([model.sequence_probability(PROMPT, s, temperature) for s in sequences])
    assert math.isclose(expected.sum().item(), 1.0, rel_tol=1e-5)
    params = [SamplingParams(temperature=temperature)] * 6000
    drawn, num_drafted, num_accepted = generate(model, sampler, PROMPT, params, 3, speculate=True)
    counts = torch.zeros(len(sequences))
    for sequence in drawn:
        counts[sequences.index(tuple(sequence))] += 1
    assert stats.chisquare(counts.numpy(), (expected * len(drawn)).numpy()).pvalue > P_VALUE
    assert 0 < num_accepted < num_drafted  # drafts were both kept and rejected


def _verify_one_draft(p: torch.Tensor, draft: int, num_draws: int, **params) -> list[list[int]]:
    logits = p.log().repeat(2 * num_draws, 1)
    rows = [row(f"r{i}", temperature=1.0, **params) for i in range(num_draws)]
    return Sampler(seed=3)(logits, SamplingBatch.of_requests(rows, [(draft,)] * num_draws)).token_ids


@pytest.mark.parametrize("seeded", [False, True])
def test_a_draft_is_accepted_with_its_probability_and_a_rejection_draws_from_the_rest(seeded: bool) -> None:
    """One position, p over 4 tokens, draft d = 1: P(accept) = p(1); given a rejection, p without 1; the
    first token emitted is a plain draw from p. Seeded requests (one seed each) follow the same law."""
    p = torch.tensor([0.1, 0.4, 0.2, 0.3])
    num_draws = 20000
    if seeded:
        token_ids = [_verify_one_draft(p, 1, 1, seed=seed)[0] for seed in range(num_draws // 4)]
        num_draws //= 4
    else:
        token_ids = _verify_one_draft(p, 1, num_draws)
    accepted = [t for t in token_ids if len(t) == 2]
    rejected = torch.tensor([t[0] for t in token_ids if len(t) == 1])
    assert all(t[0] == 1 for t in accepted) and 1 not in rejected.tolist()
    assert abs(len(accepted) / num_draws - p[1].item()) < 4 * math.sqrt(0.24 / num_draws)
    rest = torch.cat([p[:1], p[2:]])
    observed = torch.bincount(rejected, minlength=4)[[0, 2, 3]].float()
    assert stats.chisquare(observed.numpy(), (rest / rest.sum() * len(rejected)).numpy()).pvalue > P_VALUE
    firsts = torch.bincount(torch.tensor([t[0] for t in token_ids]), minlength=4).float()
    assert stats.chisquare(firsts.numpy(), (p * num_draws).numpy()).pvalue > P_VALUE


def test_a_draft_of_probability_zero_is_always_rejected_and_never_emitted() -> None:
    p = torch.tensor([0.5, 0.5, 0.0, 0.0])
    token_ids = _verify_one_draft(p, 2, 200)
    assert all(len(t) == 1 and t[0] != 2 for t in token_ids)
