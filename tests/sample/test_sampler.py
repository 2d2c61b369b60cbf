"""Sampler: exact greedy, truncation never picks excluded tokens, seeds independent of the batch, the engine
seed for unseeded rows, per-request state made and dropped, logprobs."""

from __future__ import annotations

import math
from typing import Sequence

import pytest
import torch

from kvserve.sample.counter_noise import draw_seed
from kvserve.sample.metadata import SamplingBatch, SamplingRow
from kvserve.sample.processor import LogitsProcessor
from kvserve.sample.sampler import Sampler, SamplerOutput
from kvserve.sampling_params import SamplingParams

VOCAB = 32


def row(key="r", index=0, prompt=(), outputs=(), eos=frozenset(), **params) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), index, key, list(prompt), list(outputs), frozenset(eos))


def batch(*rows: SamplingRow) -> SamplingBatch:
    return SamplingBatch(list(rows))


def tokens(out: SamplerOutput) -> list[int]:
    """The one token each request of a batch without drafts appends."""
    return [token for (token,) in out.token_ids]


def random_logits(num_rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_plain_greedy_is_argmax_and_skips_logprobs():
    logits = random_logits(5)
    out = Sampler()(logits.clone(), batch(*[row(temperature=0.0)] * 5))
    assert tokens(out) == logits.argmax(-1).tolist()
    assert out.logprobs is None


def test_greedy_with_penalties_is_argmax_of_the_hand_processed_logits():
    logits = torch.tensor([[3.0, 2.9, 1.0, -0.5, 2.0]])
    r = row(prompt=[0], outputs=[1], temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.5,
            logit_bias={3: 4.0})
    # bias: [3, 2.9, 1, 3.5, 2]; repetition over {0, 1}: [2, 1.933, 1, 3.5, 2]; frequency on 1: 1.433
    assert tokens(Sampler()(logits, batch(r))) == [3]


def test_mixed_batch_greedy_rows_stay_exact():
    logits = random_logits(6, seed=1)
    rows = [row(temperature=0.0) if i % 2 == 0 else row(temperature=1.0) for i in range(6)]
    out = Sampler()(logits.clone(), batch(*rows))
    assert tokens(out)[0::2] == logits.argmax(-1)[0::2].tolist()


def test_min_tokens_masks_eos_until_reached():
    logits = torch.zeros(2, VOCAB)
    logits[:, 7] = 10.0
    rows = [row(eos={7}, outputs=[1], min_tokens=2, temperature=0.0),
            row(eos={7}, outputs=[1, 2], min_tokens=2, temperature=0.0)]
    out = Sampler()(logits, batch(*rows))
    assert out.token_ids[0] != [7] and out.token_ids[1] == [7]


@pytest.mark.parametrize("params, allowed", [
    (dict(top_k=3), {29, 30, 31}),
    (dict(top_p=0.5), None),  # filled from the distribution below
    (dict(min_p=0.5), None),
    (dict(top_k=5, top_p=0.6, min_p=0.3), None),
])
def test_truncation_never_picks_excluded_tokens(params, allowed):
    base = torch.arange(VOCAB, dtype=torch.float32) * 0.3  # token 31 most likely
    probs = base.softmax(-1)
    if allowed is None:
        allowed = _allowed_by_hand(probs, params.get("top_k", 0), params.get("top_p", 1.0), params.get("min_p", 0.0))
    num_draws = 2000
    out = Sampler()(base.repeat(num_draws, 1), batch(*[row(**params)] * num_draws))
    picked = set(tokens(out))
    assert picked <= allowed
    assert len(picked) == len(allowed)  # every allowed token shows up in 2000 draws



@pytest.mark.parametrize("params", [dict(top_k=3), dict(top_p=0.5), dict(min_p=0.5)])
def test_truncation_holds_in_a_batch_with_rows_that_do_not_truncate(params) -> None:
    """The scheduler batches a request with top_k/top_p/min_p with plain ones: its rows stay truncated."""
    base = torch.arange(VOCAB, dtype=torch.float32) * 0.3
    allowed = _allowed_by_hand(base.softmax(-1), params.get("top_k", 0), params.get("top_p", 1.0),
                               params.get("min_p", 0.0))
    num_draws = 600
    rows = [row(**params) if i % 2 == 0 else row() for i in range(num_draws)]
    picked = tokens(Sampler()(base.repeat(num_draws, 1), batch(*rows)))
    assert set(picked[0::2]) == allowed
    assert not set(picked[1::2]) <= allowed  # the plain rows draw from the whole vocabulary


def test_min_p_of_one_draws_the_most_likely_token() -> None:
    logits = random_logits(1, seed=3)[0]
    assert logits.argmax() != 0
    num_draws = 200
    out = Sampler()(logits.repeat(num_draws, 1), batch(*[row(min_p=1.0)] * num_draws))
    assert set(tokens(out)) == {int(logits.argmax())}


@pytest.mark.parametrize("temperature, allowed", [(2.0, {0, 1, 2}), (1.0, {0, 1}), (0.5, {0})])
def test_min_p_applies_to_the_temperature_scaled_distribution(temperature: float, allowed: set[int]) -> None:
    """vLLM's order: temperature first, then min-p on the scaled probabilities."""
    logits = torch.tensor([0.0, -0.5, -1.0, -5.0])
    assert _allowed_by_hand((logits / temperature).softmax(-1), 0, 1.0, 0.5) == allowed
    num_draws = 2000
    out = Sampler()(logits.repeat(num_draws, 1), batch(*[row(temperature=temperature, min_p=0.5)] * num_draws))
    assert set(tokens(out)) == allowed

def _allowed_by_hand(probs: torch.Tensor, top_k: int, top_p: float, min_p: float) -> set[int]:
    """vLLM's order: min-p, then top-k (ties with the k-th kept), then top-p among what is left."""
    order = [t for t in probs.argsort(descending=True).tolist() if probs[t] >= min_p * probs.max()]
    if top_k:
        order = [t for t in order if probs[t] >= probs[order[min(top_k, len(order)) - 1]]]
    total = sum(probs[t].item() for t in order)
    kept, mass = [], 0.0
    for t in order:
        if mass >= top_p:
            break
        kept.append(t)
        mass += probs[t].item() / total
    return set(kept)


def test_min_p_comes_before_top_p_as_in_vllm() -> None:
    """top_p 0.8 among what min_p 0.2 kept (tokens 0-3 of these): 0, 1 and 2. Applied after top_p, as before,
    min_p kept token 3 too, drawn a tenth of the time, which vLLM never draws."""
    logits = torch.tensor([0.0, -0.5, -1.0, -1.5, -2.0, -2.5, -3.0, -4.0])
    num_draws = 4000
    out = Sampler()(logits.repeat(num_draws, 1), batch(*[row(top_p=0.8, min_p=0.2)] * num_draws))
    assert set(tokens(out)) == {0, 1, 2} == _allowed_by_hand(logits.softmax(-1), 0, 0.8, 0.2)


@pytest.mark.parametrize("vocab_size, num_tied", [(64, 3), (4096, 3), (4096, 2000)])
def test_top_k_keeps_every_token_tied_with_the_kth(vocab_size: int, num_tied: int) -> None:
    """As vLLM's: a tie at the k-th place is the model's, so all of it stays (the sort kept the tied tokens of
    lowest index only); 2,000 tied tokens as well as 3."""
    logits = torch.full((vocab_size,), -3.0)
    logits[10] = 2.0
    tied = torch.arange(20, 20 + num_tied)
    logits[tied] = 1.0
    num_draws = 3000
    out = Sampler()(logits.repeat(num_draws, 1), batch(*[row(top_k=2)] * num_draws))
    picked = torch.tensor(tokens(out))
    assert set(picked.tolist()) <= {10, *tied.tolist()}
    share = (picked == 10).float().mean().item()  # e^2 / (e^2 + num_tied e): 0.475 for three ties
    assert abs(share - math.e / (math.e + num_tied)) < 0.04
    if num_tied == 3:
        assert set(picked.tolist()) == {10, 20, 21, 22}


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_temperature_scales_the_distribution(temperature):
    probs = torch.tensor([0.5, 0.3, 0.2])
    expected = probs ** (1 / temperature)
    expected = expected / expected.sum()
    num_draws = 20000
    out = Sampler()(probs.log().repeat(num_draws, 1), batch(*[row(temperature=temperature)] * num_draws))
    freq = torch.bincount(torch.tensor(tokens(out)), minlength=3) / num_draws
    assert torch.allclose(freq, expected, atol=0.015)


@pytest.mark.parametrize("seeded", [False, True], ids=["generator", "counter-noise"])
def test_draws_follow_the_distribution(seeded: bool) -> None:
    """The exponential race with either noise: -log(U) from the sampler's generator, or a seed's counter-based
    noise (a seed a row here, so the rows' draws are independent)."""
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1])
    num_draws = 20000
    rows = [row(key=f"r{i}", seed=i if seeded else None) for i in range(num_draws)]
    out = Sampler()(probs.log().repeat(num_draws, 1), batch(*rows))
    freq = torch.bincount(torch.tensor(tokens(out)), minlength=4) / num_draws
    assert torch.allclose(freq, probs, atol=0.015)  # 4 standard errors at p = 0.5


def test_seeded_row_is_independent_of_its_batch():
    target = random_logits(1, seed=3)

    def draws(sampler: Sampler, others: int, position: int, seed_of_batch: int) -> list[int]:
        drawn: list[int] = []
        for step in range(4):
            logits = random_logits(others + 1, seed=seed_of_batch + step)
            logits[position] = target[0]
            rows = [row(key=f"o{i}") for i in range(others + 1)]
            rows[position] = row(key="seeded", seed=1234, outputs=drawn)
            drawn.append(tokens(sampler(logits, batch(*rows)))[position])
        return drawn

    alone = draws(Sampler(), 0, 0, 10)
    assert draws(Sampler(), 5, 3, 20) == alone
    assert draws(Sampler(), 2, 0, 30) == alone
    assert len(set(alone)) > 1  # each output position draws its own noise


def test_seeded_samples_of_one_request_differ_but_reproduce():
    logits = torch.zeros(4, VOCAB)  # uniform: different generators must disagree somewhere

    def run() -> list[list[int]]:
        sampler = Sampler()
        rows = [row(key=f"r#{i}", index=i, seed=7) for i in range(4)]
        return [tokens(sampler(logits.clone(), batch(*rows))) for _ in range(3)]

    first = run()
    assert first == run()
    assert len({tuple(step[i] for step in first) for i in range(4)}) == 4


def test_a_seeded_draw_depends_only_on_seed_sample_index_and_position():
    """Whatever the sampler, the key, or the draws before it: a retried or preempted request, or one whose
    earlier positions were drawn as verified draft rows, draws the same noise at each position."""
    logits = torch.zeros(1, VOCAB)

    def at(sampler: Sampler, position: int, key: str = "a", seed: int = 5, index: int = 0) -> int:
        return tokens(sampler(logits.clone(), batch(row(key=key, index=index, seed=seed, outputs=[0] * position))))[0]

    sampler = Sampler(seed=1)
    first = [at(sampler, p) for p in range(8)]
    assert [at(Sampler(seed=2), p, key="b") for p in reversed(range(8))] == first[::-1]
    assert len(set(first)) > 1
    assert [at(sampler, p, seed=6) for p in range(8)] != first
    assert [at(sampler, p, index=1) for p in range(8)] != first
    assert len({draw_seed(s, i, p) for s in range(4) for i in range(4) for p in range(4)}) == 64


def test_unseeded_draws_follow_the_sampler_seed_not_torchs_global_rng():
    logits = torch.zeros(8, VOCAB)  # uniform: any change of noise shows

    def draws(sampler_seed: int, global_seed: int) -> list[list[int]]:
        torch.manual_seed(global_seed)
        sampler = Sampler(sampler_seed)
        return [tokens(sampler(logits.clone(), batch(*[row(key=f"r{i}") for i in range(8)]))) for _ in range(3)]

    assert draws(3, 0) == draws(3, 99)
    assert draws(3, 0) != draws(4, 0)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    Sampler(3)(logits.clone(), batch(*[row()] * 8))
    assert torch.equal(torch.get_rng_state(), before)  # the global generator is never advanced


class BanAccepted(LogitsProcessor):
    """A stateful processor for these tests: bans every token its key has produced so far."""

    is_stateful = True

    def __init__(self) -> None:
        self.produced: dict[str, list[int]] = {}

    def is_needed(self, row: SamplingRow) -> bool:
        return True

    def apply(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
        for i, r in enumerate(rows):
            logits[i, self.produced[r.generator_key]] = -math.inf

    def add(self, key: str, row: SamplingRow) -> None:
        self.produced[key] = list(row.output_token_ids)

    def accept(self, key: str, token_ids: Sequence[int]) -> None:
        self.produced[key].extend(token_ids)

    def drop(self, key: str) -> None:
        self.produced.pop(key, None)

    @property
    def num_states(self) -> int:
        return len(self.produced)


def greedy_step(sampler: Sampler, *keys: str) -> list[int]:
    """One greedy step over uniform logits: each key takes its lowest token not yet banned."""
    rows = [row(key=k, temperature=0.0) for k in keys]
    return tokens(sampler(torch.zeros(len(keys), VOCAB), batch(*rows)))


def test_state_is_created_from_the_first_row_and_advanced_by_each_draw():
    processor = BanAccepted()
    sampler = Sampler(processors=[processor])
    sampler(torch.zeros(1, VOCAB), batch(row(key="a", outputs=[0, 2], temperature=0.0)))
    assert processor.produced == {"a": [0, 2, 1]}
    assert greedy_step(sampler, "a") == [3]


def test_drop_frees_every_piece_of_state():
    processor = BanAccepted()
    sampler = Sampler(processors=[processor])
    keys = ["r", "r#1", "r#2", "u"]
    rows = [row(key=k, index=i, seed=None if k == "u" else 5) for i, k in enumerate(keys)]
    for _ in range(3):
        sampler(torch.zeros(4, VOCAB), batch(*rows))
    assert (sampler.num_states, processor.num_states) == (4, 4)
    sampler.drop(["r#1", "unknown"])  # an abort of one sample leaves the others alone
    assert (sampler.num_states, processor.num_states) == (3, 3)
    assert len(processor.produced["r"]) == 3
    sampler.drop(["r", "r#2", "u"])
    assert (sampler.num_states, processor.num_states) == (0, 0)


def test_logprobs_are_of_the_raw_logits_with_ranks_and_top_k():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.0, 0.0, 5.0, 1.0]])
    raw = torch.log_softmax(logits, -1)
    rows = [row(temperature=0.0, logprobs=2, logit_bias={3: 10.0}), row(temperature=0.0)]
    out = Sampler()(logits.clone(), batch(*rows))
    assert tokens(out) == [3, 2]
    (entry,) = out.logprobs[0]
    assert entry.token_ids == [3, 1, 2]
    assert entry.ranks == [4, 1, 2]
    assert entry.logprobs == pytest.approx([raw[0, 3].item(), raw[0, 1].item(), raw[0, 2].item()])
    assert out.logprobs[1] is None


def _hand_processed(logits: torch.Tensor, r: SamplingRow) -> torch.Tensor:
    """One row's logits as its draw takes them, processed by hand: bias, repetition penalty over prompt and
    outputs, then (a random row) temperature and top-k."""
    p, out = r.params, logits.clone()
    for token, bias in (p.logit_bias or {}).items():
        out[token] += bias
    seen = sorted(set(r.prompt_token_ids) | set(r.output_token_ids))
    out[seen] = torch.where(out[seen] > 0, out[seen] / p.repetition_penalty, out[seen] * p.repetition_penalty)
    if p.is_greedy:
        return out
    out /= p.temperature
    if p.top_k:
        out[out < out.topk(p.top_k).values[-1]] = -float("inf")
    return out


@pytest.mark.parametrize("mode", ["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"])
def test_each_logprobs_mode_gives_the_values_it_names(mode: str) -> None:
    """Raw: the model's own logits; processed: those the draw took (a greedy row's after the processors, a random
    row's after its temperature and top-k too, its masked tokens -inf), as log probabilities or as logits. The
    row that wants none is left out; the others are batched with greedy and random rows beside them."""
    logits = random_logits(4, seed=11)
    rows = [row("g", prompt=[1, 2], outputs=[5], temperature=0.0, logit_bias={7: 2.5}, repetition_penalty=1.4,
                logprobs=3),
            row("r", prompt=[3], outputs=[4, 4], temperature=0.7, top_k=4, logit_bias={9: -1.0},
                repetition_penalty=1.2, seed=3, logprobs=5),
            row("n", temperature=0.5),
            row("p", temperature=1.3, seed=4, logprobs=2)]
    out = Sampler(logprobs_mode=mode)(logits.clone(), batch(*rows))
    assert out.logprobs[2] is None
    for i in (0, 1, 3):
        values = logits[i] if mode.startswith("raw") else _hand_processed(logits[i], rows[i])
        values = torch.log_softmax(values, -1) if mode.endswith("logprobs") else values
        (entry,) = out.logprobs[i]
        assert entry.token_ids[0] == tokens(out)[i]
        assert entry.token_ids[1:] == values.topk(rows[i].params.logprobs).indices.tolist()
        assert entry.logprobs == pytest.approx(values[entry.token_ids].tolist())
        assert entry.ranks[0] == int((values > values[tokens(out)[i]]).sum()) + 1
    if mode.startswith("processed"):  # top_k=4 of row "r" leaves its fifth most likely masked
        assert out.logprobs[1][0].logprobs[-1] == -float("inf")


def test_the_mode_changes_no_draw() -> None:
    """Every row wants logprobs (their values taken from the whole batch, not a copy of some rows): the draws
    are the same in every mode, and the raw logits those before the bias."""
    logits = random_logits(6, seed=12)
    rows = [row(f"k{i}", temperature=0.0 if i % 3 == 0 else 0.8, top_k=5, seed=i, logprobs=2, logit_bias={i: 3.0})
            for i in range(6)]
    outs = {mode: Sampler(logprobs_mode=mode)(logits.clone(), batch(*rows))
            for mode in ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")}
    assert len({tuple(tokens(out)) for out in outs.values()}) == 1
    for i, ((entry,),) in enumerate(zip(outs["raw_logits"].logprobs)):
        assert entry.logprobs == logits[i, entry.token_ids].tolist()


def test_logprobs_zero_returns_only_the_sampled_token():
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    out = Sampler()(logits.clone(), batch(row(temperature=0.0, logprobs=0)))
    (entry,) = out.logprobs[0]
    assert entry.token_ids == [1]
    assert entry.ranks == [1]
    expected = 3 - math.log(math.exp(1) + math.exp(2) + math.exp(3))
    assert entry.logprobs[0] == pytest.approx(expected)



def test_a_tied_tokens_rank_counts_only_the_strictly_more_likely() -> None:
    """Ranks are 1 + the number of strictly more likely tokens: tokens tied for the top all rank 1."""
    logits = torch.tensor([[1.0, 3.0, 3.0, 3.0, 0.0]] * 2)
    rows = [row(temperature=0.0, logprobs=2, logit_bias={2: 1.0}),  # drawn: token 2, tied with 1 and 3
            row(temperature=0.0, logprobs=0, logit_bias={0: 9.0})]
    out = Sampler()(logits.clone(), batch(*rows))
    assert tokens(out) == [2, 0]
    assert out.logprobs[0][0].ranks == [1, 1, 2]
    assert out.logprobs[1][0].ranks == [4]  # below the three tied tokens

@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_prompt_logprobs(mode: str):
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 0.0]])
    entries = Sampler(logprobs_mode=mode).prompt_logprobs(logits, torch.tensor([2, 0]), 1)
    raw = torch.log_softmax(logits, -1)
    assert entries[0].token_ids == [2, 1] and entries[0].ranks == [2, 1]
    assert entries[0].logprobs == pytest.approx([raw[0, 2].item(), raw[0, 1].item()])
    assert entries[1].token_ids == [0, 0] and entries[1].ranks == [1, 1]


@pytest.mark.parametrize("mode", ["raw_logits", "processed_logits"])
def test_prompt_logprobs_in_a_logits_mode_are_the_models_logits(mode: str):
    """No processor takes part in a prompt: both logits modes give the model's own logits, as vLLM's."""
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 0.5]])
    entries = Sampler(logprobs_mode=mode).prompt_logprobs(logits, torch.tensor([2, 0]), 2)
    assert [e.logprobs for e in entries] == [[1.0, 2.0, 1.0], [3.0, 3.0, 0.5]]
    assert [e.ranks for e in entries] == [[2, 1, 2], [1, 1, 2]]


def test_row_count_mismatch_is_rejected():
    with pytest.raises(ValueError, match="rows"):
        Sampler()(torch.zeros(2, VOCAB), batch(row()))


def test_values_at_the_edges_of_fp32_draw_what_their_limits_would() -> None:
    """A temperature under GREEDY_BELOW is greedy (dividing by it would overflow fp32 logits to inf); a top_p
    that is 0 in fp32 still keeps the most likely token; a top-k past int64 keeps every token."""
    logits = random_logits(4, seed=3)
    argmax = logits.argmax(-1).tolist()
    for params in (dict(temperature=1e-40), dict(top_p=1e-300), dict(top_p=1e-300, seed=5)):
        out = Sampler()(logits.clone(), batch(*[row(key=f"r{i}", **params) for i in range(4)]))
        assert tokens(out) == argmax, params
    huge_k = Sampler()(logits.clone(), batch(*[row(key=f"r{i}", top_k=2**70, seed=i) for i in range(4)]))
    assert all(0 <= t < VOCAB for t in tokens(huge_k))
    assert SamplingParams(temperature=SamplingParams.GREEDY_BELOW / 2).is_greedy
    assert not SamplingParams(temperature=SamplingParams.GREEDY_BELOW).is_greedy


def test_the_smallest_repetition_penalty_keeps_the_draw_finite() -> None:
    low, _ = SamplingParams.REPETITION_PENALTY_RANGE
    logits = random_logits(2, seed=4) * 30
    rows = [row(key=f"r{i}", prompt=list(range(VOCAB)), repetition_penalty=low, seed=i) for i in range(2)]
    out = Sampler()(logits.clone(), batch(*rows))
    assert tokens(out) == (logits * torch.where(logits > 0, 1 / low, low)).argmax(-1).tolist()
