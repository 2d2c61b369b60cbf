"""Where a request's tokens end, as functions of the request alone: why it stops after a token, whether its next
token is sure to stop it, how many tokens it may run, and which prompt logprobs it still owes.

None of them touches the queues or the KV; ``new_prompt_logprobs`` only counts the prompt logprobs returned.
"""

from __future__ import annotations

from kvserve.outputs import FinishReason, TokenLogprobs
from kvserve.request import Request


def stop_reason(request: Request, token_id: int, max_model_len: int) -> tuple[FinishReason, int | None] | None:
    """Why the request stops after ``token_id`` (already appended), checked in order: EOS, a stop token,
    max_tokens, max_model_len; None if it goes on. The sampler masks EOS and stop tokens until ``min_tokens``
    outputs precede them, unless a constraint allows nothing else (then its end ends the request early); both
    stay in ``output_token_ids``, the frontend hides them from text."""
    params = request.sampling_params
    num_outputs = len(request.output_token_ids)
    if not params.ignore_eos and token_id in request.eos_token_ids:
        return FinishReason.STOP, None
    if token_id in params.stop_token_ids:
        return FinishReason.STOP, token_id
    if params.max_tokens is not None and num_outputs >= params.max_tokens:
        return FinishReason.LENGTH, None
    if request.num_prompt_tokens + num_outputs >= max_model_len:
        return FinishReason.LENGTH, None
    return None


def stops_after_next_token(request: Request, max_model_len: int) -> bool:
    """Whether the token the request samples next is sure to end it: its max_tokens, or max_model_len."""
    max_tokens = request.sampling_params.max_tokens
    num_outputs = request.num_output_tokens + 1
    return (max_tokens is not None and num_outputs >= max_tokens) \
        or request.num_prompt_tokens + num_outputs >= max_model_len


def num_tokens_left(request: Request, num_computed: int) -> int:
    """Tokens the request may run from ``num_computed`` on: all it has, except that an n > 1 request that
    has not forked yet stops before its last prompt token (each of its samples runs that token itself)."""
    end = request.num_tokens
    if request.will_fork and num_computed < request.num_prompt_tokens - 1:
        end = request.num_prompt_tokens - 1
    return end - num_computed


def wants_prompt_logprobs(request: Request, end: int) -> bool:
    """True if the chunk ending at ``end`` predicts prompt tokens whose logprobs were not returned yet.

        positions:  0   1   2  ...  P-2 | P-1 ...        (P = num_prompt_tokens)
        predicts:  t1  t2  t3  ...  tP-1|  (outputs)     position p predicts prompt token p + 1
    """
    if request.sampling_params.prompt_logprobs is None:
        return False
    return min(end, request.num_prompt_tokens - 1) > request.num_prompt_logprobs_sent


def new_prompt_logprobs(request: Request, start: int, entries: list[TokenLogprobs]) -> list[TokenLogprobs] | None:
    """The entries not returned before (a preemption recomputes some), counted as returned now;
    ``entries[j]`` predicts prompt token start+1+j."""
    num_sent = request.num_prompt_logprobs_sent
    request.num_prompt_logprobs_sent = max(num_sent, start + len(entries))
    return entries[max(0, num_sent - start) :] or None
