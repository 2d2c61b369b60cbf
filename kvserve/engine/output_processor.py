"""OutputProcessor: the frontend half of a step. Token ids in, user-facing RequestOutputs out.

A pooling request has no samples: its one output, once its prompt has run, holds the pooled hidden states
(``PoolingRequestOutput``).

Per sample it detokenizes incrementally, looks for stop strings across token boundaries, converts logprobs,
and records how the sample ended; per request it gathers the n samples into one RequestOutput.

Every RequestOutput is a fresh cumulative snapshot (text, token_ids, logprobs so far), and snapshots are
append-only: a sample's next snapshot extends its previous one and never takes text back. That is the delta
facility: a consumer keeps, per sample, how many characters and tokens it has sent, and the delta is
``text[num_chars:]``, ``token_ids[num_tokens:]`` and ``logprobs[num_tokens:]`` (``server/streaming.py``'s
``SampleCursor``). It also makes coalescing safe: skipping snapshots loses nothing. To keep text append-only,
an unfinished sample hides the end of its text while it could still be the start of a stop string.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence, TypeVar

from transformers import PreTrainedTokenizerBase

from kvserve.engine.detokenizer import IncrementalDetokenizer, TokenTextCache
from kvserve.engine.stop_strings import StopStringMatcher
from kvserve.list_prefix import ListPrefix
from kvserve.outputs import (
    CompletionOutput,
    FinishReason,
    Logprob,
    PoolingOutput,
    PoolingRequestOutput,
    PositionLogprobs,
    RequestOutput,
    TokenLogprobs,
)
from kvserve.request import sample_request_id
from kvserve.sampling_params import SamplingParams
from kvserve.sched.output import EngineOutput

T = TypeVar("T")


class ProcessedOutputs(NamedTuple):
    """One step's result: the requests that moved, and the samples a stop string ended, which the engine
    must finish (engine-side sample ids, with finish reason STOP)."""

    request_outputs: list[RequestOutput | PoolingRequestOutput]
    stopped_request_ids: list[str]


class OutputProcessor:
    """Owns the frontend state of every unfinished request. ``process`` is the per-step Python loop over
    the step's EngineOutputs (one per sample that moved)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.token_texts = TokenTextCache(tokenizer)
        self._requests: dict[str, _RequestState | _PoolingRequestState] = {}
        # engine-side sample id -> (request, index)
        self._samples: dict[str, tuple[_RequestState | _PoolingRequestState, int]] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        eos_token_ids: frozenset[int] | Sequence[int] = frozenset(),
        pooling: bool = False,
    ) -> None:
        """Track a request and its ``params.n`` samples (``pooling``: a pooling request, one output). An EOS
        (``eos_token_ids``) or stop token that ends a sample is kept in its token_ids but not in its text."""
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        stop_token_ids = frozenset(eos_token_ids).union(params.stop_token_ids)
        state = _PoolingRequestState(request_id, prompt_token_ids, params) if pooling else \
            _RequestState(request_id, prompt, prompt_token_ids, params, stop_token_ids, self.tokenizer)
        self._requests[request_id] = state
        for index in range(params.n):
            self._samples[sample_request_id(request_id, index)] = (state, index)

    def process(self, engine_outputs: list[EngineOutput], final_only: bool = False) -> ProcessedOutputs:
        """Apply one step's EngineOutputs; return a snapshot of each request that moved (in order of first
        appearance), or with ``final_only`` of each that finished, and the sample ids stopped by a stop
        string. Finished requests are forgotten; outputs for unknown (e.g. aborted) ids are ignored.

        An unfinished request's snapshot reads its token ids and logprobs through views (``ListPrefix``), so
        that snapshotting it at every step costs what the step added, not what the request has produced. A
        consumer that reads only final outputs (offline generation) asks for those alone: then the text of a
        sample without stop strings is not made before it finishes either, its tokens detokenized at once at
        the end (a fifth of the host's work in a 256-request step)."""
        moved: dict[str, _RequestState | _PoolingRequestState] = {}
        stopped: list[str] = []
        for engine_output in engine_outputs:
            located = self._samples.get(engine_output.request_id)
            if located is None:
                continue
            state, index = located
            if state.update(index, engine_output, self.token_texts, final_only):
                stopped.append(engine_output.request_id)
            moved[state.request_id] = state
        outputs = [state.snapshot() for state in moved.values() if state.is_finished or not final_only]
        for state in moved.values():
            if state.is_finished:
                self._forget(state)
        return ProcessedOutputs(outputs, stopped)

    def abort(self, request_id: str, first_scheduled_time: float | None = None
              ) -> RequestOutput | PoolingRequestOutput | None:
        """Finish every unfinished sample with ABORT and forget the request; its final snapshot, or None if the
        request is unknown or already finished. ``first_scheduled_time``: the scheduler's, where no token brought
        it yet (aborted before its first)."""
        state = self._requests.get(request_id)
        if state is None:
            return None
        if state.first_scheduled_time is None:
            state.first_scheduled_time = first_scheduled_time
        state.abort()
        self._forget(state)
        return state.snapshot()

    def sample_request_ids(self, request_id: str) -> list[str]:
        """The engine-side ids of a request's samples (the id alone if the request is not tracked)."""
        state = self._requests.get(request_id)
        if state is None:
            return [request_id]
        return [sample_request_id(request_id, i) for i in range(state.params.n)]

    def request_ids(self) -> list[str]:
        """The requests not finished yet."""
        return list(self._requests)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._requests)

    def _forget(self, state: _RequestState | _PoolingRequestState) -> None:
        self._requests.pop(state.request_id, None)
        for index in range(state.params.n):  # an interrupted add_request may have made none of them
            self._samples.pop(sample_request_id(state.request_id, index), None)


class _SampleState:
    """One sample's text, tokens and logprobs so far, and how it ended.

        text:  |<-------------- visible -------------->|<- held ->|
                                                         a possible stop-string start, hidden until it
                                                         completes (then cut) or cannot (then shown)
    """

    def __init__(
        self, index: int, params: SamplingParams, stop_token_ids: frozenset[int], detokenizer: IncrementalDetokenizer
    ) -> None:
        self.index = index
        self.params = params
        self.stop_token_ids = stop_token_ids
        self.detokenizer = detokenizer
        self.stop_matcher = StopStringMatcher(params.stop_strings) if params.stop_strings else None
        self.token_ids: list[int] = []
        self._undecoded: list[int] = []  # tokens whose text nobody reads before the sample ends (``update``)
        self.text = ""
        self.num_visible_chars = 0
        self.logprobs: list[PositionLogprobs] | None = [] if params.logprobs is not None else None
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    def update(self, output: EngineOutput, token_texts: TokenTextCache, final_only: bool = False) -> bool:
        """Take one EngineOutput; return True if a stop string ended the sample while the engine still runs it.
        Several new tokens (a speculating step's accepted run) are taken one at a time when there are stop
        strings, so that ``token_ids`` end at the token completing a stop string, as with one-token steps.
        ``final_only``: only the finished sample is read, so without stop strings its text waits until then."""
        if self.is_finished:
            return False
        if final_only and self.stop_matcher is None and not output.finished:
            self._take_tokens(output, token_texts)
            self._undecoded.extend(output.new_token_ids)
            return False
        if len(output.new_token_ids) > 1 and self.stop_matcher is not None:
            for one in _one_token_outputs(output):
                stopped_by_string = self._update(one, token_texts)
                if self.is_finished:
                    return stopped_by_string
            return False
        return self._update(output, token_texts)

    def _update(self, output: EngineOutput, token_texts: TokenTextCache) -> bool:
        self._take_tokens(output, token_texts)
        new_text = self._detokenize(self._text_token_ids(output))
        if output.finished:
            new_text += self.detokenizer.flush()
        self.text += new_text
        stopped_by_string = self._cut_at_stop_string(new_text)
        if output.finished and not stopped_by_string:
            self._finish(output.finish_reason, output.stop_reason)
        self._update_visible()
        return stopped_by_string and not output.finished

    def _take_tokens(self, output: EngineOutput, token_texts: TokenTextCache) -> None:
        self.token_ids.extend(output.new_token_ids)
        if self.logprobs is not None and output.logprobs:
            self.logprobs.extend(to_position_logprobs(entry, token_texts) for entry in output.logprobs)

    def _detokenize(self, token_ids: list[int]) -> str:
        """The text of ``token_ids`` and of the tokens held back before them."""
        if self._undecoded:
            token_ids, self._undecoded = self._undecoded + token_ids, []
        return self.detokenizer.update(token_ids)

    def abort(self) -> None:
        if not self.is_finished:
            self.text += self._detokenize([]) + self.detokenizer.flush()
            self._finish(FinishReason.ABORT, None)
            self._update_visible()

    def snapshot(self) -> CompletionOutput:
        held = _held(self.is_finished)
        return CompletionOutput(
            self.index, self.text[:self.num_visible_chars], held(self.token_ids),
            self.finish_reason, self.stop_reason, None if self.logprobs is None else held(self.logprobs),
        )

    def _text_token_ids(self, output: EngineOutput) -> list[int]:
        """The new tokens that become text: an EOS or stop token that ended the sample is not text (it stays
        in token_ids), unless ``include_stop_str_in_output``."""
        new = output.new_token_ids
        ended_by_token = output.finish_reason is FinishReason.STOP and bool(new) and new[-1] in self.stop_token_ids
        if ended_by_token and not self.params.include_stop_str_in_output:
            return new[:-1]
        return new

    def _cut_at_stop_string(self, new_text: str) -> bool:
        """Look for a stop string ending in the new text (from ``min_tokens + 1`` outputs on); if one is there,
        cut the text before it (after it with ``include_stop_str_in_output``) and finish."""
        if self.stop_matcher is None:
            return False
        found = self.stop_matcher.feed(new_text, report=len(self.token_ids) > self.params.min_tokens)
        if found is None:
            return False
        position, stop = found
        self.text = self.text[:position + len(stop) if self.params.include_stop_str_in_output else position]
        self._finish(FinishReason.STOP, stop)
        return True

    def _update_visible(self) -> None:
        held = 0 if self.is_finished or self.stop_matcher is None else self.stop_matcher.partial_length
        self.num_visible_chars = len(self.text) - held

    def _finish(self, reason: FinishReason | None, stop_reason: int | str | None) -> None:
        self.finish_reason = reason
        self.stop_reason = stop_reason


def _one_token_outputs(output: EngineOutput) -> list[EngineOutput]:
    """``output`` as one EngineOutput per new token; only the last one carries how the sample ended."""
    last = len(output.new_token_ids) - 1
    return [
        EngineOutput(
            output.request_id, [token_id],
            output.finish_reason if i == last else None,
            output.stop_reason if i == last else None,
            output.logprobs[i : i + 1] if output.logprobs else None,
            output.prompt_logprobs if i == 0 else None,
            output.num_cached_tokens,
            output.first_scheduled_time,
        )
        for i, token_id in enumerate(output.new_token_ids)
    ]


class _RequestState:
    """A request's n samples and its prompt logprobs (which only sample 0's outputs carry)."""

    def __init__(
        self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
        stop_token_ids: frozenset[int], tokenizer: PreTrainedTokenizerBase,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.samples = [
            _SampleState(
                i, params, stop_token_ids,
                IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens),
            )
            for i in range(params.n)
        ]
        # the first prompt token has no logprobs: nothing predicts it
        self.prompt_logprobs: list[PositionLogprobs | None] | None = (
            [None] if params.prompt_logprobs is not None else None
        )
        self.num_cached_tokens = 0
        self.first_scheduled_time: float | None = None

    @property
    def is_finished(self) -> bool:
        return all(s.is_finished for s in self.samples)

    def update(self, index: int, output: EngineOutput, token_texts: TokenTextCache, final_only: bool) -> bool:
        if index == 0:
            self.num_cached_tokens = output.num_cached_tokens
            self.first_scheduled_time = output.first_scheduled_time
            if self.prompt_logprobs is not None and output.prompt_logprobs:
                self.prompt_logprobs.extend(to_position_logprobs(e, token_texts) for e in output.prompt_logprobs)
        return self.samples[index].update(output, token_texts, final_only)

    def abort(self) -> None:
        for sample in self.samples:
            sample.abort()

    def snapshot(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[s.snapshot() for s in self.samples],
            finished=self.is_finished,
            prompt_logprobs=None if self.prompt_logprobs is None else _held(self.is_finished)(self.prompt_logprobs),
            num_cached_tokens=self.num_cached_tokens,
            first_scheduled_time=self.first_scheduled_time,
        )


class _PoolingRequestState:
    """A pooling request until its one output (``params``: ``POOLING_SAMPLING_PARAMS``, one sample)."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.output: EngineOutput | None = None
        self.first_scheduled_time: float | None = None
        self.is_finished = False

    def update(self, index: int, output: EngineOutput, token_texts: TokenTextCache, final_only: bool) -> bool:
        self.output = output
        self.first_scheduled_time = output.first_scheduled_time
        self.is_finished = output.finished
        return False  # no text: no stop string

    def abort(self) -> None:
        self.is_finished = True

    def snapshot(self) -> PoolingRequestOutput:
        pooled = None if self.output is None else self.output.pooled
        return PoolingRequestOutput(
            self.request_id, None if pooled is None else PoolingOutput(pooled), self.prompt_token_ids,
            self.is_finished, 0 if self.output is None else self.output.num_cached_tokens, self.first_scheduled_time)


def _held(finished: bool) -> Callable[[list[T]], Sequence[T]]:
    """How a snapshot holds one of its request's lists: a finished request's as a copy of its own (a list);
    an unfinished one's as a view, read to the list's present length, since the list is only appended to."""
    return list if finished else ListPrefix


def to_position_logprobs(entry: TokenLogprobs, token_texts: TokenTextCache) -> PositionLogprobs:
    """TokenLogprobs -> {token id: Logprob}, the chosen token first; if it is also among the top-k, its entry
    as the chosen token is kept."""
    position: PositionLogprobs = {}
    for token_id, logprob, rank in zip(entry.token_ids, entry.logprobs, entry.ranks):
        if token_id not in position:
            position[token_id] = Logprob(logprob, rank, token_texts(token_id))
    return position
