"""/metrics: every metric the issue names, under vLLM's names, and counters that move by exactly one request."""

from __future__ import annotations

import time

import httpx
import openai
import pytest
import torch

from kvserve.engine.stats_counters import COUNTER_STATS
from kvserve import LLM, SamplingParams
from kvserve.outputs import CompletionOutput, PoolingOutput, PoolingRequestOutput, RequestOutput
from kvserve.server.metrics import ServerMetrics
from tests.server.conftest import MODEL_NAME, ServerProcess

EXPECTED = [
    "kvserve:time_to_first_token_seconds_bucket",
    "kvserve:inter_token_latency_seconds_bucket",
    "kvserve:time_per_output_token_seconds_bucket",
    "kvserve:e2e_request_latency_seconds_bucket",
    "kvserve:request_queue_time_seconds_bucket",
    "kvserve:num_requests_running",
    "kvserve:num_requests_waiting",
    "kvserve:kv_cache_usage_perc",
    "kvserve:prefix_cache_queries_total",
    "kvserve:prefix_cache_hits_total",
    "kvserve:prompt_tokens_total",
    "kvserve:generation_tokens_total",
    "kvserve:num_preemptions_total",
    "kvserve:num_swapped_out_total",
    "kvserve:num_swapped_in_total",
    "kvserve:num_blocks_swapped_out_total",
    "kvserve:num_blocks_swapped_in_total",
    "kvserve:num_swap_fallbacks_total",
    "kvserve:num_graph_replays_total",
    "kvserve:num_tokens_computed_total",
    "kvserve:request_success_total",
    "kvserve:cache_config_info",
    "kvserve:prefix_cache_blocks",
    "kvserve:prefix_cache_evictions_total",
    "kvserve:spec_decode_num_draft_tokens_total",
    "kvserve:spec_decode_num_accepted_tokens_total",
    "kvserve:spec_decode_num_emitted_tokens_total",
]


def test_metrics_has_every_named_metric(server: ServerProcess) -> None:
    response = httpx.get(f"{server.url}/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    names = {line.split("{")[0] for line in response.text.splitlines() if not line.startswith("#")}
    assert set(EXPECTED) <= names, set(EXPECTED) - names
    assert f'model_name="{MODEL_NAME}"' in response.text


def test_counters_move_by_exactly_one_requests_tokens(server: ServerProcess, client: openai.OpenAI) -> None:
    names = ["kvserve:prompt_tokens_total", "kvserve:generation_tokens_total", "kvserve:prefix_cache_queries_total",
             "kvserve:e2e_request_latency_seconds_count", "kvserve:time_to_first_token_seconds_count"]
    before = {name: server.metric(name) for name in names}
    length_before = server.metric("kvserve:request_success_total", finished_reason="length")
    answer = client.completions.create(model=MODEL_NAME, prompt="Count my tokens", max_tokens=9, temperature=0,
                                       extra_body={"ignore_eos": True})
    moved = {name: server.metric(name) - before[name] for name in names}
    assert moved == {
        "kvserve:prompt_tokens_total": answer.usage.prompt_tokens,
        "kvserve:generation_tokens_total": 9,
        "kvserve:prefix_cache_queries_total": answer.usage.prompt_tokens,
        "kvserve:e2e_request_latency_seconds_count": 1,
        "kvserve:time_to_first_token_seconds_count": 1,
    }
    assert server.metric("kvserve:request_success_total", finished_reason="length") - length_before == 1
    assert server.metric("kvserve:num_requests_running") == 0


def test_a_repeated_prompt_hits_the_prefix_cache(server: ServerProcess, client: openai.OpenAI) -> None:
    prompt = "A long shared system prompt that many requests send before their question. " * 4
    before = {name: server.metric(name) for name in ["kvserve:prefix_cache_queries_total",
                                                     "kvserve:prefix_cache_hits_total"]}
    first = client.completions.create(model=MODEL_NAME, prompt=prompt + "One?", max_tokens=2, temperature=0)
    second = client.completions.create(model=MODEL_NAME, prompt=prompt + "Two?", max_tokens=2, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens_details.cached_tokens == 0 and cached >= 16
    assert server.metric("kvserve:prefix_cache_hits_total") - before["kvserve:prefix_cache_hits_total"] == cached
    queries = server.metric("kvserve:prefix_cache_queries_total") - before["kvserve:prefix_cache_queries_total"]
    assert queries == first.usage.prompt_tokens + second.usage.prompt_tokens
    assert server.metric("kvserve:prefix_cache_blocks") > 0


def test_swap_and_graph_counters_follow_the_engine_stats() -> None:
    stats = {"block_size": 4, "num_blocks_total": 8, "num_blocks_used": 0, "kv_cache_dtype": "float32",
             "num_running": 0, "num_waiting": 0}
    metrics = ServerMetrics("m", stats, 64)
    swaps = {"num_preemptions": 4, "num_swapped_out": 3, "num_swapped_in": 2, "num_blocks_swapped_out": 9,
             "num_blocks_swapped_in": 6, "num_swap_fallbacks": 1, "num_graph_replays": 11,
             "num_tokens_computed": 57}
    metrics.on_step([], {**stats, **swaps}, time.monotonic())
    for key, value in swaps.items():
        assert metrics.registry.get_sample_value(f"kvserve:{key}_total", {"model_name": "m"}) == value, key


def test_kv_block_gauges_follow_the_engine_stats() -> None:
    stats = {"block_size": 4, "num_blocks_total": 8, "num_blocks_used": 5, "kv_cache_dtype": "float32",
             "num_running": 1, "num_waiting": 0, "kv_blocks_windowed": 2, "kv_blocks_full": 3}
    metrics = ServerMetrics("m", stats, 64)
    metrics.on_step([], stats, time.monotonic())
    for key in ("kv_blocks_windowed", "kv_blocks_full"):
        assert metrics.registry.get_sample_value(f"kvserve:{key}", {"model_name": "m"}) == stats[key], key


def test_tier_byte_counters_put_their_unit_before_total() -> None:
    """Prometheus' convention: ``..._bytes_total``, the unit last before the suffix."""
    stats = {"block_size": 4, "num_blocks_total": 8, "num_blocks_used": 0, "kv_cache_dtype": "float32",
             "num_running": 0, "num_waiting": 0}
    metrics = ServerMetrics("m", {**stats, "kv_offload_offloaded_bytes": 0, "kv_offload_loaded_bytes": 0}, 64)
    moved = {"kv_offload_offloaded_bytes": 4096, "kv_offload_loaded_bytes": 512}
    metrics.on_step([], {**stats, **moved}, time.monotonic())
    for key, value in moved.items():
        assert metrics.registry.get_sample_value(f"kvserve:{key}_total", {"model_name": "m"}) == value, key


def test_the_disk_tier_shows_whether_it_still_writes_and_how_much_it_moved() -> None:
    stats = {"block_size": 4, "num_blocks_total": 8, "num_blocks_used": 0, "kv_cache_dtype": "float32",
             "num_running": 0, "num_waiting": 0, "kv_offload_disk_writable": True}
    metrics = ServerMetrics("m", stats, 64)
    assert metrics.registry.get_sample_value("kvserve:kv_offload_disk_writable", {"model_name": "m"}) == 1
    moved = {"kv_offload_disk_writable": False, "kv_offload_disk_writes": 3, "kv_offload_disk_reads": 2,
             "kv_offload_blocks_dropped": 1}
    metrics.on_step([], {**stats, **moved}, time.monotonic())
    assert metrics.registry.get_sample_value("kvserve:kv_offload_disk_writable", {"model_name": "m"}) == 0
    for key in ("kv_offload_disk_writes", "kv_offload_disk_reads", "kv_offload_blocks_dropped"):
        assert metrics.registry.get_sample_value(f"kvserve:{key}_total", {"model_name": "m"}) == moved[key], key


def test_queue_time_ends_where_the_engine_first_scheduled_the_request() -> None:
    """Not at the step of the first token, which for n > 1 comes a step after the prefill (the samples fork)."""
    stats = {"block_size": 4, "num_blocks_total": 8, "num_blocks_used": 0, "kv_cache_dtype": "float32",
             "num_running": 0, "num_waiting": 0}
    metrics = ServerMetrics("m", stats, 64)
    arrival = time.monotonic()
    metrics.on_request_added("r", arrival)
    samples = [CompletionOutput(i, "a", [5], None) for i in range(2)]
    metrics.on_step([RequestOutput("r", "p", [1, 2], samples, first_scheduled_time=arrival + 0.01)], stats,
                    step_start=arrival + 0.5)
    metrics.on_step([RequestOutput("r", "p", [1, 2], samples, finished=True, first_scheduled_time=arrival + 0.01)],
                    stats, step_start=arrival + 0.6)
    queued = metrics.registry.get_sample_value("kvserve:request_queue_time_seconds_sum", {"model_name": "m"})
    assert queued == pytest.approx(0.01)


def test_a_pooling_request_counts_its_prompt_and_finishes_as_a_generation_does() -> None:
    """An embedding's output holds a vector, no samples: it counts its prompt tokens, its latency, its queue time
    and its success; an aborted one its abort and no prompt tokens run."""
    stats = {"block_size": 4, "num_blocks_total": 8, "num_blocks_used": 0, "kv_cache_dtype": "float32",
             "num_running": 0, "num_waiting": 0}
    metrics = ServerMetrics("m", stats, 64)
    arrival = time.monotonic()
    for request_id in ("pooled", "aborted"):
        metrics.on_request_added(request_id, arrival)
    vector = PoolingOutput(torch.ones(4))
    metrics.on_step([PoolingRequestOutput("pooled", vector, [1, 2, 3], True, first_scheduled_time=arrival + 0.01),
                     PoolingRequestOutput("aborted", None, [4, 5], True)], stats, step_start=arrival + 0.5)

    def value(name: str, **labels: str) -> float:
        return metrics.registry.get_sample_value(f"kvserve:{name}", {"model_name": "m", **labels})

    assert value("prompt_tokens_total") == 3 and value("generation_tokens_total") == 0
    assert value("request_success_total", finished_reason="stop") == 1
    assert value("request_success_total", finished_reason="abort") == 1
    assert value("request_prompt_tokens_sum") == 5 and value("e2e_request_latency_seconds_count") == 2
    assert value("request_queue_time_seconds_sum") == pytest.approx(0.01 + 0.5)
    assert value("time_to_first_token_seconds_count") == 0


def test_a_request_aborted_before_its_first_token_counts_in_every_per_request_histogram(tiny_checkpoints) -> None:
    """Its prompt and queue time were observed at the first token only, so the histograms' counts parted; and one
    aborted during its prefill queued only until that began (the engine's abort carries when it was scheduled)."""
    llm = LLM(str(tiny_checkpoints["llama"]), dtype="float32", num_kv_blocks=64, block_size=4,
              max_num_batched_tokens=16)
    engine = llm.engine
    metrics = ServerMetrics("m", engine.stats(), engine.max_model_len)

    def value(name: str) -> float | None:
        return metrics.registry.get_sample_value(f"kvserve:{name}", {"model_name": "m"})

    arrival = time.monotonic()
    engine.add_request("prefilling", {"prompt_token_ids": list(range(3, 60))}, SamplingParams(max_tokens=4))
    metrics.on_request_added("prefilling", arrival)
    for _ in range(2):  # two chunks of its prompt, no token yet
        step_start = time.monotonic()
        metrics.on_step(engine.step(), engine.stats(), step_start)
    scheduled = engine.core.scheduler.requests["prefilling"].first_scheduled_time
    time.sleep(0.2)
    metrics.on_step(engine.abort_request(["prefilling"]), engine.stats(), time.monotonic())
    queued = value("request_queue_time_seconds_sum")
    assert queued == pytest.approx(scheduled - arrival, abs=1e-6)

    arrival = time.monotonic()
    engine.add_request("waiting", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=4))
    metrics.on_request_added("waiting", arrival)
    time.sleep(0.05)  # never scheduled: it queued until it ended
    metrics.on_step(engine.abort_request(["waiting"]), engine.stats(), time.monotonic())
    assert value("request_queue_time_seconds_sum") >= queued + 0.05

    for histogram in ("e2e_request_latency_seconds", "request_queue_time_seconds", "request_prompt_tokens",
                      "request_generation_tokens"):
        assert value(f"{histogram}_count") == 2, histogram
    assert value("request_prompt_tokens_sum") == 57 + 3 and value("request_generation_tokens_sum") == 0
    assert value("prompt_tokens_total") == 0  # counted at the first token, as vLLM does
    assert value("time_to_first_token_seconds_count") == 0


def test_every_engine_counter_the_server_mirrors_is_one_that_counts_since_start() -> None:
    stats = {"block_size": 4, "num_blocks_total": 8, "num_blocks_used": 0, "kv_cache_dtype": "float32",
             "num_running": 0, "num_waiting": 0}
    assert set(ServerMetrics("m", stats, 64)._engine_counters) <= COUNTER_STATS


def test_the_waiting_gauge_counts_as_admission_does_when_given_its_count() -> None:
    """A request still being tokenized counts as waiting for ``--max-waiting`` (the async engine's count): the gauge
    read 0 meanwhile, from the last step's queue, and the router balanced toward the busy replica."""
    stats = {"block_size": 4, "num_blocks_total": 8, "num_blocks_used": 0, "kv_cache_dtype": "float32",
             "num_running": 1, "num_waiting": 0}
    metrics = ServerMetrics("m", stats, 64)
    waiting = [3]
    metrics.count_waiting(lambda: waiting[0])
    metrics.on_step([], stats, time.monotonic())
    assert metrics.registry.get_sample_value("kvserve:num_requests_waiting", {"model_name": "m"}) == 3
    waiting[0] = 5  # read when scraped, not at the last step
    assert metrics.registry.get_sample_value("kvserve:num_requests_waiting", {"model_name": "m"}) == 5
