"""Prometheus metrics under vLLM's names, ``vllm:`` replaced by ``kvserve:``, so dashboards need only a prefix.

``ServerMetrics`` is the AsyncEngine's ``StepObserver``: it is called on the engine thread after each step
(or batch of commands) and owns the per-request timing it needs. Each instance has its own registry.

Times are seen from the frontend: TTFT runs from arrival to the end of the step that made the first token,
queue time from arrival to the engine's first scheduling of the request (`RequestOutput.first_scheduled_time`:
the step of its first prompt chunk; the start of the first token's step where that is missing; its end for a
request aborted before it was scheduled), observed with the prompt's length as each request finishes. A pooling
request (``PoolingRequestOutput``: embeddings, scores) generates nothing: it counts its prompt tokens, end-to-end and
queue time, and a success ("stop", or "abort" where it has no vector) as it finishes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from kvserve.outputs import FinishReason, PoolingRequestOutput, RequestOutput

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                          10.0, 20.0, 40.0, 80.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                    240.0, 480.0, 960.0, 1920.0, 7680.0)
CONTENT_TYPE = CONTENT_TYPE_LATEST


def _token_buckets(max_model_len: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_model_len, as vLLM builds them."""
    buckets, exponent = [], 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_model_len:
                return buckets
            buckets.append(value)
        exponent += 1


@dataclass
class _RequestTimes:
    arrival: float
    first_token: float | None = None
    last_token: float | None = None
    scheduled: float | None = None  # where queueing ended, once known
    num_generation_tokens: int = 0


# KV tiers (zero while offload is off): stats key -> help; bandwidth is rate(bytes) / rate(seconds)
_TIER_GAUGES = {
    "kv_offload_host_blocks": "KV blocks held in the host-memory tier.",
    "kv_offload_host_bytes": "Bytes of KV blocks held in the host-memory tier.",
    "kv_offload_disk_blocks": "KV block files in the disk tier.",
    "kv_offload_disk_bytes": "Bytes of KV block files in the disk tier.",
    "kv_offload_disk_writable": "1 while the disk tier writes blocks; 0 once an error of its whole directory (full, "
                                "read-only, gone) stopped the writes, or where there is no disk tier.",
}
# KV blocks held by kind of KV cache group (``kv/groups.py``): stats key -> help
_KV_GROUP_GAUGES = {
    "kv_blocks_windowed": "KV blocks held by sliding-window layers' groups (bounded by their windows).",
    "kv_blocks_full": "KV blocks held by full-attention layers' groups (or by every layer with one group).",
}
_TIER_COUNTERS = {
    "kv_offload_host_hit_tokens": "Tokens loaded back from the host-memory tier: prefix hits, and preempted "
                                  "requests' blocks as they resume (prefix_cache_hits counts first admissions).",
    "kv_offload_disk_hit_tokens": "Prefix tokens loaded back from the disk tier.",
    "kv_offload_offloaded_bytes": "Bytes of KV blocks copied from the device pool to the tiers.",
    "kv_offload_seconds": "Seconds spent copying KV blocks to the tiers.",
    "kv_offload_loaded_bytes": "Bytes of KV blocks copied from the tiers into the device pool.",
    "kv_reload_seconds": "Seconds spent copying KV blocks from the tiers into the device pool.",
    "kv_offload_corrupt_blocks": "KV block files skipped as corrupt, truncated or written for something else.",
    "kv_offload_disk_writes": "KV block files written to the disk tier.",
    "kv_offload_disk_write_errors": "KV block files that could not be written.",
    "kv_offload_disk_reads": "KV block files read from the disk tier into the host tier (prefix hits on disk).",
    "kv_offload_blocks_dropped": "KV blocks evicted from the device pool and not offloaded: every host row was "
                                 "held.",
    "kv_offload_disk_reads_skipped": "KV blocks on the disk tier recomputed instead: reading measured slower.",
    "kv_swap_seconds": "Seconds spent copying swapped-out requests' KV to the host tier and back.",
}


_SWAP_COUNTERS = {
    "num_swapped_out": "Requests whose KV was swapped out to the host tier (preempted, or forked with no block "
                       "free).",
    "num_swapped_in": "Swapped-out requests whose KV was loaded back to resume.",
    "num_blocks_swapped_out": "KV blocks copied to the host tier by swap-outs.",
    "num_blocks_swapped_in": "KV blocks loaded back by swap-ins.",
    "num_blocks_swap_in_found_on_device": "KV blocks of swap-ins that the prefix cache still held on the device.",
    "num_swap_fallbacks": "Swap-outs the host tier had no room for: preempted by recompute instead.",
}


class ServerMetrics:
    """The server's metrics; ``on_request_added`` / ``on_step`` are called only from the engine thread."""

    def __init__(self, model_name: str, stats: dict[str, Any], max_model_len: int) -> None:
        disable_created_metrics()  # no *_created series, as in vLLM: dashboards do not use them
        self.registry = CollectorRegistry()
        self._labels = {"model_name": model_name}
        self._requests: dict[str, _RequestTimes] = {}
        self._counts_waiting = False  # the waiting gauge reads the server's count (``count_waiting``), not stats
        self._make_gauges(stats)
        self._make_counters()
        # Engine counters mirrored as Prometheus counters: stats key -> (counter, value already counted).
        self._engine_counters = {
            "num_preemptions": self.num_preemptions,
            "num_steps_scheduled_ahead": self._counter(
                "num_steps_scheduled_ahead", "Decode steps scheduled and queued while the step before them ran "
                "(the overlapped scheduler, CUDA)."),
            "num_tokens_computed": self._counter(
                "num_tokens_computed", "Tokens run through the model: prompt tokens not found in the prefix cache, "
                "generated ones, speculative drafts, and those recomputed after a preemption."),
            "num_graph_replays": self._counter(
                "num_graph_replays", "Engine steps run through a captured step graph (CUDA or CPU); the rest ran "
                "eagerly."),
            **{key: self._counter(key, doc) for key, doc in _SWAP_COUNTERS.items()},
            "prefix_cache_queries": self.prefix_cache_queries,
            "prefix_cache_hits": self.prefix_cache_hits,
            "prefix_cache_evictions": self.prefix_cache_evictions,
            "spec_decode_num_draft_tokens": self.spec_decode_num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.spec_decode_num_accepted_tokens,
            "spec_decode_num_emitted_tokens": self.spec_decode_num_emitted_tokens,
            **{key: self._counter(key, doc) for key, doc in _TIER_COUNTERS.items()},
        }
        self._engine_counts_seen = {key: stats.get(key, 0) for key in self._engine_counters}
        self._make_histograms(max_model_len)
        self._lora_labels: dict[str, str] | None = None  # the LoRA info's present labels, once set
        self._lora_info = Gauge(
            "kvserve:lora_requests_info", "The LoRA adapters of the running and the waiting requests (names, "
            "comma-separated), and max_loras; the value: the Unix time they took these values.",
            ["running_lora_adapters", "waiting_lora_adapters", "max_lora"], registry=self.registry,
        ) if "running_lora_adapters" in stats else None  # LoRA on
        self._set_gauges(stats)  # e.g. the disk tier's blocks, found at start, before any request

    # Each metric is labelled with model_name, like vLLM's; these return the child for this model, so that
    # every metric is exported (at zero) from the start.

    def _gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(f"kvserve:{name}", doc, ["model_name"], registry=self.registry).labels(**self._labels)

    def _counter(self, name: str, doc: str) -> Counter:
        return Counter(f"kvserve:{name}", doc, ["model_name"], registry=self.registry).labels(**self._labels)

    def _histogram(self, name: str, doc: str, buckets: Any) -> Histogram:
        metric = Histogram(f"kvserve:{name}", doc, ["model_name"], buckets=buckets, registry=self.registry)
        return metric.labels(**self._labels)

    def _make_gauges(self, stats: dict[str, Any]) -> None:
        self.num_requests_running = self._gauge("num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = self._gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_cache_usage = self._gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (0 to 1).")
        self.prefix_cache_blocks = self._gauge("prefix_cache_blocks", "KV blocks the prefix cache names.")
        # gauges set straight from a stats key of the same name
        self.stat_gauges = {key: self._gauge(key, doc) for key, doc in {**_TIER_GAUGES, **_KV_GROUP_GAUGES}.items()}
        info = Gauge("kvserve:cache_config_info", "The KV cache configuration.",
                     ["model_name", "block_size", "num_gpu_blocks", "cache_dtype"], registry=self.registry)
        info.labels(
            block_size=str(stats["block_size"]), num_gpu_blocks=str(stats["num_blocks_total"]),
            cache_dtype=stats["kv_cache_dtype"], **self._labels
        ).set(1)

    def _make_counters(self) -> None:
        self.prompt_tokens = self._counter("prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = self._counter("generation_tokens", "Tokens generated.")
        self.prefix_cache_queries = self._counter("prefix_cache_queries",
                                                  "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = self._counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.prefix_cache_evictions = self._counter("prefix_cache_evictions",
                                                    "Cached KV blocks evicted to make room.")
        self.num_preemptions = self._counter("num_preemptions", "Requests preempted by the scheduler.")
        # speculative decoding (zero while it is off), vLLM's names
        self.spec_decode_num_draft_tokens = self._counter("spec_decode_num_draft_tokens", "Draft tokens proposed.")
        self.spec_decode_num_accepted_tokens = self._counter("spec_decode_num_accepted_tokens",
                                                             "Draft tokens accepted by verification.")
        self.spec_decode_num_emitted_tokens = self._counter(
            "spec_decode_num_emitted_tokens", "Tokens emitted by verified rows: accepted drafts + 1 each.")
        self.request_success = Counter("kvserve:request_success", "Finished requests, by finish reason.",
                                       ["model_name", "finished_reason"], registry=self.registry)
        for reason in FinishReason:
            self.request_success.labels(finished_reason=reason.value, **self._labels)

    def _make_histograms(self, max_model_len: int) -> None:
        self.ttft = self._histogram("time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS)
        self.itl = self._histogram(
            "inter_token_latency_seconds", "Time between two steps that gave a request tokens.", _TOKEN_LATENCY_BUCKETS
        )
        self.tpot = self._histogram(
            "time_per_output_token_seconds", "Mean time per output token after the first, per request.",
            _TOKEN_LATENCY_BUCKETS,
        )
        self.e2e = self._histogram("e2e_request_latency_seconds", "Arrival to finish.", _REQUEST_BUCKETS)
        self.queue_time = self._histogram("request_queue_time_seconds", "Time spent waiting.", _REQUEST_BUCKETS)
        token_buckets = _token_buckets(max_model_len)
        self.request_prompt_tokens = self._histogram("request_prompt_tokens", "Prompt tokens per request.",
                                                     token_buckets)
        self.request_generation_tokens = self._histogram(
            "request_generation_tokens", "Generated tokens per request (all samples).", token_buckets
        )

    # ---- StepObserver ----

    def on_request_added(self, request_id: str, arrival_time: float) -> None:
        self._requests[request_id] = _RequestTimes(arrival_time)

    def on_step(self, outputs: list[RequestOutput | PoolingRequestOutput], stats: dict[str, Any],
                step_start: float) -> None:
        now = time.monotonic()
        self._set_gauges(stats)
        for out in outputs:
            times = self._requests.get(out.request_id)
            if times is None:
                continue
            if isinstance(out, PoolingRequestOutput):
                self._observe_pooled(out, times, step_start, now)
            else:
                self._observe_request(out, times, step_start, now)

    def count_waiting(self, num_waiting: Callable[[], int]) -> None:
        """Read the waiting gauge from ``num_waiting`` whenever it is scraped, in place of the last step's stats
        (which know the scheduler's queue alone): the server's count, as ``--max-waiting`` admits by, includes the
        requests still being tokenized or added, so that a replica tokenizing a burst does not look idle to the
        router's balancing."""
        self._counts_waiting = True
        self.num_requests_waiting.set_function(num_waiting)

    def _set_gauges(self, stats: dict[str, Any]) -> None:
        self.num_requests_running.set(stats["num_running"])
        if not self._counts_waiting:
            self.num_requests_waiting.set(stats["num_waiting"])
        total = stats["num_blocks_total"]
        self.kv_cache_usage.set(stats["num_blocks_used"] / total if total else 0.0)
        self.prefix_cache_blocks.set(stats.get("prefix_cache_blocks", 0))
        for key, gauge in self.stat_gauges.items():
            gauge.set(stats.get(key, 0))
        if self._lora_info is not None:
            self._set_lora_info(stats)
        for key, counter in self._engine_counters.items():
            num_new = stats.get(key, 0) - self._engine_counts_seen[key]
            if num_new > 0:
                counter.inc(num_new)
            self._engine_counts_seen[key] = stats.get(key, 0)

    def _set_lora_info(self, stats: dict[str, Any]) -> None:
        """vLLM's ``lora_requests_info``, but one series: the labels changed, the old series goes and the new one
        is stamped with the time (unchanged, nothing is done: a step pays a comparison)."""
        labels = {"running_lora_adapters": stats["running_lora_adapters"],
                  "waiting_lora_adapters": stats["waiting_lora_adapters"], "max_lora": str(stats["max_loras"])}
        if labels == self._lora_labels:
            return
        if self._lora_labels is not None:
            self._lora_info.remove(*self._lora_labels.values())
        self._lora_info.labels(**labels).set_to_current_time()
        self._lora_labels = labels

    def _observe_request(self, out: RequestOutput, times: _RequestTimes, step_start: float, now: float) -> None:
        num_tokens = sum(len(sample.token_ids) for sample in out.outputs)
        num_new = num_tokens - times.num_generation_tokens
        if num_new > 0:
            if times.first_token is None:
                self._observe_first_token(out, times, step_start, now)
            else:
                self.itl.observe(now - times.last_token)
            self.generation_tokens.inc(num_new)
            times.num_generation_tokens = num_tokens
            times.last_token = now
        if out.finished:
            self._observe_finished(out, times, now)
            del self._requests[out.request_id]

    def _observe_first_token(self, out: RequestOutput, times: _RequestTimes, step_start: float, now: float) -> None:
        times.first_token = now
        self.ttft.observe(now - times.arrival)
        # queueing ends where the engine first scheduled the request: for n > 1 the first token comes a step
        # after the prefill (the samples fork then), which is no waiting
        times.scheduled = out.first_scheduled_time if out.first_scheduled_time is not None else step_start
        self.prompt_tokens.inc(len(out.prompt_token_ids))

    def _observe_finished(self, out: RequestOutput, times: _RequestTimes, now: float) -> None:
        """Every finished request's figures, an aborted one's too (its queue time and prompt as well, though it
        never had a first token: one that was never scheduled queued until it ended)."""
        reason = out.outputs[0].finish_reason if out.outputs else None
        self.request_success.labels(finished_reason=str(reason or "abort"), **self._labels).inc()
        self.e2e.observe(now - times.arrival)
        scheduled = times.scheduled if times.scheduled is not None else out.first_scheduled_time
        self.queue_time.observe(max(0.0, (scheduled if scheduled is not None else now) - times.arrival))
        self.request_prompt_tokens.observe(len(out.prompt_token_ids))
        self.request_generation_tokens.observe(times.num_generation_tokens)
        # per sample: with n > 1 the samples decode side by side, so the time is the longest sample's
        longest = max((len(sample.token_ids) for sample in out.outputs), default=0)
        if times.first_token is not None and longest > 1:
            self.tpot.observe((times.last_token - times.first_token) / (longest - 1))

    def _observe_pooled(self, out: PoolingRequestOutput, times: _RequestTimes, step_start: float, now: float) -> None:
        if not out.finished:
            return
        del self._requests[out.request_id]
        pooled = out.outputs is not None  # else aborted
        self.request_success.labels(finished_reason=(FinishReason.STOP if pooled else FinishReason.ABORT).value,
                                    **self._labels).inc()
        if pooled:  # its prompt was run through the model, as a generation's with its first token
            self.prompt_tokens.inc(len(out.prompt_token_ids))
        self.request_prompt_tokens.observe(len(out.prompt_token_ids))
        self.e2e.observe(now - times.arrival)
        scheduled = out.first_scheduled_time if out.first_scheduled_time is not None else step_start
        self.queue_time.observe(max(0.0, scheduled - times.arrival))

    def render(self) -> bytes:
        """The Prometheus text exposition of this registry."""
        return generate_latest(self.registry)
