"""LLM: the offline, vLLM-shaped API over LLMEngine."""

from __future__ import annotations

import dataclasses
import itertools
import os
import signal
import threading
from collections.abc import Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Callable, Iterator, TypeVar, overload

import torch

from tqdm.auto import tqdm

from kvserve.config import DEFAULT_MODEL
from kvserve.engine.beam_search import BeamBatch, BeamSearchOutput, step_params
from kvserve.engine.gc_freeze import heap_frozen
from kvserve.engine.input_processor import ChatMessages, ProcessedPrompt, PromptInput
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.scoring import check_score_pairs, pair_scores
from kvserve.engine.profiler import TRACE_DIR_ENV, trace_dir_from_environment
from kvserve.engine_args import EngineArgs
from kvserve.lora_request import LoRARequest
from kvserve.outputs import (
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from kvserve.pooling_params import PoolingParams
from kvserve.sampling_params import BeamSearchParams, SamplingParams

PROGRESS_BAR_MIN_PROMPTS = 8
T = TypeVar("T")


class LLM:
    """Generate from a model offline: ``LLM().generate(["Hello"], SamplingParams(max_tokens=8))``."""

    def __init__(self, model: str = DEFAULT_MODEL, *, enable_sleep_mode: bool = False, **engine_options: Any) -> None:
        """``engine_options`` are ``EngineArgs``'s fields (``dtype``, ``max_num_seqs``, ``num_kv_blocks``, ...);
        an unknown one is a TypeError that names it, a bad value a ValueError that names it. vLLM's
        ``speculative_config={"method": "ngram", "num_speculative_tokens": K, ...}`` (or ``{"method": "draft",
        "model": PATH, ...}``) and ``pooler_config={"pooling_type": "MEAN", "normalize": False}`` are accepted too.
        ``enable_sleep_mode`` (vLLM's) lets ``sleep`` release the KV cache and the weights."""
        if not isinstance(enable_sleep_mode, bool):
            raise TypeError(f"enable_sleep_mode must be a bool, got {type(enable_sleep_mode).__name__}")
        self.enable_sleep_mode = enable_sleep_mode
        engine_options = EngineArgs.with_config_dicts(engine_options)
        config = EngineArgs(model=model, **engine_options).create_engine_config()
        self.engine = LLMEngine(config)
        self._request_ids = itertools.count()
        # one generate at a time: calls from two threads stepped each other's requests (wrong tokens, or errors)
        self._running = threading.Lock()
        self._pid = os.getpid()

    def __reduce__(self) -> Any:
        raise TypeError("an LLM cannot be pickled or sent to another process: make one in that process (with "
                        "multiprocessing's spawn start method)")

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop what the engine runs beside this process's step loop (tensor-parallel workers, the KV tiers' I/O
        threads); the LLM cannot generate afterwards. Idempotent; ``with LLM(...) as llm:`` calls it."""
        self.engine.close()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        *,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order.

        ``prompts``: text, ``{"prompt": text}`` or ``{"prompt_token_ids": [...]}`` (vLLM's TextPrompt and
        TokensPrompt), or a list of them; another key of such a dict is a ValueError naming it. ``sampling_params``
        is one SamplingParams for all prompts or a list with one per prompt (None: ``get_default_sampling_params``,
        the model's generation_config.json's). Every prompt is
        validated before any runs: a bad one raises ValueError and nothing is left queued. Calls from several
        threads run one after the other. ``use_tqdm``: a progress bar (for 8 prompts or more), or, as in vLLM, the
        tqdm-like class to make it with. ``lora_request``: the LoRA adapter every prompt runs with, or a list with
        one per prompt (None: the base model; needs ``enable_lora=True``), as vLLM's. ``priority``: one per prompt,
        as vLLM's (the lower, the sooner; needs ``scheduling_policy="priority"`` for any but 0).
        """
        prompts = _prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = _params_per_prompt(sampling_params, SamplingParams, len(prompts), "sampling_params")
        if priority is not None and (isinstance(priority, (str, bytes)) or not isinstance(priority, Sequence)):
            raise TypeError(f"priority must be a list with one int per prompt, got {type(priority).__name__}")
        priorities = [0] * len(prompts) if priority is None else list(priority)
        if len(priorities) != len(prompts):
            raise ValueError(f"priority has {len(priorities)} values for {len(prompts)} prompts: give one per prompt")
        adapters = _adapter_per_prompt(lora_request, len(prompts))
        self._check_process()
        with self._running:
            process = self.engine.input_processor.process
            request_ids = self._queue([process(p, sp, cap_max_tokens=True) for p, sp in zip(prompts, params)],
                                      priorities, adapters)
            bar = use_tqdm if callable(use_tqdm) else tqdm
            return self._run(request_ids, bool(use_tqdm) and len(request_ids) >= PROGRESS_BAR_MIN_PROMPTS, bar)

    def encode(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        pooling_task: str | None = None,
    ) -> list[PoolingRequestOutput]:
        """Run every prompt and return its hidden states, pooled (vLLM's): ``pooling_task`` "embed" one vector a
        prompt (the engine's ``pooling_type``), "token_embed" one a prompt token; or ``pooling_params``, one for all
        prompts or one each (the task theirs). ``prompts``, ``use_tqdm`` and ``lora_request`` as ``generate``'s;
        ``truncate_prompt_tokens``: keep each prompt's last k tokens. A prompt's KV stays in the prefix cache, as a
        generation's does: a later request that begins with it starts from it."""
        prompts = _prompt_list(prompts)
        if pooling_params is None:
            pooling_params = PoolingParams(task=pooling_task or "embed")
        params = _params_per_prompt(pooling_params, PoolingParams, len(prompts), "pooling_params")
        if pooling_task is not None and any(p.task != pooling_task for p in params):
            raise ValueError(f"pooling_task={pooling_task!r} but pooling_params ask for another task")
        if truncate_prompt_tokens is not None:
            params = [dataclasses.replace(p, truncate_prompt_tokens=truncate_prompt_tokens) for p in params]
        adapters = _adapter_per_prompt(lora_request, len(prompts))
        self._check_process()
        with self._running:
            request_ids = self._queue([self.engine.process(p, pp) for p, pp in zip(prompts, params)], None, adapters)
            bar = use_tqdm if callable(use_tqdm) else tqdm
            return self._run(request_ids, bool(use_tqdm) and len(request_ids) >= PROGRESS_BAR_MIN_PROMPTS, bar,
                             "encode")

    def embed(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (vLLM's): ``encode``'s "embed" task, each vector as a list of floats."""
        outputs = self.encode(prompts, pooling_params, truncate_prompt_tokens=truncate_prompt_tokens,
                              use_tqdm=use_tqdm, lora_request=lora_request, pooling_task="embed")
        return [EmbeddingRequestOutput(out.request_id, EmbeddingOutput(_pooled(out).tolist()), out.prompt_token_ids)
                for out in outputs]

    def score(
        self,
        data_1: PromptInput | Sequence[PromptInput],
        data_2: PromptInput | Sequence[PromptInput],
        /,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        pooling_params: PoolingParams | None = None,
        lora_request: LoRARequest | None = None,
    ) -> list[ScoringRequestOutput]:
        """How alike two texts are (vLLM's, for an embedding model): the cosine similarity of their embeddings, for
        each pair: one ``data_1`` against each of ``data_2``, or ``data_1[i]`` against ``data_2[i]``."""
        firsts, seconds = _prompt_list(data_1), _prompt_list(data_2)
        check_score_pairs(len(firsts), len(seconds))
        embeddings = self.encode([*firsts, *seconds], pooling_params, truncate_prompt_tokens=truncate_prompt_tokens,
                                 use_tqdm=use_tqdm, lora_request=lora_request, pooling_task="embed")
        left, right = embeddings[: len(firsts)], embeddings[len(firsts):]
        scores = pair_scores([_pooled(out) for out in left], [_pooled(out) for out in right])
        left = left * len(right) if len(left) == 1 else left
        return [ScoringRequestOutput(f"{first.request_id}_{second.request_id}", ScoringOutput(score),
                                     first.prompt_token_ids + second.prompt_token_ids)
                for first, second, score in zip(left, right, scores)]

    def beam_search(self, prompts: PromptInput | Sequence[PromptInput], params: BeamSearchParams,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """vLLM's beam search (``kvserve/engine/beam_search.py``): the best ``params.beam_width`` sequences of each
        prompt, in input order, best first. The prompts are ``generate``'s, all searched in one batch; every
        prompt is checked first (ValueError naming the field: ``max_tokens`` over the room ``max_model_len``
        leaves), and an exception meanwhile leaves no request queued. ``use_tqdm``: a bar over the steps."""
        prompts = _prompt_list(prompts)
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        self._check_process()
        with self._running:
            engine = self.engine
            process = engine.input_processor.process
            batch = BeamBatch([process(p, step_params(params)) for p in prompts], params, engine.eos_token_ids,
                              engine.max_model_len)
            with tqdm(total=params.max_tokens, desc="beam search", disable=not use_tqdm) as bar:
                while not batch.done:
                    processed = [process(p, batch.step_params) for p in batch.step_prompts()]
                    batch.advance(self._run(self._queue(processed), show_progress=False))
                    bar.update(1)
            return batch.outputs(engine.tokenizer)

    def _queue(self, processed: list[ProcessedPrompt], priorities: Sequence[int] | None = None,
               adapters: Sequence[LoRARequest | None] | None = None) -> list[str]:
        """Add the requests, all or none (e.g. one larger than the whole KV cache: nothing is left queued); their
        ids."""
        request_ids = [f"offline-{next(self._request_ids)}" for _ in processed]
        try:
            for rid, p, rank, adapter in zip(request_ids, processed, priorities or [0] * len(processed),
                                             adapters or [None] * len(processed)):
                self.engine.add_processed(rid, p, rank, adapter)
        except BaseException:
            self.engine.abort_request(request_ids)
            raise
        return request_ids

    @overload
    def chat(self, messages: ChatMessages, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool | Callable[..., Any] = True,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None, *,
             add_generation_prompt: bool = True,
             tools: Sequence[dict[str, Any]] | None = None, chat_template: str | None = None,
             continue_final_message: bool = False,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]: ...

    @overload  # apart, so that a type checker infers a conversation of messages in several shapes as one
    def chat(self, messages: Sequence[ChatMessages],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool | Callable[..., Any] = True,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None, *,
             add_generation_prompt: bool = True,
             tools: Sequence[dict[str, Any]] | None = None, chat_template: str | None = None,
             continue_final_message: bool = False,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]: ...

    def chat(
        self,
        messages: ChatMessages | Sequence[ChatMessages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {'role', 'content'} in OpenAI's shape: text parts,
        assistant ``tool_calls`` and ``tool`` results included) or a list of conversations. ``tools`` (OpenAI's
        ``{"type": "function", "function": {...}}``) go to the template as the server sends them; the replies are
        the model's text, in whatever format it writes calls. ``chat_template``: a Jinja template for this call in
        place of the engine's (as vLLM's ``LLM.chat`` takes one). ``continue_final_message`` (with
        ``add_generation_prompt=False``): the replies go on from the last message's text, left open (a prefill);
        ``chat_template_kwargs``: more variables for the template (Qwen3's ``enable_thinking``...), as vLLM's.
        ``lora_request``: ``generate``'s. The options after it are keywords only: vLLM's ``chat`` takes others in
        their places."""
        for name, flag in (("add_generation_prompt", add_generation_prompt),
                           ("continue_final_message", continue_final_message)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
        if tools is not None and (isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence)
                                  or not all(isinstance(tool, Mapping) for tool in tools)):
            raise TypeError("tools must be a list of tools in OpenAI's shape ({'type': 'function', 'function': "
                            f"{{...}}}}), got {repr(tools)[:80]}")
        if isinstance(messages, (str, bytes, bytearray)) or not isinstance(messages, Sequence):
            raise TypeError(f"messages must be a list of messages or of conversations, got {type(messages).__name__}")
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        if not conversations:
            raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
        processor = self.engine.input_processor
        prompts = [processor.apply_chat_template(conversation, add_generation_prompt, tools,
                                                 chat_template=chat_template,
                                                 continue_final_message=continue_final_message,
                                                 template_kwargs=chat_template_kwargs)
                   for conversation in conversations]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def stats(self) -> dict[str, Any]:
        """KV cache and scheduler state: block counts, KV dtype, peak usage and waste, preemptions."""
        return self.engine.stats()

    def list_loras(self) -> set[int]:
        """The ids of the LoRA adapters served: those generate's ``lora_request`` named (vLLM's engine's)."""
        return self.engine.list_loras()

    def remove_lora(self, lora_id: int) -> bool:
        """Unload LoRA adapter ``lora_id``, freeing its weights; False where none of that id is served (vLLM's
        engine's). The id is retired: a later ``lora_request`` with it is refused (give the adapter a new id)."""
        with self._running:  # between two generates: none of its requests is left
            if lora_id not in self.engine.list_loras():
                return False
            self.engine.remove_lora(lora_id)
            return True

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """Empty the prefix cache (vLLM's; ``LLMEngine.reset_prefix_cache``): between two generates no request
        holds a block, so it empties and returns True. ``reset_connector``: the KV tiers too."""
        with self._running:
            return self.engine.reset_prefix_cache(reset_running_requests, reset_connector)

    def start_profile(self, trace_dir: str | None = None) -> None:
        """Record ``torch.profiler`` traces of the engine's steps from now on (vLLM's), into ``trace_dir``, else
        vLLM's ``$VLLM_TORCH_PROFILER_DIR``; RuntimeError where neither names one, or a profile is recording
        already. ``stop_profile`` writes the trace."""
        trace_dir = trace_dir or trace_dir_from_environment()
        if trace_dir is None:
            raise RuntimeError(f"start_profile needs a directory for the trace: pass trace_dir, or set "
                               f"${TRACE_DIR_ENV}")
        with self._running:
            self.engine.start_profile(trace_dir)

    def stop_profile(self) -> str:
        """Stop recording and write the trace of the steps since ``start_profile``; returns its path (a gzipped
        Chrome trace). RuntimeError naming ``start_profile`` where none is recording."""
        with self._running:
            return self.engine.stop_profile()

    def sleep(self, level: int = 1) -> None:
        """Release the KV cache (level 1; its prefix cache with it) or the weights too (level 2) until ``wake_up``,
        as vLLM's sleep mode does (``LLMEngine.sleep``); ``generate`` meanwhile raises ``EngineAsleep``. Needs
        ``LLM(enable_sleep_mode=True)``."""
        if not self.enable_sleep_mode:
            raise ValueError("sleep mode is off: make the LLM with enable_sleep_mode=True")
        with self._running:
            self.engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back what ``sleep`` released and ``tags`` name ("weights", "kv_cache"; None: all), vLLM's."""
        with self._running:
            self.engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.engine.is_sleeping

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` and ``chat`` use without sampling params (vLLM's name): the model's
        generation_config.json sampling fields (``generation_config="auto"``), else SamplingParams' defaults."""
        return self.engine.default_sampling_params

    def _check_process(self) -> None:
        """RuntimeError in a child forked after the LLM was made: its OpenMP threads (torch's, the kernels') did
        not come with it, and its first parallel kernel would wait for them for ever."""
        if os.getpid() != self._pid:
            raise RuntimeError("this LLM was made in another process (a fork): make one in this process, or start "
                               "it with multiprocessing's spawn start method")

    def _run(self, request_ids: list[str], show_progress: bool, progress_bar: Callable[..., Any] = tqdm,
             desc: str = "generate") -> list[Any]:
        """Step until ``request_ids`` finish (``RequestOutput``s, or a pooling request's ``PoolingRequestOutput``);
        whatever is raised meanwhile (the caller's progress bar too) aborts those unfinished, so that none is left
        queued for the next call to run."""
        finished: dict[str, Any] = {}
        try:
            with progress_bar(total=len(request_ids), desc=desc, disable=not show_progress) as bar, \
                    heap_frozen(), _interrupts_between_steps() as interrupted:
                while self.engine.has_unfinished_requests():
                    for out in self.engine.step(final_only=True):
                        if out.finished:
                            finished[out.request_id] = out
                            bar.update(1)
                    if interrupted():
                        raise KeyboardInterrupt
        except BaseException:
            self.engine.abort_request(rid for rid in request_ids if rid not in finished)
            raise
        return [finished[rid] for rid in request_ids]


def _params_per_prompt(params: T | Sequence[T], kind: type[T], num_prompts: int, name: str) -> list[T]:
    """One params object for all prompts, or a list of them with one per prompt; TypeError or ValueError else."""
    if isinstance(params, kind):
        return [params] * num_prompts
    if not isinstance(params, Sequence) or not all(isinstance(p, kind) for p in params):
        raise TypeError(f"{name} must be a {kind.__name__} or a list of them, one per prompt")
    if len(params) != num_prompts:
        raise ValueError(f"got {len(params)} {name} for {num_prompts} prompts")
    return list(params)


def _pooled(output: PoolingRequestOutput) -> torch.Tensor:
    assert output.outputs is not None, "a finished pooling request has its states"
    return output.outputs.data


def _adapter_per_prompt(lora_request: LoRARequest | Sequence[LoRARequest | None] | None,
                        num_prompts: int) -> list[LoRARequest | None]:
    """One LoRA request (or None) for all prompts, or a list with one per prompt; TypeError or ValueError else."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * num_prompts
    if not isinstance(lora_request, Sequence) or \
            not all(r is None or isinstance(r, LoRARequest) for r in lora_request):
        raise TypeError("lora_request must be a LoRARequest or a list of them (None for the base model), one per "
                        f"prompt; got {type(lora_request).__name__}")
    if len(lora_request) != num_prompts:
        raise ValueError(f"got {len(lora_request)} lora_requests for {num_prompts} prompts: give one per prompt")
    return list(lora_request)


def _prompt_list(prompts: PromptInput | Sequence[PromptInput]) -> Sequence[PromptInput]:
    """One prompt or a list of them, as a list; TypeError for anything else."""
    if isinstance(prompts, (str, Mapping)):
        return [prompts]
    if isinstance(prompts, (bytes, bytearray)) or not isinstance(prompts, Sequence):  # bytes: no text
        raise TypeError("prompts must be a string, a dict with 'prompt_token_ids' or 'prompt', or a list of "
                        f"them; got {type(prompts).__name__}")
    return prompts


@contextmanager
def _interrupts_between_steps() -> Iterator[Callable[[], bool]]:
    """Ctrl-C lands between engine steps, never inside one: a step half done (a block taken but in no table, a
    request in two queues) left the engine broken for every later call. In the main thread, while Python's own
    handler is in place, SIGINT is only noted; the caller asks after each step whether it came. Elsewhere (another
    thread, a handler of the user's) signals are left as they are."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield lambda: False
        return
    received: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        yield lambda: bool(received)
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
