"""``kvserve bench serve``: drive an OpenAI-compatible server with a workload and time every streamed chunk.

Each request streams (``stream_options.include_usage``) and asks greedily for an exact number of tokens through
the backend's extras: kvserve's and vLLM's ``ignore_eos`` + ``min_tokens``, llama.cpp's ``ignore_eos`` +
``n_predict`` (``--backend openai`` sends none and checks no length). A request whose usage reports another
length failed: it did different work. Token counts come from the final chunk's ``usage``; for a server that
sends none, the output is the generated text re-tokenized with the benchmark's tokenizer (as vLLM's benchmark
counts it), and the report says so. ``--timeout`` bounds each request whole, a stream that never ends included.

Connections are not reused: llama.cpp's server sometimes closes a kept-alive connection after a stream, which
would show up as failures that are the client's doing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import httpx
import torch
from tqdm import tqdm
from transformers import PreTrainedTokenizerBase

from kvserve.bench.datasets import SampleRequest, add_dataset_arguments, build_dataset, check_workload_flags
from kvserve.bench.metrics import (RequestRecord, parse_goodput, parse_prometheus, record_dict, server_hit_rate,
                                   summarize)
from kvserve.bench.report import check_output_path, format_run, format_sweep, write_result_json
from kvserve.config import DEFAULT_MODEL
from kvserve.extras import require_matplotlib
from kvserve.model.loader import Checkpoint, load_checkpoint
from kvserve.model.sources import resolve_model

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
BACKENDS = ("kvserve", "vllm", "llamacpp", "openai")
NUM_WARMUP_TOKENS = 4
ERROR_TEXT_LIMIT = 300  # characters of a server's error body kept in the report
_SSE_LINE_END = re.compile(r"\r\n|\r|\n")


@dataclass(frozen=True)
class Target:
    """The server under test and how to talk to it."""

    base_url: str
    model: str
    count_tokens: Callable[[str], int]  # the tokens of a server's output, where it sends no usage
    endpoint: str = COMPLETIONS
    backend: str = "kvserve"
    api_key: str | None = None
    timeout_s: float = 3600.0

    def url(self, path: str) -> str:
        return self.base_url.rstrip("/") + path

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def request_body(self, request: SampleRequest, answers: list[str]) -> tuple[str, dict[str, Any]]:
        """The path and JSON body of ``request``; ``answers``: the server's answers to the earlier turns of its
        conversation. Multiturn requests go to the chat endpoint whatever ``endpoint`` says; on the chat endpoint, a
        request with messages of its own (grounded) sends them, not its prompt, which already holds the template."""
        body = {"model": self.model, **length_fields(self.backend, request.output_len)}
        if request.turn is not None:
            return CHAT, {**body, "messages": with_answers(request.messages or [], answers)}
        if self.endpoint == CHAT:
            return CHAT, {**body, "messages": request.messages or [{"role": "user", "content": request.prompt}]}
        return COMPLETIONS, {**body, "prompt": request.prompt}


def length_fields(backend: str, output_len: int) -> dict[str, Any]:
    """Streaming, greedy, and exactly ``output_len`` tokens, in the backend's own words."""
    fields: dict[str, Any] = {"max_tokens": output_len, "temperature": 0, "stream": True,
                              "stream_options": {"include_usage": True}}
    if backend in ("kvserve", "vllm"):
        fields.update(ignore_eos=True, min_tokens=output_len)
    elif backend == "llamacpp":
        fields.update(ignore_eos=True, n_predict=output_len)
    return fields


def with_answers(messages: list[dict[str, str]], answers: list[str]) -> list[dict[str, str]]:
    """The history with its scripted assistant turns replaced, in order, by the server's answers."""
    remaining = iter(answers)
    return [{**m, "content": next(remaining)} if m["role"] == "assistant" else m for m in messages]


# ---- one request -----------------------------------------------------------------------------------------


def take_chunk(record: RequestRecord, chunk: dict[str, Any], now: float) -> None:
    """Record one parsed SSE chunk that arrived at ``now``: its text and time, its usage, or its error.

    Every chunk with a choice times a token's arrival, its text empty or not, as vLLM's benchmark counts them: a
    server sends one for a token whose text it holds back (a character's first bytes). Not chat's role-only
    chunk, which kvserve sends before the first token."""
    if "error" in chunk:
        record.error = f"stream error: {json.dumps(chunk['error'])[:ERROR_TEXT_LIMIT]}"
        return
    choices = chunk.get("choices") or []
    if choices and not _is_role_only(choices[0]):
        record.chunk_times.append(now)
        record.text += _choice_text(choices[0])
    usage = chunk.get("usage")
    if usage:
        record.counted_from_usage = True
        record.prompt_tokens = usage.get("prompt_tokens", record.prompt_tokens)
        record.completion_tokens = usage.get("completion_tokens", 0)
        record.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")


def finish(record: RequestRecord, now: float, saw_done: bool, exact_length: bool,
           count_tokens: Callable[[str], int]) -> None:
    """Close the record of a stream that ended at ``now``: it succeeded if it reached [DONE] with the asked
    number of tokens, as the server's usage counts them. Without usage, ``count_tokens`` counts them in the text
    (a chunk may carry several), an estimate (a text need not tokenize back to the tokens that made it), so no
    request fails by it."""
    if record.error is not None:
        return
    if not saw_done:
        record.error = "the stream ended before [DONE] (connection closed)"
        return
    record.end = now
    # a chunk past the tokens the usage counts carried none: a peer's last one, its finish reason alone
    # (llama.cpp's ``"delta": {}``), not a token's arrival
    if record.counted_from_usage and len(record.chunk_times) > record.completion_tokens > 0:
        del record.chunk_times[record.completion_tokens:]
    if not record.counted_from_usage:
        record.completion_tokens = count_tokens(record.text)
    elif exact_length and record.completion_tokens != record.expected_output_len:
        record.error = f"got {record.completion_tokens} of {record.expected_output_len} tokens (cut short?)"


def _is_role_only(choice: dict[str, Any]) -> bool:
    delta = choice.get("delta")
    return (delta is not None and "role" in delta and not delta.get("content") and not delta.get("tool_calls")
            and choice.get("finish_reason") is None)


def _choice_text(choice: dict[str, Any]) -> str:
    if "delta" in choice:
        return (choice["delta"] or {}).get("content") or ""
    return choice.get("text") or ""


async def send(client: httpx.AsyncClient, target: Target, path: str, body: dict[str, Any],
               record: RequestRecord) -> None:
    """POST one streaming request and record it, all of it within ``target.timeout_s``; whatever the server or
    the network does ends up in ``record.error``, never in an exception."""
    record.start = time.perf_counter()
    try:
        async with asyncio.timeout(target.timeout_s):  # the whole request: a trickle of chunks must not outlast it
            saw_done = await _stream(client, target, path, body, record)
    except TimeoutError:
        record.error = f"timed out: no [DONE] within --timeout {target.timeout_s:g} s"
        return
    except httpx.HTTPError as e:
        record.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        return
    finish(record, time.perf_counter(), saw_done, target.backend != "openai", target.count_tokens)


async def _stream(client: httpx.AsyncClient, target: Target, path: str, body: dict[str, Any],
                  record: RequestRecord) -> bool:
    """Whether the stream reached [DONE]; an error status or an error chunk ends it in ``record.error``."""
    async with client.stream("POST", target.url(path), json=body, headers=target.headers()) as response:
        if response.status_code != 200:
            raw = (await response.aread()).decode(errors="replace")
            record.error = f"HTTP {response.status_code}: {raw[:ERROR_TEXT_LIMIT]}"
            return False
        async for data in _sse_data(response):
            if data == "[DONE]":
                return True
            _take_data(record, data, time.perf_counter())
            if record.error is not None:
                return False
    return False


def _take_data(record: RequestRecord, data: str, now: float) -> None:
    try:
        take_chunk(record, json.loads(data), now)
    except (ValueError, AttributeError, TypeError, KeyError, IndexError) as e:  # not JSON, or not a chunk's shape
        record.error = f"a malformed chunk ({type(e).__name__}: {e}): {data[:ERROR_TEXT_LIMIT]}"


async def _sse_data(response: httpx.Response) -> AsyncIterator[str]:
    """The data fields of an event stream, whose lines end at CR, LF or CRLF alone: not httpx's aiter_lines,
    which also ends them at U+0085, U+2028 and U+2029, characters a server's JSON may leave in a chunk's text."""
    pending = ""
    async for text in response.aiter_text():
        *lines, pending = _SSE_LINE_END.split(pending + text)
        for line in lines:
            if line.startswith("data:"):
                yield line[len("data:"):].strip()
    if pending.startswith("data:"):
        yield pending[len("data:"):].strip()


# ---- the load ------------------------------------------------------------------------------------------


def sessions(requests: list[SampleRequest]) -> list[list[SampleRequest]]:
    """The turns of one conversation (multiturn) form one session, run in order; any other request is a
    session of its own. Sessions keep the order of their first request."""
    ordered: list[list[SampleRequest]] = []
    conversations: dict[int | None, list[SampleRequest]] = {}
    for request in requests:
        if request.turn is None:
            ordered.append([request])
        elif request.group in conversations:
            conversations[request.group].append(request)
        else:
            conversations[request.group] = [request]
            ordered.append(conversations[request.group])
    return ordered


def arrival_delays(num_sessions: int, request_rate: float, seed: int) -> list[float]:
    """Start times in seconds: a Poisson process at ``request_rate`` (exponential gaps, seeded), or all at 0."""
    if request_rate == float("inf"):
        return [0.0] * num_sessions
    rng = random.Random(seed)
    delays, t = [], 0.0
    for _ in range(num_sessions):
        delays.append(t)
        t += rng.expovariate(request_rate)
    return delays


async def run_requests(target: Target, requests: list[SampleRequest], request_rate: float = float("inf"),
                       max_concurrency: int | None = None, seed: int = 0, desc: str = "bench serve"
                       ) -> tuple[list[RequestRecord], float]:
    """Send every request under the load shape; returns their records, session by session, and the wall time in
    seconds. Arrivals and ``max_concurrency`` count sessions: a conversation holds its slot for all its turns."""
    groups = sessions(requests)
    semaphore = asyncio.Semaphore(max_concurrency or max(len(groups), 1))
    delays = arrival_delays(len(groups), request_rate, seed)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    # no httpx timeout: it would bound each read, and ``send`` bounds each request whole
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        with tqdm(total=len(requests), desc=desc, unit="req", disable=None) as progress:
            start = time.perf_counter()
            done = await asyncio.gather(*(_run_session(client, target, group, semaphore, delay, progress)
                                          for group, delay in zip(groups, delays)))
            duration = time.perf_counter() - start
    return [record for group in done for record in group], duration


async def _run_session(client: httpx.AsyncClient, target: Target, session: list[SampleRequest],
                       semaphore: asyncio.Semaphore, delay: float, progress: tqdm) -> list[RequestRecord]:
    await asyncio.sleep(delay)
    records: list[RequestRecord] = []
    answers: list[str] = []
    async with semaphore:
        for request in session:
            record = RequestRecord(request.output_len, prompt_tokens=request.prompt_len, group=request.group,
                                   turn=request.turn)
            failed = next((r for r in records if not r.ok), None)
            if failed is not None:  # the next turn would resend an answer that never came
                record.error = f"not sent: turn {failed.turn} of its conversation failed"
            else:
                path, body = target.request_body(request, answers)
                await send(client, target, path, body, record)
                answers.append(record.text)
            records.append(record)
            progress.update(1)
    return records


async def scrape_metrics(target: Target) -> dict[str, float]:
    """The server's /metrics, summed over labels; {} when it has none."""
    try:
        async with httpx.AsyncClient(timeout=10) as client:
            response = await client.get(target.url("/metrics"), headers=target.headers())
    except httpx.HTTPError:
        return {}
    return parse_prometheus(response.text) if response.status_code == 200 else {}


async def server_context_len(target: Target) -> int | None:
    """The server's context limit: ``max_model_len`` of /v1/models (kvserve, vLLM), or llama.cpp's per-slot
    ``n_ctx`` from /props; None when neither says."""
    async with httpx.AsyncClient(timeout=10, headers=target.headers()) as client:
        for path, keys in (("/v1/models", ("data", 0, "max_model_len")),
                           ("/props", ("default_generation_settings", "n_ctx"))):
            try:
                response = await client.get(target.url(path))
                value: Any = response.json()
                for key in keys:
                    value = value[key]
            except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
                continue
            if isinstance(value, int):
                return value
    return None


# ---- the command ---------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (default: %(default)s)")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="the model name the server answers to")
    parser.add_argument("--tokenizer", default=None,
                        help="the model whose tokenizer builds the prompts, resolved as kvserve resolves a model "
                             "(default: --model)")
    parser.add_argument("--backend", choices=BACKENDS, default="kvserve",
                        help="which extras make output lengths exact: kvserve/vllm (ignore_eos, min_tokens), "
                             "llamacpp (ignore_eos, n_predict), openai (none, lengths unchecked; default: "
                             "%(default)s)")
    parser.add_argument("--endpoint", choices=(COMPLETIONS, CHAT), default=COMPLETIONS,
                        help="multiturn always uses the chat endpoint (default: %(default)s)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--label", default=None, help="this run's name in tables, plots and compare")
    parser.add_argument("--request-rate", default="inf",
                        help="Poisson arrivals per second (multiturn: conversations), or inf (all at once); a "
                             "comma-separated list sweeps, "
                             "each rate after the first with fresh prompts (seed + index) so that nothing an "
                             "earlier rate left in the server's cache helps it (default: %(default)s)")
    parser.add_argument("--max-concurrency", type=int, default=None,
                        help="requests in flight at most (default: no limit)")
    parser.add_argument("--warmup", "--num-warmups", dest="num_warmups", type=int, default=2,
                        help="short requests sent before timing (default: %(default)s)")
    parser.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                        help="SLOs for goodput, any of ttft, tpot, e2e in ms, e.g. ttft:500 tpot:100")
    parser.add_argument("--timeout", type=float, default=3600.0,
                        help="seconds before a request counts as failed (default: %(default)g)")
    parser.add_argument("--result-json", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None, metavar="DIR", help="write latency (and sweep) PNGs")
    add_dataset_arguments(parser)


def parse_request_rates(value: str) -> list[float]:
    """``"1,2,4,inf"`` -> [1.0, 2.0, 4.0, inf]."""
    try:
        rates = [float(item) for item in value.split(",")]
    except ValueError:
        raise ValueError(f"--request-rate takes numbers or inf, comma-separated, got {value!r}") from None
    if not all(rate > 0 for rate in rates):  # nan too
        raise ValueError(f"--request-rate must be positive, got {value!r}")
    return rates


def check_flags(args: argparse.Namespace) -> None:
    """Raise ValueError naming a flag the run would only trip over once requests are being sent, or once it is
    over (an output path)."""
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1 (leave it out for no limit), got {args.max_concurrency}")
    if args.num_warmups < 0:
        raise ValueError(f"--warmup must be >= 0, got {args.num_warmups}")
    if not args.timeout > 0:
        raise ValueError(f"--timeout must be a positive number of seconds, got {args.timeout}")
    check_workload_flags(args)
    if args.result_json is not None:
        check_output_path(args.result_json, "--result-json")
    if args.plot is not None:
        require_matplotlib("--plot")  # before the run, not after it
        check_output_path(args.plot, "--plot", directory=True)


def main(args: argparse.Namespace) -> int:
    """Run the workload at each request rate and report; 0 when every run completed at least one request (the
    failures are in the report), 1 otherwise."""
    slos = parse_goodput(args.goodput)
    rates = parse_request_rates(args.request_rate)
    check_flags(args)
    # the tokenizer and config only: no weight is read
    checkpoint = load_checkpoint(resolve_model(args.tokenizer or args.model), torch.float32, "dummy")
    target = Target(args.base_url, args.model, token_counter(checkpoint.tokenizer), args.endpoint, args.backend,
                    args.api_key, args.timeout)
    runs = asyncio.run(_measure(target, args, checkpoint, rates, slos))
    label = args.label or f"{args.backend} {args.dataset_name}"
    result = {"kind": "serve", "label": label, "runs": runs}
    if args.result_json:  # first: a reader of the report that has gone (a pager quit) loses no finished run
        write_result_json(args.result_json, result, args)
    for run in runs:
        print(format_run(run, f"{label} | rate {run['request_rate']} | concurrency "
                              f"{args.max_concurrency or 'unlimited'}"))
    if len(runs) > 1:
        print(format_sweep(runs))
    if args.plot:
        from kvserve.bench.plots import write_plots  # matplotlib only when asked for

        for path in write_plots(runs, args.plot, label):
            print(f"wrote {path}")
    return 0 if all(run["completed"] for run in runs) else 1


async def _measure(target: Target, args: argparse.Namespace, checkpoint: Checkpoint, rates: list[float],
                   slos: dict[str, float]) -> list[dict[str, Any]]:
    await warm_up(target, args.num_warmups)
    context_len = None
    if args.dataset_name == "long" and args.long_prompt_len is None:
        context_len = await server_context_len(target) or checkpoint.max_model_len
    runs = []
    for index, rate in enumerate(rates):
        seeded = argparse.Namespace(**{**vars(args), "seed": args.seed + index})
        requests = build_dataset(seeded, checkpoint.tokenizer, context_len, chat=target.endpoint == CHAT)
        runs.append(await measure_run(target, requests, rate, args.max_concurrency, seeded.seed, slos))
    return runs


async def measure_run(target: Target, requests: list[SampleRequest], request_rate: float,
                      max_concurrency: int | None, seed: int, slos: dict[str, float]) -> dict[str, Any]:
    """One timed run: its summary, the server's prefix-cache hit rate over it, and every request's figures."""
    before = await scrape_metrics(target)
    rate_label = "inf" if request_rate == float("inf") else request_rate
    records, duration = await run_requests(target, requests, request_rate, max_concurrency, seed,
                                           desc=f"bench serve (rate {rate_label})")
    after = await scrape_metrics(target)
    return {"request_rate": rate_label, "max_concurrency": max_concurrency, "num_requests": len(requests),
            **summarize(records, duration, slos), "prefix_cache_hit_rate": server_hit_rate(before, after),
            "requests": [record_dict(r) for r in records]}


def token_counter(tokenizer: PreTrainedTokenizerBase) -> Callable[[str], int]:
    """The tokens of a text by the benchmark's tokenizer, none added: how vLLM's benchmark counts the output of a
    server that sends no usage."""
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False))


async def warm_up(target: Target, num_warmups: int) -> None:
    """Short requests, untimed, with prompts of their own so that nothing they cache helps the run; raises
    ``RuntimeError`` if the server cannot answer them."""
    if num_warmups <= 0:
        return
    requests = [SampleRequest(f"Warm-up request {i}: say something.", 8, NUM_WARMUP_TOKENS)
                for i in range(num_warmups)]
    records, _ = await run_requests(target, requests, desc="warm-up")
    failed = [r.error for r in records if not r.ok]
    if failed:
        raise RuntimeError(f"warm-up failed against {target.base_url}: {failed[0]}")
