"""The load generator of ``kvserve bench serve``: streams requests to an OpenAI-compatible server and times
every chunk.

Each request asks for an exact number of tokens (``max_tokens`` = ``min_tokens``, ``ignore_eos``, greedy), so
that every server does the same work; a request that comes back with a different ``completion_tokens`` (some
servers cut silently at their context limit) counts as failed. Token counts come from the server's ``usage``.
Connections are not reused: llama.cpp's server sometimes closes a kept-alive connection after a stream, which
would show up as failures that are the client's doing.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import httpx

from kvserve.bench.workloads import Conversation, SampleRequest, Workload

REQUEST_TIMEOUT_S = 3600.0


@dataclass
class RequestResult:
    expected_output_len: int
    ok: bool = False
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, when the server gives it
    ttft: float | None = None  # seconds from sending to the first chunk with text
    itl: list[float] = field(default_factory=list)  # seconds between chunks with text
    e2e: float = 0.0
    turn: int | None = None  # multiturn: the turn's index in its conversation
    text: str = ""

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first."""
        if self.ttft is None or self.completion_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.completion_tokens - 1)


@dataclass(frozen=True)
class Target:
    base_url: str
    model: str
    api_key: str | None = None

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def exact_length_body(output_len: int) -> dict[str, Any]:
    """What makes every server generate exactly ``output_len`` tokens, greedily (vLLM's and llama.cpp's names)."""
    return {
        "max_tokens": output_len, "min_tokens": output_len, "ignore_eos": True, "temperature": 0,
        "stream": True, "stream_options": {"include_usage": True},
    }


async def stream_request(
    client: httpx.AsyncClient, target: Target, path: str, body: dict[str, Any], expected_output_len: int
) -> RequestResult:
    """POST one streaming request and time it; never raises for what the server or the network does."""
    result = RequestResult(expected_output_len)
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", target.base_url.rstrip("/") + path, json=body,
                                 headers=target.headers()) as response:
            if response.status_code != 200:
                raw = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {raw[:300]}"
                return result
            async for chunk in _sse_chunks(response):
                now = time.perf_counter()
                if "error" in chunk:
                    result.error = f"stream error: {json.dumps(chunk['error'])[:300]}"
                    return result
                text = _chunk_text(chunk)
                if text:
                    if result.ttft is None:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    result.text += text
                _take_usage(result, chunk.get("usage"))
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as e:
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.e2e = time.perf_counter() - start
    result.ok, result.error = _check_complete(result)
    return result


async def _sse_chunks(response: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


def _chunk_text(chunk: dict[str, Any]) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "delta" in choice:  # chat: the first chunk may carry only the role
        return choice["delta"].get("content") or ""
    return choice.get("text") or ""


def _take_usage(result: RequestResult, usage: dict[str, Any] | None) -> None:
    if not usage:
        return
    result.prompt_tokens = usage.get("prompt_tokens", 0)
    result.completion_tokens = usage.get("completion_tokens", 0)
    details = usage.get("prompt_tokens_details") or {}
    if "cached_tokens" in details:
        result.cached_tokens = details["cached_tokens"]


def _check_complete(result: RequestResult) -> tuple[bool, str | None]:
    if not result.completion_tokens:
        return False, "the server sent no usage: token counts unknown"
    if result.completion_tokens != result.expected_output_len:
        return False, f"got {result.completion_tokens} of {result.expected_output_len} tokens (cut short?)"
    return True, None


# ------------------------------------------------------------------------------------------------- load


@dataclass(frozen=True)
class LoadShape:
    request_rate: float = float("inf")  # Poisson arrivals per second; inf: all at once
    max_concurrency: int | None = None
    seed: int = 0


async def run_workload(target: Target, workload: Workload, shape: LoadShape, progress: Any = None
                       ) -> tuple[list[RequestResult], float]:
    """Run every request (or conversation) under the load shape; returns the results and the wall time."""
    limit = shape.max_concurrency or max(len(workload.requests), len(workload.conversations), 1)
    semaphore = asyncio.Semaphore(limit)
    limits = httpx.Limits(max_connections=limit + 4, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(REQUEST_TIMEOUT_S), limits=limits) as client:
        start = time.perf_counter()
        if workload.conversations:
            jobs = [_conversation(client, target, c, semaphore, progress) for c in workload.conversations]
        else:
            jobs = [_completion(client, target, r, semaphore, progress) for r in workload.requests]
        results = await asyncio.gather(*_arrivals(jobs, shape))
        duration = time.perf_counter() - start
    return [r for group in results for r in group], duration


async def _delayed(job: Any, delay: float) -> list[RequestResult]:
    await asyncio.sleep(delay)
    return await job


def _arrivals(jobs: list[Any], shape: LoadShape) -> list[Any]:
    """Start times with exponential gaps (a Poisson process) at ``request_rate``, seeded."""
    if shape.request_rate == float("inf"):
        return jobs
    rng = random.Random(shape.seed)
    delays, t = [], 0.0
    for _ in jobs:
        delays.append(t)
        t += rng.expovariate(shape.request_rate)
    return [_delayed(job, delay) for job, delay in zip(jobs, delays)]


async def _completion(client: httpx.AsyncClient, target: Target, request: SampleRequest,
                      semaphore: asyncio.Semaphore, progress: Any) -> list[RequestResult]:
    body = {"model": target.model, "prompt": request.prompt, **exact_length_body(request.output_len)}
    async with semaphore:
        result = await stream_request(client, target, "/v1/completions", body, request.output_len)
    if progress is not None:
        progress.update(1)
    return [result]


async def _conversation(client: httpx.AsyncClient, target: Target, conversation: Conversation,
                        semaphore: asyncio.Semaphore, progress: Any) -> list[RequestResult]:
    """Turns in order, each resending the whole history with the server's previous answers."""
    messages: list[dict[str, str]] = []
    results = []
    async with semaphore:
        for turn, user_text in enumerate(conversation.user_turns):
            messages.append({"role": "user", "content": user_text})
            body = {"model": target.model, "messages": messages, **exact_length_body(conversation.output_len)}
            result = await stream_request(client, target, "/v1/chat/completions", body, conversation.output_len)
            result.turn = turn
            results.append(result)
            if progress is not None:
                progress.update(1)
            if not result.ok:
                break
            messages.append({"role": "assistant", "content": result.text})
    return results


async def scrape_metrics(base_url: str) -> dict[str, float]:
    """Every unlabelled-or-labelled sample of the server's /metrics summed by name; {} if it has none."""
    try:
        async with httpx.AsyncClient(timeout=10) as client:
            response = await client.get(base_url.rstrip("/") + "/metrics")
    except httpx.HTTPError:
        return {}
    if response.status_code != 200:
        return {}
    samples: dict[str, float] = {}
    for line in response.text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_part, _, value = line.rpartition(" ")
        name = name_part.split("{")[0]
        try:
            samples[name] = samples.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return samples
