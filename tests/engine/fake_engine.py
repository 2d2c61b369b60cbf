"""A model-free stand-in for LLMEngine with the same driving API, for AsyncEngine tests.

Tokens are bytes (vocabulary 256); each step gives every running request (at most ``max_num_seqs``) its next
token, ``(last + 1) % 256``, until ``max_tokens``; the n samples of a request are identical. One "KV block" is held per unfinished request.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterable

from kvserve.engine.input_processor import ProcessedPrompt
from kvserve.outputs import CompletionOutput, FinishReason, RequestOutput
from kvserve.sampling_params import SamplingParams


class ByteTokenizer:
    chat_template = None  # the fake renders chats itself
    all_special_tokens: list[str] = []

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return bytes(token_ids).decode("utf-8", errors="replace")  # bytes: no special token to skip


class FakeInputProcessor:
    """Tokenizes and checks prompts as the real one, on whichever thread calls it (the async engine's inputs
    thread): the threads it ran on are noted."""

    vocab_size = 256

    def __init__(self, tokenizer: ByteTokenizer, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.threads_seen: set[str] = set()

    def process(self, prompt: Any, params: SamplingParams) -> ProcessedPrompt:
        self.threads_seen.add(threading.current_thread().name)
        text = prompt if isinstance(prompt, str) else prompt.get("prompt")
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt["prompt_token_ids"])
        if not token_ids:
            raise ValueError("the prompt is empty")
        max_tokens = params.max_tokens or self.max_model_len - len(token_ids)
        if len(token_ids) + max_tokens > self.max_model_len:
            raise ValueError("prompt + max_tokens is over max_model_len")
        return ProcessedPrompt(text, token_ids, dataclasses.replace(params, max_tokens=max_tokens))

    def tokenize_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens)

    def chat_template(self, tools: list[dict[str, Any]] | None = None) -> None:
        return None  # the fake renders chats itself

    def constraint_compiled(self, spec: Any) -> bool:
        return False  # the fake compiles nothing: a test stands in for check_constraint

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None, add_special_tokens: bool = False,
                            continue_final_message: bool = False,
                            template_kwargs: dict[str, Any] | None = None) -> dict:
        # a template that closes no message: continuing the last one is rendering it as it is
        text = "".join(f"<{m['role']}>{m.get('content', '')}" for m in messages) + ("<assistant>" * add_generation_prompt)
        return {"prompt": text, "prompt_token_ids": self.tokenizer.encode(text)}


@dataclass
class _FakeRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    max_tokens: int
    n: int = 1  # n identical samples
    output_token_ids: list[int] = field(default_factory=list)

    def output(self, finish: FinishReason | None) -> RequestOutput:
        text = bytes(self.output_token_ids).decode("utf-8", "replace")
        samples = [CompletionOutput(i, text, list(self.output_token_ids), finish) for i in range(self.n)]
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, samples, finished=finish is not None)


class FakeEngine:
    NUM_BLOCKS = 64

    def __init__(self, max_num_seqs: int = 4, max_model_len: int = 64, step_seconds: float = 0.0) -> None:
        self.step_seconds = step_seconds
        self.tokenizer = ByteTokenizer()
        self.input_processor = FakeInputProcessor(self.tokenizer, max_model_len)
        self.max_model_len = max_model_len
        self.default_sampling_params = SamplingParams()
        self.supported_tasks: tuple[str, ...] = ("generate", "embed", "token_embed")  # LLMEngine's, by default
        self.max_num_seqs = max_num_seqs
        self.requests: dict[str, _FakeRequest] = {}
        self.priorities: dict[str, int] = {}  # each request's priority as added (the server passes the body's)
        self.num_steps = 0
        self.step_error: BaseException | None = None
        self.worker_failure: BaseException | None = None  # what check_workers raises, once set
        self.threads_seen: set[str] = set()
        self.num_kv_flushes = 0

    def add_request(self, request_id: str, prompt: Any, params: SamplingParams, priority: int = 0) -> None:
        self.add_processed(request_id, self.process(prompt, params), priority)

    def process(self, prompt: Any, params: SamplingParams) -> ProcessedPrompt:
        """The real engine's ``process``, for generation (the fake serves no pooling requests)."""
        return self.input_processor.process(prompt, params)

    def add_processed(self, request_id: str, processed: ProcessedPrompt, priority: int = 0,
                      lora_request: Any = None) -> None:
        self._note_thread()
        if lora_request is not None:
            raise ValueError("the fake engine serves no LoRA adapters")
        if request_id in self.requests:
            raise ValueError(f"duplicate request id {request_id}")
        self.priorities[request_id] = priority
        params = processed.params
        self.requests[request_id] = _FakeRequest(
            request_id, processed.prompt, processed.prompt_token_ids, params.max_tokens, params.n)

    def abort_request(self, request_ids: Iterable[str]) -> list[RequestOutput]:
        self._note_thread()
        aborted = [self.requests.pop(rid) for rid in list(request_ids) if rid in self.requests]
        return [r.output(FinishReason.ABORT) for r in aborted]

    def step(self) -> list[RequestOutput]:
        self._note_thread()
        self.num_steps += 1
        time.sleep(self.step_seconds)
        if self.step_error is not None:
            raise self.step_error
        outputs = []
        for request in list(self.requests.values())[: self.max_num_seqs]:
            last = (request.output_token_ids or request.prompt_token_ids)[-1]
            request.output_token_ids.append((last + 1) % 256)
            finish = FinishReason.LENGTH if len(request.output_token_ids) >= request.max_tokens else None
            if finish:
                del self.requests[request.request_id]
            outputs.append(request.output(finish))
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def stats(self) -> dict[str, Any]:
        num_running = min(len(self.requests), self.max_num_seqs)
        return {
            "block_size": 16,
            "num_blocks_total": self.NUM_BLOCKS,
            "num_blocks_used": len(self.requests),
            "num_blocks_free": self.NUM_BLOCKS - len(self.requests),
            "num_running": num_running,
            "num_waiting": len(self.requests) - num_running,
            "num_preemptions": 0,
            "kv_cache_dtype": "float32",
        }

    def close(self) -> None:
        pass

    def check_workers(self) -> None:
        if self.worker_failure is not None:
            raise self.worker_failure

    def flush_kv_offload(self, timeout: float | None = None) -> None:
        self.num_kv_flushes += 1

    def _note_thread(self) -> None:
        self.threads_seen.add(threading.current_thread().name)
