"""Sampler: one step's logits [N, V] -> the tokens each request appends (and logprobs for those that ask):
one per row, or for a speculating request (one row per verified position) its accepted draft tokens and the
target's next token (``sample/rejection.py``).

    logits ─┬─> log_softmax (or a copy) ──────────────────────────────> logprobs (raw modes, the default)
            └─> logits processors, in order (in place, rows that need them)
                  ├─ greedy rows: argmax
                  ├─ random rows: / temperature -> min-p -> top-k, top-p (one sort) -> softmax -> draw
                  └─ the logits each row's draw took ─> log_softmax (or a copy) ─> logprobs (processed modes)

The engine's ``logprobs_mode`` (``config.LOGPROBS_MODES``, vLLM's) says which: the model's own logits (raw) or
those the draw took, after the processors and, for a random row, its temperature and truncation (processed, a
masked token's entry -inf), as log probabilities or as the logits themselves. A greedy row's processed values
are its logits after the processors alone (vLLM's, in a batch of greedy rows), whatever else shares its batch.

An all-greedy batch that no processor touches and that wants no logprobs is one max (the hot path). The draw
is an exponential race, ``argmax(p / q)`` with ``q ~ Exp(1)`` (equivalent to sampling from p): unseeded rows
share one batched draw from the sampler's own generator (seeded from the engine seed, never torch's global
one); seeded rows take counter-based noise keyed by their seed, sample index and the output position they draw
(``sample/counter_noise.py``, one batched computation for all of them), so their tokens depend only on those
and their logits: never on the other rows of the batch, on a preemption, on how many tokens they speculated,
or on whether their last token was still in flight when they were launched.
"""

from __future__ import annotations

from typing import Callable, Iterable, NamedTuple, Sequence

import torch

from kvserve.config import ModelConfig
from kvserve.device_copy import HostCopy, to_device
from kvserve.sample.argmax import first_max
from kvserve.sample.counter_noise import draw_seed, seeded_exponentials
from kvserve.sample.logits_processors import default_processors
from kvserve.sample.logprobs import gather_logprobs, launch_gather_logprobs, logprob_values
from kvserve.sample.metadata import SamplingBatch, SamplingRow
from kvserve.sample.processor import LogitsProcessor
from kvserve.sample.rejection import accept_draft
from kvserve.sample.truncation import apply_min_p, apply_top_k_top_p
from kvserve.outputs import TokenLogprobs

_SEED_MASK = 2**64 - 1


class SamplerOutput(NamedTuple):
    """One entry per request: the tokens it appends; ``logprobs`` is None when no row asked, else None for the
    requests that did not and one entry per appended token for the others."""

    token_ids: list[list[int]]
    logprobs: list[list[TokenLogprobs] | None] | None


class PendingSamples:
    """A launched sampling: ``token_ids``, one per row on the logits' device (not read back yet, so a next step
    can take its input ids from them there), and the call that reads them back (``Sampler.launch``)."""

    def __init__(self, token_ids: torch.Tensor, finish: Callable[[], SamplerOutput]) -> None:
        self.token_ids = token_ids
        self._finish = finish

    def __call__(self) -> SamplerOutput:
        return self._finish()


class Sampler:
    """Samples the tokens of each request. Owns the logits processors and every piece of per-request sampling
    state, keyed by each sample's engine-side id (``SamplingRow.generator_key``) and kept across steps until
    ``drop``: the processors' state.

    What the caller owes it, per key: nothing when it first appears (state is created from its first row: an
    n > 1 request forks its samples before its first draw, so each sample's state starts from its own row);
    ``drop`` once the request finished or was aborted. The sampler advances the processors'
    state past each token a request appends by itself."""

    def __init__(self, seed: int = 0, processors: Sequence[LogitsProcessor] | None = None,
                 logprobs_mode: str = ModelConfig.logprobs_mode) -> None:
        self.seed = int(seed)  # a numpy integer's & with the 64-bit mask below would overflow
        self.logprobs_mode = logprobs_mode
        self._processed_logprobs = logprobs_mode.startswith("processed_")
        self._processors = default_processors() if processors is None else list(processors)
        self._stateful = [p for p in self._processors if p.is_stateful]
        self._keys: set[str] = set()  # keys whose processor state exists (tracked only with stateful processors)
        self._unseeded: torch.Generator | None = None

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """Sample row i of ``logits`` (fp32 [N, V], modified in place) with ``batch.rows[i]``, then keep each
        speculating request's draft tokens up to the first the target disagrees with. Greedy (temperature 0)
        is the exact argmax of the processed logits. Logprobs are the values ``logprobs_mode`` names. The token
        ids' host copy is the call's only sync when no row wants logprobs."""
        return self.launch(logits, batch)()

    def launch(self, logits: torch.Tensor, batch: SamplingBatch) -> PendingSamples:
        """Queue the sampling of ``logits`` (as ``__call__`` samples them) on their device; the call returned
        reads the token ids back (the sync) and advances the processors' state past them. Between the two the
        host is free while the device works (an overlapped engine step processes the last step's outputs
        then). Call it before the next ``launch``."""
        if logits.shape[0] != len(batch):
            raise ValueError(f"logits have {logits.shape[0]} rows but the sampling batch has {len(batch)}")
        if self._stateful:
            self._add_new_keys(batch.rows)
        token_ids, values = self._sample(logits, batch)
        if self._stateful and batch.draft_token_ids is None:  # a token per row: state on the device takes it now
            for processor in self._stateful:
                processor.accept_launched(batch.rows, token_ids)
        host_token_ids = HostCopy(token_ids)  # read back without waiting for a step queued after this one
        token_logprobs = None if values is None else self._token_logprobs(values, token_ids, batch)

        def finish() -> SamplerOutput:
            logprobs = None if token_logprobs is None else token_logprobs()
            output = _per_request(host_token_ids.result().tolist(), logprobs, batch)
            if self._stateful:
                self._accept([batch.rows[i] for i in batch.first_rows], output.token_ids)
            return output

        return PendingSamples(token_ids, finish)

    def is_history_free(self, row: SamplingRow) -> bool:
        """Whether the row's next draw depends on nothing but its logits, params and position: no processor
        that reads its tokens (a grammar does; the bias, the min_tokens ban and the penalties, whose counts on
        the device take each token at launch, do not). Only such rows may be drawn before their last token is
        read back (the overlapped scheduler), their position counting the token in flight
        (``SamplingRow.position``: a seeded draw and the ban read it); a continued step with any other row
        draws after that token's update (``ModelRunner.draw_deferred``)."""
        return not any(p.reads_history(row) for p in self._processors)

    def prepare(self, batch: SamplingBatch) -> None:
        """Called before the forward pass whose logits ``batch`` will sample: new samples' state is created and
        the processors start the work that needs no logits (the grammar masks, on a worker thread), so that it
        overlaps the model."""
        if self._stateful:
            self._add_new_keys(batch.rows)
        for processor in self._processors:
            processor.prepare(batch.rows)

    def drop(self, keys: Iterable[str]) -> None:
        """Free all state of finished or aborted samples (engine-side ids; unknown ids are ignored)."""
        for key in keys:
            if key in self._keys:
                self._keys.remove(key)
                for processor in self._stateful:
                    processor.drop(key)

    @property
    def num_states(self) -> int:
        """Keys holding processor state."""
        return len(self._keys)

    def _add_new_keys(self, rows: Sequence[SamplingRow]) -> None:
        for row in rows:
            if row.generator_key not in self._keys:
                self._keys.add(row.generator_key)
                for processor in self._stateful:
                    processor.add(row.generator_key, row)

    def _accept(self, rows: Sequence[SamplingRow], token_ids: list[list[int]]) -> None:
        for row, appended in zip(rows, token_ids):
            for processor in self._stateful:
                processor.accept(row.generator_key, appended)

    def _sample(self, logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The target's token at each row, and the values of the logprob entries of the rows that ask for them
        (``batch.logprob_rows``; None if none does), on the logits' device."""
        needs_processing = self._needs_processing(batch.rows)
        if batch.is_all_greedy and not needs_processing and not batch.needs_logprobs:
            return first_max(logits), None
        wants_raw = batch.needs_logprobs and not self._processed_logprobs
        values = self._logprob_values(logits, batch) if wants_raw else None
        if needs_processing:
            for processor in self._processors:
                processor.apply(logits, batch.rows)
        token_ids = self._choose(logits, batch)
        if batch.needs_logprobs and self._processed_logprobs:  # ``logits`` hold what each row's draw took
            values = self._logprob_values(logits, batch)
        return token_ids, values

    def _needs_processing(self, rows: Sequence[SamplingRow]) -> bool:
        return any(any(map(p.is_needed, rows)) for p in self._processors)

    def _choose(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        if batch.is_all_greedy:
            return first_max(logits)
        random_rows = [i for i, r in enumerate(batch.rows) if not r.params.is_greedy]
        if len(random_rows) == len(batch):
            return self._draw(logits, batch.rows)
        token_ids = first_max(logits)
        index = to_device(random_rows, torch.long, logits.device)
        random_logits = logits[index]
        token_ids[index] = self._draw(random_logits, [batch.rows[i] for i in random_rows])
        if self._processed_logprobs and batch.needs_logprobs:  # the random rows' truncated logits, for logprobs
            logits[index] = random_logits
        return token_ids

    def _draw(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """Temperature, truncation and a draw for rows that all have temperature > 0 (``logits`` left as the draw
        took them: divided, and -inf where truncated)."""
        probs = self._probs(logits, rows)
        return first_max(probs.div_(self._exponentials(probs, rows)))

    @staticmethod
    def _probs(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """The distributions rows with temperature > 0 draw from: temperature, min-p, top-k, top-p, softmax (vLLM's
        order: min-p first, so that top-p measures its mass among the tokens min-p kept)."""
        params = [r.params for r in rows]
        logits.div_(_per_row([p.temperature for p in params], logits)[:, None])
        vocab_size = logits.shape[1]  # a larger top-k keeps every token, and would not fit an int64 if huge
        top_k = _per_row([min(p.top_k, vocab_size) for p in params], logits, torch.long) \
            if any(p.top_k for p in params) else None
        top_p = _per_row([p.top_p for p in params], logits) if any(p.top_p < 1.0 for p in params) else None
        if any(p.min_p > 0.0 for p in params):
            apply_min_p(logits, _per_row([p.min_p for p in params], logits))
        if top_k is not None or top_p is not None:
            apply_top_k_top_p(logits, top_k, top_p)
        return logits.softmax(dim=-1)

    def _exponentials(self, probs: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """Exp(1) noise per row: one batched draw for unseeded rows from the sampler's generator, and one
        batched computation of counter-based noise for the seeded rows, keyed by seed, sample index and
        output position."""
        seeded = [i for i, r in enumerate(rows) if r.params.seed is not None]
        keys = [draw_seed(rows[i].params.seed, rows[i].sample_index, rows[i].position)  # type: ignore[arg-type]
                for i in seeded]
        if len(seeded) == len(rows):
            return seeded_exponentials(keys, probs.shape[1], probs.device)
        # -log(U), U ~ uniform [0, 1): Exp(1), and 4-6x faster than torch's ``exponential_`` on CPU (25 ns a value
        # there, 19 ms a step for 16 rows of 49,152 tokens). Never 0 (U < 1), so a masked token's 0 / q is never
        # 0 / 0 (NaN, which argmax would pick); U = 0 gives q = inf, which that token loses.
        generator = self._unseeded_generator(probs.device)
        noise = torch.rand(probs.shape, generator=generator, device=probs.device).log_().neg_()
        if seeded:
            noise[to_device(seeded, torch.long, probs.device)] = seeded_exponentials(keys, probs.shape[1],
                                                                                     probs.device)
        return noise

    def _unseeded_generator(self, device: torch.device) -> torch.Generator:
        if self._unseeded is None:
            self._unseeded = torch.Generator(device=device)
            self._unseeded.manual_seed(self.seed & _SEED_MASK)
        return self._unseeded

    def _logprob_values(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """The logprob entries' values (``logprobs_mode``) of the rows that want them, in a tensor of their own:
        the sampler goes on to change ``logits`` in place."""
        wanted = batch.logprob_rows
        if len(wanted) == len(batch):
            rows = logits if self.logprobs_mode.endswith("_logprobs") else logits.clone()
        else:
            rows = logits[to_device(wanted, torch.long, logits.device)]
        return logprob_values(rows, self.logprobs_mode)

    def prompt_logprobs(self, logits: torch.Tensor, target_ids: torch.Tensor, num_top: int) -> list[TokenLogprobs]:
        """Logprobs of prompt tokens: row j of ``logits`` [L, V] predicts ``target_ids[j]``; each entry holds that
        token's value and rank, then the ``num_top`` most likely tokens. The model's own values in every mode
        (logits in the logits modes): no processor takes part in a prompt, as in vLLM."""
        if logits.shape[0] != target_ids.shape[0]:
            raise ValueError(f"{logits.shape[0]} logit rows for {target_ids.shape[0]} prompt tokens")
        values = logprob_values(logits.float(), self.logprobs_mode.replace("processed_", "raw_"))
        return gather_logprobs(values, target_ids, [num_top] * logits.shape[0])

    @staticmethod
    def _token_logprobs(
        values: torch.Tensor, token_ids: torch.Tensor, batch: SamplingBatch
    ) -> Callable[[], list[TokenLogprobs | None]]:
        """The logprob entries of the rows that want them (``values``: theirs alone), queued now; the call returned
        reads them back."""
        wanted = batch.logprob_rows
        index = to_device(wanted, torch.long, token_ids.device)
        num_top = [batch.rows[i].params.logprobs or 0 for i in wanted]
        entries = launch_gather_logprobs(values, token_ids[index], num_top)

        def by_row() -> list[TokenLogprobs | None]:
            out: list[TokenLogprobs | None] = [None] * len(batch)
            for i, entry in zip(wanted, entries()):
                out[i] = entry
            return out

        return by_row


def _per_request(
    token_ids: list[int], logprobs: list[TokenLogprobs | None] | None, batch: SamplingBatch
) -> SamplerOutput:
    """Per request, the rows' tokens (and logprobs) it appends: its one row's, or a speculating request's up
    to its first rejected draft token (a request's rows share its params: all want logprobs, or none)."""
    if batch.draft_token_ids is None:
        return SamplerOutput([[t] for t in token_ids],
                             None if logprobs is None else [None if e is None else [e] for e in logprobs])
    spans = [(start, start + len(accept_draft(draft, token_ids[start : start + len(draft) + 1])))
             for start, draft in zip(batch.first_rows, batch.draft_token_ids)]
    return SamplerOutput(
        [token_ids[start:end] for start, end in spans],
        None if logprobs is None else [
            None if logprobs[start] is None else logprobs[start:end] for start, end in spans  # type: ignore[misc]
        ],
    )


def _per_row(values: list, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    return to_device(values, dtype or like.dtype, like.device)
