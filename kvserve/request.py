"""Request: the engine-side state of one sequence being generated.

Token counters, as everywhere in kvserve::

    |<------------------ num_tokens ------------------>|
    |<------ num_prompt_tokens ------>|<-- outputs -->|
    |<--- num_computed_tokens --->|                   (KV written for these)
    |<- num_cached ->|                                 (of those, found in the prefix cache)

The scheduler owns ``status``, ``num_computed_tokens`` and the block tables (through the KV manager); the
scheduler's ``update_from_output`` is the only writer of ``output_token_ids``.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from kvserve.kv.block_keys import CacheNamespace
from kvserve.outputs import FinishReason
from kvserve.pooling_params import PoolingParams
from kvserve.sampling_params import SamplingParams
from kvserve.token_ids import TokenIds


SAMPLE_ID_SEPARATOR = "#"  # reserved: a submitted request id never contains it, so sample ids never collide


def sample_request_id(request_id: str, index: int) -> str:
    """The engine-side id of sample ``index`` of a request with n > 1; sample 0 keeps the request's own id."""
    return request_id if index == 0 else f"{request_id}{SAMPLE_ID_SEPARATOR}{index}"


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # blocks freed; waits to resume: from its KV swapped to the host tier, or recomputing it
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.monotonic)
    sample_index: int = 0  # which of the n samples of its group this request is
    parent_id: str | None = None  # the request this one was forked from (n > 1)
    # its structured-output constraint compiled: held so that the compiler, which tracks compiled grammars weakly,
    # finds it when the request is scheduled even if its cache has let it go meanwhile (``sample/grammar.py``)
    grammar: object | None = None
    cache_salt: str | None = None  # shares cached KV blocks only with requests sent with the same salt
    lora_id: int = 0  # the LoRA adapter its tokens run with (``LoRARequest.lora_int_id``); 0: the base model
    lora_digest: str | None = None  # that adapter's content (``LoRAAdapter.digest``), which its KV differs by
    priority: int = 0  # scheduling_policy "priority": the lower, the sooner (ties go by arrival_time)
    # a pooling request (``PoolingParams``): it draws no token, and finishes once its prompt has run, with the
    # pooled hidden states; its ``sampling_params`` are ``POOLING_SAMPLING_PARAMS``
    pooling_params: PoolingParams | None = None

    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None  # time.monotonic() of its first admission: queueing ends there
    block_ids: list[int] = field(default_factory=list)  # KV cache group 0's block table (``kv/groups.py``)
    group_block_ids: list[list[int]] = field(default_factory=list)  # groups 1.., as long; [] with one group
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    num_prompt_logprobs_sent: int = 0  # prompt tokens 1..k had their logprobs returned (kept across preemption)
    has_forked: bool = False  # an n > 1 request has made its samples 1..n-1 (it forks once, before its last prompt token)

    @property
    def cache_namespace(self) -> CacheNamespace | None:
        """Whose cached KV blocks it may share: requests of the same cache_salt and LoRA adapter (None: those of
        neither)."""
        if self.cache_salt is None and self.lora_digest is None:
            return None
        return CacheNamespace(self.cache_salt, self.lora_digest)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def token_ids(self) -> TokenIds:
        """Prompt then outputs, as a read-only view: slicing it copies only the slice."""
        return TokenIds(self.prompt_token_ids, self.output_token_ids)

    @property
    def will_fork(self) -> bool:
        """True for an n > 1 request that has not yet made its other samples."""
        return self.sampling_params.n > 1 and self.parent_id is None and not self.has_forked

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def max_tokens(self) -> int:
        """The output budget; the engine fills ``sampling_params.max_tokens`` from max_model_len if None."""
        assert self.sampling_params.max_tokens is not None
        return self.sampling_params.max_tokens
